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


def test_a_source_begun_before_the_app_holds_its_messages_until_started(trace_file):
    # GIVEN a file source begun before there is an app to post to (the command begins it while
    # the app's modules load; the app when it is built)
    import threading

    from memrec.tui import messages
    from memrec.tui.sources import FileSource

    src = FileSource(trace_file)
    src.open()
    src.begin()
    for _ in range(1000):  # it reads and replays (and is done) without anyone to tell
        if not src.running:
            break
        threading.Event().wait(0.01)
    assert src.model.indexed and src.model.store.n
    got = []
    done = threading.Event()

    def post(message):
        got.append(message)
        if isinstance(message, messages.Indexed):
            done.set()

    # WHEN the app starts it
    src.start(post)
    # THEN the app gets every message, in the order they were posted: loaded before indexed
    assert done.wait(10)
    kinds = [type(m).__name__ for m in got]
    assert kinds.index("Loaded") < kinds.index("Indexed")
    assert all(k in ("LoadProgress", "Loaded", "Indexed") for k in kinds)
    src.stop()
