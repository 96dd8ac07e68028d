"""The built-in PD router: SGLang's PD protocol in front of prefill and decode nodes, with sglang-router's flags.

* ``create_router_app(prefill, decode, ...)``: the router's FastAPI app; ``router_main(argv)`` / ``python -m
  fsm_pd.router``: run it (``--prefill URL [BOOTSTRAP_PORT]``, ``--decode URL``, ``--policy``, ...).

Modules: ``app`` (the app and its flags), ``core`` (one request's attempts), ``legs`` (the prefill and decode legs
of an attempt), ``merge`` (SGLang's bootstrap fields into a body, logprobs across legs), ``migrate`` (a stream moved
off a dead decode node), ``fleet`` (worker health, load, circuit breakers, retry budget), ``routes`` (the routes
besides generation), ``metrics``. See ``docs/serving.md`` and ``docs/fleet.md``.
"""

from fsm_pd.router.app import PrefillWorker, build_arg_parser, create_router_app, router_main

__all__ = ["PrefillWorker", "build_arg_parser", "create_router_app", "router_main"]
