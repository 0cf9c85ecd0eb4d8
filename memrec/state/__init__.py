"""The live memory state: who holds what, on which GPU, right now (:class:`LiveState`).

See :mod:`memrec.state.live` for the accounting and the modules; this package keeps the names
callers import.
"""

from memrec.terms.events import CATEGORY_INDEX
from memrec.terms.events import DRIVER
from memrec.terms.events import IPC_MAPPED
from memrec.state.fields import ALIAS_FIELDS
from memrec.state.fields import ALLOC_COLUMNS
from memrec.state.fields import ALLOC_FIELDS
from memrec.state.fields import EXIT_LARGEST
from memrec.state.fields import EXPORT_FIELDS
from memrec.state.fields import FABRIC_FIELDS
from memrec.state.fields import FAILURE_FIELDS
from memrec.state.fields import HANDLE_FIELDS
from memrec.state.fields import HELD_FIELDS
from memrec.state.fields import HOST_FIELDS
from memrec.state.fields import JOURNAL_FIELDS
from memrec.state.fields import LARGEST_FIELDS
from memrec.state.fields import MAP_FIELDS
from memrec.state.fields import MAX_FAILURES
from memrec.state.fields import OPEN_FIELDS
from memrec.state.fields import PEAK_FIELDS
from memrec.state.fields import SNAPSHOT_VERSION
from memrec.state.fields import Holding
from memrec.state.live import LiveState
from memrec.state.snapshot import alloc_rows

__all__ = [
    "ALIAS_FIELDS", "ALLOC_COLUMNS", "ALLOC_FIELDS", "CATEGORY_INDEX", "DRIVER", "EXIT_LARGEST", "EXPORT_FIELDS",
    "FABRIC_FIELDS", "FAILURE_FIELDS", "HANDLE_FIELDS", "HELD_FIELDS", "HOST_FIELDS", "IPC_MAPPED",
    "JOURNAL_FIELDS", "LARGEST_FIELDS", "MAP_FIELDS", "MAX_FAILURES", "OPEN_FIELDS", "PEAK_FIELDS",
    "SNAPSHOT_VERSION", "Holding", "LiveState", "alloc_rows",
]
