"""``NodeLoop``: one thread steps the nodes of ``--role pd``; a handoff's messages are decided where they land.

The first tests drive the loop with members whose steps relay a token between them, the way a READY from P's step
lands in D's inbox and D's PULLED in P's. The idle wake is set to a minute: a relay the loop lost (a message queued
for a member that had already stepped in that pass, and the shared wakeup cleared by another member's step) would
wait that minute and fail the test's few seconds. The last test runs two real ``KVManager``s on one loop and a real
handoff between them (``pool`` backend, in-process messages): every transition of both rooms is decided on that one
thread.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections import deque

import jax.numpy as jnp
import numpy as np
import pytest
from node_sockets import node_sockets
from pool_admission import pool_admission

from fsm_pd.control import KVManager, node_loop
from fsm_pd.control.node_loop import NodeLoop
from fsm_pd.kernels import KVLayout
from fsm_pd.machines import KVPoll
from fsm_pd.store import read_journal, replay
from fsm_pd.transport import generate_secret


class _Inbox:
    def __init__(self, wakeup: threading.Event) -> None:
        self.items, self.wakeup = deque(), wakeup

    @property
    def pending(self) -> bool:
        return bool(self.items)

    def put(self, item) -> None:
        self.items.append(item)
        self.wakeup.set()


class Relay:
    """A member whose step takes each token and hands it, one hop shorter, to its peer, then clears the shared wakeup
    as ``Node.step`` does before it reads its inbox: the hand-over stands for a message from another thread that
    reached the peer, which had already stepped in this pass, just before this member's step cleared the wakeup."""

    def __init__(self, loop: NodeLoop, name: str) -> None:
        self.name, self.node, self.peer = name, _Inbox(loop.wakeup), None
        self.stepped, self.kept_alive, self.stopped = [], 0, False
        self.done = threading.Event()

    def active(self) -> bool:
        return not self.stopped

    def step_once(self) -> None:
        while self.node.items:
            hops = self.node.items.popleft()
            self.stepped.append((hops, threading.current_thread().name))
            if hops:
                self.peer.node.put(hops - 1)
            else:
                self.done.set()
        self.node.wakeup.clear()

    def keep_alive(self) -> None:
        self.kept_alive += 1


@pytest.fixture
def slow_idle(monkeypatch):
    monkeypatch.setattr(node_loop, "IDLE_WAKE_S", 60.0)


def pair(loop: NodeLoop) -> tuple[Relay, Relay]:
    p, d = Relay(loop, "p"), Relay(loop, "d")
    p.peer, d.peer = d, p
    loop.join(p)
    loop.join(d)
    return p, d


@pytest.fixture
def relays():
    """A loop of two relays; both leave it when the test ends."""
    loop = NodeLoop("pd")
    p, d = pair(loop)
    yield loop, p, d
    loop.leave(p)
    loop.leave(d)


@pytest.mark.parametrize("first", ["p", "d"])
def test_a_token_relayed_between_two_members_is_decided_within_one_wake(slow_idle, first, relays):
    loop, p, d = relays
    time.sleep(0.05)  # the thread has taken its first wake and waits again
    (p if first == "p" else d).node.put(9)  # 10 steps, each handing over to the other member
    done = p.done if first == "d" else d.done
    assert done.wait(5), f"the relay stalled: {p.stepped} {d.stepped}"
    assert {name for _, name in p.stepped + d.stepped} == {"fsm-loop[pd]"}


def test_run_pending_decides_what_is_queued_on_the_callers_thread(slow_idle, relays):
    """The model thread of ``--role pd`` calls ``run_pending`` after each engine step: a handoff its step started
    runs to its end there, found without a wakeup."""
    loop, p, d = relays
    time.sleep(0.05)  # the loop's thread has taken its first wake and waits on its (one-minute) idle wake
    p.node.items.append(5)  # queued without a wakeup: only run_pending can find it
    assert loop.run_pending() is True
    assert d.done.is_set()
    assert {name for _, name in p.stepped + d.stepped} == {threading.current_thread().name}


def run_pending_elsewhere(loop: NodeLoop) -> bool:
    """``loop.run_pending()`` on another thread: whether it could step."""
    outcome: list[bool] = []
    other = threading.Thread(target=lambda: outcome.append(loop.run_pending()), name="other")
    other.start()
    other.join(5)
    return outcome == [True]


def test_while_a_thread_holds_the_loop_no_other_steps_and_the_holder_decides_it(relays):
    """``--role pd``'s model thread holds the loop through an engine step: a submit wakes the loop's thread at once,
    which would otherwise take the handoff the step just started and run it beside the model thread. Any other
    thread that would step meanwhile, the loop's own included (it takes the same lock), finds the loop held."""
    loop, p, d = relays
    with loop.held():
        p.node.put(3)  # wakes the loop's thread
        assert not run_pending_elsewhere(loop)
        assert loop.run_pending() is True
    assert d.done.is_set()
    assert {name for _, name in p.stepped + d.stepped} == {threading.current_thread().name}


