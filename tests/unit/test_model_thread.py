"""The model thread: jobs in order, a job's failure is its own, a fatal one kills the thread and says why."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError

import jax.numpy as jnp
import pytest
from polling import until

from fsm_pd.model.model_thread import ModelThread, ModelThreadDead


@pytest.fixture
def thread():
    t = ModelThread(name="model[test]")
    yield t
    t.close()


def blocked(thread: ModelThread) -> threading.Event:
    """Hold the thread in a job until the returned event is set, so that later jobs queue up behind it."""
    release, running = threading.Event(), threading.Event()
    thread.submit(lambda _: (running.set(), release.wait()))
    assert running.wait(30)
    return release


def test_jobs_run_in_order_on_one_thread(thread):
    seen = []
    futures = [thread.submit(lambda owner, i=i: seen.append((i, threading.current_thread().name))) for i in range(20)]
    for f in futures:
        f.result(30)
    assert [i for i, _ in seen] == list(range(20)) and {name for _, name in seen} == {"model[test]"}
    assert thread.call(lambda owner: owner is thread, timeout=30)


def test_an_ordinary_failure_is_the_jobs_own(thread):
    def bad(_):
        raise ValueError("shape mismatch")

    with pytest.raises(ValueError, match="shape mismatch"):
        thread.call(bad, timeout=30)
    assert thread.health() is None and thread.call(lambda _: 7, timeout=30) == 7


@pytest.mark.parametrize("fatal", [MemoryError("out of host memory"), SystemExit(3)])
def test_a_fatal_failure_kills_the_thread_and_fails_what_is_queued(thread, fatal):
    heard = []
    thread.on_death.append(heard.append)
    release = blocked(thread)

    def dies(_):
        raise fatal

    dying = thread.submit(dies)
    queued = thread.submit(lambda _: "never runs")
    release.set()
    with pytest.raises(type(fatal)):
        dying.result(30)
    with pytest.raises(ModelThreadDead, match=type(fatal).__name__):
        queued.result(30)
    assert type(fatal).__name__ in thread.health()
    assert heard == [thread.dead]
    with pytest.raises(ModelThreadDead):  # later jobs fail at once instead of waiting forever
        thread.submit(lambda _: None).result(30)


def test_a_lost_pool_kills_the_thread(thread):
    thread.pool = (jnp.zeros(4), jnp.ones(4))

    def donated_then_failed(owner):
        owner.pool[1].delete()  # what a failed jit call that had donated the pool leaves behind
        raise RuntimeError("XLA: resource exhausted")

    with pytest.raises(RuntimeError):
        thread.call(donated_then_failed, timeout=30)
    reason = thread.health()
    assert reason is not None and "KV pool was lost" in reason and "layers [1]" in reason


def test_a_pool_lost_by_a_failure_the_job_contained_kills_the_thread(thread):
    """A decode step runs each request alone when the batch fails (``serving/isolate.py``) and returns; if the failed
    call had donated the pool, every later step would fail on its deleted buffers while /health said 200."""
    heard = []
    thread.on_death.append(heard.append)
    thread.pool = (jnp.zeros(4), jnp.ones(4), jnp.ones(4))

    def donated_then_isolated(owner):
        owner.pool[0].delete()  # the failed batched call took the pool; the job caught it and answered 500s
        return ["500 for each request"]

    assert thread.call(donated_then_isolated, timeout=30) == ["500 for each request"]
    assert until(lambda: heard, timeout_s=30)  # the thread dies after the job's caller has its answer
    reason = thread.health()
    assert reason is not None and "KV pool was lost" in reason and "contained" in reason, reason
    assert heard == [reason]
    with pytest.raises(ModelThreadDead):
        thread.submit(lambda _: None).result(30)


def test_a_job_that_returns_with_the_pool_whole_leaves_the_thread_serving(thread):
    thread.pool = (jnp.zeros(4), jnp.ones(4))
    assert thread.call(lambda owner: len(owner.pool), timeout=30) == 2
    assert thread.health() is None and thread.call(lambda _: 7, timeout=30) == 7


def test_close_cancels_queued_jobs():
    thread = ModelThread()
    release = blocked(thread)
    queued = thread.submit(lambda _: "never runs")
    closer = threading.Thread(target=thread.close)
    closer.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # until close() has taken effect: new jobs are refused
        try:
            thread.submit(lambda _: None)
        except RuntimeError as err:
            assert "closed" in str(err)
            break
    release.set()
    closer.join(30)
    assert not closer.is_alive()
    with pytest.raises(CancelledError):
        queued.result(30)
    assert thread.health() is None  # closed on purpose is not dead
