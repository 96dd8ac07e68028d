"""HoldTable: what a released entry leaves behind is bounded; a failed one is remembered for the puller. PullWaits:
pulls parked until their entry is published, and one delivery per entry (the device and tcp backends share it)."""

from __future__ import annotations

import threading
import time

import pytest

from fsm_pd.transport.backends.holds import HoldTable, PullWaits


def table(**kw) -> HoldTable:
    return HoldTable(lambda uuid, reason, hold: None, **kw)


def test_released_entries_leave_a_bounded_memory():
    holds = table(max_released=8)
    for uuid in range(1, 1001):  # every request's entry ends released
        holds.publish(uuid, 16, 60.0, lambda deadline: b"kv")
        assert holds.end(uuid, "released after the pull", released=True)
    assert holds.remembered() == 8
    assert holds.tombstone(1000) == "released after the pull"  # a duplicate pull right after still fails fast
    assert holds.tombstone(1) is None
    holds.close()


def test_a_failed_entry_is_remembered_and_never_published_again():
    holds = table(max_released=1)
    holds.publish(7, 16, 60.0, lambda deadline: b"kv")
    assert holds.end(7, "failed by producer: aborted")
    for uuid in range(100, 110):  # many releases afterwards do not push the failure out
        holds.publish(uuid, 16, 60.0, lambda deadline: b"kv")
        holds.end(uuid, "released after the pull", released=True)
    assert holds.tombstone(7) == "failed by producer: aborted"
    assert not holds.end(7, "again")
    with pytest.raises(ValueError, match="never reused"):
        holds.publish(7, 16, 60.0, lambda deadline: b"kv")
    holds.close()


class ManualClock:
    """A ``HoldClock`` that moves only when told to: the table must read no other time."""

    def __init__(self):
        self.t, self.timers = 1000.0, []

    def now(self) -> float:
        return self.t

    def call_at(self, when, fn):
        timer = [when, fn]
        self.timers.append(timer)

        class Handle:
            @staticmethod
            def cancel():
                timer[1] = None

        return Handle()

    def advance(self, seconds: float) -> None:
        self.t += seconds
        for timer in [t for t in self.timers if t[0] <= self.t and t[1] is not None]:
            self.timers.remove(timer)
            timer[1]()


def test_expiry_and_tombstone_ttl_follow_the_tables_clock():
    clock, retired = ManualClock(), []
    holds = HoldTable(lambda uuid, reason, hold: retired.append((uuid, reason)), tombstone_ttl_s=30.0, clock=clock)
    hold = holds.publish(5, 16, 2.0, lambda deadline: b"kv")
    assert hold.deadline == 1002.0
    clock.advance(1.9)
    assert holds.get(5) is hold and retired == []
    clock.advance(0.2)  # the hold's deadline on this clock, not on time.monotonic()
    assert holds.get(5) is None and retired == [(5, "hold expired after 2 s without a pull")]
    clock.advance(29.0)
    holds.publish(6, 16, 60.0, lambda deadline: b"kv")
    holds.end(6, "failed by producer: x")  # remembering a new tombstone prunes the ones past their TTL
    assert holds.tombstone(5) is not None
    clock.advance(1.5)  # 30.5 s after 5 ended, 1.5 s after 6 did
    holds.publish(7, 16, 60.0, lambda deadline: b"kv")
    holds.end(7, "failed by producer: y")
    assert holds.tombstone(5) is None and holds.tombstone(6) == "failed by producer: x"
    holds.close()


def test_a_pull_parks_until_its_entry_is_published_then_takes_its_one_delivery():
    changed = threading.Condition()
    waits, box = PullWaits(changed), {}

    def pull() -> None:
        with changed:
            box["got"] = waits.wait(7, time.monotonic() + 30, lambda: box.get("entry"))

    puller = threading.Thread(target=pull)
    puller.start()
    deadline = time.monotonic() + 10
    while waits.parked() != {7}:  # what a backend's parked_pulls says
        assert time.monotonic() < deadline, "the pull never parked"
        time.sleep(0.005)
    with changed:
        box["entry"] = "kv"
        changed.notify_all()  # a publish
    puller.join(10)
    assert box["got"] == "kv" and waits.parked() == frozenset()
    with changed:
        assert not waits.delivered(7)
        waits.deliver(7)
        assert waits.delivered(7)  # a second pull of it fails
        waits.ended(7)
        assert not waits.delivered(7)  # its hold ended: a new publish is a new delivery


def test_a_pull_gives_up_at_its_deadline_or_a_stop_and_an_ended_entry_raises_and_leaves_nothing_parked():
    changed = threading.Condition()
    waits = PullWaits(changed)
    with changed:
        assert waits.wait(1, time.monotonic() + 0.05, lambda: None) is None
        assert waits.wait(2, time.monotonic() + 30, lambda: None, lambda: True) is None

        def ended():
            raise LookupError("transfer 3 failed")

        with pytest.raises(LookupError):
            waits.wait(3, time.monotonic() + 30, ended)
    assert waits.parked() == frozenset()
