"""The connection protocol of fsm-pd's servers, over real sockets on 127.0.0.1 (stub engines).

Slow clients cannot hold connections: those that send nothing, drip their headers or stall in their body are closed
(408 where a request began), while ordinary requests, kept-alive connections and long generations are untouched.
Clients that drop a stream leave no log noise behind and cancel the router's decode leg.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import threading
import time

import httpx
import pytest
from stub_engine import StubEngine

from fsm_pd.api import create_app
from fsm_pd.net.http_protocol import ReadTimeouts
from fsm_pd.net.http_server import AppServer
from fsm_pd.router import create_router_app
from fsm_pd.router.policy import CLASSIC_PD

LIMIT_S = 1.0  # the server's deadlines; every wait below is bounded by GIVE_UP_S, far above them
GIVE_UP_S = 60.0
HEAD = b"POST /generate HTTP/1.1\r\nHost: t\r\ncontent-type: application/json\r\n"


def read_until_closed(sock: socket.socket, deadline: float | None = None) -> bytes | None:
    """Everything the server sends until it closes the connection; None if it is still open at ``deadline``
    (default: GIVE_UP_S from now)."""
    sock.settimeout(0.2)
    data, deadline = b"", deadline if deadline is not None else time.monotonic() + GIVE_UP_S
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
    return None


def connect(port: int, first: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if first:
        sock.sendall(first)
    return sock


@pytest.fixture
def server():
    engine = StubEngine(role="colocated", token_delay_s=0.0)
    with AppServer(create_app(engine, engine.tokenizer), read_timeouts=ReadTimeouts(LIMIT_S, LIMIT_S)) as srv:
        yield srv, engine
        engine.close()


def open_connections(srv) -> int:
    return len(srv._server.server_state.connections)


def test_silent_slow_header_and_slow_body_connections_are_closed(server):
    srv, _ = server
    silent = [connect(srv.port) for _ in range(20)]
    slow_header = [connect(srv.port, HEAD[:30]) for _ in range(40)]
    slow_body = [connect(srv.port, HEAD + b"content-length: 1000\r\n\r\n{\"text\": \"") for _ in range(40)]
    with httpx.Client(base_url=srv.url, timeout=30) as client:  # the server answers others meanwhile
        ok = client.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 2}})
        assert ok.status_code == 200
    give_up = time.monotonic() + GIVE_UP_S
    try:
        for sock in silent + slow_header:
            got = read_until_closed(sock, give_up)
            assert got is not None, "a connection without complete headers was never closed"
            assert got == b"" or got.startswith(b"HTTP/1.1 408 ")
        for sock in slow_body:
            got = read_until_closed(sock, give_up)
            assert got is not None, "a connection with an incomplete body was never closed"
            assert got.startswith(b"HTTP/1.1 408 ") and b"request body not received within 1 s" in got
    finally:
        for sock in silent + slow_header + slow_body:
            sock.close()
    deadline = time.monotonic() + GIVE_UP_S
    while open_connections(srv) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert open_connections(srv) == 0


def test_a_drip_does_not_reset_the_clock(server):
    srv, _ = server
    sock = connect(srv.port, b"POST /generate HTTP/1.1\r\n")
    stop = threading.Event()

    def drip():  # one header byte every tenth of the deadline, forever: each alone would be "activity"
        for byte in iter(lambda: b"X", None):
            if stop.wait(LIMIT_S / 10):
                return
            try:
                sock.sendall(byte)
            except OSError:
                return

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    try:
        assert read_until_closed(sock) is not None, "a dripping client kept its connection open"
    finally:
        stop.set()
        dripper.join(5)
        sock.close()


def test_kept_alive_connections_and_long_answers_are_not_timed(server):
    srv, engine = server
    engine.token_delay_s = LIMIT_S / 2  # 6 tokens: the answer takes three deadlines' worth of time
    with httpx.Client(base_url=srv.url, timeout=GIVE_UP_S) as client:
        slow = client.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 6}})
        assert slow.status_code == 200 and len(slow.json()["output_ids"]) == 6
        # the connection is idle between requests now: uvicorn's keep-alive timer rules it, no read deadline is armed
        protocols = list(srv._server.server_state.connections)
        assert len(protocols) == 1 and protocols[0]._deadline is None
        engine.token_delay_s = 0.0
        again = client.post("/generate", json={"text": "b", "sampling_params": {"max_new_tokens": 1}})
        assert again.status_code == 200
        assert len(list(srv._server.server_state.connections)) == 1  # the same connection served both


def test_read_timeouts_from_flags_environment_and_defaults(monkeypatch):
    monkeypatch.delenv("FSM_PD_HEADER_TIMEOUT_S", raising=False)
    monkeypatch.delenv("FSM_PD_BODY_TIMEOUT_S", raising=False)
    assert ReadTimeouts.from_env() == ReadTimeouts(10.0, 30.0)
    monkeypatch.setenv("FSM_PD_HEADER_TIMEOUT_S", "3")
    monkeypatch.setenv("FSM_PD_BODY_TIMEOUT_S", "0")
    assert ReadTimeouts.from_env() == ReadTimeouts(3.0, None)  # 0 turns a limit off
    assert ReadTimeouts.from_env(header_s=5, body_s=7) == ReadTimeouts(5, 7)  # flags win
    monkeypatch.setenv("FSM_PD_BODY_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="FSM_PD_BODY_TIMEOUT_S"):
        ReadTimeouts.from_env()


def _drop_streams(port: int, count: int, *, reset: bool) -> None:
    """``count`` clients at once, each reading the start of a long stream and then leaving (RST or FIN)."""
    body = json.dumps({"text": "a", "stream": True, "sampling_params": {"max_new_tokens": 500}}).encode()

    def one() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(HEAD + b"content-length: %d\r\n\r\n%s" % (len(body), body))
            got = b""
            while len(got) < 2000:
                chunk = sock.recv(4096)
                assert chunk, got
                got += chunk
            assert got.startswith(b"HTTP/1.1 200 ")
            if reset:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    threads = [threading.Thread(target=one) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(GIVE_UP_S)


@pytest.mark.parametrize("reset, token_delay_s", [(True, 0.0), (False, 0.002)])
def test_router_streams_cut_by_clients_end_quietly_and_cancel_the_decode(caplog, reset, token_delay_s):
    caplog.set_level(logging.WARNING, logger="asyncio")
    prefill, decode = StubEngine(role="prefill"), StubEngine(role="decode", token_delay_s=token_delay_s)
    with contextlib.ExitStack() as stack:
        p_url = stack.enter_context(AppServer(create_app(prefill, prefill.tokenizer, bootstrap_port=8998))).url
        d_url = stack.enter_context(AppServer(create_app(decode, decode.tokenizer, bootstrap_port=8998))).url
        router = stack.enter_context(AppServer(create_router_app([(p_url, 8998)], [d_url], pd_policy=CLASSIC_PD)))
        _drop_streams(router.port, 32, reset=reset)
        deadline = time.monotonic() + GIVE_UP_S
        while decode.live and time.monotonic() < deadline:  # every decode leg ends (cancelled, or ran out)
            time.sleep(0.02)
        assert decode.live == []
        with httpx.Client(base_url=router.url, timeout=30) as client:  # the router still serves
            assert client.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 2}}).is_success
        prefill.close()
        decode.close()
    noise = [r.getMessage() for r in caplog.records if "socket.send() raised exception" in r.getMessage()]
    assert noise == []
