"""Issue 23, item 5: every file memrec writes goes through the one guarded creator.

``memrec export`` and ``memrec plot`` wrote with ``open(path, "wb")``, pyarrow's
``write_table(table, path)`` and matplotlib's ``savefig(path)``: root wrote through a symbolic link
planted at the output (after the existence check too) and followed a linked ``-o`` folder. Now
:mod:`memrec.base.files` creates every file (``O_EXCL|O_NOFOLLOW``, relative to a folder reached
without following another user's link). The first test scans every module so that the next
writer cannot slip past; the others attack as the review did, as another uid (``setpriv``).
"""

from __future__ import annotations

import ast
import errno
import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memrec.base.files import create_file
from memrec.base.files import create_new
from memrec.base.files import make_folder
from memrec.base.files import open_folder
from memrec.commands import main
from memrec.trace.reader import load_trace

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "memrec"
NOBODY = 65534

#: Calls that write to a file or object passed to them: the target must be a file object the
#: guarded creator made (bound by ``with create_file(...) as f``) or a descriptor memrec holds.
SINKS = {"savefig": 0, "write_table": 1, "to_csv": 0, "to_parquet": 0, "save": 0, "savez": 0, "dump": 1,
         "savez_compressed": 0, "tofile": 0, "ParquetWriter": 0}
#: Writers of a path that have no guarded form: always refused.
PATH_WRITERS = {"write_text", "write_bytes", "touch", "symlink_to", "hardlink_to"}
#: shutil's copies (``copy`` alone is also numpy's and a dict's).
COPIES = {"copy", "copy2", "copyfile", "copytree", "move"}
#: Folders made outside :func:`memrec.base.files.make_folder`, each for a stated reason.
MKDIR_ALLOWED = {
    ("memrec/export/plot.py", "_private_config_dir_if_needed"): "matplotlib's config folder in the user's own home",
    ("memrec/validation/stubdriver/build.py", "default_cache_dir"): "the stub's build cache in the user's own cache folder",
    ("memrec/validation/stubdriver/build.py", "build_stub"): "the stub's build folder, named by the caller (tests)",
    ("memrec/validation/stubdriver/build.py", "build_torch_stub"): "the torch stub's build folder, named by the caller (tests)",
    ("memrec/commands/install_service.py", "_write"): "systemd's folders under a root-owned prefix",
}
#: Calls whose result, bound by ``with``, a sink may write to: the guarded creator's file (also
#: as ``create_output``, which removes it again when the writing fails), a descriptor memrec
#: holds, or memory (``io.BytesIO``: no path to write through).
GUARDED_OPENERS = {"create_file", "create_output", "fdopen", "BytesIO"}


def _mode(call: ast.Call, position: int) -> str | None:
    """The mode string of an open() call, "" when it is not a literal, None when absent (read)."""
    node = call.args[position] if len(call.args) > position else next(
        (k.value for k in call.keywords if k.arg == "mode"), None)
    if node is None:
        return None
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""


def _callee(call: ast.Call) -> tuple[str, str]:
    """(object name or "", function name) of a call."""
    f = call.func
    if isinstance(f, ast.Attribute):
        owner = f.value.id if isinstance(f.value, ast.Name) else ""
        return owner, f.attr
    return "", f.id if isinstance(f, ast.Name) else ""


