"""The Textual TUI (``memrec tui``): replay a trace, follow the daemon, compare two traces.

Only this package imports textual; :mod:`memrec.tui.model` and :mod:`memrec.tui.sources` do not,
so the model can be used (and benchmarked) without it.
"""
