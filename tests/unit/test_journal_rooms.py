"""``Journal.has_room``: every room a node ever journaled, flushed or still buffered, found through the index."""

from __future__ import annotations

import threading

from fsm_pd.store import Journal
from fsm_pd.store.schema import MAX_ROOM


def _create_row(journal: Journal, node: str, role: str, room: int) -> None:
    journal.add(node, role, room, 0, "create", "Bootstrapping", "Bootstrapping", '{"event":{},"effects":[]}', 1.0)


def test_has_room_sees_buffered_flushed_and_reopened_rows(tmp_path):
    path = tmp_path / "j.db"
    journal = Journal(path)
    _create_row(journal, "p0", "prefill", 7)
    assert journal.has_room("p0", "prefill", 7)  # buffered, not flushed yet
    journal.flush()
    assert journal.has_room("p0", "prefill", 7)
    assert not journal.has_room("p0", "decode", 7)  # another role
    assert not journal.has_room("p1", "prefill", 7)  # another node sharing the file
    assert not journal.has_room("p0", "prefill", 8)
    _create_row(journal, "p0", "prefill", MAX_ROOM)
    journal.close()

    reopened = Journal(path)  # a restarted node
    assert reopened.has_room("p0", "prefill", 7) and reopened.has_room("p0", "prefill", MAX_ROOM)
    reopened.close()


def test_has_room_from_another_thread_while_the_writer_holds_rows(tmp_path):
    journal = Journal(tmp_path / "j.db")
    for room in range(100):
        _create_row(journal, "d0", "decode", room)
    journal.flush()
    found: list[bool] = []
    reader = threading.Thread(target=lambda: found.extend(journal.has_room("d0", "decode", r) for r in (5, 500)))
    reader.start()
    reader.join()
    assert found == [True, False]
    journal.close()


def test_has_room_is_an_index_search(tmp_path):
    journal = Journal(tmp_path / "j.db")
    with journal.engine.connect() as conn:
        plan = conn.exec_driver_sql("EXPLAIN QUERY PLAN " + journal._room_lookup, ("n", "prefill", 1)).fetchall()
    journal.close()
    assert any("USING COVERING INDEX" in str(step) or "USING INDEX" in str(step) for step in plan), plan