def unguarded_writes(path: Path) -> list[str]:
    """Every place in ``path`` that writes a file without :mod:`memrec.base.files`."""
    rel = path.relative_to(ROOT).as_posix()
    tree = ast.parse(path.read_text(), str(path))
    found = []
    guarded: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                call = item.context_expr
                if isinstance(call, ast.Call) and _callee(call)[1] in GUARDED_OPENERS and isinstance(item.optional_vars, ast.Name):
                    guarded.add(item.optional_vars.id)

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call):
                check(child, function)
            visit(child, name)

    def check(call: ast.Call, function: str) -> None:
        owner, name = _callee(call)
        where = f"{rel}:{call.lineno} ({function or 'module'})"
        if name == "open" and owner == "os":
            flags = ast.unparse(call.args[1]) if len(call.args) > 1 else ""
            if not flags or any(f in flags for f in ("O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND")) \
                    or "O_RDONLY" not in flags:  # (reading with os.open is fine)
                found.append(f"{where}: os.open (use memrec.base.files.create_new)")
        elif name == "open":
            mode = _mode(call, 0 if owner else 1)
            if mode is not None and (mode == "" or set(mode) & set("wax+")):
                found.append(f"{where}: open(..., {mode!r}) (use memrec.base.files.create_file)")
        elif name in PATH_WRITERS or (owner == "shutil" and name in COPIES):
            found.append(f"{where}: .{name}() (use memrec.base.files.create_file)")
        elif name in ("mkdir", "makedirs") and (rel, function) not in MKDIR_ALLOWED:
            found.append(f"{where}: {name}() (use memrec.base.files.make_folder)")
        elif name in SINKS and not (name == "dump" and owner not in ("pickle", "json", "marshal")) \
                and not (name == "save" and owner not in ("np", "numpy")) \
                and not (name == "write_table" and len(call.args) < 2 and not call.keywords):
            # (a ParquetWriter's own write_table(table) names no target: its constructor did)
            i = SINKS[name]
            target = call.args[i] if len(call.args) > i else None
            to_stream = isinstance(target, ast.Attribute) and ast.unparse(target) in ("sys.stdout", "sys.stderr")
            if not (to_stream or isinstance(target, ast.Name) and target.id in guarded):
                found.append(f"{where}: {name}() into something not made by memrec.base.files.create_file")

    visit(tree, "")
    return found


def test_no_module_writes_a_file_but_through_the_guarded_creator():
    # GIVEN every module of the memrec.* namespace: memrec/ and the folders pyproject maps into it
    # (daemon/, probes/, tui/, sglang_hooks/, contrib/), the guarded creator itself aside
    trees = [PACKAGE, *(ROOT / name for name in ("daemon", "probes", "tui", "sglang_hooks", "contrib"))]
    modules = [p for tree in trees for p in sorted(tree.rglob("*.py")) if p != PACKAGE / "base" / "files.py"]
    assert len(modules) > 150
    # THEN none opens, saves, dumps, copies or makes a folder by another way
    found = [line for p in modules for line in unguarded_writes(p)]
    assert found == []


def test_the_scan_finds_each_way_of_writing_it_refuses(tmp_path):
    # GIVEN a module with one of each unguarded write (the scan must not be a test that cannot fail)
    bad = ROOT / "memrec" / "_scan_probe_tmp.py"
    bad.write_text(
        "import os, pickle, json\n"
        "def f(path, fig, pq, t, folder):\n"
        "    open(path, 'w').write('x')\n"
        "    with path.open('ab') as g: pass\n"
        "    os.open(path, os.O_WRONLY)\n"
        "    path.write_bytes(b'')\n"
        "    fig.savefig(path)\n"
        "    pq.write_table(t, path)\n"
        "    pickle.dump(t, open(path, mode))\n"
        "    folder.mkdir()\n"
        "    with create_file(path) as ok:\n"
        "        fig.savefig(ok)\n"
        "        pq.ParquetWriter(ok, t.schema).write_table(t)\n"
        "    open(path).read()\n"
        "    pq.ParquetWriter(path, t.schema).write_table(t)\n"
    )
    try:
        found = unguarded_writes(bad)
    finally:
        bad.unlink()
    # THEN each is reported once (a ParquetWriter at its constructor), and the guarded savefig and
    # ParquetWriter and the read are not
    assert [line.split(":")[1].split()[0] for line in found] == ["3", "4", "5", "6", "7", "8", "9", "9", "10",
                                                                 "15"], found


# ------------------------------------------------------------------------------ the creator itself

