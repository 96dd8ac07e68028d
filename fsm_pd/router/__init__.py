"""The built-in PD router: SGLang's PD protocol in front of prefill and decode nodes, with sglang-router's flags.

* ``create_router_app(prefill, decode, ...)``: the router's FastAPI app; ``router_main(argv)`` / ``python -m
  fsm_pd.router``: run it (``--prefill URL [BOOTSTRAP_PORT]``, ``--decode URL``, ``--policy``, ...).

Modules: ``app`` (the app and its flags), ``core`` (a request's attempts until one starts its answer: retries and
migration), ``attempts`` (one attempt: its legs, what its failure tells the fleet, the wind-down before a retry),
``legs`` (the prefill and decode legs of an attempt and their deadlines), ``policy`` (which path a request takes: pd
or local), ``cache_aware`` (``--policy cache_aware``: the worker whose prefix cache holds the prompt), ``merge``
(SGLang's bootstrap fields into a body, logprobs across legs), ``migrate`` (a stream moved off a dead decode node),
``fleet`` (worker health, load, circuit breakers, retry budget), ``routes`` (the routes besides generation),
``metrics``, ``__main__`` (``python -m fsm_pd.router``). See ``docs/serving.md`` and ``docs/fleet.md``.
"""

from fsm_pd.router.app import PrefillWorker, build_arg_parser, create_router_app, router_main

__all__ = ["PrefillWorker", "build_arg_parser", "create_router_app", "router_main"]
