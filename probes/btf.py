"""Where a field of a kernel structure lies in the running kernel, read from its BTF
(``/sys/kernel/btf/vmlinux``).

Why: ``--stacks`` matches a CPython 3.10 thread state to the calling thread by its pthread id,
which on x86-64 is the thread's FS base, kept by the kernel in ``task_struct.thread.fsbase``.
Where that field lies changes with the kernel's version and configuration, and the kernel headers
a host has need not be the running kernel's (on the machine this was written on: 6.1 headers, a
6.18 kernel). The probe program is compiled once and cached, the same on every kernel, so the
offset is found here at run time and handed to it as data (:mod:`memrec.probes.pystacks`).

Only what that needs is read: the type section, struct and union members (the ``kind_flag``
bitfield encoding included), and the modifiers and typedefs between a member and its struct. The
file is untrusted input as far as this reader goes: its size, every offset and every walk are
bounded, and anything it does not understand raises :class:`BtfError` rather than guessing.
"""

from __future__ import annotations

import functools
import struct
from pathlib import Path

VMLINUX = Path("/sys/kernel/btf/vmlinux")
#: The largest BTF file read (the kernel's is a few MiB).
MAX_BYTES = 64 << 20
_MAGIC = 0xEB9F
_HEADER = struct.Struct("<HBBIIIII")
_TYPE = struct.Struct("<III")
_MEMBER = struct.Struct("<III")

# BTF_KIND_* (include/uapi/linux/btf.h)
INT, PTR, ARRAY, STRUCT, UNION, ENUM, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT = range(1, 12)
FUNC, FUNC_PROTO, VAR, DATASEC, FLOAT, DECL_TAG, TYPE_TAG, ENUM64 = range(12, 20)
#: Bytes that follow a type's 12-byte header: (fixed, per vlen entry), for every kind defined.
_TRAILING = {
    INT: (4, 0), PTR: (0, 0), ARRAY: (12, 0), STRUCT: (0, 12), UNION: (0, 12), ENUM: (0, 8), FWD: (0, 0),
    TYPEDEF: (0, 0), VOLATILE: (0, 0), CONST: (0, 0), RESTRICT: (0, 0), FUNC: (0, 0), FUNC_PROTO: (0, 8),
    VAR: (4, 0), DATASEC: (0, 12), FLOAT: (0, 0), DECL_TAG: (4, 0), TYPE_TAG: (0, 0), ENUM64: (0, 12),
}
#: Kinds that stand for the type they point to (skipped when resolving a member's type).
_ALIASES = frozenset({TYPEDEF, VOLATILE, CONST, RESTRICT, TYPE_TAG})
#: The most aliases followed, and the deepest anonymous struct/union searched, before giving up.
_MAX_CHAIN = 32


class BtfError(ValueError):
    """The BTF cannot be read, or does not hold what was asked for (the message says which)."""


