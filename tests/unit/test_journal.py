"""The journal on a real SQLite file: schema, WAL, durability, group commit, versions, errors."""

from __future__ import annotations

import json
import sqlite3

import pytest
from sqlalchemy import event

from fsm_pd.store import Journal, JournalError, SchemaVersionError, VersionConflict, read_journal
from fsm_pd.store.schema import SCHEMA_VERSION


def add_row(journal: Journal, room: int, version: int, trigger: str = "create") -> None:
    journal.add("n1", "prefill", room, version, trigger, "Bootstrapping", "Bootstrapping",
                json.dumps({"event": {}, "effects": []}), 1.5 + version)


def test_schema_and_pragmas(tmp_path):
    path = tmp_path / "j.db"
    journal = Journal(path, durability="full")
    add_row(journal, 7, 0)
    journal.flush()
    conn = sqlite3.connect(path)
    columns = [(r[1], r[2]) for r in conn.execute("PRAGMA table_info(transitions)")]
    assert columns == [("seq", "INTEGER"), ("node", "TEXT"), ("role", "TEXT"), ("room", "INTEGER"),
                       ("version", "INTEGER"), ("trigger", "TEXT"), ("src", "TEXT"), ("dst", "TEXT"),
                       ("payload", "TEXT"), ("at", "REAL")]
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("SELECT value FROM journal_meta WHERE key='schema_version'").fetchone()[0] == str(
        SCHEMA_VERSION)
    with journal.engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
    journal.close()
    off = Journal(tmp_path / "off.db", durability="off")
    with off.engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA synchronous").scalar() == 0
    off.close()
    with pytest.raises(ValueError, match="durability"):
        Journal(tmp_path / "bad.db", durability="sometimes")


def test_group_commit_is_one_transaction_per_flush(tmp_path):
    journal = Journal(tmp_path / "j.db")
    statements = []  # what the driver runs: the flush writes through a driver connection, past SQLAlchemy's events
    journal.engine.dispose()  # so the next connection is a new one, traced
    event.listen(journal.engine, "connect", lambda conn, _: conn.set_trace_callback(statements.append))
    for room in range(500):
        add_row(journal, room, 0)
    assert journal.pending == 500
    assert journal.flush() == 500
    assert [s for s in statements if s.split()[0] in ("BEGIN", "COMMIT", "ROLLBACK")] == ["BEGIN", "COMMIT"]
    assert journal.pending == 0
    assert len(read_journal(tmp_path / "j.db")) == 500


def test_version_conflict_keeps_nothing_of_the_batch(tmp_path):
    path = tmp_path / "j.db"
    journal = Journal(path)
    add_row(journal, 1, 0)
    journal.flush()
    add_row(journal, 2, 0)
    add_row(journal, 1, 0)  # the same (node, role, room, version) again
    with pytest.raises(VersionConflict):
        journal.flush()
    assert [(r.room, r.version) for r in read_journal(path)] == [(1, 0)]


def test_other_schema_version_is_refused(tmp_path):
    path = tmp_path / "j.db"
    Journal(path).close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE journal_meta SET value='999' WHERE key='schema_version'")
    conn.commit()
    conn.close()
    with pytest.raises(SchemaVersionError, match="999"):
        Journal(path)
    with pytest.raises(SchemaVersionError):
        read_journal(path)


def test_read_errors_are_clear(tmp_path):
    with pytest.raises(JournalError, match="no journal"):
        read_journal(tmp_path / "missing.db")
    (tmp_path / "text.db").write_text("not sqlite")
    with pytest.raises(JournalError, match="not a database"):
        read_journal(tmp_path / "text.db")
    sqlite3.connect(tmp_path / "other.db").execute("CREATE TABLE x(a)").connection.commit()
    with pytest.raises(JournalError, match="not an fsm-pd journal"):
        read_journal(tmp_path / "other.db")


def test_any_sqlalchemy_url(tmp_path):
    url = f"sqlite:///{tmp_path / 'url.db'}"
    journal = Journal(url)
    add_row(journal, 3, 0)
    journal.close()
    rows = read_journal(url)
    assert rows[0].room == 3 and rows[0].at == 1.5 and rows[0].payload == {"event": {}, "effects": []}
