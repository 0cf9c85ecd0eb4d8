"""Where the TUI's data comes from: a trace file, the live daemon, or two files to compare.

The app takes a source as an argument (tests pass their own). A source fills a
:class:`~memrec.tui.model.TraceModel` and reports through ``post`` (the app's thread-safe
``post_message``); it never touches widgets.

- :class:`FileSource`: scans the file once, keeping event chunks as columns decoded from the
  mapped file (no 10-million-row structured array), then replays it into the model's series in
  steps. The first frame waits for the file's start only (its trailer gives the time range): the
  rest of the scan goes on behind it (:class:`~memrec.tui.messages.Loaded`, then ``Scanned``).
- :class:`LiveSource`: a reader thread subscribes on the daemon's Unix socket, splits frames and
  posts :class:`RecordsReceived` (the model checks each record as a file's); when the daemon goes
  away it posts :class:`Disconnected` and reconnects with exponential backoff.
- :class:`DiffSource`: two file sources.

All three implement :class:`Source`, the one type the app takes.
"""

from __future__ import annotations

import gc
import os
import socket
import threading
import time
from typing import Callable
from typing import Protocol

from memrec.analysis.report.answer import Answer
from memrec.base.collector import paused
from memrec.tui import messages
from memrec.tui.model import TraceModel

Post = Callable[[object], object]


class Source(Protocol):
    """What the app draws from (like the trace writer's ``Sink`` on the other side).

    A source fills :attr:`model` (and :attr:`other_model`, comparing two traces) from a thread of
    its own, started by :meth:`start`, and reports only through ``post`` (the app's thread-safe
    ``post_message``): :class:`~memrec.tui.messages.Loaded`, ``Scanned`` and ``Indexed`` for a file,
    ``Connected``/``Disconnected``/``RecordsReceived`` for a live stream.
    """

    #: The model the view draws; a live source replaces it when the daemon starts a new stream.
    model: TraceModel
    #: Diff mode: the trace compared with :attr:`model` (None otherwise).
    other_model: TraceModel | None
    #: A stream that goes on (the view follows it, can pause, and reconnects); False: files read once.
    live: bool
    #: Set by the app: true while the user interacts (a file's replay then waits).
    busy: Callable[[], bool]

    @property
    def title(self) -> str:
        """What the status line calls the source."""

    def begin(self) -> None:
        """Start reading now, before the app can take messages (they wait for :meth:`start`):
        a file is scanned while Textual starts. Optional: :meth:`start` begins when not begun."""

    def start(self, post: Post) -> None:
        """Start delivering (returns at once)."""

    def new_model(self) -> TraceModel:
        """A fresh model for a new stream (live: the daemon restarted)."""

    def stop(self) -> None:
        """Stop and wait briefly for the thread; safe to call twice."""


