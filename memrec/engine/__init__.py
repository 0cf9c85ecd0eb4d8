"""The one replay engine: every tool that needs a trace's state over time gets it from here.

``memrec report``, ``memrec diff``, ``memrec.load`` (:mod:`memrec.api`), the exports and the TUI
model all replay a trace the same way, so a number read in one of them is the number every other
one shows:

- :mod:`memrec.engine.replay`: where a replay starts (:func:`~memrec.engine.replay.initial_state`),
  the span a trace covers (:func:`~memrec.engine.replay.trace_bounds`), one whole-trace replay
  (:func:`~memrec.engine.replay.build_timeline`, or :class:`~memrec.engine.replay.Replay` fed a
  chunk at a time) and the state at one event
  (:func:`~memrec.engine.replay.state_at`, nearest keyframe + the gap);
- :mod:`memrec.engine.source` and :mod:`memrec.engine.stream`: the report's and diff's passes over
  a trace's events a chunk at a time (:func:`~memrec.engine.source.scan_trace` first, then
  :func:`~memrec.engine.stream.replay_pass`), from the file or from loaded columns: memory that does
  not follow the events;
- :mod:`memrec.engine.journal`: the replay's journal (one row per change of a (gpu, pid,
  category) total, ``LiveState``'s own record) as columns;
- :mod:`memrec.engine.series`: step series built from the journal with numpy only: per GPU and
  (pid, category) for the whole-trace tools, per GPU and category, appended chunk by chunk, for
  the TUI;
- :mod:`memrec.engine.phases`: phases from markers with the one semantics documented in
  ``docs/report.md`` ("Phases"), and the bytes attributed to them;
- :mod:`memrec.engine.group`: grouped sums without ``np.unique(axis=0)`` (the sort that cost
  a whole-trace report 38 % of its time).

Everything after ``LiveState.apply`` is numpy over the journal's columns; the engine reads the
journal rows (``memrec.state.JOURNAL_FIELDS``), never LiveState's internals.
"""
