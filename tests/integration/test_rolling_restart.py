"""A rolling restart under load loses no request: 2 prefill + 2 decode nodes (tiny model, tcp, 127.0.0.1) behind the
built-in router, 32 workers sending mixed streamed and whole requests (``load_mix.LoadMix``) while each of the four
nodes in turn is SIGTERMed (it drains: refuses new requests with 503, finishes its open ones, exits 0), restarted
with the same command line (port, bootstrap port, journal) and waited for (its /health, then the router's traffic
reaching it again) before the next. Needs the router's health checks and retries (``fleet.py``): a draining node
answers /health 503 and new requests 503, which the router retries on the other node of that role."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from load_mix import LoadMix
from processes import Cluster, free_port

WORKERS = 32
TOKENS = 16
ROUTER_FLAGS = ["--health-check-interval-secs", "0.5", "--health-check-timeout-secs", "2",
                "--cb-timeout-duration-secs", "1", "--max-retries", "3"]


def served(url: str) -> int:
    """Generation requests this node answered so far (its own /metrics)."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("fsm_pd_http_requests_total{") and 'status="200"' in line and (
                'route="/generate"' in line or 'route="/v1/chat/completions"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


@pytest.mark.slow
def test_rolling_restart_of_every_node_under_load(tmp_path):
    c = Cluster(tmp_path)
    try:
        boots = [free_port(), free_port()]
        urls = c.serve_many(*[("prefill", "--bootstrap-port", str(b), "--transfer-backend", "tcp") for b in boots],
                            ("decode", "--transfer-backend", "tcp"), ("decode", "--transfer-backend", "tcp"))
        prefills, decodes = urls[:2], urls[2:]
        port = free_port()
        argv = [sys.executable, "-m", "fsm_pd.cli", "serve", "--role", "router", "--port", str(port),
                "--pd-policy", "always"]
        for url, boot in zip(prefills, boots, strict=True):
            argv += ["--prefill", url, str(boot)]
        for url in decodes:
            argv += ["--decode", url]
        router = c.start("router", [*argv, *ROUTER_FLAGS], f"http://127.0.0.1:{port}")
        procs = {url: proc for url, proc in zip([*prefills, *decodes], c.procs, strict=False)}
        drains = {}
        with LoadMix(router, workers=WORKERS, tokens=TOKENS, timeout=60) as load:
            load.wait_ok(WORKERS, 180)  # warm: every worker has had an answer
            for url in [*prefills, *decodes]:
                proc: subprocess.Popen = procs[url]
                signalled = time.monotonic()
                os.kill(proc.pid, signal.SIGTERM)
                assert proc.wait(timeout=60) == 0, f"{url} did not drain and exit 0"
                drains[url] = round(time.monotonic() - signalled, 2)
                c.start(f"restarted-{url.rsplit(':', 1)[1]}", list(proc.args), url)  # waits for /health 200
                procs[url] = c.procs[-1]
                # the router has taken it back: it answers requests again before the next node goes
                deadline = time.monotonic() + 60
                while served(url) == 0:
                    assert time.monotonic() < deadline, f"the router sent nothing to the restarted {url}"
                    time.sleep(0.2)
                load.wait_ok(WORKERS, 120)
        outcomes = load.snapshot()
        summary = load.summary()
        failed = [o for o in outcomes if o.result != "ok"]
        print(f"rolling restart: {summary}; drain seconds per node {drains}")
        assert not failed, f"{len(failed)} of {len(outcomes)} failed: {[(o.status, o.detail) for o in failed[:5]]}"
        assert summary["total"] >= 4 * WORKERS
    finally:
        c.stop()
