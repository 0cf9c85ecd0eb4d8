"""USDT probes of an ELF file: the ``.note.stapsdt`` notes and their argument specs, read as data.

Why here and not bcc's USDT support: bcc attaches USDT probes per process (it writes the
semaphore into each pid's memory) and compiles the argument reading into the program for one
binary. memrec attaches once per file for every process on the host: the kernel raises the
semaphore in each process that maps the file (the uprobe's ``ref_ctr_offset``), and the BPF
program decodes the arguments from a spec table (``usdt_specs`` in ``torch.bpf.c``), so
different builds (PyTorch releases, compilers) with different argument forms share one program.

A note (SystemTap SDT v3, ``NT_STAPSDT`` = 3, owner ``stapsdt``) holds the probe's address, the
``.stapsdt.base`` address the linker saw (a prelinked or moved file shifts both by the same
amount), the semaphore's address (0: none), and three strings: provider, name, argument specs.
On x86-64 an argument spec is ``SIZE@OPERAND`` where SIZE is 1, 2, 4 or 8 bytes, negative when
signed, and OPERAND a register (``%rax``, ``%dl``), a memory operand (``-56(%rbp)``, ``(%rdi)``)
or a constant (``$5``). Anything else (``%rip``-relative, index registers, another
architecture's syntax) is refused with its reason: a probe is attached only when every argument
it needs is read exactly.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from memrec.probes.elfsyms import read_bytes
from memrec.probes.elfsyms import read_layout

NT_STAPSDT = 3
_SHT_NOTE = 7
NOTE_SECTION = ".note.stapsdt"
BASE_SECTION = ".stapsdt.base"
#: The most arguments a spec holds (the BPF side's array size; SDT allows 12).
MAX_ARGS = 12
#: The most notes read from one file (PyTorch has a handful; a hostile file gets no more).
MAX_NOTES = 4096

# Argument kinds, as torch.bpf.c reads them.
ARG_CONST, ARG_REG, ARG_DEREF = 1, 2, 3

#: x86-64 register name (any width) -> offset of the full register in ``struct pt_regs``.
_PT_REGS = {"r15": 0, "r14": 8, "r13": 16, "r12": 24, "rbp": 32, "rbx": 40, "r11": 48, "r10": 56, "r9": 64,
            "r8": 72, "rax": 80, "rcx": 88, "rdx": 96, "rsi": 104, "rdi": 112, "rip": 128, "rsp": 152}
_ALIASES = {
    "rax": ("eax", "ax", "al"), "rbx": ("ebx", "bx", "bl"), "rcx": ("ecx", "cx", "cl"), "rdx": ("edx", "dx", "dl"),
    "rsi": ("esi", "si", "sil"), "rdi": ("edi", "di", "dil"), "rbp": ("ebp", "bp", "bpl"), "rsp": ("esp", "sp", "spl"),
}
REGISTERS: dict[str, int] = dict(_PT_REGS)
for _full, _names in _ALIASES.items():
    REGISTERS.update({n: _PT_REGS[_full] for n in _names})
for _i in range(8, 16):
    REGISTERS.update({f"r{_i}{s}": _PT_REGS[f"r{_i}"] for s in ("d", "w", "b")})

_SPEC = re.compile(r"^(-?)(1|2|4|8)@(.+)$")
_MEMORY = re.compile(r"^(-?(?:0x[0-9a-fA-F]+|\d+))?\(%([a-z0-9]+)\)$")


class UsdtError(ValueError):
    """An argument spec memrec cannot read exactly."""


@dataclass(frozen=True)
class UsdtArg:
    """One argument: how the BPF program reads it.

    Attributes:
        kind: ARG_CONST (``value`` is the argument), ARG_REG (the register at ``reg_off`` of
            pt_regs) or ARG_DEREF (memory at that register + ``value``).
        reg_off: the register's offset in ``struct pt_regs``.
        value: the constant, or the memory operand's displacement.
        size: bytes (1, 2, 4, 8); the value read is cut to them.
        signed: sign-extended from ``size`` bytes, else zero-extended.
    """

    kind: int
    reg_off: int
    value: int
    size: int
    signed: bool

    def pack(self) -> bytes:
        """As ``struct usdt_arg`` in torch.bpf.c (u64 value, u32 kind, u32 reg_off, u32 shift, u32 signed)."""
        return struct.pack("<qIIII", self.value, self.kind, self.reg_off, 64 - 8 * self.size, int(self.signed))


@dataclass(frozen=True)
class UsdtProbe:
    """One probe site of a file.

    Attributes:
        provider, name: e.g. ``pytorch``, ``malloc``.
        offset: the file offset of the probe's nop (where the uprobe goes).
        semaphore: the file offset of its semaphore (the uprobe's ``ref_ctr_offset``), 0: none.
        spec: the argument specs as the note spells them.
        args: the parsed arguments, or None when ``error`` says why they cannot be read.
    """

    provider: str
    name: str
    offset: int
    semaphore: int
    spec: str
    args: tuple[UsdtArg, ...] | None
    error: str | None = None


def parse_arg(text: str) -> UsdtArg:
    """One x86-64 argument spec (``-8@%rax``, ``-1@%dl``, ``-8@-56(%rbp)``, ``4@$3``).

    Raises:
        UsdtError: a form that is not read exactly (why in the message).
    """
    m = _SPEC.match(text)
    if not m:
        raise UsdtError(f"argument {text!r}: not SIZE@OPERAND")
    signed, size, operand = m.group(1) == "-", int(m.group(2)), m.group(3)
    if operand.startswith("$"):
        try:
            return UsdtArg(ARG_CONST, 0, int(operand[1:], 0), size, signed)
        except ValueError:
            raise UsdtError(f"argument {text!r}: a constant that is not a number") from None
    if operand.startswith("%"):
        reg = REGISTERS.get(operand[1:])
        if reg is None or operand[1:] == "rip":
            raise UsdtError(f"argument {text!r}: register {operand} is not read")
        return UsdtArg(ARG_REG, reg, 0, size, signed)
    mm = _MEMORY.match(operand)
    if mm:
        reg = REGISTERS.get(mm.group(2))
        if reg is None or mm.group(2) == "rip":
            raise UsdtError(f"argument {text!r}: base register %{mm.group(2)} is not read")
        return UsdtArg(ARG_DEREF, reg, int(mm.group(1) or "0", 0), size, signed)
    raise UsdtError(f"argument {text!r}: operand form {operand!r} is not read")


def parse_args(spec: str) -> tuple[UsdtArg, ...]:
    """Every argument of a note's spec string (empty: no arguments).

    Raises:
        UsdtError: more than MAX_ARGS, or one argument that cannot be read.
    """
    parts = spec.split()
    if len(parts) > MAX_ARGS:
        raise UsdtError(f"{len(parts)} arguments, more than {MAX_ARGS}")
    return tuple(parse_arg(p) for p in parts)


def _notes(data: bytes) -> list[bytes]:
    """The descriptors of the ``stapsdt`` notes in a note section's bytes."""
    out, at = [], 0
    while at + 12 <= len(data) and len(out) < MAX_NOTES:
        namesz, descsz, kind = struct.unpack_from("<III", data, at)
        name_at = at + 12
        desc_at = name_at + ((namesz + 3) & ~3)
        end = desc_at + ((descsz + 3) & ~3)
        if end > len(data) or desc_at + descsz > len(data):
            break
        if kind == NT_STAPSDT and data[name_at:name_at + namesz].rstrip(b"\0") == b"stapsdt":
            out.append(data[desc_at:desc_at + descsz])
        at = end
    return out


def read_probes(fd: int) -> list[UsdtProbe]:
    """Every USDT probe of the ELF file ``fd`` (empty: the file has none).

    A probe whose address or semaphore lies outside the file's loaded bytes, or whose arguments
    cannot be read exactly, is returned with ``args=None`` and the reason in ``error``.

    Raises:
        ElfError: not an ELF64 LE file, or its tables are out of bounds.
        OSError: the file cannot be read.
    """
    layout = read_layout(fd)
    note = next((s for s in layout.sections if s.name == NOTE_SECTION and s.type == _SHT_NOTE), None)
    if note is None:
        return []
    base = layout.section(BASE_SECTION)
    probes = []
    for desc in _notes(read_bytes(fd, note.offset, note.size)):
        if len(desc) < 24:
            continue
        pc, link_base, sem = struct.unpack_from("<QQQ", desc, 0)
        strings = desc[24:].split(b"\0")
        if len(strings) < 3:
            continue
        provider, name, spec = (s.decode(errors="replace") for s in strings[:3])
        if base is not None and link_base:
            pc += base.addr - link_base
            if sem:
                sem += base.addr - link_base
        offset = layout.file_offset(pc)
        sem_offset = layout.file_offset(sem) if sem else 0
        error = None
        args: tuple[UsdtArg, ...] | None = None
        if offset is None:
            error = f"probe address {pc:#x} is outside the file's loaded bytes"
        elif sem_offset is None:
            error = f"semaphore address {sem:#x} is outside the file's loaded bytes"
        else:
            try:
                args = parse_args(spec)
            except UsdtError as exc:
                error = str(exc)
        probes.append(UsdtProbe(provider, name, offset or 0, sem_offset or 0, spec, args, error))
    return probes


