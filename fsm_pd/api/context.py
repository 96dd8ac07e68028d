"""What every route of one server shares: the engine, its tokenizer, the names it answers to, its PD identity."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fsm_pd.api.request_checks import NodeIdentity
from fsm_pd.serving.types import Engine


@dataclass(slots=True)
class ApiContext:
    engine: Engine
    tokenizer: Any
    model_name: str  # served_model_name: what /v1/models lists and OpenAI responses name
    model_path: str  # what the model was loaded from; also accepted as a model name
    bootstrap_port: int | None  # the prefill node's bootstrap server port (or a decode's default for null)
    model_info_extra: dict = field(default_factory=dict)  # model_type, architectures, ... for /model_info
    created: int = field(default_factory=lambda: int(time.time()))
    # (rid, room) -> RequestRun of the requests this server is running (``GenerateRequest.identity``)
    live: dict = field(default_factory=dict)
    drain: Any = None  # the server's Drain (drain.py), once create_app made it
    wait: Any = None  # how long a handler waits for the engine (runner.WaitDeadlines); None: the defaults
    max_request_bytes: int | None = None  # the body limit (create_app), reported on /health for a router

    @property
    def role(self) -> str:
        return self.engine.role

    @property
    def node(self) -> NodeIdentity:
        return NodeIdentity(role=self.engine.role, max_context=int(self.engine.max_context),
                            model_names=frozenset({self.model_name, self.model_path}),
                            bootstrap_port=self.bootstrap_port, vocab_size=self.vocab_size,
                            max_token_bytes=getattr(self.tokenizer, "max_token_bytes", None))

    @property
    def model_config(self):
        """The engine's model config (``engine.model.config``), None for an engine without a model (the stub)."""
        return getattr(getattr(self.engine, "model", None), "config", None)

    @property
    def vocab_size(self) -> int | None:
        config = self.model_config
        if config is not None:
            return int(config.vocab_size)
        return getattr(self.tokenizer, "vocab_size", None)

    @property
    def disaggregation_mode(self) -> str:
        # SGLang reports the string "null" for a colocated server; sglang-router reads this field.
        return self.role if self.role in ("prefill", "decode") else "null"
