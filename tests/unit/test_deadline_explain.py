"""Every deadline names itself: the explanation of each state's timer agrees with the tables, the environment and
the flags; replay names the timer that ended a room; the router's stream wait tells its idle deadline from the
request's."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from fsm_pd.cli.flags import node_parser
from fsm_pd.cli.main import EXIT_OK, main
from fsm_pd.control.config import DEFAULTS, ENV
from fsm_pd.machines import MACHINES
from fsm_pd.machines.deadlines import STATE_DEADLINES, ended_by_deadline, explain_failure
from fsm_pd.router.legs import StreamIdle, until
from fsm_pd.store import write_rows

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
COLUMNS = ("node", "role", "room", "version", "trigger", "src", "dst", "payload", "at")


def test_every_state_deadline_of_the_tables_is_explained_with_its_env_and_flag():
    from_tables = {(role, timer): state for role, machine in MACHINES.items()
                   for timer, state in machine.timer_states.items()}  # entered, and handed over to (admission)
    assert {key: d.state for key, d in STATE_DEADLINES.items()} == from_tables
    for role, machine in MACHINES.items():
        assert set(DEFAULTS[role]) == set(machine.timer_states), role
    for (role, timer), deadline in STATE_DEADLINES.items():
        assert deadline.env == ENV[timer]
        help_text = " ".join(node_parser(role).format_help().split())  # the words, however argparse wraps them
        assert f"{deadline.flag} S seconds a room may wait in {deadline.state} for {deadline.waits_for};" in help_text
        assert f"(default: ${deadline.env}, else {DEFAULTS[role][timer]:g};" in help_text


def test_a_timeout_reason_is_explained_with_its_length_and_a_peers_without():
    own = explain_failure("decode", "waiting timeout", {"waiting": 2.0})
    assert own == ("waiting timeout: the decode node waited 2 s in WaitingForInput for the prefill node's READY (its "
                   "prefill done and the KV published): its waiting deadline (--waiting-timeout / "
                   "$FSM_PD_WAITING_TIMEOUT)")
    peer = explain_failure("prefill", "aborted by peer: transfer timeout", {"pull_hold": 60.0})
    assert peer.endswith("the decode node waited in Transferring for the KV to be pulled, checked and scattered: its "
                         "transfer deadline (--transfer-timeout / $FSM_PD_TRANSFER_TIMEOUT)")
    assert ended_by_deadline(own) and not ended_by_deadline(peer)
    for other in ("local error: node restarted", "aborted by peer: client went away", None):
        assert explain_failure("decode", other, {}) == other


def test_replay_names_the_deadline_that_ended_each_side_of_the_timeout_golden(tmp_path, capsys):
    rows = [json.loads(line) for line in (GOLDEN / "timeout.jsonl").read_text().splitlines()]
    journal = tmp_path / "timeout.db"
    write_rows(journal, ([r[c] for c in COLUMNS] for r in rows))
    assert main(["replay", str(journal), "--format", "json"]) == EXIT_OK
    sides = {r["role"]: r for r in json.loads(capsys.readouterr().out)["rooms"]}
    assert sides["decode"]["deadline"] == {
        "timer": "waiting", "state": "WaitingForInput", "seconds": 5.0, "flag": "--waiting-timeout",
        "env": "FSM_PD_WAITING_TIMEOUT",
        "waits_for": "the prefill node's READY (its prefill done and the KV published)",
        "explained": "the decode node waited 5 s in WaitingForInput for the prefill node's READY (its prefill done "
                     "and the KV published): its waiting deadline (--waiting-timeout / $FSM_PD_WAITING_TIMEOUT)"}
    assert sides["prefill"]["deadline"]["timer"] == "bootstrap" and sides["prefill"]["deadline"]["seconds"] == 5.0
    assert main(["replay", str(journal)]) == EXIT_OK
    table = capsys.readouterr().out
    assert "waiting timeout: the decode node waited 5 s in WaitingForInput" in table
    assert "bootstrap timeout: the prefill node waited 5 s in Bootstrapping for the decode node's PREPARE" in table


@pytest.mark.parametrize("name", ["success", "abort", "prefill_crash"])
def test_a_room_no_timer_ended_has_no_deadline(name, tmp_path, capsys):
    rows = [json.loads(line) for line in (GOLDEN / f"{name}.jsonl").read_text().splitlines()]
    journal = tmp_path / f"{name}.db"
    write_rows(journal, ([r[c] for c in COLUMNS] for r in rows))
    assert main(["replay", str(journal), "--format", "json"]) == EXIT_OK
    assert all(r["deadline"] is None for r in json.loads(capsys.readouterr().out)["rooms"])


async def _stalls_after(first: bytes, stop: asyncio.Event):
    yield first
    await stop.wait()  # a worker that answered and then went silent
    yield b"late"


def test_a_stream_wait_tells_its_idle_deadline_from_the_requests():
    async def scenario(idle_s: float, request_in_s: float) -> tuple[list[bytes], BaseException]:
        stop = asyncio.Event()
        got: list[bytes] = []
        deadline = asyncio.get_running_loop().time() + request_in_s
        try:
            async for item in until(_stalls_after(b"first", stop), deadline, idle_s=idle_s):
                got.append(item)
        except TimeoutError as err:
            return got, err
        finally:
            stop.set()
        raise AssertionError("the stalled stream ended without a timeout")

    got, err = asyncio.run(scenario(idle_s=0.05, request_in_s=30.0))
    assert got == [b"first"] and isinstance(err, StreamIdle) and err.idle_s == 0.05
    got, err = asyncio.run(scenario(idle_s=30.0, request_in_s=0.05))  # the request's deadline comes first
    assert got == [b"first"] and not isinstance(err, StreamIdle)


def test_a_room_that_waits_too_long_for_pages_is_explained_as_such_on_both_sides(tmp_path, capsys):
    """The simulation's production decode node with a pool the prompt never fits: its room, the prefill node's
    address known, waits in the pre-allocation queue until its admission deadline (not its bootstrap deadline),
    tells the prefill node, and replay explains both sides by that wait."""
    from fsm_pd.sim import SimConfig, World

    world = World(SimConfig(requests=0, seed=4, num_pages=8, chunked=0.0), tmp_path, durability="off")
    world.add_request(1, 200, at=0.001)  # 13 pages: more than the whole pool
    world.run()
    world.close()
    assert main(["replay", str(tmp_path / "prefill.db"), str(tmp_path / "decode.db"), "--format", "json"]) == EXIT_OK
    sides = {r["role"]: r for r in json.loads(capsys.readouterr().out)["rooms"]}
    assert sides["decode"]["reason"] == "admission timeout"
    assert sides["decode"]["deadline"]["explained"] == (
        "the decode node waited 20 s in Bootstrapping for free KV pages for the prompt (its place in the "
        "pre-allocation queue, the prefill node's address known): its admission deadline (--admission-timeout / "
        "$FSM_PD_ADMISSION_TIMEOUT)")
    assert sides["prefill"]["reason"] == "aborted by peer: admission timeout"  # told at once, not at its own deadline
    assert explain_failure("prefill", sides["prefill"]["reason"], {}).endswith(
        "the decode node waited in Bootstrapping for free KV pages for the prompt (its place in the pre-allocation "
        "queue, the prefill node's address known): its admission deadline (--admission-timeout / "
        "$FSM_PD_ADMISSION_TIMEOUT)")
