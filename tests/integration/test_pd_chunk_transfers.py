"""Real processes on 127.0.0.1: a prefill node that prefills long prompts in chunks hands each chunk's KV over while
the next one computes (``fsm_pd/effects/chunked.py``). The answers equal a colocated node's whole prefill, token for
token under greedy sampling, and ``fsm-pd replay`` shows every chunk on the prefill node and every piece on the decode
node."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from processes import PAGE_SIZE, Cluster, free_port
from test_pd_serving import cluster, greedy  # noqa: F401 (cluster is a fixture)

from fsm_pd.store import read_journal, replay

CHUNK = 4 * PAGE_SIZE  # tokens a prefill step computes: pieces of 4 pages
# byte-level tokenizer: one chunk (the whole handoff), then 2, 5 and 5 chunks: 5, 18 and 20 pages, in pieces of 4
PROMPTS = ["short prompt", "m" * (CHUNK + 7), "The chunks travel while the next one computes. " * 6,
           "0123456789" * (5 * CHUNK // 10)]
PIECES = [2, 5, 5]


@pytest.fixture(scope="module")
def whole_prefill(tmp_path_factory) -> list[list[int]]:
    """The greedy answers of a colocated node that prefills each prompt whole: what every backend's chunked PD must
    give (one node for the module: they depend on no backend)."""
    c = Cluster(tmp_path_factory.mktemp("whole_prefill"))
    try:
        colocated = c.serve("colocated", "--chunked-prefill-size", "4096")
        yield [greedy(colocated, prompt) for prompt in PROMPTS]
    finally:
        c.stop()


@pytest.mark.parametrize("backend", ["tcp", "zmq", "jax"])
def test_chunked_prefill_node_answers_as_a_whole_prefill_and_replay_shows_each_chunk(cluster, whole_prefill, backend):  # noqa: F811 (the fixture)
    boot = free_port()
    p, d = cluster.serve_many(
        ("prefill", "--bootstrap-port", str(boot), "--transfer-backend", backend, "--chunked-prefill-size", str(CHUNK)),
        ("decode", "--transfer-backend", backend))
    router = cluster.router(p, boot, d)
    want = whole_prefill
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda prompt: greedy(router, prompt), PROMPTS))
    assert got == want
    journals = sorted(cluster.tmp.glob("*.db"))
    rows = [row for j in journals for row in read_journal(j)]
    result = replay(rows)
    assert result.consistent and {r.final for r in result.rooms} == {"Success"}
    # the prompts of several chunks went piece by piece, the short one whole
    published = [r for r in rows if r.trigger == "published" and r.event.get("chunks")]
    assert sorted(r.event["chunks"] for r in published) == PIECES
    chunks = [r for r in rows if r.trigger == "kv_chunk"]
    assert all(r.src == r.dst == "Transferring" for r in chunks) and sum(r.event.get("last", False)
                                                                         for r in chunks) == 3
    pulled = [r for r in rows if r.trigger == "pulled" and "chunks" in r.event]
    assert sorted(len(r.event["chunks"]) for r in pulled) == PIECES
    text = subprocess.run([sys.executable, "-m", "fsm_pd.cli", "replay", "--format", "json", *map(str, journals)],
                          capture_output=True, text=True, timeout=120, check=True).stdout
    assert text.count("last chunk computed: all") == 3 and text.count("first chunk queued on the device:") == 3, text
    assert text.count("2 pieces (") == 1 and text.count("5 pieces (") == 2, text
