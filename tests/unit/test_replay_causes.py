"""Replay says what one side's journal cannot say of itself (``fsm_pd/store/causes.py``): that its node died, that the
router (not the client) closed its request, and how much of its time was the prefill's compute or a dead peer's
silence rather than the transfer. The journals are written by the production node core (``NodeCore`` over the
tables and a ``Journal``) on a virtual clock; a restart is the node's own ``recover``."""

from __future__ import annotations

import json

import pytest

from fsm_pd.cli.main import EXIT_OK, main
from fsm_pd.control.core import NodeCore
from fsm_pd.effects import Node, RecordingInterpreter, VirtualClock
from fsm_pd.machines import RECEIVER, SENDER
from fsm_pd.store import Journal, read_journal, replay
from fsm_pd.store.causes import PEER_DOWN, PREFILL_COMPUTE, REQUEST_CLOSED, RETRY_ABORT

LAYOUT = {"num_layers": 1, "num_pages": 8, "page_size": 2, "kv_heads": 1, "head_dim": 4}
DEADLINES = {"prefill": {"bootstrap": 5.0, "waiting": 5.0, "pull_hold": 5.0},
             "decode": {"bootstrap": 5.0, "admission": 5.0, "waiting": 5.0, "transfer": 5.0}}
HEARTBEATS = "prefill node at 127.0.0.1:1 missed 2 heartbeats 0.5 s apart: it died, hangs or is cut off"


class Nodes:
    """Prefill and decode node cores journaling into ``tmp_path``, on one virtual clock."""

    def __init__(self, tmp_path):
        self.tmp, self.clock, self.cores = tmp_path, VirtualClock(1000.0), {}

    def core(self, name: str) -> NodeCore:
        if name not in self.cores:
            machine = SENDER if name.startswith("prefill") else RECEIVER
            node = Node(name, machine, Journal(self.tmp / f"{name}.db"), RecordingInterpreter(), self.clock,
                        DEADLINES[machine.role])
            self.cores[name] = NodeCore(node, LAYOUT)
        return self.cores[name]

    def at(self, t: float, name: str, room: int, trigger: str, payload: dict | None = None) -> None:
        """At ``t`` seconds: the room's creation (``create``) or an event on it."""
        self.clock.advance_to(1000.0 + t)
        c = self.core(name)
        if trigger == "create" and c.role == "prefill":
            c.add_sender(room, prompt_len=8, rid="req-1")
        elif trigger == "create":
            c.add_receiver(room, page_count=4, prompt_len=8, rid="req-1", bootstrap_addr="127.0.0.1:1")
        else:
            c.submit(room, trigger, payload or {})
        c.node.step()

    def restart(self, t: float, name: str) -> None:
        """The node's process died; a new one on the same journal fails what it finds open (``node restarted``)."""
        self.clock.advance_to(1000.0 + t)
        self.cores.pop(name).node.journal.close()
        self.core(name).node.recover()
        self.core(name).node.step()

    def journals(self) -> list[str]:
        for c in self.cores.values():
            c.node.journal.close()
        return sorted(str(p) for p in self.tmp.glob("*.db"))


def handshake(nodes: Nodes, room: int, prefill: str = "prefill-0", decode: str = "decode-0") -> None:
    nodes.at(0.0, decode, room, "create")
    nodes.at(0.0, prefill, room, "create")
    nodes.at(0.01, decode, room, "pages_reserved", {"pages": [1, 2, 3, 4]})
    nodes.at(0.01, decode, room, "bootstrap_resolved", {"peer": prefill})  # PREPARE goes out
    nodes.at(0.02, prefill, room, "metadata_received", {"peer_layout": LAYOUT, "peer": decode})


