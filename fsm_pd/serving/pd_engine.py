"""``PDEngine``: what a prefill and a decode node share on top of ``EngineCore``: the KV manager and the rooms.

Each request of a PD node is one bootstrap room (``request.bootstrap.room``, the allocator key too). Who touches what
(``docs/threads.md``):

- ``submit`` (any thread) opens the room with the manager (``_open_room``: ``add_sender`` / ``add_receiver``); a room
  used before is refused there (409), whoever used it. An abort tells the manager, which fails the room if it is still
  open; on an ended room the event is journaled as ignored, on a cleared one it is dropped.
- ``rooms`` (room -> its live request) belongs to the model thread: ``_step`` moves ``arrivals`` into it and takes
  requests out as their rooms end.
- The manager's loop thread only observes: ``_observe`` copies what the scheduler needs of a room that reached a state
  of interest (``watched``) into ``room_events`` and kicks the scheduler. It never reads ``rooms``.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from fsm_pd.control import KVManager
from fsm_pd.model.loader import LoadedModel
from fsm_pd.serving.common import check_request, journal_path, room_error_status
from fsm_pd.serving.engine import EngineCore
from fsm_pd.serving.sequence import Sequence
from fsm_pd.serving.shared_pool import SharedPool
from fsm_pd.serving.types import EngineError, GenerateRequest
from fsm_pd.store import JournalError
from fsm_pd.transport import generate_secret

OPEN_STATES = ("Bootstrapping", "WaitingForInput", "Transferring")


class PDEngine(EngineCore):
    watched: tuple[str, ...] = ("Success", "Failed")  # the room states the scheduler hears of

    def __init__(self, model: LoadedModel | str = "tiny", *, num_pages: int = 512, page_size: int = 16,
                 node_id: str | None = None, journal: str | None = None, secret: bytes | None = None,
                 backend: str = "tcp", backend_options: dict | None = None, deadlines: dict | None = None,
                 host: str = "127.0.0.1", advertise_host: str | None = None, prefix_cache: bool = False,
                 shared: SharedPool | None = None, **manager_options: Any):
        """The node settings both roles take. ``node_id`` defaults to ``<role>-0``; ``journal=None`` puts the journal
        in a fresh temporary directory; ``secret=None`` draws a new side-channel secret (a decode node must get its
        prefill node's). ``host`` is bound; ``advertise_host`` (default ``host``, required when ``host`` is a
        wildcard) is what peers are told. ``manager_options`` go to ``KVManager`` (admission, heartbeat). ``shared``:
        the pool and step loop this engine shares with its peer in one process (``shared_pool.py``); its handoffs then
        go through the ``pool`` backend, which moves page ownership."""
        node_id = node_id or f"{self.role}-0"
        super().__init__(model, num_pages=num_pages, page_size=page_size, name=node_id, prefix_cache=prefix_cache,
                         shared=shared)
        if shared is not None:
            backend, manager_options["shared_pool"] = "pool", shared.allocator
        if self.model.device is not None:  # a role on a device of its own: what it pulls lands there
            from jax.sharding import SingleDeviceSharding

            manager_options.setdefault("staging_sharding", SingleDeviceSharding(self.model.device))
        self.node_id = node_id
        self.secret = secret if secret is not None else generate_secret()
        self.rooms: dict[int, Sequence] = {}  # room -> its live request: the model thread's
        self.room_events: deque[tuple[int, str, Any]] = deque()  # (room, state, detail) from the manager's loop
        self.manager = KVManager(role=self.role, node_id=node_id, layout=self.layout,
                                 journal=journal_path(journal, node_id), secret=self.secret, backend=backend,
                                 backend_options=backend_options, deadlines=deadlines, host=host,
                                 advertise_host=advertise_host, model=self.model_thread,
                                 observers=[self._observe], **manager_options)
        self.registries.append(self.manager.metrics.registry)
        self.manager.metrics.watch_leaks(self.leak_counters)
        self.manager.on_stopped.append(self._cannot_serve)

    # --- any thread ---
    def health(self) -> str | None:
        """Why this node cannot serve (its loop stopped, its model thread died), or None: ``/health``."""
        return self.manager.health()

    def info(self) -> dict:
        counters = self.manager.counters()
        return {**super().info(), **self._role_info(), **counters, "leaks": self.leak_counters(counters),
                "faults": self.manager.effects.faults.config.describe(),
                "faults_injected": self.manager.effects.faults.counters()}

    def leak_counters(self, counters: dict | None = None) -> dict:
        """What this node holds now; when idle: ``pages_free`` at its start value, everything else 0."""
        counters = counters if counters is not None else self.manager.counters()
        return {"pages_free": self.allocator.free_pages, "pages_reserved": self.allocator.reserved_pages,
                "open_transfer_entries": counters["open_transfer_entries"],
                "rooms_bound_to_peers": counters["rooms_bound_to_peers"],
                "rooms_open": sum(n for s, n in counters["rooms_by_state"].items() if s in OPEN_STATES),
                "requests_live": len(self.requests), "queued": len(self.rooms), **self._role_leaks(counters)}

    def _check(self, request: GenerateRequest) -> None:
        check_request(request, self.max_context, needs_bootstrap=True, pool_tokens=self._pool_tokens_checked())

    def _key(self, request: GenerateRequest) -> int:
        return request.bootstrap.room

    def _accept(self, seq: Sequence) -> None:
        try:
            self._open_room(seq)
        except (ValueError, JournalError) as exc:  # RoomInUse: used before (maybe before a restart), or live
            raise EngineError(f"request {seq.rid}: {exc}", room_error_status(exc)) from None

    def _on_cancel(self, seq: Sequence, reason: str) -> None:
        self.manager.abort(seq.key, reason)

    def _close_parts(self) -> None:
        self.manager.close()

    # --- the manager's loop thread ---
    def _observe(self, room, decision, at) -> None:
        if decision.dst != decision.src and decision.dst in self.watched:
            self.room_events.append((room.room, decision.dst, self._detail(room, decision, at)))
            self._driver.kick()

    # --- the model thread ---
    def _take_arrivals(self) -> list[Sequence]:
        """Record the requests submitted since the last step under their rooms; returns them in order."""
        arrived = self._arrived()
        for seq in arrived:
            self.rooms[seq.key] = seq
        return arrived

    def _take_room_events(self) -> list[tuple[int, str, Any]]:
        """The room events queued by the loop, oldest first. Those of a room whose request is still being submitted
        (``_accept`` opened the room, and the loop can move it on before the request leaves ``arrivals``) stay
        queued for the step after that submit, which finds the request in ``rooms``."""
        events, later = [], []
        while self.room_events:
            event = self.room_events.popleft()
            (later if event[0] not in self.rooms and self._arriving(event[0]) else events).append(event)
        self.room_events.extendleft(reversed(later))
        return events

    # --- what each role adds ---
    def _open_room(self, seq: Sequence) -> None:
        raise NotImplementedError

    def _detail(self, room, decision, at) -> Any:
        """What the scheduler needs of a room that reached ``decision.dst``, copied on the loop thread."""
        raise NotImplementedError

    def _pool_tokens_checked(self) -> int | None:
        """The pool size a request must fit (a decoding node's), or None."""
        return None

    def _role_info(self) -> dict:
        return {}

    def _role_leaks(self, counters: dict) -> dict:
        return {}
