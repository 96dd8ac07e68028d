"""A bad command line of ``fsm-pd serve`` or ``fsm-pd launch`` ends before anything loads, with one line that names
the cause and exit status 2 (``serve_flags``, ``serve_checks``).

Each case runs the real command in a child process in which jax cannot be imported: a command that got as far as
loading a model (or its imports) would end in an ImportError's traceback instead of the one line.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys

import pytest
from real_parts import TCP

from fsm_pd.cli.flags import role_parser, split_role

# the command, with every later ``import jax`` failing
NO_JAX = "import sys; sys.modules['jax'] = None; from fsm_pd.cli.main import main; sys.exit(main(sys.argv[1:]))"
SECRET = ["--side-channel-secret", "ab" * 32]
UNKNOWN_BACKEND = "argument --transfer-backend: unknown transfer backend 'rdma' (known: device, jax, pool, tcp, zmq)"


def run(args: list[str], *, jax: bool = False) -> subprocess.CompletedProcess:
    code = NO_JAX if not jax else NO_JAX.replace("sys.modules['jax'] = None; ", "")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def taken():
    """A port a process listens on (this test's socket)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def assert_refused(result: subprocess.CompletedProcess, prog: str, *said: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), result.stderr
    for words in said:
        assert words in lines[0], lines[0]


@pytest.mark.parametrize("args, said", [
    (["--role", "prefill", "--port", "-5"], "argument --port: must be a TCP port, 0 to 65535, got -5"),
    (["--role", "prefill", "--port", "70000"], "argument --port: must be a TCP port, 0 to 65535, got 70000"),
    (["--role", "colocated", "--num-pages", "0"], "argument --num-pages: must be at least 2, got 0"),
    (["--role", "colocated", "--page-size", "0"], "argument --page-size: must be at least 1, got 0"),
    (["--role", "decode", "--token-idle-timeout-secs", "nan"], "must be above 0 seconds, got nan"),
    pytest.param(["--role", "decode", "--journal", "/dev/null/x.db", *SECRET], "--journal /dev/null/x.db: /dev/null "
                 "is not a directory", marks=TCP),  # checked after the ports: 127.0.0.1 must take them
    pytest.param(["--role", "prefill"], "FSM_PD_SIDE_CHANNEL_SECRET is not set", marks=TCP),
    (["--role", "pd", "--uds", "/tmp/x.sock", "--prefill-pool-share", "1.5"],
     "argument --prefill-pool-share: must be above 0 and below 1, got 1.5"),
    (["--role", "pd", "--uds", "/tmp/x.sock", "--transfer-backend", "jax"], "--transfer-backend jax: the jax"),
    (["--role", "pd", "--uds", "/tmp/x.sock", "--tp", "2"], "--tp 2: --role pd runs both engines on one device"),
    pytest.param(["--role", "decode", "--transfer-backend", "device", *SECRET], "--transfer-backend device: it hands "
                 "KV between the two engines of one process", marks=TCP),
    (["--role", "prefill", "--transfer-backend", "rdma", *SECRET], UNKNOWN_BACKEND),
    (["--role", "decode", "--uds", "/tmp/x.sock", "--transfer-backend", "rdma", *SECRET], UNKNOWN_BACKEND),
    (["--role", "pd", "--transfer-backend", "rdma"], UNKNOWN_BACKEND),  # not blamed on unix sockets
    pytest.param(["--role", "pd", "--transfer-backend", "jax"], "--transfer-backend jax: the jax transfer backend "
                 "cannot run over the unix sockets that link --role pd's two engines", marks=TCP),  # after the ports
    (["--role", "colocated", "--model", "/nowhere/m.gguf"], "--model /nowhere/m.gguf: no such file or directory"),
    (["--role", "decode", "--uds", "/tmp/x.sock", "--journal", "foo://bar", *SECRET], "--journal: cannot use "
     "foo://bar as a journal: Can't load plugin: sqlalchemy.dialects:foo"),
    (["--role", "decode", "--uds", "/tmp/x.sock", "--model", "/tmp", *SECRET], "--model /tmp: /tmp/config.json not "
     "found: not an HF checkpoint directory"),
], ids=["negative port", "port above 65535", "no pages", "page size 0", "nan seconds", "journal", "no secret",
        "pd pool share", "pd jax backend", "pd tp", "device backend alone", "unknown backend", "unknown backend uds",
        "pd unknown backend", "pd jax without uds", "missing model file", "journal url", "not a checkpoint"])
def test_a_refused_value_ends_serve_in_one_line_before_jax_is_imported(args, said, monkeypatch):
    monkeypatch.delenv("FSM_PD_SIDE_CHANNEL_SECRET", raising=False)
    assert_refused(run(["serve", *args]), "fsm-pd serve", said)


@TCP
def test_the_missing_secret_says_how_to_make_one(monkeypatch):
    monkeypatch.delenv("FSM_PD_SIDE_CHANNEL_SECRET", raising=False)
    assert_refused(run(["serve", "--role", "decode"]), "fsm-pd serve", "secrets.token_hex(32)")


@pytest.mark.parametrize("role, flag", [("decode", "--port"), ("prefill", "--bootstrap-port")])
@TCP
def test_a_port_already_taken_ends_serve_before_jax_is_imported(taken, role, flag):
    assert_refused(run(["serve", "--role", role, flag, str(taken), *SECRET]), "fsm-pd serve",
                   f"{flag} {taken}: cannot listen on 127.0.0.1:{taken}: another process listens there")


@TCP
def test_the_router_role_given_as_one_word_and_its_taken_port(taken):
    # the router imports the API (and jax with it) to build its parser; it loads no model
    result = run(["serve", "--role=router", "--port", str(taken), "--prefill", "http://127.0.0.1:1",
                  "--decode", "http://127.0.0.1:2"], jax=True)
    assert_refused(result, "fsm-pd serve", f"--port {taken}: cannot listen on 127.0.0.1:{taken}")


@pytest.mark.parametrize("args, said", [
    (["--port", "-1"], "argument --port: must be a TCP port, 0 to 65535, got -1"),
    (["--transfer-backend", "rdma"], UNKNOWN_BACKEND),
    (["--model", "/nowhere/m.gguf"], "--model /nowhere/m.gguf: no such file or directory"),
    pytest.param(["--decode-arg=--num-pages=0"], "decode-0: fsm-pd serve: error: argument --num-pages: must be at "
                 "least 2", marks=TCP),
], ids=["negative port", "unknown backend", "missing model", "a node's flag"])
def test_a_refused_value_ends_launch_in_one_line_before_anything_starts(args, said, tmp_path):
    assert_refused(run(["launch", "--journal-dir", str(tmp_path / "cluster"), *args]), "fsm-pd launch", said)
    assert not (tmp_path / "cluster").exists()


@TCP
def test_launch_on_a_taken_port_starts_nothing(taken, tmp_path):
    result = run(["launch", "--port", str(taken), "--journal-dir", str(tmp_path / "cluster")])
    assert_refused(result, "fsm-pd launch", f"--port {taken}: cannot listen on 127.0.0.1:{taken}: another process "
                                            "listens there (address already in use)")
    assert not (tmp_path / "cluster").exists()


def test_role_pd_offers_the_routers_policies_and_default():
    from fsm_pd.cli import pd_flags as serve_flags
    from fsm_pd.router import policy

    assert serve_flags.PD_POLICIES == policy.MODES
    assert serve_flags.DEFAULT_LOCAL_PREFILL_MAX_TOKENS == policy.DEFAULT_LOCAL_PREFILL_MAX_TOKENS


def test_the_role_is_found_in_either_spelling():
    assert split_role(["--role", "router", "--port", "1"]) == ("router", ["--port", "1"])
    assert split_role(["--port", "1", "--role=router"]) == ("router", ["--port", "1"])
    assert split_role(["--port", "1"]) == (None, ["--port", "1"])
    parser, words = role_parser(["--role=router", "--prefill", "http://p", "--decode", "http://d"])
    assert words == ["--prefill", "http://p", "--decode", "http://d"]
    assert parser.parse_args(words).decode == ["http://d"]


def test_a_cpu_host_is_not_told_at_every_start_that_it_has_no_tpu(caplog):
    from fsm_pd.cli.serve import quiet_absent_backends

    log = logging.getLogger("jax._src.xla_bridge")
    quiet_absent_backends()
    try:
        with caplog.at_level(logging.INFO):
            log.info("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so: libtpu.so: cannot open "
                     "shared object file: No such file or directory")
            log.warning("Unable to initialize backend 'tpu': it is there and broken")
            log.info("another line")
        assert [r.getMessage()[:40] for r in caplog.records] == ["Unable to initialize backend 'tpu': it i",
                                                                 "another line"]
    finally:
        log.filters.clear()
