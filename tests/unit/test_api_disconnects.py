"""A client that leaves a stream midway: its request is aborted, counted as 499 (not 200), and leaves no "Task
exception was never retrieved" behind (stub engine, real sockets)."""

from __future__ import annotations

import gc
import logging
import time

import httpx
import pytest
from real_parts import TCP
from stub_engine import stub_server

from fsm_pd.store.causes import REQUEST_CLOSED

pytestmark = TCP  # every test here serves or connects on 127.0.0.1 (tests/real_parts.py)

GIVE_UP_S = 30.0


def counted(client: httpx.Client, status: str, route: str = "/generate") -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'fsm_pd_http_requests_total{{route="{route}",status="{status}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def until(predicate) -> bool:
    deadline = time.monotonic() + GIVE_UP_S
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


@pytest.mark.parametrize("path, body", [
    ("/generate", {"text": "a", "stream": True, "sampling_params": {"max_new_tokens": 400}}),
    ("/v1/completions", {"prompt": "a", "stream": True, "max_tokens": 400}),
])
def test_a_stream_cut_by_its_client_is_aborted_counted_499_and_quiet(caplog, path, body):
    caplog.set_level(logging.ERROR, logger="asyncio")
    with stub_server("colocated", token_delay_s=0.005) as (url, engine), httpx.Client(base_url=url) as client:
        for _ in range(5):
            with httpx.Client(base_url=url, timeout=GIVE_UP_S) as leaving, leaving.stream("POST", path, json=body) as r:
                assert r.status_code == 200
                for i, _line in enumerate(r.iter_lines()):
                    if i == 3:
                        break  # and the connection closes with the client
        assert until(lambda: len(engine.aborted) == 5 and engine.live == [])
        assert engine.abort_reasons == [REQUEST_CLOSED] * 5  # not "by the client": a router's close looks the same
        assert until(lambda: counted(client, "499", path) == 5)
        assert counted(client, "200", path) == 0
        whole = client.post(path, json={**body, "stream": False, "max_tokens": 2,
                                        "sampling_params": {"max_new_tokens": 2}})
        assert whole.status_code == 200 and counted(client, "200", path) == 1  # a stream read to its end is a 200 too
        gc.collect()  # an abandoned task's exception is reported when the task is collected
    assert [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()] == []


def test_a_stream_read_to_its_end_is_a_200(caplog):
    with stub_server("colocated") as (url, _), httpx.Client(base_url=url, timeout=GIVE_UP_S) as client:
        with client.stream("POST", "/generate", json={"text": "a", "stream": True,
                                                      "sampling_params": {"max_new_tokens": 5}}) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        assert until(lambda: counted(client, "200") == 1)
        assert counted(client, "499") == 0
