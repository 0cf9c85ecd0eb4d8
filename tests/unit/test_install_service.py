"""``memrec install-service`` (staged under --root) checked by ``systemd-analyze verify``, and
``memrec completion``'s scripts run by real bash and fish (zsh: syntax)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from memrec.base.errors import ExitCode
from memrec.commands import main

MEMREC = str(Path(sys.executable).parent / "memrec")


def verify(unit: Path, root: Path) -> subprocess.CompletedProcess:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("no systemd-analyze (Debian/Ubuntu: apt-get install systemd)")
    return subprocess.run([analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True,
                          cwd=root, timeout=60)


def test_install_service_stages_a_unit_systemd_accepts(tmp_path, capsys):
    if not os.path.exists(MEMREC):
        pytest.skip(f"no memrec console script beside {sys.executable} (pip install -e . first)")
    # WHEN the service is staged under a root
    assert main(["install-service", "--root", str(tmp_path), "--memrec", MEMREC]) == 0
    said = capsys.readouterr().out
    unit = tmp_path / "etc/systemd/system/memrec.service"
    assert f"wrote {unit}" in said
    text = unit.read_text()
    # THEN its ExecStart runs this memrec, as a notify service with a watchdog and a restart policy
    assert f"ExecStart={MEMREC} daemon" in text
    for line in ("Type=notify", "Restart=on-failure", "WatchdogSec=30", "StateDirectory=memrec",
                 "RuntimeDirectory=memrec", "Nice=-10", "--drop-capabilities", "--keep 20", "--socket-group memrec"):
        assert line in text
    assert (tmp_path / "etc/sysusers.d/memrec.conf").read_text().strip().endswith("g memrec -")
    for rel in ("usr/local/share/bash-completion/completions/memrec", "usr/local/share/zsh/site-functions/_memrec",
                "usr/local/share/fish/vendor_completions.d/memrec.fish"):
        assert (tmp_path / rel).stat().st_size > 100
    # AND systemd's own checker accepts it without a warning
    proc = verify(unit, tmp_path)
    assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stderr


def test_systemd_analyze_catches_a_broken_unit(tmp_path):
    """The check above can fail: an unknown directive and a missing binary are reported."""
    unit = tmp_path / "memrec.service"
    unit.write_text("[Service]\nType=notify\nExecStart=/nonexistent/memrec daemon\nNoSuchDirective=1\n")
    proc = verify(unit, tmp_path)
    assert proc.returncode != 0 or proc.stderr
    assert "NoSuchDirective" in proc.stderr or "nonexistent" in proc.stderr


def test_install_service_print_and_errors(tmp_path, capsys):
    assert main(["install-service", "--print", "--memrec", "/opt/memrec/bin/memrec"]) == 0
    assert "ExecStart=/opt/memrec/bin/memrec daemon" in capsys.readouterr().out
    assert main(["install-service", "--root", str(tmp_path), "--memrec", "relative/memrec"]) == ExitCode.USAGE
    assert main(["install-service", "--root", str(tmp_path), "--enable", "--memrec", MEMREC]) == ExitCode.USAGE
    blocked = tmp_path / "file"
    blocked.write_text("x")
    assert main(["install-service", "--root", str(blocked), "--memrec", MEMREC]) == ExitCode.CANT_CREATE
    assert capsys.readouterr().err.count("\n") == 3


# ------------------------------------------------------------------------------ completion


def script(shell: str, tmp_path: Path, capsys) -> Path:
    assert main(["completion", shell]) == 0
    path = tmp_path / f"memrec.{shell}"
    path.write_text(capsys.readouterr().out)
    return path


def bash_complete(path: Path, line: str) -> list[str]:
    words = line.split(" ")
    code = (
        f"source {path}\n"
        f"COMP_WORDS=({' '.join(repr(w) for w in words)}); COMP_CWORD={len(words) - 1}\n"
        "_memrec; printf '%s\\n' \"${COMPREPLY[@]}\"\n"
    )
    proc = subprocess.run(["bash", "--norc", "-c", code], capture_output=True, text=True, timeout=30, cwd=path.parent)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_bash_completion_completes_commands_options_choices_and_files(tmp_path, capsys):
    path = script("bash", tmp_path, capsys)
    (tmp_path / "run.mrec").write_text("")
    assert bash_complete(path, "memrec me") == ["merge"]
    assert {"report", "daemon", "install-service", "completion"} <= set(bash_complete(path, "memrec "))
    assert bash_complete(path, "memrec report --j") == ["--json"]
    assert "--metrics-addr" in bash_complete(path, "memrec daemon --met")
    assert bash_complete(path, "memrec completion ") == ["bash", "zsh", "fish"]
    assert bash_complete(path, "memrec report ru") == ["run.mrec"]
    assert bash_complete(path, "memrec -v rep") == ["report"]


def test_fish_completion_runs_in_fish(tmp_path, capsys):
    fish = shutil.which("fish")
    if fish is None:
        pytest.skip("no fish shell here (apt-get install fish)")
    path = script("fish", tmp_path, capsys)
    proc = subprocess.run([fish, "--no-config", "-c", f"source {path}; complete -C 'memrec me'; complete -C 'memrec report --j'"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    firsts = [line.split("\t")[0] for line in proc.stdout.splitlines()]
    assert "merge" in firsts and "--json" in firsts


def test_zsh_completion_parses(tmp_path, capsys):
    zsh = shutil.which("zsh")
    if zsh is None:
        pytest.skip("no zsh here (apt-get install zsh)")
    path = script("zsh", tmp_path, capsys)
    assert path.read_text().startswith("#compdef memrec")
    proc = subprocess.run([zsh, "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_the_units_command_line_is_one_memrec_daemon_accepts():
    """ExecStart's options parse (systemd-analyze checks the unit, not memrec's arguments)."""
    import shlex

    from memrec.commands.parser import get_argument_parser
    from tests.bpf.unit_runner import parse_unit

    unit = parse_unit(Path(__file__).resolve().parents[2] / "contrib/systemd/memrec.service")
    argv = shlex.split(unit["Service"]["ExecStart"][-1])
    args = get_argument_parser().parse_args(argv[1:])
    assert args.command == "daemon" and args.drop_capabilities and args.keep == 20
    assert args.metrics_addr == ("127.0.0.1", 9862) and args.rotate_size == 1 << 30
    assert args.output == "/var/lib/memrec/" and args.socket_group == "memrec"


#: Every argument of every command that takes a file, as a user types up to it (the word to
#: complete is empty: the file names of the folder are expected).
FILE_ARGUMENTS = [
    "memrec report ", "memrec dump ", "memrec diff ", "memrec diff a.mrec ", "memrec merge ", "memrec merge a.mrec ",
    "memrec merge -o ", "memrec export ", "memrec export a.mrec -o ", "memrec plot ", "memrec plot a.mrec -o ",
    "memrec plot a.mrec --diff ", "memrec tui ", "memrec tui a.mrec --diff ", "memrec tui --live ",
    "memrec record -o ", "memrec record --libcuda ", "memrec record --socket ", "memrec daemon -o ",
    "memrec daemon --socket ", "memrec daemon --libcuda ", "memrec daemon --probe-cache ", "memrec mark --socket ",
    "memrec doctor --libcuda ", "memrec doctor --probe-cache ", "memrec demo -o ", "memrec selftest --socket ",
    "memrec install-service --root ", "memrec install-service --memrec ",
]


@pytest.mark.parametrize("line", FILE_ARGUMENTS)
def test_bash_completes_file_names_wherever_a_file_goes(tmp_path, capsys, line):
    # GIVEN the bash completion, in a folder with one trace
    path = script("bash", tmp_path, capsys)
    (tmp_path / "run.mrec").write_text("")
    # WHEN TAB is pressed where a file goes  THEN the folder's files are offered
    assert "run.mrec" in bash_complete(path, line)


def test_every_argument_that_names_a_file_completes_as_one():
    # GIVEN every command's arguments  THEN each whose name says it is a file is completed as a path
    # (a new option named like these completes without anyone editing the scripts)
    import argparse

    from memrec.commands.completion import _is_path
    from memrec.commands.parser import get_argument_parser

    parser = get_argument_parser()
    (subs,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    named = ("trace", "output", "socket", "libcuda", "probe_cache", "diff", "root", "memrec", "a", "b", "live")
    missed = [f"{name} {a.dest}" for name, sub in subs.choices.items() for a in sub._actions
              if a.dest in named and a.nargs != 0 and not _is_path(a)]
    assert missed == []