def test_a_holder_wakes_no_loop_thread_and_what_another_thread_queued_meanwhile_is_not_lost(slow_idle, relays):
    """While a thread holds the loop its wakeup is hushed (``node_loop.Wakeup``): the relay the holder decides wakes
    the loop's thread for nothing (it makes no pass, so no keep-alive), where each submit woke it to wait for the lock.
    A token another thread queues after the holder's last pass is woken for as ``held`` ends, not left to the idle
    wake (a minute here)."""
    loop, p, d = relays
    time.sleep(0.05)  # the thread has taken its first wake and waits on its idle wake
    passes = p.kept_alive
    with loop.held():
        p.node.put(3)
        assert loop.run_pending() is True
    time.sleep(0.2)
    assert d.done.is_set() and p.kept_alive == passes, "the loop's thread was woken for a relay the holder decided"
    d.done = threading.Event()
    with loop.held():
        loop.run_pending()
        other = threading.Thread(target=lambda: p.node.put(1), name="other")
        other.start()
        other.join(5)
    assert d.done.wait(5), "a token queued while the loop was held waited for the idle wake"
    assert d.stepped[-1][1] == "fsm-loop[pd]"


def test_a_stopped_member_is_skipped_and_the_other_goes_on(slow_idle, relays):
    loop, p, d = relays
    p.stopped = True
    d.node.put(0)
    assert d.done.wait(5)
    p.node.put(0)
    d.done = threading.Event()
    d.node.put(0)  # queued after p's token: the pass that takes it would have stepped p first, were p active
    assert d.done.wait(5)
    assert p.stepped == [] and not p.done.is_set()


def test_the_thread_stops_with_the_last_member_and_not_before():
    loop = NodeLoop("pd")
    p, d = pair(loop)
    loop.leave(p)
    assert loop.alive()
    d.node.put(0)
    assert d.done.wait(5)
    loop.leave(d)
    assert not loop.alive()
    assert d.kept_alive >= 1


def test_two_managers_on_one_loop_decide_both_sides_of_a_handoff_on_its_thread(tmp_path):
    """Real managers, real journals, in-process messages (``InProcessSenders``), the ``fake`` data plane."""
    loop, secret = NodeLoop("pd"), generate_secret()
    heard: list[tuple[str, str, str]] = []

    def watch(role):
        return lambda room, decision, at: heard.append((role, decision.dst, threading.current_thread().name))

    common = dict(layout=LAYOUT, secret=secret, backend="fake", loop=loop, in_process=True)
    p = KVManager(role="prefill", node_id="p0", journal=str(tmp_path / "p.db"), pool=_pool(1),
                  observers=[watch("prefill")], **common, **node_sockets(tmp_path, "p"))
    d = KVManager(role="decode", node_id="d0", journal=str(tmp_path / "d.db"), pool=_pool(0),
                  admission=pool_admission(LAYOUT.num_pages), observers=[watch("decode")], **common,
                  **node_sockets(tmp_path, "d"))
    try:
        assert p.node.wakeup is d.node.wakeup is loop.wakeup
        assert [t.name for t in threading.enumerate() if t.name.startswith("fsm-loop")] == ["fsm-loop[pd]"]
        p.add_sender(1, [3, 4])
        d.add_receiver(1, page_count=2, prefill_addr=p.side_channel.address)
        p.kv_ready(1, first_token=7)
        assert d.wait(1, 10) == KVPoll.Success and p.wait(1, 10) == KVPoll.Success
        assert {(role, dst) for role, dst, _ in heard} >= {("prefill", "Success"), ("decode", "Success")}
        assert {name for *_, name in heard} == {"fsm-loop[pd]"}
        p.close()
        assert loop.alive() and d.health() is None  # the other member keeps the loop
    finally:
        d.close()
        if p.active():
            p.close()
    assert not loop.alive()


class Buffering(Relay):
    """A relay whose steps buffer a row each and whose ``commit`` writes what is buffered, as a journal under
    ``commit_per_pass`` does; a commit on the loop's own thread first waits for ``slow`` (a slow disk)."""

    def __init__(self, loop: NodeLoop, name: str) -> None:
        super().__init__(loop, name)
        self.buffered = self.written = 0
        self.slow, self.in_commit = threading.Event(), threading.Event()

    def step_once(self) -> None:
        self.buffered += len(self.node.items)
        super().step_once()

    def commit(self) -> None:
        if threading.current_thread().name.startswith("fsm-loop") and self.buffered:
            self.in_commit.set()
            self.slow.wait(10)
        self.written, self.buffered = self.written + self.buffered, 0


