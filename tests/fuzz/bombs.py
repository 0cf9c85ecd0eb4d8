"""Small files that decompress to a lot (issue 23, item 7): what the reader budgets must stop.

- :func:`keyframe_bomb`: keyframes whose ``state_z`` is one Zstandard frame of a msgpack map
  holding a long list (of zeros, or of empty lists: each byte of it becomes a Python object). A
  9.6 KB file made ``report`` use 2.4 GB and ``dump`` 2.66 GB.
- :func:`rows_bomb`: format-2 event chunks of 65,536 rows whose every column is constant: 51
  bytes each, so a 14 KB file held 16.7 M events (``report`` 1.45 GB, the TUI 2.2 GB).

Both are valid traces in every other way (a real header, checksums that match).
"""

from __future__ import annotations

import numpy as np

from memrec.terms.columns import EVENT_DTYPE
from memrec.terms.events import Kind
from memrec.trace import codec
from memrec.trace import format as fmt

from tests.fuzz.edges import header


def _list_header(n: int) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big")


def state_bomb_frame(items: int, empty_lists: bool) -> bytes:
    """One Zstandard frame (size declared, checksum) of a keyframe state (msgpack) of ``items``
    zeros or empty lists under ``"handles"``, compressed 1 MiB at a time (never all in memory)."""
    import zstandard

    head = b"\x82" + fmt.packb("v") + fmt.packb(2) + fmt.packb("handles") + _list_header(items)
    block = (b"\x90" if empty_lists else b"\x00") * (1 << 20)
    c = zstandard.ZstdCompressor(level=codec.LEVEL, write_checksum=True).compressobj(size=len(head) + items)
    parts = [c.compress(head)]
    for start in range(0, items, len(block)):
        parts.append(c.compress(block[: min(len(block), items - start)]))
    return b"".join(parts) + c.flush()


def keyframe_bomb(keyframes: int = 4, items: int = 256 << 20, empty_lists: bool = False) -> bytes:
    """A trace of one ordinary allocation and ``keyframes`` keyframes, each a state of ``items``
    msgpack items (256 Mi zeros: 256 MiB decompressed, ~8 KB compressed)."""
    frame = state_bomb_frame(items, empty_lists)
    records = [fmt.packb(header()), fmt.encode_record({"type": "events", "events": _rows(1, constant=False)})]
    records += [fmt.packb({"type": "keyframe", "ts": 1000 + i, "event_index": 1, "state_z": frame})
                for i in range(keyframes)]
    return b"".join(records)


def _rows(n: int, constant: bool = True) -> np.ndarray:
    ev = np.zeros(n, EVENT_DTYPE)
    ev["kind"] = int(Kind.CTX) if constant else int(Kind.ALLOC)
    ev["pid"] = ev["tid"] = 7
    ev["ts"] = 1000
    ev["size"] = 0 if constant else 1 << 20
    ev["ptr"] = 0 if constant else 0x1000
    return ev


def rows_bomb(chunks: int = 256) -> bytes:
    """A trace of ``chunks`` event chunks of 65,536 constant rows each (~51 bytes a chunk)."""
    chunk = fmt.encode_record({"type": "events", "events": _rows(65536)})
    return fmt.packb(header()) + chunk * chunks
