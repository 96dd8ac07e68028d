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
