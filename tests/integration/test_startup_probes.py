"""A starting node on real processes: it answers its probes while it prepares its programs, takes no request until
it is ready, and a router sends it nothing until then (at the start, and after a restart behind the router)."""

from __future__ import annotations

import contextlib
import re
import sys
import time

import httpx
import pytest
from processes import Cluster, free_port
from real_parts import SGLANG_ROUTER
from xla_flags import for_cold_starts

BODY = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


def warm_up_env(cluster: Cluster, tmp_path) -> None:
    # warm-up on, and an empty compile cache: the node compiles its ready set, which leaves a window to watch; XLA's
    # cheapest compiles (on the CPU), as the nodes here compile far more than they run
    cluster.env |= {"FSM_PD_SKIP_SERVER_WARMUP": "0", "FSM_PD_COMPILE_CACHE": str(tmp_path / "jax"),
                    "XLA_FLAGS": for_cold_starts(cluster.env.get("XLA_FLAGS", ""))}


def metric(url: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(url + "/metrics", timeout=30).text, flags=re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_a_starting_node_answers_its_probes_and_refuses_requests_until_ready(tmp_path):
    cluster = Cluster(tmp_path)
    warm_up_env(cluster, tmp_path)
    try:
        url, proc = cluster.launch_node("colocated")
        seen: list[tuple[int, int, int, int, dict]] = []  # (health, livez, startupz, generate, health body)
        deadline = time.monotonic() + 240
        with httpx.Client(timeout=30) as client:
            while time.monotonic() < deadline:
                assert proc.poll() is None, "the node exited while starting"
                try:
                    health = client.get(url + "/health")
                except httpx.TransportError:
                    time.sleep(0.02)
                    continue
                row = (health.status_code, client.get(url + "/livez").status_code,
                       client.get(url + "/startupz").status_code,
                       client.post(url + "/generate", json=BODY).status_code,
                       health.json() if health.status_code == 503 else {})
                seen.append(row)
                if row[0] == 200 and row[3] == 200:
                    break
                time.sleep(0.02)
        starting = [row for row in seen if row[0] == 503]
        assert metric(url, "fsm_pd_refused_while_starting_total") == sum(row[3] == 503 for row in starting) > 0
        assert starting, "never saw the node starting: it answered HTTP only once it was ready"
        for _, livez, _, _, body in starting:  # (the probes after /health may already see it ready)
            assert body["status"] == "starting" and livez == 200
        assert any(row[:4] == (503, 200, 503, 503) for row in starting)
        assert any("progress" in body and body["progress"]["total"] > 0 for *_, body in starting)
        assert seen[-1][:4] == (200, 200, 200, 200)
        info = httpx.get(url + "/server_info", timeout=30).json()["startup"]
        assert {"imports", "weights", "engine", "programs"} <= set(info["phases"])
        assert info["ready_after_s"] > info["phases"]["programs"]
    finally:
        cluster.stop()


def status_of(client: httpx.Client, router: str) -> int | str:
    """A request's status, or "timeout": sglang-router may have sent one to the killed node before its health check
    noticed, and then waits for the prefill leg until the prefill's own deadline (its PD legs are not cancelled)."""
    try:
        return client.post(router + "/generate", json=BODY, timeout=15).status_code
    except httpx.TimeoutException:
        return "timeout"


def builtin_router(p_url: str, boot: int, d_urls: list[str], port: int) -> list[str]:
    return [sys.executable, "-m", "fsm_pd.cli", "serve", "--role", "router", "--port", str(port), "--prefill", p_url,
            str(boot), *(arg for url in d_urls for arg in ("--decode", url)), "--pd-policy", "always"]


def sglang_router(p_url: str, boot: int, d_urls: list[str], port: int) -> list[str]:
    """The real sglang-router, with the settings ``docs/operations.md`` gives for restarts: a check every second,
    one failure takes a worker out (the killed node's refused connection, before its successor listens) and one 200
    takes it back (its successor is ready), a check's timeout of 30 s and no circuit breaker.

    With one failure enough, a check must not fail a live node. A full run once saw 1 answer of 10: fast failures (a
    request sent to the killed node hangs the client's 15 s, since sglang-router then waits for the prefill leg, so
    only a couple fit in the restart), and the only fast failure sglang-router gives here is its own 503 when it has
    no worker to pick: a live node taken out by one check that passed its 5 s default timeout while both cores were
    busy (the restarted node compiling, the suite's other worker), or its circuit breaker, which counts a decode's
    failures against the prefill paired with it too (docs/fleet.md) and so can shut the lone prefill for 60 s. A
    longer check timeout keeps live nodes in (a killed node's refused connection fails at once whatever it is), and
    without the breaker the health checks decide alone.
    """
    return [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--host", "127.0.0.1",
            "--port", str(port), "--prefill", p_url, str(boot), *(arg for url in d_urls for arg in ("--decode", url)),
            "--policy", "round_robin", "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
            "--health-success-threshold", "1", "--health-check-timeout-secs", "30", "--disable-circuit-breaker",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]


@pytest.mark.slow
@pytest.mark.parametrize("router_argv", [builtin_router, pytest.param(sglang_router, marks=SGLANG_ROUTER)],
                         ids=["builtin", "sglang-router"])
def test_the_router_sends_nothing_to_a_node_until_it_is_ready(tmp_path, router_argv):
    """The router starts beside two starting nodes, then a decode node restarts behind it under requests: no
    generation request reaches a node that is not ready (each node counts what it refused with 503 starting)."""
    cluster = Cluster(tmp_path)
    warm_up_env(cluster, tmp_path)
    boot = free_port()
    try:
        (p_url, _), (d_url, d_proc), (d2_url, _) = (
            cluster.launch_node("prefill", "--bootstrap-port", str(boot)), cluster.launch_node("decode"),
            cluster.launch_node("decode"))
        port = free_port()
        router = f"http://127.0.0.1:{port}"
        cluster.launch("router", router_argv(p_url, boot, [d_url, d2_url], port))
        ok = 0
        deadline = time.monotonic() + 240
        with httpx.Client(timeout=60) as client:
            while time.monotonic() < deadline and ok < 5:  # a router still starting refuses, or is not listening yet
                with contextlib.suppress(httpx.TransportError):
                    ok += client.post(router + "/generate", json=BODY).status_code == 200
                time.sleep(0.05)
            assert ok == 5
            # restart one decode node behind the router, with requests flowing
            d_proc.kill()
            d_proc.wait(timeout=30)
            argv = list(d_proc.args)
            restarted = cluster.launch("decode-restarted", argv)
            statuses = []
            while restarted.poll() is None and time.monotonic() < deadline:
                statuses.append(status_of(client, router))
                with contextlib.suppress(httpx.TransportError):
                    if client.get(d_url + "/health").status_code == 200:
                        break
            served = 'fsm_pd_http_requests_total{route="/generate",status="200"}'
            back = time.monotonic() + 30  # once it is ready, the router takes it back within its next checks
            while metric(d_url, served) == 0 and time.monotonic() < back:
                statuses.append(status_of(client, router))
        assert metric(d_url, served) > 0, "the restarted node was never used again"
        assert statuses.count(200) >= len(statuses) - 2, statuses  # the kill itself may fail a request or two
        for url in (p_url, d2_url):
            assert metric(url, "fsm_pd_refused_while_starting_total") == 0, f"{url} got requests while starting"
        # A restart quicker than the health checks notice the kill: the router still holds the address ready, and
        # the one request that reaches the new process is what tells it (503 starting: the router marks it starting
        # and retries elsewhere). After that, nothing until it is ready: at most that one (seen once under -n 2).
        assert metric(d_url, "fsm_pd_refused_while_starting_total") <= 1, f"{d_url} got requests while starting"
    finally:
        cluster.stop()
