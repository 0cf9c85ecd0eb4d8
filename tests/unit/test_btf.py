"""The BTF reader (memrec.probes.btf) on blobs built here type by type, every kind with its trailing
data ahead of the structs looked up (a reader that skips one kind's data wrongly misreads all that
follows), and on the running kernel's own BTF. That the offset it finds is the right one is proven
end to end by tests/bpf/test_python_stacks.py: CPython 3.10 threads are matched by it."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from memrec.probes import btf


class Builder:
    """A little-endian BTF blob, one type at a time (ids from 1, in the order added)."""

    def __init__(self) -> None:
        self.strings = b"\0"
        self.types = b""
        self.count = 0

    def name(self, text: str) -> int:
        if not text:
            return 0
        at = len(self.strings)
        self.strings += text.encode() + b"\0"
        return at

    def add(self, name: str, kind: int, vlen: int, size_or_type: int, trailing: bytes = b"", kind_flag: int = 0) -> int:
        info = (kind_flag << 31) | (kind << 24) | vlen
        self.types += struct.pack("<III", self.name(name), info, size_or_type) + trailing
        self.count += 1
        return self.count

    def struct(self, name: str, size: int, members: list[tuple[str, int, int]], kind_flag: int = 0,
               kind: int = btf.STRUCT) -> int:
        trailing = b"".join(struct.pack("<III", self.name(n), t, off) for n, t, off in members)
        return self.add(name, kind, len(members), size, trailing, kind_flag)

    def blob(self, magic: int = 0xEB9F, version: int = 1) -> bytes:
        header = struct.pack("<HBBIIIII", magic, version, 0, 24, 0, len(self.types), len(self.types), len(self.strings))
        return header + self.types + self.strings


def _kernel_like() -> tuple[Builder, int]:
    """Every kind, then a task_struct whose ``thread`` sits in an anonymous union past a bitfield
    struct (kind_flag encoding), behind a typedef and a const; returns the builder and the offset
    of thread.fsbase in bytes."""
    b = Builder()
    ulong = b.add("long unsigned int", btf.INT, 0, 8, struct.pack("<I", 64))
    uint = b.add("unsigned int", btf.INT, 0, 4, struct.pack("<I", 32))
    nibble = b.add("unsigned int", btf.INT, 0, 4, struct.pack("<I", 4))  # a bitfield without kind_flag
    b.add("", btf.PTR, 0, ulong)
    b.add("", btf.ARRAY, 0, 0, struct.pack("<III", ulong, uint, 3))
    b.add("e", btf.ENUM, 2, 4, struct.pack("<Ii", b.name("A"), 0) + struct.pack("<Ii", b.name("B"), 1))
    b.add("fwd", btf.FWD, 0, 0)
    b.add("", btf.VOLATILE, 0, ulong)
    b.add("", btf.RESTRICT, 0, ulong)
    proto = b.add("", btf.FUNC_PROTO, 2, ulong, struct.pack("<II", 0, ulong) + struct.pack("<II", 0, uint))
    b.add("f", btf.FUNC, 0, proto)
    var = b.add("v", btf.VAR, 0, ulong, struct.pack("<I", 1))
    b.add(".data", btf.DATASEC, 1, 8, struct.pack("<III", var, 0, 8))
    b.add("double", btf.FLOAT, 0, 8)
    b.add("tag", btf.DECL_TAG, 0, var, struct.pack("<i", -1))
    b.add("user", btf.TYPE_TAG, 0, ulong)
    b.add("e64", btf.ENUM64, 1, 8, struct.pack("<III", b.name("C"), 1, 0))
    b.add("task_struct", btf.FWD, 0, 0)  # a forward declaration is not the definition
    # struct thread_struct { unsigned long tls[3]; unsigned long sp; unsigned es:16, ds:16; ...; fsbase; }
    thread = b.struct("thread_struct", 64, [("tls_array", 4, 0), ("sp", ulong, 192), ("es", uint, (16 << 24) | 256),
                                            ("ds", uint, (16 << 24) | 272), ("fsbase", ulong, 320)], kind_flag=1)
    typedef = b.add("thread_t", btf.TYPEDEF, 0, thread)
    const = b.add("", btf.CONST, 0, typedef)
    anon_struct = b.struct("", 72, [("flags", uint, 0), ("thread", const, 64)])
    anon_union = b.struct("", 72, [("other", ulong, 0), ("", anon_struct, 0)], kind=btf.UNION)
    b.struct("task_struct", 200, [("state", uint, 0), ("pid", uint, 32), ("", anon_union, 512),
                                  ("nibble", nibble, 1600)])
    return b, 512 // 8 + 64 // 8 + 320 // 8


def test_the_offset_is_found_past_every_kind_through_anonymous_members_typedefs_and_bitfields():
    b, want = _kernel_like()
    found = btf.Btf(b.blob())
    assert len(found) == b.count
    assert found.offset_of("task_struct", "thread.fsbase", 8) == want == 112
    assert found.offset_of("task_struct", "pid", 4) == 4
    with pytest.raises(btf.BtfError, match="not a 4-byte integer at a byte offset"):
        found.offset_of("thread_struct", "es", 4)  # 16 bits wide: the kind_flag encoding was read
    with pytest.raises(btf.BtfError, match="not a 4-byte integer"):
        found.offset_of("task_struct", "thread.fsbase", 4)
    with pytest.raises(btf.BtfError, match="not a 4-byte integer at a byte offset"):
        found.offset_of("task_struct", "nibble", 4)
    with pytest.raises(btf.BtfError, match="no member gsbase in struct thread_struct"):
        found.offset_of("task_struct", "thread.gsbase", 8)
    with pytest.raises(btf.BtfError, match="no struct mm_struct"):
        found.offset_of("mm_struct", "pgd", 8)


@pytest.mark.parametrize("damage, message", [
    (lambda blob: blob[:10], "shorter than a BTF header"),
    (lambda blob: struct.pack("<H", 0x9FEB) + blob[2:], "not BTF"),
    (lambda blob: blob[:2] + b"\x02" + blob[3:], "BTF version 2"),
    (lambda blob: blob[:-5], "past the end"),
])
def test_a_damaged_blob_is_refused_with_the_reason(damage, message):
    b, _ = _kernel_like()
    with pytest.raises(btf.BtfError, match=message):
        btf.Btf(damage(b.blob()))


def test_an_unknown_kind_or_a_type_cut_short_is_refused_not_skipped():
    b = Builder()
    b.add("x", 31, 0, 0)
    with pytest.raises(btf.BtfError, match="kind 31, unknown"):
        btf.Btf(b.blob())
    b = Builder()
    b.struct("s", 8, [("a", 1, 0), ("b", 1, 32)])
    blob = b.blob()
    cut = blob[:12] + struct.pack("<I", len(b.types) - 4) + blob[16:]  # type_len 4 bytes short
    with pytest.raises(btf.BtfError, match="past the type section"):
        btf.Btf(cut)


def test_a_loop_of_typedefs_is_refused():
    b = Builder()
    b.add("a", btf.TYPEDEF, 0, 2)
    b.add("b", btf.TYPEDEF, 0, 1)
    b.struct("s", 8, [("x", 1, 0)])
    with pytest.raises(btf.BtfError, match="typedefs and qualifiers in a row"):
        btf.Btf(b.blob()).offset_of("s", "x", 8)


def test_without_btf_the_reason_is_given(tmp_path):
    assert btf.task_fsbase_offset(tmp_path / "vmlinux") == (
        f"no kernel BTF ({tmp_path / 'vmlinux'}: No such file or directory)")
    (tmp_path / "bad").write_bytes(b"\0" * 64)
    assert "not BTF" in btf.task_fsbase_offset(tmp_path / "bad")


@pytest.mark.skipif(not btf.VMLINUX.exists(), reason="the kernel has no BTF")
def test_the_running_kernels_task_struct_thread_fsbase():
    found = btf.Btf(Path(btf.VMLINUX).read_bytes())
    offset = btf.task_fsbase_offset()
    assert isinstance(offset, int)
    task = found.struct("task_struct")
    thread, _, _ = found.member(task, "thread")
    inner, _, _ = found.member(found.struct("thread_struct"), "fsbase")
    assert offset == (thread + inner) // 8 and 0 < offset < found.size(task)
