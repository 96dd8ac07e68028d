"""The page allocator: page 0 never handed out, one growing reservation per room, frees idempotent and final."""

from __future__ import annotations

import pytest

from fsm_pd.kvpool.pages import OutOfPages, PageAllocator, PageOwnershipError, pages_for


def test_reserve_extend_free():
    pages = PageAllocator(8)
    got = pages.reserve(1, 3)
    assert 0 not in got and len(set(got)) == 3 and pages.free_pages == 4
    got.append(99)  # the caller's copy, not the record
    assert pages.pages_of(1) == got[:3]
    more = pages.extend(1, 2)
    assert pages.pages_of(1) == got[:3] + more and pages.reserved_pages == 5
    with pytest.raises(OutOfPages):
        pages.extend(1, 3)
    assert pages.reserved_pages == 5, "all or nothing"
    assert pages.free(1) == 5 and pages.free(1) == 0 and pages.free_pages == 7
    for grow in (lambda: pages.reserve(1, 1), lambda: pages.extend(1, 1)):
        with pytest.raises(ValueError, match="already freed"):
            grow()


def test_limits_are_clear():
    pages = PageAllocator(4)
    with pytest.raises(ValueError, match="never fit"):
        pages.reserve(1, 4)
    with pytest.raises(ValueError, match="at least one"):
        pages.reserve(1, 0)
    pages.reserve(2, 2)
    with pytest.raises(OutOfPages):
        pages.reserve(3, 2)
    assert pages_for(0, 16) == 0 and pages_for(16, 16) == 1 and pages_for(17, 16) == 2


def test_the_memory_of_freed_rooms_is_bounded():
    pages = PageAllocator(8, remember_closed=3)
    for room in range(1, 101):  # a long life of short requests that were never forgotten explicitly
        pages.reserve(room, 1)
        pages.free(room)
    assert len(pages._closed) == 3
    for room in (98, 99, 100):  # the most recent still refuse a late reservation
        with pytest.raises(ValueError, match="already freed"):
            pages.reserve(room, 1)
    assert pages.reserve(1, 1)  # long gone from memory: refusing reuse is the journal's job


def test_a_hand_over_moves_the_senders_pages_and_frees_what_the_receiver_held():
    pool = PageAllocator(16)
    prefill, decode = pool.view("prefill"), pool.view("decode")
    sent, reserved = prefill.reserve(1, 3), decode.reserve(1, 3)
    sender = pool.holder(sent)
    assert sender == ("prefill", 1)
    assert pool.hand_over(sent, reserved, sender=sender) == (("prefill", 1), ("decode", 1))
    assert decode.pages_of(1) == sent and prefill.pages_of(1) == [] and pool.free_pages == 15 - 3
    assert prefill.free(1) == 0  # nothing of its own left to free: the pages are the decode room's now


def test_a_hand_over_refuses_pages_its_sender_freed_even_once_another_room_holds_them_all():
    """The sender's room ended mid-handoff (its pages freed), and another room reserved them all since, with its own
    KV in them: the hand-over must refuse them (before, it took them from whichever room held them all)."""
    pool = PageAllocator(16)
    prefill, decode = pool.view("prefill"), pool.view("decode")
    sent, reserved = prefill.reserve(1, 3), decode.reserve(1, 3)
    sender = pool.holder(sent)
    prefill.free(1)
    other = prefill.reserve(2, 12)  # every free page: those room 1 freed among them
    assert set(sent) <= set(other)
    with pytest.raises(PageOwnershipError, match=r"are room \('prefill', 2\)'s now: freed and reused meanwhile"):
        pool.hand_over(sent, reserved, sender=sender)
    assert prefill.pages_of(2) == other and decode.pages_of(1) == reserved  # nothing changed
    prefill.free(2)
    with pytest.raises(PageOwnershipError, match="no room holds all of the pages"):
        pool.hand_over(sent, reserved, sender=sender)
