"""Every command in the README, run as written, on a fresh clone after the README's two set-up
commands, the way a new user meets them.

A fresh ``git clone`` of this checkout into a temporary folder runs ``./scripts/start`` (set-up,
then the demo: this host has no GPU, or has one and the daemon would run until stopped, so the
demo is what start runs here) and ``./scripts/test`` (its set-up, then pytest on one small file:
the whole suite is what runs this test). The apt packages and kernel headers of this host are
reused, as a second clone on one host would; pip installs into the clone's own ``.venv``. The
clone's ``memrec`` is then the one on PATH, through the link set-up makes (into a folder of the
test's own, ``MEMREC_BIN_DIR``, so the host's ``/usr/local/bin`` is left alone).

Then every command of the README's ``sh`` blocks, its ``$`` lines and its inline ``memrec ...``
commands with arguments runs in the clone as a user types it, with these differences, each
needed to run it here at all:

- ``sudo`` is left out (the tests run as root; the README says so for hosts without sudo);
- the daemon writes into the test's folder rather than ``/var/lib/memrec/``, and is stopped with
  SIGINT (the README's Ctrl-C); markers and the live view use its socket (``MEMREC_SOCKET``);
- the files a command reads are there: ``run.mrec`` is the trace the demo recorded (``record``
  makes its own of ``train.py`` first, which has no GPU to use here: it is checked, then the
  demo's is put back for the commands that read it); ``base.mrec``,
  ``other.mrec``, ``custom_ar.mrec`` and ``sgl.mrec`` are the SGLang examples; ``node0.mrec`` and
  ``node1.mrec`` are two hosts' traces; ``train.py`` and ``load.py`` are the user's programs;
- an alternative (``bash|zsh|fish``, ``parquet|csv``) runs each way; ``...`` is the daemon's ``-o``;
- a command this host cannot run is named in :data:`ELSEWHERE` with the test that runs it.

A README command that is in none of these lists fails the test: a new command is checked when
it is written.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

pytestmark = pytest.mark.network  # pip installs the clone's .venv from the package index

#: README commands that need what this host lacks, and where they are run instead.
ELSEWHERE = {
    "sudo memrec record -o sgl.mrec -- python -m sglang.launch_server --model-path M --tp 8":
        "SGLang on GPUs: tests/gpu/test_sglang_standin_stock.py records its stand-in",
    "sudo memrec install-service --enable":
        "changes the host's systemd: tests/bpf/test_systemd_service.py installs and runs the unit",
}
#: The set-up commands, which the fixture runs.
SET_UP = {"sudo ./scripts/start", "sudo ./scripts/test"}
#: Long-running commands, run by their own tests below.
LONG_RUNNING = {
    "sudo memrec daemon -o /var/lib/memrec/", "memrec daemon --metrics-addr 127.0.0.1:9862 ...",
    "memrec tui run.mrec", "memrec tui --live", "memrec tui examples/sglang-standin-ipc.mrec",
    "memrec tui examples/sglang-standin-base.mrec --diff examples/sglang-standin-ipc.mrec",
    "memrec mark load -- python load.py",
}


def readme_commands() -> list[str]:
    """Every command of the README: the ``sh`` blocks' lines (comments cut), the ``$`` lines,
    and the inline ``memrec ...`` commands that have arguments (a bare ``memrec doctor`` in a
    sentence names the command; the ``sh`` block runs it)."""
    text = README.read_text()
    out: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.splitlines():
            command = re.split(r"\s{2,}#|\s+#\s", line)[0].strip()
            if command:
                out.append(command)
    out += re.findall(r"^\$ (.+)$", text, re.M)
    for inline in re.findall(r"`((?:sudo )?memrec [^`]+)`", text):
        command = " ".join(inline.split())
        if len(command.removeprefix("sudo ").split()) > 2:
            out.append(command)
    return list(dict.fromkeys(out))


def expand(command: str) -> list[str]:
    """The runnable forms of a README command (see the module docstring)."""
    command = command.removeprefix("sudo ").replace("; sudo ", "; ")
    for alternatives in ("bash|zsh|fish", "parquet|csv"):
        if alternatives in command:
            return [f for a in alternatives.split("|") for f in expand(command.replace(alternatives, a))]
    return [command.replace(" -o DIR", f" -o tables-{command.split('--to ')[1].split()[0]}")
            if " -o DIR" in command else command]


def _can_run() -> str | None:
    if os.geteuid() != 0:
        return "the README's set-up runs as root"
    if shutil.which("apt-get") is None or shutil.which("git") is None:
        return "the README's set-up is for Debian/Ubuntu hosts with git"
    if shutil.which("tmux") is None:
        return "tmux runs the TUI here (scripts/setup installs it)"
    return None


@pytest.fixture(scope="module")
def clone(bpf_host, tmp_path_factory) -> dict:
    """A fresh clone after ``./scripts/start`` and ``./scripts/test``, with the files the README's
    commands read; returns its path, the environment a user's shell has there, and what start said."""
    reason = _can_run()
    if reason:
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("readme")
    repo = base / "memrec"
    done = subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    subprocess.run(["git", "-C", str(repo), "checkout", "-q", head], check=True, timeout=60)
    bin_dir = base / "bin"
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "MEMREC_SETUP_LOG", "MEMREC_APT_UPDATED", "MEMREC_SOCKET", "PYTHONPATH")}
    path = [p for p in env["PATH"].split(":") if "/.venv/" not in p]  # not this checkout's own memrec
    env.update(PATH=":".join([str(bin_dir), *path]), MEMREC_BIN_DIR=str(bin_dir), MEMREC_SOCKET=str(base / "memrec.sock"),
               COLUMNS="80")  # the README shows 80-column output
    # THE TWO SET-UP COMMANDS, as the README's quick start has them (root: no sudo)
    start = subprocess.run(["./scripts/start"], cwd=repo, env=env, capture_output=True, text=True, timeout=1500)
    assert start.returncode == 0, start.stderr[-3000:]
    test = subprocess.run(["./scripts/test", "tests/unit/test_units.py"], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=1500)
    assert test.returncode == 0, (test.stdout + test.stderr)[-3000:]
    assert re.search(r"^\d+ passed", test.stdout.splitlines()[-1]), test.stdout[-2000:]
    # The user's own files the README's commands name
    if shutil.which("python", path=env["PATH"]) is None:  # a Debian without python-is-python3
        (bin_dir / "python").symlink_to(shutil.which("python3"))
    (repo / "train.py").write_text("print('training')\n")
    (repo / "load.py").write_text("print('loading')\n")
    shutil.copy(repo / "demo.mrec", repo / "run.mrec")
    examples = repo / "examples"
    for name, example in (("base", "sglang-standin-base"), ("other", "sglang-standin-ipc"),
                          ("custom_ar", "sglang-standin-ipc"), ("sgl", "sglang-standin-ipc")):
        shutil.copy(examples / f"{example}.mrec", repo / f"{name}.mrec")
    from tests.unit.test_merge import S
    from tests.unit.test_merge import host_trace

    host_trace(repo / "node0.mrec", "node0", "boot-0", 100 * S, 0, [(1.0, 100, 0, 2**30)], esterror_us=500)
    host_trace(repo / "node1.mrec", "node1", "boot-1", 900 * S, 0, [(2.0, 100, 0, 2**29)], esterror_us=500)
    return {"repo": repo, "env": env, "base": base, "start": start}


