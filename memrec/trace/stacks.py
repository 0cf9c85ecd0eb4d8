"""Stacks of allocations in a trace (format 2.3): frames, the interning writers do, the table readers build.

An event that has a stack names it in its ``stack`` column (0: no stack recorded). A stack is
its frames, innermost first, or :class:`Unavailable` with the reason memrec could not read it
(the interpreter's layout unknown, the thread's memory unreadable): a stack that could not be
read is never confused with one that was not asked for (0), nor shown as a wrong stack.

Strings, frames and stacks are each written once per file, in ``stacks`` records that a writer
emits before the first event chunk that names them (:class:`StackInterner`). Every file holds
the definitions of every id its events use, so each rotated part of a recording reads on its
own; ``memrec merge`` interns each file's stacks again into the merged file's ids. The wire
form of one ``stacks`` record (every key optional)::

    {"type": "stacks",
     "s0": first string id,  "s": [str, ...],                          ids s0, s0+1, ...
     "f0": first frame id,   "f": [file, line, function, native, ...]  4 ints a frame; file and
                                                                       function are string ids
     "k0": first stack id,   "k": [[frame id, ...] | reason, ...]}     a list: the frames,
                                                                       innermost first; an int:
                                                                       unavailable, the reason's
                                                                       string id

String and frame ids count from 0, stack ids from 1 (0 is "none"). A record may only name ids
defined before it or in it (strings before frames before stacks), so no cycle can be written;
a reader refuses a record that names an id not defined yet, defines an id twice, or exceeds the
bounds below (:func:`check_stacks_record`), and skips it with the other malformed records.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Hashable
from typing import Iterable
from typing import Sequence

from memrec.base.errors import TraceFormatError
from memrec.trace.budget import ReadBudget

#: The record type of stack definitions.
STACKS = "stacks"
#: The most frames a stack may have (a reader refuses more; writers cut outer frames).
MAX_DEPTH = 512
#: The longest string a reader accepts (a path, a qualified function name), in characters.
MAX_STRING = 4096
#: The most entries (strings + frames + stacks) one record may define.
MAX_ENTRIES = 1 << 16
#: The most ids of each kind one file may define: a table bounded whatever the file claims.
MAX_IDS = 1 << 24


@dataclasses.dataclass(frozen=True, slots=True)
class Frame:
    """One frame of a stack.

    A Python frame: ``file``, ``line``, ``function`` (the qualified name where the interpreter
    has it, e.g. ``CustomAllreduce.__init__``). A native frame (``native``): ``file`` is the
    module (the mapped file's path), ``line`` the offset of the return address in it and
    ``function`` the symbol ("" when none covers it); :attr:`module`, :attr:`offset` and
    :attr:`symbol` name them so.
    """

    file: str
    line: int
    function: str
    native: bool = False

    @property
    def module(self) -> str:
        return self.file

    @property
    def offset(self) -> int:
        return self.line

    @property
    def symbol(self) -> str:
        return self.function

    def label(self) -> str:
        """``file:line function`` (a native one: ``module+0xoffset symbol``), as views print it."""
        if self.native:
            return f"{self.file}+0x{self.line:x} {self.function or '?'}".rstrip()
        return f"{self.file}:{self.line} {self.function}".rstrip()


@dataclasses.dataclass(frozen=True, slots=True)
class Unavailable:
    """A stack memrec was asked for and could not read, and why (e.g. ``"python 3.9: no offsets"``)."""

    reason: str


#: What a stack id stands for: the frames, innermost first, or why there are none.
Stack = tuple[Frame, ...] | Unavailable


class StackInterner:
    """The ids one file gives its strings, frames and stacks, and the definitions not written yet.

    A writer owns one (its file's ids): :meth:`intern` returns a stack's id, defining what is new;
    :meth:`take_record` hands the new definitions as one ``stacks`` record, which the writer emits
    before the next events chunk. Repeated stacks cost a dict lookup: by ``key`` (any hashable the
    caller already has, e.g. the BPF program's stack id) when given, else by the frames.
    """

    def __init__(self) -> None:
        self._strings: dict[str, int] = {}
        self._frames: dict[Frame, int] = {}
        self._stacks: dict[Stack, int] = {}
        self._keys: dict[Hashable, int] = {}
        self._new_strings: list[str] = []
        self._new_frames: list[int] = []
        self._new_stacks: list[list[int] | int] = []
        self._first = (0, 0, 1)  # the first new string, frame and stack id of the pending record

    @property
    def stacks(self) -> int:
        """How many stacks are defined (written or pending)."""
        return len(self._stacks)

    def intern(self, stack: Sequence[Frame] | Unavailable, key: Hashable | None = None) -> int:
        """The id of ``stack`` (frames innermost first, or Unavailable) in this file, defining it if new.

        Raises:
            ValueError: more than :data:`MAX_DEPTH` frames, or a string readers would refuse.
            TypeError: not frames nor Unavailable.
        """
        if key is not None:
            found = self._keys.get(key)
            if found is not None:
                return found
        if not isinstance(stack, Unavailable):
            stack = tuple(stack)
        found = self._stacks.get(stack)
        if found is None:
            found = self._define(stack)
        if key is not None:
            self._keys[key] = found
        return found

    def _define(self, stack: Stack) -> int:
        if isinstance(stack, Unavailable):
            entry: list[int] | int = self._string(stack.reason)
        else:
            if len(stack) > MAX_DEPTH:
                raise ValueError(f"a stack of {len(stack)} frames: at most {MAX_DEPTH} (cut the outer ones)")
            entry = [self._frame(frame) for frame in stack]
        if len(self._stacks) + 1 >= MAX_IDS:
            raise ValueError(f"more than {MAX_IDS} stacks in one file")
        number = len(self._stacks) + 1
        self._stacks[stack] = number
        self._new_stacks.append(entry)
        return number

    def _frame(self, frame: Frame) -> int:
        found = self._frames.get(frame)
        if found is None:
            if not isinstance(frame, Frame):
                raise TypeError(f"a stack's frames must be Frame, not {type(frame).__name__}")
            if not 0 <= frame.line < 2**63:
                raise ValueError(f"frame line/offset {frame.line} out of range")
            names = (self._string(frame.file), self._string(frame.function))  # before the frame is kept
            found = self._frames[frame] = len(self._frames)
            self._new_frames += (names[0], frame.line, names[1], int(frame.native))
        return found

    def _string(self, text: str) -> int:
        found = self._strings.get(text)
        if found is None:
            if not isinstance(text, str):
                raise TypeError(f"a frame's names must be str, not {type(text).__name__}")
            if len(text) > MAX_STRING:
                raise ValueError(f"a name of {len(text)} characters: at most {MAX_STRING}")
            found = self._strings[text] = len(self._strings)
            self._new_strings.append(text)
        return found

    def pending(self) -> bool:
        """Whether definitions wait to be written."""
        return bool(self._new_stacks or self._new_frames or self._new_strings)

    def take_record(self) -> dict | None:
        """The ``stacks`` record of the definitions made since the last one (None: nothing new)."""
        if not self.pending():
            return None
        rec = _record(self._first, self._new_strings, self._new_frames, self._new_stacks)
        self._first = (len(self._strings), len(self._frames), len(self._stacks) + 1)
        self._new_strings, self._new_frames, self._new_stacks = [], [], []
        return rec

    def whole_record(self) -> dict | None:
        """One ``stacks`` record defining everything interned so far, pending included (a live
        subscriber that joins mid-file needs the definitions the file already holds)."""
        if not self._stacks and not self._strings:
            return None
        frames: list[int] = []
        for frame in self._frames:
            frames += (self._strings[frame.file], frame.line, self._strings[frame.function], int(frame.native))
        stacks = [self._strings[s.reason] if isinstance(s, Unavailable) else [self._frames[f] for f in s]
                  for s in self._stacks]
        return _record((0, 0, 1), list(self._strings), frames, stacks)


def _record(first: tuple[int, int, int], strings: list[str], frames: list[int], stacks: list) -> dict:
    """A ``stacks`` record: the strings, frames and stacks from ids ``first``, empty lists left out."""
    rec: dict[str, Any] = {"type": STACKS}
    for (first_key, key), start, values in zip((("s0", "s"), ("f0", "f"), ("k0", "k")), first, (strings, frames, stacks)):
        if values:
            rec[first_key], rec[key] = start, values
    return rec


@dataclasses.dataclass(frozen=True)
class StackDefs:
    """One checked ``stacks`` record: what it defines, ids already resolved to their first one."""

    s0: int
    strings: list[str]
    f0: int
    frames: list[int]  # 4 ints a frame, as on the wire
    k0: int
    stacks: list[list[int] | int]


def _int(value: Any, lo: int, hi: int, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value < hi:
        raise TraceFormatError(f"malformed stacks record: {what} is not an integer in [{lo}, {hi})")
    return value


def check_stacks_record(obj: dict, budget: ReadBudget | None = None) -> StackDefs:
    """The definitions of one ``stacks`` record, its shape and bounds checked (ids against the
    table are checked when it is added: :meth:`StackTable.add`). ``budget``: charged a row per
    entry and the strings' bytes.

    Raises:
        OverBudget: past ``budget``.
        TraceFormatError: a key of the wrong type, a count past the bounds.
    """
    strings = obj.get("s", [])
    frames = obj.get("f", [])
    stacks = obj.get("k", [])
    for name, value in (("s", strings), ("f", frames), ("k", stacks)):
        if not isinstance(value, list):
            raise TraceFormatError(f"malformed stacks record: {name} is not a list")
    entries = len(strings) + len(frames) // 4 + len(stacks)
    if entries > MAX_ENTRIES:
        raise TraceFormatError(f"malformed stacks record: {entries} entries, at most {MAX_ENTRIES}")
    if len(frames) % 4:
        raise TraceFormatError("malformed stacks record: f does not hold 4 integers a frame")
    if not all(isinstance(s, str) and len(s) <= MAX_STRING for s in strings):
        raise TraceFormatError(f"malformed stacks record: s holds a non-string or one past {MAX_STRING} characters")
    for value in frames:
        _int(value, 0, 2**63, "a frame field")
    depth = 0
    for stack in stacks:
        if isinstance(stack, list):
            if len(stack) > MAX_DEPTH:
                raise TraceFormatError(f"malformed stacks record: a stack of {len(stack)} frames, at most {MAX_DEPTH}")
            for frame in stack:
                _int(frame, 0, MAX_IDS, "a frame id")
            depth += len(stack)
        else:
            _int(stack, 0, MAX_IDS, "an unavailable stack's reason")
    if budget is not None:
        budget.spend(rows=entries + depth, nbytes=sum(len(s) for s in strings))
    return StackDefs(_int(obj.get("s0", 0), 0, MAX_IDS, "s0"), strings, _int(obj.get("f0", 0), 0, MAX_IDS, "f0"),
                     frames, _int(obj.get("k0", 1), 1, MAX_IDS, "k0"), stacks)


class StackTable:
    """Every stack a trace defines, by id: what a loaded trace (``Trace.stacks``) and a live
    model hold. ``stack(id)`` gives the frames (innermost first) or :class:`Unavailable`."""

    def __init__(self) -> None:
        self._strings: dict[int, str] = {}
        self._frames: dict[int, Frame] = {}
        self._stacks: dict[int, Stack] = {}

    def __len__(self) -> int:
        return len(self._stacks)

    def __bool__(self) -> bool:
        return bool(self._stacks)

    def __contains__(self, stack_id: object) -> bool:
        return stack_id in self._stacks

    def ids(self) -> list[int]:
        """Every stack id defined, ascending."""
        return sorted(self._stacks)

    def stack(self, stack_id: int) -> Stack | None:
        """The stack ``stack_id`` names; None for 0 (no stack) or an id the trace does not define
        (its record was damaged)."""
        return self._stacks.get(int(stack_id))

    def add(self, defs: StackDefs) -> None:
        """Take one record's definitions. All or nothing: a record naming an id that is not
        defined (here or before), or defining one twice, changes nothing.

        Raises:
            TraceFormatError: such a record (readers skip it with the other malformed ones).
        """
        strings = self._strings  # nothing is kept before every id is checked
        new_strings = {defs.s0 + i: s for i, s in enumerate(defs.strings)}
        new_frames: dict[int, Frame] = {}
        for i in range(0, len(defs.frames), 4):
            file, line, function, native = defs.frames[i : i + 4]
            names = [new_strings.get(n, strings.get(n)) for n in (file, function)]
            if None in names:
                raise TraceFormatError("malformed stacks record: a frame names a string that is not defined")
            new_frames[defs.f0 + i // 4] = Frame(names[0], line, names[1], bool(native))
        new_stacks: dict[int, Stack] = {}
        for i, entry in enumerate(defs.stacks):
            if isinstance(entry, int):
                reason = new_strings.get(entry, strings.get(entry))
                if reason is None:
                    raise TraceFormatError("malformed stacks record: an unavailable stack names a string that is not defined")
                new_stacks[defs.k0 + i] = Unavailable(reason)
                continue
            frames = tuple(new_frames.get(f) or self._frames.get(f) for f in entry)
            if None in frames:
                raise TraceFormatError("malformed stacks record: a stack names a frame that is not defined")
            new_stacks[defs.k0 + i] = frames  # type: ignore[assignment]
        for mine, new, what in ((self._strings, new_strings, "string"), (self._frames, new_frames, "frame"),
                                (self._stacks, new_stacks, "stack")):
            if not new.keys().isdisjoint(mine) or max(new, default=0) >= MAX_IDS:
                raise TraceFormatError(f"malformed stacks record: defines a {what} id again")
        self._strings.update(new_strings)
        self._frames.update(new_frames)
        self._stacks.update(new_stacks)

    def items(self) -> Iterable[tuple[int, Stack]]:
        """``(id, stack)`` for every stack, by id."""
        return sorted(self._stacks.items())

    def id_map(self, interner: StackInterner) -> dict[int, int]:
        """Each of this table's ids → the id ``interner`` gives the same stack (merging files)."""
        return {number: interner.intern(stack) for number, stack in self.items()}
