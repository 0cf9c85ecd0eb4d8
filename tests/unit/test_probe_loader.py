"""The probe loader's pure parts: map-fd relocation, the cache file format and its bounds, the cache
key and directory checks (no BPF needed)."""

from __future__ import annotations

import os
import struct

import pytest

from memrec.probes import bpfsys
from memrec.probes import probecache
from memrec.probes.loader import MapSpec
from memrec.probes.loader import Program
from memrec.probes.loader import RelocationError
from memrec.probes.loader import relocate


def insn(op: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", op, (src << 4) | dst, off, imm)


def ld_map(fd: int, src: int = 1) -> bytes:
    """``r1 = map[fd]`` as a compiler emits it: two 8-byte slots, the fd in the first imm."""
    return insn(0x18, 1, src, 0, fd) + insn(0, 0, 0, 0, 0)


EXIT = insn(0x95)
MOV_R0 = insn(0xB7, 0, 0, 0, 0)


def program(**changes) -> Program:
    fields = dict(
        license="GPL", kern_version=0x60100,
        maps={"events": MapSpec("events", 27, 0, 0, 1 << 22, 0), "lost": MapSpec("lost", 6, 4, 8, 1, 0)},
        functions={"enter_cuInit": (2, ld_map(12) + ld_map(11, src=2) + MOV_R0 + EXIT)},
        fds={12: "events", 11: "lost"},
    )
    fields.update(changes)
    return Program(**fields)


def test_relocate_replaces_every_baked_in_map_fd_and_nothing_else():
    code = MOV_R0 + ld_map(12) + insn(0x18, 2, 0, 0, 12) + insn(0, imm=0) + ld_map(11, src=2) + EXIT
    out = relocate(code, {12: "events", 11: "lost"}, {"events": 40, "lost": 41})
    slots = [struct.unpack_from("<BBhi", out, at) for at in range(0, len(out), 8)]
    assert [s[3] for s in slots] == [0, 40, 0, 12, 0, 41, 0, 0]  # a plain ld_imm64 (src 0) keeps its value
    assert len(out) == len(code) and out[:8] == code[:8] and out[-8:] == code[-8:]


def test_relocate_refuses_an_fd_the_program_does_not_declare():
    with pytest.raises(RelocationError, match="instruction 1 refers to map fd 9"):
        relocate(MOV_R0 + ld_map(9) + EXIT, {12: "events"}, {"events": 40})


def test_a_program_survives_the_cache_file_format():
    p = program()
    assert probecache.decode("k", probecache.encode("k", p)) == p


@pytest.mark.parametrize("damage, why", [
    (lambda b: b[: len(b) // 2], "checksum mismatch"),
    (lambda b: b[:20], "truncated"),
    (lambda b: b"", "truncated"),
    (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "checksum mismatch"),
    (lambda b: b"XXXXXXXX" + b[8:], "not a memrec probe cache file"),
    (lambda b: b + bytes(probecache.MAX_BYTES), "larger than"),
])
def test_a_damaged_cache_file_is_refused_saying_why(damage, why):
    data = probecache.encode("k", program())
    with pytest.raises(probecache.CacheError, match=why):
        probecache.decode("k", damage(data))


def test_a_file_for_another_key_or_with_malformed_content_is_refused():
    data = probecache.encode("k", program())
    with pytest.raises(probecache.CacheError, match="another key"):
        probecache.decode("other", data)
    odd = program(functions={"f": (2, b"\x95" * 5)})  # not whole instructions
    with pytest.raises(probecache.CacheError, match="malformed"):
        probecache.decode("k", probecache.encode("k", odd))
    unknown = program(fds={12: "events", 11: "nowhere"})
    with pytest.raises(probecache.CacheError, match="malformed"):
        probecache.decode("k", probecache.encode("k", unknown))


def test_the_key_changes_with_the_source_the_flags_and_the_tools(monkeypatch):
    from memrec.probes.cuda import program_cflags

    base = probecache.cache_key("src", program_cflags(False, 1024))
    assert base == probecache.cache_key("src", program_cflags(False, 1024))
    others = {
        probecache.cache_key("src ", program_cflags(False, 1024)),
        probecache.cache_key("src", program_cflags(True, 1024)),
        probecache.cache_key("src", program_cflags(False, 2048)),
    }
    monkeypatch.setattr(probecache, "FORMAT", probecache.FORMAT + 1)
    others.add(probecache.cache_key("src", program_cflags(False, 1024)))
    assert base not in others and len(others) == 4


def test_the_cache_directory_must_be_roots_alone(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the directory checks want root-owned directories")
    safe = tmp_path / "cache"
    safe.mkdir(mode=0o700)
    assert probecache.cache_dir_problem(str(safe)) is None
    assert probecache.cache_dir_problem(str(safe / "not" / "yet")) is None
    link = tmp_path / "link"
    link.symlink_to(safe)
    assert "symlink" in probecache.cache_dir_problem(str(link / "x"))
    safe.chmod(0o775)
    assert "writable by group or others" in probecache.cache_dir_problem(str(safe))
    assert "writable by group or others" in probecache.cache_dir_problem(str(safe / "below"))
    safe.chmod(0o1777)  # a sticky parent (as /tmp) is fine, the directory itself is not
    assert probecache.cache_dir_problem(str(safe / "below")) is None
    assert "writable" in probecache.cache_dir_problem(str(safe))
    safe.chmod(0o700)
    os.chown(safe, 65534, 65534)
    assert "not owned by root" in probecache.cache_dir_problem(str(safe))


def test_a_cache_write_then_read_gives_the_program_back(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the cache is root's")
    cache = probecache.ProbeCache(str(tmp_path / "a" / "b"))
    assert cache.read("k") is None
    cache.write("k", program())
    assert cache.read("k") == program()
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o700
    assert [p.name for p in (tmp_path / "a" / "b").iterdir()] == ["k.mrprobe"]
    assert probecache.ProbeCache(None).read("k") is None


def test_a_cache_write_that_cannot_rename_leaves_no_temporary_file(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the cache is root's")
    cache = probecache.ProbeCache(str(tmp_path / "c"))
    cache.write("k", program())
    os.unlink(cache.path("k"))
    os.mkdir(cache.path("k"))  # the rename onto it fails (EISDIR)
    with pytest.raises(OSError):
        cache.write("k", program())
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["k.mrprobe"]


def test_possible_cpus():
    assert bpfsys.possible_cpus("0-3\n") == 4
    assert bpfsys.possible_cpus("0\n") == 1
    assert bpfsys.possible_cpus("0-1,4-7\n") == 8


def test_the_daemon_option_and_its_default():
    from memrec.daemon import config

    assert config.DEFAULT_PROBE_CACHE == probecache.DEFAULT_DIR
    assert config.probe_cache("off") is None and config.probe_cache("OFF") is None
    assert config.probe_cache("rel/dir") == os.path.abspath("rel/dir")
    with pytest.raises(ValueError):
        config.probe_cache(" ")
    assert config.DaemonConfig(probe_cache=None).probe_cache is None


def test_doctor_says_whether_the_daemon_finds_its_compiled_program(tmp_path, capsys):
    if os.geteuid() != 0:
        pytest.skip("the cache is root's")
    from memrec.__main__ import main
    from memrec.daemon.config import DEFAULT_RINGBUF_PAGES
    from memrec.probes.cuda import program_cflags
    from memrec.probes.cuda import program_source

    cache = tmp_path / "cache"

    def doctor_line() -> str:
        main(["doctor", "--json", "--probe-cache", str(cache)])
        (check,) = [c for c in __import__("json").loads(capsys.readouterr().out) if c["name"] == "probe cache"]
        return f"{check['status']}: {check['detail']}"

    assert doctor_line().startswith("ok: no compiled probe program for this kernel")
    key = probecache.cache_key(program_source(), program_cflags(False, DEFAULT_RINGBUF_PAGES))
    probecache.ProbeCache(str(cache)).write(key, program())
    assert doctor_line().startswith("ok: a compiled probe program for this kernel")
    cache.chmod(0o777)
    assert doctor_line() == f"warn: {cache} is not used: {cache} is writable by group or others"
