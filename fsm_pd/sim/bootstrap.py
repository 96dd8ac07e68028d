"""An in-memory bootstrap server and the decode side's ``ResolverPort`` over it.

The port is the production ``ThreadedResolver`` over the production ``PrefillResolver`` (its cache, ``forget``, the
joining of rooms that need a rank whose lookup is under way, the moved-registration check); only the lookup pool is
simulated (``SimLookups``: each lookup takes ``LOOKUP_S`` of virtual time, so rooms arriving meanwhile join it) and
the lookup reads the in-memory registry instead of HTTP. Prefill instances register when they start; a dead one's
registration stays until its successor replaces it, as on the real server.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fsm_pd.bootstrap.client import base_url
from fsm_pd.control.resolver import PrefillResolver
from fsm_pd.control.workers import ThreadedResolver
from fsm_pd.sim.faults import FaultPlan
from fsm_pd.sim.timeline import Timeline

LOOKUP_S = 0.001


class SimBootstrap:
    def __init__(self, addr: str):
        self.addr = addr  # host:port, as a request names it
        self.url = base_url(addr)
        self.ranks: dict[str, dict] = {}
        self.lookups = 0

    def register(self, entry: dict) -> None:
        self.ranks[self.url] = dict(entry)

    def lookup(self, url: str, dp_rank: int = 0, **_: Any) -> dict:
        self.lookups += 1
        found = self.ranks.get(url)
        if found is None:
            raise LookupError(f"no prefill rank dp={dp_rank} is registered at {url}")
        return dict(found)


class SimLookups:
    """The lookup worker pool (``Executor.submit``) on the virtual clock: a job runs ``LOOKUP_S`` after it was
    submitted, on the simulator's thread; the jobs of a process that died meanwhile never run."""

    def __init__(self, sched: Timeline, instance: Any):
        self.sched, self.instance = sched, instance

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self.sched.later(LOOKUP_S, lambda: fn(*args), self.instance)


class SimResolver:
    """The decode instance's ``ResolverPort`` (``resolve``: the production ``ThreadedResolver``'s) and its
    ``PrefillResolver`` (``resolver``), whose lookups read the in-memory registry."""

    def __init__(self, sched: Timeline, instance: Any, plan: FaultPlan, bootstrap: SimBootstrap):
        self.plan, self.bootstrap = plan, bootstrap
        self.record: Callable[..., None] | None = None  # World.record
        self.resolver = PrefillResolver(retries=0, lookup=self._lookup)
        self.port = ThreadedResolver(lambda: self.resolver, SimLookups(sched, instance))
        self.resolve = self.port.resolve

    def _lookup(self, url: str, **kw: Any) -> dict:
        """One HTTP lookup, as the bootstrap server would answer it (or fail to, when the plan says so)."""
        if self.plan.resolve_fails():
            if self.record is not None:  # every room waiting for this lookup fails on it
                self.record("lookup failure", None, f"the lookup of {url} failed")
            raise LookupError("the bootstrap server did not answer")
        return self.bootstrap.lookup(url, **kw)

    def forget_peer(self, addr: str, instance: str | None, transfer_addrs: set[str]) -> None:
        """``PeerWatch``'s ``forget``: the prefill node at ``addr`` died or was replaced; look it up afresh."""
        self.resolver.forget_peer(addr, instance)
