"""`fsm-pd serve --role bootstrap` runs the standalone bootstrap server as a real process until SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx


def test_standalone_bootstrap_server_serves_and_stops_on_sigterm():
    proc = subprocess.Popen([sys.executable, "-m", "fsm_pd.cli", "serve", "--role", "bootstrap", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        layout = httpx.get(url + "/route", params=dict.fromkeys(
            ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank"), -1), timeout=5)
        assert layout.status_code == 503  # nobody registered yet
    finally:
        proc.send_signal(signal.SIGTERM)  # the process this test started
        assert proc.wait(timeout=15) == 0
