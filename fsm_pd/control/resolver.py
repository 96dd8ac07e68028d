"""How the decode node finds the prefill node of a request, and how the prefill node makes itself findable.

A request names its prefill node the SGLang way, ``bootstrap_host``/``bootstrap_port`` (here ``bootstrap_addr``,
``"host:port"``), or, without a bootstrap server, directly by side-channel address (``prefill_addr``). Lookups are
cached per (bootstrap URL, dp rank). An entry names the prefill node's side-channel address and, when the node
registered one, its process instance; the result carries it as ``prefill_instance``, so a room can be bound to the
instance it started with.

A cached entry is only as good as the process behind it. When that process dies or is replaced, the owner drops
the entry so that the next request asks the bootstrap server afresh (SGLang issue 16903): ``forget(url)`` by
bootstrap server, ``forget_peer(addr, instance)`` by what the peer monitor saw. ``forget_peer`` with an instance
drops only entries naming that instance, so a late report about a dead instance cannot throw away the lookup that
already found its successor.

Watched by a ``PeerWatch`` (``watch_with``), the resolver does not wait for a death to be declared: a cached entry
whose node missed its last heartbeat, or that nobody watches (a restart there would go unnoticed), is asked afresh,
and when the bootstrap server now names another process for the same rank (a new instance, usually at a new address:
the node restarted), the rooms bound to the old one fail at once (``PeerWatch.moved``). A prefill node that restarts
faster than its death can be declared is then used at once, not after the old one's rooms failed.

``resolve`` never blocks: a room is answered from the cache, joins the lookup of its rank already under way, or leads
a new one, which the caller's ``run`` port makes wherever blocking is allowed (``ThreadedResolver``: a worker thread;
the simulation: its virtual clock). So the cache, the joining and the moved-registration check are the same code in
a serving node and in the simulation. ``resolver(ctx)`` is the blocking form (the lookup on the calling thread).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from fsm_pd.bootstrap import RankRegistration, deregister_prefill_rank, register_prefill_rank, resolve_prefill
from fsm_pd.bootstrap.client import base_url
from fsm_pd.net.unix_sockets import unix_address

# done(result, error), as ``fsm_pd.effects.ports.ResultDone``
Done = Callable[[Any, "BaseException | None"], None]
# run(call, done): make the blocking ``call()`` somewhere it may block and report ``done(result, error)``
Run = Callable[[Callable[[], Any], Done], None]


class PrefillResolver:
    def __init__(self, *, retries: int = 14, interval_s: float = 1.0,
                 lookup: Callable[..., dict] = resolve_prefill):
        """``lookup``: ``resolve_prefill`` (HTTP); the simulation passes its in-memory bootstrap registry's."""
        self.retries, self.interval_s, self.lookup = retries, interval_s, lookup
        self._cache: dict[tuple[str, int], dict] = {}
        self._lock = threading.Lock()
        self._asking: dict[tuple[str, int], Future] = {}  # lookups under way, shared by every room that waits
        self._suspect: Callable[[str], bool] = lambda addr: False
        self._moved: Callable[[str, str | None, str | None], None] | None = None

    def watch_with(self, peers: Any) -> None:
        """Consult ``peers`` (a ``PeerWatch``): distrust cached nodes that missed a heartbeat or that nobody watches
        (``PeerMonitor.suspect``), and report a rank whose registration moved to another process
        (``peers.moved(old_addr, old_instance, new_instance)``)."""
        self._suspect, self._moved = peers.monitor.suspect, peers.moved

    def __call__(self, ctx: Mapping[str, Any]) -> dict:
        """``{"prefill_addr", "peer"}``, plus ``"bootstrap_url"`` and, if registered, ``"prefill_instance"`` when
        found through a bootstrap server. Blocks for a lookup's retries (made on this thread, or by the room that
        leads the lookup of the same rank). Raises ``LookupError``."""
        answer: Future = Future()
        self.resolve(ctx, lambda found, error: _settle(answer, found, error), _run_here)
        return answer.result()

    def resolve(self, ctx: Mapping[str, Any], done: Done, run: Run) -> None:
        """What ``self(ctx)`` gives, reported to ``done(answer, error)`` without blocking the caller: at once when no
        lookup is needed (a ``prefill_addr``, a trusted cache entry), when the lookup of the same rank under way
        ends, or when the lookup this room leads ends; ``run(call, done)`` makes that one. Why one per rank: a
        bootstrap server that is down holds its lookup for the retries, and rooms must not each retry against it
        (nor each hold a worker while rooms of live prefill nodes queue behind them until their deadline)."""
        try:
            if "prefill_addr" in ctx:
                done({"prefill_addr": ctx["prefill_addr"], "peer": ctx.get("peer", "prefill")}, None)
                return
            url, key = _key(ctx)
        except Exception as exc:  # noqa: BLE001 - the caller decides what the failure means
            done(None, exc)
            return
        with self._lock:
            found = self._cache.get(key)
        doubted = found if found is not None and self._suspect(found["side_channel"]) else None
        if found is not None and doubted is None:
            done(_answer(url, found), None)
            return
        with self._lock:
            pending = self._asking.get(key)
            leader = pending is None
            if leader:
                pending = self._asking[key] = Future()
        pending.add_done_callback(lambda ended: _forward(ended, url, done))
        if leader:
            lookup = self.lookup
            run(lambda: lookup(url, dp_rank=key[1], retries=self.retries, interval=self.interval_s),
                lambda found, error: self._looked_up(key, pending, doubted, found, error))

    def _looked_up(self, key: tuple[str, int], pending: Future, doubted: dict | None, found: Any,
                   error: BaseException | None) -> None:
        """The lookup that ``key``'s rooms wait for ended: cache it, then answer them all."""
        if error is None and not found.get("side_channel"):
            error = LookupError(f"the prefill rank registered at {key[0]} has no fsm-pd side channel "
                                "(is it an fsm-pd prefill node?)")
        with self._lock:  # cached before the lookup stops being under way: no gap for a second lookup
            if error is None:
                self._cache[key] = found
            del self._asking[key]
        if error is not None:
            pending.set_exception(error)
            return
        pending.set_result(found)
        moved = doubted is not None and (doubted["side_channel"], doubted.get("instance")) != (
            found["side_channel"], found.get("instance"))
        if moved and self._moved is not None:
            self._moved(doubted["side_channel"], doubted.get("instance"), found.get("instance"))

    def forget(self, url: str) -> None:
        """Drop every entry learned from the bootstrap server at ``url``."""
        with self._lock:
            for key in [k for k in self._cache if k[0] == url]:
                del self._cache[key]

    def forget_peer(self, addr: str, instance: str | None = None) -> int:
        """Drop the entries whose prefill node listens at side-channel address ``addr`` (dead, or replaced), only
        those naming ``instance`` if it is given. Returns how many were dropped."""
        with self._lock:
            stale = [key for key, found in self._cache.items()
                     if found.get("side_channel") == addr and (instance is None or found.get("instance") == instance)]
            for key in stale:
                del self._cache[key]
        return len(stale)


