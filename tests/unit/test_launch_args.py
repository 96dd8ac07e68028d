"""``fsm-pd launch --node-arg/--router-arg``: flags passed through to the processes launch starts, checked by each
process's own parser before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fsm_pd.launch import check_commands, plan


def children(extra=(), router_extra=()):
    return plan(1, 2, 30000, "tiny", "tcp", Path("/tmp/unused"), ["--kv-checksum", "on", *extra],
                router_extra=list(router_extra))


def test_passed_flags_reach_every_node_and_the_router_alone():
    procs = children(["--token-idle-timeout-secs=60"], ["--pd-policy=auto"])
    nodes, router = procs[:-1], procs[-1]
    assert [c.name for c in nodes] == ["prefill-0", "decode-0", "decode-1"]
    assert all("--token-idle-timeout-secs=60" in c.argv and "--pd-policy=auto" not in c.argv for c in nodes)
    assert "--pd-policy=auto" in router.argv and "--token-idle-timeout-secs=60" not in router.argv
    assert check_commands(procs) is None


def test_a_flag_a_node_or_the_router_refuses_is_named_before_anything_starts():
    error = check_commands(children(["--token-idle-timeout-secs=soon"]))
    assert error.startswith("prefill-0: ") and "--token-idle-timeout-secs: invalid float value: 'soon'" in error
    error = check_commands(children(router_extra=["--pd-policy=sometimes"]))
    assert error.startswith("router: ") and "invalid choice: 'sometimes'" in error
    assert "unrecognized arguments: --no-such-flag" in check_commands(children(["--no-such-flag"]))


def test_launch_exits_2_with_the_error_and_starts_nothing(tmp_path):
    journals = tmp_path / "cluster"
    result = subprocess.run([sys.executable, "-m", "fsm_pd.cli", "launch", "--journal-dir", str(journals),
                             "--node-arg=--token-idle-timeout-secs=soon"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "prefill-0" in result.stdout and "invalid float value: 'soon'" in result.stdout
    assert not journals.exists()  # nothing started: no journal directory, no logs


def test_the_cluster_needs_a_prefill_node_only_when_the_router_sends_every_request_through_one():
    """Under ``auto`` (the default) and ``never`` a decode node prefills prompts itself, so launch keeps serving
    when its last prefill node dies (it stopped the cluster, and the request in flight with it)."""
    from fsm_pd.launch import needed_roles

    assert needed_roles([]) == needed_roles(["--pd-policy", "auto"]) == needed_roles(["--pd-policy=never"]) == \
        ("decode",)
    assert needed_roles(["--pd-policy", "always"]) == needed_roles(["--max-retries", "1", "--pd-policy=always"]) == \
        ("prefill", "decode")
