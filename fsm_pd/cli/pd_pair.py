"""``PDPair``: ``--role pd``'s two engines as one, for a node's HTTP app in front of them (``--pd-front direct``,
the default).

Behind the built-in router (``--pd-front router``), a PD request of the one process crossed three apps: the router's,
then the prefill engine's and the decode engine's (in process, ``net/asgi_transport.py``), each with its middleware,
its JSON and its worker-thread plan; the chat template ran in each engine's app, and the decode's first token went
through about seven turns of the event loop before its client saw it (a colocated node's: two). On a TPU v5e that
was 68 ms of a decode-heavy request's 102 ms TTFT outside both engines, against 32 of 49 for a colocated node (issue
48, round r12), and under ``--decode-steps-per-dispatch 8`` that TTFT is most of what pd loses.

Here the process's app is a node's app (``api/app.py``: the same routes, checks, template, tokenizer, streaming and
SSE as a colocated node) whose engine is this pair. A request is planned once, then submitted to both engines as a
router would have sent it: a new bootstrap room, the prefill engine's bootstrap server, the route the policy chose
(``router/policy.py``, from the prompt's exact length). The decode engine streams to the client; the prefill
engine's one answer (its room's end) goes nowhere, as a router's prefill leg does when the client needs nothing of
it: the decode engine's answer carries the prompt's logprobs when asked for (READY brought them). Everything below the
engines' ``submit`` is unchanged: each side's KVPoll machine, journal and replay, the handoff, the decode engine's
recompute when a transfer fails.

What the router did that a pair in one process does not need: retries on another worker (there is none; a failed
handoff is recomputed by the decode engine), health checks of its workers (``cli/pd_front.py`` asks the engines), a
migration of a broken stream. Its ``--pd-policy auto`` rule 3 (a prefill side busier than the decode side) needs
queue lengths the router counted per worker; the pair leaves it out: auto is rules 1 and 2, the threshold.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from fsm_pd.router.merge import new_room
from fsm_pd.router.policy import PolicySettings, Route, RouteInput, decide
from fsm_pd.serving.types import Bootstrap, GenerateRequest, TokenOutput

log = logging.getLogger(__name__)


class _PrefillAnswer:
    """Where the prefill engine's answer goes: nowhere, but a failure is logged (the decode side fails its room and
    recomputes or answers with the error itself)."""

    def __init__(self, rid: str) -> None:
        self.rid = rid

    def push(self, item: TokenOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            log.debug("request %s: the prefill engine answered %s: %s", self.rid, type(item).__name__, item)

    def push_many(self, items: list[TokenOutput]) -> None:
        pass


class PDPair:
    """The ``Engine`` of ``api/app.py`` (``serving/types.py``) over a prefill and a decode engine of one process."""

    role = "pd"

    def __init__(self, prefill: Any, decode: Any, policy: PolicySettings, bootstrap_host: str,
                 info_extra: Any = None) -> None:
        """``bootstrap_host``: the prefill engine's bootstrap server as a decode engine reaches it (``unix:PATH``,
        no port). ``info_extra``: a callable whose dict joins ``info()`` (the process's start-up)."""
        self.prefill, self.decode, self.policy = prefill, decode, policy
        self.bootstrap_host = bootstrap_host
        self.model_name, self.model = decode.model_name, decode.model
        self.max_context = min(prefill.max_context, decode.max_context)
        self.routed = {"pd": 0, "local": 0}
        self._info_extra = info_extra

    @property
    def engines(self) -> tuple[Any, Any]:
        return self.prefill, self.decode

    def route(self, request: GenerateRequest) -> Route:
        return decide(self.policy, RouteInput(len(request.input_ids), exact=True))

    def submit(self, request: GenerateRequest, stream: Any) -> None:
        route = self.route(request)
        boot = Bootstrap(self.bootstrap_host, 0, new_room(), local=route.path == "local")
        sent = replace(request, bootstrap=boot, route=route.wire())
        if route.path == "pd":
            self.prefill.submit(replace(sent, stream=False), _PrefillAnswer(request.rid))
        try:
            self.decode.submit(sent, stream)
        except BaseException:
            if route.path == "pd":  # the prefill side's room must not wait out its bootstrap deadline
                self.prefill.abort(request.rid, reason="the decode engine refused the request", room=boot.room)
            raise
        self.routed[route.path] += 1

    def abort(self, rid: str, reason: str | None = None, status: int = 499, *, room: int | None = None) -> bool:
        """Every live request of ``rid`` in both engines (the API knows no room: the pair chose it)."""
        return any([engine.abort(rid, reason=reason, status=status) for engine in self.engines])

    def health(self) -> str | None:
        for engine in self.engines:
            if (reason := engine.health()) is not None:
                return f"the {engine.role} engine cannot serve: {reason}"
        return None

    def health_fields(self) -> dict:
        """``/health``'s fields: the decode engine's pre-allocation queue."""
        return self.decode.health_fields()

    def flush_cache(self) -> tuple[bool, str]:
        """SGLang's ``/flush_cache`` on both engines: flushed only if both were."""
        results = [(engine.role, *engine.flush_cache()) for engine in self.engines]
        return all(ok for _, ok, _ in results), "; ".join(f"{role}: {message}" for role, _, message in results)

    def collect(self):
        """``/metrics``: the requests by path, as the built-in router counts its attempts (the same family)."""
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily("fsm_pd_router_routed", "Requests by path: pd (through the prefill engine) or "
                                     "local (the decode engine prefilled the prompt itself)", labels=["path"])
        for path, n in self.routed.items():
            family.add_metric([path], n)
        yield family

    def info(self) -> dict:
        decode = self.decode.info()
        out = {"role": "pd", "transfer_backend": decode.get("transfer_backend"), "routed": dict(self.routed),
               "engines": {"prefill": self.prefill.info(), "decode": decode}}
        if self._info_extra is not None:
            out.update(self._info_extra())
        return out

