"""Retention: finished rooms leave the live journal for monthly archive files, so the live journal stops growing.

A room is moved once it has ended (``rooms.closed_at`` is set) and either ended more than ``keep_s`` ago or the
live journal holds more than ``max_rows`` rows (then the oldest finished rooms go first, none that ended less than
``MIN_AGE_S`` ago). Open rooms are never
moved: recovery needs them. Each room goes, rows and ``rooms`` row together, into the archive of the month (UTC) it
ended in, ``<journal>.archive-YYYY-MM.db`` beside a journal file (or in ``archive_dir``), which is itself a journal
of the same schema: ``fsm-pd replay`` reads it like any other. The live journal names its archives in
``journal_meta`` (``archive:YYYY-MM``), so replay given the live journal finds them.

The work runs on the writer's thread, after a group commit (``Journal.flush`` calls ``after_flush``), first a
minute after the node started, at most ``batch`` rooms at a time so that one pass holds the node loop only briefly;
a pass that found a full batch runs again after the next flush, otherwise the next check is ``check_every_s``
later. Each batch is first committed to the archive (replacing any copy of the same rooms there), then deleted from
the live journal: a crash between the two leaves a room in both, which the next pass moves again and replay reads once.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import delete, func, insert, select, tuple_
from sqlalchemy.engine import make_url

from fsm_pd.store.journal import Journal
from fsm_pd.store.reader import ARCHIVE_KEY
from fsm_pd.store.retention_flags import DEFAULT_MAX_ROWS
from fsm_pd.store.schema import journal_meta, rooms, transitions

log = logging.getLogger(__name__)

CHUNK = 300  # rooms per (room, role, node) IN (...) list
# Even over the row cap, a room stays this long after it ended: a late message for it (a duplicate PULLED) is still
# journaled, as ignored, and that row must land beside the room's others, not alone in the live journal.
MIN_AGE_S = 600.0


@dataclass
class Retention:
    keep_s: float | None = 7 * 86400  # finished rooms older than this are archived (None: age alone never does)
    max_rows: int | None = DEFAULT_MAX_ROWS  # above this many live rows the oldest finished rooms go (None: no cap)
    archive_dir: Path | None = None  # default: beside the journal file
    batch: int = 1000  # rooms per pass
    check_every_s: float = 60.0
    start_after_s: float = 60.0  # the first pass waits this long after ``attach``: never competes with a start
    node: str | None = None  # archive only this node's rooms (a journal shared by a fleet holds every node's)
    clock: Callable[[], float] = time.time
    moved: int = 0  # rooms archived so far
    _next_check: float = field(default=0.0, repr=False)

    def attach(self, journal: Journal) -> Journal:
        """Run on ``journal`` after its flushes; refuses at once a policy that could not write its archives."""
        archive_path(journal, "0000-00", self.archive_dir)
        self._next_check = self.clock() + self.start_after_s
        journal.retention = self
        return journal

    def after_flush(self, journal: Journal) -> None:
        now = self.clock()
        if now < self._next_check:
            return
        try:
            done = archive_finished(journal, self, now)
        except Exception:  # noqa: BLE001 - archiving is housekeeping: it must never stop the node's loop
            log.exception("journal %s: archiving failed; trying again in %.0f s", journal.url, self.check_every_s)
            done = 0
        self.moved += done
        self._next_check = now if done >= self.batch else now + self.check_every_s


def archive_path(journal: Journal, month: str, archive_dir: Path | None) -> Path:
    url = make_url(journal.url)
    if url.get_backend_name() == "sqlite" and url.database:
        live = Path(url.database)
        return (archive_dir or live.parent) / f"{live.stem}.archive-{month}.db"
    if archive_dir is None:
        raise ValueError(f"journal {url.render_as_string()} is not a file: give an archive directory "
                         "(--journal-archive-dir)")
    return archive_dir / f"{url.database or 'journal'}.archive-{month}.db"


def archive_finished(journal: Journal, policy: Retention, now: float) -> int:
    """Move up to ``policy.batch`` finished rooms to their archives; returns how many were moved."""
    r, t = rooms.c, transitions.c
    mine = [r.node == policy.node] if policy.node is not None else []
    with journal.engine.connect() as conn:
        chosen = []
        if policy.keep_s is not None:
            chosen = conn.execute(select(rooms).where(r.closed_at.is_not(None), r.closed_at < now - policy.keep_s,
                                                      *mine).order_by(r.closed_at).limit(policy.batch)).all()
        if not chosen and policy.max_rows is not None:
            live = conn.execute(select(func.count()).select_from(transitions)).scalar_one()
            if live > policy.max_rows:
                chosen = conn.execute(select(rooms).where(r.closed_at.is_not(None), r.closed_at < now - MIN_AGE_S,
                                                          *mine).order_by(r.closed_at).limit(policy.batch)).all()
        if not chosen:
            return 0
        keys = [(row.room, row.role, row.node) for row in chosen]
        rows = []
        for i in range(0, len(keys), CHUNK):
            rows += conn.execute(select(transitions).where(tuple_(t.room, t.role, t.node).in_(keys[i:i + CHUNK]))
                                 ).all()
    months: dict[str, tuple[list, list]] = {}
    month_of = {}
    for row in chosen:
        month = time.strftime("%Y-%m", time.gmtime(row.closed_at))
        month_of[(row.room, row.role, row.node)] = month
        months.setdefault(month, ([], []))[0].append(row._asdict())
    for row in rows:
        months[month_of[(row.room, row.role, row.node)]][1].append(row._asdict())
    paths = {month: archive_path(journal, month, policy.archive_dir) for month in months}
    for month, (room_rows, transition_rows) in months.items():
        _write_archive(paths[month], journal.durability, room_rows, transition_rows)
    with journal.engine.begin() as conn:
        named = set(conn.execute(select(journal_meta.c.key).where(journal_meta.c.key.like(ARCHIVE_KEY + "%")))
                    .scalars())
        for month, path in paths.items():
            if ARCHIVE_KEY + month not in named:
                conn.execute(insert(journal_meta).values(key=ARCHIVE_KEY + month, value=str(path)))
        seqs = [row.seq for row in rows]
        for i in range(0, len(seqs), CHUNK * 4):
            conn.execute(delete(transitions).where(t.seq.in_(seqs[i:i + CHUNK * 4])))
        for i in range(0, len(keys), CHUNK):
            conn.execute(delete(rooms).where(tuple_(r.room, r.role, r.node).in_(keys[i:i + CHUNK])))
    log.info("journal %s: archived %d finished rooms (%d rows) to %s", journal.url, len(keys), len(rows),
             ", ".join(str(p) for p in paths.values()))
    return len(keys)


def _write_archive(path: Path, durability: str, room_rows: list[dict], transition_rows: list[dict]) -> None:
    """Put these rooms into the archive at ``path`` (a journal too), replacing any earlier copy of them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    archive = Journal(path, durability=durability)
    r, t = rooms.c, transitions.c
    keys = [(row["room"], row["role"], row["node"]) for row in room_rows]
    try:
        with archive.engine.begin() as conn:
            for i in range(0, len(keys), CHUNK):
                chunk = keys[i:i + CHUNK]
                conn.execute(delete(transitions).where(tuple_(t.room, t.role, t.node).in_(chunk)))
                conn.execute(delete(rooms).where(tuple_(r.room, r.role, r.node).in_(chunk)))
            conn.execute(insert(rooms), room_rows)
            if transition_rows:
                conn.execute(insert(transitions), transition_rows)  # seq kept: commit order survives the move
    finally:
        archive.engine.dispose()


def attach_from_args(journal: Journal, args: argparse.Namespace) -> Retention | None:
    """The serve flags' policy, attached to ``journal`` (None when both limits are off)."""
    keep, max_rows = args.journal_keep, args.journal_max_rows or None
    if keep is None and max_rows is None:
        return None
    archive_dir = Path(os.path.expanduser(args.journal_archive_dir)) if args.journal_archive_dir else None
    if archive_dir is None and journal.engine.dialect.name != "sqlite":
        # a database server's journal is usually a fleet's: every node would archive every node's rooms
        log.warning("journal %s: retention is off (a database journal archives only with --journal-archive-dir; "
                    "a fleet's shared journal is best kept in size by the database itself)", journal.name)
        return None
    policy = Retention(keep_s=keep, max_rows=max_rows, archive_dir=archive_dir, node=getattr(args, "node_id", None))
    policy.attach(journal)
    return policy
