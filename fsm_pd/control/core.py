"""``NodeCore``: the jax-free heart of one node's control plane, shared by ``KVManager`` and the simulation.

It owns nothing that does I/O. It turns requests into room creations and events, routes side-channel messages to
events, and keeps messages that beat their room (D's PREPARE can reach P before the request does). Rooms bound to a
peer that died or restarted are failed by ``PeerWatch`` (``peers.py``). ``KVManager`` is this core plus the real
ports and the loop thread; ``fsm_pd.sim`` is the same core plus simulated ports, stepped by the simulator.

Thread safety: every method may be called from any thread; rooms change only in ``node.step()``, and a clear is
queued to it like an event.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

from fsm_pd.effects import Node
from fsm_pd.machines import KVPoll
from fsm_pd.store.limits import MAX_ROOM
from fsm_pd.transport.messages import Abort, Prepare, Pulled, Ready

log = logging.getLogger(__name__)

EARLY_ROOMS = 4096  # messages for rooms not created yet are kept for this many rooms, the oldest dropped first


class RoomInUse(ValueError):
    """A request named a bootstrap room this node has (or had) already: live, finished, or from before a restart."""


class NodeCore:
    def __init__(self, node: Node, layout: dict):
        """``layout``: our ``KVLayout.to_dict()``, recorded in every room (the peer's is checked against it)."""
        self.node, self.role, self.node_id = node, node.role, node.node_id
        self.layout = dict(layout)
        self._lock = threading.Lock()
        self._known: set[int] = set()
        self._early: OrderedDict[int, list[tuple[str, dict]]] = OrderedDict()

    # --- events in ---
    def submit(self, room: int, trigger: str, payload: dict) -> None:
        """Deliver now if the room exists (or is being created); otherwise keep it until it is."""
        with self._lock:
            if room in self._known:
                self.node.submit(room, trigger, payload)
                return
            self._early.setdefault(room, []).append((trigger, payload))
            self._early.move_to_end(room)
            while len(self._early) > EARLY_ROOMS:
                self._early.popitem(last=False)

    def create(self, room: int, payload: dict) -> None:
        if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room <= MAX_ROOM:
            raise ValueError(f"bootstrap_room must be an integer in [0, {MAX_ROOM}], got {room!r}")
        journal = self.node.journal
        with self._lock:
            # A room is created once per node, ever: a second create would journal a duplicate row, and a journal
            # that cannot be written stops the loop. Finished rooms leave memory, so the journal is asked too.
            if room in self._known or (journal is not None and journal.has_room(self.node_id, self.role, room)):
                raise RoomInUse(f"bootstrap_room {room} was already used on {self.node_id}; a room is used once")
            self._known.add(room)
            self.node.create(room, payload)
            for trigger, early in self._early.pop(room, ()):
                self.node.submit(room, trigger, early)

    def on_message(self, msg: Any) -> None:
        """A side-channel message, already authenticated and deduplicated: the event it means for its room."""
        if isinstance(msg, Prepare) and self.role == "prefill":
            self.submit(msg.room, "metadata_received", {
                "peer": msg.sender, "reply_to": msg.reply_to, "peer_layout": msg.layout,
                "peer_page_count": msg.page_count, "peer_cached_pages": msg.cached_pages,
                "transfer_id": msg.transfer_id, "peer_instance": msg.instance,
                **({} if msg.kv_checksum else {"peer_kv_checksum": False})})
        elif isinstance(msg, Pulled) and self.role == "prefill":
            self.submit(msg.room, "pull_done", {"peer": msg.sender})
        elif isinstance(msg, Ready) and self.role == "decode":
            self.submit(msg.room, "kv_published", {
                "peer_layout": msg.layout, "uuid": msg.uuid, "transfer_addr": msg.transfer_addr,
                "backend": msg.backend, "page_count": msg.page_count, "first_token": msg.first_token,
                "first_logprob": msg.first_logprob, "input_logprobs": msg.input_logprobs,
                "top_logprobs": msg.top_logprobs, "peer_cached_tokens": msg.cached_tokens,
                **({"chunks": msg.chunks, "chunk_pages": msg.chunk_pages} if msg.chunks else {}),
                **({"kv_checksum": msg.kv_checksum} if msg.kv_checksum is not None else {}),
                **({"chunk_checksums": True} if msg.chunk_checksums else {}),
                **({"checksum_entry": True} if msg.checksum_entry else {}),
                **({"kv_checksum_algorithm": msg.kv_checksum_algorithm}
                   if msg.kv_checksum is not None or msg.chunk_checksums or msg.checksum_entry else {})})
        elif isinstance(msg, Abort):
            self.submit(msg.room, "peer_abort", {"reason": msg.reason, "peer": msg.sender})
        else:
            log.info("%s ignores a %s message", self.node_id, type(msg).__name__)

    def recover(self, reason: str = "node restarted") -> list[int]:
        """Rebuild the unfinished rooms from the journal and fail them (``Node.recover``); returns their ids."""
        with self._lock:
            recovered = self.node.recover(reason)
            self._known.update(self.node.rooms)
        return recovered

    def clear(self, room: int) -> None:
        with self._lock:
            self.node.clear(room)
            self._known.discard(room)

    # --- requests ---
    def add_sender(self, room: int, pages: list[int] | None = None, prompt_len: int = 0,
                   rid: str | None = None) -> None:
        self._require("prefill")
        payload: dict[str, Any] = {"layout": self.layout, "prompt_len": prompt_len}
        if rid is not None:  # the client's request id, journaled with the room: replay --request chains attempts by it
            payload["rid"] = rid
        if pages is not None:
            payload["pages"] = [int(p) for p in pages]
        self.create(room, payload)

    def kv_ready(self, room: int, pages: list[int] | None = None, first_token: int = 0,
                 first_logprob: float | None = None, input_logprobs: list[float] | None = None,
                 top_logprobs: str | None = None, cached_tokens: int = 0) -> None:
        self._require("prefill")
        payload: dict[str, Any] = {"first_token": first_token, "first_logprob": first_logprob,
                                   "input_logprobs": input_logprobs, "cached_tokens": int(cached_tokens)}
        if top_logprobs is not None:
            payload["top_logprobs"] = top_logprobs
        if pages is not None:
            payload["pages"] = [int(p) for p in pages]
        self.submit(room, "kv_ready", payload)

    def kv_first_chunk(self, room: int, pages: list[int], final_pages: int, piece_pages: int,
                       cached_tokens: int = 0) -> None:
        """The first chunk of a prompt prefilled in chunks: start the handoff now, in pieces of ``piece_pages``."""
        self._require("prefill")
        self.submit(room, "kv_ready", {"pages": [int(p) for p in pages], "cached_tokens": int(cached_tokens),
                                       "final_pages": int(final_pages), "piece_pages": int(piece_pages)})

    def kv_chunk(self, room: int, final_pages: int, first_token: int | None = None) -> None:
        """A later chunk: the room's first ``final_pages`` pages hold final KV; with ``first_token``, the last."""
        self._require("prefill")
        payload: dict[str, Any] = {"final_pages": int(final_pages)}
        if first_token is not None:
            payload.update(first_token=int(first_token), last=True)
        self.submit(room, "kv_chunk", payload)

    def add_receiver(self, room: int, page_count: int | None = None, prompt_len: int = 0, rid: str | None = None,
                     **where: Any) -> None:
        self._require("decode")
        payload = {"layout": self.layout, "page_count": page_count, "prompt_len": prompt_len, **where}
        if rid is not None:
            payload["rid"] = rid
        self.create(room, payload)

    def give_pages(self, room: int, pages: list[int], cached_pages: int = 0) -> None:
        """The prompt's pages; the first ``cached_pages`` already hold their KV (D's prefix cache): P sends the
        rest."""
        self._require("decode")
        if not pages:
            raise ValueError("a transfer needs at least one destination page")
        if not 0 <= cached_pages <= len(pages):
            raise ValueError(f"{cached_pages} cached pages of {len(pages)}")
        self.submit(room, "pages_reserved", {"pages": [int(p) for p in pages], "cached_pages": int(cached_pages)})

    def abort(self, room: int, reason: str = "aborted") -> None:
        self.submit(room, "abort", {"reason": reason})

    # --- reading ---
    def poll(self, room: int) -> KVPoll | None:
        return self.node.poll(room)

    def reason(self, room: int) -> str | None:
        """Why the room failed (None while it has not), from what the loop published."""
        return self.node.reasons.get(room)

    def early_rooms(self) -> int:
        return len(self._early)

    def _require(self, role: str) -> None:
        if self.role != role:
            raise RuntimeError(f"{self.node_id} is a {self.role} node")