def run(clone: dict, command: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=clone["repo"], env=clone["env"], capture_output=True,
                          text=True, timeout=timeout)


def test_every_readme_command_is_checked():
    # GIVEN the README's commands  THEN each is run here, by the set-up, or named with where it runs
    commands = readme_commands()
    assert len(commands) > 20
    unknown = [c for c in commands if c not in SET_UP | LONG_RUNNING | set(ELSEWHERE) and not quick(c)]
    assert unknown == []


def quick(command: str) -> bool:
    """A command that runs to its end at once (the rest of the README's)."""
    return command not in SET_UP | LONG_RUNNING | set(ELSEWHERE) and (
        command.startswith(("memrec ", "sudo memrec ")) or command.startswith("memrec report examples/"))


def test_start_puts_memrec_on_path_and_its_next_step_works(clone):
    # THEN start said where memrec is on PATH, and the demo's next step names a file that is here
    start = clone["start"]
    assert f"memrec on PATH: {clone['base'] / 'bin' / 'memrec'} -> .venv/bin/memrec" in start.stderr
    assert "next: memrec tui demo.mrec" in start.stderr
    which = run(clone, "command -v memrec")
    assert which.stdout.strip() == str(clone["base"] / "bin" / "memrec")
    assert os.path.realpath(which.stdout.strip()) == str(clone["repo"] / ".venv" / "bin" / "memrec")
    # AND that next step runs as printed, where start was run
    assert "memrec tui demo.mrec" in start.stderr
    _tui(clone, "memrec tui demo.mrec")


