"""Which TP/PP/DP rank a hooked SGLang process is, read without importing or calling anything
collective: SGLang's own parallel state, the hooked object, or the process title SGLang sets."""

from __future__ import annotations

import re
import sys
import time
from typing import Any

from memrec.sglang_hooks.state import STATE

_TITLE_RANK = re.compile(r"(?:^|_)(ATTN_CP|MOE_DP|DP|PP|TP|EP)(\d+)(?=_|$)")
_TITLE_KEYS = {"TP": "tp_rank", "PP": "pp_rank", "DP": "dp_rank", "EP": "ep_rank"}


def parse_proctitle(title: str) -> dict:
    """Ranks from SGLang's process title, e.g. ``sglang::scheduler_DP1_PP0_TP3_EP3``.

    ``MOE_DP``/``ATTN_CP`` ranks are skipped (their ``DP`` is not the data-parallel rank).
    """
    if "sglang::scheduler" not in title:
        return {}
    rest = title.split("sglang::scheduler", 1)[1].strip()
    suffix = rest.split()[0] if rest else ""
    out: dict = {}
    for m in _TITLE_RANK.finditer(suffix):
        key = _TITLE_KEYS.get(m.group(1))
        if key is not None:
            out[key] = int(m.group(2))
    return out


#: Seconds between two reads of /proc/self/cmdline while no SGLang title is found.
TITLE_REREAD_S = 1.0


def _proctitle() -> str:
    """This process's title: ``setproctitle.getproctitle()`` when SGLang has imported it (a
    cheap call), else ``/proc/self/cmdline``, read at most once a second."""
    if STATE.title_cache is not None:
        return STATE.title_cache
    title = ""
    spt = sys.modules.get("setproctitle")
    if spt is not None:
        try:
            title = str(spt.getproctitle())
        except Exception:
            title = ""
    if not title:
        now = time.monotonic()
        if now - STATE.title_read_at < TITLE_REREAD_S:
            return ""
        STATE.title_read_at = now
        try:
            with open("/proc/self/cmdline", "rb") as f:
                title = f.read(4096).replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:
            title = ""
    if "sglang::scheduler" in title:
        STATE.title_cache = title  # set once, before any model work: safe to keep
    return title


def _sglang_ranks() -> dict:
    """Ranks from SGLang's own state, without importing anything and without collectives."""
    out: dict = {}
    ctx = sys.modules.get("sglang.srt.runtime_context")  # 0.5.16+
    if ctx is not None:
        try:
            parallel = ctx.get_parallel()
        except Exception:
            parallel = None
        if parallel is not None:
            for key in ("tp_rank", "pp_rank", "dp_rank"):
                try:
                    value = getattr(parallel, key)
                except Exception:  # not published yet: RuntimeError / ValueError
                    continue
                if isinstance(value, int) and not isinstance(value, bool):
                    out[key] = value
    if "tp_rank" not in out:
        state = sys.modules.get("sglang.srt.distributed.parallel_state")  # every version
        if state is not None:
            for key, group in (("tp_rank", "_TP"), ("pp_rank", "_PP")):
                coordinator = getattr(state, group, None)
                value = getattr(coordinator, "rank_in_group", None) if coordinator is not None else None
                if isinstance(value, int) and not isinstance(value, bool) and key not in out:
                    out[key] = value
    return out


def ranks(obj: Any = None) -> dict:
    """``tp_rank``/``pp_rank``/``dp_rank`` of this process and where they came from.

    Sources, first found wins per key: SGLang's parallel state (``get_parallel()`` from 0.5.16,
    the ``_TP``/``_PP`` group coordinators before), the hooked object's own attributes (or its
    ``ps``), then the process title SGLang sets (``sglang::scheduler_TP{n}...``).
    """
    if STATE.rank_cache is not None:
        return dict(STATE.rank_cache)
    out = _sglang_ranks()
    source = "sglang" if out else None
    if obj is not None and not isinstance(obj, type):
        # The object's own attributes, else its ParallelState (``self.ps``: 0.5.13 – 0.5.20).
        holders = (obj, getattr(obj, "ps", None))
        for key in ("tp_rank", "pp_rank", "dp_rank"):
            for holder in holders:
                value = getattr(holder, key, None) if holder is not None else None
                if key not in out and isinstance(value, int) and not isinstance(value, bool):
                    out[key] = value
                    source = source or "object"
    if "tp_rank" not in out or "dp_rank" not in out:
        for key, value in parse_proctitle(_proctitle()).items():
            if key in ("tp_rank", "pp_rank", "dp_rank") and key not in out:
                out[key] = value
                source = source or "proctitle"
    if source:
        out["rank_source"] = source
    if source == "sglang" and "tp_rank" in out:
        STATE.rank_cache = dict(out)  # ranks do not change once the groups exist
    return out
