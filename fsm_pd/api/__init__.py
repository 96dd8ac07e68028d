"""The HTTP layer of one node: SGLang- and OpenAI-compatible servers of a prefill, decode or colocated engine.

* ``create_app(engine, tokenizer, ...)``: the FastAPI app of an engine.
* ``serve(app, host, port)`` in the foreground; ``AppServer(app, host, port)`` on a background thread.

The built-in PD router is its own package, ``fsm_pd.router``.
"""

from fsm_pd.api.app import create_app
from fsm_pd.api.server import AppServer, serve

__all__ = ["AppServer", "create_app", "serve"]