def chunked_start(nodes: Nodes, room: int) -> None:
    """A prompt of two chunks: READY after the first, so both sides enter Transferring while the second computes."""
    handshake(nodes, room)
    nodes.at(0.05, "prefill-0", room, "kv_ready", {"pages": [1, 2, 3, 4], "piece_pages": 2, "final_pages": 2})
    nodes.at(0.06, "prefill-0", room, "published", {"uuid": 1, "chunks": 2, "chunk_pages": 2})
    nodes.at(0.07, "decode-0", room, "kv_published", {"peer_layout": LAYOUT, "uuid": 1})


def sides(journals: list[str], room: int) -> dict:
    result = replay([row for j in journals for row in read_journal(j)])
    return {r.role: r for r in result.rooms if r.room == room}


def test_a_killed_prefill_node_s_side_says_it_died_and_the_decode_side_s_wait_is_compute_and_a_dead_peer(tmp_path):
    nodes = Nodes(tmp_path)
    chunked_start(nodes, 21)
    nodes.at(1.25, "prefill-0", 21, "kv_chunk", {"final_pages": 3})  # computing on when its process is killed
    nodes.at(2.75, "decode-0", 21, "peer_failed", {"reason": HEARTBEATS})
    found = sides(nodes.journals(), 21)
    prefill, decode = found["prefill"], found["decode"]

    assert prefill.final == "Transferring" and prefill.reason is None  # its journal just stops
    assert prefill.why == (f"its node died: its journal stops after its kv_chunk, 1.25s into this side; the decode "
                           f"node found it dead (peer failed: {HEARTBEATS})")
    # 1.2 s of its Transferring was computing the second chunk, not sending
    assert prefill.phases == pytest.approx({"Bootstrapping": 0.02, "WaitingForInput": 0.03, "compute": 1.2})
    # the decode side's 2.68 s in Transferring: the prefill computing until it died, then a dead peer, no transfer
    assert decode.time_in_state["Transferring"] == pytest.approx(2.68)
    assert decode.phases == pytest.approx({"Bootstrapping": 0.01, "WaitingForInput": 0.06, PREFILL_COMPUTE: 1.18,
                                           PEER_DOWN: 1.5})


def test_the_chunked_handoff_s_transfer_is_only_what_follows_the_last_chunk(tmp_path):
    nodes = Nodes(tmp_path)
    chunked_start(nodes, 22)
    nodes.at(1.25, "prefill-0", 22, "kv_chunk", {"final_pages": 4, "last": True})
    nodes.at(1.28, "decode-0", 22, "pulled", {"chunks": [64, 64]})
    nodes.at(1.30, "decode-0", 22, "scattered", {})
    nodes.at(1.31, "prefill-0", 22, "pull_done", {"peer": "decode-0"})
    found = sides(nodes.journals(), 22)
    assert found["decode"].phases == pytest.approx({"Bootstrapping": 0.01, "WaitingForInput": 0.06,
                                                    PREFILL_COMPUTE: 1.18, "Transferring": 0.05})
    assert found["prefill"].phases == pytest.approx({"Bootstrapping": 0.02, "WaitingForInput": 0.03, "compute": 1.2,
                                                     "Transferring": 0.06})
    assert found["decode"].cause is None and found["prefill"].cause is None
    # a chunk before the last is journaled as the model thread queued it on the device, not as computed (issue 51:
    # a timeline read "pages final" for 128 pages 0.22 s into a 101 s prefill); the last one samples, so it was
    details = {e["trigger"]: e["detail"] for e in found["prefill"].events if e["trigger"] in ("kv_ready", "kv_chunk")}
    assert details == {"kv_ready": "first chunk queued on the device: 2 of 4 pages final once it has run, sent in "
                                   "pieces of 2",
                       "kv_chunk": "last chunk computed: all 4 pages final, trailer with the first token"}


def test_a_chunk_before_the_last_is_not_read_as_computed(tmp_path):
    nodes = Nodes(tmp_path)
    chunked_start(nodes, 24)
    nodes.at(0.06, "prefill-0", 24, "kv_chunk", {"final_pages": 3})
    (chunk,) = [e for e in sides(nodes.journals(), 24)["prefill"].events if e["trigger"] == "kv_chunk"]
    assert chunk["detail"] == "chunk queued on the device: 3 pages final once it has run"