def _run_here(call: Callable[[], Any], done: Done) -> None:
    try:
        result = call()
    except BaseException as exc:  # noqa: BLE001 - reported, and raised again by whoever waits on the answer
        done(None, exc)
    else:
        done(result, None)


def _settle(answer: Future, found: Any, error: BaseException | None) -> None:
    if error is not None:
        answer.set_exception(error)
    else:
        answer.set_result(found)


def _forward(ended: Future, url: str, done: Done) -> None:
    error = ended.exception()
    if error is not None:
        done(None, error)
    else:
        done(_answer(url, ended.result()), None)


def _key(ctx: Mapping[str, Any]) -> tuple[str, tuple[str, int]]:
    if "bootstrap_addr" not in ctx:
        raise LookupError("the request names neither a bootstrap server (bootstrap_host/bootstrap_port) "
                          "nor a prefill side-channel address")
    url = base_url(str(ctx["bootstrap_addr"]))
    return url, (url, int(ctx.get("prefill_dp_rank", 0)))


def _answer(url: str, found: dict) -> dict:
    out = {"prefill_addr": found["side_channel"], "peer": found.get("node_id", "prefill"), "bootstrap_url": url}
    if found.get("instance"):
        out["prefill_instance"] = found["instance"]
    return out


def prefill_registration(*, host: str, side_channel: str, transfer_addr: str, backend: str, layout: dict,
                         node_id: str, http_port: int | None = None, instance: str | None = None,
                         tp_rank: int = 0) -> RankRegistration:
    """This prefill node's registration of TP rank ``tp_rank`` of ``layout["tp"]``: what it registers, and what it
    deregisters with. One process drives every rank (SPMD), so all its ranks name the same addresses. A node on unix
    sockets registers ``rank_ip`` ``unix:PATH`` of its side channel and ``rank_port`` 0: no SGLang decode could reach
    it, and fsm-pd's reads ``side_channel``."""
    if side_channel.startswith("ipc://"):
        host, port = unix_address(side_channel[len("ipc://"):]), 0
    else:
        port = int(side_channel.rsplit(":", 1)[1])
    return RankRegistration(rank_ip=host, rank_port=port, page_size=layout["page_size"],
                            kv_cache_dtype=layout["dtype"], attn_tp_size=int(layout.get("tp", 1)), attn_tp_rank=tp_rank,
                            prefill_http_port=http_port, side_channel=side_channel, transfer_addr=transfer_addr,
                            transfer_backend=backend, kv_layout=layout, node_id=node_id, instance=instance)


def register_prefill(bootstrap_url: str, *, token: str | None = None, attempts: int = 5,
                     backoff_base_s: float = 1.0, **registration: Any) -> None:
    """Register this prefill node (``prefill_registration``'s fields) with its bootstrap server, one entry per TP
    rank as SGLang's prefill ranks do, retrying with SGLang's backoff. ``instance`` (the side channel's) replaces
    whatever an earlier process registered for the same rank."""
    for rank in range(int(registration["layout"].get("tp", 1))):
        register_prefill_rank(bootstrap_url, prefill_registration(**registration, tp_rank=rank).to_json(),
                              token=token, attempts=attempts, backoff_base_s=backoff_base_s)


def deregister_prefill(bootstrap_url: str, *, token: str | None = None, **registration: Any) -> bool:
    """Take this prefill node's ranks out of its bootstrap server (a drain), if this instance still holds them;
    True when every rank was removed."""
    ranks = range(int(registration["layout"].get("tp", 1)))
    return all([deregister_prefill_rank(bootstrap_url, prefill_registration(**registration, tp_rank=rank).to_json(),
                                        token=token) for rank in ranks])
