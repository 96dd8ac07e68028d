"""The runtime loop of one node and role: decide → journal → execute effects; results come back as events.

``submit`` may be called from any thread (handlers' worker threads, the side-channel listener, the timer thread);
``step`` runs on the node's own loop thread and is the only place rooms change. One step decides every queued event,
commits their journal rows in one transaction, and only then runs their effects: group commit and write-ahead in one.

A row's payload is turned into JSON when its batch is written, not when it is decided: where the loop commits once a
pass (``commit_by_loop``) that moves the encoding out of a ``--role pd`` handoff's way, onto the commit after it (a
64-page ``kv_ready`` took 90 us to encode on the model thread, its caches cold from the forward pass). The text is
the same: an event's payload is never changed once submitted, since it becomes the room's context as it is (replay
rebuilds that context from the journaled JSON, so a payload changed later would already diverge from it).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any

from fsm_pd.machines import INITIAL, Decision, KVPoll, Room, TransferMachine
from fsm_pd.store.journal import Journal, JournalRow
from fsm_pd.store.reader import open_room_rows

Observer = Callable[[Room, Decision, float], None]
log = logging.getLogger(__name__)
_CLEAR = object()  # an inbox entry that forgets a room instead of firing a trigger
_RECORD = object()  # an inbox entry that journals a record row, outside the machine (``record``)


class Node:
    def __init__(self, node_id: str, machine: TransferMachine, journal: Journal | None, interpreter: Any,
                 clock: Any, deadlines: Mapping[str, float], wakeup: threading.Event | None = None,
                 commit_by_loop: bool = False):
        """``wakeup``: set whenever an event is queued; a loop that steps several nodes (``control/node_loop.py``)
        gives them one. ``commit_by_loop``: a step buffers its rows and runs their effects, and the loop commits
        them at the end of its pass (``NodeLoop(commit_per_pass=True)``: only where every effect stays in the
        process); a step that fails a room still commits before its effects, since its client hears of it."""
        missing = set(machine.timer_states) - set(deadlines)
        if missing:
            raise ValueError(f"{machine.role} deadlines missing for timers {sorted(missing)}")
        self.node_id = node_id
        self.role = machine.role
        self.machine = machine
        self.journal = journal
        self.interpreter = interpreter
        self.clock = clock
        self.deadlines = dict(deadlines)
        self.rooms: dict[int, Room] = {}  # the loop's alone; everyone else reads ``states`` and ``reasons``
        # what other threads may see: a state is published here only once it is journaled and its effects started,
        # so nobody acts on a transition that a crash could still take back; a failed room's reason likewise
        self.states: dict[int, str] = {}
        self.reasons: dict[int, str | None] = {}
        self.timers: dict[tuple[int, str], Any] = {}
        self.observers: list[Observer] = []
        self.dropped_unknown_room = 0
        self._inbox: deque[tuple[int, str, dict, float]] = deque()
        self.wakeup = wakeup if wakeup is not None else threading.Event()
        self.commit_by_loop = commit_by_loop

    @property
    def pending(self) -> bool:
        """Whether anything is queued for the next step."""
        return bool(self._inbox)

    def submit(self, room: int, trigger: str, payload: dict | None = None, at: float | None = None) -> None:
        """Queue an event for the next step. Thread-safe."""
        self._inbox.append((room, trigger, payload or {}, self.clock.now() if at is None else at))
        if not self.wakeup.is_set():  # Event.set takes a lock; most submits find the loop already woken
            self.wakeup.set()

    def clear(self, room: int) -> None:
        """Forget a terminal room at the end of the next step; its later events are dropped and counted. Thread-safe:
        like an event, it waits its turn in the inbox, so it never overtakes the room's own events nor races a
        step (rooms change only on the loop)."""
        self._inbox.append((room, _CLEAR, {}, 0.0))
        if not self.wakeup.is_set():
            self.wakeup.set()

    def record(self, role: str, room: int, trigger: str, dst: str, event: dict, reason: str | None = None) -> None:
        """Journal one row that no machine fires, in the next step's group commit: what a node did for a request
        without a transfer (a decode node's own prefill, role ``local``: ``store/replay.py``). Version 0, from the
        initial state to ``dst``. Thread-safe."""
        payload = {"event": event, "effects": [], **({"reason": reason} if reason is not None else {})}
        self._inbox.append((room, _RECORD, (role, trigger, dst, payload), self.clock.now()))
        if not self.wakeup.is_set():
            self.wakeup.set()

    def create(self, room: int, payload: dict | None = None) -> None:
        """Queue the creation of a room; the node's deadlines are recorded in the journaled event."""
        self.submit(room, "create", {"deadlines": self.deadlines, **(payload or {})})

    def step(self) -> int:
        """Decide, journal and execute everything queued so far; returns how many events were processed."""
        if self.wakeup.is_set():  # cleared before the inbox is read: a submit after this wakes the next step
            self.wakeup.clear()
        if not self._inbox:  # most steps of an idle node (the simulation steps both nodes at every settle)
            return 0
        batch: list[tuple[Room, Decision, float]] = []
        rows: list[tuple] = []
        rooms, inbox, node_id, role, fire = self.rooms, self._inbox, self.node_id, self.role, self.machine.fire
        clears: list[int] = []
        while inbox:
            room_id, trigger, payload, at = inbox.popleft()
            if trigger is _CLEAR:  # later events for the room, in this step too, find no room and are dropped
                if self._forget(room_id):
                    clears.append(room_id)
                continue
            if trigger is _RECORD:
                r_role, r_trigger, r_dst, r_payload = payload
                rows.append((node_id, r_role, room_id, 0, r_trigger, INITIAL, r_dst, _encode(r_payload), at))
                continue
            room = rooms.get(room_id)
            if room is None:
                if trigger != "create":
                    self.dropped_unknown_room += 1  # already cleared: nothing left to journal it against
                    continue
                room = rooms[room_id] = Room(room_id)
            decision = fire(room, trigger, payload)
            rows.append((node_id, role, room_id, decision.version, trigger, decision.src, decision.dst,
                         partial(_payload_json, payload, decision), at))
            batch.append((room, decision, at))
        if self.journal is not None and rows:
            self.journal.add_rows(rows)
            if not self.commit_by_loop or any(d.dst == "Failed" != d.src for _, d, _ in batch):
                self.journal.flush()
        run, states, reasons = self.interpreter.run, self.states, self.reasons
        for room, decision, _ in batch:
            if decision.effects:
                run(self, room, decision)
            states[room.room] = decision.dst
            if decision.dst == "Failed":
                reasons[room.room] = room.reason
        # observers (waiters, metrics) hear of a decision once its effects have been started
        for observe in self.observers:
            for room, decision, at in batch:
                observe(room, decision, at)
        for room_id in clears:  # its last decision was published and observed above: now it is gone for all
            states.pop(room_id, None)
            reasons.pop(room_id, None)
        return len(batch)

    def poll(self, room: int) -> KVPoll | None:
        """The room's journaled state; reading it never advances anything. Thread-safe."""
        found = self.states.get(room)
        return None if found is None else KVPoll[found]

    def _forget(self, room: int) -> bool:
        found = self.rooms.get(room)
        if found is not None and not found.terminal:  # a caller's bug: forgetting it would strand its effects
            log.error("%s: clear of room %d ignored: it is %s, not terminal", self.node_id, room, found.state)
            return False
        self.rooms.pop(room, None)
        return True

    def recover(self, reason: str = "node restarted") -> list[int]:
        """Rebuild this node's unfinished rooms from its journal and fail them. Returns their ids.

        Only the open rooms are read (the journal's ``rooms`` table lists them, kept in the same commits as the
        rows), so a restart costs what is open, not the journal's history.
        """
        if self.journal is None:
            return []
        self.journal.flush()
        with self.journal.engine.connect() as conn:
            rows = open_room_rows(conn, self.node_id, self.role)
        return self.restore(rows, reason)

    def restore(self, rows: Iterable[JournalRow], reason: str = "node restarted") -> list[int]:
        """Rebuild rooms from this node's journal ``rows`` (in journal order) and fail the unfinished ones; returns
        their ids. The rebuilt rooms go through the same ``fire`` as live ones, so they resume at the journaled
        version. (Given every row of the journal, this is recovery as it was before the ``rooms`` table: the oracle
        the recovery tests and ``bench/journal_scale.py`` compare ``recover`` against.)"""
        rooms: dict[int, Room] = {}
        for row in rows:
            room = rooms.setdefault(row.room, Room(row.room))
            self.machine.fire(room, row.trigger, row.event)
        # rooms that finished before the restart can never change again: keeping them would grow memory with the
        # journal's whole history (their late events are then dropped and counted, not journaled)
        self.rooms = {room_id: room for room_id, room in rooms.items() if not room.terminal}
        self.states = {room_id: room.state for room_id, room in self.rooms.items()}
        self.reasons = {}
        unfinished = sorted(self.rooms)
        for room_id in unfinished:
            self.submit(room_id, "error", {"blame": "local", "reason": reason})
        return unfinished


# one encoder for the process: json.dumps with non-default options builds a new encoder per call
_encode = json.JSONEncoder(separators=(",", ":")).encode


def _payload_json(payload: dict, decision: Decision) -> str:
    event = _encode(payload) if payload else "{}"
    extra = ""
    if decision.ignored is not None:
        extra = ',"ignored":' + _encode(decision.ignored)
    elif decision.reason is not None:
        extra = ',"reason":' + _encode(decision.reason)
    return '{"event":' + event + ',"effects":' + decision.effects_json + extra + "}"