class _Relay:
    """The ``post`` a source's thread gets: what it posts before the app can take messages is
    held, then passed on in order once :meth:`connect` gives the app's ``post_message``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[object] = []
        self._post: Post | None = None

    def __call__(self, message: object) -> None:
        with self._lock:
            if self._post is None:
                self._held.append(message)
                return
        self._post(message)

    def connect(self, post: Post) -> None:
        with self._lock:  # a message posted meanwhile waits here: the order holds
            for message in self._held:
                post(message)
            self._held, self._post = [], post


class _Threaded:
    """A source whose :meth:`run` is the body of a daemon thread of its own."""

    _stop: threading.Event
    _thread: threading.Thread | None = None

    def run(self, post: Post) -> None:
        raise NotImplementedError

    def begin(self) -> None:
        if self._thread is None:
            self._relay = _Relay()
            self._thread = threading.Thread(target=self._body, args=(self._relay,), name=f"memrec-{type(self).__name__}",
                                            daemon=True)
            self._thread.start()

    def start(self, post: Post) -> None:
        self.begin()
        self._relay.connect(post)

    def _body(self, post: Post) -> None:
        try:
            self.run(post)
        except Exception as error:  # no traceback over the screen (it is on stderr): the status line says it
            post(messages.SourceFailed(f"{type(error).__name__}: {error}"))

    @property
    def running(self) -> bool:
        """The thread is still at work (a file: reading, replaying, splitting the untraced band)."""
        return self._thread is not None and self._thread.is_alive()

    def _join(self) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
#: The largest trace whose untraced band the TUI splits itself (it keeps the replay's journal for it).
RECONCILE_MAX_EVENTS = 2_000_000
#: Threads that decode a file's chunks while it is scanned (ahead of the scan, in order): the
#: first frame waits for the scan, and decoding (zstd, numpy) runs without the GIL.
SCAN_THREADS = 2
#: Seconds between two progress messages of a file's replay: each wakes the UI thread, which redraws
#: the timeline (its exact part grows) holding the GIL that the replay needs.
PROGRESS_EVERY = 0.5


class FileSource(_Threaded):
    """A ``.mrec`` file.

    Raises (from :meth:`open`):
        OSError: the file cannot be read.
        TraceFormatError: not a memrec trace, or a newer format.
    """

    live = False
    other_model = None

    def __init__(self, path: str | os.PathLike, index_step: int = 131072, split_untraced: bool = True) -> None:
        self.path = os.fspath(path)
        self.index_step = index_step
        #: Split the untraced band once replayed (:meth:`reconcile`); a diff's other trace does not.
        self.split_untraced = split_untraced
        self.model = TraceModel()
        self._stop = threading.Event()
        self._reader = None
        self.identity: tuple[int, int, int] | None = None  # the file's, once opened
        #: Set by the app: true while the user interacts (the replay then pauses).
        self.busy: Callable[[], bool] = lambda: False

    @property
    def title(self) -> str:
        return os.path.basename(self.path)

    def open(self) -> None:
        """Check the file now (the command turns failures into exit codes)."""
        from memrec.trace.reader import TraceReader

        self._reader = TraceReader(self.path, read_size=16 << 20)
        #: The file this view reads: the answer's own read of the path must find the same one.
        self.identity = self._reader.identity()
        self.model.set_header(self._reader.header)

    def scan(self, post: Post | None = None, ready: Callable[[], object] | None = None) -> None:
        """Read every record into the model (events decoded straight from the mapped file; format-1
        columns stay views of it); fast, no replay.

        The records and warnings are the reader's (:meth:`~memrec.trace.reader.TraceReader.items`),
        the same every command gets.

        ``ready``: called once, as soon as the model can draw a first frame: the trace's end
        taken from the trailer in the file's last bytes (the time range), and the records up to
        and with the first events chunk (the keyframe at the start, the first events) read. The
        rest is read after it, waiting while ``busy()`` (the first frame being painted, the user
        pressing keys): the first frame no longer waits for every chunk to be decoded (100M
        events: 37 s)."""
        if self._reader is None:
            self.open()
        from memrec.trace.chunks import EVENTS
        from memrec.trace.format import MARKER
        from memrec.trace.records import deliver

        reader = self._reader
        model = self.model
        if ready is not None:
            trailer = reader.tail_trailer()
            end = trailer.get("end_ts") if trailer is not None else None
            if isinstance(end, int) and end >= 0:
                with model.lock:
                    model.t_end_hint = end  # a hint: the scan's checked trailer replaces it
        on_marker = model.add_marker  # (what its RecordSink on_marker calls)
        # The model keeps every marker and chunk and makes no cycles: the collector rests while it
        # grows (a step loop's 50,000 marker records set off collections that walked all of it), as
        # it does for the replay (index)
        with paused():
            for i, (kind, item) in enumerate(reader.items(mapped=True, threads=SCAN_THREADS)):
                if kind == MARKER:  # most records of a step loop's trace: no dispatch, and the
                    on_marker(item)  # checks below (stop, busy, progress) every 64th record only
                    if i % 64:
                        continue
                else:
                    deliver(kind, item, model)  # the model is a RecordSink, as load_trace's builder is
                if self._stop.is_set():
                    return
                if ready is not None and kind == EVENTS:
                    ready()
                    ready = None
                elif ready is None:
                    self._wait_while_busy()
                if post is not None and i % 64 == 0:
                    post(messages.LoadProgress("scan", i, 0))
        model.warnings.extend(reader.warnings)
        reader.close()
        if model.trailer is None:  # the last bytes' trailer was not one the scan could read: no end from it
            with model.lock:
                model.t_end_hint = None
        if ready is not None:  # a trace without events
            ready()

    def _wait_while_busy(self) -> None:
        """Leave the GIL to the UI thread while the user presses keys (or the first frame is
        being drawn): the scan and the replay are the app's background work."""
        while self.busy() and not self._stop.is_set():
            time.sleep(0.02)

    def index(self, post: Post | None = None) -> None:
        """Replay the events into the series (run in a worker thread).

        The replay is pure Python (LiveState): while the user is pressing keys (``busy()``), it
        waits, so that it never competes with the UI thread for the GIL.
        """
        model = self.model
        if self.split_untraced and model.store.n <= RECONCILE_MAX_EVENTS:
            model.keep_journal()  # for the untraced split (reconcile)
        # The replay makes no reference cycles; a full collection of the growing model, run by
        # whichever thread allocates (the UI's, often), stalled key presses by up to ~100 ms.
        # The collector rests until the replay is done (the app then freezes the model).
        gc.disable()
        told = 0.0
        try:
            while not self._stop.is_set():
                self._wait_while_busy()
                n = model.index_step(self.index_step)
                if not n:
                    break
                # at most PROGRESS_EVERY: each message wakes the UI thread, which then takes the GIL
                if post is not None and time.monotonic() - told >= PROGRESS_EVERY:
                    told = time.monotonic()
                    post(messages.LoadProgress("index", model.frontier, model.store.n))
        finally:
            gc.enable()

    def run(self, post: Post) -> None:
        """Scan (the app draws its first frame from the file's start while the rest is read),
        then replay (the worker thread's body)."""
        t = time.perf_counter()
        try:
            self.scan(post, ready=lambda: post(messages.Loaded(time.perf_counter() - t)))
        except Exception as error:  # a file that changed under us: say so, do not crash the UI
            post(messages.SourceFailed(f"{self.path}: {error}"))
            return
        if self._stop.is_set():
            return
        post(messages.Scanned(time.perf_counter() - t))
        self.index(post)
        if not self._stop.is_set():
            post(messages.Indexed(time.perf_counter() - t))
        if not self._stop.is_set() and self.reconcile():
            post(messages.Indexed(time.perf_counter() - t))  # the cursor's state now has the split
        if not self._stop.is_set():
            answered = self.answer()
            if answered is not None and not self._stop.is_set():
                post(messages.Answered(answered))

    def answer(self) -> Answer | None:
        """The trace's answer, as ``memrec report`` prints it first: the report of the file, read
        and replayed again in this thread after the TUI's own replay (the first frame and the
        replay never wait for it), in the report's bounded memory. None (the view keeps its own
        landmarks) when it cannot be had."""
        from memrec.analysis.report.build import trace_answer
        from memrec.engine.source import scan_trace

        try:  # the events read from the file a record at a time, as ``memrec report`` reads them
            return trace_answer(*scan_trace(self.path, same_as=self.identity))
        except Exception as error:  # noqa: BLE001 - a file that changed under us: the TUI goes on without
            self.model.warnings.append(f"no answer: {error}")
            return None

    def reconcile(self) -> bool:
        """Split the untraced band with ``memrec report``'s engine, over this model's own events and
        replay (its journal, kept: no second read or replay; only for traces up to
        :data:`RECONCILE_MAX_EVENTS`, the journal's memory); return whether the model got it."""
        model = self.model
        replayed = model.replayed()
        if replayed is None:
            if model.store.n > RECONCILE_MAX_EVENTS:
                model.untraced_note = f"over {RECONCILE_MAX_EVENTS:,} events: see memrec report"
            return False
        from memrec.analysis.untraced.reconcile import reconcile

        try:
            rec = reconcile(replayed[0], timeline=replayed[1])
        except Exception as error:  # the view says why; the rest of the TUI goes on
            model.untraced_note = f"cannot split the untraced band: {error}"
            return False
        model.reconciliation = rec
        model.untraced_note = "" if rec.process_sampling else "no NVML per-process samples in this trace"
        return True

    def new_model(self) -> TraceModel:
        return TraceModel()

    def stop(self) -> None:
        self._stop.set()
        self._join()


