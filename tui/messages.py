"""Messages the data sources post to the app (the only way a source thread talks to it), and the
one the main screen's cursor worker posts to the screen.

``post_message`` is thread-safe; everything here is plain data. Floods are merged with
``can_replace``: Textual drops a pending message when the one queued after it can replace it,
so :class:`RecordsReceived` moves its records into the newer message before saying yes.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field

from textual.message import Message

from memrec.analysis.report.answer import Answer
from memrec.analysis.diff.build import Verdict
from memrec.tui.store import EventRows
from memrec.tui.views import CursorState


@dataclass
class RecordsReceived(Message):
    """Decoded trace records from the live daemon, in stream order."""

    records: list[dict] = field(default_factory=list)

    def can_replace(self, message: Message) -> bool:
        if isinstance(message, RecordsReceived):
            message.records[:0] = self.records
            self.records = []
            return True
        return False


@dataclass
class Connected(Message):
    """The live source subscribed to the daemon (again, after a reconnect when ``attempt`` > 1)."""

    path: str
    attempt: int


@dataclass
class Disconnected(Message):
    """The live connection ended; the source retries in ``retry_in`` seconds."""

    reason: str
    retry_in: float


@dataclass
class LoadProgress(Message):
    """A file source's progress: ``phase`` is "scan" (reading records) or "index" (replaying)."""

    phase: str
    done: int
    total: int

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, LoadProgress) and message.phase == self.phase


@dataclass
class Loaded(Message):
    """The file's start is read: the model can draw a first frame over the whole time range (the
    trailer's), while the rest of the file is read (:class:`Scanned`) and replayed (:class:`Indexed`)."""

    seconds: float


@dataclass
class Scanned(Message):
    """The whole file is read (every event, marker, NVML sample; the replay goes on)."""

    seconds: float


@dataclass
class Indexed(Message):
    """The replay reached the end: series and checkpoints cover the whole trace."""

    seconds: float


@dataclass
class SourceFailed(Message):
    """The source cannot go on (a file that became unreadable): one line for the user."""

    error: str


@dataclass
class CursorStateReady(Message):
    """The state at the cursor and the events around it, computed in a worker (``key`` says which
    request it answers; ``other``: diff mode, the other trace's state at the aligned time)."""

    key: tuple
    state: CursorState
    events: EventRows
    other: CursorState | None = None


@dataclass
class Answered(Message):
    """The trace's answer is known (:mod:`memrec.analysis.report.answer`, after the replay): the screen
    opens on it. ``verdict``: diff mode, what ``memrec diff`` says of the two runs, and ``other``
    the compared run's answer."""

    answer: Answer
    verdict: Verdict | None = None
    other: Answer | None = None
