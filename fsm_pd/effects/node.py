"""The runtime loop of one node and role: decide → journal → execute effects; results come back as events.

``submit`` may be called from any thread (handlers' worker threads, the side-channel listener, the timer thread);
``step`` runs on the node's own loop thread and is the only place rooms change. One step decides every queued event,
commits their journal rows in one transaction, and only then runs their effects: group commit and write-ahead in one.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from fsm_pd.machines import Decision, KVPoll, Room, TransferMachine
from fsm_pd.store.journal import Journal
from fsm_pd.store.reader import open_room_rows, read_journal

Observer = Callable[[Room, Decision, float], None]


class Node:
    def __init__(self, node_id: str, machine: TransferMachine, journal: Journal | None, interpreter: Any,
                 clock: Any, deadlines: Mapping[str, float]):
        missing = set(machine.deadlines.values()) - set(deadlines)
        if missing:
            raise ValueError(f"{machine.role} deadlines missing for timers {sorted(missing)}")
        self.node_id = node_id
        self.role = machine.role
        self.machine = machine
        self.journal = journal
        self.interpreter = interpreter
        self.clock = clock
        self.deadlines = dict(deadlines)
        self.rooms: dict[int, Room] = {}
        # what other threads may see: a state is published here only once it is journaled and its effects started,
        # so nobody acts on a transition that a crash could still take back
        self.states: dict[int, str] = {}
        self.timers: dict[tuple[int, str], Any] = {}
        self.observers: list[Observer] = []
        self.dropped_unknown_room = 0
        self._inbox: deque[tuple[int, str, dict, float]] = deque()
        self.wakeup = threading.Event()

    def submit(self, room: int, trigger: str, payload: dict | None = None, at: float | None = None) -> None:
        """Queue an event for the next step. Thread-safe."""
        self._inbox.append((room, trigger, payload or {}, self.clock.now() if at is None else at))
        if not self.wakeup.is_set():  # Event.set takes a lock; most submits find the loop already woken
            self.wakeup.set()

    def create(self, room: int, payload: dict | None = None) -> None:
        """Queue the creation of a room; the node's deadlines are recorded in the journaled event."""
        self.submit(room, "create", {"deadlines": self.deadlines, **(payload or {})})

    def step(self) -> int:
        """Decide, journal and execute everything queued so far; returns how many events were processed."""
        self.wakeup.clear()
        batch: list[tuple[Room, Decision, float]] = []
        rows: list[tuple] = []
        rooms, inbox, node_id, role, fire = self.rooms, self._inbox, self.node_id, self.role, self.machine.fire
        while inbox:
            room_id, trigger, payload, at = inbox.popleft()
            room = rooms.get(room_id)
            if room is None:
                if trigger != "create":
                    self.dropped_unknown_room += 1  # already cleared: nothing left to journal it against
                    continue
                room = rooms[room_id] = Room(room_id)
            decision = fire(room, trigger, payload)
            rows.append((node_id, role, room_id, decision.version, trigger, decision.src, decision.dst,
                         _payload_json(payload, decision), at))
            batch.append((room, decision, at))
        if self.journal is not None and rows:
            self.journal.add_rows(rows)
            self.journal.flush()
        run, states = self.interpreter.run, self.states
        for room, decision, _ in batch:
            if decision.effects:
                run(self, room, decision)
            if rooms.get(room.room) is room:  # not cleared meanwhile by another thread: never resurrect a room
                states[room.room] = decision.dst
        # observers (waiters, metrics) hear of a decision once its effects have been started
        for observe in self.observers:
            for room, decision, at in batch:
                observe(room, decision, at)
        return len(batch)

    def poll(self, room: int) -> KVPoll | None:
        """The room's journaled state; reading it never advances anything. Thread-safe."""
        found = self.states.get(room)
        return None if found is None else KVPoll[found]

    def clear(self, room: int) -> None:
        """Forget a terminal room; later events for it are dropped and counted."""
        found = self.rooms.get(room)
        if found is not None and not found.terminal:
            raise ValueError(f"room {room} is {found.state}; only terminal rooms can be cleared")
        self.rooms.pop(room, None)
        self.states.pop(room, None)

    def recover(self, reason: str = "node restarted", *, full_scan: bool = False) -> list[int]:
        """Rebuild this node's unfinished rooms from its journal and fail them. Returns their ids.

        The rebuilt rooms go through the same ``fire`` as live ones, so they resume at the journaled version. Only
        the open rooms are read (the journal's ``rooms`` table lists them, kept in the same commits as the rows), so
        a restart costs what is open, not the journal's history. ``full_scan`` reads every row instead, as recovery
        did before that table: the oracle that tests and ``bench/journal_scale.py`` compare against.
        """
        if self.journal is None:
            return []
        self.journal.flush()
        if full_scan:
            rows = [row for row in read_journal(self.journal.url) if row.node == self.node_id and row.role == self.role]
        else:
            with self.journal.engine.connect() as conn:
                rows = open_room_rows(conn, self.node_id, self.role)
        rooms: dict[int, Room] = {}
        for row in rows:
            room = rooms.setdefault(row.room, Room(row.room))
            self.machine.fire(room, row.trigger, row.event)
        # rooms that finished before the restart can never change again: keeping them would grow memory with the
        # journal's whole history (their late events are then dropped and counted, not journaled)
        self.rooms = {room_id: room for room_id, room in rooms.items() if not room.terminal}
        self.states = {room_id: room.state for room_id, room in self.rooms.items()}
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
