"""Retention on real SQLite files: finished rooms past their age (or over the row cap) move to monthly archives,
open rooms stay, recovery is unchanged, and replay of the live journal reads the archives and names them."""

from __future__ import annotations

import json
import sqlite3

from fsm_pd.cli.main import EXIT_OK, main
from fsm_pd.effects import Node, RecordingInterpreter, VirtualClock
from fsm_pd.machines import SENDER
from fsm_pd.store import Journal, read_journal
from fsm_pd.store.retention import Retention

LAYOUT = {"num_layers": 1, "num_pages": 4, "page_size": 2, "kv_heads": 1, "head_dim": 4}
DEADLINES = {"bootstrap": 5.0, "waiting": 5.0, "pull_hold": 5.0}
DAY = 86400.0
START = 1_764_547_200.0  # 2025-12-01 00:00 UTC


def history(path, days: int = 3, per_day: int = 20) -> Node:
    """``per_day`` rooms a day for ``days`` days, every other one failed by an abort, the rest left open."""
    clock = VirtualClock(START)
    node = Node("p0", SENDER, Journal(path), RecordingInterpreter(), clock, DEADLINES)
    room = 0
    for day in range(days):
        clock.advance_to(START + day * DAY)
        for i in range(per_day):
            node.create(room, {"layout": LAYOUT, "rid": f"req-{room}"})
            if i % 2 == 0:
                node.submit(room, "abort", {"reason": "client went away"})
            room += 1
        node.step()
    return node


def counts(path) -> tuple[int, int]:
    conn = sqlite3.connect(path)
    try:
        return (conn.execute("SELECT count(*) FROM rooms").fetchone()[0],
                conn.execute("SELECT count(*) FROM transitions").fetchone()[0])
    finally:
        conn.close()


def replay_json(capsys, *journals) -> dict:
    assert main(["replay", *map(str, journals), "--format", "json"]) == EXIT_OK
    out = capsys.readouterr()
    doc = json.loads(out.out)
    doc["stderr"] = out.err
    return doc


def test_age_moves_finished_rooms_to_the_archive_and_replay_reads_it(tmp_path, capsys):
    live = tmp_path / "p0.db"
    node = history(live)
    before = replay_json(capsys, live)
    policy = Retention(start_after_s=0, keep_s=1.5 * DAY, max_rows=None, clock=lambda: START + 2 * DAY + 60)
    policy.attach(node.journal)
    node.journal.flush()  # nothing pending: retention runs after commits only
    node.create(999, {"layout": LAYOUT})
    node.step()  # a commit: the pass runs
    # day 0's 10 finished rooms ended more than 1.5 days before "now"; its 10 open rooms and later days stay
    assert policy.moved == 10
    archive = tmp_path / "p0.archive-2025-12.db"
    assert counts(archive) == (10, 20)
    assert counts(live)[0] == 61 - 10
    after = replay_json(capsys, live)
    assert after["journals"] == [str(live), str(archive)] and str(archive) in after["stderr"]
    assert [r for r in after["rooms"] if r["room"] != 999] == before["rooms"]  # the same rooms, from two files

    restarted = Node("p0", SENDER, Journal(live), RecordingInterpreter(), VirtualClock(START), DEADLINES)
    full = Node("p0", SENDER, Journal(live), RecordingInterpreter(), VirtualClock(START), DEADLINES)
    every_row = [row for row in read_journal(live) if row.node == "p0" and row.role == full.role]
    assert restarted.recover() == full.restore(every_row) == [r for r in range(60) if r % 2] + [999]


