"""The simulation and the replay command end to end: determinism, no-fault success, explained failures."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys

import pytest

from fsm_pd.report import to_json
from fsm_pd.sim import SimConfig, World, simulate
from fsm_pd.sim.invariants import page_accounting
from fsm_pd.sim.run import schedule_requests, summarize
from fsm_pd.store import read_journal, replay


def replay_json(journal_dir) -> str:
    rows = read_journal(journal_dir / "prefill.db") + read_journal(journal_dir / "decode.db")
    result = replay(rows)
    return to_json(result, result.rooms, ["prefill.db", "decode.db"])


def test_no_faults_means_every_request_succeeds(tmp_path):
    summary = simulate(SimConfig(requests=200, seed=3, fault_rate=0.0), tmp_path)
    assert summary["succeeded"] == summary["requests"] == 200
    assert summary["failed_by_reason"] == {} and summary["prefill_failed_by_reason"] == {}
    assert summary["failed_by_fault"] == {"no injected fault": 0} and summary["failed_without_fault"] == 0
    assert summary["leaks"] == {"staging_buffers_held": 0, "pages_reserved": 0, "transfer_entries_open": 0,
                                "pulled_buffers_held": 0, "violations": []}


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_every_failure_is_grouped_by_reason_and_has_an_injected_fault_behind_it(seed):
    """Issue 51: the reasons carried piece numbers, checksum values and instance ids, so 200 requests could make
    nearly as many keys; and nothing said that the crash of seeds 1 to 5 caused nearly every failure."""
    summary = simulate(SimConfig(requests=200, seed=seed, fault_rate=0.2))
    assert summary["failed"] > 0
    assert len(summary["failed_by_reason"]) <= 20 and len(summary["prefill_failed_by_reason"]) <= 20, summary
    numbered = [r for r in summary["failed_by_reason"] if re.search(r"(piece|layer|transfer|within) \d|0x[0-9a-f]", r)]
    assert numbered == [], summary["failed_by_reason"]
    assert sum(summary["failed_by_reason"].values()) == summary["failed"]
    assert summary["failed_without_fault"] == 0, summary["failed_by_fault"]
    assert sum(summary["failed_by_fault"].values()) == summary["failed"]
    assert all(kind in summary["faults"] for kind in (k.split(" at ")[0] for k in summary["failed_by_fault"])
               if kind != "no injected fault"), summary


def test_a_failure_no_fault_explains_is_counted_as_such():
    world = World(SimConfig(requests=20, seed=3, fault_rate=0.0))
    schedule_requests(world)
    world.run()
    world.close()
    assert summarize(world)["failed"] == 0
    from fsm_pd.sim.attribution import failed_by_fault

    assert failed_by_fault(world, [1, 2]) == {"no injected fault": 2}


def journal_rows(journal_dir) -> list[tuple]:
    """Every row of both journals, every column but the autoincrement key: what "byte-identical" means here."""
    rows = []
    for name in ("prefill.db", "decode.db"):
        conn = sqlite3.connect(journal_dir / name)
        try:
            rows += conn.execute("SELECT node, role, room, version, trigger, src, dst, payload, at FROM transitions "
                                 "ORDER BY seq").fetchall()
        finally:
            conn.close()
    return rows


def test_same_seed_same_history(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    # seed 5 at this rate crashes and restarts both nodes: recovery is part of the history that must repeat
    config = SimConfig(requests=150, seed=5, fault_rate=0.3)
    first = simulate(config, a)
    assert first == simulate(config, b)
    assert first["prefill_crashes"] and first["decode_crashes"]
    assert journal_rows(a) == journal_rows(b) and len(journal_rows(a)) > 500
    assert replay_json(a) == replay_json(b)
    simulate(SimConfig(requests=150, seed=12, fault_rate=0.3), c)
    assert replay_json(a) != replay_json(c)


def test_faults_end_every_room_and_replay_matches_live_state(tmp_path):
    world = World(SimConfig(requests=300, seed=5, fault_rate=0.25), tmp_path)
    from fsm_pd.sim.run import schedule_requests

    schedule_requests(world)
    world.run()
    world.close()
    live = {key: room.state for key, room in world.live_rooms().items()}
    assert all(state in ("Success", "Failed") for state in live.values())
    assert "Failed" in live.values() and "Success" in live.values()
    result = replay(read_journal(tmp_path / "prefill.db") + read_journal(tmp_path / "decode.db"))
    # the rooms' own sides; beside them, a node's records of a peer found dead after a room ended (store/roles.py)
    rooms = {key: final for key, final in result.final_states().items() if key[1] in ("prefill", "decode")}
    assert result.consistent and rooms == live
    assert {key[1] for key in result.final_states()} <= {"prefill", "decode", "peer"}


def run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fsm_pd.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_simulate_then_replay_explains_every_failed_room(tmp_path):
    sim = run_cli("simulate", "--requests", "300", "--seed", "7", "--fault-rate", "0.2", "--journal-dir", "sim",
                  cwd=tmp_path)
    assert sim.returncode == 0, sim.stderr
    summary = json.loads(sim.stdout)
    assert summary["failed"] > 0
    rep = run_cli("replay", "sim/prefill.db", "sim/decode.db", "--failed", "--format", "json", cwd=tmp_path)
    assert rep.returncode == 0, rep.stderr
    rooms = json.loads(rep.stdout)["rooms"]
    failed = [r for r in rooms if r["final"] == "Failed"]
    assert len({r["room"] for r in rooms}) >= summary["failed"]
    for r in failed:
        assert r["reason"] and r["ended_by"] in ("abort", "peer_abort", "peer_failed", "timeout", "error")
        # a room's first row is its create; a record (a peer found dead after the room ended) is its one row
        first = "peer_failed" if r["role"] == "peer" else "create"
        assert r["consistent"] and r["events"][0]["trigger"] == first and r["role"] in ("prefill", "decode", "peer")
    table = run_cli("replay", "sim/prefill.db", "sim/decode.db", "--failed", cwd=tmp_path)
    assert table.returncode == 0 and "every room replays consistently" in table.stdout
    assert "pages moved: sent/prompt pages (" in table.stdout  # the column's legend, under the table
    html = run_cli("replay", "sim/prefill.db", "sim/decode.db", "--failed", "--format", "html", "--out", "t.html",
                   cwd=tmp_path)
    assert html.returncode == 0 and "<html>" in (tmp_path / "t.html").read_text()[:200]

    conn = sqlite3.connect(tmp_path / "sim" / "decode.db")
    room = conn.execute("SELECT room FROM transitions WHERE trigger='scattered' LIMIT 1").fetchone()[0]
    conn.execute("UPDATE transitions SET dst='Failed' WHERE room=? AND trigger='scattered'", (room,))
    conn.commit()
    conn.close()
    broken = run_cli("replay", "sim/prefill.db", "sim/decode.db", "--failed", cwd=tmp_path)
    assert broken.returncode == 3
    assert f"room {room} decode" in broken.stderr


def test_unreadable_journal_exits_2(tmp_path):
    (tmp_path / "x.db").write_text("garbage")
    assert run_cli("replay", "x.db", cwd=tmp_path).returncode == 2
    assert run_cli("replay", "missing.db", cwd=tmp_path).returncode == 2
    bad = run_cli("simulate", "--fault-rate", "2", cwd=tmp_path)
    assert bad.returncode == 2 and "between 0 and 1" in bad.stderr


def test_a_pull_that_lands_after_its_room_ended_is_discarded_exactly_once(tmp_path):
    """The leak found by reading the code (issue 11), kept as a scenario: the client leaves while the pull has every
    byte but has not reported; FreePages runs first, then the pull reports success for a room that has ended."""
    from fsm_pd.sim.invariants import leaks, ownership_violations

    # handed over whole (a chunked handoff's late piece is discarded without an event: nothing to journal)
    world = World(SimConfig(requests=0, seed=1, num_pages=64, chunked=0.0), tmp_path, durability="off")
    world.add_request(1, 100, at=0.001)
    effects = world.decode.instance.effects
    assert world.run_until(lambda: 1 in effects.pending and world.ledger.holdings("pulled"))
    (landed,) = world.ledger.holdings("pulled")
    world.abort("decode", 1, "client went away")
    world.run()
    world.close()
    assert world.decode.instance.node.rooms[1].reason == "client went away"
    assert world.ledger.attempts[("pulled", landed.key)] == 1
    assert world.ledger.freed[("pulled", landed.key)] == "the handler discarding it"
    assert effects.pulled == {} and leaks(world) == [] and ownership_violations(world) == []
    late = [r for r in read_journal(tmp_path / "decode.db") if r.trigger == "pulled"]
    assert [(r.src, r.payload.get("ignored")) for r in late] == [("Failed", "room is already Failed")]


def test_rooms_arriving_while_their_ranks_lookup_is_under_way_join_it(tmp_path):
    """The production resolver's joining (``PrefillResolver.resolve`` behind ``ThreadedResolver``) runs in the
    simulation: rooms that need the rank while its lookup is under way share that lookup and its outcome."""
    world = World(SimConfig(requests=0, seed=2, num_pages=64), tmp_path, durability="off")
    world.plan.fail_next_resolve = 1  # the first lookup fails: every room waiting on it fails with it
    for room in range(1, 5):
        world.add_request(room, 30, at=0.001)
    world.run()
    decode = world.decode.instance.node.rooms
    assert world.bootstrap.lookups == 0, "the failed lookup never reached the registry"
    assert {decode[r].reason for r in range(1, 5)} == {
        "remote error: bootstrap lookup failed: the bootstrap server did not answer"}
    for room in range(5, 9):
        world.add_request(room, 30, at=world.clock.now() + 0.001)
    world.run()
    assert world.bootstrap.lookups == 1, "one lookup for the four rooms, then the cache"
    assert all(decode[r].state == "Success" for r in range(5, 9))
    world.close()


def test_a_reused_room_is_refused_by_both_nodes_live_ended_or_from_before_a_restart(tmp_path):
    """``NodeCore.create`` (and the journal behind it) refuses a room it has used, as the engines answer 409."""
    world = World(SimConfig(requests=0, seed=3, num_pages=64), tmp_path, durability="off")
    world.model_delay = 1.0  # room 1 is still under way when it is sent again
    world.add_request(1, 40, at=0.001)
    world.add_request(1, 40, at=0.01)
    world.run(until=0.5)
    assert sorted(world.refused) == [("decode", 1), ("prefill", 1)]
    world.model_delay = 0.0005
    world.run()
    world.add_request(1, 40, at=world.clock.now() + 0.001)  # ended
    world.run()
    world.crash("prefill", restart_after=0.0)
    world.crash("decode", restart_after=0.0)
    world.run(until=world.clock.now() + 1)
    world.add_request(1, 40, at=world.clock.now() + 0.001)  # only the journal remembers it now
    world.run()
    world.close()
    assert sorted(world.refused) == [("decode", 1)] * 3 + [("prefill", 1)] * 3
    assert world.reuse_accepted == []
    assert world.decode.live_rooms()[1].state == "Success" == world.prefill.live_rooms()[1].state
    creates = [r for r in read_journal(tmp_path / "decode.db") + read_journal(tmp_path / "prefill.db")
               if r.trigger == "create"]
    assert len(creates) == 2, "one create per node, ever"


def test_progressive_instances_publish_before_gathering_and_write_layers_as_they_land(tmp_path):
    """With ``progressive`` (and zmq: no send from the pool) the handlers' overlapped branches run: P publishes
    (and READY goes out) before its layers are final, D's streamed scatter writes each group of layers (two of four)
    as it lands, and its ``Scatter`` only waits. Without it, one gather and one write."""
    for progressive, writes in ((1.0, 2), (0.0, 1)):
        world = World(SimConfig(requests=0, seed=5, num_pages=64, progressive=progressive, sends_pages=0.0,
                                chunked=0.0), tmp_path / str(writes), durability="off")
        kv, final_when_published = world.prefill.instance.effects.kv, []
        original = kv.publish_while_gathering

        def spy(owner, transfer, uuid, pages, hold_s, on_published, original=original, seen=final_when_published):
            def published(rows):
                (_, progress), _ = transfer.lookup(uuid)
                seen.append(progress.final_bytes)
                on_published(rows)

            original(owner, transfer, uuid, pages, hold_s, published)

        kv.publish_while_gathering = spy
        world.add_request(1, 40, at=0.001)
        world.run()
        world.close()
        assert world.decode.instance.node.rooms[1].state == "Success" == world.prefill.instance.node.rooms[1].state
        assert world.ledger.writes == writes
        assert final_when_published == ([0] if progressive else [])  # published before any byte was final


def test_handoffs_between_tensor_parallel_sizes_run_the_multi_piece_handlers(tmp_path):
    """P split over 2 devices, D over 1: every transfer is two pieces, each published, pulled (and failed at
    random) on its own; rooms still end once, nothing is held afterwards, and the journals replay."""
    config = SimConfig(requests=200, seed=2, fault_rate=0.1, prefill_tp=2, decode_tp=1)
    summary = simulate(config, tmp_path)
    assert summary["succeeded"] > 150
    assert summary["leaks"] == {"staging_buffers_held": 0, "pages_reserved": 0, "transfer_entries_open": 0,
                                "pulled_buffers_held": 0, "violations": []}
    rows = read_journal(tmp_path / "prefill.db") + read_journal(tmp_path / "decode.db")
    result = replay(rows)
    assert result.consistent
    details = {e.get("detail") for room in result.rooms for e in room.events if e["trigger"] in ("published", "pulled")}
    assert "2 pieces" in details  # replay's timeline shows what each piece did
    assert any(d and d.startswith("prefill shard 0 -> decode shard 0: ") and "; prefill shard 1 -> decode shard 0: "
               in d for d in details), details
    pulled = [r.payload["event"] for r in rows if r.trigger == "pulled" and "pieces" in r.payload.get("event", {})]
    assert pulled and all([p[:2] for p in e["pieces"]] == [[0, 0], [1, 0]] for e in pulled)
    # either piece can fail the room, and the reason says which (the summary groups the reasons without the numbers)
    failed = " ".join(r.reason for r in result.rooms if r.role == "decode" and r.reason)
    assert "piece 0 (prefill shard 0 -> decode shard 0)" in failed and "piece 1 (prefill shard 1 -> decode shard 0)" \
        in failed, failed
    assert "piece N (prefill shard N -> decode shard N)" in " ".join(summary["failed_by_reason"])


def test_prefix_caches_hit_evict_and_hand_over_only_the_pages_decode_lacks(tmp_path):
    """Prompts share a system prompt and earlier turns: the prefill node's cache hits and, in a pool smaller than
    the work, evicts; the decode node's cache (seed 1 draws it) makes P send only the pages D lacks (PREPARE's
    ``cached_pages``). Every request still succeeds, and every page ends free or cached, unlocked."""
    config = SimConfig(requests=300, seed=1, num_pages=512, prefill_pages=256, max_prompt=300)
    world = World(config, tmp_path)
    schedule_requests(world)
    world.run()
    summary = summarize(world)
    prefill, decode = world.prefill.instance.scheduler, world.decode.instance.scheduler
    world.close()
    assert world.decode_radix_cache and summary["succeeded"] == 300
    assert prefill.cache.hit_tokens > 0 and prefill.cache.evicted_pages > 0
    assert decode.cache.hit_tokens > 0 and decode.cache.locked == prefill.cache.locked == 0
    assert page_accounting(world) == [] and summary["leaks"]["violations"] == []
    rows = read_journal(tmp_path / "decode.db")
    cached = [r.payload["event"]["cached_pages"] for r in rows if r.trigger == "pages_reserved"]
    assert any(cached) and not all(cached)
    prepares = [r for r in read_journal(tmp_path / "prefill.db") if r.trigger == "metadata_received"]
    assert any(r.payload["event"].get("peer_cached_pages") for r in prepares)


def _one_request(config: SimConfig, tmp_path, prompt_len: int = 100) -> World:
    world = World(config, tmp_path, durability="off")
    world.add_request(1, prompt_len, at=0.001)
    return world


def test_p_sends_from_its_pool_under_the_lease_and_a_page_freed_mid_send_is_caught(tmp_path):
    """tcp's path: P publishes the room's pages themselves (``publish_pages``), the pull reads them layer by layer
    under the model thread's lease, and the pages stay the send's until the hold ends. Ending the hold after the
    pages were freed (the release dropped: the hold lingers until it expires) is caught when the pages go back."""
    config = SimConfig(requests=0, seed=1, num_pages=64, progressive=1.0, sends_pages=1.0, chunked=0.0)
    world = _one_request(config, tmp_path / "ok")
    sent = []
    server = world.prefill.instance.transfer
    publish_pages = server.publish_pages
    server.publish_pages = lambda uuid, source, hold_s: (sent.append(source), publish_pages(uuid, source, hold_s))
    world.run()
    world.close()
    assert [type(s).__name__ for s in sent] == ["SimPoolPages"] and sent[0].corrupt is None
    assert world.decode.instance.node.rooms[1].state == "Success" == world.prefill.instance.node.rooms[1].state
    assert world.ledger.violations == [] and world.prefill.instance.scheduler.allocator.busy == {}

    broken = _one_request(config, tmp_path / "broken")
    broken.prefill.instance.transfer.release = lambda uuid: None  # the hold outlives the room's pages
    broken.run()
    broken.close()
    assert any("went back to the free list (room 1's free) while the send from the pool of room 1 had not finished"
               in v for v in broken.ledger.violations), broken.ledger.violations[:3]


def test_a_long_prompt_is_handed_off_chunk_by_chunk_through_the_production_handlers(tmp_path):
    """A prefill in chunks of 64 tokens: READY after the first chunk, each later chunk's pieces published once their
    pages are final, the trailer with the first token last; D pulls piece after piece and scatters each."""
    world = _one_request(SimConfig(requests=0, seed=2, num_pages=64, chunked=1.0), tmp_path, prompt_len=300)
    world.run()
    world.close()
    p, d = world.prefill.instance.node.rooms[1], world.decode.instance.node.rooms[1]
    assert (p.state, d.state) == ("Success", "Success")
    assert p.ctx["piece_pages"] == 4 and len(d.ctx["chunks"]) == 5  # 19 pages in pieces of 4, each pulled
    rows = [r.trigger for r in read_journal(tmp_path / "prefill.db") if r.room == 1]
    assert rows.count("kv_chunk") == 4  # chunks 2..5 (the first is kv_ready)
    assert world.ledger.violations == []


def test_a_stalled_node_answers_no_ping_and_its_peer_fails_the_rooms_bound_to_it(tmp_path):
    """SIGSTOP: the prefill process is stopped for 4 s while a room is bound to it. Its pings go unanswered, so the
    decode node declares it dead after two missed heartbeats and fails the room; when it resumes, its own room ends
    too, within its state's deadline plus the stall, and the outcomes agree (the stall explains them)."""
    from fsm_pd.sim.invariants import leaks, overdue_states
    from fsm_pd.sim.outcomes import outcome_disagreements

    world = _one_request(SimConfig(requests=0, seed=3, num_pages=64, chunked=0.0), tmp_path, prompt_len=40)
    decode = world.decode.instance
    late: list[str] = []
    world.probes.append(lambda: late.extend(overdue_states(world)))
    assert world.run_until(lambda: 1 in decode.node.rooms and decode.node.rooms[1].state == "WaitingForInput")
    stopped_at = world.clock.now()
    world.stall("prefill", 4.0)
    world.run()
    world.close()
    room = decode.node.rooms[1]
    assert room.state == "Failed" and "missed 2 heartbeats" in room.reason, room.reason
    (failed_at,) = [r.at for r in read_journal(tmp_path / "decode.db") if r.room == 1 and r.dst == "Failed" != r.src]
    bound = (world.config.heartbeat_max_failures + 1) * world.config.heartbeat_interval
    assert failed_at - stopped_at <= bound + 0.01
    assert world.prefill.instance.node.rooms[1].terminal
    assert late == [] and leaks(world) == [] and outcome_disagreements(world) == []