@pytest.mark.parametrize("command", [c for c in readme_commands() if quick(c)])
def test_a_readme_command_runs_as_written(clone, command):
    for form in expand(command):
        repo = clone["repo"]
        if form == "memrec record -o run.mrec -- python train.py":
            (repo / "run.mrec").unlink()
        # WHEN typed in the clone
        done = run(clone, form)
        if form == "memrec record -o run.mrec -- python train.py":
            assert done.returncode == 0 and done.stdout == "training\n", done.stderr
            assert run(clone, "memrec report run.mrec").returncode == 0
            shutil.copy(repo / "demo.mrec", repo / "run.mrec")
            continue
        # THEN it works; `memrec selftest` needs a GPU and cuda-python: here it says so in one line
        if form == "memrec selftest":
            assert done.returncode == 69 and done.stderr.count("\n") == 1 and "error" in done.stderr, done.stderr
            continue
        assert done.returncode == 0, f"{form}: {done.stderr[-2000:]}"
        assert "Traceback" not in done.stderr, done.stderr
        if form.startswith("memrec report examples/sglang-standin-ipc.mrec | head -3"):
            # the three lines the README shows
            shown = README.read_text().split(f"$ {form}\n", 1)[1].split("```")[0].strip().splitlines()
            assert done.stdout.splitlines() == shown


def _tui(clone: dict, command: str, painted: bool = True) -> str:
    from tests.tui.tmux_term import Tmux

    env = clone["env"]
    inner = f"cd {clone['repo']} && {command}; echo EXIT=$?"
    term = Tmux(f"readme-{os.getpid()}-{int(time.monotonic() * 1000) % 100000}", f"bash -c {shlex.quote(inner)}",
                (120, 36), env={"PATH": env["PATH"], "MEMREC_SOCKET": env["MEMREC_SOCKET"]})
    try:
        if painted:
            ok, screen = term.wait_painted(timeout=60)
            assert ok, screen
        else:
            # connected to the daemon: "live", or "no data for Ns" on a host without NVML (the
            # daemon sends nothing while nothing happens), never "connecting" or an error
            end = time.monotonic() + 60
            screen = term.screen()
            while not re.search(r" live\b|no data for", screen) and time.monotonic() < end:
                time.sleep(0.3)
                screen = term.screen()
            assert re.search(r" live\b|no data for", screen), screen
        term.keys("q")
        term.wait_for("EXIT=0", timeout=30)
        return screen
    finally:
        term.close()


@pytest.fixture
def daemon(clone, tmp_path):
    """`memrec daemon -o DIR` as the README starts it, stopped with Ctrl-C (SIGINT) after the test."""
    out = tmp_path / "var-lib-memrec"
    out.mkdir()
    proc = subprocess.Popen(["bash", "-c", f"exec memrec daemon -o {out}/"], cwd=clone["repo"], env=clone["env"],
                            stderr=subprocess.PIPE, text=True)
    sock = Path(clone["env"]["MEMREC_SOCKET"])
    end = time.monotonic() + 120
    while not sock.exists() and proc.poll() is None and time.monotonic() < end:
        time.sleep(0.2)
    assert sock.exists(), proc.stderr.read() if proc.poll() is not None else "no socket after 120 s"
    yield out
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 0, err[-2000:]


def test_the_daemon_records_until_ctrl_c_and_shell_markers_pair(clone, daemon):
    # WHEN a command is run as a phase while the daemon records (the README's line)
    done = run(clone, "memrec mark load -- python load.py")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "loading\n"
    # AND the live view opens on it
    _tui(clone, "memrec tui --live", painted=False)


def test_the_daemon_records_a_trace_that_reports(clone, daemon):
    time.sleep(1)
    traces = list(daemon.glob("*.mrec"))
    assert len(traces) == 1
    done = run(clone, f"memrec report {traces[0]}")
    assert done.returncode == 0, done.stderr


def test_the_daemon_serves_metrics(clone):
    # GIVEN a free port for the README's --metrics-addr (9862 may be another daemon's here)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = clone["base"] / "metrics"
    out.mkdir(exist_ok=True)
    sock = clone["base"] / "metrics.sock"
    command = "memrec daemon --metrics-addr 127.0.0.1:9862 ...".replace("9862", str(port)).replace(
        "...", f"-o {out}/ --socket {sock}")
    proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=clone["repo"], env=clone["env"],
                            stderr=subprocess.PIPE, text=True)
    try:
        import urllib.request

        end = time.monotonic() + 120
        body = ""
        while time.monotonic() < end and proc.poll() is None:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
                break
            except OSError:
                time.sleep(0.5)
        assert "memrec_" in body, proc.stderr.read() if proc.poll() is not None else body[:500]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    assert proc.returncode == 0


def test_the_tui_opens_a_trace(clone):
    _tui(clone, "memrec tui run.mrec")


def test_the_tui_opens_the_examples(clone):
    # (what their first screens say: tests/tui/test_tui_answer_e2e.py)
    _tui(clone, "memrec tui examples/sglang-standin-ipc.mrec")
    _tui(clone, "memrec tui examples/sglang-standin-base.mrec --diff examples/sglang-standin-ipc.mrec")