def test_the_row_cap_moves_the_oldest_finished_rooms_whatever_their_age(tmp_path):
    live = tmp_path / "p0.db"
    node = history(live, days=2)
    policy = Retention(start_after_s=0, keep_s=None, max_rows=10, batch=5, clock=lambda: START + DAY + 3600)
    policy.attach(node.journal)
    node.submit(1, "abort", {"reason": "client went away"})  # room 1 (open, day 0) finishes now
    node.step()  # one pass: a full batch of 5, so the next commit runs another
    assert policy.moved == 5
    for _ in range(4):
        node.submit(3, "timeout", {"timer": "waiting"})  # not armed: ignored events, commits that trigger passes
        node.step()
    assert policy.moved == 21  # every finished room, oldest first; the open rooms are all that is left
    conn = sqlite3.connect(live)
    left = {r for (r,) in conn.execute("SELECT room FROM rooms WHERE closed_at IS NOT NULL")}
    conn.close()
    assert left == set()
    assert counts(live)[0] == 40 - 21


def test_a_room_in_both_files_is_replayed_once(tmp_path, capsys):
    """A crash after the archive commit and before the live delete leaves a room in both: replay shows it once."""
    live = tmp_path / "p0.db"
    node = history(live, days=1, per_day=4)
    copy = tmp_path / "copy.db"
    node.journal.close()
    src = sqlite3.connect(live)
    src.execute(f"VACUUM INTO '{copy}'")
    src.close()
    policy = Retention(start_after_s=0, keep_s=1.0, max_rows=None, clock=lambda: START + DAY)
    journal = Journal(live)
    policy.attach(journal)
    journal.add("p0", "prefill", 500, 0, "create", "Bootstrapping", "Bootstrapping", '{"event":{},"effects":[]}',
                START)
    journal.close()
    assert policy.moved == 2
    archive = tmp_path / "p0.archive-2025-12.db"
    # the archived rooms are back in a live journal too (the copy taken before the move): both name the archive
    conn = sqlite3.connect(copy)
    conn.execute("INSERT INTO journal_meta VALUES ('archive:2025-12', ?)", (str(archive),))
    conn.commit()
    conn.close()
    doc = replay_json(capsys, copy)
    assert doc["journals"] == [str(copy), str(archive)]
    assert sorted(r["room"] for r in doc["rooms"]) == [0, 1, 2, 3]


def test_a_late_row_for_an_archived_room_joins_its_history(tmp_path, capsys):
    """A room archived while its node still held it gets a late (ignored) message: the row lands in the live
    journal, and replay shows one history, not two."""
    live = tmp_path / "p0.db"
    node = history(live, days=1, per_day=2)  # room 0 failed, room 1 open
    policy = Retention(start_after_s=0, keep_s=1.0, max_rows=None, clock=lambda: START + DAY)
    policy.attach(node.journal)
    node.create(7, {"layout": LAYOUT})
    node.step()
    assert policy.moved == 1 and counts(tmp_path / "p0.archive-2025-12.db") == (1, 2)
    node.submit(0, "abort", {"reason": "again"})  # room 0 is still in memory: journaled as ignored, in live
    node.step()
    doc = replay_json(capsys, live)
    [room0] = [r for r in doc["rooms"] if r["room"] == 0]
    assert [e["version"] for e in room0["events"]] == [0, 1, 2] and room0["consistent"]
    assert room0["events"][2]["ignored"]


def test_a_node_archives_only_its_own_rooms(tmp_path):
    """A journal several nodes share: each node's retention moves its own finished rooms, never another's."""
    live = tmp_path / "shared.db"
    history(live, days=1, per_day=4).journal.close()  # p0's rooms 0-3, 0 and 2 failed
    clock = VirtualClock(START)
    other = Node("p1", SENDER, Journal(live), RecordingInterpreter(), clock, DEADLINES)
    other.create(50, {"layout": LAYOUT})
    other.submit(50, "abort", {"reason": "client went away"})
    other.step()
    policy = Retention(start_after_s=0, keep_s=1.0, max_rows=None, node="p1", clock=lambda: START + DAY)
    policy.attach(other.journal)
    other.create(51, {"layout": LAYOUT})
    other.step()
    assert policy.moved == 1
    conn = sqlite3.connect(live)
    left = sorted(conn.execute("SELECT node, room FROM rooms").fetchall())
    conn.close()
    assert left == [("p0", 0), ("p0", 1), ("p0", 2), ("p0", 3), ("p1", 51)]