def test_the_loop_thread_commits_outside_the_lock_and_a_holder_first_commits_what_it_buffered(slow_idle):
    """The shared pool's loop: a pass of the loop's own thread (a bootstrap, say) is committed after it lets go of
    the lock, so the model thread's next step does not wait for that commit; and that step, once it holds the loop,
    commits what the pass buffered before anything it does can leave the process."""
    loop = NodeLoop("pd", commit_per_pass=True)
    member = Buffering(loop, "p")
    member.peer = member
    loop.join(member)
    try:
        member.node.put(0)  # a message from another thread: the loop's thread steps it, then commits slowly
        assert member.in_commit.wait(10)
        with loop.held():  # the model thread's step: the lock is free, and the row is written before it goes on
            assert member.written == 1 and member.buffered == 0
        member.slow.set()
        member.slow, member.in_commit = threading.Event(), threading.Event()
        member.node.put(0)
        assert member.in_commit.wait(10)
        assert loop.run_pending()  # nor does a pass of the model thread wait for that commit
        member.slow.set()
    finally:
        member.slow.set()
        loop.leave(member)


def committed(path) -> int:
    """Rows another reader finds in the journal file now."""
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT count(*) FROM transitions").fetchone()[0]
    finally:
        conn.close()


def test_a_loop_that_commits_per_pass_commits_a_whole_handoff_once_per_journal_at_the_end_of_the_step(tmp_path,
                                                                                                     slow_idle):
    """The shared pool's loop (``commit_per_pass``): the bootstrap, decided on the loop's thread, is committed at the
    end of its passes; the handoff that the model thread's step started, decided in its ``run_pending`` inside
    ``held``, is in neither journal's file until ``held`` ends, and then whole, one commit a journal; the replay
    reads both sides to Success. (The ``fake`` data plane pulls on a worker thread: the test holds the loop until
    that pull's event is decided too, as ``pool``'s own pull, taken in the pass, needs not.) The loop's idle wake is
    a minute (``slow_idle``): an idle pass that took the lock just before the step held it commits after letting go,
    and would commit the step's rows early (a loaded machine's suite saw it once: 3 rows in P's file mid-step)."""
    loop, secret = NodeLoop("pd", commit_per_pass=True), generate_secret()
    common = dict(layout=LAYOUT, secret=secret, backend="fake", loop=loop, in_process=True)
    paths = {role: tmp_path / f"{role}.db" for role in ("p", "d")}
    p = KVManager(role="prefill", node_id="p0", journal=str(paths["p"]), pool=_pool(1), **common,
                  **node_sockets(tmp_path, "p"))
    d = KVManager(role="decode", node_id="d0", journal=str(paths["d"]), pool=_pool(0),
                  admission=pool_admission(LAYOUT.num_pages), **common, **node_sockets(tmp_path, "d"))
    try:
        def run_until(state: str) -> None:  # what the fake backend's threads hand back is decided here
            deadline = time.monotonic() + 10
            while not (p.node.states.get(1) == d.node.states.get(1) == state):
                assert time.monotonic() < deadline, (p.node.states, d.node.states)
                loop.run_pending()
                time.sleep(0.001)

        p.add_sender(1, [3, 4])  # the bootstrap, on the loop's own thread: each pass commits at its end
        d.add_receiver(1, page_count=2, prefill_addr=p.side_channel.address)
        deadline = time.monotonic() + 10
        while not (p.node.states.get(1) == d.node.states.get(1) == "WaitingForInput"
                   and p.journal.pending == d.journal.pending == 0):
            assert time.monotonic() < deadline, (p.node.states, d.node.states, p.journal.pending, d.journal.pending)
            time.sleep(0.01)
        with loop.held():  # the loop's thread commits after its pass: a holder waits for a commit under way
            pass
        managers = {"p": p, "d": d}
        before = {role: (committed(path), managers[role].journal.commits) for role, path in paths.items()}
        with loop.held():  # the model thread's step that finished the prompt
            p.kv_ready(1, first_token=7)
            run_until("Success")
            assert {role: committed(path) for role, path in paths.items()} == {r: b[0] for r, b in before.items()}
        for role, m in (("p", p), ("d", d)):
            assert committed(paths[role]) > before[role][0] and m.journal.pending == 0
            assert m.journal.commits == before[role][1] + 1, role
    finally:
        d.close()
        p.close()
    result = replay([*read_journal(paths["p"]), *read_journal(paths["d"])])
    assert result.consistent and {r.final for r in result.rooms} == {"Success"}


LAYOUT = KVLayout(num_layers=1, num_pages=16, page_size=4, kv_heads=1, head_dim=8)


def _pool(seed):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(LAYOUT.layer_shape, dtype=np.float32))
                 for _ in range(LAYOUT.num_layers))


def test_a_loop_whose_members_all_stopped_sleeps_instead_of_spinning(slow_idle, relays):
    """Only a member's step clears the shared wakeup: with every member stopped, a message still queued for one sets
    it, and the thread must not find it set pass after pass (it spun at 100% of a core)."""
    loop, p, d = relays
    passes = []
    real_pass = loop._pass
    loop._pass = lambda *args, **kwargs: (passes.append(1), real_pass(*args, **kwargs))
    p.stopped = d.stopped = True
    p.node.put(0)  # sets the wakeup; no active member steps
    time.sleep(0.3)
    assert len(passes) <= 2, f"{len(passes)} passes in 0.3 s with no member to step"
    d.stopped = False
    d.node.put(0)  # an active member is still woken for
    assert d.done.wait(5)
