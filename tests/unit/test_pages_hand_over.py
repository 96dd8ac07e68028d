"""A pool two engines share (``--role pd``): each keys its rooms apart (``PageAllocator.view``), and a handoff moves
page ownership (``hand_over``) all at once or not at all. Hypothesis drives reservations, frees, growth and
hand-overs of both roles in any order: a page is never held by two rooms, never lost, and a hand-over of pages the
sender no longer holds (its room freed them first) is refused and changes nothing."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from fsm_pd.kvpool.pages import OutOfPages, PageAllocator, PageOwnershipError


def accounted(allocator: PageAllocator, cached: list[int] = ()) -> None:
    """Every usable page is free, held by exactly one room or ``cached`` (adopted by a prefix cache), once; and the
    index that answers who holds a page (``_owner``, what ``holder`` and ``hand_over`` ask) names that room for every
    held page, and no other page."""
    held = [page for pages in allocator._held.values() for page in pages]
    everything = held + list(allocator._free) + list(cached)
    assert sorted(everything) == list(range(1, allocator.num_pages)), "a page held twice, or lost"
    assert allocator._owner == {page: room for room, pages in allocator._held.items() for page in pages}


def test_views_key_each_roles_rooms_apart():
    shared = PageAllocator(16)
    prefill, decode = shared.view("prefill"), shared.view("decode")
    p, d = prefill.reserve(7, 3), decode.reserve(7, 2)
    assert not set(p) & set(d)
    assert prefill.holders() == {7: 3} and decode.holders() == {7: 2}
    assert prefill.free(7) == 3 and decode.pages_of(7) == d
    assert shared.free_pages == 15 - 2 and decode.free_pages == shared.free_pages
    with pytest.raises(ValueError, match="already freed"):
        prefill.reserve(7, 1)  # the prefill room is closed; the decode room of the same id lives on
    accounted(shared)


def test_a_hand_over_moves_ownership_and_frees_what_it_replaces():
    shared = PageAllocator(16)
    prefill, decode = shared.view("prefill"), shared.view("decode")
    sent, reserved = prefill.reserve(3, 4), decode.reserve(3, 4)
    free_before = shared.free_pages
    assert shared.hand_over(sent, reserved, sender=shared.holder(sent)) == (("prefill", 3), ("decode", 3))
    assert decode.pages_of(3) == sent and prefill.pages_of(3) == []
    assert shared.free_pages == free_before + 4  # D's own reservation went back
    assert prefill.free(3) == 0  # the sender's room holds nothing more: its end frees nothing of D's
    assert decode.free(3) == 4
    accounted(shared)


def test_a_hand_over_of_pages_the_sender_freed_is_refused_and_changes_nothing():
    shared = PageAllocator(16)
    prefill, decode = shared.view("prefill"), shared.view("decode")
    sent, reserved = prefill.reserve(3, 2), decode.reserve(3, 2)
    source = shared.holder(sent)
    prefill.free(3)  # the sender's room failed first
    with pytest.raises(PageOwnershipError, match="freed or reused"):
        shared.hand_over(sent, reserved, sender=source)
    assert decode.pages_of(3) == reserved
    with pytest.raises(PageOwnershipError):
        shared.hand_over(reserved, [0], sender=shared.holder(reserved))  # nobody holds page 0
    accounted(shared)


def test_a_hand_over_of_pages_another_room_reserved_again_is_refused():
    shared = PageAllocator(5)  # four usable pages: a freed page is the next one reserved
    prefill, decode = shared.view("prefill"), shared.view("decode")
    sent, reserved = prefill.reserve(3, 2), decode.reserve(3, 2)
    source = shared.holder(sent)
    prefill.free(3)
    again = prefill.reserve(4, 2)  # another prompt's room holds the very pages now, with its own KV in them
    assert sorted(again) == sorted(sent)
    with pytest.raises(PageOwnershipError, match="reused meanwhile"):
        shared.hand_over(sent, reserved, sender=source)
    assert prefill.pages_of(4) == again and decode.pages_of(3) == reserved
    accounted(shared)


class SharedPool(RuleBasedStateMachine):
    """Two roles over one allocator, as ``--role pd`` runs them, in any interleaving."""

    def __init__(self):
        super().__init__()
        self.shared = PageAllocator(6)  # small: freed pages come back soon, to other rooms
        self.views = {"prefill": self.shared.view("prefill"), "decode": self.shared.view("decode")}
        self.sent: dict[int, list[int]] = {}  # room -> the page list P published (what D's pull will carry)
        self.cached: list[int] = []  # pages a prefix cache adopted from rooms (``adopt``), until it releases them

    @rule(role=st.sampled_from(["prefill", "decode"]), room=st.integers(0, 5), count=st.integers(1, 3))
    def reserve(self, role, room, count):
        try:
            pages = self.views[role].reserve(room, count)
        except (OutOfPages, ValueError):
            return
        if role == "prefill":
            self.sent[room] = (pages, self.shared.holder(pages))  # what P's gather publishes

    @rule(role=st.sampled_from(["prefill", "decode"]), room=st.integers(0, 5))
    def free(self, role, room):
        self.views[role].free(room)

    @rule(room=st.integers(0, 5), count=st.integers(1, 3))
    def grow(self, room, count):
        with contextlib.suppress(OutOfPages, ValueError):
            self.views["decode"].extend(room, count)

    @rule(room=st.integers(0, 5))
    def adopt(self, room):
        """D's scatter of a room whose page list P published: all or nothing."""
        published, reserved = self.sent.get(room), self.views["decode"].pages_of(room)
        if not published or not reserved:
            return
        pages, source = published
        before = self.shared.holders()
        try:
            moved_from, _ = self.shared.hand_over(pages, reserved[:len(pages)], sender=source)
        except PageOwnershipError:
            assert self.shared.holders() == before  # nothing moved
            return
        assert moved_from == ("prefill", room), "adopted from the room that published them, and no other"
        assert set(pages) <= set(self.views["decode"].pages_of(room))
        del self.sent[room]

    @rule(role=st.sampled_from(["prefill", "decode"]), room=st.integers(0, 5))
    def cache_takes(self, role, room):
        """A prefix cache adopts a room's first page (it leaves the room, and comes back only by ``release``)."""
        pages = self.views[role].pages_of(room)[:1]
        self.views[role].adopt(room, pages)
        self.cached += pages

    @rule()
    def cache_releases(self):
        self.shared.release(self.cached)
        self.cached = []

    @invariant()
    def every_page_once(self):
        accounted(self.shared, self.cached)


TestSharedPool = SharedPool.TestCase
TestSharedPool.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
