"""The decode node's pre-allocation queue on real processes: `fsm-pd serve` prefill and decode nodes (tiny model)
behind the built-in router in classic PD (every request needs the decode node's pages), and a burst of four times
what the decode pool holds. The requests that wait for free KV pages wait under their room's admission deadline, not
the bootstrap deadline (1 s here: the prefill node's address is found in milliseconds; each pull is held back 1 s, so
the queue outlasts it on any machine), so every one is answered and every room of both nodes ends in Success; the
queue shows in the decode node's `/health` and `/metrics` while it lasts, and is empty after. (When the bootstrap
deadline counted the wait for pages, before the admission deadline, the queued requests failed: 504 "bootstrap
timeout"; the router's retries, off here, hid it by queueing them again at the back under new rooms.)
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from processes import PAGE_SIZE, Cluster, free_port

from fsm_pd.store import read_journal, replay

PROMPT = "queued behind memory pressure, request {i:02d}: " + "x" * 60  # 108 bytes: 7 pages of 16
NEW_TOKENS = 64  # 4 pages more each while it decodes
PAGES_PER_REQUEST = -(-(108 + NEW_TOKENS) // PAGE_SIZE)  # 11
DECODE_PAGES = 3 * PAGES_PER_REQUEST + 1  # three requests at a time (page 0 is padding)
BURST = 4 * 3
BOOTSTRAP_S = 1.0  # the decode node's bootstrap deadline: its lookup of the prefill node's address
PULL_DELAY_S = 1.0  # each transfer holds its pages this long more: the queue outlasts BOOTSTRAP_S on any machine


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.stop()


def generate(url: str, i: int) -> httpx.Response:
    body = {"text": PROMPT.format(i=i), "rid": f"burst-{i}",
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
    return httpx.post(url + "/generate", json=body, timeout=300)


@pytest.mark.timeout(300)
def test_a_burst_of_four_pools_is_answered_whole_with_the_queue_in_health_and_metrics(cluster):
    boot = free_port()
    p, d = cluster.serve_many(
        ("prefill", "--model", "tiny", "--bootstrap-port", str(boot), "--transfer-backend", "tcp"),
        ("decode", "--model", "tiny", "--transfer-backend", "tcp", "--num-pages", str(DECODE_PAGES),
         "--bootstrap-timeout", str(BOOTSTRAP_S)),
        env={**cluster.env, "FSM_PD_FAULT_PULL_DELAY_S": str(PULL_DELAY_S)})
    router = cluster.router(p, boot, d, "--retry-policy", "fail")  # a failed room is the client's error, not a retry
    assert generate(router, 99).status_code == 200  # warm: the prefill node's address is known, programs loaded
    said = httpx.get(d + "/health", timeout=10).json()
    assert said == {"status": "ok", "prealloc_queue": 0, "prealloc_oldest_wait_s": 0.0,
                    "max_request_bytes": said["max_request_bytes"]}

    seen: list[dict] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(httpx.get(d + "/health", timeout=10).json())
            done.wait(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(BURST) as pool:
            answers = list(pool.map(lambda i: generate(router, i), range(BURST)))
    finally:
        done.set()
        watcher.join()

    failed = [(i, a.status_code, a.text[:300]) for i, a in enumerate(answers) if a.status_code != 200]
    assert not failed, failed
    assert all(len(a.json()["output_ids"]) == NEW_TOKENS for a in answers)
    rooms = replay([row for journal in sorted(cluster.tmp.glob("*.db")) for row in read_journal(journal)]).rooms
    assert len(rooms) == 2 * (BURST + 1) and {(r.final, r.reason) for r in rooms} == {("Success", None)}
    longest = max(s["prealloc_queue"] for s in seen)
    waited = max(s["prealloc_oldest_wait_s"] for s in seen)
    assert longest >= BURST // 2, seen  # most of the burst waited for pages
    assert waited > BOOTSTRAP_S, f"the queue never outlasted the bootstrap deadline, so it proves nothing: {waited} s"
    assert httpx.get(d + "/health", timeout=10).json()["prealloc_queue"] == 0
    metrics = httpx.get(d + "/metrics", timeout=30).text
    assert re.search(r'^fsm_pd_prealloc_queue\{[^}]*role="decode"[^}]*\} 0\.0$', metrics, re.M), metrics
    assert re.search(r"^fsm_pd_prealloc_oldest_wait_seconds\{[^}]*\} 0\.0$", metrics, re.M)
