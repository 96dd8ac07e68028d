"""``/health`` tells the truth: a node whose loop stopped (its journal cannot be written) or whose model thread died
answers 503 with the reason, on every role, and no request is left waiting on it: those in flight end with a 503,
later ones are refused at once. Real engines (tiny model) behind their HTTP apps on 127.0.0.1."""

from __future__ import annotations

import sqlite3
import threading

import httpx
import pytest
from polling import until
from stub_engine import StubEngine

from fsm_pd.api import AppServer, create_app
from fsm_pd.serving.colocated_engine import ColocatedEngine
from fsm_pd.serving.decode_engine import DecodeEngine
from fsm_pd.serving.prefill_engine import PrefillEngine

CLIENT_TIMEOUT_S = 120.0  # a hang shows up as this timeout, far beyond any answer here
JOURNAL_REFUSES = "injected: the disk refuses journal writes"




def refuse_journal_writes(path: str) -> None:
    """From outside the node, as a full disk or a broken volume would: every later journal insert fails."""
    with sqlite3.connect(path) as db:
        db.execute("CREATE TRIGGER refuse BEFORE INSERT ON transitions "
                   f"BEGIN SELECT RAISE(ABORT, '{JOURNAL_REFUSES}'); END")


@pytest.fixture
def nodes(model, tmp_path):
    """``make(role)`` -> (engine, journal path, the bootstrap (host, port) its PD requests name). A decode node gets a
    real prefill partner to resolve, which never sees the request: the room then waits (its deadlines are minutes)
    instead of failing on its own while the test runs."""
    made = []

    def make(role: str):
        journal = str(tmp_path / f"{role}.db")
        if role == "colocated":
            made.append(ColocatedEngine(model, num_pages=64, page_size=4))
            return made[-1], None, None
        prefill = PrefillEngine(model, num_pages=64, page_size=4, backend="fake", journal=str(tmp_path / "p.db"))
        made.append(prefill)
        if role == "prefill":
            return prefill, str(tmp_path / "p.db"), prefill.bootstrap_host_port
        made.append(DecodeEngine(model, num_pages=64, page_size=4, backend="fake", journal=journal,
                                 secret=prefill.secret))
        return made[-1], journal, prefill.bootstrap_host_port

    yield make
    for engine in reversed(made):
        engine.close()


def body_for(bootstrap, room: int = 7, **sampling) -> dict:
    body = {"text": "hello there", "sampling_params": {"max_new_tokens": 4, **sampling}}
    if bootstrap is not None:
        body.update(bootstrap_host=bootstrap[0], bootstrap_port=bootstrap[1], bootstrap_room=room)
    return body


def unhealthy(url: str, *needles: str) -> None:
    for path in ("/health", "/health_generate"):
        r = httpx.get(url + path, timeout=CLIENT_TIMEOUT_S)
        assert r.status_code == 503, (path, r.text)
        reason = r.json()["reason"]
        assert all(n in reason for n in needles), (path, reason)


def test_health_reports_what_the_engine_says():
    engine = StubEngine()
    engine.health = lambda: "the model thread died: MemoryError"
    with AppServer(create_app(engine, engine.tokenizer)) as server:
        unhealthy(server.url, "MemoryError")
        engine.health = lambda: None
        assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_node_whose_journal_cannot_be_written_is_503_and_leaves_nobody_waiting(role, nodes, model):
    engine, journal, bootstrap = nodes(role)
    with AppServer(create_app(engine, model.tokenizer, bootstrap_port=8998)) as server:
        assert httpx.get(server.url + "/health").status_code == 200
        refuse_journal_writes(journal)
        r = httpx.post(server.url + "/generate", json=body_for(bootstrap), timeout=CLIENT_TIMEOUT_S)
        assert r.status_code == 503 and JOURNAL_REFUSES in r.json()["error"]["message"], r.text
        unhealthy(server.url, "journal could not be written", JOURNAL_REFUSES)
        later = httpx.post(server.url + "/generate", json=body_for(bootstrap, room=8), timeout=CLIENT_TIMEOUT_S)
        assert later.status_code == 503 and "cannot serve" in later.json()["error"]["message"]


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_a_dead_model_thread_is_503_and_ends_requests_in_flight(role, nodes, model):
    engine, _, bootstrap = nodes(role)
    with AppServer(create_app(engine, model.tokenizer, bootstrap_port=8998)) as server:
        assert httpx.get(server.url + "/health").status_code == 200
        release, held = threading.Event(), threading.Event()
        engine.model_thread.submit(lambda _: (held.set(), release.wait(CLIENT_TIMEOUT_S)))
        assert held.wait(30)
        body = body_for(bootstrap, max_new_tokens=200, ignore_eos=True)
        answers = []
        client = threading.Thread(target=lambda: answers.append(
            httpx.post(server.url + "/generate", json=body, timeout=CLIENT_TIMEOUT_S)))
        client.start()
        assert until(lambda: len(engine.requests) == 1), "the request never reached the engine"

        def fatal(_):
            raise MemoryError("injected: out of host memory")

        dying = engine.model_thread.submit(fatal)  # queued behind the request's own work
        release.set()
        with pytest.raises(MemoryError):
            dying.result(CLIENT_TIMEOUT_S)
        client.join(CLIENT_TIMEOUT_S)
        assert answers and answers[0].status_code == 503, answers and answers[0].text
        assert "injected: out of host memory" in answers[0].json()["error"]["message"]
        unhealthy(server.url, "MemoryError", "injected: out of host memory")
        later = httpx.post(server.url + "/generate", json=body_for(bootstrap, room=8), timeout=CLIENT_TIMEOUT_S)
        assert later.status_code == 503 and "cannot serve" in later.json()["error"]["message"]
