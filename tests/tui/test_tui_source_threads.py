"""Sources run in threads of their own (the :class:`~memrec.tui.sources.Source` protocol): what
reaches the app when one breaks, and when a source is begun before the app can take messages."""

from __future__ import annotations

import threading

from memrec.tui import messages
from memrec.tui.sources import FileSource


def start_until(src: FileSource, last: type) -> list:
    """Start ``src`` with a ``post`` that keeps every message; return them once one of type
    ``last`` came (within 10 s)."""
    got = []
    done = threading.Event()

    def post(message):
        got.append(message)
        if isinstance(message, last):
            done.set()

    src.start(post)
    assert done.wait(10)
    return got


def test_a_source_thread_that_fails_says_so_in_one_message(trace_file):
    # GIVEN a file source whose replay breaks (a bug, a file changed under it)
    src = FileSource(trace_file)
    src.open()

    def broken(post=None):
        raise RuntimeError("replay broke")

    src.index = broken
    # WHEN it runs in its thread
    got = start_until(src, messages.SourceFailed)
    # THEN the app is told in one line (no traceback on the terminal)
    assert got[-1].error == "RuntimeError: replay broke"
    src.stop()


def test_a_source_begun_before_the_app_holds_its_messages_until_started(trace_file):
    # GIVEN a file source begun before there is an app to post to (the command begins it while
    # the app's modules load; the app when it is built), which reads and replays the whole file
    src = FileSource(trace_file)
    src.open()
    src.begin()
    for _ in range(1000):
        if not src.running:
            break
        threading.Event().wait(0.01)
    assert src.model.indexed and src.model.store.n
    # WHEN the app starts it
    got = start_until(src, messages.Indexed)
    # THEN the app gets every message, in the order they were posted: loaded (the first frame),
    # scanned (the whole file read), indexed (replayed)
    kinds = [type(m).__name__ for m in got]
    assert kinds.index("Loaded") < kinds.index("Scanned") < kinds.index("Indexed")
    assert all(k in ("LoadProgress", "Loaded", "Scanned", "Indexed", "Answered") for k in kinds)
    src.stop()