def test_a_link_planted_as_the_folder_by_another_user_is_not_followed(tmp_path):
    # GIVEN a folder anyone may write to, and in it a link to a root-only folder planted by nobody
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o1777)
    os.chmod(shared, 0o1777)
    victim = tmp_path / "etc"
    victim.mkdir()
    link = shared / "out"
    link.symlink_to(victim)
    os.lchown(link, NOBODY, NOBODY)
    # WHEN root creates a file through it THEN it is refused, nothing is created in the target
    with pytest.raises(OSError, match="owned by uid 65534, another user"):
        create_new(link / "x.csv")
    with pytest.raises(OSError, match="another user"):
        make_folder(link)
    assert list(victim.iterdir()) == []
    # AND root's own link, or root-owned one in the path, is followed as before
    os.lchown(link, 0, 0)
    fd, _ = create_new(link / "x.csv")
    os.close(fd)
    assert (victim / "x.csv").exists()


def test_open_folder_follows_relative_and_absolute_links_of_the_caller(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "rel").symlink_to("a/b")
    (tmp_path / "abs").symlink_to(tmp_path / "a")
    (tmp_path / "loop").symlink_to("loop")
    for path, want in ((tmp_path / "rel", tmp_path / "a" / "b"), (tmp_path / "abs" / "b", tmp_path / "a" / "b"),
                       (tmp_path / "abs" / ".." / "a", tmp_path / "a")):
        fd = open_folder(path)
        try:
            assert os.path.samestat(os.fstat(fd), os.stat(want))
        finally:
            os.close(fd)
    with pytest.raises(OSError, match="too many levels"):
        open_folder(tmp_path / "loop")
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        open_folder(tmp_path / "file")


def test_create_file_never_truncates_a_link_planted_at_the_name(tmp_path):
    secret = tmp_path / "shadow"
    secret.write_text("root:secret\n")
    (tmp_path / "out.csv").symlink_to(secret)
    for replace in (False, True):
        with pytest.raises(OSError):
            create_file(tmp_path / "out.csv", replace=replace)
    assert secret.read_text() == "root:secret\n"


def test_a_folder_that_cannot_be_made_is_named_by_its_whole_path(tmp_path):
    # GIVEN a folder that mkdir refuses (a name too long; as a user, a folder not theirs)
    path = tmp_path / ("x" * 300)
    with pytest.raises(OSError) as error:
        make_folder(path)
    # THEN the error names the path given, which the command prints ("x: Permission denied" was
    # all `memrec export --to csv -o /data/run/x` said)
    assert error.value.filename == str(path)


def test_an_output_whose_writing_fails_is_removed_and_only_that_file(tmp_path):
    from memrec.base.files import create_output

    # GIVEN an output whose writing stops half-way (Ctrl-C, a full disk, a cut trace)
    out = tmp_path / "events.csv"
    with pytest.raises(KeyboardInterrupt):
        with create_output(out, text=True) as f:
            f.write("ts,pid\n1,2\n")
            raise KeyboardInterrupt
    # THEN no cut file is left to be read as a whole one (or to need -f next time)
    assert not out.exists()
    # AND a file that someone put at the name meanwhile is not the one made: it stays
    with pytest.raises(RuntimeError):
        with create_output(out) as f:
            os.rename(out, tmp_path / "moved")
            (tmp_path / "planted").write_text("theirs")
            os.rename(tmp_path / "planted", out)
            raise RuntimeError("stop")
    assert out.read_text() == "theirs"
    # AND a body that ends well keeps its file
    with create_output(tmp_path / "whole.csv", text=True) as f:
        f.write("ts\n")
    assert (tmp_path / "whole.csv").read_text() == "ts\n"


# ------------------------------------------------------------------------------ the commands, attacked

def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def trace_file():
    return ROOT / "tests" / "data" / "golden_v1.mrec"  # an OOM, an IPC export/open pair, markers, NVML


@pytest.fixture
def shared():
    """A world-writable sticky folder (like /tmp) and a root-only file an attacker would like
    rewritten, in a folder other users may search (pytest's own is root's alone)."""
    import shutil
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="mrg", dir="/tmp"))
    os.chmod(top, 0o755)
    folder = top / "shared"
    folder.mkdir()
    os.chmod(folder, 0o1777)
    secret = top / "secret"
    secret.write_text("root only\n")
    os.chmod(secret, 0o600)
    yield folder, secret
    shutil.rmtree(top, ignore_errors=True)


