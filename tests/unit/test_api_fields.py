"""Request fields the API layer reads or refuses (stub engines, real sockets): token ids checked against the model's
vocabulary, the model's identity in /get_model_info, the decode node's part of the prompt logprobs."""

from __future__ import annotations

import contextlib
import json
import time
from types import SimpleNamespace

import httpx
import pytest
from real_parts import TCP
from stub_engine import StubEngine

from fsm_pd.api import AppServer, create_app
from fsm_pd.model.config import ModelConfig

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
@TCP
def test_token_ids_are_checked_against_the_models_vocabulary(padded_vocab, path, field):
    client, engine = padded_vocab
    body = {"max_tokens": 1, "sampling_params": {"max_new_tokens": 1}}
    ok = client.post(path, json={**body, field: [1, 300, 511]})  # past the tokenizer, inside the model
    assert ok.status_code == 200, ok.text
    assert engine.submitted[-1].input_ids == [1, 300, 511]
    bad = client.post(path, json={**body, field: [1, 512]})
    assert bad.status_code == 400 and field in bad.json()["error"]["message"] and "512" in bad.text


@TCP
def test_model_info_names_the_checkpoints_architecture(padded_vocab):
    client, _ = padded_vocab
    info = client.get("/get_model_info").json()
    assert info["model_type"] == "qwen2" and info["architectures"] == ["Qwen2ForCausalLM"]


@TCP
def test_decode_node_leaves_prompt_logprobs_to_the_prefills_copy():
    # Both PD routers put the prefill's input_token_logprobs in front of the decode's: the decode sends none.
    engine = StubEngine(role="decode")
    with served(engine) as client:
        body = {"text": "hey", "return_logprob": True, "sampling_params": {"max_new_tokens": 2}, **PD}
        meta = client.post("/generate", json=body).json()["meta_info"]
    assert meta["input_token_logprobs"] == [] and len(meta["output_token_logprobs"]) == 2


@pytest.fixture
def pd_decode():
    engine = StubEngine(role="decode")
    with served(engine) as client:
        yield client, engine


@TCP
def test_n_fans_out_with_derived_rooms_seeds_and_rids(pd_decode):
    client, engine = pd_decode
    body = {"text": "hi", "rid": "r", "sampling_params": {"n": 3, "max_new_tokens": 2, "seed": 5}, **PD}
    answers = client.post("/generate", json=body).json()
    assert isinstance(answers, list) and len(answers) == 3
    reqs = sorted(engine.submitted, key=lambda r: r.rid)
    assert [r.rid for r in reqs] == ["r-0", "r-1", "r-2"]
    assert reqs[0].bootstrap.room == 7 and reqs[0].seed == 5  # copy 0 keeps the room and seed it was given
    assert len({r.bootstrap.room for r in reqs}) == 3 and len({r.seed for r in reqs}) == 3
    again = StubEngine(role="decode")  # the partner node derives the same rooms and seeds from the same body
    with served(again) as other:
        other.post("/generate", json=body)
    assert sorted((r.bootstrap.room, r.seed) for r in again.submitted) == \
        sorted((r.bootstrap.room, r.seed) for r in reqs)


@TCP
def test_a_batch_of_prompts_is_answered_in_order():
    engine = StubEngine()
    with served(engine) as client:
        answers = client.post("/generate", json={"input_ids": [[1, 2], [3], [4, 5, 6]],
                                                 "sampling_params": {"max_new_tokens": 1}}).json()
        assert [a["meta_info"]["prompt_tokens"] for a in answers] == [2, 1, 3]
        completion = client.post("/v1/completions", json={"prompt": ["ab", "c"], "max_tokens": 2, "n": 2}).json()
    assert [c["index"] for c in completion["choices"]] == [0, 1, 2, 3]
    assert completion["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11,
                                   "prompt_tokens_details": {"cached_tokens": 0}}


@TCP
def test_max_new_tokens_zero_returns_the_prompt_only():
    engine = StubEngine()
    with served(engine) as client:
        answer = client.post("/generate", json={"text": "hey", "return_logprob": True,
                                                "sampling_params": {"max_new_tokens": 0}}).json()
    assert answer["text"] == "" and answer["output_ids"] == [] and answer["meta_info"]["completion_tokens"] == 0
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert engine.submitted[0].sampling.max_new_tokens == 1  # the engine makes one token, which nobody sees


