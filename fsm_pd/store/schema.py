"""The journal's schema (SQLAlchemy Core): the append-only transitions, one row per room, and metadata.

Version 2 (this one) adds, over version 1:

- the order of the unique index is (room, role, node, version), so one room's rows, and every room in room order,
  are index reads (``replay --room``, streaming replay); version 1 journals get a second index with that order;
- ``rooms``: one row per (room, role, node), written in the same group commit as the room's first row and updated in
  the one that ends it. It holds the request id (``rid``) the room was created for, when it opened, and, once
  finished, its final state and when. It is the journal's snapshot of open rooms (``closed_at IS NULL``: what a
  restarted node must rebuild), its index of request ids, and retention's list of what to archive.
"""

from __future__ import annotations

import logging

from sqlalchemy import (
    REAL,
    BigInteger,
    Column,
    Double,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
    bindparam,
    insert,
    select,
    update,
)

from fsm_pd.machines import TERMINAL
from fsm_pd.store.limits import MAX_ROOM  # noqa: F401 - its home was here

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2


metadata = MetaData()

# 64-bit ids and seconds on every database; SQLite keeps the DDL it always had (its INTEGER is 64-bit, its REAL 8
# bytes, and only "INTEGER PRIMARY KEY" makes seq the rowid), while PostgreSQL's INTEGER (32-bit) would refuse a room
# above 2**31 and its REAL (4 bytes) would round a Unix timestamp to minutes.
BIG = BigInteger().with_variant(Integer, "sqlite")
SECONDS = Double().with_variant(REAL, "sqlite")

transitions = Table(
    "transitions",
    metadata,
    Column("seq", BIG, primary_key=True, autoincrement=True),
    Column("node", Text, nullable=False),
    Column("role", Text, nullable=False),
    Column("room", BIG, nullable=False),
    Column("version", Integer, nullable=False),
    Column("trigger", Text, nullable=False),
    Column("src", Text, nullable=False),
    Column("dst", Text, nullable=False),
    Column("payload", Text, nullable=False),  # JSON: {"event": ..., "effects": [...], "ignored"?: ..., "reason"?: ...}
    Column("at", SECONDS, nullable=False),
    # room first: one room's rows and room-ordered scans are index reads; (node, role, room) lookups use it too
    UniqueConstraint("room", "role", "node", "version", name="uq_transition_version"),
    sqlite_autoincrement=True,
)

# What version 1 journals lack (their unique index leads with node); created when one is migrated.
ROOM_ORDER_INDEX_DDL = ("CREATE INDEX IF NOT EXISTS ix_transitions_room_order "
                        "ON transitions (room, role, node, version)")

rooms = Table(
    "rooms",
    metadata,
    Column("room", BIG, nullable=False),
    Column("role", Text, nullable=False),
    Column("node", Text, nullable=False),
    Column("rid", Text, nullable=True),  # the client's request id, from the create event (null when none was given)
    Column("opened_at", SECONDS, nullable=False),
    Column("final", Text, nullable=True),  # Success or Failed once the room ended, null while it is open
    Column("closed_at", SECONDS, nullable=True),  # the `at` of the row that ended it
    PrimaryKeyConstraint("room", "role", "node", name="pk_rooms"),
    Index("ix_rooms_rid", "rid"),
    Index("ix_rooms_closed_at", "closed_at"),  # open rooms (NULL) for recovery; the oldest finished for retention
)

journal_meta = Table(
    "journal_meta",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

COLUMNS = ("node", "role", "room", "version", "trigger", "src", "dst", "payload", "at")


def migrate_from_1(conn, target) -> None:
    """Version 1 to 2, in the opening transaction: the room-ordered index and the ``rooms`` table, built once."""
    log.warning("journal %s has schema version 1: building its room index and rooms table (once)", target)
    conn.exec_driver_sql(ROOM_ORDER_INDEX_DDL)
    t = transitions.c
    firsts = conn.execute(select(t.room, t.role, t.node, t.at).where(t.version == 0))
    opened = [{"room": r.room, "role": r.role, "node": r.node, "rid": None, "opened_at": r.at} for r in firsts]
    if opened:
        conn.execute(insert(rooms), opened)
    ends = conn.execute(select(t.room, t.role, t.node, t.dst, t.at)
                        .where(t.dst.in_(sorted(TERMINAL)), t.src.not_in(sorted(TERMINAL))))
    params = [{"k_room": r.room, "k_role": r.role, "k_node": r.node, "final": r.dst, "closed_at": r.at}
              for r in ends]
    if params:
        conn.execute(update(rooms).where(rooms.c.room == bindparam("k_room"), rooms.c.role == bindparam("k_role"),
                                         rooms.c.node == bindparam("k_node"))
                     .values(final=bindparam("final"), closed_at=bindparam("closed_at")), params)
    conn.execute(update(journal_meta).where(journal_meta.c.key == "schema_version").values(value=str(SCHEMA_VERSION)))
