"""PoolLease: readers of the pool between the model thread's jobs, never during one, and neither side starves."""

from __future__ import annotations

import threading
import time

from fsm_pd.kvpool.lease import PoolLease
from fsm_pd.model.model_thread import ModelThread

WAIT_S = 5.0


def until(predicate, timeout_s: float = WAIT_S) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


def test_a_job_waits_for_the_reader_in_progress():
    model = ModelThread(pool=None)
    try:
        events: list[str] = []
        turn = model.lease.turn()
        with model.lease.read(turn):
            job = model.submit(lambda owner: events.append("job"))
            assert until(model.lease.contended), "the model thread never asked for the pool"
            assert not job.done()  # it waits at the lease, as the reader has not let go
            events.append("reader done")
        job.result(WAIT_S)
        assert events == ["reader done", "job"]
    finally:
        model.close()


def test_a_reader_waits_while_a_job_runs():
    model = ModelThread(pool=None)
    try:
        running, finish, order = threading.Event(), threading.Event(), []

        def job(owner):
            running.set()
            finish.wait(WAIT_S)
            order.append("job")

        model.submit(job)
        assert running.wait(WAIT_S)
        turn = model.lease.turn()

        def read():
            with model.lease.read(turn):
                order.append("reader")

        reader = threading.Thread(target=read)
        reader.start()
        assert until(lambda: turn.waited), "the reader never waited for the pool"
        assert order == []  # it waits, as the job runs on
        finish.set()
        reader.join(WAIT_S)
        assert order == ["job", "reader"] and turn.waited
    finally:
        model.close()


def test_a_waiting_reader_gets_a_turn_between_back_to_back_jobs():
    lease = PoolLease()
    turn = lease.turn()
    read = threading.Event()
    jobs_before_read: list[int] = []
    jobs = 0

    def reader():
        with lease.read(turn):
            jobs_before_read.append(jobs)
            read.set()

    with lease.job():
        thread = threading.Thread(target=reader)
        thread.start()
        assert until(lambda: turn.waited), "the reader never waited on the job"
        jobs += 1
    for _ in range(20):  # the model thread keeps going at once: the reader must still come first
        with lease.job():
            jobs += 1
    thread.join(WAIT_S)
    assert read.is_set() and jobs_before_read == [1]


def test_a_reader_that_had_its_turn_waits_for_a_job_that_wants_the_pool():
    lease = PoolLease()
    first, second = lease.turn(), lease.turn()
    order: list[str] = []
    reading, done_reading = threading.Event(), threading.Event()
    with lease.read(first):
        pass  # first's turn in this gap between jobs

    def hold_second() -> None:
        with lease.read(second):
            reading.set()
            done_reading.wait(WAIT_S)

    def job() -> None:
        with lease.job():
            order.append("job")

    def first_again() -> None:
        with lease.read(first):
            order.append("first again")

    threads = [threading.Thread(target=hold_second)]
    threads[0].start()
    assert reading.wait(WAIT_S)
    threads.append(threading.Thread(target=job))
    threads[1].start()
    while not lease.contended():  # the job waits for the second reader
        threading.Event().wait(0.001)
    threads.append(threading.Thread(target=first_again))
    threads[2].start()
    assert until(lambda: first.waited), "first never waited"  # it already read in this gap: the job goes first
    assert order == []
    done_reading.set()
    for thread in threads:
        thread.join(WAIT_S)
    assert order == ["job", "first again"]
