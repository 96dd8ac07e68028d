"""``FSM_PD_STACK_SAMPLES=PATH`` on a real node: its threads' stacks, the model thread's among them, are in PATH once it
has served and stopped (``runtime/stack_samples.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from processes import dies_with_parent

from fsm_pd.net import unix_http
from fsm_pd.net.unix_sockets import unix_address


@pytest.mark.slow
def test_a_node_started_with_it_writes_its_model_threads_stacks_at_exit(tmp_path):
    sock = tmp_path / "c.sock"
    env = {**os.environ, "FSM_PD_MODEL": "tiny", "FSM_PD_STACK_SAMPLES": str(tmp_path / "stacks-{pid}.txt")}
    log = open(tmp_path / "node.log", "w")  # noqa: SIM115 - the child writes to it
    proc = subprocess.Popen([sys.executable, "-m", "fsm_pd.cli", "serve", "--role", "colocated", "--uds", str(sock)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, preexec_fn=dies_with_parent())
    url = unix_http.http_url(unix_address(str(sock)))
    try:
        with unix_http.client(timeout=60) as client:
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "node.log").read_text()
                try:
                    if client.get(url + "/health", timeout=2).status_code == 200:
                        break
                except Exception:  # noqa: BLE001 - not listening yet
                    pass
                time.sleep(0.2)
            body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
            assert client.post(url + "/generate", json=body).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    stacks = (tmp_path / f"stacks-{proc.pid}.txt").read_text()  # {pid}: the node's own file
    assert "thread (model[" in stacks and "thread (MainThread)" in stacks
