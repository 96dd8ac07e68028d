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


def test_once_its_rooms_are_read_a_new_room_is_answered_without_the_database(tmp_path):
    """``has_room``'s filter (``room_filter.py``): every room held is found (written before the journal opened,
    buffered, flushed, added while the filter was being read), and a new one is answered without a query."""
    path = tmp_path / "j.db"
    earlier = Journal(path)
    for room in range(50):
        _create_row(earlier, "d0", "decode", room)
    earlier.close()
    journal = Journal(path)
    _create_row(journal, "d0", "decode", 1000)  # buffered before the filter exists
    assert journal.has_room("d0", "decode", 3)  # the first question makes the filter; the database answers
    _create_row(journal, "d0", "decode", 1001)  # added while (or after) it reads the database
    assert journal._rooms.ready.wait(10) and journal._rooms.failed is None
    journal.flush()
    _create_row(journal, "d0", "decode", 1002)
    journal.add_rows([("d0", "decode", 1003, 0, "create", "Bootstrapping", "Bootstrapping", "{}", 1.0)])  # a batch

    def unreachable():
        raise AssertionError("the database was asked")

    asked = journal.engine.raw_connection
    journal.engine.raw_connection = unreachable
    try:
        assert not any(journal.has_room("d0", "decode", room) for room in range(2000, 2200))
        assert not journal.has_room("d1", "decode", 3) and not journal.has_room("d0", "prefill", 3)
    finally:
        journal.engine.raw_connection = asked
    held = [*range(50), 1000, 1001, 1002, 1003]
    assert all(journal.has_room("d0", "decode", room) for room in held)  # "maybe": the database confirms each
    assert all(journal._rooms.maybe("d0", "decode", room) for room in held)
    journal.close()


def test_the_filter_keeps_what_was_added_while_it_read_the_database():
    from fsm_pd.store.room_filter import RoomFilter

    release = threading.Event()

    def slow_load():
        release.wait(10)
        return [("n", "decode", 1)]

    rooms = RoomFilter(slow_load, pending=[("n", "decode", 2, 0, "create")])
    rooms.add("n", "decode", 3)
    assert rooms.maybe("n", "decode", 99)  # not read yet: every answer is "maybe"
    release.set()
    assert rooms.ready.wait(10)
    assert all(rooms.maybe("n", "decode", room) for room in (1, 2, 3))
    assert sum(rooms.maybe("n", "decode", room) for room in range(100, 10_100)) < 50  # ~0 at this fill


def test_rows_a_flush_is_writing_are_found_and_rows_added_meanwhile_are_kept(tmp_path):
    """A flush takes the buffered rows, then writes them (slowly here: a slow disk). Meanwhile another thread asks for
    a room of those rows, which are neither buffered nor in the file yet: they are found. A row added meanwhile
    stays buffered for the next flush."""
    journal = Journal(tmp_path / "j.db")
    write, writing, go_on = journal._write, threading.Event(), threading.Event()

    def slow_write(rows):
        writing.set()
        assert go_on.wait(10)
        return write(rows)

    journal._write = slow_write
    _create_row(journal, "d0", "decode", 11)
    flushing = threading.Thread(target=journal.flush)
    flushing.start()
    try:
        assert writing.wait(10)
        assert journal.has_room("d0", "decode", 11)  # taken by the flush, not in the file yet
        _create_row(journal, "d0", "decode", 12)  # added while it writes
    finally:
        go_on.set()
        flushing.join(10)
    assert journal.pending == 1 and journal.flush() == 1
    assert journal.has_room("d0", "decode", 11) and journal.has_room("d0", "decode", 12)
    journal.close()