class Btf:
    """The types of one BTF blob, indexed by id (ids start at 1; 0 is void)."""

    def __init__(self, data: bytes) -> None:
        if len(data) < _HEADER.size:
            raise BtfError(f"{len(data)} bytes: shorter than a BTF header")
        magic, version, _flags, hdr_len, type_off, type_len, str_off, str_len = _HEADER.unpack_from(data)
        if magic != _MAGIC:
            raise BtfError(f"magic 0x{magic:04x}, not 0x{_MAGIC:04x} (not BTF, or not little-endian)")
        if version != 1 or hdr_len < _HEADER.size:
            raise BtfError(f"BTF version {version}, header of {hdr_len} bytes: not understood")
        types = (hdr_len + type_off, hdr_len + type_off + type_len)
        strings = (hdr_len + str_off, hdr_len + str_off + str_len)
        if types[1] > len(data) or strings[1] > len(data):
            raise BtfError(f"sections past the end of {len(data)} bytes")
        self._data = memoryview(data)
        self._strings = bytes(data[strings[0]:strings[1]])
        #: the byte offset of each type's header, by id (index 0: void, no header)
        self._at = [0]
        at = types[0]
        while at < types[1]:
            if at + _TYPE.size > types[1]:
                raise BtfError(f"type {len(self._at)} cut off at byte {at}")
            _name, info, _size = _TYPE.unpack_from(data, at)
            kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
            if kind not in _TRAILING:
                raise BtfError(f"type {len(self._at)} is of kind {kind}, unknown to this reader")
            fixed, each = _TRAILING[kind]
            self._at.append(at)
            at += _TYPE.size + fixed + each * vlen
        if at != types[1]:
            raise BtfError(f"the last type runs {at - types[1]} bytes past the type section")

    def __len__(self) -> int:
        return len(self._at) - 1

    def _head(self, type_id: int) -> tuple[str, int, int, int, int]:
        """(name, kind, vlen, kind_flag, size or type) of ``type_id``."""
        if not 0 < type_id < len(self._at):
            raise BtfError(f"type id {type_id} out of range (1..{len(self)})")
        name_off, info, size = _TYPE.unpack_from(self._data, self._at[type_id])
        return self._name(name_off), (info >> 24) & 0x1F, info & 0xFFFF, info >> 31, size

    def _name(self, offset: int) -> str:
        if offset >= len(self._strings):
            raise BtfError(f"name at {offset} past the string section")
        end = self._strings.find(b"\0", offset)
        return self._strings[offset:end if end >= 0 else len(self._strings)].decode("utf-8", "replace")

    def size(self, type_id: int) -> int:
        """The size in bytes of struct, union, integer or enum ``type_id``."""
        return self._head(type_id)[4]

    def struct(self, name: str) -> int:
        """The id of the struct named ``name`` (its definition, not a forward declaration)."""
        for type_id in range(1, len(self._at)):
            head = self._head(type_id)
            if head[1] == STRUCT and head[0] == name:
                return type_id
        raise BtfError(f"no struct {name}")

    def resolve(self, type_id: int) -> int:
        """``type_id`` with its typedefs and qualifiers taken off."""
        for _ in range(_MAX_CHAIN):
            _name, kind, _vlen, _flag, target = self._head(type_id)
            if kind not in _ALIASES:
                return type_id
            type_id = target
        raise BtfError(f"more than {_MAX_CHAIN} typedefs and qualifiers in a row at type {type_id}")

    def member(self, type_id: int, name: str, depth: int = 0) -> tuple[int, int, int]:
        """(bit offset, type id, bitfield width or 0) of member ``name`` of struct or union
        ``type_id``, looked for in its anonymous struct and union members too (their offsets added)."""
        if depth > _MAX_CHAIN:
            raise BtfError(f"anonymous members nested more than {_MAX_CHAIN} deep")
        sname, kind, vlen, kind_flag, _size = self._head(type_id)
        if kind not in (STRUCT, UNION):
            raise BtfError(f"type {type_id} ({sname or 'anonymous'}) is not a struct or union")
        at = self._at[type_id] + _TYPE.size
        anonymous = []
        for i in range(vlen):
            name_off, member_type, offset = _MEMBER.unpack_from(self._data, at + i * _MEMBER.size)
            bits = offset & 0xFFFFFF if kind_flag else offset  # kind_flag: bitfield width in the top byte
            if name_off == 0:
                anonymous.append((bits, member_type))
            elif self._name(name_off) == name:
                return bits, member_type, offset >> 24 if kind_flag else 0
        for bits, member_type in anonymous:
            inner = self.resolve(member_type)
            if self._head(inner)[1] in (STRUCT, UNION):
                with_inner = self._member_or_none(inner, name, depth + 1)
                if with_inner is not None:
                    return bits + with_inner[0], with_inner[1], with_inner[2]
        raise BtfError(f"no member {name} in {'struct' if kind == STRUCT else 'union'} {sname or 'anonymous'}")

    def _member_or_none(self, type_id: int, name: str, depth: int) -> tuple[int, int, int] | None:
        try:
            return self.member(type_id, name, depth)
        except BtfError as error:
            if str(error).startswith("no member "):
                return None
            raise

    def offset_of(self, struct_name: str, path: str, size: int) -> int:
        """The byte offset of ``path`` ("thread.fsbase") in struct ``struct_name``, checked to be a
        whole-byte member of ``size`` bytes (an integer or a pointer)."""
        type_id = self.struct(struct_name)
        bits = width = 0
        for part in path.split("."):
            found, type_id, width = self.member(self.resolve(type_id), part)
            bits += found
        leaf = self.resolve(type_id)
        _name, kind, _vlen, _flag, leaf_size = self._head(leaf)
        leaf_size = 8 if kind == PTR else leaf_size
        if kind == INT:  # without kind_flag a bitfield is an INT narrower than its size, or at a bit offset
            (encoding,) = struct.unpack_from("<I", self._data, self._at[leaf] + _TYPE.size)
            width = width or (0 if (encoding & 0xFF, (encoding >> 16) & 0xFF) == (8 * leaf_size, 0) else 1)
        if bits % 8 or width or kind not in (INT, PTR, ENUM, ENUM64) or leaf_size != size:
            raise BtfError(f"{struct_name}.{path} is not a {size}-byte integer at a byte offset")
        return bits // 8


@functools.cache
def task_fsbase_offset(path: Path = VMLINUX) -> int | str:
    """The byte offset of ``task_struct.thread.fsbase`` in the running kernel, or why it is not
    known (a string). Read once per daemon: the kernel does not change under it."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as error:
        return f"no kernel BTF ({path}: {error.strerror})"
    if len(data) > MAX_BYTES:
        return f"{path} is larger than {MAX_BYTES >> 20} MiB"
    try:
        return Btf(data).offset_of("task_struct", "thread.fsbase", 8)
    except BtfError as error:
        return f"{path}: {error}"
