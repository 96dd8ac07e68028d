"""Aborts reach their own attempt only: on a PD node a request is its rid and its bootstrap room, and a router's
retry of a failed attempt (the client's rid, a new room) is a different request there. Real prefill and decode
engines (tiny model, the in-process ``fake`` data plane) behind their HTTP apps on 127.0.0.1.

The race these pin down (seen in rolling restarts, then covered by a second abort 50 ms later in the router): a
draining prefill refused an attempt at once; the router's abort of that attempt reached the decode node before the
attempt's own request did; that request then registered, waited on a room its prefill never opened, and held the rid
when the retry came, which got 400 "request ... is already running".
"""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest
from polling import until
from test_room_reuse import PAGE_SIZE, PAGES, Node

from fsm_pd.serving.decode_engine import DecodeEngine
from fsm_pd.serving.prefill_engine import PrefillEngine
from fsm_pd.transport import generate_secret

LATE_S = 10.0  # a request refused at submit answers at once; one that registered would wait for its room far longer


@pytest.fixture(scope="module")
def pd(model, tmp_path_factory):
    tmp, secret = tmp_path_factory.mktemp("attempts"), generate_secret()
    p = Node(lambda: PrefillEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", secret=secret,
                                   journal=str(tmp / "p.db"), node_id="prefill-0"))
    d = Node(lambda: DecodeEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", secret=secret,
                                  journal=str(tmp / "d.db"), node_id="decode-0"))
    yield p, d
    d.stop()
    p.stop()


def attempt(p: Node, rid: str, room: int) -> dict:
    """One attempt's body, as the router sends it to both nodes."""
    host, port = p.engine.bootstrap_host_port
    return {"text": "hello", "rid": rid, "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}


def post_then_leave(node: Node, body: dict) -> socket.socket:
    """POST ``body`` to /generate on a raw connection; closing the socket is the client going away."""
    url = urlsplit(node.server.url)
    conn = socket.create_connection((url.hostname, url.port))
    data = json.dumps(body).encode()
    conn.sendall(b"POST /generate HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return conn


def live(node: Node, rid: str, room: int) -> bool:
    return node.engine.requests.get(rid, room) is not None


def test_an_abort_that_comes_before_its_attempt_refuses_it_and_the_retry_runs(pd):
    p, d = pd
    early = d.client.post("/abort_request", json={"rid": "client-1", "room": 51})
    assert early.status_code == 200 and early.json() == {"aborted": []}
    # the attempt's own decode request, late: refused at once instead of waiting on room 51 (its prefill has none)
    late = d.client.post("/generate", json=attempt(p, "client-1", 51), timeout=LATE_S)
    assert late.status_code == 499, late.text
    assert "aborted before it arrived" in late.json()["error"]["message"]
    with ThreadPoolExecutor(2) as pool:  # the retry: the same rid, a new room, on both nodes
        legs = [pool.submit(node.client.post, "/generate", json=attempt(p, "client-1", 52)) for node in (p, d)]
        prefill, decode = (leg.result() for leg in legs)
    assert prefill.status_code == 200 and decode.status_code == 200, (prefill.text, decode.text)
    assert len(decode.json()["output_ids"]) == 3
    assert until(lambda: d.engine.info()["requests_live"] == 0 and p.engine.info()["requests_live"] == 0)


def test_a_retry_beside_its_live_attempt_outlives_that_attempts_client_leaving(pd):
    p, d = pd
    # the first attempt on the prefill node alone: its room waits for a decode node's PREPARE, so it stays live
    first = post_then_leave(p, attempt(p, "client-2", 61))
    try:
        assert until(lambda: live(p, "client-2", 61))
        with ThreadPoolExecutor(1) as pool:
            retry = pool.submit(p.client.post, "/generate", json=attempt(p, "client-2", 62))
            assert until(lambda: live(p, "client-2", 62) or retry.done())
            assert not retry.done(), retry.result().text  # taken beside the first, not refused as "already running"
            first.close()  # its client goes away: the node aborts that attempt, by its rid and room
            first = None
            assert until(lambda: not live(p, "client-2", 61))
            assert live(p, "client-2", 62) and not retry.done()  # the retry was not aborted with it
            decode = d.client.post("/generate", json=attempt(p, "client-2", 62))
            assert decode.status_code == 200 and retry.result().status_code == 200, (decode.text, retry.result().text)
    finally:
        if first is not None:
            first.close()
    assert until(lambda: d.engine.info()["requests_live"] == 0 and p.engine.info()["requests_live"] == 0)