class DiffSource(_Threaded):
    """Two trace files: ``base`` is drawn, ``other`` is compared with it."""

    live = False

    def __init__(self, base: str | os.PathLike, other: str | os.PathLike) -> None:
        self.base = FileSource(base)
        self.other = FileSource(other, split_untraced=False)
        self.model = self.base.model
        self.other_model: TraceModel | None = self.other.model
        self.busy: Callable[[], bool] = lambda: False

    @property
    def title(self) -> str:
        return f"{self.base.title} vs {self.other.title}"

    def open(self) -> None:
        self.base.open()
        self.other.open()

    def run(self, post: Post) -> None:
        t = time.perf_counter()
        try:
            self.base.scan(post)
            self.other.scan(None)
        except Exception as error:
            post(messages.SourceFailed(str(error)))
            return
        post(messages.Loaded(time.perf_counter() - t))
        self.base.busy = self.other.busy = lambda: self.busy()  # the app sets ours later when begun early
        self.base.index(post)
        self.other.index(None)
        post(messages.Indexed(time.perf_counter() - t))
        if self.base.reconcile():  # the base's split, as a file source has it
            post(messages.Indexed(time.perf_counter() - t))
        if not self.base._stop.is_set():
            answered = self.answer()
            if answered is not None:
                post(answered)

    def answer(self) -> messages.Answered | None:
        """Both runs' answers and ``memrec diff``'s verdict on them (read and replayed again here,
        after the TUI's replays)."""
        from memrec.analysis.diff.build import diff_traces
        from memrec.analysis.diff.build import verdict_of
        from memrec.analysis.report.build import trace_answer
        from memrec.trace.reader import load_trace

        try:
            a, b = load_trace(self.base.path), load_trace(self.other.path)
            d = diff_traces(a, b, self.base.title, self.other.title)
            return messages.Answered(trace_answer(a), verdict_of(d), trace_answer(b))
        except Exception as error:  # noqa: BLE001 - the TUI goes on without
            self.model.warnings.append(f"no answer: {error}")
            return None

    def new_model(self) -> TraceModel:
        return TraceModel()

    def stop(self) -> None:
        self.base.stop()
        self.other.stop()
        self._join()


