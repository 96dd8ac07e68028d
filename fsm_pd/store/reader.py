"""Reading journals without loading them whole: one room, one request's rooms, a node's open rooms, or every room
in room order as a stream.

Every read goes through an index (``schema.py``): the transitions' unique (room, role, node, version) index gives a
room's rows and the room-ordered scan, the ``rooms`` table gives open rooms and request ids. A *side* is one room's
rows on one node, in version order: ``list[JournalRow]``. Streams yield side after side and keep only the current
one in memory (SQLAlchemy's ``yield_per``: the driver fetches in batches, on PostgreSQL through a server cursor).

Version 1 journals (before the room index) are read too, by the same queries: slower, since the database must sort,
and without request ids, which version 1 did not record. Opening one with a writer (``Journal``) migrates it.
"""

from __future__ import annotations

import heapq
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from itertools import groupby
from pathlib import Path

from orjson import loads as _fast_loads
from sqlalchemy import inspect, select
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from fsm_pd.store.database import create_reader_engine, journal_name
from fsm_pd.store.journal import JournalError, JournalRow, SchemaVersionError, _url
from fsm_pd.store.schema import SCHEMA_VERSION, journal_meta, rooms, transitions

READABLE_VERSIONS = ("1", str(SCHEMA_VERSION))
ARCHIVE_KEY = "archive:"  # journal_meta keys naming the archive files retention wrote (retention.py)
BATCH = 2000  # rows fetched per round trip while streaming
CHUNK = 500  # rooms per IN (...) list

Side = list[JournalRow]

_t = transitions.c
_ROOM_ORDER = (_t.room, _t.role, _t.node, _t.version)


def _loads(text: str):
    """JSON text to Python: orjson (several times faster on the payloads replay parses by the million); it refuses
    NaN and Infinity, which ``json.dumps`` writes, so those payloads go to the standard library."""
    try:
        return _fast_loads(text)
    except ValueError:
        return json.loads(text)


def row_from(r) -> JournalRow:
    """A ``transitions`` row (a tuple in column order: seq, node, role, room, version, trigger, src, dst, payload,
    at) as a :class:`JournalRow`, its payload parsed."""
    try:
        payload = _loads(r[8])
    except (TypeError, ValueError) as exc:
        raise JournalError(f"journal row {r[0]} has a payload that is not JSON: {exc}") from exc
    return JournalRow(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], payload, r[9])


def side_key(side: Side) -> tuple[int, str, str]:
    first = side[0]
    return first.room, first.role, first.node


def _side_of(r) -> tuple:
    return r[3], r[2], r[1]  # room, role, node


def _sides(result) -> Iterator[Side]:
    """Group a room-ordered row stream into sides."""
    for _, group in groupby(result, key=_side_of):
        yield [row_from(r) for r in group]


def open_room_rows(conn: Connection, node: str, role: str) -> list[JournalRow]:
    """Every row of ``node``'s unfinished rooms in ``role``, room by room in version order: what recovery needs.

    Two index reads: the open rooms from ``rooms`` (``closed_at IS NULL``), then each one's rows.
    """
    r = rooms.c
    ids = conn.execute(select(r.room).where(r.closed_at.is_(None), r.node == node, r.role == role)).scalars().all()
    out: list[JournalRow] = []
    for i in range(0, len(ids), CHUNK):
        chunk = ids[i:i + CHUNK]
        result = conn.execute(select(transitions).where(_t.room.in_(chunk), _t.role == role, _t.node == node)
                              .order_by(*_ROOM_ORDER))
        out.extend(row_from(row) for row in result)
    return out


