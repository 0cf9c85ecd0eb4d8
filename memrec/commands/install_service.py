"""``memrec install-service``: install the systemd unit, its group and the shell completions.

What it writes (under ``--root``, default ``/``):

- ``etc/systemd/system/memrec.service``: ``contrib/systemd/memrec.service`` with ``ExecStart``
  pointing at this memrec (the one running the command: a virtualenv's or pipx's path works);
- ``etc/sysusers.d/memrec.conf``: the ``memrec`` group whose members may send markers;
- bash, zsh and fish completions under ``usr/local/share``.

On the live system (``--root /``) it then creates the group (``systemd-sysusers``, else
``groupadd --system``), reloads systemd and, with ``--enable``, enables and starts the service.
Files are written to a temporary name and renamed, so a half-written unit is never seen.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from pathlib import Path

from memrec.base.errors import ExitCode
from memrec.base.errors import MemrecCommandError
from memrec.base.files import create_new

UNIT_NAME = "memrec.service"
#: Where each file goes, relative to the root.
UNIT_PATH = Path("etc/systemd/system") / UNIT_NAME
SYSUSERS_PATH = Path("etc/sysusers.d/memrec.conf")
COMPLETION_PATHS = {
    "bash": Path("usr/local/share/bash-completion/completions/memrec"),
    "zsh": Path("usr/local/share/zsh/site-functions/_memrec"),
    "fish": Path("usr/local/share/fish/vendor_completions.d/memrec.fish"),
}
_EXEC_START = re.compile(r"^ExecStart=(\S+)", re.MULTILINE)


def contrib_file(*parts: str) -> str:
    """A file shipped in contrib/ (the wheel carries it as package data of memrec.contrib)."""
    import importlib.resources

    return importlib.resources.files("memrec.contrib").joinpath(*parts).read_text()


def unit_text(memrec_path: str) -> str:
    """The unit with ``ExecStart`` running ``memrec_path``."""
    text = contrib_file("systemd", UNIT_NAME)
    if not _EXEC_START.search(text):
        raise MemrecCommandError("the shipped unit has no ExecStart line", exit_code=ExitCode.SOFTWARE)
    return _EXEC_START.sub(lambda _m: f"ExecStart={memrec_path}", text, count=1)


def this_memrec() -> str:
    """The absolute path of the memrec being run (its console script), or one on $PATH."""
    argv0 = Path(sys.argv[0])
    if argv0.name == "memrec" and argv0.exists():
        return os.path.abspath(argv0)
    beside = Path(sys.executable).parent / "memrec"
    if beside.exists():
        return os.fspath(beside)
    found = shutil.which("memrec")
    if found:
        return os.path.abspath(found)
    raise MemrecCommandError("cannot find the memrec executable: name it with --memrec PATH", exit_code=ExitCode.USAGE)


def _write(root: Path, rel: Path, text: str) -> Path:
    path = root / rel
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        fd, _ = create_new(tmp, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as error:
        raise MemrecCommandError(f"cannot write {path}: {error.strerror or error}", exit_code=ExitCode.CANT_CREATE) from None
    return path


def _run(argv: list[str]) -> None:
    import subprocess

    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise MemrecCommandError(f"{' '.join(argv)} failed: {detail[-1] if detail else proc.returncode}")


def _make_group() -> str:
    if shutil.which("systemd-sysusers"):
        _run(["systemd-sysusers", os.fspath(Path("/") / SYSUSERS_PATH)])
        return "group memrec (systemd-sysusers)"
    import grp

    try:
        grp.getgrnam("memrec")
        return "group memrec exists"
    except KeyError:
        _run(["groupadd", "--system", "memrec"])
        return "group memrec (groupadd)"


class InstallServiceCommand:
    """Install the systemd service (unit, socket group, shell completions); --enable starts it.

    The unit runs `memrec daemon` at boot as a Type=notify service: traces in /var/lib/memrec
    (1 GiB files, the 20 newest kept), markers on /run/memrec/memrec.sock for group memrec,
    metrics on 127.0.0.1:9862, capabilities reduced after attaching, restarted on failure.
    Change it with `systemctl edit memrec`. docs/operations.md has the whole set-up.

    examples:
      sudo memrec install-service --enable
      memrec install-service --root /tmp/pkgroot      # stage the files (packaging, review)
      memrec install-service --print                  # show the unit as it would be written
    """

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--root", type=Path, default=Path("/"), metavar="DIR",
                            help="install below DIR instead of / (no group, no systemctl)")
        parser.add_argument("--memrec", metavar="PATH", help="the memrec executable ExecStart runs (default: this one)")
        parser.add_argument("--enable", action="store_true", help="then enable and start the service (root / only)")
        parser.add_argument("--print", action="store_true", help="print the unit and write nothing")

    def run(self, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        from memrec.commands.completion import script

        memrec_path = args.memrec or this_memrec()
        if not os.path.isabs(memrec_path):
            raise MemrecCommandError(f"--memrec {memrec_path}: systemd needs an absolute path", exit_code=ExitCode.USAGE)
        unit = unit_text(memrec_path)
        if args.print:
            print(unit, end="")
            return ExitCode.OK
        live = args.root.resolve() == Path("/")
        if live and os.geteuid() != 0:
            raise MemrecCommandError("installing into / needs root (or stage with --root DIR)", exit_code=ExitCode.NO_PERM)
        if args.enable and not live:
            raise MemrecCommandError("--enable works on the running system only (--root /)", exit_code=ExitCode.USAGE)
        done = [_write(args.root, UNIT_PATH, unit), _write(args.root, SYSUSERS_PATH, contrib_file("systemd", "memrec.sysusers"))]
        for shell, rel in COMPLETION_PATHS.items():
            done.append(_write(args.root, rel, script(shell)))
        for path in done:
            print(f"wrote {path}")
        if live:
            print(_make_group())
            if Path("/run/systemd/system").is_dir():  # systemd is the service manager here
                _run(["systemctl", "daemon-reload"])
                if args.enable:
                    _run(["systemctl", "enable", "--now", UNIT_NAME])
                    print("enabled and started memrec.service: systemctl status memrec")
                else:
                    print("start it with: systemctl enable --now memrec")
            else:
                print("systemd is not running here: the unit is installed for the next boot with systemd")
        return ExitCode.OK
