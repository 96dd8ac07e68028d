"""A journal that cannot be read stops the node: the request that found out gets a 503 naming the journal (not a
500), /health says why, later requests are refused with the same reason. The journal's room check is made to fail
here (a unit test: its database is a SQLite file); test_postgres_journal.py stops a real PostgreSQL server."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from node_sockets import node_sockets
from test_serving_colocated import PAGE_SIZE, PAGES, request

from fsm_pd.model.loader import load_model
from fsm_pd.serving.prefill_engine import PrefillEngine
from fsm_pd.serving.types import Bootstrap, EngineError, RequestStream
from fsm_pd.store import JournalError

GONE = "journal postgresql://fsm:***@db:5432/journal read failed: connection refused"


@pytest.fixture
def prefill(tmp_path):
    engine = PrefillEngine(load_model("tiny"), num_pages=PAGES, page_size=PAGE_SIZE, backend="fake",
                           journal=str(tmp_path / "p.db"), **node_sockets(tmp_path, "p", bootstrap=True))
    yield engine
    engine.close()


def submit(engine: PrefillEngine, rid: str, room: int) -> None:
    host, port = engine.bootstrap_host_port
    req = dataclasses.replace(request(rid, [1, 2, 3]), bootstrap=Bootstrap(host, port, room))

    async def go():  # a stream belongs to an event loop, as in the API
        engine.submit(req, RequestStream(rid))

    asyncio.run(go())


def test_a_failed_room_check_stops_the_node_with_a_503(prefill, monkeypatch):
    def unreachable(node, role, room):
        raise JournalError(GONE)

    monkeypatch.setattr(prefill.manager.journal, "has_room", unreachable)
    assert prefill.health() is None
    with pytest.raises(EngineError) as first:
        submit(prefill, "r1", 7)
    assert first.value.status == 503 and GONE in str(first.value)
    assert GONE in (prefill.health() or ""), "the node still says it can serve"
    with pytest.raises(EngineError) as later:
        submit(prefill, "r2", 8)
    assert later.value.status == 503 and GONE in str(later.value)
    assert prefill.info()["requests_live"] == 0  # the refused requests hold nothing