class LiveSource(_Threaded):
    """Follows a running daemon over its Unix socket (subscriber protocol).

    Args:
        path: the daemon's socket (default: ``$MEMREC_SOCKET`` or /run/memrec/memrec.sock).
        backoff: first and largest delay between reconnection attempts, seconds.
        max_events: events the live model keeps (older ones are dropped: memory stays bounded).
    """

    live = True
    other_model = None

    def __init__(self, path: str | None = None, backoff: tuple[float, float] = (0.2, 5.0), max_events: int = 2_000_000) -> None:
        from memrec.terms.protocol import socket_path

        self.path = socket_path(path)
        self.backoff = backoff
        self.max_events = max_events
        self.model = self.new_model()
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self.attempts = 0
        self.busy: Callable[[], bool] = lambda: False

    @property
    def title(self) -> str:
        return f"live {self.path}"

    def new_model(self) -> TraceModel:
        return TraceModel(max_events=self.max_events)

    def open(self) -> None:
        """Check that a daemon answers (raises OSError or ProtocolError when none does)."""
        from memrec.terms.protocol import ping

        ping(self.path, timeout=2.0)

    def run(self, post: Post) -> None:
        """Subscribe, and again with a growing delay whenever the connection ends (the thread's body)."""
        delay = self.backoff[0]
        while not self._stop.is_set():
            self.attempts += 1
            reason = self._session(post)
            if self._stop.is_set():
                break
            post(messages.Disconnected(reason, delay))
            if self._stop.wait(delay):
                break
            delay = min(delay * 2, self.backoff[1])
            if reason == "":
                delay = self.backoff[0]

    def _session(self, post: Post) -> str:
        """One connection: subscribe, stream records until it ends; return why it ended."""
        from memrec.terms.protocol import encode_frame
        from memrec.trace.frames import MAX_SUBSCRIBER_FRAME
        from memrec.trace.frames import FrameDecoder
        from memrec.trace.frames import FrameError

        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(2.0)
            sock.connect(self.path)
            sock.sendall(encode_frame({"type": "subscribe"}))
        except OSError as error:
            return f"cannot connect to {self.path}: {error.strerror or error}"
        self._sock = sock
        sock.settimeout(0.25)
        # records stay in wire form: the model checks and decodes them as a file's are
        decoder = FrameDecoder(MAX_SUBSCRIBER_FRAME, decode=False)
        post(messages.Connected(self.path, self.attempts))
        try:
            while not self._stop.is_set():
                try:
                    data = sock.recv(1 << 20)
                except socket.timeout:
                    continue
                if not data:
                    return "the daemon closed the connection"
                try:
                    records = decoder.feed(data)
                except FrameError as error:
                    if error.records:
                        post(messages.RecordsReceived(error.records))
                    return f"bad frame from the daemon: {error}"
                if records:
                    if any(r.get("type") == "error" for r in records):
                        msg = next(r for r in records if r.get("type") == "error").get("message", "")
                        return f"the daemon refused: {msg}"
                    post(messages.RecordsReceived(records))
            return ""
        except OSError as error:
            return f"connection lost: {error.strerror or error}"
        finally:
            self._sock = None
            sock.close()

    def stop(self) -> None:
        self._stop.set()
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._join()
