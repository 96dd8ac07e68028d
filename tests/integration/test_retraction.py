"""Retraction on real processes: `fsm-pd serve` prefill and decode nodes (tiny model) behind the built-in router,
the decode pool sized for about 20 of the 40 concurrent streams of 128 tokens each. Every stream completes with no
error event, its greedy tokens equal those of an unpressured colocated node, and the decode node's /server_info and
/metrics count the retractions and resumptions. A request that could never fit the pool gets a 400, and
/flush_cache answers as SGLang's does (400 while requests run, 200 when idle)."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from greedy_ties import split_at_a_tie, tiny_prompt_ids
from processes import PAGE_SIZE, Cluster, free_port

# 128 tokens a stream: each grows from 2 pages to 10, so a pool for 20 fills and retracts as it did at 256 (18
# pages), for half the decode steps (the module took 28 s alone, 32 s in the suite)
STREAMS, NEW_TOKENS = 40, 128
PROMPTS = [f"stream {i}: the quick brown fox" for i in range(STREAMS)]  # 29 or 30 bytes: 2 pages of 16
PAGES_PER_STREAM = -(-(30 + NEW_TOKENS) // PAGE_SIZE)  # 10
DECODE_PAGES = 20 * PAGES_PER_STREAM + 1  # room for about 20 whole streams (page 0 is padding)
OPENAI_EVERY = 4  # every 4th stream is an OpenAI completions stream (they failed with "out of pages" before)


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.stop()


def stream(url: str, i: int) -> tuple[list[str], dict]:
    """One streamed request; returns the raw `data:` payloads and what it produced."""
    if i % OPENAI_EVERY == OPENAI_EVERY - 1:
        path, body = "/v1/completions", {"model": "tiny", "prompt": PROMPTS[i], "max_tokens": NEW_TOKENS,
                                         "temperature": 0, "ignore_eos": True, "stream": True}
    else:
        path, body = "/generate", {"text": PROMPTS[i], "stream": True, "sampling_params": {
            "max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
    events: list[str] = []
    with httpx.stream("POST", url + path, json=body, timeout=600) as answer:
        assert answer.status_code == 200, answer.read()
        for line in answer.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    chunks = [c for c in (json.loads(e) for e in events if e != "[DONE]") if "error" not in c]  # errors: see test
    if path == "/generate":
        last = chunks[-1] if chunks else {"output_ids": None, "meta_info": {"finish_reason": None}}
        got = {"ids": last["output_ids"], "finish": last["meta_info"]["finish_reason"]}
    else:
        got = {"text": "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")),
               "finish": [None, *(c["choices"][0]["finish_reason"] for c in chunks if c.get("choices"))][-1]}
    return events, got


def all_streams(url: str) -> list[tuple[list[str], dict]]:
    with ThreadPoolExecutor(STREAMS) as pool:
        return list(pool.map(lambda i: stream(url, i), range(STREAMS)))


def different_outputs(pressured, unpressured) -> list[tuple[int, str]]:
    """The streams whose pressured output is not the unpressured one, with why. Token ids may split at a tie of the
    tiny model (``greedy_ties``: stream 20's first token is one); texts, which lost their ids, must be equal."""
    found = []
    for i, ((_, got), (_, want)) in enumerate(zip(pressured, unpressured, strict=True)):
        if got["finish"] != want["finish"]:
            found.append((i, f"finish {got['finish']} != {want['finish']}"))
        elif "ids" in got:
            if (why := split_at_a_tie(tiny_prompt_ids(PROMPTS[i]), got["ids"] or [], want["ids"] or [])) is not None:
                found.append((i, why))
        elif got["text"] != want["text"]:
            found.append((i, "texts differ"))
    return found


def engine_info(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=30).json()["internal_states"][0]


def test_forty_streams_on_a_pool_for_twenty_all_complete_with_unpressured_output(cluster):
    boot = free_port()
    p, d, colocated = cluster.serve_many(
        ("prefill", "--model", "tiny", "--bootstrap-port", str(boot), "--transfer-backend", "tcp"),
        ("decode", "--model", "tiny", "--transfer-backend", "tcp", "--num-pages", str(DECODE_PAGES)),
        ("colocated", "--model", "tiny", "--num-pages", str(2 * STREAMS * PAGES_PER_STREAM)))
    router = cluster.router(p, boot, d)

    # while the streams run, /flush_cache on the decode node is refused as SGLang refuses it
    flush_answers: list[int] = []
    stop = threading.Event()

    def flush_while_busy():
        while not stop.is_set() and not flush_answers:
            if engine_info(d)["requests_running"] > 0:
                flush_answers.append(httpx.post(d + "/flush_cache", timeout=30).status_code)
            stop.wait(0.2)

    flusher = threading.Thread(target=flush_while_busy)
    flusher.start()
    try:
        pressured = all_streams(router)
    finally:
        stop.set()
        flusher.join()
    unpressured = all_streams(colocated)

    errors = [(i, e) for i, (events, _) in enumerate(pressured) for e in events if '"error"' in e]
    assert not errors, errors[:3]
    assert all(events[-1] == "[DONE]" for events, _ in pressured)
    assert different_outputs(pressured, unpressured) == []
    assert all(len(got.get("ids", [0] * NEW_TOKENS)) == NEW_TOKENS for _, got in pressured)

    info = engine_info(d)
    assert info["preempted"] > 0, "a pool for 20 streams must have retracted some of 40"
    assert info["resumed"] == info["preempted"] and info["retracted_waiting"] == 0
    assert info["pages_reserved"] == 0 and info["requests_live"] == 0
    assert engine_info(colocated)["preempted"] == 0
    metrics = httpx.get(d + "/metrics", timeout=30).text
    assert re.search(rf'^fsm_pd_preemptions_total{{[^}}]*role="decode"[^}}]*}} {info["preempted"]}\.0$', metrics,
                     re.M), metrics
    assert re.search(rf'^fsm_pd_resumptions_total{{[^}}]*}} {info["resumed"]}\.0$', metrics, re.M)

    assert flush_answers == [400]
    for url in (p, d, colocated):
        answer = httpx.post(url + "/flush_cache", timeout=30)
        assert answer.status_code == 200, (url, answer.text)

    # a request that could never fit the decode pool, even alone: a 400 naming the limit, not a stall or a 500
    body = {"text": "hi", "sampling_params": {"max_new_tokens": (DECODE_PAGES - 1) * PAGE_SIZE, "temperature": 0}}
    answer = httpx.post(router + "/generate", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    assert "context" in answer.text or "KV pool" in answer.text

