"""``PeerWatch`` on the simulation: rooms bound to a peer process that died or was replaced fail within the heartbeat
bound, with a reason that says which, and the next request finds the new process."""

from __future__ import annotations

from fsm_pd.sim import SimConfig, World
from fsm_pd.sim.invariants import leaks, ownership_violations
from fsm_pd.store import read_journal, replay


def world_with_a_slow_gather(tmp_path) -> World:
    """One request whose gather takes 30 s: D waits in WaitingForInput, P in Transferring, both bound to the other."""
    world = World(SimConfig(requests=0, seed=4, num_pages=64), tmp_path, durability="off")
    world.add_request(1, 40, at=0.001)
    # slow only from the prefill on: admission runs model jobs too (the engines' own), and 30 s there would let the
    # bootstrap deadline fail the room before either side is bound
    assert world.run_until(lambda: world.prefill.live_rooms().get(1) is not None
                           and world.prefill.live_rooms()[1].state == "WaitingForInput")
    world.model_delay = 30.0
    assert world.run_until(lambda: world.prefill.instance.peers.bound() and world.decode.instance.peers.bound())
    return world


def failure(world: World, role: str, room: int) -> tuple[str, float]:
    """(reason, time) of the room's move to Failed in ``role``'s journal."""
    (row,) = [r for r in read_journal(world.journal_dir / f"{role}.db") if r.room == room and r.dst == "Failed"
              and r.src != "Failed"]
    return row.payload["reason"], row.at


def test_a_dead_prefill_fails_the_decode_rooms_bound_to_it_within_three_heartbeats(tmp_path):
    world = world_with_a_slow_gather(tmp_path)
    (bound_room,) = world.decode.instance.peers.bound()
    died = world.clock.now()
    world.crash("prefill")  # and it stays dead
    world.run(until=died + 10)
    reason, at = failure(world, "decode", bound_room)
    assert reason == (f"peer failed: prefill node at {world.prefill_addr} missed 2 heartbeats 1 s apart: it died, "
                      "hangs or is cut off")
    assert at - died <= 3.0 + 0.01, "two missed heartbeats, one second apart, after at most one more interval"
    assert world.decode.instance.peers.bound() == {}
    assert world.decode.instance.resolver.resolver._cache == {}, "the dead node's lookup was dropped"
    world.close()


def test_a_dead_decode_fails_the_prefill_rooms_bound_to_it_and_frees_their_staging(tmp_path):
    world = world_with_a_slow_gather(tmp_path)
    world.model_delay = 0.0005
    assert world.run_until(lambda: world.ledger.holdings("staging"))  # the gather is done, the staging buffer published
    died = world.clock.now()
    world.crash("decode")
    world.run(until=died + 10)
    reason, at = failure(world, "prefill", 1)
    assert reason.startswith(f"peer failed: decode node at {world.decode_addr} missed 2 heartbeats")
    assert at - died <= 3.01 < world.config.prefill_deadlines["pull_hold"], "before its own deadline would"
    assert world.ledger.holdings("staging") == [] and leaks(world) == [] and ownership_violations(world) == []
    world.close()


def test_a_prefill_replaced_at_the_same_address_fails_rooms_of_the_old_instance_at_once(tmp_path):
    world = world_with_a_slow_gather(tmp_path)
    old = world.prefill.instance.channel.instance_id
    died = world.clock.now()
    world.crash("prefill", restart_after=0.0)  # the new process answers the next heartbeat, as a new instance
    world.model_delay = 0.0005
    world.run(until=died + 1.5)
    new = world.prefill.instance
    reason, at = failure(world, "decode", 1)
    assert reason == (f"peer failed: prefill node at {world.prefill_addr} restarted: instance {old} was replaced by "
                      f"{new.channel.instance_id}")
    assert at - died <= 1.01, "the first pong from the new instance tells"

    world.add_request(2, 40, at=world.clock.now() + 0.001)  # the next request goes to the new instance
    world.run()
    assert world.decode.instance.node.rooms[2].state == "Success"
    assert new.node.rooms[2].state == "Success"
    world.close()


