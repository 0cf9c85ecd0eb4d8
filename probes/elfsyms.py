"""The function symbols of an ELF shared object and the file offsets a uprobe takes.

Why not bcc's symbol resolver: a warm start does not load libbcc at all (see ``bpfsys``). A
uprobe is placed at a *file offset*: the symbol's virtual address moved into the loadable
segment that holds it (``vaddr - p_vaddr + p_offset``), which is what bcc computes too.
Only what the probes need is read: 64-bit little-endian ELF, ``.dynsym`` and ``.symtab`` (libcuda),
the section names and ``.note.stapsdt`` (PyTorch's USDT probes, :mod:`memrec.probes.usdt`).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

_STT_FUNC, _STT_GNU_IFUNC = 2, 10
_SHT_SYMTAB, _SHT_DYNSYM = 2, 11
_PT_LOAD = 1
#: Bounds on what is read from an untrusted file: tables past these are refused, not read.
_MAX_TABLE = 256 << 20


class ElfError(ValueError):
    """The file is not a 64-bit little-endian ELF file this reader understands."""


def _read(fd: int, offset: int, size: int) -> bytes:
    if size < 0 or size > _MAX_TABLE:
        raise ElfError(f"table of {size} bytes at {offset}")
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise ElfError(f"truncated at {offset}+{size}")
    return data


@dataclass(frozen=True)
class Section:
    """One section header: its name, type, virtual address, file offset and size."""

    name: str
    type: int
    addr: int
    offset: int
    size: int


@dataclass(frozen=True)
class Layout:
    """What maps a virtual address of the file to the file offset a uprobe takes."""

    #: (p_vaddr, p_vaddr + p_filesz, p_offset) of each loadable segment.
    segments: tuple[tuple[int, int, int], ...]
    sections: tuple[Section, ...]
    #: The raw section headers (name, type, flags, addr, offset, size, link, info, align, entsize).
    raw_sections: tuple[tuple[int, ...], ...]

    def file_offset(self, vaddr: int) -> int | None:
        """The file offset of ``vaddr``, or None when no loadable segment's file bytes hold it."""
        for lo, hi, off in self.segments:
            if lo <= vaddr < hi:
                return vaddr - lo + off
        return None

    def section(self, name: str) -> Section | None:
        """The first section named ``name``."""
        return next((sec for sec in self.sections if sec.name == name), None)


def read_layout(fd: int) -> Layout:
    """The loadable segments and the named sections of the ELF file ``fd``.

    Raises:
        ElfError: not an ELF64 LE file, or its tables are out of bounds.
        OSError: the file cannot be read.
    """
    head = _read(fd, 0, 64)
    if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        raise ElfError("not a 64-bit little-endian ELF file")
    phoff, shoff = struct.unpack_from("<QQ", head, 32)
    phentsize, phnum, shentsize, shnum, shstrndx = struct.unpack_from("<HHHHH", head, 54)
    if phentsize < 56 or shentsize < 64:
        raise ElfError("odd header sizes")
    segments = []
    phdrs = _read(fd, phoff, phentsize * phnum)
    for i in range(phnum):
        p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz = struct.unpack_from("<IIQQQQ", phdrs, i * phentsize)
        if p_type == _PT_LOAD:
            segments.append((p_vaddr, p_vaddr + p_filesz, p_offset))
    shdrs = _read(fd, shoff, shentsize * shnum)
    raw = tuple(struct.unpack_from("<IIQQQQIIQQ", shdrs, i * shentsize) for i in range(shnum))
    names = _read(fd, raw[shstrndx][4], raw[shstrndx][5]) if 0 < shstrndx < shnum else b""
    sections = []
    for sh_name, sh_type, _f, sh_addr, sh_offset, sh_size, *_rest in raw:
        end = names.find(b"\0", sh_name)
        name = names[sh_name:end if end >= 0 else len(names)].decode(errors="replace") if sh_name < len(names) else ""
        sections.append(Section(name, sh_type, sh_addr, sh_offset, sh_size))
    return Layout(tuple(segments), tuple(sections), raw)


def read_bytes(fd: int, offset: int, size: int) -> bytes:
    """``size`` bytes at ``offset`` of the file (bounded like every table read here)."""
    return _read(fd, offset, size)


#: One Elf64_Sym.
_SYM = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"), ("value", "<u8"),
                 ("size", "<u8")])


