"""D side of an overlapped handoff (StreamedScatter): groups of layers are written as they land, in model-thread
order with the job that frees pages."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest

from fsm_pd.control.overlap import StreamedScatter, layer_group
from fsm_pd.kernels import KVLayout, page_bucket
from fsm_pd.model.model_thread import ModelThread

# StreamedScatter writes a CPU pool (a TPU node scatters whole): the CPU is jax's default device here, on a TPU
# host too (tests/on_chip.py)
pytestmark = pytest.mark.usefixtures("cpu_default")

LAYOUT = KVLayout(num_layers=4, num_pages=12, page_size=2, kv_heads=2, head_dim=8)
PAGES = [9, 3, 4]


def make_pool(value: float) -> tuple[jax.Array, ...]:
    return tuple(jax.device_put(np.full(LAYOUT.layer_shape, value, np.float32)) for _ in range(LAYOUT.num_layers))


def staging() -> np.ndarray:
    shape = LAYOUT.staging_shape(page_bucket(len(PAGES)))
    return np.arange(np.prod(shape), dtype=np.float32).reshape(shape)


def layer_bytes(host: np.ndarray) -> int:
    return host[0].nbytes


@pytest.fixture
def model():
    thread = ModelThread(make_pool(-1.0))
    yield thread
    thread.close()


def written_layers(model: ModelThread, host: np.ndarray) -> list[bool]:
    pool = [np.asarray(layer) for layer in model.pool]
    return [bool(np.array_equal(pool[i][PAGES], host[i, : len(PAGES)])) for i in range(LAYOUT.num_layers)]


def test_group_is_the_smallest_divisor_reaching_the_page_bytes():
    big = KVLayout(num_layers=16, num_pages=9, page_size=16, kv_heads=8, head_dim=128)  # 128 KiB pages
    assert layer_group(big) == 4
    assert layer_group(KVLayout(num_layers=28, num_pages=9, page_size=16, kv_heads=8, head_dim=128,
                                dtype="bfloat16")) == 14  # 64 KiB pages: 8 needed, 14 is the next divisor
    assert layer_group(LAYOUT) == LAYOUT.num_layers  # tiny pages: one write for all layers


def test_only_fully_landed_groups_are_written_and_the_result_is_the_whole_scatter(model):
    host = staging()
    stream = StreamedScatter(model, LAYOUT, PAGES, group=2)
    stream.on_progress(0, host, layer_bytes(host) + 5)  # a layer and a bit: no whole group yet
    assert stream.submitted == 0
    stream.on_progress(0, host, 2 * layer_bytes(host))
    assert stream.submitted == 2
    model.call(lambda owner: None)  # the write ran
    assert written_layers(model, host) == [True, True, False, False]
    stream.on_progress(0, host, host.nbytes)
    stream.finish().result(timeout=30)
    assert written_layers(model, host) == [True] * 4
    untouched = [p for p in range(1, LAYOUT.num_pages) if p not in PAGES]
    assert all((np.asarray(layer)[untouched] == -1.0).all() for layer in model.pool)


def test_writes_queued_after_the_free_job_write_nothing(model):
    host = staging()
    stream = StreamedScatter(model, LAYOUT, PAGES, group=2)
    gate = threading.Event()
    model.submit(lambda owner: gate.wait(10))  # hold the model thread so that the order below is the queue order
    stream.on_progress(0, host, 2 * layer_bytes(host))  # group 0: queued before the free, so it still runs
    model.submit(lambda owner: stream.cancel())  # what FreePages queues before it releases the pages
    stream.on_progress(0, host, host.nbytes)  # group 1 landed after the abort
    gate.set()
    with pytest.raises(RuntimeError, match="cancelled"):
        stream.finish().result(timeout=30)
    assert written_layers(model, host) == [True, True, False, False]


def test_a_failed_write_is_reported_and_stops_later_writes(model):
    host = staging()
    stream = StreamedScatter(model, LAYOUT, [9, 3, 99], group=2)  # page 99 does not exist
    stream.on_progress(0, host, host.nbytes)
    with pytest.raises(ValueError, match="out of range"):
        stream.finish().result(timeout=30)
    assert written_layers(model, host) == [False] * 4


def test_a_group_must_divide_the_layers(model):
    with pytest.raises(ValueError, match="does not divide"):
        StreamedScatter(model, LAYOUT, PAGES, group=3)
