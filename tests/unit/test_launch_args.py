"""``fsm-pd launch --node-arg/--prefill-arg/--decode-arg/--router-arg``: flags passed through to the processes launch
starts, checked by each process's own parser and checks before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from real_parts import TCP

from fsm_pd.cli.flags import accelerator_host, resolve_dtype, resolve_page_size
from fsm_pd.cli.launch import check_commands, chip_holder, exit_cause, plan
from fsm_pd.kernels.layout import PAGE_SIZES


def children(extra=(), router_extra=(), prefill_extra=(), decode_extra=()):
    return plan(1, 2, 30000, "tiny", "tcp", Path("/tmp/unused"), ["--kv-checksum", "on", *extra],
                router_extra=list(router_extra), prefill_extra=prefill_extra, decode_extra=decode_extra)


@TCP  # the nodes' checks find their ports free on 127.0.0.1
def test_passed_flags_reach_every_node_and_the_router_alone():
    procs = children(["--token-idle-timeout-secs=60"], ["--pd-policy=auto"])
    nodes, router = procs[:-1], procs[-1]
    assert [c.name for c in nodes] == ["prefill-0", "decode-0", "decode-1"]
    assert all("--token-idle-timeout-secs=60" in c.argv and "--pd-policy=auto" not in c.argv for c in nodes)
    assert "--pd-policy=auto" in router.argv and "--token-idle-timeout-secs=60" not in router.argv
    assert check_commands(procs) is None


@TCP  # the nodes' checks find their ports free on 127.0.0.1
def test_a_flag_of_one_role_goes_to_that_role_alone():
    procs = children(prefill_extra=["--disable-chunk-transfers"], decode_extra=["--on-transfer-failure=fail"])
    by_name = {c.name: c.argv for c in procs}
    prefill = by_name["prefill-0"]
    assert "--disable-chunk-transfers" in prefill and "--on-transfer-failure=fail" not in prefill
    for decode in ("decode-0", "decode-1"):
        assert "--on-transfer-failure=fail" in by_name[decode] and "--disable-chunk-transfers" not in by_name[decode]
    assert check_commands(procs) is None
    # the same flag sent to every node is refused by the role that does not take it
    refused = check_commands(children(["--disable-chunk-transfers"]))
    assert refused == "decode-0: fsm-pd serve: error: unrecognized arguments: --disable-chunk-transfers"


@TCP  # the nodes' checks find their ports free on 127.0.0.1
def test_a_flag_a_node_or_the_router_refuses_is_named_before_anything_starts():
    error = check_commands(children(["--token-idle-timeout-secs=soon"]))
    assert error == ("prefill-0: fsm-pd serve: error: argument --token-idle-timeout-secs: must be a number of "
                     "seconds, got 'soon'")
    error = check_commands(children(router_extra=["--pd-policy=sometimes"]))
    assert error.startswith("router: ") and "invalid choice: 'sometimes'" in error
    assert "unrecognized arguments: --no-such-flag" in check_commands(children(["--no-such-flag"]))


@TCP  # the nodes' checks find their ports free on 127.0.0.1
def test_launch_exits_2_with_the_error_and_starts_nothing(tmp_path):
    journals = tmp_path / "cluster"
    result = subprocess.run([sys.executable, "-m", "fsm_pd.cli", "launch", "--journal-dir", str(journals),
                             "--node-arg=--token-idle-timeout-secs=soon"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == ("fsm-pd launch: error: prefill-0: fsm-pd serve: error: argument "
                             "--token-idle-timeout-secs: must be a number of seconds, got 'soon'\n")
    assert not journals.exists()  # nothing started: no journal directory, no logs


@pytest.mark.parametrize("layout, first", [("nodes", "prefill-0"), ("pd", "pd")])
def test_launch_uds_names_a_socket_path_too_long_before_anything_starts(tmp_path, layout, first):
    """Each layout names its first process's socket (the layout given: on a TPU host ``auto`` is ``pd``)."""
    journals, sockets = tmp_path / "cluster", tmp_path / ("d" * 90)
    result = subprocess.run([sys.executable, "-m", "fsm_pd.cli", "launch", "--journal-dir", str(journals),
                             "--uds", str(sockets), "--layout", layout], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    said = result.stderr.strip()
    assert "\n" not in said and said.startswith(f"fsm-pd launch: error: {first}: --uds: ") and "sun_path" in said
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


def test_a_child_s_exit_is_reported_by_its_error_line_not_its_last(tmp_path):
    log = tmp_path / "router.log"
    log.write_text("INFO:     Started server process [7]\nINFO:     Waiting for application startup.\n"
                   "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 30000): address "
                   "already in use\nINFO:     Waiting for application shutdown.\n"
                   "INFO:     Application shutdown complete.\n")
    assert exit_cause(log) == ("ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 30000): "
                               "address already in use")
    log.write_text("2026-01-01 10:00:00,001 INFO uvicorn: Started server process [7]\n"  # as log_to_stderr writes
                   "2026-01-01 10:00:00,002 ERROR uvicorn: [Errno 98] error while attempting to bind\n"
                   "2026-01-01 10:00:00,003 INFO uvicorn: Application shutdown complete.\n")
    assert exit_cause(log) == "2026-01-01 10:00:00,002 ERROR uvicorn: [Errno 98] error while attempting to bind"
    log.write_text("fsm-pd serve: model loaded\nKilled\n")
    assert exit_cause(log) == "Killed"  # no error line: the last one
    assert exit_cause(tmp_path / "none.log") is None


def test_on_an_accelerator_host_the_first_decode_node_holds_the_chip_and_every_node_gets_one_dtype():
    procs = plan(2, 2, 30000, "tiny", "tcp", Path("/tmp/unused"), [], uds=Path("/run/fsm"))  # no port: no TCP
    assert chip_holder(procs).name == "decode-0"
    assert resolve_dtype("auto", "tpu") == "bfloat16" and resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("float32", "tpu") == "float32"  # asked for: kept
    # and one page size (kernels.layout.PAGE_SIZES): the platform's default, unless --page-size says
    assert resolve_page_size(None, "tpu") == PAGE_SIZES.get("tpu", 16) and resolve_page_size(None, "cpu") == 16
    assert resolve_page_size(32, "tpu") == 32
    assert accelerator_host({"TPU_ACCELERATOR_TYPE": "v5litepod-4"})  # as the v5e host says it
    assert accelerator_host({}) == any(Path("/dev").glob("accel*"))


def test_the_cluster_needs_a_prefill_node_only_when_the_router_sends_every_request_through_one():
    """Under ``auto`` (the default) and ``never`` a decode node prefills prompts itself, so launch keeps serving
    when its last prefill node dies (it stopped the cluster, and the request in flight with it)."""
    from fsm_pd.cli.launch import needed_roles

    assert needed_roles([]) == needed_roles(["--pd-policy", "auto"]) == needed_roles(["--pd-policy=never"]) == \
        ("decode",)
    assert needed_roles(["--pd-policy", "always"]) == needed_roles(["--max-retries", "1", "--pd-policy=always"]) == \
        ("prefill", "decode")


def test_launch_takes_the_router_s_pd_policy_itself():
    """``fsm-pd launch --pd-policy always`` failed with no hint that the flag is the router's (issue 51): launch takes
    it and hands it to the router, and a --router-arg given too comes after it, so it wins."""
    from fsm_pd.cli.launch import needed_roles
    from fsm_pd.cli.main import PD_POLICIES, build_parser, router_extra
    from fsm_pd.router.policy import MODES

    assert PD_POLICIES == MODES
    args = build_parser().parse_args(["launch", "--pd-policy", "always"])
    assert router_extra(args) == ["--pd-policy=always"]
    assert needed_roles(router_extra(args)) == ("prefill", "decode")  # launch waits for a prefill node then
    # on unix sockets: no TCP port is picked, so this runs on a host without TCP too
    procs = plan(1, 2, 30000, "tiny", "tcp", Path("/tmp/unused"), [], router_extra=router_extra(args),
                 uds=Path("/run/fsm"))
    router = next(c for c in procs if c.name == "router")
    assert "--pd-policy=always" in router.argv
    assert all("--pd-policy=always" not in c.argv for c in procs if c is not router)
    args = build_parser().parse_args(["launch", "--pd-policy", "never", "--router-arg=--pd-policy=always"])
    assert router_extra(args) == ["--pd-policy=never", "--pd-policy=always"]
    assert router_extra(build_parser().parse_args(["launch"])) == []


def test_where_one_process_holds_the_accelerator_the_default_cluster_is_one_pd_process():
    from fsm_pd.cli.launch_layout import choose, one_process_problem, plan_one_process

    fits = one_process_problem(1, 1, 1, 1, [])
    assert fits is None
    assert choose("auto", True, fits) == "pd" and choose("auto", False, fits) == "nodes"
    assert choose("nodes", True, fits) == "nodes" and choose("pd", False, fits) == "pd"
    for problem, said in ((one_process_problem(2, 1, 1, 1, []), "--prefill 2 --decode 1"),
                          (one_process_problem(1, 1, 1, 2, []), "--tp 1"),
                          (one_process_problem(1, 1, 1, 1, ["--router-arg=--policy=cache_aware"]), "--node-arg")):
        assert said in problem
        assert choose("auto", True, problem) == "nodes"  # a cluster one process cannot be stays nodes
        with pytest.raises(ValueError, match=f"--layout pd: one process cannot run this cluster: .*{said}"):
            choose("pd", True, problem)
    child = plan_one_process(30000, "tiny", None, Path("/tmp/j"), ["--kv-checksum", "on"], ["--pd-policy=always"],
                             Path("/run/fsm"))
    assert child.argv[child.argv.index("--role") + 1] == "pd" and "--transfer-backend" not in child.argv  # pool
    assert child.argv[child.argv.index("--uds") + 1] == "/run/fsm/router.sock" and "--pd-policy=always" in child.argv
    assert child.argv[child.argv.index("--journal-dir") + 1] == "/tmp/j"
    assert check_commands([child]) is None  # every flag it passes, --role pd takes
    assert chip_holder([child]) is child  # on a TPU host, the accelerator is its


def test_a_pd_process_s_start_up_shows_as_one_node_s():
    from fsm_pd.cli.children import one_status

    node = {"status": "starting", "phase": "programs", "progress": {"done": 3, "total": 9, "step": "decode"}}
    assert one_status(node) is node
    both = {"status": "starting", "engines": {
        "prefill": {"status": "starting", "phase": "programs", "progress": {"done": 6, "total": 6, "step": "x"}},
        "decode": {"status": "starting", "phase": "programs", "progress": {"done": 2, "total": 8, "step": "decode 8"}}}}
    assert one_status(both) == {"phase": "programs", "progress": {"step": "decode 8", "done": 8, "total": 14}}
    assert one_status({"status": "starting", "engines": {"prefill": {"status": "starting", "phase": "weights"},
                                                         "decode": {"status": "starting"}}}) == {"phase": "weights"}
