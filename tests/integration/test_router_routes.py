"""The routes SGLang's clients call besides generation, on real processes (tiny model): a prefill and a decode node
behind the built-in router. /abort_request reaches the workers that hold the request, /flush_cache every worker,
/tokenize, /detokenize, /get_load, /v1/models/{id} and the router's own /metrics answer as SGLang's do.

The test process's shared PD cluster (``conftest.pd_urls``: processes started there, stopped by PID); everything on
127.0.0.1.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

# one xdist worker runs every module on the shared PD cluster (conftest.pd_urls), so that a run starts it once
pytestmark = pytest.mark.xdist_group("shared-pd")

TIMEOUT_S = 180


@pytest.fixture(scope="module")
def pd(pd_urls):
    """(router URL, prefill URL, decode URL): the test process's shared PD cluster (``conftest.pd_urls``). These tests
    hold nothing across it: they read the router's counters as growth, abort what they start and wait until the
    decode node has dropped it, and a flushed cache is only an empty one."""
    return pd_urls["router"], pd_urls["prefill"], pd_urls["decode"]


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample of a Prometheus text exposition (0 when absent); labels in any order."""
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        sample, _, rest = head.partition("{")
        found = dict(pair.split("=", 1) for pair in rest.rstrip("}").split(",") if pair) if rest else {}
        if sample == name and {k: v.strip('"') for k, v in found.items()} == labels:
            return float(value)
    return 0.0


class HeldStream:
    """A streamed /generate through the router, read on a thread: its chunks, and when it ended."""

    def __init__(self, url: str, body: dict):
        self.chunks: list[dict | str] = []
        self.first = threading.Event()
        self.ended = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self.thread.start()

    def _read(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=TIMEOUT_S) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        data = line[5:].strip()
                        self.chunks.append(data if data == "[DONE]" else json.loads(data))
                        self.first.set()
        finally:
            self.first.set()
            self.ended.set()