def test_a_lookup_that_names_a_replaced_instance_binds_the_room_to_the_instance_there_now(tmp_path):
    """The resolver's cache still names the old instance after the monitor saw the new one (a lookup that raced the
    restart). The room's messages reach the new process, which its request reached too: it is bound to that one, so
    the new one's death or replacement fails it."""
    world = world_with_a_slow_gather(tmp_path)
    resolver = world.decode.instance.resolver.resolver
    stale = dict(next(iter(resolver._cache.values())))
    world.crash("prefill", restart_after=0.0)
    world.model_delay = 0.0005
    world.run(until=world.clock.now() + 1.5)  # room 1 failed through the replaced instance; the cache was dropped
    new = world.prefill.instance.channel.instance_id
    resolver._cache[(world.bootstrap.url, 0)] = stale
    world.add_request(3, 40, at=world.clock.now() + 0.001)
    assert world.run_until(lambda: 3 in world.decode.instance.peers.bound())
    assert world.decode.instance.peers.bound()[3][:2] == (world.prefill_addr, new) != (world.prefill_addr,
                                                                                        stale["instance"])
    world.run()
    assert world.decode.instance.node.rooms[3].state == "Success"
    world.close()


def test_rooms_that_end_are_unbound_and_a_quiet_world_watches_only_addresses(tmp_path):
    """The binding index does not grow with the request count: every room leaves it when it ends."""
    world = World(SimConfig(requests=0, seed=2, num_pages=64), tmp_path, durability="off")
    for room in range(1, 51):
        world.add_request(room, 20 + room, at=0.001 * room)
    world.run()
    assert sum(r.state == "Success" for r in world.decode.instance.node.rooms.values()) == 50
    for slot in (world.prefill, world.decode):
        assert slot.instance.peers.bound_count() == 0
        assert len(slot.instance.peers.monitor.watched()) == 1  # the one peer address, not one entry per room
    world.close()


def test_the_resolver_asks_afresh_for_a_suspect_node_and_reports_a_moved_registration():
    from fsm_pd.control.resolver import PrefillResolver

    registry = {"side_channel": "tcp://a:1", "instance": "i1", "rank_ip": "a", "rank_port": 1}
    lookups, moved, suspects = [], [], set()

    def lookup(url, **_):
        lookups.append(url)
        return dict(registry)

    class Peers:  # what watch_with uses of a PeerWatch
        class monitor:  # noqa: N801
            suspect = staticmethod(suspects.__contains__)

        @staticmethod
        def moved(addr, old, new):
            moved.append((addr, old, new))

    resolver = PrefillResolver(lookup=lookup)
    resolver.watch_with(Peers)
    ctx = {"bootstrap_addr": "boot:8998"}
    assert resolver(ctx)["prefill_addr"] == "tcp://a:1" and resolver(ctx)["prefill_instance"] == "i1"
    assert len(lookups) == 1, "a trusted node is served from the cache"
    suspects.add("tcp://a:1")  # it missed a heartbeat; meanwhile it restarted elsewhere
    registry.update(side_channel="tcp://b:2", instance="i2")
    assert resolver(ctx)["prefill_addr"] == "tcp://b:2"
    assert len(lookups) == 2 and moved == [("tcp://a:1", "i1", "i2")]
    assert resolver(ctx)["prefill_addr"] == "tcp://b:2" and len(lookups) == 2, "the new one is trusted again"


