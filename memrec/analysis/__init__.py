"""Analysis of a trace: replay it into the live state and summarise it.

The replay itself (series, phases, the state at a time) is :mod:`memrec.engine`, shared with the
exports, ``memrec.load`` and the TUI; what is here summarises what it gives.

- :mod:`memrec.analysis.reconcile`: NVML beside the traced bytes (the "untraced" band).
- :mod:`memrec.analysis.kv_budget`: SGLang's KV budget rebuilt from markers.
- :mod:`memrec.analysis.sglang_report`: the report's per-rank SGLang section.
- :mod:`memrec.analysis.report`: ``build_report(trace)``; :mod:`memrec.analysis.answer` its first
  three lines; :mod:`memrec.analysis.report_text` ``render_text(report)``.
- :mod:`memrec.analysis.names`, :mod:`memrec.analysis.text`: names, byte counts and tables.
- :mod:`memrec.analysis.diff`: two traces compared by rank, phase and GPU.

Nothing here imports bcc, pynvml or textual.
"""
