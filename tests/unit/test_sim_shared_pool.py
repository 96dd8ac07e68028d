"""The simulation's shared-pool mode (``--role pd`` on one set of devices): one process, one pool, handoffs that move
page ownership through the production handlers and ``PageAllocator.hand_over``; and what its checks catch."""

from __future__ import annotations

import pytest

from fsm_pd.kvpool.pages import PageAllocator
from fsm_pd.sim import SimConfig, World
from fsm_pd.sim.invariants import leaks, page_accounting
from fsm_pd.store import read_journal


def shared_world(tmp_path, **config) -> World:
    options = dict(requests=0, seed=1, num_pages=64, prefill_pages=24, chunked=0.0, decode_radix_cache=0.0,
                   shared_pool=1.0)
    return World(SimConfig(**{**options, **config}), tmp_path, durability="off")


def room(world: World, role: str, room_id: int):
    return (world.prefill if role == "prefill" else world.decode).instance.node.rooms[room_id]


def landed(world: World, room_id: int):
    """D holds room ``room_id``'s page list (pulled) and has not reported it yet."""
    decode = world.decode.instance
    return lambda: room_id in decode.effects.pending and any(h.room == room_id for h in world.ledger.holdings("pulled"))


def test_the_decode_room_adopts_the_prefill_rooms_pages_and_nothing_is_copied(tmp_path):
    world = shared_world(tmp_path)
    world.add_request(1, 100, at=0.001)
    world.run()
    world.close()
    p, d = room(world, "prefill", 1), room(world, "decode", 1)
    assert (p.state, d.state) == ("Success", "Success")
    rows = {r.trigger: r.payload["event"] for r in read_journal(tmp_path / "decode.db")}
    assert d.ctx["pages"] == p.ctx["pages"] != rows["pages_reserved"]["pages"]  # P's pages; D's own went back
    assert rows["pulled"] == {"bytes": 0}
    assert rows["scattered"] == {"kv_checksum_check": "off", "pages": p.ctx["pages"], "adopted_pages": 7, "bytes": 0}
    assert d.ctx["backend"] == "pool"
    assert world.prefill.instance.scheduler.allocator.shared is world.decode.instance.scheduler.allocator.shared
    assert world.ledger.violations == [] and page_accounting(world) == [] and leaks(world) == []


@pytest.mark.parametrize("told", [True, False])
def test_pages_the_prefill_room_freed_mid_handoff_are_refused(tmp_path, told):
    """P's room ends (its client leaves) once D has the page list, and before D's report of the pull is read (late
    here: the hand-over itself runs the moment it is, on D's loop): P frees the pages. Told by the ABORT, D fails;
    with the ABORT lost, D's hand-over finds the pages no longer P's and refuses them, changing nothing."""
    world = shared_world(tmp_path)
    world.plan.slow_pulls_s = 0.05
    world.add_request(1, 100, at=0.001)
    assert world.run_until(landed(world, 1))
    if not told:
        world.plan.forced_messages.append("drop")
    world.abort("prefill", 1, "client went away")
    world.run()
    world.close()
    reason = room(world, "decode", 1).reason
    assert reason == "aborted by peer: client went away" if told else "freed or reused meanwhile" in reason, reason
    assert world.ledger.violations == [] and page_accounting(world) == [] and leaks(world) == []


