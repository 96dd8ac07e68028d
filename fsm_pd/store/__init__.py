"""The journal (SQLite by default, any SQLAlchemy URL), its reader, and replay.

The names below load their modules on first use (PEP 562): SQLAlchemy costs a node's start 0.3 s, and a colocated
node, which keeps no journal, needs only the room-id limit (``store.limits``) from here.
"""

from __future__ import annotations

import sys
import types

from fsm_pd.runtime.lazy import lazy_exports

_HOME = {
    "Divergence": "replay",
    "Journal": "journal",
    "JournalError": "journal",
    "JournalReader": "reader",
    "JournalRow": "journal",
    "ReplayResult": "replay",
    "RoomReport": "replay",
    "SchemaVersionError": "journal",
    "VersionConflict": "journal",
    "read_journal": "reader",
    "replay": "replay",
    "write_rows": "journal",
}
__all__, __getattr__ = lazy_exports(__name__, _HOME)


class _Store(types.ModuleType):
    """This package, whose ``replay`` is replay's function, as when every name was imported up front: once loaded,
    the module ``store.replay`` would otherwise take the package's attribute of its name (Python binds it there)."""

    def __setattr__(self, name: str, value) -> None:
        if name in _HOME and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Store
