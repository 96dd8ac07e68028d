"""What keeps a long request from holding a node (issue 51): its prompt is built on a worker thread, never on the
event loop that serves every other request; a text that no tokenization fits in the context is refused before it is
tokenized; and a long text is tokenized without holding the interpreter's lock (the same ids as the short path).
The body limit itself, on real processes: ``tests/integration/test_oversized_requests.py``."""

from __future__ import annotations

import threading

import pytest
from node_sockets import node_sockets
from stub_engine import StubEngine
from test_gguf_loader import gguf_tensors, small_config, vocabulary, write_gguf

from fsm_pd.api import AppServer, create_app
from fsm_pd.model import tokenizer as tokenizers
from fsm_pd.model.loader import load_model
from fsm_pd.model.params import random_params
from fsm_pd.net import unix_http
from fsm_pd.net.body_limit import request_bytes_for


class Watched:
    """The stub's tokenizer, noting the thread of every ``encode``."""

    def __init__(self, inner) -> None:
        self.inner, self.threads = inner, []

    def encode(self, text, **options):
        self.threads.append(threading.current_thread().name)
        return self.inner.encode(text, **options)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture
def served(tmp_path):
    """The stub's app on 127.0.0.1, or on a unix socket where this host has no TCP (``node_sockets``)."""
    engine = StubEngine()
    tokenizer = Watched(engine.tokenizer)
    server = AppServer(create_app(engine, tokenizer), **node_sockets(tmp_path, "api")).start()
    try:
        yield server, engine, tokenizer
    finally:
        server.stop()
        engine.close()


def post(server, path: str, body: dict):
    return unix_http.request("POST", unix_http.http_url(server.url) + path, json=body, timeout=30)


def loop_thread(server) -> str:
    return server._thread.name  # uvicorn's event loop runs on the AppServer's thread


@pytest.mark.parametrize("path, body", [
    ("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 2}}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}),
    ("/tokenize", {"prompt": "Hello"}),
])
def test_a_prompt_is_tokenized_off_the_event_loop(served, path, body):
    server, _, tokenizer = served
    answer = post(server, path, body)
    assert answer.status_code == 200, answer.text
    assert tokenizer.threads and loop_thread(server) not in tokenizer.threads, (loop_thread(server), tokenizer.threads)


@pytest.mark.parametrize("path, field", [
    ("/generate", lambda text: {"text": text}),
    ("/v1/completions", lambda text: {"prompt": text}),
    ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}]}),
])
def test_a_text_no_tokenization_fits_is_refused_before_it_is_tokenized(served, path, field):
    server, engine, tokenizer = served
    most = engine.max_context * tokenizer.max_token_bytes  # what the longest tokens could pack into the context
    answer = post(server, path, field("é" * (most // 2 + 1)))  # 2 bytes a character
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    # (a chat's text is its rendered template, a little longer than the message)
    assert message.startswith("the prompt's text is ") and f"at most {tokenizer.max_token_bytes} bytes" in message \
        and f"context is {engine.max_context} tokens" in message, message
    assert tokenizer.threads == []  # refused before any tokenizing
    assert engine.submitted == []
    shorter = post(server, path, field("x" * engine.max_context))  # counted, then refused
    assert shorter.status_code == 400 and "tokens" in shorter.text and tokenizer.threads, shorter.text
    assert request_bytes_for(engine.max_context) > most  # the body limit lets such a text through to this check


def test_a_long_text_takes_the_path_that_lets_go_of_the_lock_and_gets_the_same_ids(tmp_path, monkeypatch):
    config = small_config()
    tok = load_model(str(write_gguf(tmp_path / "m.gguf", config, gguf_tensors(config, random_params(config))))
                     ).tokenizer
    text = "<|im_start|>hello wé, hell " * 2000
    assert len(text) > tokenizers.GIL_FREE_CHARS
    batched = []
    real = tok._inner.encode_batch
    monkeypatch.setattr(tok, "_inner", Spy(tok._inner, lambda *a, **k: batched.append(1) or real(*a, **k)))
    assert tok.encode(text) == tok._inner.encode(text).ids and batched == [1]
    assert tok.encode("hello") == tok._inner.encode("hello").ids and batched == [1]  # short: the plain path
    # the most bytes one token stands for: the longest of its texts (the specials here)
    assert tok.max_token_bytes == max(len(t.encode()) for t in vocabulary() if not t.startswith("Ġ") or t == "Ġw")


class Spy:
    def __init__(self, inner, encode_batch) -> None:
        self.inner, self.encode_batch = inner, encode_batch

    def __getattr__(self, name):
        return getattr(self.inner, name)
