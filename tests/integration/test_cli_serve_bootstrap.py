"""`fsm-pd serve --role bootstrap` runs the standalone bootstrap server as a real process until SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
from processes import dies_with_parent

from fsm_pd.bootstrap import RankRegistration, register_prefill_rank, resolve_prefill


def test_standalone_bootstrap_server_serves_and_stops_on_sigterm():
    proc = subprocess.Popen([sys.executable, "-m", "fsm_pd.cli", "serve", "--role", "bootstrap", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=dies_with_parent())
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


def test_standalone_bootstrap_server_on_a_unix_socket(tmp_path_factory):
    """--uds: the server takes a registration and answers lookups over its socket (the client's unix:PATH URL), and
    removes the socket when it stops."""
    path = tmp_path_factory.mktemp("b") / "bootstrap.sock"
    proc = subprocess.Popen([sys.executable, "-m", "fsm_pd.cli", "serve", "--role", "bootstrap", "--uds", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=dies_with_parent())
    try:
        url = proc.stdout.readline().strip()
        assert url == f"unix:{path}"
        reg = RankRegistration(rank_ip="unix:/s/p.side.sock", rank_port=0, page_size=16, kv_cache_dtype="float32",
                               side_channel="ipc:///s/p.side.sock", node_id="prefill-0")
        register_prefill_rank(url, reg.to_json(), attempts=1)
        assert resolve_prefill(url, retries=0)["side_channel"] == "ipc:///s/p.side.sock"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    assert not path.exists()