def test_pages_freed_mid_handoff_and_reserved_again_by_another_room_are_not_adopted(tmp_path):
    """The bug this mode found: room 1's prefill room ends once D has its page list (the ABORT lost, D's report of
    the pull late), its pages go back, and room 3's prefill reserves them all and computes its KV there. The
    hand-over took the pages from whichever room held them all, so decode room 1 reached Success over room 3's KV
    (``decode room 1 adopted pages [15, 16, 17, 18] from ('prefill', 3), not from prefill room 1``); now the
    handoff names its sender, which no longer holds them, and decode room 1 fails."""
    world = shared_world(tmp_path, num_pages=14, prefill_pages=8)  # 21 usable pages: room 3 waits for room 1's
    world.plan.slow_pulls_s = 0.05
    for room_id, prompt_len in ((1, 100), (2, 130), (3, 100)):
        world.add_request(room_id, prompt_len, at=0.001)
    assert world.run_until(landed(world, 1))
    world.plan.forced_messages.append("drop")
    world.abort("prefill", 1, "client went away")
    world.run()
    world.close()
    assert room(world, "prefill", 3).state == "Success" == room(world, "decode", 3).state
    d = room(world, "decode", 1)
    assert d.state == "Failed" and "are room ('prefill', 3)'s now: freed and reused meanwhile" in d.reason, d.reason
    assert world.ledger.violations == [] and page_accounting(world) == [] and leaks(world) == []


def test_a_crash_of_either_role_is_one_of_the_process_and_it_restarts_whole(tmp_path):
    world = shared_world(tmp_path)
    world.add_request(1, 100, at=0.001)
    assert world.run_until(landed(world, 1))
    first = world.prefill.instance.process
    world.crash("decode", restart_after=1.0)
    assert not world.prefill.alive and not world.decode.alive
    world.run()
    world.add_request(2, 40, at=world.clock.now() + 0.001)
    world.run()
    world.close()
    assert world.prefill.instance.process is world.decode.instance.process is not first
    assert room(world, "decode", 2).state == "Success" == room(world, "prefill", 2).state
    assert world.ledger.violations == [] and page_accounting(world) == [] and leaks(world) == []


def test_the_decode_loop_retracts_and_resumes_requests_whose_pages_it_adopted(tmp_path):
    """Four prompts of 150 tokens decoding up to 400 tokens in a 63-page pool: the newest gives its adopted pages
    back (``give_back``) and resumes later over new ones; every page comes back."""
    world = shared_world(tmp_path, num_pages=40, seed=0, decode_tokens=400)
    for room_id in range(1, 5):
        world.add_request(room_id, 150, at=0.001)
    world.run()
    world.close()
    decode = world.decode.instance
    counts = decode.scheduler.loop.counters()  # how many depends on when each handoff lands: at least one
    assert counts["preempted"] >= 1 and counts["resumed"] == counts["preempted"], counts
    assert {r.state for r in decode.node.rooms.values()} == {"Success"}
    assert world.ledger.violations == [] and page_accounting(world) == [] and leaks(world) == []


def test_the_checks_catch_a_hand_over_that_drops_the_release_of_the_replaced_pages(tmp_path, monkeypatch):
    """The receiver's reserved pages must go back to the free list with the hand-over: without that they leak."""
    real = PageAllocator.hand_over

    def dropped_release(self, pages, replacing, **sender):
        moved = real(self, pages, replacing, **sender)
        with self._lock:
            for page in replacing:
                self._free.remove(page)  # as if it never released them
        return moved

    monkeypatch.setattr(PageAllocator, "hand_over", dropped_release)
    world = shared_world(tmp_path)
    world.add_request(1, 100, at=0.001)
    world.run()
    world.close()
    assert any("its replaced pages [" in v and "are not free" in v for v in world.ledger.violations), \
        world.ledger.violations
    assert any("leaked: neither free, nor a room's, nor cached" in p for p in page_accounting(world))


def test_the_seeded_runner_holds_every_invariant_in_shared_pools(capsys):
    """``python -m fsm_pd.sim --seeds 1-3 --shared-pool``: faults, aborts, timeouts and crashes on one pool."""
    from fsm_pd.sim.sweep import main

    assert main(["--seeds", "1-3", "--fault-rate", "0.2", "--shared-pool", "--requests", "60"]) == 0, \
        capsys.readouterr().out
    out = capsys.readouterr().out
    assert "3 of 3 seeds held every invariant" in out and "shared-pool worlds: 3" in out
    assert "decode adopted the pages" in out
