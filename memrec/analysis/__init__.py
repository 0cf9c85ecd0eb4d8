"""Analysis of a trace: replay it into the live state and summarise it.

- :mod:`memrec.analysis.timeline`: per-GPU step series of bytes by category and by process.
- :mod:`memrec.analysis.phases`: phases from markers and the bytes each phase allocated.
- :mod:`memrec.analysis.report`: ``build_report(trace)`` and ``render_text(report)``.

Nothing here imports bcc, pynvml or textual.
"""
