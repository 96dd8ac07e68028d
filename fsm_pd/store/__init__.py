"""The journal (SQLite by default, any SQLAlchemy URL), its reader, and replay."""

from fsm_pd.store.journal import (
    Journal,
    JournalError,
    JournalRow,
    SchemaVersionError,
    VersionConflict,
    read_journal,
    write_rows,
)
from fsm_pd.store.replay import Divergence, ReplayResult, RoomReport, replay

__all__ = [
    "Divergence",
    "Journal",
    "JournalError",
    "JournalRow",
    "ReplayResult",
    "RoomReport",
    "SchemaVersionError",
    "VersionConflict",
    "read_journal",
    "replay",
    "write_rows",
]
