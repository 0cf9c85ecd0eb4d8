"""Analysis of a trace: replay it into the live state and summarise it.

The replay itself (series, phases, the state at a time) is :mod:`memrec.engine`, shared with the
exports, ``memrec.load`` and the TUI; what is here summarises what it gives.

- :mod:`memrec.analysis.untraced.reconcile`: NVML beside the traced bytes (the "untraced" band).
- :mod:`memrec.analysis.sglang.kv_budget`: SGLang's KV budget rebuilt from markers.
- :mod:`memrec.analysis.sglang.section`: the report's per-rank SGLang section.
- :mod:`memrec.analysis.report.build`: ``build_report(trace)``; :mod:`memrec.analysis.report.answer` its first
  three lines; :mod:`memrec.analysis.report.text` ``render_text(report)``.
- :mod:`memrec.analysis.names`, :mod:`memrec.analysis.text`: names, byte counts and tables.
- :mod:`memrec.analysis.diff.build`: two traces compared by rank, phase and GPU.

Nothing here imports bcc, pynvml or textual.
"""
