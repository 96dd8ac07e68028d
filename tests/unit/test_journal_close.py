"""``Journal.close`` from one thread while a node's loop is inside a flush on another never shares the writer
connection: ``KVManager.close`` gives up joining its loop after 5 s and then closes the journal, which flushes.

The race is made deterministic: the loop's flush stops inside its transaction (a gate around the real SQLite
connection holds its insert) until the closing thread has either reached the connection itself (the bug: two
transactions interleaved on one DB-API connection) or is waiting for the journal's own turn.
"""

from __future__ import annotations

import json
import threading

import pytest

from fsm_pd.store import Journal, JournalError, read_journal


def add_row(journal: Journal, room: int) -> None:
    journal.add("n1", "prefill", room, 0, "create", "Bootstrapping", "Bootstrapping",
                json.dumps({"event": {}, "effects": []}), 1.5)


class Gate:
    """The writer connection, watched: who has a transaction open on it, and whether another thread ran a statement
    meanwhile. The loop's first insert waits for ``release``."""

    def __init__(self, real, loop_name: str) -> None:
        self.real, self.loop_name = real, loop_name
        self.open_by: str | None = None
        self.overlaps: list[str] = []
        self.inside, self.release, self.other_arrived = threading.Event(), threading.Event(), threading.Event()

    def enter(self) -> None:
        me = threading.current_thread().name
        if self.open_by not in (None, me):
            self.overlaps.append(f"{me} ran a statement inside {self.open_by}'s transaction")
            self.other_arrived.set()
        self.open_by = me

    def cursor(self):
        return GatedCursor(self)

    def commit(self) -> None:
        self.real.commit()
        self.open_by = None

    def rollback(self) -> None:
        self.real.rollback()
        self.open_by = None

    def close(self) -> None:
        self.real.close()

    def __getattr__(self, name):
        return getattr(self.real, name)


class GatedCursor:
    def __init__(self, gate: Gate) -> None:
        self.gate, self.real = gate, gate.real.cursor()

    def execute(self, sql, *args):
        self.gate.enter()
        return self.real.execute(sql, *args)

    def executemany(self, sql, rows):
        self.gate.enter()
        if threading.current_thread().name == self.gate.loop_name and not self.gate.inside.is_set():
            self.gate.inside.set()
            assert self.gate.release.wait(30)
        return self.real.executemany(sql, rows)

    def close(self) -> None:
        self.real.close()


class Announced:
    """The journal's write lock (when it has one), announcing the closing thread's arrival before it waits."""

    def __init__(self, lock, arrived: threading.Event, who: str) -> None:
        self.lock, self.arrived, self.who = lock, arrived, who

    def __enter__(self):
        if threading.current_thread().name == self.who:
            self.arrived.set()
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


def test_close_waits_for_the_loops_flush_and_never_shares_its_connection(tmp_path):
    path = tmp_path / "j.db"
    journal = Journal(path, durability="off")
    add_row(journal, 1)
    journal.flush()  # the writer connection is open (a SQLite file's is kept from flush to flush)
    gate = Gate(journal._writer, loop_name="loop")
    journal._writer = gate
    journal._write_lock = Announced(getattr(journal, "_write_lock", threading.RLock()), gate.other_arrived, "closer")
    results: dict[str, object] = {}

    def run(name, work):
        try:
            results[name] = work()
        except Exception as exc:  # noqa: BLE001 - what the thread ended with is the finding
            results[name] = exc

    add_row(journal, 2)
    loop = threading.Thread(target=run, args=("loop", journal.flush), name="loop")
    loop.start()
    assert gate.inside.wait(30)  # the loop is inside its transaction, its insert held
    add_row(journal, 3)  # a row the loop's next step buffered: close must journal it
    closer = threading.Thread(target=run, args=("closer", journal.close), name="closer")
    closer.start()
    assert gate.other_arrived.wait(30)  # the closer reached the connection (the race) or waits for its turn
    gate.release.set()
    loop.join(30)
    closer.join(30)
    assert gate.overlaps == []
    assert results == {"loop": 1, "closer": None}
    assert sorted(row.room for row in read_journal(path)) == [1, 2, 3]
    with pytest.raises(JournalError, match="closed"):  # a loop that flushes after close journals nothing
        add_row(journal, 4)
        journal.flush()
    journal.close()  # a second close is a no-op
