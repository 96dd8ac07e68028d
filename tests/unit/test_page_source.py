"""Sending a handoff straight from the pool's pages (tcp ``publish_pages`` of a ``PoolPages``): the bytes are the ones
a gather would build, no view of the pool is alive while a job donates it, and a hold that ends mid-stream or a
puller that dies mid-stream ends the stream without sending a page that may have been freed."""

from __future__ import annotations

import socket
import threading
import time
import warnings
from functools import partial

import jax
import numpy as np
import pytest
from real_parts import TCP

from fsm_pd.kernels import KVLayout, gather_pages, page_bucket
from fsm_pd.kernels.page_source import PoolPages
from fsm_pd.model.model_thread import ModelThread
from fsm_pd.transport.backends import TransferFailed, create_backend, new_uuid
from fsm_pd.transport.backends import tcp_wire as wire
from fsm_pd.transport.backends.spec import array_key, layout_digest
from fsm_pd.transport.backends.tcp_backend import parse_address

# a send from the pool reads zero-copy views of a CPU pool: the CPU is jax's default device here, on a TPU host
# too (tests/on_chip.py); and the tcp backend listens on 127.0.0.1
pytestmark = [pytest.mark.usefixtures("cpu_default"), TCP]

LAYOUT = KVLayout(num_layers=4, num_pages=80, page_size=16, kv_heads=2, head_dim=64)  # 16 KiB pages
STEP_PAGE = LAYOUT.num_pages - 1  # the page the test's "steps" write: never one that is sent
TIMEOUT_S = 20.0


def make_pool(layout: KVLayout = LAYOUT) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(7)
    return tuple(jax.device_put(rng.standard_normal(layout.layer_shape, dtype=np.float32))
                 for _ in range(layout.num_layers))


@partial(jax.jit, donate_argnums=0)
def _step(pool):
    return tuple(layer.at[STEP_PAGE].add(1.0) for layer in pool)


def step(owner) -> bool:
    """A donating step, as a forward pass is: whether XLA updated the pool in place (no view kept it alive)."""
    before = [layer.unsafe_buffer_pointer() for layer in owner.pool]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Some donated buffers were not usable"
        owner.pool = jax.block_until_ready(_step(owner.pool))
    return before == [layer.unsafe_buffer_pointer() for layer in owner.pool]


def spec(pages: list[int], layout: KVLayout = LAYOUT):
    return [jax.ShapeDtypeStruct(layout.staging_shape(page_bucket(len(pages))), np.float32)]


@pytest.fixture
def model():
    thread = ModelThread(make_pool(), name="test-prefill-model")
    thread.call(step)  # the first step moves the pool out of the NumPy memory device_put aliased
    yield thread
    thread.close()


@pytest.fixture
def pair():
    with create_backend("tcp", frame_bytes=256 << 10) as producer, create_backend("tcp", serve=False) as consumer:
        yield producer, consumer


def publish(model: ModelThread, producer, pages: list[int], layout: KVLayout = LAYOUT) -> tuple[int, np.ndarray]:
    """Publish ``pages`` from the pool; also what a gather of them gives now (the bytes D must get)."""
    uuid = new_uuid()
    expected = model.call(lambda owner: np.asarray(gather_pages(owner.pool, np.array(pages, np.int32), layout=layout)))
    model.call(lambda owner: producer.publish_pages(uuid, PoolPages(owner, pages, layout), TIMEOUT_S))
    return uuid, expected


@pytest.mark.parametrize("pages", [[3, 4, 5, 6, 7, 8], [40, 2, 17, 18, 19, 60, 1, 33, 34], list(range(70, 0, -2))],
                         ids=["consecutive", "runs", "every-other"])
def test_the_pulled_bytes_are_what_a_gather_builds(model, pair, pages):
    producer, consumer = pair
    uuid, expected = publish(model, producer, pages)
    (got,) = consumer.pull(producer.address, uuid, spec(pages), TIMEOUT_S)
    np.testing.assert_array_equal(np.asarray(got), expected)  # padding rows included: page 0, as gathered
    producer.release(uuid)
    assert producer.open_entries().count == 0


def test_more_page_runs_per_frame_than_one_sendmsg_takes():
    layout = KVLayout(num_layers=2, num_pages=2400, page_size=1, kv_heads=1, head_dim=64)  # 512-byte pages
    pages = list(range(2, 2400, 2))  # 1199 runs of one page per layer: more than MAX_IOV in a 1 MiB frame
    model = ModelThread(make_pool(layout))
    try:
        with create_backend("tcp", frame_bytes=1 << 20) as producer, create_backend("tcp", serve=False) as consumer:
            uuid, expected = publish(model, producer, pages, layout)
            (got,) = consumer.pull(producer.address, uuid, spec(pages, layout), TIMEOUT_S)
            np.testing.assert_array_equal(np.asarray(got), expected)
    finally:
        model.close()