def test_rooms_that_need_the_same_rank_meanwhile_share_one_lookup():
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from fsm_pd.control.resolver import PrefillResolver

    release, calls = threading.Event(), []

    def slow_lookup(url, **_):  # a bootstrap server that answers late (or is down and retried)
        calls.append(url)
        release.wait(10)
        return {"side_channel": "tcp://a:1", "instance": "i1"}

    resolver = PrefillResolver(lookup=slow_lookup)
    ctx = {"bootstrap_addr": "boot:8998"}
    with ThreadPoolExecutor(8) as pool:
        answers = [pool.submit(resolver, ctx) for _ in range(8)]
        threading.Timer(0.2, release.set).start()
        assert {a.result(timeout=10)["prefill_addr"] for a in answers} == {"tcp://a:1"}
    assert len(calls) == 1, "one lookup for the eight rooms"
    assert resolver(ctx)["prefill_addr"] == "tcp://a:1" and len(calls) == 1


def test_a_cached_lookup_of_a_node_nobody_watches_is_asked_afresh(tmp_path):
    """Every room that waited for a lookup ended before binding, so nothing watches the node it named; that node is
    then replaced. The next request must not bind to the old instance from the cache (found while deriving the
    liveness bound: it failed with 'restarted' 10 s after the restart, long after any heartbeat)."""
    world = World(SimConfig(requests=0, seed=1, num_pages=64), tmp_path, durability="off")
    decode = world.decode
    world.add_request(1, 40, at=0.001)
    assert world.run_until(lambda: 1 in decode.instance.node.rooms)
    world.abort("decode", 1, "client went away")  # while its lookup is under way
    world.run()
    assert decode.instance.resolver.resolver._cache and decode.instance.peers.monitor.watched() == {}
    world.crash("prefill", restart_after=0.0)
    world.run(until=world.clock.now() + 10)
    world.add_request(2, 40, at=world.clock.now() + 0.001)
    world.run()
    assert decode.instance.node.rooms[2].state == "Success" == world.prefill.instance.node.rooms[2].state
    assert world.bootstrap.lookups == 2
    world.close()


def test_a_room_that_failed_before_its_dead_peer_was_found_gets_a_peer_record_and_replay_says_the_peer_died(
        tmp_path):
    """The prefill process is killed while the decode node pulls: the pull breaks off at once and the decode room
    fails on its own, so no room is bound when the heartbeats find the prefill dead. The decode node journals a
    ``peer`` record for that room (``store/roles.py``), and replay reads the prefill side, left in Transferring, as
    a node that died, not a side with no reason."""
    world = world_with_a_slow_gather(tmp_path)
    world.model_delay = 0.0005
    assert world.run_until(lambda: world.decode.live_rooms()[1].state == "Transferring")
    died = world.clock.now()
    world.crash("prefill")  # and it stays dead
    world.add_request(2, 40, at=died + 5)  # an idle world stops: a request still to come keeps the heartbeats going
    world.run(until=died + 10)
    (failed,) = [r for r in read_journal(world.journal_dir / "decode.db")
                 if r.room == 1 and r.role == "decode" and r.dst == "Failed"]
    reason, failed_at = failed.payload["reason"], failed.at
    assert "pull failed" in reason and failed_at - died < 1.0, "the pull broke off before any heartbeat was missed"
    rows = [r for r in read_journal(world.journal_dir / "decode.db") if r.room == 1 and r.role == "peer"]
    assert [(r.trigger, r.dst, r.payload["reason"]) for r in rows] == [
        ("peer_failed", "Failed", f"peer failed: prefill node at {world.prefill_addr} missed 2 heartbeats 1 s apart: "
                                  "it died, hangs or is cut off")]
    assert failed_at < rows[0].at <= died + 3.01
    found = {r.role: r for r in replay([*read_journal(world.journal_dir / "prefill.db"),
                                        *read_journal(world.journal_dir / "decode.db")]).rooms if r.room == 1}
    prefill = found["prefill"]
    assert prefill.final == "Transferring" and prefill.reason is None and prefill.consistent
    assert prefill.alive_until is not None
    assert prefill.why.startswith("its node died: its journal stops after its ")
    assert "the decode node found it dead " in prefill.why and "after its side had ended (peer failed: prefill node" \
        in prefill.why, prefill.why
    assert found["peer"].consistent and found["decode"].consistent
    world.close()
