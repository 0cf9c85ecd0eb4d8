"""Sources run in threads of their own (the :class:`~memrec.tui.sources.Source` protocol): what
reaches the app when one breaks."""

from __future__ import annotations


def test_a_source_thread_that_fails_says_so_in_one_message(trace_file):
    # GIVEN a file source whose replay breaks (a bug, a file changed under it)
    import threading

    from memrec.tui import messages
    from memrec.tui.sources import FileSource

    src = FileSource(trace_file)
    src.open()

    def broken(post=None):
        raise RuntimeError("replay broke")

    src.index = broken
    got = []
    done = threading.Event()

    def post(message):
        got.append(message)
        if isinstance(message, messages.SourceFailed):
            done.set()

    # WHEN it runs in its thread
    src.start(post)
    # THEN the app is told in one line (no traceback on the terminal)
    assert done.wait(10)
    assert got[-1].error == "RuntimeError: replay broke"
    src.stop()
