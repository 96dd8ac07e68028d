"""Progressive publish between two real processes: P publishes a host array before filling it, D sees each final
prefix as it lands, and every way the filling can stop ends the pull with a clear error well before its deadline.

P is ``transfer_producer.py`` (op ``publish_progressive``), which fills the array part by part on a thread. The
last test is the tcp backend's own: the cap on the streams (threads) its producer serves at once.
"""

from __future__ import annotations

import socket
import threading
import time

import jax
import numpy as np
import pytest
from test_transfer_backends import Producer, make_arrays, specs, timed_failure

from fsm_pd.transport.backends import TransferFailed, create_backend
from fsm_pd.transport.backends.tcp_backend import parse_address

PROGRESSIVE = ["zmq", "tcp"]
SHAPE, DTYPE = [16, 32768], "float32"  # 2 MiB
TIMEOUT_S = 20.0


def fill(producer: Producer, **opts: object) -> int:
    cmd = {"seed": 5, "shape": SHAPE, "dtype": DTYPE, "parts": 8, "pause_s": 0.1, **opts}
    return producer.call(op="publish_progressive", **cmd)["uuid"]


class Progress:
    """on_progress hook that records when each prefix landed and checks it is already byte-exact then."""

    def __init__(self, expected: np.ndarray) -> None:
        self.expected = expected.reshape(-1).view(np.uint8)
        self.seen: list[tuple[float, int]] = []
        self.wrong: list[int] = []

    def __call__(self, index: int, host: np.ndarray, final_bytes: int) -> None:
        assert index == 0
        if host.reshape(-1).view(np.uint8)[:final_bytes].tobytes() != self.expected[:final_bytes].tobytes():
            self.wrong.append(final_bytes)
        self.seen.append((time.monotonic(), final_bytes))


@pytest.fixture(params=PROGRESSIVE)
def producer(request):
    p = Producer(request.param)
    yield p
    p.close()


def test_each_part_streams_as_soon_as_it_is_final(producer):
    (expected,) = make_arrays(5, [SHAPE], [DTYPE])
    progress = Progress(expected)
    with create_backend(producer.backend) as consumer:
        uuid = fill(producer, pause_s=0.15)
        (got,) = consumer.pull(producer.address, uuid, specs([SHAPE], [DTYPE]), TIMEOUT_S, on_progress=progress)
        returned = time.monotonic()
    producer.call(op="release", uuid=uuid)
    assert np.asarray(got).tobytes() == expected.tobytes()
    sizes = [n for _, n in progress.seen]
    assert sizes == sorted(sizes) and sizes[-1] == expected.nbytes
    assert not progress.wrong, "a prefix was reported before its bytes were in place"
    # 8 parts 0.15 s apart: the first part arrives about a second before the last, not with it.
    assert returned - progress.seen[0][0] > 0.6
    assert producer.open_entries() == (0, 0)


def test_producer_failing_mid_fill_fails_the_pull_at_once(producer):
    progress = Progress(make_arrays(5, [SHAPE], [DTYPE])[0])
    with create_backend(producer.backend) as consumer:
        uuid = fill(producer, fail_after=3)
        err, took = timed_failure(
            lambda: consumer.pull(producer.address, uuid, specs([SHAPE], [DTYPE]), TIMEOUT_S, on_progress=progress)
        )
    assert isinstance(err, TransferFailed) and err.blame == "remote"
    assert "gather failed on purpose" in err.reason
    assert took < 3.0
    assert all(n <= 3 * 2**18 for _, n in progress.seen) and not progress.wrong  # 3 of 8 parts of 2 MiB
    assert producer.open_entries() == (0, 0)


def test_hold_expiring_mid_fill_fails_the_pull(producer):
    with create_backend(producer.backend) as consumer:
        uuid = fill(producer, fill_parts=2, hold_s=0.8)
        err, took = timed_failure(consumer.pull, producer.address, uuid, specs([SHAPE], [DTYPE]), TIMEOUT_S)
    assert isinstance(err, TransferFailed) and "hold expired" in err.reason
    assert took < 4.0
    assert producer.open_entries() == (0, 0)


@pytest.mark.parametrize("backend", PROGRESSIVE)
def test_producer_killed_mid_fill_fails_the_pull_at_once(backend):
    producer = Producer(backend)
    first = threading.Event()
    try:
        with create_backend(backend) as consumer:
            uuid = fill(producer, fill_parts=2)
            threading.Thread(target=lambda: first.wait(10) and producer.kill(), daemon=True).start()
            err, took = timed_failure(
                lambda: consumer.pull(producer.address, uuid, specs([SHAPE], [DTYPE]), TIMEOUT_S,
                                      on_progress=lambda *_: first.set())
            )
    finally:
        if producer.proc.poll() is None:
            producer.kill()
    assert first.is_set()
    assert isinstance(err, TransferFailed) and err.blame == "remote"
    assert took < 5.0


def test_tcp_refuses_pulls_beyond_its_stream_limit_at_once():
    """Each served pull is a thread on P, so their number is capped; one over the cap fails at once, and the slot
    comes back when a stream ends."""
    with create_backend("tcp", max_streams=1) as producer, create_backend("tcp", serve=False) as consumer:
        _, address = parse_address(producer.address)
        idle = socket.create_connection(address)  # takes the one stream, waiting for its request
        err, took = timed_failure(consumer.pull, producer.address, 12345, specs([[8]], ["float32"]), TIMEOUT_S)
        assert isinstance(err, TransferFailed) and "busy" in err.reason and took < 2.0
        idle.close()
        expected = np.arange(8, dtype=np.float32)
        producer.publish(777, [jax.device_put(expected)], 30.0)
        deadline = time.monotonic() + 5
        while True:  # the stream thread notices the closed connection and gives its slot back
            try:
                (got,) = consumer.pull(producer.address, 777, specs([[8]], ["float32"]), TIMEOUT_S)
                break
            except TransferFailed as exc:
                assert "busy" in exc.reason and time.monotonic() < deadline
                time.sleep(0.05)
        assert np.asarray(got).tobytes() == expected.tobytes()


@pytest.mark.parametrize("timeout_s", [float("nan"), -1.0, 1e9])
def test_tcp_refuses_a_pull_with_a_nonsense_timeout(timeout_s):
    """A stream thread parks for as long as the puller asks; a request that asks for forever is refused."""
    from fsm_pd.transport.backends import tcp_wire as wire

    with create_backend("tcp") as producer:
        _, address = parse_address(producer.address)
        with socket.create_connection(address, timeout=5) as raw:
            wire.send_request(raw, {"v": wire.PROTOCOL_VERSION, "uuid": 1, "digest": b"x" * 16, "timeout_s": timeout_s})
            kind, length = wire.unpack_frame_header(wire.recv_exact(raw, wire.FRAME_HEADER_BYTES))
            body = wire.unpack(wire.recv_exact(raw, length))
    assert kind == wire.FAIL and body["blame"] == "local" and "timeout_s" in body["reason"]