def test_the_decode_loop_retracts_the_newest_under_pressure_and_resumes_it(tmp_path):
    """Four requests of 150 tokens on a 64-page decode pool, each decoding up to 400 tokens: the pool cannot grow
    them all, so the production ``pick_retractions`` picks the newest, its pages go back (``give_back``), and it
    resumes once they fit (its KV recomputed: those pages are being written until then). Every request finishes,
    every page comes back, and no page went back while a writer or reader was on it."""
    world = World(SimConfig(requests=0, seed=0, num_pages=64, decode_tokens=400, chunked=0.0, decode_radix_cache=0.0),
                  tmp_path, durability="off")
    for room in range(1, 5):
        world.add_request(room, 150, at=0.001)
    world.run()
    world.close()
    decode = world.decode.instance
    assert decode.scheduler.loop.counters() == {"preempted": 2, "resumed": 2}
    assert {r.state for r in decode.node.rooms.values()} == {"Success"} and decode.scheduler.live() == 0
    assert world.ledger.violations == [] and page_accounting(world) == []


def test_a_seed_range_holds_every_invariant_at_fault_rate_0_2(capsys):
    """``python -m fsm_pd.sim --seeds 1-5 --fault-rate 0.2``: the seeded runner's checks (every invariant, the
    oracles, replay) over a few seeds; docs/simulation.md gives the 200-seed figure."""
    from fsm_pd.sim.sweep import main

    assert main(["--seeds", "1-5", "--fault-rate", "0.2"]) == 0, capsys.readouterr().out
    assert "5 of 5 seeds held every invariant" in capsys.readouterr().out


