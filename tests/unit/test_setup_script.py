"""scripts/setup in a copy of this checkout, as a new user's first screen shows it.

The host's packages are taken as installed (a fake dpkg-query on PATH) and its kernel headers as
linked (a fake modules root): the header step has its own tests (test_kernel_headers.py). What runs
for real is the virtualenv and pip, whose output must not reach the user's screen.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP = {".git", ".venv", "__pycache__", ".pytest_cache", "build"}


def _can_run() -> str | None:
    if os.geteuid() != 0:
        return "scripts/setup runs as root"
    if shutil.which("apt-get") is None:
        return "scripts/setup knows Debian/Ubuntu hosts only"
    probe = subprocess.run(["/usr/bin/python3", "-c", "import bcc, venv, ensurepip"], capture_output=True)
    if probe.returncode != 0:
        return "the system python3 lacks bcc or venv (python3-bpfcc, python3-venv)"
    return None


@pytest.fixture
def fresh_clone(tmp_path) -> Path:
    reason = _can_run()
    if reason:
        pytest.skip(reason)
    clone = tmp_path / "memrec"
    shutil.copytree(ROOT, clone, ignore=lambda d, names: [n for n in names if n in SKIP or n.endswith(".egg-info")])
    return clone


def run_setup(clone: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "dpkg-query").write_text("#!/bin/sh\nprintf 'install ok installed'\n")
    (fake / "dpkg-query").chmod(0o755)
    build = tmp_path / "modules" / os.uname().release / "build" / "include"
    build.mkdir(parents=True, exist_ok=True)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    # MEMREC_BIN_DIR: the `memrec` link goes into the test's folder (on PATH), not /usr/local/bin
    env = dict(os.environ, PATH=f"{tmp_path / 'on-path'}:{fake}:{os.environ['PATH']}",
               MEMREC_MODULES_ROOT=str(tmp_path / "modules"), MEMREC_SRC_ROOT=str(tmp_path / "src"),
               TMPDIR=str(tmp_path / "tmp"), MEMREC_BIN_DIR=str(tmp_path / "on-path"))
    for key in ("MEMREC_SETUP_LOG", "MEMREC_APT_UPDATED", "VIRTUAL_ENV"):
        env.pop(key, None)
    return subprocess.run(["bash", str(clone / "scripts" / "setup")], capture_output=True, text=True, env=env,
                          timeout=600, cwd="/")


def test_setup_shows_its_own_lines_only_and_a_rerun_says_ready(fresh_clone, tmp_path):
    # GIVEN a fresh copy of the checkout (no .venv) on a host with the packages and headers in place
    # WHEN set up, as scripts/start does first
    first = run_setup(fresh_clone, tmp_path)
    # THEN it works, and the screen holds memrec's lines alone: no pip notices, no setuptools
    # warning about folders named like the package, no apt output
    assert first.returncode == 0, first.stderr
    lines = first.stderr.splitlines()
    assert all(line.startswith("memrec setup: ") for line in lines), first.stderr
    extras = "nvml,tui,metrics,export,plot,pandas,sql" + (",gpu" if os.path.exists("/dev/nvidiactl") else "")
    assert lines[0] == f"memrec setup: installing memrec[{extras}] into .venv (pip)"
    assert lines[-1].startswith("memrec setup: ready: memrec ")
    assert first.stdout == ""
    assert (fresh_clone / ".venv" / "bin" / "memrec").exists()
    # AND `memrec` is on PATH, a link to the clone's, and the last line says so
    link = tmp_path / "on-path" / "memrec"
    assert lines[-1].endswith(f"; memrec on PATH: {link} -> .venv/bin/memrec")
    assert os.readlink(link) == str(fresh_clone / ".venv" / "bin" / "memrec")
    # WHEN run again THEN one line, and its log was removed both times
    again = run_setup(fresh_clone, tmp_path)
    assert again.returncode == 0 and again.stderr.splitlines() == [lines[-1]]
    assert list((tmp_path / "tmp").glob("memrec-setup.*")) == []
    # AND a .venv without pip (made before python3-venv was installed) is made again
    shutil.rmtree(fresh_clone / ".venv" / "lib")
    redo = run_setup(fresh_clone, tmp_path)
    assert redo.returncode == 0, redo.stderr
    assert "making .venv again: the one here has no working pip" in redo.stderr


def test_operations_md_by_hand_bcc_link_works_with_another_python3_first_on_path(tmp_path):
    # GIVEN docs/operations.md's by-hand lines that let a virtualenv reach the system bcc, a fresh
    # virtualenv made by another Python, and a PATH whose python3 has no bcc (pyenv, conda)
    if subprocess.run(["/usr/bin/python3", "-c", "import bcc"], capture_output=True).returncode != 0:
        pytest.skip("the system python3 has no bcc (python3-bpfcc)")
    doc = (ROOT / "docs" / "operations.md").read_text()
    block = doc.split("# the venv must see the system's bcc package", 1)[1].split("\n", 1)[1]
    block = block.split("/opt/memrec/bin/memrec doctor", 1)[0]
    lines = [line for line in block.splitlines() if line and not line.startswith("#")]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    shadow = tmp_path / "bin"
    shadow.mkdir()
    (shadow / "python3").write_text('#!/bin/sh\nexec /usr/bin/python3 -S "$@"\n')  # no site-packages: no bcc
    (shadow / "python3").chmod(0o755)
    script = "\n".join(["set -e", *lines]).replace("/opt/memrec/bin/python", str(venv / "bin" / "python"))
    # WHEN a user runs them
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                          env={**os.environ, "PATH": f"{shadow}:{os.environ['PATH']}"})
    # THEN the virtualenv imports bcc
    assert done.returncode == 0, done.stderr
    assert subprocess.run([str(venv / "bin" / "python"), "-c", "import bcc"], capture_output=True).returncode == 0


def test_a_memrec_that_is_not_our_link_is_left_alone_and_named(fresh_clone, tmp_path):
    # GIVEN a memrec on PATH that set-up did not make (pip-installed elsewhere: a plain file)
    (tmp_path / "on-path").mkdir()
    other = tmp_path / "on-path" / "memrec"
    other.write_text("#!/bin/sh\necho theirs\n")
    # WHEN set up
    done = run_setup(fresh_clone, tmp_path)
    # THEN it is kept, and the last line says how to run this clone's memrec instead
    assert done.returncode == 0, done.stderr
    assert other.read_text() == "#!/bin/sh\necho theirs\n"
    assert done.stderr.splitlines()[-1].endswith(
        f"{other} is not a link made by memrec's set-up, so it was left alone: run {fresh_clone}/.venv/bin/memrec")
