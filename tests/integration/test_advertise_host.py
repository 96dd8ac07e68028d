"""Bind one address, advertise another, over IPv6: each node here binds the IPv6 wildcard ``::`` and advertises
``::1``, so everything a peer is told must name ``[::1]`` (a peer told ``[::]`` would only reach it by luck) and every
connection crosses IPv6 loopback. Skipped where this machine has no ``::1``.

The transfer backends (P in a subprocess, as in ``test_transfer_backends.py``), the side channel, and a real prefill
and decode engine pair in this process (the production ``KVManager``, bootstrap registration and tcp transfers),
equal to colocated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time

import pytest
from test_transfer_backends import Producer, assert_bytes_equal, make_arrays, specs

from fsm_pd.bootstrap import resolve_prefill
from fsm_pd.engine.loader import load_model
from fsm_pd.engine.sampling import SamplingParams
from fsm_pd.serving.collect import generate
from fsm_pd.serving.colocated_engine import ColocatedEngine
from fsm_pd.serving.decode_engine import DecodeEngine
from fsm_pd.serving.prefill_engine import PrefillEngine
from fsm_pd.serving.types import Bootstrap, GenerateRequest
from fsm_pd.transport import SideChannel, generate_secret
from fsm_pd.transport.backends import create_backend
from fsm_pd.transport.messages import Heartbeat


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")


@pytest.mark.parametrize("name", ["jax", "zmq", "tcp"])
def test_a_backend_bound_to_the_ipv6_wildcard_advertises_and_serves_its_advertised_address(name):
    producer = Producer(name, host="::", advertise_host="::1")
    consumer = create_backend(name, host="::1") if name == "jax" else create_backend(name, serve=False)
    try:
        assert producer.address.rpartition(":")[0].endswith("[::1]"), producer.address
        shapes, dtypes = [[3, 5, 8], [7]], ["float32", "int32"]
        uuid = producer.publish(11, shapes, dtypes)
        assert_bytes_equal(consumer.pull(producer.address, uuid, specs(shapes, dtypes), 20),
                           make_arrays(11, shapes, dtypes))
    finally:
        consumer.close()
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


async def through_pd(p, d, req):
    """What a router does: the request to both nodes at once; the answer is the decode node's."""
    return await asyncio.gather(generate(p, req), generate(d, req))


def test_a_pd_pair_bound_to_the_ipv6_wildcard_answers_as_colocated(tmp_path):
    model = load_model("tiny")
    sizes = {"num_pages": 64, "page_size": 4}
    p = PrefillEngine(model, backend="tcp", host="::", advertise_host="::1", journal=str(tmp_path / "p.db"), **sizes)
    d = DecodeEngine(model, backend="tcp", host="::", advertise_host="::1", secret=p.secret,
                     journal=str(tmp_path / "d.db"), **sizes)
    colocated = ColocatedEngine(model, **sizes)
    try:
        host, port = p.bootstrap_host_port
        assert host == "::1"
        found = resolve_prefill(Bootstrap(host, port, 0).addr, retries=0)
        assert found["rank_ip"] == "::1", found  # bare in the registration, as SGLang's rank_ip
        assert found["side_channel"].startswith("tcp://[::1]:") and found["transfer_addr"].startswith("tcp://[::1]:")
        assert d.manager.side_channel.address.startswith("tcp://[::1]:")  # PREPARE's reply_to
        for room, ids in enumerate([[5, 9, 2], list(range(1, 30))]):
            req = GenerateRequest(f"r{room}", ids, SamplingParams(temperature=0.0, max_new_tokens=8), seed=0)
            want = [o.token_id for o in asyncio.run(generate(colocated, req))]
            pd_req = dataclasses.replace(req, bootstrap=Bootstrap(f"[{host}]", port, 100 + room))
            _, got = asyncio.run(asyncio.wait_for(through_pd(p, d, pd_req), 120))
            assert [o.token_id for o in got] == want
    finally:
        colocated.close()
        d.close()
        p.close()
