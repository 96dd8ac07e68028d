"""The transition journal: append-only, write-ahead, group-committed.

A ``Journal`` is one database (a SQLite file by default, any SQLAlchemy URL accepted). Writers buffer rows with
``add`` and make them durable with ``flush``, one transaction per batch: the runtime flushes once per step, after
deciding every queued event and before running any of their effects, so journaling many rooms at once costs one
commit. ``durability`` maps to SQLite's ``synchronous``: ``full`` fsyncs every commit (a committed transition
survives power loss), ``normal`` survives a process crash but not power loss (WAL), ``off`` leaves it to the OS.

The same commit keeps the ``rooms`` table current (``schema.py``): a room's first row inserts its row there, the row
that ends it records the final state. That table is what lets a restarted node read only its open rooms, and
replay find a room, a request id or the failures without reading the whole history. A version 1 journal is migrated
to version 2 when a writer opens it (its rows are kept as they are; the room index and table are built once).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from sqlalchemy import bindparam, insert, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from fsm_pd.machines import TERMINAL
from fsm_pd.store.database import (  # noqa: F401 - DURABILITY is re-exported
    DURABILITY,
    DatabaseUrlError,
    create_journal_engine,
    journal_name,
    journal_url,
    ping,
)
from fsm_pd.store.room_filter import RoomFilter
from fsm_pd.store.schema import (
    COLUMNS,
    SCHEMA_VERSION,
    journal_meta,
    metadata,
    migrate_from_1,
    rooms,
    transitions,
)

log = logging.getLogger(__name__)


class JournalError(RuntimeError):
    """The journal cannot be opened, read or written."""


class SchemaVersionError(JournalError):
    """The journal was written by an incompatible version of fsm-pd."""


class VersionConflict(JournalError):
    """Two writers journaled the same (node, role, room, version): the room's history would fork."""


class JournalClosed(JournalError):
    """A flush after ``close``: the rows are not journaled, so their effects must not run."""


class JournalRow(NamedTuple):
    """One journaled transition as read back. A NamedTuple: a streamed replay builds a million of them."""

    seq: int
    node: str
    role: str
    room: int
    version: int
    trigger: str
    src: str
    dst: str
    payload: dict
    at: float

    @property
    def event(self) -> dict:
        return self.payload.get("event", {})


def _url(target: str | os.PathLike) -> str:
    return journal_url(target)


def _engine(url: str, durability: str) -> Engine:
    """The writer's engine (database.py: SQLite pragmas, PostgreSQL's synchronous_commit and timeouts)."""
    try:
        return create_journal_engine(url, durability)
    except DatabaseUrlError as exc:
        raise JournalError(str(exc)) from exc