@TCP
def test_echo_with_logprobs_and_max_tokens_zero_is_lm_evals_loglikelihood(pd_decode):
    client, _ = pd_decode
    body = {"prompt": "hey", "echo": True, "logprobs": 0, "max_tokens": 0, **PD}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == "hey"
    assert choice["logprobs"]["tokens"] == ["h", "e", "y"]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0, -1.0]  # the prefill's, as READY carried them
    assert choice["logprobs"]["text_offset"] == [0, 1, 2]


@TCP
def test_best_of_keeps_the_n_most_likely(monkeypatch):
    engine = StubEngine()
    with served(engine) as client:
        answer = client.post("/v1/completions", json={"prompt": "a", "best_of": 3, "n": 1, "max_tokens": 2}).json()
    assert len(engine.submitted) == 3 and all(r.return_logprob for r in engine.submitted)
    assert len(answer["choices"]) == 1 and answer["choices"][0]["logprobs"] is None


@TCP
def test_no_stop_trim_keeps_the_stop_string():
    engine = StubEngine()
    with served(engine) as client:
        body = {"text": "a", "sampling_params": {"stop": "wor", "max_new_tokens": 20}}
        trimmed = client.post("/generate", json=body).json()["text"]
        body["sampling_params"]["no_stop_trim"] = True
        kept = client.post("/generate", json=body).json()
    assert trimmed == " hello " and engine.submitted[-1].sampling.no_stop_trim
    assert kept["meta_info"]["finish_reason"]["matched"] == "wor"


def test_stop_checker_keeps_the_stop_string_with_no_stop_trim():
    from fsm_pd.model.sampling import SamplingParams
    from fsm_pd.model.stopping import StopChecker

    tok = StubEngine().tokenizer
    for trim, want in ((False, "ab"), (True, "abcd")):
        checker = StopChecker(tok, SamplingParams(stop=("cd",), no_stop_trim=trim, max_new_tokens=9), ())
        for tid in tok.encode("abcde"):
            if checker.append(tid):
                break
        assert checker.text == want


def _sse(text: str) -> list[dict]:
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@TCP
def test_a_streamed_batch_interleaves_answers_named_by_index():
    # Streamed, each answer's chunks carry its index (prompt-major); read per index, each equals its whole answer.
    engine = StubEngine()
    with served(engine) as client:
        body = {"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 3, "n": 2}}
        whole = client.post("/generate", json=body).json()
        chunks = _sse(client.post("/generate", json={**body, "stream": True}).text)
        assert sorted({c["index"] for c in chunks}) == [0, 1, 2, 3]
        last = {c["index"]: c for c in chunks}  # SGLang's chunks are cumulative: the last one is the answer
        assert [last[i]["output_ids"] for i in range(4)] == [a["output_ids"] for a in whole]
        assert [last[i]["meta_info"]["prompt_tokens"] for i in range(4)] == [2, 2, 1, 1]

        body = {"prompt": ["ab", "c"], "max_tokens": 2, "n": 2, "stream": True,
                "stream_options": {"include_usage": True}}
        chunks = _sse(client.post("/v1/completions", json=body).text)
        texts: dict[int, str] = {}
        for c in chunks[:-1]:
            (choice,) = c["choices"]
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        whole = client.post("/v1/completions", json={**body, "stream": False}).json()
        assert texts == {c["index"]: c["text"] for c in whole["choices"]}
        assert chunks[-1]["usage"] == whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 8,
                                                         "total_tokens": 11,
                                                         "prompt_tokens_details": {"cached_tokens": 0}}

        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 3, "stream": True}
        chunks = _sse(client.post("/v1/chat/completions", json=body).text)
        roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role")]
        assert roles == [0, 1, 2]
        finished = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
        assert sorted(finished) == [0, 1, 2]


@TCP
def test_a_streamed_batch_fails_with_a_status_before_its_first_token_and_with_an_event_after():
    engine = StubEngine(fail_after=0)
    body = {"text": ["a", "b"], "stream": True, "sampling_params": {"max_new_tokens": 3}}
    with served(engine) as client:
        r = client.post("/generate", json=body)
        assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
        engine.fail_after = 1
        chunks = _sse(client.post("/generate", json=body).text)
        assert "injected" in chunks[-1]["error"]["message"]
        assert all("output_ids" in c for c in chunks[:-1])


@TCP
def test_a_client_leaving_a_streamed_batch_aborts_every_copy():
    engine = StubEngine(token_delay_s=0.05)
    body = {"text": "a", "stream": True, "sampling_params": {"n": 3, "max_new_tokens": 200}}
    with served(engine) as client:
        with client.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the first chunk, then away
        deadline = time.monotonic() + 5
        while len(engine.aborted) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(engine.aborted) == sorted(req.rid for req in engine.submitted) and not engine.live