def test_steps_during_a_send_donate_the_pool_in_place_and_the_bytes_still_arrive(model, pair):
    """The puller stalls after its first frame, so that steps run while the send is in flight: each must consume
    the pool in place (a view kept across a step would make XLA copy it), and the rest then comes from a copy."""
    producer, consumer = pair
    pages = list(range(1, 65))  # 4 MiB: many frames
    uuid, expected = publish(model, producer, pages)
    in_place: list[bool] = []
    stalled = threading.Event()

    def slow_reader(index: int, host: np.ndarray, final_bytes: int) -> None:
        if not stalled.is_set():
            stalled.set()
            for _ in range(5):  # steps on P while D does not read; P's socket fills up
                in_place.append(model.call(step))
                time.sleep(0.01)

    (got,) = consumer.pull(producer.address, uuid, spec(pages), TIMEOUT_S, on_progress=slow_reader)
    in_place += [model.call(step) for _ in range(3)]  # and after it
    np.testing.assert_array_equal(np.asarray(got), expected)
    assert in_place == [True] * 8


# 512 pages of 64 KiB (16 KiB a layer): 32 MiB, far more than loopback's socket buffers hold (4 MiB to send, a few to
# receive) when D first reports progress, at 1 MiB landed. With the 4 MiB of LAYOUT a loaded machine could get the
# whole stream and its END into the buffers before D's callback ended the hold, and the pull rightly succeeded.
BIG = KVLayout(num_layers=4, num_pages=600, page_size=16, kv_heads=2, head_dim=64)
BIG_PAGES = list(range(80, 592))


def test_a_hold_ended_mid_stream_fails_the_pull_and_sends_no_page_freed_after_it(pair):
    """P fails the hold while D is mid-stream, then "frees" the pages: a job overwrites them. D's pull fails with
    P's reason, and every byte it had landed is the pages' old contents or the zeros that close a frame."""
    producer, consumer = pair
    model = ModelThread(make_pool(BIG), name="test-prefill-model")
    uuid, expected = publish(model, producer, BIG_PAGES, BIG)
    landed: list[np.ndarray] = []
    freed = threading.Event()

    def free_pages(owner) -> None:
        owner.pool = tuple(layer.at[np.array(BIG_PAGES)].set(99.0) for layer in owner.pool)

    def on_progress(index: int, host: np.ndarray, final_bytes: int) -> None:
        if not freed.is_set():
            freed.set()
            producer.fail(uuid, "room aborted")  # the handlers end the hold before the model thread frees pages
            model.call(free_pages)
        landed[:] = [host.reshape(-1).view(np.uint8)[:final_bytes].copy()]  # bytes: a write may end mid-float

    try:
        with pytest.raises(TransferFailed, match="room aborted"):
            consumer.pull(producer.address, uuid, spec(BIG_PAGES, BIG), TIMEOUT_S, on_progress=on_progress)
        got = landed[0]
        sent = expected.reshape(-1).view(np.uint8)[: got.size]
        assert not np.any(got[: got.size // 4 * 4].view(np.float32) == 99.0), "a freed page's new contents were sent"
        assert np.all((got == sent) | (got == 0))
        assert producer.open_entries().count == 0
        assert model.call(step)
    finally:
        model.close()


def test_a_puller_dying_mid_stream_leaves_no_view_of_the_pool(model):
    """The steps run once P's stream has met the reset and ended (not merely after a while): a view of the pool left
    behind by the stream's error path would show, where one checked before the stream noticed the reset would not.
    That it ended shows at one stream slot: a second pull is refused as busy until the dying stream gives it back."""
    with create_backend("tcp", frame_bytes=256 << 10, max_streams=1) as producer, \
            create_backend("tcp", serve=False) as consumer:
        pages = list(range(1, 65))
        uuid, _ = publish(model, producer, pages)
        family, address = parse_address(producer.address)
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.connect(address)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            keys = [array_key(s.shape, s.dtype, None) for s in spec(pages)]
            wire.send_request(sock, {"v": wire.PROTOCOL_VERSION, "uuid": uuid, "digest": layout_digest(keys),
                                     "timeout_s": TIMEOUT_S})
            sock.recv(1 << 20)  # the stream has started
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # reset
        probe = new_uuid()
        producer.publish(probe, [jax.device_put(np.zeros(4, np.float32))], TIMEOUT_S)
        deadline = time.monotonic() + TIMEOUT_S
        while True:  # until the one stream slot is free again: P's stream of the dead puller has ended
            try:
                consumer.pull(producer.address, probe, [jax.ShapeDtypeStruct((4,), np.float32)], TIMEOUT_S)
                break
            except TransferFailed as exc:
                assert "busy" in str(exc) and time.monotonic() < deadline, exc
            time.sleep(0.01)
        assert all(model.call(step) for _ in range(3))
        producer.release(uuid)
        producer.release(probe)
        assert producer.open_entries().count == 0
