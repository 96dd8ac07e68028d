"""What SGLang and OpenAI clients send, through a real PD pair (tiny model) behind the built-in router and the real
sglang-router, next to a colocated node: prompt logprobs counted once, sampling parameters that need state on the
decode side (penalties count the first token, which the prefill sampled), fan-out (``n``, batches), ``echo``.

The test process's shared PD cluster (``conftest.pd_urls``: processes started there, stopped by PID); everything on
127.0.0.1.
"""

from __future__ import annotations

import json

import httpx
import pytest
from processes import post_ok, routers

# one xdist worker runs every module on the shared PD cluster (conftest.pd_urls), so that a run starts it once
pytestmark = pytest.mark.xdist_group("shared-pd")

TIMEOUT_S = 180




def generate(url: str, body: dict) -> dict | list:
    return post_ok(url, "/generate", body, TIMEOUT_S)


def test_prompt_logprobs_come_back_once_through_both_routers(pd_urls):
    prompt = "count me once"
    body = {"text": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}
    want = generate(pd_urls["colocated"], body)["meta_info"]
    assert len(want["input_token_logprobs"]) == want["prompt_tokens"] > 1
    for url in routers(pd_urls):
        meta = generate(url, body)["meta_info"]
        assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"], url
        assert [x[1] for x in meta["input_token_logprobs"]] == [x[1] for x in want["input_token_logprobs"]]
        assert [x[0] for x in meta["input_token_logprobs"]] == pytest.approx(
            [x[0] for x in want["input_token_logprobs"]], abs=1e-4)
        assert len(meta["output_token_logprobs"]) == 3
        with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=TIMEOUT_S) as r:
            assert r.status_code == 200
            chunks = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
        counts = [len(json.loads(c)["meta_info"]["input_token_logprobs"]) for c in chunks[:-1]]
        assert set(counts) == {meta["prompt_tokens"]}, (url, counts)


def test_model_info_names_the_architecture(pd_urls):
    for url in (pd_urls["colocated"], pd_urls["router"]):
        info = httpx.get(url + "/get_model_info", timeout=30).json()
        assert info["model_type"] and info["architectures"] and info["architectures"][0].endswith("ForCausalLM")


def test_penalties_through_pd_equal_colocated(pd_urls):
    # Greedy, so any difference is the penalty state: the decode's history must hold the prefill's first token.
    plain = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    penalised = {**plain, "frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.8,
                 "logit_bias": {"101": 3.0}}
    for prompt in ("The quick brown fox", "aaaa"):
        want = generate(pd_urls["colocated"], {"text": prompt, "sampling_params": penalised})["output_ids"]
        assert want != generate(pd_urls["colocated"], {"text": prompt, "sampling_params": plain})["output_ids"]
        assert generate(pd_urls["router"], {"text": prompt, "sampling_params": penalised})["output_ids"] == want
        if "sglang-router" in pd_urls:  # it re-serialises sampling_params and drops logit_bias (0.3.2): penalties only
            no_bias = {k: v for k, v in penalised.items() if k != "logit_bias"}
            want = generate(pd_urls["colocated"], {"text": prompt, "sampling_params": no_bias})["output_ids"]
            got = generate(pd_urls["sglang-router"], {"text": prompt, "sampling_params": no_bias})["output_ids"]
            assert got == want


def test_n_and_max_new_tokens_zero_through_the_router(pd_urls):
    body = {"text": "fan out", "sampling_params": {"n": 3, "max_new_tokens": 4, "temperature": 1.0, "seed": 3}}
    got = generate(pd_urls["router"], body)
    want = generate(pd_urls["colocated"], body)  # seeds derive the same on every node
    assert len(got) == 3 and [a["output_ids"] for a in got] == [a["output_ids"] for a in want]
    zero = generate(pd_urls["router"], {"text": "only the prompt", "return_logprob": True,
                                     "sampling_params": {"max_new_tokens": 0}})
    assert zero["output_ids"] == [] and len(zero["meta_info"]["input_token_logprobs"]) == zero["meta_info"][
        "prompt_tokens"]


def test_batched_prompt_logprobs_as_sgl_select_asks(pd_urls):
    # sgl.select scores each choice with one batched request: text as a list, max_new_tokens 0, prompt logprobs from
    # logprob_start_len. Each answer must carry its own prompt's logprobs, once (a decode answer leaves them out and
    # the router merges the prefill's, answer by answer).
    texts = ["The capital of France is Paris", "The capital of France is London", "x"]
    body = {"text": texts, "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": 4,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0}}
    want = generate(pd_urls["colocated"], body)
    assert [len(a["meta_info"]["input_token_logprobs"]) for a in want] == [
        max(a["meta_info"]["prompt_tokens"] - 4, 0) for a in want]
    assert len(want[0]["meta_info"]["input_token_logprobs"]) > 1
    # The built-in router only: sglang-router 0.3.2 refuses a batched "text" in PD mode (422 "invalid type:
    # sequence, expected a string"), so sgl.select cannot run through it.
    for url in (pd_urls["router"],):
        got = generate(url, body)
        assert len(got) == len(want), url
        for answer, wanted in zip(got, want, strict=True):
            rows, wanted_rows = answer["meta_info"]["input_token_logprobs"], wanted["meta_info"]["input_token_logprobs"]
            assert [r[1:] for r in rows] == [r[1:] for r in wanted_rows], url  # ids and texts
            assert [r[0] for r in rows] == pytest.approx([r[0] for r in wanted_rows], abs=1e-4), url


def test_streamed_n_through_pd_equals_colocated(pd_urls):
    # Streamed fan-out on a PD pair: the prefill node answers every copy, the decode node streams them interleaved,
    # each chunk named by its index; per index the last chunk equals colocated's answer (seeds derive the same).
    body = {"text": ["stream two", "and three"], "stream": True,
            "sampling_params": {"n": 2, "max_new_tokens": 5, "temperature": 1.0, "seed": 7}}

    def last_per_index(url: str) -> dict[int, list[int]]:
        with httpx.stream("POST", url + "/generate", json=body, timeout=TIMEOUT_S) as r:
            assert r.status_code == 200, r.read()
            chunks = [json.loads(line[5:]) for line in r.iter_lines()
                      if line.startswith("data:") and line[5:].strip() != "[DONE]"]
        return {c["index"]: c["output_ids"] for c in chunks}

    want = last_per_index(pd_urls["colocated"])
    assert sorted(want) == [0, 1, 2, 3] and all(len(ids) == 5 for ids in want.values())
    assert last_per_index(pd_urls["router"]) == want
