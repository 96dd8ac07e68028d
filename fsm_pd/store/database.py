"""Which database a journal is in, and how to connect to it: SQLite files and PostgreSQL servers.

``--journal`` takes a path (a SQLite file) or a SQLAlchemy URL. ``postgresql://user@host/db`` (or ``postgres://``,
libpq's spelling) uses the psycopg 3 driver (``pip install 'fsm-pd[postgres]'``); a URL that names its driver
(``postgresql+psycopg2://``) keeps it. Many nodes may write one PostgreSQL journal: every row names its node, and
the unique (room, role, node, version) index keeps each node's history its own.

Durability: SQLite's ``synchronous`` (see ``journal.py``), or PostgreSQL's ``synchronous_commit``: ``full`` waits for
the server to flush its WAL (a committed transition survives the server's crash and power loss), ``normal`` and
``off`` let the server acknowledge before that flush (a committed transition survives this node's crash, and the
server's crash can take back its last ~0.6 s of commits).

A server that goes away must fail the node, never hang it: libpq connects with a timeout, and TCP keepalives plus
``tcp_user_timeout`` turn a silent network into an error within ``DEAD_PEER_S`` seconds.
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError

DURABILITY = {"full": "FULL", "normal": "NORMAL", "off": "OFF"}
PG_SYNCHRONOUS_COMMIT = {"full": "on", "normal": "off", "off": "off"}
CONNECT_TIMEOUT_S = 5
DEAD_PEER_S = 30
# libpq keywords, for the drivers built on libpq; a URL's own ?keyword=value wins
LIBPQ_DRIVERS = ("psycopg", "psycopg2")
LIBPQ_DEFAULTS = {"connect_timeout": CONNECT_TIMEOUT_S, "keepalives": 1, "keepalives_idle": 10,
                  "keepalives_interval": 5, "keepalives_count": 3, "tcp_user_timeout": DEAD_PEER_S * 1000,
                  "application_name": "fsm-pd"}


class DatabaseUrlError(ValueError):
    """A ``--journal`` target that is not a usable path or URL (a bad URL, a driver that is not installed)."""


def journal_url(target: str | os.PathLike) -> str:
    """The SQLAlchemy URL of a journal: a path becomes ``sqlite:///ABS``; PostgreSQL without a driver gets psycopg."""
    raw = os.fspath(target)
    if "://" not in raw:
        return f"sqlite:///{Path(raw).absolute()}"
    scheme, rest = raw.split("://", 1)
    if scheme in ("postgresql", "postgres"):
        return f"postgresql+psycopg://{rest}"
    return raw


def journal_name(target: str | os.PathLike) -> str:
    """How messages name a journal: a path as given, a URL with its password masked."""
    raw = os.fspath(target)
    return shown(raw) if "://" in raw else raw


def shown(url: str) -> str:
    """The URL for messages and logs: the password, if any, is masked."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def create_journal_engine(url: str, durability: str) -> Engine:
    """An engine whose connections write with the journal's durability and fail fast when the database is gone."""
    if durability not in DURABILITY:
        raise ValueError(f"durability must be one of {sorted(DURABILITY)}, got {durability!r}")
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise DatabaseUrlError(f"not a journal path or database URL: {shown(url)!r} ({exc})") from exc
    try:
        backend, driver = parsed.get_backend_name(), parsed.get_driver_name()  # the driver's name loads the dialect
    except ArgumentError as exc:  # NoSuchModuleError: no such dialect
        raise DatabaseUrlError(f"cannot use {shown(url)} as a journal: {exc}") from exc
    options: dict = {}
    if backend == "postgresql":
        # the journal's statements are compiled once and run through the driver with row tuples: positional style
        options.update(paramstyle="format", pool_pre_ping=True)
        if driver in LIBPQ_DRIVERS:
            options["connect_args"] = {k: v for k, v in LIBPQ_DEFAULTS.items() if k not in parsed.query}
    try:
        engine = create_engine(parsed, **options)
    except ModuleNotFoundError as exc:
        hint = " (pip install 'fsm-pd[postgres]')" if backend == "postgresql" else ""
        raise DatabaseUrlError(f"the driver for {shown(url)} is not installed: {exc}{hint}") from exc
    except ArgumentError as exc:
        raise DatabaseUrlError(f"cannot use {shown(url)} as a journal: {exc}") from exc
    if engine.dialect.name == "sqlite":
        _sqlite(engine, durability)
    elif engine.dialect.name == "postgresql":
        _postgresql(engine, durability)
    if not engine.dialect.positional:
        engine.dispose()
        raise DatabaseUrlError(f"the driver of {shown(url)} ({engine.dialect.driver}) takes only named parameters; "
                               f"a journal needs a positional one (postgresql+psycopg, sqlite)")
    return engine


def create_reader_engine(url: str) -> Engine:
    """An engine for reading a journal (replay): the driver and the libpq timeouts of a writer, nothing it sets."""
    parsed = make_url(url)
    options = {}
    if parsed.get_backend_name() == "postgresql" and parsed.get_driver_name() in LIBPQ_DRIVERS:
        options["connect_args"] = {k: v for k, v in LIBPQ_DEFAULTS.items() if k not in parsed.query}
    return create_engine(parsed, **options)


def _sqlite(engine: Engine, durability: str) -> None:
    # pysqlite's own transaction handling is off so that BEGIN/COMMIT are exactly ours (SQLAlchemy's documented
    # recipe); WAL lets replay read while a node writes.
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA synchronous={DURABILITY[durability]}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):
        conn.exec_driver_sql("BEGIN")


def _postgresql(engine: Engine, durability: str) -> None:
    level = PG_SYNCHRONOUS_COMMIT[durability]

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):
        cursor = dbapi_conn.cursor()
        cursor.execute(f"SET synchronous_commit TO {level}")  # SET is transactional in PostgreSQL: commit it
        cursor.close()
        dbapi_conn.commit()


def ping(engine: Engine) -> None:
    """One round trip to the database; raises the driver's error when it cannot be reached."""
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))
