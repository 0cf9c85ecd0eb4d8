"""Analysis of a trace: replay it into the live state and summarise it.

The replay itself (series, phases, the state at a time) is :mod:`memrec.engine`, shared with the
exports, ``memrec.load`` and the TUI; what is here summarises what it gives, a sub-package per
family:

- :mod:`memrec.analysis.report.build`: ``build_report(trace)`` (:mod:`~memrec.analysis.report.build`)
  returns the report's typed sections (:mod:`~memrec.analysis.report.model`); the answer every
  view leads with (:mod:`~memrec.analysis.report.answer`) and the text
  (:mod:`~memrec.analysis.report.text`) read them.
- :mod:`memrec.analysis.diff.build`: two traces compared by rank, phase and GPU.
- :mod:`memrec.analysis.sglang`: SGLang's KV budget rebuilt from markers and the report's per-rank
  SGLang section.
- :mod:`memrec.analysis.untraced.split`: NVML beside the traced bytes (the "untraced" band) and its split.
- shared: :mod:`memrec.analysis.sections` (typed sections that serialise to the JSON),
  :mod:`memrec.analysis.names`, :mod:`memrec.analysis.text` (names, byte counts and tables).

Nothing here imports bcc, pynvml or textual.
"""
