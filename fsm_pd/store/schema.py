"""The journal's schema (SQLAlchemy Core). One append-only table of transitions, one row of metadata."""

from __future__ import annotations

from sqlalchemy import REAL, Column, Integer, MetaData, String, Table, Text, UniqueConstraint

SCHEMA_VERSION = 1

# The largest bootstrap room a journal can hold: SQLite's INTEGER is signed 64-bit. SGLang's router draws rooms below
# 2**63 too, so every room a real router sends fits; anything larger is refused before a room is created.
MAX_ROOM = 2**63 - 1

metadata = MetaData()

transitions = Table(
    "transitions",
    metadata,
    Column("seq", Integer, primary_key=True, autoincrement=True),
    Column("node", Text, nullable=False),
    Column("role", Text, nullable=False),
    Column("room", Integer, nullable=False),
    Column("version", Integer, nullable=False),
    Column("trigger", Text, nullable=False),
    Column("src", Text, nullable=False),
    Column("dst", Text, nullable=False),
    Column("payload", Text, nullable=False),  # JSON: {"event": ..., "effects": [...], "ignored"?: ..., "reason"?: ...}
    Column("at", REAL, nullable=False),
    UniqueConstraint("node", "role", "room", "version", name="uq_transition_version"),
    sqlite_autoincrement=True,
)

journal_meta = Table(
    "journal_meta",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

COLUMNS = ("node", "role", "room", "version", "trigger", "src", "dst", "payload", "at")