def as_nobody(*argv: str) -> None:
    subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="attacks as another uid need root")
@pytest.mark.parametrize("to, name", [("memory-viz", "snap.pickle"), ("perfetto", "run.pftrace"), ("csv", "tables"),
                                      ("parquet", "tables")])
def test_export_as_root_never_writes_through_a_users_link(trace_file, shared, to, name):
    pytest.importorskip("pyarrow" if to == "parquet" else "msgpack")
    if to == "perfetto":
        pytest.importorskip("perfetto.trace_builder.proto_builder")
    folder, secret = shared
    out = folder / name
    # GIVEN a user plants a link where root will write (a file name, or the -o folder itself)
    if to in ("csv", "parquet"):
        as_nobody("ln", "-s", str(secret.parent), str(out))  # the -o folder: root's folder
        target = secret.parent / f"events.{to}"
    else:
        as_nobody("ln", "-s", str(secret), str(out))
        target = secret
    for force in ([], ["-f"]):
        # WHEN root exports there (with and without --force)
        code, _, err = run("export", *force, str(trace_file), "--to", to, "-o", str(out))
        # THEN it refuses with one line, and the target is untouched
        assert code != 0 and err.count("\n") == 1, err
        assert secret.read_text() == "root only\n" and not (target != secret and target.exists())


@pytest.mark.skipif(os.geteuid() != 0, reason="attacks as another uid need root")
def test_plot_as_root_never_writes_through_a_users_link(trace_file, shared):
    pytest.importorskip("matplotlib")
    folder, secret = shared
    out = folder / "t.png"
    as_nobody("ln", "-s", str(secret), str(out))
    for force in ([], ["-f"]):
        code, _, err = run("plot", *force, str(trace_file), "-o", str(out))
        assert code != 0 and err.count("\n") == 1, err
        assert secret.read_text() == "root only\n"
    # AND a picture in a folder reached through nobody's link is refused too
    as_nobody("ln", "-s", str(secret.parent), str(folder / "pics"))
    code, _, err = run("plot", str(trace_file), "-o", str(folder / "pics" / "t.png"))
    assert code != 0 and "another user" in err and not (secret.parent / "t.png").exists()


def test_a_link_planted_after_the_existence_check_is_not_followed(trace_file, tmp_path, monkeypatch):
    # GIVEN the checks pass (no file at the output), then a link appears before the write (a race
    # the review won with a loop of `ln -sf`)
    from memrec.commands import export as export_command

    secret = tmp_path / "secret"
    secret.write_text("keep\n")
    out = tmp_path / "snap.pickle"
    real = export_command.check_output

    def check_then_plant(path, force):
        result = real(path, force)
        path.symlink_to(secret)  # (the golden trace has several processes: one file each)
        return result

    monkeypatch.setattr(export_command, "check_output", check_then_plant)
    # WHEN the export writes THEN it fails on the link, with one line, and the file is intact
    code, _, err = run("export", str(trace_file), "--to", "memory-viz", "-o", str(out))
    assert code != 0 and err.count("\n") == 1 and secret.read_text() == "keep\n", err


def test_force_still_replaces_a_regular_output(trace_file, tmp_path):
    out = tmp_path / "snap.pickle"
    out.write_bytes(b"old")
    pid = str(next(iter(load_trace(trace_file).processes)))
    assert run("export", "-f", str(trace_file), "--to", "memory-viz", "-p", pid, "-o", str(out))[0] == 0
    assert out.read_bytes()[:1] == b"\x80" and not out.is_symlink()  # a pickle now
    folder = tmp_path / "tables"
    assert run("export", str(trace_file), "--to", "csv", "-o", str(folder))[0] == 0
    assert run("export", "-f", str(trace_file), "--to", "csv", "-o", str(folder))[0] == 0
    assert (folder / "events.csv").read_text().startswith("ts,")


if __name__ == "__main__":  # print what the scan finds (handy while fixing a new writer)
    for p in (p for p in sorted(PACKAGE.rglob("*.py")) if p != PACKAGE / "base" / "files.py"):
        for line in unguarded_writes(p):
            print(line)
    sys.exit(0)