def test_a_room_whole_in_one_piece_has_its_states_alone(tmp_path):
    nodes = Nodes(tmp_path)
    handshake(nodes, 23)
    nodes.at(0.5, "prefill-0", 23, "kv_ready", {"pages": [1, 2, 3, 4]})
    found = sides(nodes.journals(), 23)
    assert found["prefill"].phases is None and found["decode"].phases is None


def test_a_leg_the_router_closed_after_its_prefill_node_died_and_retried_is_not_the_client_s(tmp_path, capsys):
    nodes = Nodes(tmp_path)
    handshake(nodes, 31)  # the prefill node is killed after its metadata_received, at 0.02
    nodes.at(0.1, "decode-0", 31, "abort", {"reason": REQUEST_CLOSED})  # the router closed the decode leg
    nodes.at(0.3, "decode-0", 32, "create")  # and retried on another prefill node
    nodes.at(0.3, "prefill-1", 32, "create")
    nodes.restart(2.4, "prefill-0")
    journals = nodes.journals()
    found = sides(journals, 31)
    assert found["prefill"].why == ("local error: node restarted (its node died: its journal stops after its "
                                    "metadata_received, 20.0ms into this side, and the node failed the room when it "
                                    "restarted)")
    assert found["prefill"].phases == pytest.approx({"Bootstrapping": 0.02, "node down": 2.38})
    assert found["decode"].why == (f"{REQUEST_CLOSED} (closed by the router: the prefill node had died (its journal "
                                   "stops 20.0ms into this side))")

    assert main(["replay", "--request", "req-1", *journals, "--format", "json"]) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    first = doc["attempts"][0]
    # the side to blame is the dead prefill node, not the decode leg the router closed afterwards
    assert first["failed_first"]["role"] == "prefill" and first["outcome"] == "Failed"
    assert doc["story"][0].startswith("attempt 1 (room 31 on decode decode-0, prefill prefill-0) failed after 2.40s: "
                                      "prefill prefill-0 died: local error: node restarted (its node died")
    decode = next(s for s in first["sides"] if s["role"] == "decode")
    assert decode["cause"] == ("closed by the router: the prefill node had died (its journal stops 20.0ms into this "
                               "side); the router retried the request: attempt 2, room 32")


def test_the_router_s_abort_before_a_retry_is_no_failure_of_its_own(tmp_path, capsys):
    nodes = Nodes(tmp_path)
    handshake(nodes, 41)
    nodes.at(0.5, "prefill-0", 41, "error", {"blame": "local", "reason": "prefill failed: out of pages"})
    nodes.at(0.6, "decode-0", 41, "abort", {"reason": RETRY_ABORT})  # the router's wind-down before its retry
    nodes.at(0.7, "decode-0", 42, "create")
    nodes.at(0.7, "prefill-0", 42, "create")
    assert main(["replay", "--request", "req-1", *nodes.journals(), "--format", "json"]) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    # the prefill side's failure came first and caused the router's wind-down of the decode leg
    assert doc["story"][0].startswith("attempt 1 (room 41 on decode decode-0, prefill prefill-0) failed after "
                                      "600.0ms: prefill prefill-0 ended it on error: local error: prefill failed")
    decode = next(s for s in doc["attempts"][0]["sides"] if s["role"] == "decode")
    assert decode["reason"] == RETRY_ABORT and decode["cause"] is None


def test_a_client_that_left_is_still_the_client(tmp_path):
    nodes = Nodes(tmp_path)
    handshake(nodes, 51)
    nodes.at(0.2, "decode-0", 51, "abort", {"reason": REQUEST_CLOSED})  # nothing failed before: no one to blame
    found = sides(nodes.journals(), 51)
    assert found["decode"].why == REQUEST_CLOSED and found["decode"].cause is None