class Journal:
    """One journal database. ``add`` buffers, ``flush`` commits the buffer in one transaction."""

    def __init__(self, target: str | os.PathLike, *, durability: str = "full"):
        self.url = _url(target)
        self._last_ok = time.monotonic()  # when the database last answered (keep_alive)
        self.name = journal_name(target)  # for messages: a URL's password masked
        self.durability = durability
        try:
            self.engine = _engine(self.url, durability)
            with self.engine.begin() as conn:
                metadata.create_all(conn)
                found = conn.execute(select(journal_meta.c.value).where(journal_meta.c.key == "schema_version"))
                found = found.scalar_one_or_none()
                if found is None:
                    conn.execute(insert(journal_meta).values(key="schema_version", value=str(SCHEMA_VERSION)))
                elif found == "1":
                    migrate_from_1(conn, target)
                    found = str(SCHEMA_VERSION)
        except SQLAlchemyError as exc:
            raise JournalError(f"cannot open journal {self.name}: {getattr(exc, 'orig', None) or exc}") from exc
        if found is not None and found != str(SCHEMA_VERSION):
            raise SchemaVersionError(
                f"journal {self.name} has schema version {found}; this fsm-pd reads and writes version {SCHEMA_VERSION}"
            )
        dialect = self.engine.dialect
        # for_executemany: no RETURNING of the new seq (PostgreSQL would add one; nobody reads it)
        self._insert = str(insert(transitions).compile(dialect=dialect, column_keys=list(COLUMNS),
                                                       for_executemany=True))
        self._open_room = str(insert(rooms).compile(
            dialect=dialect, column_keys=["room", "role", "node", "rid", "opened_at"]))
        self._close_room = str(update(rooms).where(
            rooms.c.room == bindparam("k_room"), rooms.c.role == bindparam("k_role"),
            rooms.c.node == bindparam("k_node")).values(final=bindparam("final"), closed_at=bindparam("closed_at"))
            .compile(dialect=dialect))
        self.retention = None  # a ``Retention`` (retention.py) that archives finished rooms after some flushes
        # driver-level like the insert: through SQLAlchemy's connection wrapper a lookup costs ~0.5 ms, raw ~0.04 ms
        self._room_lookup = str(select(transitions.c.seq).where(
            transitions.c.node == bindparam("node"), transitions.c.role == bindparam("role"),
            transitions.c.room == bindparam("room")).compile(dialect=self.engine.dialect))
        self._pending: list[tuple] = []
        self._flushing: list[tuple] = []  # the rows a flush is committing (``_flush``)
        # what has_room may skip the database for (room_filter.py): made at its first question, fed by every room's
        # first row (a room is journaled from version 0; the database and the rows buffered then hold the older ones)
        self._rooms: RoomFilter | None = None
        self._rooms_lock = threading.Lock()
        self._rooms_held = str(select(transitions.c.node, transitions.c.role, transitions.c.room).distinct()
                               .compile(dialect=dialect))
        # A flush writes through a driver connection of the engine's pool: through SQLAlchemy's connection and
        # transaction wrappers it cost about 0.2 ms of Python besides the database's work, a fifth of a simulated
        # request (``bench/sim_scale.py``) and time on a node's loop between steps. A SQLite file's connection is
        # kept from flush to flush; a server's is checked out each time, so that the pool's pre-ping replaces one
        # that died with a restarted server.
        self._writer = None
        self._keep_writer = self._explicit_begin = dialect.name == "sqlite"  # its driver's transactions are off
        # One flush at a time on the writer connection: a node's loop flushes, and ``close`` flushes from another
        # thread, which may come while the loop is still inside a flush (``KVManager.close`` gives up joining the
        # loop after 5 s); a DB-API connection must not run two transactions at once.
        self._write_lock = threading.RLock()
        self._closed = False
        self.rows_written = 0
        self.commits = 0

    def add(self, node: str, role: str, room: int, version: int, trigger: str, src: str, dst: str,
            payload: str, at: float) -> None:
        """Buffer one row; ``payload`` is already JSON text."""
        with self._rooms_lock:
            self._pending.append((node, role, room, version, trigger, src, dst, payload, at))
            if self._rooms is not None and version == 0:
                self._rooms.add(node, role, room)

    def add_rows(self, rows: list[tuple]) -> None:
        """Buffer ready-made row tuples in ``COLUMNS`` order (the node loop's batch). A row's payload is its JSON
        text, or a callable that returns it, called when the rows are written (``Node.step``'s, below)."""
        with self._rooms_lock:
            self._pending.extend(rows)
            if self._rooms is not None:
                # a room's first row (version 0) names it: its later rows would set the same bits again, 6 us a row
                # on the thread that steps the rooms (a handoff's five on the model thread of --role pd)
                keys = [row[:3] for row in rows if row[3] == 0]
                if keys:
                    self._rooms.add_many(keys)

    def has_room(self, node: str, role: str, room: int) -> bool:
        """Whether ``node`` ever journaled ``room`` in ``role``, counting rows buffered but not yet flushed.

        Callable from any thread: it reads through its own pooled connection (WAL lets it run beside the writer),
        and the unique (room, role, node, version) index answers it without a scan.
        """
        with self._rooms_lock:
            if self._rooms is None:  # rows not yet flushed are counted here, later ones by add
                self._rooms = RoomFilter(self._held_rooms, [*self._flushing, *self._pending])
            elif not self._rooms.maybe(node, role, room):
                return False
        node_col, role_col, room_col = 0, 1, 2
        # the writer swaps the list on flush, and keeps the rows it commits in ``_flushing`` until they are in: read
        # in the order rows move (buffered, being written, in the file), so a row moving meanwhile is found once
        for row in (*self._pending, *self._flushing):
            if row[room_col] == room and row[node_col] == node and row[role_col] == role:
                return True
        try:
            conn = self.engine.raw_connection()
            try:
                cursor = conn.cursor()
                cursor.execute(self._room_lookup, (node, role, room))
                found = cursor.fetchone()  # the first match is enough; SQLite stops there
                cursor.close()
            finally:
                conn.close()  # back to the pool
        except (SQLAlchemyError, self.engine.dialect.dbapi.Error) as exc:
            raise JournalError(f"journal {self.name} read failed: {getattr(exc, 'orig', None) or exc}") from exc
        return found is not None

    def _held_rooms(self) -> list[tuple[str, str, int]]:
        """Every (node, role, room) in the database (``RoomFilter``'s thread)."""
        conn = self.engine.raw_connection()
        try:
            cursor = conn.cursor()
            cursor.execute(self._rooms_held)
            return [(node, role, int(room)) for node, role, room in cursor.fetchall()]
        finally:
            conn.close()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def flush(self) -> int:
        """Commit every buffered row in one transaction; returns how many. Nothing is kept on failure. Thread-safe:
        a flush waits for one running on another thread; after ``close`` it raises ``JournalClosed``."""
        with self._write_lock:
            if self._closed:
                raise JournalClosed(f"journal {self.name} is closed")
            return self._flush()

    def _flush(self) -> int:
        with self._rooms_lock:  # a row added on another thread while the list is swapped lands in one or the other
            rows, self._pending = self._pending, []
            self._flushing = rows  # until committed, ``has_room`` finds them here
        if not rows:
            return 0
        try:
            return self._write(rows)
        finally:
            self._flushing = []

    def _write(self, rows: list[tuple]) -> int:
        rows = [row if type(row[7]) is str else (*row[:7], row[7](), row[8]) for row in rows]
        opened, closed = _room_changes(rows)
        dbapi = self.engine.dialect.dbapi
        try:
            if self._writer is None:
                self._writer = self.engine.raw_connection()  # the engine's connect events (pragmas) still run
            cursor = self._writer.cursor()
            try:
                if self._explicit_begin:
                    cursor.execute("BEGIN")
                # the compiled Core statements, through the driver's executemany: no dict built per row
                cursor.executemany(self._insert, rows)
                if opened:
                    cursor.executemany(self._open_room, opened)
                if closed:
                    cursor.executemany(self._close_room, closed)
                self._writer.commit()
            finally:
                cursor.close()
            if not self._keep_writer:
                self._writer, writer = None, self._writer
                writer.close()  # back to the pool
        except (dbapi.Error, SQLAlchemyError) as exc:
            self._drop_writer()
            if isinstance(exc, dbapi.IntegrityError):
                raise VersionConflict(f"a (node, role, room, version) was journaled twice: {exc}") from exc
            raise JournalError(f"journal {self.name} write failed: {getattr(exc, 'orig', None) or exc}") from exc
        self.rows_written += len(rows)
        self.commits += 1
        self._last_ok = time.monotonic()
        if self.retention is not None:
            self.retention.after_flush(self)
        return len(rows)

    def _drop_writer(self) -> None:
        """After a failed flush: roll back, and leave the connection (it may be broken) for the next flush to
        replace."""
        writer, self._writer = self._writer, None
        if writer is None:
            return
        try:
            writer.rollback()
            writer.close()
        except Exception:  # noqa: BLE001 - a broken connection: the pool discards it
            writer.invalidate()

    def keep_alive(self, idle_s: float = 2.0) -> None:
        """Ping a database server that has not answered for ``idle_s`` (a SQLite file is never pinged): an idle
        node learns that its journal is gone before a request needs it. Raises :class:`JournalError` then."""
        if self.engine.dialect.name == "sqlite" or time.monotonic() - self._last_ok < idle_s:
            return
        try:
            ping(self.engine)
        except SQLAlchemyError as exc:
            reason = getattr(exc, 'orig', None) or exc
            raise JournalError(f"journal {self.name} cannot be reached: {reason}") from exc
        self._last_ok = time.monotonic()

    def close(self) -> None:
        """Flush what is buffered and close; waits for a flush running on another thread. Idempotent."""
        with self._write_lock:
            if self._closed:
                return
            try:
                self._flush()
            finally:
                self._closed = True
                if self._writer is not None:
                    self._writer.close()
                    self._writer = None
                self.engine.dispose()


def _room_changes(rows: list[tuple]) -> tuple[list[tuple], list[tuple]]:
    """The ``rooms`` rows a batch opens (a room's version 0) and the ones it ends (a move into a terminal state).

    Positional parameters in the compiled statements' order: (room, role, node, rid, opened_at) and
    (final, closed_at, room, role, node).
    """
    opened, closed = [], []
    for node, role, room, version, _trigger, src, dst, payload, at in rows:
        if version == 0:
            rid = None
            if '"rid"' in payload:  # parse only the create rows that carry one
                rid = json.loads(payload).get("event", {}).get("rid")
            opened.append((room, role, node, None if rid is None else str(rid), at))
        if dst in TERMINAL and src not in TERMINAL:
            closed.append((dst, at, room, role, node))
    return opened, closed


def write_rows(target: str | os.PathLike, rows: Iterable[Sequence], *, durability: str = "full") -> None:
    """Append ready-made rows (tests, tools): each ``(node, role, room, version, trigger, src, dst, payload, at)``."""
    journal = Journal(target, durability=durability)
    for row in rows:
        payload = row[7] if isinstance(row[7], str) else json.dumps(row[7])
        journal.add(*row[:7], payload, row[8])
    journal.close()
