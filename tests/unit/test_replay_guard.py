"""ReplayGuard: staleness, nonce replay with bounded memory, and once-only delivery per (sender, instance, room,
type)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fsm_pd.transport.messages import Abort, Heartbeat, Pulled
from fsm_pd.transport.replay_guard import ReplayGuard

NOW = 1_700_000_000.0


ORIGIN = "tcp://127.0.0.1:1"


def pulled(nonce: int, *, room: int = 1, sender: str = "d0", sent_at: float = NOW, instance: str = "i1") -> Pulled:
    return Pulled(room=room, sender=sender, instance=instance, origin=ORIGIN, nonce=nonce, sent_at=sent_at,
                  transfer_id=1)


def test_fresh_messages_pass_once_and_replays_are_caught():
    guard = ReplayGuard()
    msg = pulled(1)
    assert guard.check(msg, NOW) is None
    assert guard.check(msg, NOW + 1) == "replayed"


def test_messages_outside_the_skew_window_are_stale_in_both_directions():
    guard = ReplayGuard(max_skew_s=5)
    assert guard.check(pulled(1, sent_at=NOW - 6), NOW) == "stale"
    assert guard.check(pulled(2, sent_at=NOW + 6), NOW) == "stale"
    assert guard.check(pulled(3, sent_at=NOW - 4.9), NOW) is None


def test_a_replay_after_its_nonce_expired_is_stale_not_delivered():
    guard = ReplayGuard(max_skew_s=5)
    msg = pulled(1)
    assert guard.check(msg, NOW) is None
    assert guard.check(pulled(2, room=2, sent_at=NOW + 10), NOW + 10) is None  # expires nonce 1
    assert guard.remembered_nonces == 1
    assert guard.check(msg, NOW + 10) == "stale"


def test_same_sender_room_and_type_is_delivered_once_even_with_a_fresh_nonce():
    guard = ReplayGuard()
    assert guard.check(pulled(1), NOW) is None
    assert guard.check(pulled(2), NOW) == "duplicate"
    assert guard.check(pulled(3, sender="d1"), NOW) is None  # another sender
    assert guard.check(pulled(4, room=2), NOW) is None  # another room
    abort = Abort(room=1, sender="d0", instance="i1", origin=ORIGIN, nonce=5, sent_at=NOW, reason="x")
    assert guard.check(abort, NOW) is None  # another type
    assert guard.check(pulled(6, instance="i2"), NOW) is None  # a restarted sender is news, not a copy
    assert guard.check(pulled(7, instance="i2"), NOW) == "duplicate"


def test_heartbeats_are_never_deduplicated():
    guard = ReplayGuard()
    for nonce in range(5):
        beat = Heartbeat(room=0, sender="p0", instance="i1", origin=ORIGIN, nonce=nonce, sent_at=NOW, pong=False)
        assert guard.check(beat, NOW) is None


def test_delivered_keys_are_bounded_in_number():
    guard = ReplayGuard(max_delivered=2)
    for room in (1, 2, 3):
        assert guard.check(pulled(room, room=room), NOW) is None
    assert guard.check(pulled(10, room=1), NOW) is None  # evicted: delivered again (tolerated downstream)
    assert guard.check(pulled(11, room=3), NOW) == "duplicate"


def test_delivered_keys_are_forgotten_after_the_skew_window():
    guard = ReplayGuard(max_skew_s=5)
    for room in range(100):  # a steady flow of messages, one per room, over 100 s
        assert guard.check(pulled(room, room=room, sent_at=NOW + room), NOW + room) is None
        assert guard.remembered_deliveries <= 6 and guard.remembered_nonces <= 6
    assert guard.check(pulled(1000, room=99, sent_at=NOW + 99), NOW + 99) == "duplicate"  # within the window
    assert guard.check(pulled(1001, room=90, sent_at=NOW + 99), NOW + 99) is None  # long after: delivered again


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-30, 30), min_size=1, max_size=60), st.integers(1, 8))
def test_a_full_nonce_memory_never_lets_a_replay_through(offsets, capacity):
    # Fill a tiny memory with messages of scattered ages, then replay every one of them: none may be delivered.
    guard = ReplayGuard(max_skew_s=60, max_nonces=capacity)
    accepted = []
    for i, offset in enumerate(offsets):
        msg = pulled(i, room=i, sent_at=NOW + offset)
        if guard.check(msg, NOW) is None:
            accepted.append(msg)
        assert guard.remembered_nonces <= capacity
    assert accepted, "the first message always passes"
    for msg in accepted:
        assert guard.check(msg, NOW + 1) == "replayed"
