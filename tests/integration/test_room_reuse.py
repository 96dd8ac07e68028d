"""A bootstrap room is used once per node: reused while live, after it finished, or after a restart, it gets a 409
from both nodes and on every route, and the node keeps serving (tiny model, real engines and HTTP servers on
127.0.0.1, the in-process ``fake`` data plane).

Before this, a reused room made a duplicate journal row, the node loop stopped ("the journal could not be
written"), and every later request hung.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from fsm_pd.api import AppServer, create_app
from fsm_pd.machines import KVPoll
from fsm_pd.model.loader import load_model
from fsm_pd.serving.decode_engine import DecodeEngine
from fsm_pd.serving.prefill_engine import PrefillEngine
from fsm_pd.transport import generate_secret

PAGES, PAGE_SIZE = 96, 4
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


class Node:
    """An engine behind its HTTP app; ``restart()`` closes both and starts them again on the same journal."""

    def __init__(self, make):
        self._make = make
        self._stack = contextlib.ExitStack()
        self.start()

    def start(self) -> None:
        self.engine = self._make()
        port = self.engine.bootstrap_host_port[1] if isinstance(self.engine, PrefillEngine) else None
        self.server = AppServer(create_app(self.engine, self.engine.model.tokenizer, bootstrap_port=port)).start()
        self.client = httpx.Client(base_url=self.server.url, timeout=TIMEOUT_S)

    def stop(self) -> None:
        self.client.close()
        self.server.stop()
        self.engine.close()

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def pd(model, tmp_path):
    secret = generate_secret()  # the deployment's: a restarted node comes back with it
    p = Node(lambda: PrefillEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", secret=secret,
                                   journal=str(tmp_path / "p.db"), node_id="prefill-0"))
    d = Node(lambda: DecodeEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", secret=secret,
                                  journal=str(tmp_path / "d.db"), node_id="decode-0"))
    yield p, d
    d.stop()
    p.stop()


def body(p: Node, room: int, path: str = "/generate") -> dict:
    host, port = p.engine.bootstrap_host_port
    fields = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
    if path == "/generate":
        return {"text": "hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0}, **fields}
    if path == "/v1/completions":
        return {"prompt": "hello", "max_tokens": 3, "temperature": 0, **fields}
    return {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "temperature": 0, **fields}


def routed(p: Node, d: Node, room: int, path: str = "/generate") -> tuple[httpx.Response, httpx.Response]:
    """What a router does: the same body to both nodes at once."""
    with ThreadPoolExecutor(2) as pool:
        legs = [pool.submit(node.client.post, path, json=body(p, room, path)) for node in (p, d)]
        return legs[0].result(), legs[1].result()


def assert_reused(response: httpx.Response, room: int) -> None:
    assert response.status_code == 409, response.text
    message = response.json()["error"]["message"]
    assert f"bootstrap_room {room}" in message and ("already used" in message or "in use" in message)


def assert_serving(p: Node, d: Node, room: int) -> None:
    prefill, decode = routed(p, d, room)
    assert prefill.status_code == 200 and decode.status_code == 200, (prefill.text, decode.text)
    assert len(decode.json()["output_ids"]) == 3


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_a_finished_room_reused_is_409_on_both_nodes(pd, path):
    p, d = pd
    assert_serving(p, d, 11)
    prefill, decode = routed(p, d, 11, path)
    assert_reused(prefill, 11)
    assert_reused(decode, 11)
    assert_serving(p, d, 12)  # both loops still run: the next room is served


def test_a_live_room_reused_is_409_and_the_first_request_is_untouched(pd):
    p, d = pd
    with ThreadPoolExecutor(1) as pool:
        # the prefill node alone: its room waits for a decode node's PREPARE, so it stays live
        first = pool.submit(p.client.post, "/generate", json=body(p, 21))
        with httpx.Client(timeout=TIMEOUT_S) as poll:
            for _ in range(int(TIMEOUT_S / 0.02)):
                if p.engine.manager.poll(21) is not None:
                    break
                poll.get(p.server.url + "/health")  # a round trip instead of a sleep
        assert p.engine.manager.poll(21) is KVPoll.Bootstrapping
        assert_reused(p.client.post("/generate", json=body(p, 21)), 21)
        # now the decode node takes the same room: the first request completes as if nothing happened
        decode = d.client.post("/generate", json=body(p, 21))
        assert decode.status_code == 200 and first.result().status_code == 200


def test_rooms_used_before_a_restart_are_409_after_it(pd):
    p, d = pd
    assert_serving(p, d, 31)
    with ThreadPoolExecutor(1) as pool:  # a room still live when the node goes down: failed by the restart
        pending = pool.submit(p.client.post, "/generate", json=body(p, 32))
        with httpx.Client(timeout=TIMEOUT_S) as poll:
            for _ in range(int(TIMEOUT_S / 0.02)):
                if p.engine.manager.poll(32) is not None:
                    break
                poll.get(p.server.url + "/health")
        p.restart()
        # the client of room 32 was cut off by the restart (its connection closed, or an error answer)
        assert pending.exception() is not None or pending.result().status_code >= 500
    d.restart()
    prefill, decode = routed(p, d, 31)  # finished before the restart
    assert_reused(prefill, 31)
    assert_reused(decode, 31)
    # live at the restart and failed by it (the decode node never saw it: sent there, it would wait for a
    # prefill node that refuses it, until a router cancels that leg)
    assert_reused(p.client.post("/generate", json=body(p, 32)), 32)
    assert_serving(p, d, 33)


def test_the_largest_room_is_served_and_a_larger_one_refused(pd):
    p, d = pd
    assert_serving(p, d, 2**63 - 1)
    for node in (p, d):
        r = node.client.post("/generate", json=body(p, 2**63))
        assert r.status_code == 400 and "bootstrap_room" in r.json()["error"]["message"]
    assert_serving(p, d, 41)
