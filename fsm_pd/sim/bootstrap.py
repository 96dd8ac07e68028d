"""An in-memory bootstrap server and the decode side's ``ResolverPort`` over it.

The resolver is the production ``PrefillResolver`` (its cache and ``forget`` included), given the registry's lookup
instead of HTTP. Prefill instances register when they start; a dead one's registration stays until its successor
replaces it, as on the real server.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fsm_pd.bootstrap.client import base_url
from fsm_pd.control.resolver import PrefillResolver
from fsm_pd.sim.faults import FaultPlan
from fsm_pd.sim.scheduler import Scheduler

LOOKUP_S = 0.001


class SimBootstrap:
    def __init__(self, addr: str):
        self.addr = addr  # host:port, as a request names it
        self.url = base_url(addr)
        self.ranks: dict[str, dict] = {}

    def register(self, entry: dict) -> None:
        self.ranks[self.url] = dict(entry)

    def lookup(self, url: str, dp_rank: int = 0, **_: Any) -> dict:
        found = self.ranks.get(url)
        if found is None:
            raise LookupError(f"no prefill rank dp={dp_rank} is registered at {url}")
        return dict(found)


class SimResolver:
    def __init__(self, sched: Scheduler, instance: Any, plan: FaultPlan, bootstrap: SimBootstrap):
        self.sched, self.instance, self.plan = sched, instance, plan
        self.resolver = PrefillResolver(retries=0, lookup=bootstrap.lookup)

    def resolve(self, ctx: Mapping[str, Any], done: Callable[[Any, BaseException | None], None]) -> None:
        ctx = dict(ctx)
        self.sched.later(LOOKUP_S, lambda: self._answer(ctx, done), self.instance)

    def _answer(self, ctx: dict, done: Callable[[Any, BaseException | None], None]) -> None:
        if self.plan.resolve_fails():
            done(None, LookupError("the bootstrap server did not answer"))
            return
        try:
            found = self.resolver(ctx)
        except Exception as exc:  # noqa: BLE001 - as the real port reports it
            done(None, exc)
            return
        done(found, None)

    def forget_peer(self, addr: str, instance: str | None, transfer_addrs: set[str]) -> None:
        """``PeerWatch``'s ``forget``: the prefill node at ``addr`` died or was replaced; look it up afresh."""
        self.resolver.forget_peer(addr, instance)