def long_body(rid: str) -> dict:
    return {"text": "abort me", "rid": rid,
            "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}}


def test_tokenize_and_detokenize_through_the_router_as_on_a_node(pd):
    router, prefill, decode = pd
    for url in (router, decode):
        one = httpx.post(url + "/tokenize", json={"prompt": "héllo"}, timeout=30).json()
        assert one["tokens"] == list("héllo".encode()) and one["count"] == 6 and one["max_model_len"] > 6
        many = httpx.post(url + "/v1/tokenize", json={"prompt": ["a", "bc"]}, timeout=30).json()
        assert many["tokens"] == [[97], [98, 99]] and many["count"] == [1, 2]
        text = httpx.post(url + "/detokenize", json={"tokens": one["tokens"]}, timeout=30).json()
        assert text == {"text": "héllo"}
        texts = httpx.post(url + "/v1/detokenize", json={"tokens": [[97], [98, 99]]}, timeout=30).json()
        assert texts == {"text": ["a", "bc"]}
    bad = httpx.post(router + "/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400 and "tokens" in bad.json()["error"]["message"]
    missing = httpx.post(router + "/tokenize", json={"text": "no prompt field"}, timeout=30)
    assert missing.status_code == 400 and "prompt" in missing.json()["error"]["message"]


def test_one_model_card_through_the_router(pd):
    router, _, _ = pd
    name = httpx.get(router + "/v1/models", timeout=30).json()["data"][0]["id"]
    card = httpx.get(f"{router}/v1/models/{name}", timeout=30)
    assert card.status_code == 200 and card.json()["id"] == name and card.json()["object"] == "model"
    unknown = httpx.get(router + "/v1/models/no-such-model", timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_abort_request_reaches_the_workers_that_hold_it(pd):
    router, prefill, decode = pd
    assert httpx.post(router + "/abort_request", json={"rid": "nobody"}, timeout=30).json() == {"aborted": []}
    held = HeldStream(router, long_body("abort-me-1"))
    assert held.first.wait(TIMEOUT_S) and isinstance(held.chunks[0], dict), held.chunks
    load = httpx.get(router + "/get_load", timeout=30).json()
    assert [entry["load"][0]["num_reqs"] for entry in load["decode"]] == [1]
    assert load["decode"][0]["load"][0]["num_tokens"] > len("abort me")
    answer = httpx.post(router + "/abort_request", json={"rid": "abort-me-1"}, timeout=30)
    assert answer.status_code == 200 and answer.json()["aborted"] == ["abort-me-1"]
    assert held.ended.wait(30), "the stream went on after its abort"
    assert held.chunks[-1] == "[DONE]"
    tokens = len(held.chunks[-3]["output_ids"]) if len(held.chunks) > 2 else 0
    assert tokens < 2000 and "error" in held.chunks[-2], held.chunks[-2:]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the decode node drops it at its next step
        if httpx.get(decode + "/get_load", timeout=30).json()[0]["num_reqs"] == 0:
            break
        time.sleep(0.2)
    assert httpx.get(decode + "/get_load", timeout=30).json()[0]["num_reqs"] == 0
    # once the request ended the router forgets it: nothing left to abort, nothing kept
    assert httpx.post(router + "/abort_request", json={"rid": "abort-me-1"}, timeout=30).json() == {"aborted": []}
    assert httpx.get(router + "/server_info", timeout=30).json()["requests_running"] == 0


def test_flush_cache_goes_to_every_worker(pd):
    router, prefill, decode = pd
    held = HeldStream(router, long_body("busy-1"))
    assert held.first.wait(TIMEOUT_S)
    busy = httpx.post(router + "/flush_cache", timeout=30)
    assert busy.status_code == 400 and busy.json()["workers"][decode]["status"] == 400  # requests are live there
    httpx.post(router + "/abort_request", json={"rid": "busy-1"}, timeout=30)
    assert held.ended.wait(30)
    deadline, flushed = time.monotonic() + 30, None
    while time.monotonic() < deadline:
        flushed = httpx.post(router + "/flush_cache", timeout=30)
        if flushed.status_code == 200:
            break
        time.sleep(0.2)
    assert flushed.status_code == 200, flushed.text
    assert set(flushed.json()["workers"]) == {prefill, decode}
    assert httpx.get(router + "/flush_cache", timeout=30).status_code == 200  # GET too, as SGLang


def test_router_metrics_count_requests_errors_and_in_flight(pd):
    router, _, _ = pd
    before = httpx.get(router + "/metrics", timeout=30).text
    ok = httpx.post(router + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert ok.status_code == 200
    bad = httpx.post(router + "/generate", json={"text": "hi", "sampling_params": {"top_p": 7}}, timeout=60)
    assert bad.status_code == 400
    held = HeldStream(router, long_body("metrics-1"))
    assert held.first.wait(TIMEOUT_S)
    during = httpx.get(router + "/metrics", timeout=30).text
    assert metric(during, "fsm_pd_router_requests_in_flight", route="/generate") == 1
    httpx.post(router + "/abort_request", json={"rid": "metrics-1"}, timeout=30)
    assert held.ended.wait(30)
    deadline = time.monotonic() + 30
    while metric(after := httpx.get(router + "/metrics", timeout=30).text,  # counted once its last byte is sent
                 "fsm_pd_router_requests_in_flight", route="/generate") != 0:
        assert time.monotonic() < deadline, "the ended stream is still in flight"
        time.sleep(0.05)

    def grew(name: str, **labels) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grew("fsm_pd_router_requests_total", route="/generate", status="200") == 2  # the whole one, the stream
    assert grew("fsm_pd_router_requests_total", route="/generate", status="400") == 1
    assert grew("fsm_pd_router_errors_total", route="/generate", kind="client") == 1
    assert grew("fsm_pd_router_request_seconds_count", route="/generate") == 3