class JournalReader:
    """One journal opened for reading. Use as a context manager, or ``close()`` it."""

    def __init__(self, target: str | os.PathLike):
        self.name = journal_name(target)  # a URL's password masked
        if "://" not in self.name and not Path(self.name).is_file():
            raise JournalError(f"no journal at {self.name}")
        self.engine: Engine = create_reader_engine(_url(target))
        try:
            with self.engine.connect() as conn:
                names = set(inspect(conn).get_table_names())
                if not {"transitions", "journal_meta"} <= names:
                    raise JournalError(f"{self.name} is not an fsm-pd journal (tables: {sorted(names) or 'none'})")
                meta = dict(conn.execute(select(journal_meta.c.key, journal_meta.c.value)).all())
        except SQLAlchemyError as exc:
            self.engine.dispose()
            raise JournalError(f"cannot read journal {self.name}: {getattr(exc, 'orig', None) or exc}") from exc
        except JournalError:
            self.engine.dispose()
            raise
        self.version = meta.get("schema_version")
        if self.version not in READABLE_VERSIONS:
            self.engine.dispose()
            raise SchemaVersionError(f"journal {self.name} has schema version {self.version}; this fsm-pd reads "
                                     f"versions {', '.join(READABLE_VERSIONS)}")
        self._archives = sorted(v for k, v in meta.items() if k.startswith(ARCHIVE_KEY))

    def __enter__(self) -> JournalReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.engine.dispose()

    def _stream(self, query) -> Iterator:
        """The query's rows as tuples, fetched ``BATCH`` at a time."""
        if self.engine.dialect.name == "sqlite":
            yield from self._stream_sqlite(query)
            return
        try:
            with self.engine.connect() as conn:  # yield_per: a server-side cursor where the dialect has one
                yield from conn.execution_options(yield_per=BATCH).execute(query)
        except SQLAlchemyError as exc:
            raise JournalError(f"cannot read journal {self.name}: {getattr(exc, 'orig', None) or exc}") from exc

    def _stream_sqlite(self, query) -> Iterator[tuple]:
        """The same statement through the driver's own cursor: plain tuples, a third of the cost per row of
        SQLAlchemy's rows (sqlite3 steps the statement as it is fetched, so memory stays at one batch)."""
        compiled = query.compile(dialect=self.engine.dialect)
        params = tuple(compiled.params[name] for name in compiled.positiontup or ())
        conn = self.engine.raw_connection()
        try:
            cursor = conn.cursor()
            cursor.execute(str(compiled), params)
            while batch := cursor.fetchmany(BATCH):
                yield from batch
            cursor.close()
        except self.engine.dialect.dbapi.Error as exc:
            raise JournalError(f"cannot read journal {self.name}: {exc}") from exc
        finally:
            conn.close()

    def rows(self, after: int = 0) -> Iterator[JournalRow]:
        """Every row in commit order (only those after sequence number ``after``: a reader following a journal
        that is still written), streamed."""
        query = select(transitions).order_by(_t.seq)
        if after:
            query = query.where(_t.seq > after)
        return (row_from(r) for r in self._stream(query))

    def sides(self, room: int | None = None) -> Iterator[Side]:
        """Every side (or those of one room) in (room, role, node) order, streamed through the room index."""
        query = select(transitions).order_by(*_ROOM_ORDER)
        if room is not None:
            query = query.where(_t.room == room)
        return _sides(self._stream(query))

    def request_sides(self, rid: str) -> list[Side]:
        """The sides of every room created for request ``rid`` (its ``rooms.rid``), in room order."""
        if self.version == "1":
            return []  # version 1 did not record request ids
        r = rooms.c
        keys = [tuple(k) for k in self._stream(select(r.room, r.role, r.node).where(r.rid == rid))]
        out: list[Side] = []
        for room, role, node in sorted(keys):
            query = select(transitions).where(_t.room == room, _t.role == role, _t.node == node).order_by(_t.version)
            out.extend(_sides(self._stream(query)))
        return out

    def archives(self) -> list[str]:
        """The archive files retention moved this journal's finished rooms into, where they can be found.

        Each is looked for at the path recorded, then beside this journal (a copied directory); missing ones are
        returned as recorded, for the caller to report.
        """
        found = []
        for recorded in self._archives:
            path = Path(recorded)
            if not path.is_file() and "://" not in self.name:
                beside = Path(self.name).absolute().parent / path.name
                path = beside if beside.is_file() else path
            found.append(str(path))
        return found


def read_journal(target: str | os.PathLike) -> list[JournalRow]:
    """Every row of an existing journal, in commit order (small journals, tests). Raises :class:`JournalError`."""
    with JournalReader(target) as reader:
        return list(reader.rows())


def open_with_archives(targets: Sequence[str]) -> tuple[list[JournalReader], list[str]]:
    """Readers for ``targets`` and every archive they name (each file once); and the archives that are missing."""
    readers: list[JournalReader] = []
    seen: set[str] = set()
    missing: list[str] = []
    try:
        queue = list(targets)
        while queue:
            name = queue.pop(0)
            key = name if "://" in name else str(Path(name).resolve())
            if key in seen:
                continue
            seen.add(key)
            if name not in targets and "://" not in name and not Path(name).is_file():
                missing.append(name)
                continue
            reader = JournalReader(name)
            readers.append(reader)
            queue.extend(reader.archives())
    except JournalError:
        for reader in readers:
            reader.close()
        raise
    return readers, missing


def merged_sides(streams: Iterable[Iterator[Side]]) -> Iterator[Side]:
    """Merge room-ordered side streams (several journals, their archives) into one, in (room, role, node) order.

    A side found in more than one file is yielded once, its rows joined by version (the first file's row wins a
    version both have): retention copies a room into its archive and then deletes it from the live journal, so a
    crash between the two leaves it in both; and a message for an archived room that the node still held is
    journaled, as ignored, in the live file.
    """
    pending: list[Side] = []
    for side in heapq.merge(*streams, key=side_key):
        if pending and side_key(side) != side_key(pending[0]):
            yield _joined(pending)
            pending = []
        pending.append(side)
    if pending:
        yield _joined(pending)


def _joined(copies: list[Side]) -> Side:
    if len(copies) == 1:
        return copies[0]
    by_version: dict[int, JournalRow] = {}
    for side in copies:
        for row in side:
            by_version.setdefault(row.version, row)
    return [by_version[v] for v in sorted(by_version)]
