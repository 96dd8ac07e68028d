"""The reads that must not scan the journal go through its indexes (EXPLAIN QUERY PLAN on a real SQLite file), and a
version 1 journal migrates when a node opens it (or is read as it is by replay)."""

from __future__ import annotations

import json
import sqlite3

from sqlalchemy import event

from fsm_pd.cli.main import EXIT_OK, main
from fsm_pd.effects import Node, RecordingInterpreter, VirtualClock
from fsm_pd.machines import SENDER
from fsm_pd.store import Journal, JournalReader
from fsm_pd.store.reader import open_room_rows

LAYOUT = {"num_layers": 1, "num_pages": 4, "page_size": 2, "kv_heads": 1, "head_dim": 4}
DEADLINES = {"bootstrap": 5.0, "waiting": 5.0, "pull_hold": 5.0}


def journal_of(path, rooms: int = 300) -> None:
    """``rooms`` prefill rooms: two in three aborted (Failed), the rest left open."""
    node = Node("p0", SENDER, Journal(path), RecordingInterpreter(), VirtualClock(100.0), DEADLINES)
    for room in range(rooms):
        node.create(room * 7919, {"layout": LAYOUT, "rid": f"req-{room}"})
        if room % 3:
            node.submit(room * 7919, "abort", {"reason": "client went away"})
    node.step()
    node.journal.close()


def traced(engine, statements: list[str]) -> None:
    """Record every statement the driver runs on ``engine``'s connections, values inlined (sqlite3's trace)."""
    event.listen(engine, "connect", lambda dbapi_conn, _record: dbapi_conn.set_trace_callback(statements.append))
    engine.dispose()  # connections pooled before the listener are replaced by traced ones


def plans(path, statements: list[str]) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return [" | ".join(str(step[3]) for step in conn.execute("EXPLAIN QUERY PLAN " + s))
                for s in statements if s.lstrip().upper().startswith("SELECT") and "sqlite_master" not in s
                and "journal_meta" not in s]
    finally:
        conn.close()


def test_room_request_and_open_room_reads_are_index_searches(tmp_path):
    path = tmp_path / "p.db"
    journal_of(path)
    statements: list[str] = []
    reader = JournalReader(path)
    traced(reader.engine, statements)
    assert [side[0].room for side in reader.sides(room=7919 * 5)] == [7919 * 5]
    assert [side[0].room for side in reader.request_sides("req-9")] == [7919 * 9]
    reader.close()
    journal = Journal(path)
    traced(journal.engine, statements)
    with journal.engine.connect() as conn:
        assert {row.room for row in open_room_rows(conn, "p0", "prefill")} == {r * 7919 for r in range(0, 300, 3)}
    journal.close()
    found = plans(path, statements)
    assert len(found) == 5, found  # one room; the rid's rooms, then their rows; the open rooms, then their rows
    for plan in found:
        assert "SEARCH" in plan and "SCAN" not in plan and "TEMP B-TREE" not in plan, plan


def test_the_room_ordered_walk_is_an_index_walk_not_a_sort(tmp_path):
    path = tmp_path / "p.db"
    journal_of(path)
    statements: list[str] = []
    reader = JournalReader(path)
    traced(reader.engine, statements)
    rooms = [side[0].room for side in reader.sides()]
    reader.close()
    assert rooms == sorted(rooms) and len(rooms) == 300
    [plan] = plans(path, statements)
    assert "USING INDEX" in plan and "TEMP B-TREE" not in plan, plan  # rows come in index order: no sort, no memory


V1_SCHEMA = """
CREATE TABLE transitions (seq INTEGER PRIMARY KEY AUTOINCREMENT, node TEXT NOT NULL, role TEXT NOT NULL,
  room INTEGER NOT NULL, version INTEGER NOT NULL, "trigger" TEXT NOT NULL, src TEXT NOT NULL, dst TEXT NOT NULL,
  payload TEXT NOT NULL, at REAL NOT NULL, CONSTRAINT uq_transition_version UNIQUE (node, role, room, version));
CREATE TABLE journal_meta (key VARCHAR(64) NOT NULL PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO journal_meta VALUES ('schema_version', '1');
"""


def v1_journal(tmp_path):
    """A version 1 journal as the previous fsm-pd wrote it: the same rows, no rooms table, node-first index."""
    new = tmp_path / "new.db"
    journal_of(new, rooms=30)
    old = tmp_path / "old.db"
    conn = sqlite3.connect(old)
    conn.executescript(V1_SCHEMA)
    conn.execute("ATTACH ? AS new", (str(new),))
    conn.execute("INSERT INTO transitions SELECT * FROM new.transitions ORDER BY seq")
    conn.commit()
    conn.close()
    return old


def test_a_version_1_journal_is_read_as_it_is_and_migrated_by_a_writer(tmp_path, capsys):
    old = v1_journal(tmp_path)
    assert main(["replay", str(old), "--room", str(7919 * 4), "--format", "json"]) == EXIT_OK
    assert [(r["room"], r["final"]) for r in json.loads(capsys.readouterr().out)["rooms"]] == [(7919 * 4, "Failed")]

    node = Node("p0", SENDER, Journal(old), RecordingInterpreter(), VirtualClock(), DEADLINES)  # migrates
    assert node.recover() == [r * 7919 for r in range(0, 30, 3)]
    node.journal.engine.dispose()
    conn = sqlite3.connect(old)
    version = conn.execute("SELECT value FROM journal_meta WHERE key='schema_version'").fetchone()[0]
    finals = dict(conn.execute("SELECT room, final FROM rooms").fetchall())
    indexes = {r[1] for r in conn.execute("PRAGMA index_list(transitions)")}
    conn.close()
    assert version == "2" and "ix_transitions_room_order" in indexes
    assert finals == {r * 7919: (None if r % 3 == 0 else "Failed") for r in range(30)}
