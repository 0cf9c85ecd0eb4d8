"""Library discovery: maps parsing and the choice of a reachable path per (dev, inode)."""

from __future__ import annotations

import os
from pathlib import Path

from memrec.probes.libs import LibraryFile
from memrec.probes.libs import find_libcuda
from memrec.probes.libs import is_libcuda
from memrec.probes.libs import libcuda_mappings
from memrec.probes.libs import parse_ldconfig
from memrec.probes.libs import parse_maps
from memrec.probes.libs import parse_maps_line

MAPS = """\
55d0c0a00000-55d0c0a21000 r--p 00000000 fd:01 1835043                    /usr/bin/python3.11
7f3a10000000-7f3a10021000 rw-p 00000000 00:00 0
7f3a20000000-7f3a20400000 r--p 00000000 fd:01 2490377                    /usr/lib/x86_64-linux-gnu/libcuda.so.580.159.03
7f3a20400000-7f3a21000000 r-xp 00400000 fd:01 2490377                    /usr/lib/x86_64-linux-gnu/libcuda.so.580.159.03
7f3a30000000-7f3a30001000 r-xp 00000000 00:1f 99 /opt/old driver/libcuda.so.1 (deleted)
7ffd7c5f0000-7ffd7c611000 rw-p 00000000 00:00 0                          [stack]
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]
"""


def maps_line(start: int, path: str, dev: int, inode: int, deleted: bool = False) -> str:
    return (f"{start:x}-{start + 0x1000:x} r-xp 00000000 {os.major(dev):02x}:{os.minor(dev):02x} {inode}"
            f"    {path}{' (deleted)' if deleted else ''}\n")


def test_parse_maps_keeps_file_mappings_with_their_identity():
    entries = parse_maps(MAPS)
    assert [e.path for e in entries] == [
        "/usr/bin/python3.11",
        "/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.03",
        "/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.03",
        "/opt/old driver/libcuda.so.1",
    ]
    cuda = entries[1]
    assert cuda.dev == os.makedev(0xFD, 0x01) and cuda.inode == 2490377
    assert cuda.start == 0x7F3A20000000 and cuda.range == "7f3a20000000-7f3a20400000"
    old = entries[3]
    assert old.deleted and old.path == "/opt/old driver/libcuda.so.1", "spaces in paths survive"


def test_parse_maps_line_rejects_anonymous_pseudo_and_garbage():
    assert parse_maps_line("7f3a10000000-7f3a10021000 rw-p 00000000 00:00 0\n") is None
    assert parse_maps_line("7ffd7c5f0000-7ffd7c611000 rw-p 00000000 00:00 0   [stack]") is None
    assert parse_maps_line("not a maps line") is None
    assert parse_maps_line("zz-yy r-xp 0 fd:01 12 /lib/libcuda.so.1") is None


def test_libcuda_mappings_are_distinct_per_inode():
    found = libcuda_mappings(MAPS)
    assert set(found) == {(os.makedev(0xFD, 1), 2490377), (os.makedev(0, 0x1F), 99)}
    assert libcuda_mappings("7f00-7f01 r-xp 0 fd:01 5 /usr/lib/libc.so.6\n") == {}


def test_is_libcuda_matches_every_driver_name_only():
    assert is_libcuda("/usr/lib64/libcuda.so")
    assert is_libcuda("/x/libcuda.so.1")
    assert is_libcuda("/x/libcuda.so.580.159.03")
    assert not is_libcuda("/x/libcudart.so.12")
    assert not is_libcuda("/x/libcuda_stub.so")


def test_parse_ldconfig_lists_libcuda_paths():
    text = """\
1234 libs found in cache `/etc/ld.so.cache'
\tlibcudart.so.12 (libc6,x86-64) => /usr/local/cuda/lib64/libcudart.so.12
\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1
\tlibcuda.so (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so
\tlibc.so.6 (libc6,x86-64, OS ABI: Linux 3.2.0) => /lib/x86_64-linux-gnu/libc.so.6
"""
    assert parse_ldconfig(text) == ["/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so"]


