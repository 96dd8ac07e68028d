"""HoldTable: what a released entry leaves behind is bounded; a failed one is remembered for the puller."""

from __future__ import annotations

import pytest

from fsm_pd.transport.backends.holds import HoldTable


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
