"""The HTTP layer: SGLang- and OpenAI-compatible servers of one engine, and a small PD router.

* ``create_app(engine, tokenizer, ...)``: the FastAPI app of a prefill, decode or colocated engine.
* ``create_router_app(prefill, decode, ...)`` / ``router_main(argv)``: the built-in PD router (sglang-router's
  ``--prefill URL [PORT]`` / ``--decode URL`` flags).
* ``serve(app, host, port)`` in the foreground; ``AppServer(app, host, port)`` on a background thread.
* ``StubEngine``: a model-free ``Engine`` for tests and API fuzzing.
"""

from fsm_pd.api.app import create_app
from fsm_pd.api.router import PrefillWorker, build_arg_parser, create_router_app, router_main
from fsm_pd.api.server import AppServer, serve
from fsm_pd.api.stub_engine import StubEngine, stub_server, stub_tokenizer

__all__ = ["AppServer", "PrefillWorker", "StubEngine", "build_arg_parser", "create_app", "create_router_app",
           "router_main", "serve", "stub_server", "stub_tokenizer"]