def test_find_libcuda_picks_a_reachable_path_per_inode(tmp_path: Path):
    # GIVEN a host library, a container-only library, a deleted one, and installed paths
    host_lib = tmp_path / "host" / "libcuda.so.1"
    host_lib.parent.mkdir()
    host_lib.write_bytes(b"host")
    st_host = host_lib.stat()
    proc = tmp_path / "proc"
    # pid 100: maps the host library by its real path
    (proc / "100").mkdir(parents=True)
    (proc / "100" / "maps").write_text(maps_line(0x7F0000000000, str(host_lib), st_host.st_dev, st_host.st_ino))
    # pid 200: a container; its path does not exist here but /proc/200/root/<path> does
    (proc / "200" / "root" / "usr" / "lib64").mkdir(parents=True)
    container_lib = proc / "200" / "root" / "usr" / "lib64" / "libcuda.so.1"
    container_lib.write_bytes(b"container")
    (proc / "200" / "maps").write_text(
        maps_line(0x7F0000000000, "/usr/lib64/libcuda.so.1", 0x1234, 777)
        + maps_line(0x7F1000000000, str(host_lib), st_host.st_dev, st_host.st_ino)  # same inode as pid 100
    )
    # pid 300: a deleted (upgraded) driver, reachable only through map_files
    (proc / "300" / "map_files").mkdir(parents=True)
    (proc / "300" / "map_files" / "7f2000000000-7f2000001000").write_bytes(b"old")
    (proc / "300" / "maps").write_text(maps_line(0x7F2000000000, "/gone/libcuda.so.1", 0x99, 5, deleted=True))
    # pid 400: unreadable maps (a directory instead of a file) is skipped
    (proc / "400" / "maps").mkdir(parents=True)
    # an installed path that is a symlink to the host library, and a distinct installed copy
    link = tmp_path / "libcuda.so"
    link.symlink_to(host_lib)
    other = tmp_path / "other" / "libcuda.so.1"
    other.parent.mkdir()
    other.write_bytes(b"other")

    # WHEN discovering
    libs = find_libcuda([str(other)], proc_root=str(proc), usual_paths=[str(link), str(tmp_path / "missing.so")],
                        use_ldconfig=False)

    # THEN each inode appears once with a path that reaches it
    by_key = {(lib.dev, lib.inode): lib for lib in libs}
    assert len(libs) == len(by_key) == 4
    assert by_key[(st_host.st_dev, st_host.st_ino)].path == str(host_lib)
    assert by_key[(0x1234, 777)].path == str(container_lib)
    assert by_key[(0x99, 5)].path == str(proc / "300" / "map_files" / "7f2000000000-7f2000001000")
    st_other = other.stat()
    assert by_key[(st_other.st_dev, st_other.st_ino)] == LibraryFile(str(other), st_other.st_dev, st_other.st_ino)


def test_find_libcuda_skips_unreachable_mappings(tmp_path: Path):
    proc = tmp_path / "proc"
    (proc / "10").mkdir(parents=True)
    (proc / "10" / "maps").write_text(maps_line(0x7F0000000000, "/nowhere/libcuda.so.1", 0x42, 1))
    assert find_libcuda(proc_root=str(proc), usual_paths=(), use_ldconfig=False) == []


def test_find_libc10_cuda_finds_every_pytorch_install_a_process_maps(tmp_path: Path):
    # GIVEN two PyTorch installs (user-owned is fine, group-writable is not), mapped by processes
    from memrec.probes.libs import find_libc10_cuda

    proc = tmp_path / "proc"
    a = tmp_path / "venv-a" / "libc10_cuda.so"
    b = tmp_path / "venv-b" / "libc10_cuda.so"
    shared = tmp_path / "shared" / "libc10_cuda.so"
    for lib in (a, b, shared):
        lib.parent.mkdir()
        lib.write_bytes(b"\x7fELF")
        lib.chmod(0o644)
    os.chown(b, 1000, 1000)
    shared.chmod(0o664)
    for pid, libs in (("1", [a, b]), ("2", [a, shared]), ("3", [])):
        (proc / pid).mkdir(parents=True)
        (proc / pid / "maps").write_text("".join(
            maps_line(0x7F0000000000 + i * 0x10000, str(lib), lib.stat().st_dev, lib.stat().st_ino)
            for i, lib in enumerate(libs)))
    # WHEN discovering
    found = find_libc10_cuda(proc_root=str(proc))
    # THEN each install is found once; the one others may write is refused
    assert sorted(lib.path for lib in found) == sorted([str(a), str(b)])
