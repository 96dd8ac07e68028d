"""``KVManager``: one per process and role. The jax-free ``NodeCore`` (rooms, routing, early messages) plus the real
ports the effect handlers use (``ports.py``) plus the loop thread that steps the node.

It owns the journal, the side channel and its per-peer sender threads, the transfer backend, the worker pool for
pulls and bootstrap lookups, the model thread (the KV pool), the heartbeats of its peers (``PeerWatch``) and, on the
decode side, the page admission.

Threads: the *loop* thread runs ``node.step()`` and is the only one that changes rooms; the *model* thread is the only
one that touches the pool; the side-channel listener, the timer thread, the sender threads and the workers only
``submit`` events. The public methods may be called from any thread.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fsm_pd.control.admission import SchedulerAdmission
from fsm_pd.control.config import heartbeat_settings, resolve_deadlines
from fsm_pd.control.core import NodeCore, RoomInUse
from fsm_pd.control.jax_kv import JaxKV
from fsm_pd.control.metrics import NodeMetrics
from fsm_pd.control.node_loop import NodeLoop
from fsm_pd.control.peers import PeerWatch, manager_forget
from fsm_pd.control.pool_kv import SharedPoolKV
from fsm_pd.control.resolver import PrefillResolver, deregister_prefill, register_prefill
from fsm_pd.control.sending import InProcessSenders, PeerSenders
from fsm_pd.control.workers import LocalPuller, ThreadedPuller, ThreadedResolver
from fsm_pd.effects import Node, RealClock
from fsm_pd.effects.decode import DecodeEffects
from fsm_pd.effects.faults import FaultConfig, Faults
from fsm_pd.effects.ports import Admission
from fsm_pd.effects.prefill import PrefillEffects
from fsm_pd.kernels import KVLayout
from fsm_pd.machines import RECEIVER, SENDER, KVPoll
from fsm_pd.model.model_thread import ModelThread
from fsm_pd.net.unix_sockets import check_unix_backend, ipc_address, node_socket
from fsm_pd.store import Journal, JournalError
from fsm_pd.store.journal import JournalClosed
from fsm_pd.transport import SideChannel
from fsm_pd.transport.addresses import advertised_host, with_port
from fsm_pd.transport.backends import create_backend, new_uuid

log = logging.getLogger(__name__)

__all__ = ["KVManager", "RoleCrashed", "RoomInUse"]


class RoleCrashed(Exception):
    """A contained crash (``KVManager(contained_crash=True)``): the handler that reached the crash point stops."""


class KVManager:
    def __init__(self, *, role: str, node_id: str, layout: KVLayout, journal: str, secret: bytes,
                 backend: str = "tcp", backend_options: Mapping[str, Any] | None = None,
                 deadlines: Mapping[str, float] | None = None, pool: Any = None,
                 resolver: Callable[[Mapping[str, Any]], dict] | None = None, host: str = "127.0.0.1",
                 durability: str = "full", staging_sharding: Any = None,
                 admission: Admission | None = None,
                 heartbeat: Mapping[str, Any] | None = None, model: ModelThread | None = None,
                 advertise_host: str | None = None, kv_checksum: bool = True, uds: str | None = None,
                 observers: Sequence[Callable] = (), shared_pool: Any = None, contained_crash: bool = False,
                 in_process: bool = False, loop: NodeLoop | None = None):
        """``host``: what the side channel and the transfer server bind; ``advertise_host``: the host peers are told
        (bootstrap registration, side-channel origin and reply_to, transfer address), by default ``host``. A wildcard
        ``host`` needs an ``advertise_host`` (``WildcardAddress`` otherwise). ``kv_checksum``: compute (prefill) or
        verify (decode) the KV checksum of every handoff (``effects/checksums.py``). ``uds``: the node's HTTP unix
        socket (``--uds``); its side channel and transfer server then listen on unix sockets beside it
        (``PATH.side.sock``, ``PATH.kv.sock``: ``unix_sockets.node_socket``) instead of ``host``, and it opens no TCP
        socket. ``shared_pool``: the ``PageAllocator`` of a pool this node shares with its peer in one process
        (backend ``pool``): handoffs then move page ownership, no bytes (``control/pool_kv.py``). ``contained_crash``:
        a fault knob's crash (``FSM_PD_FAULT_CRASH_AT``) stops this node's loop instead of exiting the process, for
        a process that runs both roles (``--role pd``): the role dies, the process says so. ``in_process``: side-
        channel messages to a peer of this process that says so too go to it directly (``InProcessSenders``). ``loop``:
        the thread that steps this node, shared with its peer in one process (``node_loop.py``); by default its own."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        if role == "decode" and admission is None:
            raise ValueError("a decode KVManager needs an admission: SchedulerAdmission (its scheduler passes the "
                             "pages, give_pages) or another Admission")
        self.role, self.node_id, self.layout = role, node_id, layout
        self.deadlines = resolve_deadlines(role, deadlines)
        self.host = host
        # a node on unix sockets advertises paths, never a host (prefill_registration names its side channel's)
        self.advertise_host = advertised_host(host, advertise_host) if uds is None else None
        self.resolver = resolver if resolver is not None else PrefillResolver()
        self.staging_sharding = staging_sharding
        # the model thread owns the pool; a serving engine passes its own so that forward passes, gathers and
        # scatters share one queue
        self._owns_model = model is None
        self.model = model if model is not None else ModelThread(pool, name=f"model[{node_id}]")
        self.uds = uds
        options = dict(backend_options or {})
        if uds is not None:
            check_unix_backend(backend)
            options.setdefault("uds", node_socket(uds, "kv"))
        elif backend in ("jax", "zmq", "tcp"):
            options.setdefault("host", host)
            options.setdefault("advertise_host", self.advertise_host)
        self.backend = create_backend(backend, **options)
        bind = ipc_address(node_socket(uds, "side")) if uds is not None else f"tcp://{with_port(host, 0)}"
        # pings are answered only while this node can serve: peers then fail their rooms bound to us
        self.side_channel = SideChannel(node_id=node_id, secret=secret, on_message=self._on_message, bind=bind,
                                        advertise_host=self.advertise_host, healthy=self._answers_pings)
        # an engine beside its peer in one process (--role pd) hands its messages over directly
        senders = InProcessSenders if in_process else PeerSenders
        self.senders = senders(self.side_channel, name=f"send[{node_id}]")
        self.workers = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"work[{node_id}]")
        # lookups on their own threads: a bootstrap server that is down holds them for its retries, never a pull
        self.lookups = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"lookup[{node_id}]")
        self.journal = Journal(journal, durability=durability)
        self.clock = RealClock()
        if (shared_pool is None) != (backend != "pool"):
            raise ValueError("the pool backend and shared_pool go together: one pool shared by both engines")
        if shared_pool is not None:
            kv_checksum = False  # no byte moves: ownership, not a checksum, guards the handoff (pool_kv.py)
            kv = SharedPoolKV(layout, self.model, allocator=shared_pool, sharding=staging_sharding)
        else:
            kv = JaxKV(layout, self.model, progressive=self.backend.progressive, sharding=staging_sharding,
                       checksum=kv_checksum)
        # off unless FSM_PD_FAULT_* are set
        faults = Faults(FaultConfig.from_env(), role=role, **({"exit": self._crash} if contained_crash else {}))
        if role == "prefill":
            self.admission = None
            self.effects: PrefillEffects | DecodeEffects = PrefillEffects(
                layout=layout.to_dict(), channel=self.senders, transfer=self.backend, model=self.model, kv=kv,
                faults=faults, new_uuid=new_uuid, kv_checksum=kv_checksum)
            machine = SENDER
        else:
            self.admission = admission
            puller = LocalPuller if shared_pool is not None else ThreadedPuller
            self.effects = DecodeEffects(
                layout=layout.to_dict(), channel=self.senders,
                resolver=ThreadedResolver(lambda: self.resolver, self.lookups), admission=self.admission,
                puller=puller(self.backend, kv.pull_spec, self.workers), model=self.model, kv=kv,
                faults=faults, kv_checksum=kv_checksum)
            machine = RECEIVER
        self._loop = loop if loop is not None else NodeLoop(node_id)
        self.node = Node(node_id, machine, self.journal, self.effects.interpreter(), self.clock, self.deadlines,
                         wakeup=self._loop.wakeup, commit_by_loop=self._loop.commit_per_pass)
        self.core = NodeCore(self.node, layout.to_dict())
        self.metrics = NodeMetrics(self.node)
        self.metrics.backend.labels(role, node_id, self.backend.name).set(1)
        self._ended = threading.Condition()
        self._waiting = 0  # threads in ``wait``: a room's end is announced only to them (the loop's step pays it)
        self.node.observers.append(self._observe)
        # before recovery and the loop's start: the rooms a restart fails are decided on the loop's first step, and
        # an observer added after that (an engine's, when the constructor returned) never heard they ended
        self.node.observers.extend(observers)
        self._stop = threading.Event()
        self.dead: str | None = None  # why the loop stopped on its own (None while it runs, or closed on purpose)
        # heartbeats of the peers our rooms are bound to; their death or restart fails those rooms at once
        self.peers = PeerWatch(self.node, self.side_channel, self.clock,
                               **{**heartbeat_settings(), **(heartbeat or {})},
                               forget=manager_forget(self.resolver, self.side_channel, self.backend)).start()
        if isinstance(self.resolver, PrefillResolver):
            self.resolver.watch_with(self.peers)
        self.recovered = self.core.recover()
        self.on_stopped: list[Callable[[str], None]] = []  # told once, on the loop thread, when it stops on its own
        self._loop.join(self)

    # --- the loop (NodeLoop's members) ---
    def active(self) -> bool:
        return not self._stop.is_set()

    def step_once(self) -> None:
        self._guarded(self.node.step)

    def commit(self) -> None:
        self._guarded(self.journal.flush)  # the loop's end of a pass (``NodeLoop(commit_per_pass=True)``)
        self.metrics.settle()  # what the pass's decisions owe /metrics, after them (metrics.py)

    def keep_alive(self) -> None:
        self._guarded(self.journal.keep_alive)  # a database server that went away fails the node even when idle
        self.metrics.settle()

    def _guarded(self, work: Callable[[], Any]) -> None:
        try:
            work()
        except JournalClosed:  # closed by close() under a loop that outlived its leave: nothing more is journaled
            self._stop.set()
        except Exception as exc:  # a journal that cannot be written stops the node: unjournaled acts break replay
            log.exception("node %s stopped: the journal could not be written", self.node_id)
            self._stopped(f"the node loop stopped: the journal could not be written: {type(exc).__name__}: {exc}")

    def _journal_lost(self, exc: JournalError) -> None:
        """The journal could not say whether a room was used (its database is gone): like a journal that cannot
        be written, this stops the node, so /health says so and nothing is done that the journal does not hold."""
        if self.dead is None:
            log.error("node %s stopped: %s", self.node_id, exc)
            self._stopped(f"the journal could not be read: {exc}")

    def _stopped(self, reason: str) -> None:
        self.dead = reason
        self._stop.set()
        for callback in list(self.on_stopped):
            try:
                callback(reason)
            except Exception:  # one listener's failure must not keep the others from hearing
                log.exception("an on_stopped callback of %s failed", self.node_id)

    def _crash(self, code: int) -> None:
        """A fault knob's crash of this role alone: its loop stops, and the handler that crashed goes no further."""
        self._stopped(f"the {self.role} role crashed (fault injection, exit status {code})")
        raise RoleCrashed(self.dead)

    def health(self) -> str | None:
        """Why this node cannot serve (None while it can): its loop stopped, or its model thread died."""
        if self.dead is None and not self._stop.is_set() and self._loop.started and not self._loop.alive():
            return "the node loop exited"
        return self.dead or self.model.health()

    def _answers_pings(self) -> bool:
        return not hasattr(self, "_stop") or self.health() is None  # still starting: answer

    def _observe(self, room, decision, at) -> None:
        # ``_waiting`` read after the state was published: a waiter that found it not yet terminal is counted by now
        if self._waiting and decision.dst != decision.src and room.terminal:
            with self._ended:
                self._ended.notify_all()

    def _on_message(self, msg) -> None:
        core = getattr(self, "core", None)  # the listener starts before the rest of the manager is built
        if core is not None:
            core.on_message(msg)

    # --- the prefill side ---
    def register_with(self, bootstrap_url: str, *, token: str | None = None, http_port: int | None = None,
                      attempts: int = 5) -> None:
        """Make this prefill node findable: register it with the bootstrap server at ``bootstrap_url``."""
        self.core._require("prefill")
        register_prefill(bootstrap_url, host=self.advertise_host, side_channel=self.side_channel.address,
                         transfer_addr=self.backend.address, backend=self.backend.name,
                         layout=self.layout.to_dict(), node_id=self.node_id, http_port=http_port, token=token,
                         attempts=attempts, instance=self.side_channel.instance)

    def deregister_from(self, bootstrap_url: str, *, token: str | None = None, http_port: int | None = None) -> bool:
        """Stop being findable (a drain): take this node's rank out of the bootstrap server, if this process still
        holds it. True when removed; raises ``BootstrapError`` when the server refused or could not be reached."""
        self.core._require("prefill")
        return deregister_prefill(bootstrap_url, host=self.advertise_host, side_channel=self.side_channel.address,
                                  transfer_addr=self.backend.address, backend=self.backend.name,
                                  layout=self.layout.to_dict(), node_id=self.node_id, http_port=http_port,
                                  token=token, instance=self.side_channel.instance)

    def add_sender(self, room: int, pages: list[int] | None = None, prompt_len: int = 0,
                   rid: str | None = None) -> None:
        """A request with ``bootstrap_room`` arrived; its KV is (or will be) in ``pages`` of our pool.

        The pages may instead come with ``kv_ready`` (chunked prefill learns them chunk by chunk). ``rid``, the
        client's request id, is journaled with the room (``fsm-pd replay --request``).
        """
        try:
            self.core.add_sender(room, pages, prompt_len, rid)
        except JournalError as exc:
            self._journal_lost(exc)
            raise

    def kv_ready(self, room: int, pages: list[int] | None = None, first_token: int = 0,
                 first_logprob: float | None = None, input_logprobs: list[float] | None = None,
                 top_logprobs: str | None = None, cached_tokens: int = 0) -> None:
        """Our prefill of ``room`` finished: its pages hold the KV and the first token is known; ``cached_tokens`` of
        the prompt came from our prefix cache (journaled, and told to the decode node in READY)."""
        self.core.kv_ready(room, pages, first_token, first_logprob, input_logprobs, top_logprobs, cached_tokens)

    def kv_first_chunk(self, room: int, pages: list[int], final_pages: int, piece_pages: int,
                       cached_tokens: int = 0) -> None:
        """The first of several prefill chunks of ``room`` ran: its first ``final_pages`` pages hold final KV. The
        handoff starts now and moves the pages in pieces of ``piece_pages`` as they become final (``kv_chunk``);
        the first token follows with the last chunk (``effects/chunked.py``)."""
        self.core.kv_first_chunk(room, pages, final_pages, piece_pages, cached_tokens)

    def kv_chunk(self, room: int, final_pages: int, first_token: int | None = None) -> None:
        """A later prefill chunk of ``room`` ran; ``first_token`` (sampled after the last chunk) marks the last."""
        self.core.kv_chunk(room, final_pages, first_token)

    # --- the decode side ---
    def add_receiver(self, room: int, page_count: int | None = None, prompt_len: int = 0, **where: Any) -> None:
        """A request with ``bootstrap_room`` arrived; ``where`` tells the resolver how to find the prefill node."""
        try:
            self.core.add_receiver(room, page_count, prompt_len, **where)
        except JournalError as exc:
            self._journal_lost(exc)
            raise

    def give_pages(self, room: int, pages: list[int], cached_pages: int = 0) -> None:
        """The scheduler allocated ``pages`` for the room (SGLang's ``send_metadata``; ``SchedulerAdmission`` only);
        the first ``cached_pages`` already hold the prompt's KV (our prefix cache), so the prefill node sends the
        rest."""
        self.core._require("decode")
        if not isinstance(self.admission, SchedulerAdmission):
            raise RuntimeError("pages are chosen by this node's own admission; use SchedulerAdmission to pass them")
        self.core.give_pages(room, pages, cached_pages)

    def finish(self, room: int) -> None:
        """The request finished decoding: free its pages (on the model thread, after any queued write)."""
        self.core._require("decode")
        self.effects.finish(self.node, room)

    # --- both sides ---
    def abort(self, room: int, reason: str = "aborted") -> None:
        self.core.abort(room, reason)

    def fail(self, room: int, reason: str) -> None:
        """Fail the room for a local reason (its prefill failed, say); the machine frees what it holds."""
        self.core.submit(room, "error", {"blame": "local", "reason": reason})

    def poll(self, room: int) -> KVPoll | None:
        """The room's state, read without advancing anything (None if it does not exist here)."""
        return self.core.poll(room)

    def reason(self, room: int) -> str | None:
        return self.core.reason(room)

    def wait(self, room: int, timeout: float) -> KVPoll | None:
        """Block until the room is terminal or ``timeout`` passes; returns its state then."""
        with self._ended:
            self._waiting += 1
            try:
                self._ended.wait_for(lambda: (s := self.node.poll(room)) is not None
                                     and s.name in ("Success", "Failed"), timeout)
            finally:
                self._waiting -= 1
        return self.node.poll(room)

    def clear(self, room: int) -> None:
        self.core.clear(room)

    def counters(self) -> dict:
        """What this node holds right now: for leak checks, /server_info and /metrics."""
        states = Counter(list(self.node.states.values()))
        out = {"rooms_by_state": dict(states), "open_transfer_entries": self.backend.open_entries().count,
               "side_channel_dropped": self.side_channel.dropped, "rooms_bound_to_peers": self.peers.bound_count(),
               "peers_watched": len(self.peers.monitor.watched())}
        if self.role == "prefill":
            out["staging_buffers_held"] = self.effects.held()
        else:
            out.update(self.admission.counters())
            out["pulled_awaiting_scatter"] = len(self.effects.pulled)
        return out

    def close(self) -> None:
        self._stop.set()
        self._loop.leave(self)
        self.peers.close()
        self.senders.close()
        self.side_channel.close()
        self.clock.close()
        self.workers.shutdown(wait=False, cancel_futures=True)
        self.lookups.shutdown(wait=False, cancel_futures=True)
        if self._owns_model:
            self.model.close()
        self.backend.close()
        self.journal.close()
