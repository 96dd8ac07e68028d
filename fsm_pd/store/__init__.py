"""The journal (SQLite by default, any SQLAlchemy URL), its reader, and replay."""

from fsm_pd.store.journal import (
    Journal,
    JournalError,
    JournalRow,
    SchemaVersionError,
    VersionConflict,
    write_rows,
)
from fsm_pd.store.reader import JournalReader, read_journal
from fsm_pd.store.replay import Divergence, ReplayResult, RoomReport, replay

__all__ = [
    "Divergence",
    "Journal",
    "JournalError",
    "JournalReader",
    "JournalRow",
    "ReplayResult",
    "RoomReport",
    "SchemaVersionError",
    "VersionConflict",
    "read_journal",
    "replay",
    "write_rows",
]
