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


def test_launch_uds_names_a_socket_path_too_long_before_anything_starts(tmp_path):
    journals, sockets = tmp_path / "cluster", tmp_path / ("d" * 90)
    result = subprocess.run([sys.executable, "-m", "fsm_pd.cli", "launch", "--journal-dir", str(journals),
                             "--uds", str(sockets)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    said = result.stdout.strip()
    assert "\n" not in said and said.startswith("fsm-pd launch: prefill-0: --uds: ") and "sun_path" in said
    assert not journals.exists() and not sockets.exists()


def test_launch_uds_puts_every_socket_under_the_directory_and_names_them_to_the_router():
    procs = plan(1, 1, 30000, "tiny", "tcp", Path("/tmp/unused"), [], uds=Path("/run/fsm"))
    prefill, decode, router = procs
    assert router.url == "unix:/run/fsm/router.sock" and "--port" not in router.argv
    assert prefill.argv[prefill.argv.index("--bootstrap-uds") + 1] == "/run/fsm/prefill-0.bootstrap.sock"
    at = router.argv.index("--prefill")
    assert router.argv[at:at + 3] == ["--prefill", "unix:/run/fsm/prefill-0.sock",
                                      "unix:/run/fsm/prefill-0.bootstrap.sock"]
    assert router.argv[router.argv.index("--decode") + 1] == decode.url == "unix:/run/fsm/decode-0.sock"
    assert all(path.startswith("/run/fsm/") for child in procs for path in child.sockets.values())
    assert check_commands(procs) is None