class _Program:
    """What the probe cache encodes of a program (its dict form): enough to write one."""

    def as_dict(self) -> dict:
        return {"insns": b"\0" * 8}


def _plant(link: Path, target: Path) -> None:
    target.write_text("keep")
    link.symlink_to(target)


def test_the_probe_cache_never_writes_through_a_link_at_its_temporary_name(tmp_path):
    from memrec.probes.probecache import ProbeCache

    # GIVEN a cache folder, and a link planted where the next write's temporary file goes
    cache = ProbeCache(str(tmp_path / "cache"))
    cache.write("k1", _Program())  # (makes the folder, 0700)
    tmp = Path(f"{cache.path('k2')}.{os.getpid()}.tmp")
    _plant(tmp, tmp_path / "precious")
    # WHEN the program is stored THEN it is refused and the file outside is untouched
    with pytest.raises(FileExistsError):
        cache.write("k2", _Program())
    assert (tmp_path / "precious").read_text() == "keep" and not Path(cache.path("k2")).exists()
    assert (tmp_path / "cache").stat().st_mode & 0o777 == 0o700


def test_the_probe_cache_folder_is_not_reached_through_another_users_link(tmp_path):
    from memrec.probes.probecache import ProbeCache

    # GIVEN a cache folder given as a path through a link another user owns
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "cache"
    link.symlink_to(elsewhere)
    os.lchown(link, NOBODY, NOBODY)
    # WHEN a program is stored THEN the cache says why it is not used, and nothing is written there
    cache = ProbeCache(str(link / "sub"))
    cache.write("k", _Program())
    assert cache.problem and list(elsewhere.iterdir()) == []


def test_the_trace_folder_ledger_never_appends_through_a_link(tmp_path, caplog):
    from memrec.daemon import retention

    # GIVEN a trace folder whose ledger name is a link to a file outside
    folder = tmp_path / "traces"
    folder.mkdir()
    (folder / "a.mrec").write_bytes(b"x")
    _plant(folder / retention.LEDGER, tmp_path / "precious")
    # WHEN the daemon notes a trace in the ledger THEN it warns and the file outside is untouched
    retention.record(folder, folder / "a.mrec")
    assert (tmp_path / "precious").read_text() == "keep"
    assert "ledger" in caplog.text


def test_install_pth_never_writes_through_a_link(tmp_path):
    from memrec.sglang_hooks import bootstrap

    site = tmp_path / "site"
    site.mkdir()
    # GIVEN a link planted at the final name: it is replaced by the file, its target untouched
    _plant(site / bootstrap.PTH_NAME, tmp_path / "precious")
    path = bootstrap.install_pth(site)
    assert not path.is_symlink() and "memrec" in path.read_text()
    assert (tmp_path / "precious").read_text() == "keep"
    # GIVEN a link planted at the temporary name: the write is refused, its target untouched
    (site / f".{bootstrap.PTH_NAME}.{os.getpid()}.tmp").symlink_to(tmp_path / "precious")
    with pytest.raises(FileExistsError):
        bootstrap.install_pth(site)
    assert (tmp_path / "precious").read_text() == "keep"


def test_open_folder_makes_missing_folders_but_never_through_a_link_among_its_own_names(tmp_path):
    # GIVEN a root folder (the caller's path: its own links followed) and names memrec makes below it
    (tmp_path / "real").mkdir()
    (tmp_path / "mine").symlink_to(tmp_path / "real")
    fd = open_folder(tmp_path / "mine" / "new", "a", "b", create=True, parents=True, mode=0o755)
    os.close(fd)
    assert (tmp_path / "real" / "new" / "a" / "b").is_dir()
    # WHEN one of the names is a link, even the caller's own THEN it is refused
    (tmp_path / "real" / "new" / "a" / "c").symlink_to(tmp_path)
    with pytest.raises(OSError) as error:
        open_folder(tmp_path / "mine" / "new", "a", "c", create=True)
    assert error.value.errno == errno.ELOOP
