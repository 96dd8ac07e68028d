"""The built-in router's log, as its process writes it (``fsm-pd serve --role router`` in front of stub workers on
127.0.0.1): every line carries its time, so that its events line up with the nodes' journals, and its health checks
(five a second here) write nothing at ``info`` (issue 51: the log was mostly httpx's line per health check, without a
time)."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import httpx
from polling import until
from processes import dies_with_parent
from stub_engine import StubEngine

from fsm_pd.api import AppServer, create_app
from fsm_pd.cli.launch import free_port

STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+: ")


def test_the_router_s_log_lines_carry_their_time_and_health_checks_write_none(tmp_path):
    prefill, decode = StubEngine(role="prefill"), StubEngine(role="decode")
    log_path = tmp_path / "router.log"
    with AppServer(create_app(prefill, prefill.tokenizer, bootstrap_port=9000)) as p, \
            AppServer(create_app(decode, decode.tokenizer)) as d, open(log_path, "w") as log:
        port = free_port()
        router = subprocess.Popen(
            [sys.executable, "-m", "fsm_pd.cli", "serve", "--role", "router", "--port", str(port), "--prefill", p.url,
             "9000", "--decode", d.url, "--health-check-interval-secs", "0.2"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=dies_with_parent())
        try:
            url = f"http://127.0.0.1:{port}"
            assert until(lambda: _ready(url), timeout_s=120)
            time.sleep(2.0)  # ten rounds of health checks of both workers
            r = httpx.post(url + "/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 2}},
                           timeout=30)
            assert r.status_code == 200, r.text
        finally:
            router.terminate()
            router.wait(timeout=30)
    prefill.close()
    decode.close()
    lines = [line for line in log_path.read_text().splitlines() if line.strip()]
    assert any("Uvicorn running on" in line for line in lines), lines
    assert [line for line in lines if not STAMP.match(line)] == []
    assert [line for line in lines if "HTTP Request:" in line] == []
    # a clean run has no line that reads as an error (uvicorn names its logger uvicorn.error: launch's exit_cause
    # would take its shutdown line for why a child exited)
    assert [line for line in lines if "error" in line.lower()] == []


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readiness", timeout=2).json()["ready"]["decode"] == 1
    except (httpx.HTTPError, ValueError, KeyError):
        return False
