"""The timer threads (``effects/clock.RealClock``, ``backends/timers.DeadlineScheduler``) are woken only by a timer due
before every pending one: each wake costs the arming thread the interpreter's lock, and a handoff arms several timers
(deadlines of seconds to minutes) that are nearly always cancelled before they are due. Timers still fire in time."""

from __future__ import annotations

import threading
import time

from fsm_pd.effects.clock import RealClock
from fsm_pd.transport.backends.timers import DeadlineScheduler


class CountingCondition(threading.Condition):
    def __init__(self, lock=None):
        super().__init__(lock)
        self.notified = 0

    def notify(self, n: int = 1) -> None:
        self.notified += 1
        super().notify(n)


def test_real_clock_wakes_its_thread_only_for_a_new_earliest_timer(monkeypatch):
    monkeypatch.setattr(threading, "Condition", CountingCondition)  # the clock's own condition counts its wakes
    clock = RealClock()
    counting = clock._cv
    try:
        now = time.time()
        first = clock.call_at(now + 300, lambda: None)
        assert counting.notified == 1  # the heap was empty: the thread waited for nothing
        later = [clock.call_at(now + 300 + i, lambda: None) for i in range(1, 20)]
        assert counting.notified == 1  # each due after the first: the thread wakes in time already
        fired = threading.Event()
        clock.call_at(time.time() + 0.05, fired.set)  # earlier than all: must wake the thread
        assert counting.notified == 2
        assert fired.wait(2), "a timer due before every pending one did not fire"
        for handle in [first, *later]:
            clock.cancel(handle)
    finally:
        clock.close()


def test_real_clock_is_not_woken_for_a_deadline_armed_as_the_one_before_it_is_cancelled(monkeypatch):
    """A room's life: each state's deadline cancelled as the next is armed, the thread free to look in between (it
    drops the cancelled ones). It still sleeps until their time, so a deadline due after it wakes nobody."""
    monkeypatch.setattr(threading, "Condition", CountingCondition)
    clock = RealClock()
    counting = clock._cv
    try:
        now = time.time()
        clock.cancel(clock.call_at(now + 300, lambda: None))
        assert counting.notified == 1
        for i in range(1, 20):  # bootstrap, waiting, transfer...: every one after the first, none pending beside it
            time.sleep(0.005)  # the thread looks, and finds only cancelled timers
            clock.cancel(clock.call_at(now + 300 + i, lambda: None))
        assert counting.notified == 1
        fired = threading.Event()
        clock.call_at(time.time() + 0.05, fired.set)
        assert counting.notified == 2 and fired.wait(2)
    finally:
        clock.close()


def test_deadline_scheduler_is_not_woken_for_a_hold_published_after_the_last_was_released():
    """A handoff's hold: published, then released (its deadline cancelled) before the thread comes to look. The
    next hold, due later, wakes nobody."""
    scheduler = DeadlineScheduler(name="fsm-pd-deadlines[test]")
    scheduler._cond = counting = CountingCondition()
    scheduler.call_later(300, lambda: None).cancel()  # starts the thread
    time.sleep(0.05)
    before = counting.notified
    for i in range(1, 20):
        scheduler.call_later(300 + i, lambda: None).cancel()
        time.sleep(0.005)  # the thread looks, and finds only cancelled deadlines
    assert counting.notified == before
    fired = threading.Event()
    scheduler.call_later(0.05, fired.set)
    assert counting.notified == before + 1 and fired.wait(2)


def test_real_clock_fires_a_later_timer_after_the_earlier_was_cancelled():
    clock = RealClock()
    try:
        early = clock.call_at(time.time() + 0.05, lambda: None)
        fired = threading.Event()
        clock.call_at(time.time() + 0.15, fired.set)
        clock.cancel(early)
        assert fired.wait(2)
    finally:
        clock.close()


def test_deadline_scheduler_wakes_its_thread_only_for_a_new_earliest_deadline():
    scheduler = DeadlineScheduler(name="fsm-pd-deadlines[test]")
    scheduler._cond = counting = CountingCondition()
    first = scheduler.call_later(300, lambda: None)  # starts the thread, which waits on the counting condition
    time.sleep(0.05)
    before = counting.notified
    later = [scheduler.call_later(300 + i, lambda: None) for i in range(1, 20)]
    assert counting.notified == before
    fired = threading.Event()
    scheduler.call_later(0.05, fired.set)
    assert counting.notified == before + 1
    assert fired.wait(2)
    for handle in [first, *later]:
        handle.cancel()


def test_deadline_scheduler_fires_after_a_cancelled_head():
    scheduler = DeadlineScheduler(name="fsm-pd-deadlines[test]")
    head = scheduler.call_later(0.05, lambda: None)
    fired = threading.Event()
    scheduler.call_later(0.15, fired.set)
    head.cancel()
    assert fired.wait(2)


def test_deadline_scheduler_sweeps_the_cancelled_deadlines_it_no_longer_wakes_for():
    """Its thread sleeps past cancelled deadlines, so they are swept out as the heap grows: released holds do not
    stay a hold's timeout each. A live deadline still fires."""
    scheduler = DeadlineScheduler(name="fsm-pd-deadlines[test]")
    for i in range(5000):
        scheduler.call_later(300 + i * 1e-4, lambda: None).cancel()
    fired = threading.Event()
    scheduler.call_later(0.05, fired.set)
    assert len(scheduler._heap) < 2048 and scheduler.pending() == 1
    assert fired.wait(2)