def _symbol_tables(fd: int, layout: Layout):
    """Yield (symbols, file offsets, string table) of ``.symtab`` and ``.dynsym``, in file order.

    The one reader of symbol tables here, in numpy: PyTorch's and CUDA's libraries hold hundreds
    of thousands of symbols, and reading them one by one in Python took the daemon seconds per
    library. Only defined symbols with a value are kept; a symbol whose bytes no loadable segment
    holds (``.bss``) has offset -1.
    """
    sections = layout.raw_sections
    for _n, sh_type, _f, _a, sh_offset, sh_size, sh_link, _i, _al, sh_entsize in sections:
        if sh_type not in (_SHT_SYMTAB, _SHT_DYNSYM) or sh_entsize != _SYM.itemsize or sh_link >= len(sections):
            continue
        table = np.frombuffer(_read(fd, sh_offset, sh_size - sh_size % _SYM.itemsize), dtype=_SYM)
        table = table[(table["shndx"] != 0) & (table["value"] != 0)]
        offsets = np.full(len(table), -1, dtype=np.int64)
        for lo, hi, off in reversed(layout.segments):  # the first segment that holds it wins
            inside = (table["value"] >= lo) & (table["value"] < hi)
            offsets[inside] = table["value"][inside].astype(np.int64) - lo + off
        yield table, offsets, _read(fd, sections[sh_link][4], sections[sh_link][5])


def _is_function(table: np.ndarray) -> np.ndarray:
    kind = table["info"] & 0xF
    return (kind == _STT_FUNC) | (kind == _STT_GNU_IFUNC)


def _name(strtab: bytes, at: int) -> bytes:
    end = strtab.find(b"\0", at)
    return strtab[at:end if end >= 0 else len(strtab)]


class FunctionTable:
    """The function symbols of one file, by file offset, for naming native return addresses.

    The tables are taken whole and a name is decoded only when a frame lands in it.
    """

    def __init__(self, fd: int) -> None:
        starts, names, strtabs = [], [], []
        for table, offsets, strtab in _symbol_tables(fd, read_layout(fd)):
            keep = _is_function(table) & (offsets >= 0)
            starts.append(offsets[keep])
            names.append(np.stack([np.full(int(keep.sum()), len(strtabs), dtype=np.int64),
                                   table["name"][keep].astype(np.int64)], axis=1))
            strtabs.append(strtab)
        start = np.concatenate(starts) if starts else np.zeros(0, dtype=np.int64)
        order = np.argsort(start, kind="stable")
        self._starts = start[order]
        self._names = np.concatenate(names)[order] if names else np.zeros((0, 2), dtype=np.int64)
        self._strtabs = strtabs

    def __len__(self) -> int:
        return len(self._starts)

    def name_at(self, offset: int) -> str:
        """``function+0xN`` for the function whose symbol is the last at or before ``offset``, or ""."""
        at = int(np.searchsorted(self._starts, offset, side="right")) - 1
        if at < 0:
            return ""
        table, name = (int(v) for v in self._names[at])
        label = _name(self._strtabs[table], name).decode(errors="replace")
        return f"{label}+0x{offset - int(self._starts[at]):x}"


def function_offsets(fd: int, prefix: bytes = b"") -> dict[str, int]:
    """Map each defined function symbol starting with ``prefix`` to its uprobe file offset.

    Raises:
        ElfError: not an ELF64 LE file, or its tables are out of bounds.
        OSError: the file cannot be read.
    """
    found: dict[str, int] = {}
    for table, offsets, strtab in _symbol_tables(fd, read_layout(fd)):
        keep = np.flatnonzero(_is_function(table) & (offsets >= 0))
        for at, offset in zip(table["name"][keep].tolist(), offsets[keep].tolist()):
            name = _name(strtab, at)
            if name.startswith(prefix):
                found.setdefault(name.decode(errors="replace"), offset)
    return found


def symbol_offsets(fd: int, names: frozenset[bytes]) -> dict[str, int]:
    """Map each defined symbol (data too) named in ``names`` to its file offset (symbols whose
    bytes are not in the file, ``.bss``, are left out).

    Raises:
        ElfError, OSError: as :func:`function_offsets`.
    """
    found: dict[str, int] = {}
    for table, offsets, strtab in _symbol_tables(fd, read_layout(fd)):
        keep = np.flatnonzero(offsets >= 0)
        for at, offset in zip(table["name"][keep].tolist(), offsets[keep].tolist()):
            name = _name(strtab, at)
            if name in names:
                found.setdefault(name.decode(), offset)
    return found
