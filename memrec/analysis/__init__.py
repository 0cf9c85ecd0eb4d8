"""Analysis of a trace: replay it into the live state and summarise it.

- :mod:`memrec.analysis.timeline`: per-GPU step series of bytes by category and by process.
- :mod:`memrec.analysis.phases`: phases from markers and the bytes each phase allocated.
- :mod:`memrec.analysis.reconcile`: NVML beside the traced bytes (the "untraced" band).
- :mod:`memrec.analysis.kv_budget`: SGLang's KV budget rebuilt from markers.
- :mod:`memrec.analysis.sglang_report`: the report's per-rank SGLang section.
- :mod:`memrec.analysis.report`: ``build_report(trace)`` and ``render_text(report)``.
- :mod:`memrec.analysis.diff`: two traces compared by rank, phase and GPU.

Nothing here imports bcc, pynvml or textual.
"""
