"""Which database and driver a ``--journal`` target means (fsm_pd/store/database.py); no server needed."""

from __future__ import annotations

import pytest

from fsm_pd.store import Journal, JournalError
from fsm_pd.store.database import DatabaseUrlError, create_journal_engine, journal_url, shown


def test_a_path_is_a_sqlite_file(tmp_path):
    assert journal_url(tmp_path / "a.db") == f"sqlite:///{tmp_path / 'a.db'}"
    assert journal_url("sqlite:///x.db") == "sqlite:///x.db"


@pytest.mark.parametrize("scheme", ["postgresql", "postgres"])
def test_postgresql_without_a_driver_gets_psycopg(scheme):
    assert journal_url(f"{scheme}://fsm@db.example:5432/journal") == "postgresql+psycopg://fsm@db.example:5432/journal"


def test_a_named_driver_is_kept():
    assert journal_url("postgresql+psycopg2://fsm@h/j") == "postgresql+psycopg2://fsm@h/j"


def test_messages_mask_the_password():
    assert "s3cret" not in shown("postgresql+psycopg://fsm:s3cret@h/j")
    assert shown("postgresql+psycopg://fsm:s3cret@h/j") == "postgresql+psycopg://fsm:***@h/j"


def test_postgresql_engine_is_positional():
    pytest.importorskip("psycopg")
    engine = create_journal_engine(journal_url("postgresql://fsm@127.0.0.1:1/j"), "full")
    assert engine.dialect.driver == "psycopg" and engine.dialect.positional  # the journal binds row tuples
    engine.dispose()


def test_unknown_driver_is_a_journal_error_naming_the_url():
    with pytest.raises(JournalError, match=r"postgresql\+nosuchdriver://fsm:\*\*\*@h/j"):
        Journal("postgresql+nosuchdriver://fsm:pw@h/j")


def test_bad_durability():
    with pytest.raises(ValueError, match="durability"):
        create_journal_engine("sqlite://", "sometimes")


def test_not_a_url():
    with pytest.raises(DatabaseUrlError):
        create_journal_engine("::://", "full")
