"""Request fields the API layer reads or refuses (stub engines, real sockets): token ids checked against the model's
vocabulary, the model's identity in /get_model_info, the decode node's part of the prompt logprobs."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import httpx
import pytest

from fsm_pd.api import AppServer, StubEngine, create_app
from fsm_pd.engine.config import ModelConfig

PD = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7}


def big_vocab_config(vocab: int) -> ModelConfig:
    return ModelConfig(family="qwen2", vocab_size=vocab, hidden_size=8, intermediate_size=16, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=4)


@contextlib.contextmanager
def served(engine: StubEngine):
    with AppServer(create_app(engine, engine.tokenizer, bootstrap_port=8998)) as server, \
            httpx.Client(base_url=server.url, timeout=10) as client:
        yield client


@pytest.fixture
def padded_vocab():
    """A stub engine whose model has a larger vocabulary (512) than its tokenizer (272), as real checkpoints do."""
    engine = StubEngine()
    engine.model = SimpleNamespace(config=big_vocab_config(512))
    with served(engine) as client:
        yield client, engine


@pytest.mark.parametrize("path, field", [("/generate", "input_ids"), ("/v1/completions", "prompt")])
def test_token_ids_are_checked_against_the_models_vocabulary(padded_vocab, path, field):
    client, engine = padded_vocab
    body = {"max_tokens": 1, "sampling_params": {"max_new_tokens": 1}}
    ok = client.post(path, json={**body, field: [1, 300, 511]})  # past the tokenizer, inside the model
    assert ok.status_code == 200, ok.text
    assert engine.submitted[-1].input_ids == [1, 300, 511]
    bad = client.post(path, json={**body, field: [1, 512]})
    assert bad.status_code == 400 and field in bad.json()["error"]["message"] and "512" in bad.text


def test_model_info_names_the_checkpoints_architecture(padded_vocab):
    client, _ = padded_vocab
    info = client.get("/get_model_info").json()
    assert info["model_type"] == "qwen2" and info["architectures"] == ["Qwen2ForCausalLM"]


def test_decode_node_leaves_prompt_logprobs_to_the_prefills_copy():
    # Both PD routers put the prefill's input_token_logprobs in front of the decode's: the decode sends none.
    engine = StubEngine(role="decode")
    with served(engine) as client:
        body = {"text": "hey", "return_logprob": True, "sampling_params": {"max_new_tokens": 2}, **PD}
        meta = client.post("/generate", json=body).json()["meta_info"]
    assert meta["input_token_logprobs"] == [] and len(meta["output_token_logprobs"]) == 2
