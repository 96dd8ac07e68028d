"""``FSM_PD_STACK_SAMPLES=PATH`` on a real node: its threads' stacks, the model thread's among them, are in PATH once it
has served and stopped (``runtime/stack_samples.py``)."""

from __future__ import annotations

import pytest
from test_pd_one_process import start, stop, wait_healthy

from fsm_pd.net import unix_http


@pytest.mark.slow
def test_a_node_started_with_it_writes_its_model_threads_stacks_at_exit(tmp_path):
    url, proc = start(tmp_path, "node", "--role", "colocated",
                      env={"FSM_PD_STACK_SAMPLES": str(tmp_path / "stacks-{pid}.txt")})
    try:
        with unix_http.client(timeout=60) as client:
            wait_healthy(client, url, proc, tmp_path / "node.log")
            body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
            assert client.post(url + "/generate", json=body).status_code == 200
    finally:
        assert stop(proc) == 0  # SIGTERM: the node drains and ends through its exit cleanups
    stacks = (tmp_path / f"stacks-{proc.pid}.txt").read_text()  # {pid}: the node's own file
    assert "thread (model[" in stacks and "thread (MainThread)" in stacks
