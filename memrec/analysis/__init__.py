"""Analysis of a trace: replay it into the live state and summarise it.

- :mod:`memrec.analysis.timeline`: per-GPU step series of bytes by category and by process.
- :mod:`memrec.analysis.phases`: phases from markers and the bytes each phase allocated.
- :mod:`memrec.analysis.reconcile`: NVML beside the traced bytes (the "untraced" band).
- :mod:`memrec.analysis.kv_budget`: SGLang's KV budget rebuilt from markers.
- :mod:`memrec.analysis.sglang_report`: the report's per-rank SGLang section.
- :mod:`memrec.analysis.replay`: where a replay starts (keyframe at event 0) and the trace's span.
- :mod:`memrec.analysis.report`: ``build_report(trace)``; :mod:`memrec.analysis.answer` its first
  three lines; :mod:`memrec.analysis.report_text` ``render_text(report)``.
- :mod:`memrec.analysis.names`, :mod:`memrec.analysis.text`: names, byte counts and tables.
- :mod:`memrec.analysis.diff`: two traces compared by rank, phase and GPU.

Nothing here imports bcc, pynvml or textual.
"""
