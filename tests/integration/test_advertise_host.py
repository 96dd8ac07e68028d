"""Bind one address, advertise another, over IPv6: each node here binds the IPv6 wildcard ``::`` and advertises
``::1``, so everything a peer is told must name ``[::1]`` (a peer told ``[::]`` would only reach it by luck) and every
connection crosses IPv6 loopback. Skipped where this machine has no ``::1``.

The transfer backends (P in a subprocess, as in ``test_transfer_backends.py``), the side channel, and ``fsm-pd serve``
prefill and decode processes behind the built-in router and sglang-router, equal to a colocated node.
"""

from __future__ import annotations

import socket
import sys
import time

import pytest
from processes import PAGE_SIZE, Cluster, free_port, wait_health
from real_parts import SGLANG_ROUTER
from test_pd_serving import greedy
from test_transfer_backends import Producer, assert_bytes_equal, make_arrays, specs

from fsm_pd.bootstrap import resolve_prefill
from fsm_pd.transport import SideChannel, generate_secret
from fsm_pd.transport.backends import create_backend
from fsm_pd.transport.messages import Heartbeat

PROMPTS = ["Hi", "over IPv6 " * 4, "x" * 40]


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


# A real part (tests/real_parts.py): a skip for want of ::1 is counted, and fails CI unless allowed.
pytestmark = pytest.mark.real_part("ipv6-loopback", missing=None if _has_ipv6_loopback() else
                                   "this machine has no IPv6 loopback (::1)")


@pytest.mark.parametrize("name", ["jax", "zmq", "tcp"])
def test_a_backend_bound_to_the_ipv6_wildcard_advertises_and_serves_its_advertised_address(name):
    producer = Producer(name, host="::", advertise_host="::1")
    shapes, dtypes = [[3, 5, 8], [7]], ["float32", "int32"]
    try:
        assert producer.address.rpartition(":")[0].endswith("[::1]"), producer.address
        uuid = producer.publish(11, shapes, dtypes)
        if name == "jax":  # a process has one jax transfer server, and this one's is the other tests' on 127.0.0.1
            consumer = Producer(name, host="::1")
            try:
                assert consumer.call(op="pull", address=producer.address, uuid=uuid, seed=11, shapes=shapes,
                                     dtypes=dtypes, timeout_s=20) == {"equal": True}
            finally:
                consumer.close()
            return
        consumer = create_backend(name, serve=False)
        try:
            assert_bytes_equal(consumer.pull(producer.address, uuid, specs(shapes, dtypes), 20),
                               make_arrays(11, shapes, dtypes))
        finally:
            consumer.close()
    finally:
        producer.close()


def test_a_side_channel_bound_to_the_ipv6_wildcard_is_answered_at_its_advertised_address():
    secret = generate_secret()
    pongs: list = []
    with SideChannel(node_id="v6", secret=secret, on_message=lambda m: None, bind="tcp://[::]:0",
                     advertise_host="::1") as v6, \
         SideChannel(node_id="v4", secret=secret, on_message=lambda m: None) as v4:
        assert v6.address.startswith("tcp://[::1]:"), v6.address
        v6.add_observer(lambda m: pongs.append(m) if isinstance(m, Heartbeat) and m.pong else None)
        v6.ping(v4.address)  # v4 answers at the ping's origin: v6's advertised address
        deadline = time.monotonic() + 5
        while not pongs and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pongs and pongs[0].sender == "v4"


@SGLANG_ROUTER  # behind both routers: without sglang-router the test skips, counted (it did run without it, quietly)
def test_a_pd_pair_on_ipv6_loopback_answers_as_colocated_behind_both_routers(tmp_path):
    """``fsm-pd serve`` processes: the prefill binds ``::`` and advertises ``::1``, the decode binds ``::1``; the
    routers are given bracketed worker URLs."""
    cluster = Cluster(tmp_path)
    try:
        serve = [sys.executable, "-m", "fsm_pd.cli", "serve", "--page-size", str(PAGE_SIZE)]
        ports = {name: free_port() for name in ("prefill", "bootstrap", "decode", "colocated", "router", "sglang")}
        base = {name: f"http://[::1]:{port}" for name, port in ports.items()}
        nodes = {  # started together, then waited for: three JAX processes start faster side by side
            "prefill": ["--role", "prefill", "--host", "::", "--advertise-host", "::1", "--bootstrap-port",
                        str(ports["bootstrap"]), "--journal", str(tmp_path / "p.db")],
            "decode": ["--role", "decode", "--host", "::1", "--journal", str(tmp_path / "d.db")],
            "colocated": ["--role", "colocated", "--host", "::1"]}
        procs = {n: cluster.launch(n, [*serve, *args, "--port", str(ports[n])]) for n, args in nodes.items()}
        for name, proc in procs.items():
            wait_health(base[name], proc)
        found = resolve_prefill(base["bootstrap"], retries=0)
        assert found["rank_ip"] == "::1", found  # bare in the registration, as SGLang's rank_ip
        assert found["side_channel"].startswith("tcp://[::1]:") and found["transfer_addr"].startswith("tcp://[::1]:")
        workers = ["--prefill", base["prefill"], str(ports["bootstrap"]), "--decode", base["decode"]]
        routers = [cluster.start("router", [*serve[:4], "--role", "router", "--host", "::1", "--port",
                                            str(ports["router"]), *workers, "--pd-policy", "always"], base["router"]),
                   cluster.start("sglang", [  # sglang-router binds an IPv6 --host only in brackets
                       sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", *workers,
                       "--host", "[::1]", "--port", str(ports["sglang"]), "--prometheus-host", "127.0.0.1",
                       "--prometheus-port", str(free_port()), "--policy", "random"], base["sglang"])]
        want = [greedy(base["colocated"], prompt) for prompt in PROMPTS]
        assert len(set(map(tuple, want))) == len(PROMPTS)
        for router in routers:
            assert [greedy(router, prompt) for prompt in PROMPTS] == want, router
    finally:
        cluster.stop()


