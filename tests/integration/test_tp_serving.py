"""Tensor parallelism served for real: ``fsm-pd serve --tp N`` processes (the tiny model: 4 query heads, 2 KV heads),
on virtual CPU devices, behind the built-in router and the real sglang-router, on 127.0.0.1.

For each pair of sizes the issue names (prefill 2 / decode 4: decode copies each KV head twice; prefill 4 / decode 1;
prefill 1 / decode 2), greedy answers equal one colocated server's on one device, through both routers; each node
reports its real ``tp_size``, the prefill node registers one bootstrap entry per TP rank (SGLang's ``attn_tp_size``
and ``attn_tp_rank``), and the journals replay with every room a success. That D's pool gets exactly the bytes of a
same-TP handoff is checked below the HTTP layer, byte for byte (``tp_transfer_check.py``).
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from processes import Cluster, free_port
from real_parts import SGLANG_ROUTER
from test_pd_serving import PROMPTS, greedy

from fsm_pd.store import read_journal, replay

PAIRS = [(2, 4), (4, 1), (1, 2)]


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.stop()


def answers(url: str) -> list[list[int]]:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda p: greedy(url, p), PROMPTS[:12]))


def sglang_router(cluster: Cluster, prefill: str, boot: int, decode: str) -> str:
    port = free_port()
    return cluster.start(f"sglang-router-{port}", [
        sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill", prefill, str(boot),
        "--decode", decode, "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(free_port()), "--policy", "random"], f"http://127.0.0.1:{port}")


@pytest.fixture(scope="module")
def tp_fleet(tmp_path_factory):
    """One colocated server's answers, and a prefill and a decode node for each pair of sizes: started once, for
    both routers' tests (eight TP processes start in about a minute on 2 cores)."""
    c = Cluster(tmp_path_factory.mktemp("tp"))
    try:
        want = answers(c.serve("colocated"))
        assert len({tuple(ids) for ids in want}) >= 6, "varied prompts must give varied answers, or equality is weak"
        pairs = []
        for tp_p, tp_d in PAIRS:
            boot = free_port()
            prefill, decode = c.serve_many(("prefill", "--bootstrap-port", str(boot), "--tp", str(tp_p)),
                                           ("decode", "--tp", str(tp_d)))
            pairs.append((tp_p, tp_d, prefill, boot, decode))
        yield c, want, pairs
    finally:
        c.stop()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("router", ["built-in", pytest.param("sglang-router", marks=SGLANG_ROUTER)])
def test_pd_between_tp_sizes_equals_colocated_through_the_router(tp_fleet, router):
    """Through each router in its own test: the built-in router's never skips; sglang-router's is a real part."""
    cluster, want, pairs = tp_fleet
    for tp_p, tp_d, prefill, boot, decode in pairs:
        assert httpx.get(prefill + "/server_info").json()["tp_size"] == tp_p
        assert httpx.get(decode + "/server_info").json()["tp_size"] == tp_d
        layout = httpx.get(f"http://127.0.0.1:{boot}/route", params={
            "prefill_dp_rank": -1, "prefill_cp_rank": -1, "target_tp_rank": -1, "target_pp_rank": -1}).json()
        assert layout["attn_tp_size"] == tp_p
        for rank in range(tp_p):  # what SGLang's decode asks for each prefill rank it reads from
            entry = httpx.get(f"http://127.0.0.1:{boot}/route", params={
                "prefill_dp_rank": 0, "prefill_cp_rank": 0, "target_tp_rank": rank, "target_pp_rank": 0})
            assert entry.status_code == 200 and entry.json()["rank_port"] > 0
        url = cluster.router(prefill, boot, decode) if router == "built-in" else \
            sglang_router(cluster, prefill, boot, decode)
        assert answers(url) == want, (tp_p, tp_d)
    journals = sorted(cluster.tmp.glob("*.db"))
    result = replay([row for j in journals for row in read_journal(j)])
    assert result.consistent and len(result.rooms) >= 2 * len(PAIRS) * 12  # this router's rooms at least
    assert {r.final for r in result.rooms} == {"Success"}


def test_serve_refuses_tp_below_one(cluster, tmp_path):
    import subprocess

    done = subprocess.run([sys.executable, "-m", "fsm_pd.cli", "serve", "--role", "colocated", "--tp", "0"],
                          capture_output=True, text=True, timeout=60, env=cluster.env)
    assert done.returncode == 2 and "must be at least 1" in done.stderr