DEADLINE_SCENARIOS = {
    # (role, state, timer): what keeps the room there until that deadline
    ("decode", "Bootstrapping", "bootstrap"): {"lookup_s": 60.0},  # the bootstrap server never answers
    ("decode", "Bootstrapping", "admission"): {"num_pages": 8},  # the prompt never fits the pool: no pages, no PREPARE
    ("prefill", "Bootstrapping", "bootstrap"): {"lookup_s": 60.0},  # the decode node never finds it: no PREPARE
    ("decode", "WaitingForInput", "waiting"): {"prefill_model_delay": 6.0},  # P's model thread too slow to prefill
    ("prefill", "WaitingForInput", "waiting"): {"prefill_model_delay": 6.0, "decode": {"waiting": 10.0}},
    ("decode", "Transferring", "transfer"): {"slow_pulls_s": 7.0, "prefill": {"pull_hold": 10.0}},  # reports late
    ("prefill", "Transferring", "pull_hold"): {"slow_pulls_s": 7.0, "decode": {"transfer": 10.0}},  # no PULLED
}


@pytest.mark.parametrize(("role", "state", "timer"), sorted(DEADLINE_SCENARIOS))
def test_every_state_ends_at_its_deadline_within_the_slack(tmp_path, monkeypatch, role, state, timer):
    """Each deadline of each role, held until it passes: the room ends in its state by that timer's timeout (the
    decode node's Bootstrapping has two, one after the other: the address, then free pages), and the per-state
    check (``overdue_states``, at every settle point) never saw it overstay (a timer that is not armed fails it:
    docs/simulation.md)."""
    from fsm_pd.sim import bootstrap
    from fsm_pd.sim.invariants import overdue_states

    setup = DEADLINE_SCENARIOS[(role, state, timer)]
    monkeypatch.setattr(bootstrap, "LOOKUP_S", setup.get("lookup_s", bootstrap.LOOKUP_S))
    base = SimConfig()
    config = SimConfig(requests=0, seed=4, num_pages=setup.get("num_pages", 64), chunked=0.0,
                       prefill_deadlines={**base.prefill_deadlines, **setup.get("prefill", {})},
                       decode_deadlines={**base.decode_deadlines, **setup.get("decode", {})})
    world = World(config, tmp_path, durability="off")
    if "prefill_model_delay" in setup:
        world.prefill.instance.model.delay = lambda: setup["prefill_model_delay"]
    world.plan.slow_pulls_s = setup.get("slow_pulls_s", 0.0)
    late: list[str] = []
    world.probes.append(lambda: late.extend(overdue_states(world)))
    world.add_request(1, 200, at=0.001)
    world.run(until=40.0)  # past every deadline of either side
    world.close()
    assert late[:1] == []
    rows = read_journal(tmp_path / f"{role}.db")
    assert [(r.src, r.trigger, r.event.get("timer")) for r in rows if r.dst == "Failed" != r.src] == [
        (state, "timeout", timer)]


def test_prompt_tokens_are_the_draws_randrange_gives():
    """``Conversations`` draws tokens without ``randrange``'s calls; the same draws, so every seed's history."""
    import random

    from fsm_pd.sim.workload import VOCAB, Conversations

    fast, slow = Conversations(random.Random(5), 16), Conversations(random.Random(5), 16)
    assert fast._fresh(5000) == tuple(slow.rng.randrange(VOCAB) for _ in range(5000))
    assert fast.rng.random() == slow.rng.random()


def test_replay_into_a_reader_that_stops_early_ends_quietly(tmp_path):
    """``fsm-pd replay ... | head`` ended in a BrokenPipeError traceback (issue 51): now it ends as a command that
    SIGPIPE ended, silently, with 141."""
    sim = run_cli("simulate", "--requests", "300", "--seed", "7", "--fault-rate", "0.2", "--journal-dir", "sim",
                  cwd=tmp_path)
    assert sim.returncode == 0, sim.stderr
    # 600 lines of table, more than a pipe holds: the writer is still writing when its reader goes
    proc = subprocess.Popen([sys.executable, "-m", "fsm_pd.cli", "replay", "sim/prefill.db", "sim/decode.db"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b"fsm-pd replay of ")  # head -1
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
