"""A shared pool's handoff waits for no model step (``effects/ports.run_kv_job``, ``control/workers.LocalPuller``).

Under ``--role pd`` on one set of devices the handoff moves page ownership under the allocator's lock and touches no
device array, so its gather and scatter run on the engine's loop thread at once, and a pull whose entry is already
published is taken there too. Each test holds the real model thread busy (a job waiting on an event, as a long
prefill chunk would) and shows the handoff's job done meanwhile; a pool that copies KV (``JaxKV``) still queues.
"""

from __future__ import annotations

import threading

import pytest

from fsm_pd.control.jax_kv import JaxKV
from fsm_pd.control.pool_kv import SharedPoolKV
from fsm_pd.control.workers import LocalPuller
from fsm_pd.effects.ports import run_kv_job
from fsm_pd.model.model_thread import ModelThread
from fsm_pd.transport.backends.pool_backend import PageHandoff, PoolHandoffBackend


@pytest.fixture
def busy_model():
    """A real model thread held by a job until the test ends."""
    model, release = ModelThread(name="model[test]"), threading.Event()
    model.submit(lambda owner: release.wait(30))
    yield model
    release.set()
    model.close()


def test_a_shared_pool_job_runs_at_once_on_the_caller_while_the_model_thread_is_busy(busy_model):
    ran_on = []
    done = run_kv_job(busy_model, SharedPoolKV.__new__(SharedPoolKV), lambda owner: ran_on.append(
        (threading.current_thread(), owner)) or "adopted")
    assert done.done() and done.result() == "adopted"
    assert ran_on == [(threading.current_thread(), busy_model)]


def test_a_shared_pool_job_that_fails_reports_through_its_future(busy_model):
    def refuse(owner):
        raise ValueError("the sender no longer holds page 7")

    done = run_kv_job(busy_model, SharedPoolKV.__new__(SharedPoolKV), refuse)
    assert isinstance(done.exception(timeout=0), ValueError)


def test_a_pool_that_copies_kv_still_waits_for_the_model_thread(busy_model):
    done = run_kv_job(busy_model, JaxKV.__new__(JaxKV), lambda owner: threading.current_thread().name)
    assert not done.done()  # queued behind the busy job, in order with every other job on the pool


def test_a_published_pool_entry_is_taken_at_once_and_an_unpublished_one_waits_on_a_worker(busy_model):
    sender, receiver = PoolHandoffBackend(), PoolHandoffBackend()
    workers, submitted = _Workers(), []
    puller = LocalPuller(receiver, lambda count, piece: (), workers)
    sender.publish(11, (PageHandoff((3, 4, 5), sender=("prefill", 1)),), hold_timeout_s=30)
    puller.pull(sender.address, 11, 3, 5.0, done=lambda result, error: submitted.append((result, error)))
    assert submitted == [(PageHandoff((3, 4, 5), sender=("prefill", 1)), None)] and workers.jobs == []
    puller.pull(sender.address, 12, 3, 5.0, done=lambda result, error: submitted.append((result, error)))
    assert len(workers.jobs) == 1 and len(submitted) == 1  # not published yet: a blocking pull, on a worker
    sender.close()
    receiver.close()


class _Workers:
    """An executor that keeps what it is given (the test only asks whether a pull went to it)."""

    def __init__(self):
        self.jobs = []

    def submit(self, fn, *args):
        self.jobs.append((fn, args))
