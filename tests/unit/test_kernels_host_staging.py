"""HostStagingPool: a bounded set of host slots, clean timeouts, in-place copies of staging arrays."""

from __future__ import annotations

import queue
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from fsm_pd.kernels import HostPoolExhausted, HostStagingPool, KVLayout, copy_to_host, host_memory_kind
from fsm_pd.kernels.host_staging import _row_writer

LAYOUT = KVLayout(num_layers=2, num_pages=12, page_size=2, kv_heads=2, head_dim=8)


def staging(rows: int, value: float = 1.0) -> jax.Array:
    shape = LAYOUT.staging_shape(rows)
    return jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) + value


def test_slots_are_preallocated_host_buffers_of_the_largest_bucket():
    pool = HostStagingPool(LAYOUT, num_slots=3, max_pages=5)
    assert pool.rows == 8  # page_bucket(5)
    # On jaxlib 0.10.2's CPU backend every device offers pinned_host, so that is what the pool must pick.
    assert pool.memory_kind == "pinned_host"
    slot = pool.acquire(timeout=0)
    assert slot.buffer.shape == LAYOUT.staging_shape(8)
    assert slot.buffer.sharding.memory_kind == "pinned_host"
    assert pool.nbytes == 3 * LAYOUT.page_bytes() * 8


class FakeMemory:
    def __init__(self, kind):
        self.kind = kind


class FakeDevice:
    def __init__(self, *kinds):
        self.kinds = kinds

    def addressable_memories(self):
        return [FakeMemory(kind) for kind in self.kinds]

    def default_memory(self):
        return FakeMemory(self.kinds[0])


def test_memory_kind_falls_back_when_pinned_host_is_missing():
    assert host_memory_kind([FakeDevice("device", "pinned_host", "unpinned_host")]) == "pinned_host"
    mixed = [FakeDevice("device", "pinned_host", "unpinned_host"), FakeDevice("device", "unpinned_host")]
    assert host_memory_kind(mixed) == "unpinned_host"  # a kind every device offers, or none
    assert host_memory_kind([FakeDevice("device")]) == "device"


def test_exhausted_pool_times_out_cleanly_and_recovers_on_release():
    pool = HostStagingPool(LAYOUT, num_slots=2, max_pages=1)
    held = [pool.acquire(timeout=0), pool.acquire(timeout=0)]
    assert pool.free_slots() == 0
    with pytest.raises(HostPoolExhausted, match="all 2 host staging slots are in use"):
        pool.acquire(timeout=0)
    started = time.monotonic()
    with pytest.raises(TimeoutError):  # HostPoolExhausted is a TimeoutError
        pool.acquire(timeout=0.1)
    assert 0.1 <= time.monotonic() - started < 2.0
    pool.release(held.pop())
    assert pool.acquire(timeout=0) is not None


class SignallingCondition(threading.Condition):
    """The pool's condition, telling the test each time a thread starts to wait on it."""

    def __init__(self):
        super().__init__()
        self.waits: queue.SimpleQueue[None] = queue.SimpleQueue()

    def wait(self, timeout=None):
        self.waits.put(None)
        return super().wait(timeout)


def test_a_waiting_acquire_gets_the_slot_another_thread_releases():
    pool = HostStagingPool(LAYOUT, num_slots=1, max_pages=1)
    changed = pool._changed = SignallingCondition()
    slot = pool.acquire(timeout=0)
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(timeout=10)))
    waiter.start()
    changed.waits.get(timeout=10)  # the waiter looked for a free slot, found none and waits
    with changed:
        changed.notify_all()  # a wake-up that frees nothing: it must look again and go back to waiting
    changed.waits.get(timeout=10)
    assert not got, "the waiter must block while the only slot is held"
    pool.release(slot)
    waiter.join(timeout=10)
    assert got == [slot]


def test_concurrent_users_never_hold_more_than_num_slots():
    pool = HostStagingPool(LAYOUT, num_slots=2, max_pages=1)
    lock, holding, peak, errors = threading.Lock(), [0], [0], []

    def user():
        try:
            for _ in range(20):
                with pool.slot(timeout=10):
                    with lock:
                        holding[0] += 1
                        peak[0] = max(peak[0], holding[0])
                    time.sleep(0.001)
                    with lock:
                        holding[0] -= 1
        except Exception as error:  # surfaced below: a thread's exception would otherwise vanish
            errors.append(error)

    threads = [threading.Thread(target=user) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors
    assert peak[0] == 2
    assert pool.free_slots() == 2


def test_misuse_of_slots_is_rejected():
    pool, other = HostStagingPool(LAYOUT, num_slots=1, max_pages=1), HostStagingPool(LAYOUT, num_slots=1, max_pages=1)
    slot = pool.acquire(timeout=0)
    with pytest.raises(ValueError, match="belongs to another pool"):
        other.release(slot)
    pool.release(slot)
    with pytest.raises(ValueError, match="host slot 0 is not acquired"):
        pool.release(slot)
    with pytest.raises(ValueError, match="not acquired"):
        copy_to_host(staging(1), slot)
    with pytest.raises(ValueError, match="num_slots must be at least 1"):
        HostStagingPool(LAYOUT, num_slots=0, max_pages=1)


@pytest.mark.usefixtures("cpu_default")  # the in-place write is the CPU backend's (unverified on a TPU's host memory)
def test_copy_to_host_writes_rows_in_place_and_keeps_the_rest():
    pool = HostStagingPool(LAYOUT, num_slots=1, max_pages=8, sharding=SingleDeviceSharding(jax.devices("cpu")[0]))
    with pool.slot(timeout=0) as slot:
        copy_to_host(staging(8, value=100.0), slot)
        first, address = slot.buffer, slot.buffer.unsafe_buffer_pointer()
        copy_to_host(staging(2), slot)
        assert first.is_deleted(), "the slot's previous buffer is donated to the copy"
        # On this backend XLA reuses the donated host buffer: the copy lands in the preallocated memory itself.
        assert slot.buffer.unsafe_buffer_pointer() == address
        assert slot.staged_rows == 2
        assert slot.buffer.sharding.memory_kind == pool.memory_kind
        host = np.asarray(slot.buffer)
        np.testing.assert_array_equal(host[:, :2], np.asarray(staging(2)))
        np.testing.assert_array_equal(host[:, 2:], np.asarray(staging(8, value=100.0))[:, 2:])


def test_copy_to_host_rejects_staging_that_does_not_fit():
    pool = HostStagingPool(LAYOUT, num_slots=1, max_pages=2)
    slot = pool.acquire(timeout=0)
    with pytest.raises(ValueError, match=r"staging shape \[2, 4, 2, 32\] does not fit a host slot"):
        copy_to_host(staging(4), slot)
    with pytest.raises(ValueError, match="does not fit"):
        copy_to_host(jnp.zeros((2, 2, 2, 16)), slot)
    with pytest.raises(ValueError, match="staging dtype bfloat16"):
        copy_to_host(staging(2).astype(jnp.bfloat16), slot)


def test_copy_to_host_compiles_once_per_bucket():
    pool = HostStagingPool(LAYOUT, num_slots=1, max_pages=16)
    writer = _row_writer(pool.sharding)
    slot = pool.acquire(timeout=0)
    before = writer._cache_size()
    for _ in range(3):
        copy_to_host(staging(4), slot)
    copy_to_host(staging(16), slot)
    assert writer._cache_size() - before == 2
