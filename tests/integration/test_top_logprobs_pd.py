"""Top logprobs through a real PD pair (tiny model) behind the built-in router and the real sglang-router, next to a
colocated node: SGLang's ``input_top_logprobs``/``output_top_logprobs``, OpenAI's ``top_logprobs`` in completions
and chat, and lm-eval's ``local-completions`` loglikelihood request (``echo``, ``logprobs: 1``, ``max_tokens: 0``).

The test process's shared PD cluster (``conftest.pd_urls``: processes started there, stopped by PID); everything on
127.0.0.1.
"""

from __future__ import annotations

import httpx
import pytest
from processes import post_ok, routers

# one xdist worker runs every module on the shared PD cluster (conftest.pd_urls), so that a run starts it once
pytestmark = pytest.mark.xdist_group("shared-pd")

TIMEOUT_S = 180
K = 3






def assert_rows_equal(got: list, want: list) -> None:
    """Rows of ``[[logprob, id, text], ...]`` (or None): the same ids, the same values to float32 noise."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if w is not None:
            assert [x[1] for x in g] == [x[1] for x in w]
            assert [x[0] for x in g] == pytest.approx([x[0] for x in w], abs=1e-4)


def test_generate_top_logprobs_through_pd_equal_colocated(pd_urls):
    body = {"text": "alternatives, please", "return_logprob": True, "top_logprobs_num": K,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    want = post_ok(pd_urls["colocated"], "/generate", body)["meta_info"]
    assert len(want["input_top_logprobs"]) == want["prompt_tokens"] and want["input_top_logprobs"][0] is None
    assert all(len(row) == K for row in want["input_top_logprobs"][1:] + want["output_top_logprobs"])
    for (lp, tid, _), row in zip(want["output_token_logprobs"], want["output_top_logprobs"], strict=True):
        assert row[0][:2] == [lp, tid]  # greedy: the chosen token is the best, with exactly its logprob
    for url in routers(pd_urls):
        meta = post_ok(url, "/generate", body)["meta_info"]
        assert_rows_equal(meta["input_top_logprobs"], want["input_top_logprobs"])  # once, from the prefill
        assert_rows_equal(meta["output_top_logprobs"], want["output_top_logprobs"])
        assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    texts = post_ok(pd_urls["router"], "/generate", {**body, "return_text_in_logprobs": True})["meta_info"]
    assert all(isinstance(x[2], str) for row in texts["output_top_logprobs"] for x in row)


def model_id(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def lm_eval_loglikelihood(url: str, context: list[int], continuation: list[int], text: str | None = None
                          ) -> tuple[float, bool]:
    """What lm-eval's local-completions model does for one (context, continuation) pair: it sends a batch of token
    id lists; sglang-router 0.3.2 takes text prompts only, so there it sends ``text``, their text (lm-eval's
    ``tokenized_requests=False``)."""
    ids = context + continuation
    prompt = [ids] if text is None else text
    body = {"model": model_id(url), "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0,
            "temperature": 0, "seed": 1234}
    choice = post_ok(url, "/v1/completions", body)["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(context + continuation)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
    tokens = lp["token_logprobs"][len(context):]
    tops = lp["top_logprobs"][len(context):]
    return sum(tokens), all(tok == max(top.values()) for tok, top in zip(tokens, tops, strict=True))


def test_lm_eval_loglikelihood_request(pd_urls):
    colocated = pd_urls["colocated"]
    context = post_ok(colocated, "/tokenize", {"prompt": "The quick brown fox"})["tokens"]
    greedy = post_ok(colocated, "/generate", {"input_ids": context, "sampling_params": {
        "max_new_tokens": 3, "temperature": 0, "ignore_eos": True}})["output_ids"]
    other = [(t + 1) % 256 for t in greedy]  # not the greedy continuation
    want = lm_eval_loglikelihood(colocated, context, greedy)
    assert want[1] is True and want[0] < 0
    assert lm_eval_loglikelihood(colocated, context, other)[1] is False
    for url in routers(pd_urls):
        as_text = url == pd_urls.get("sglang-router")
        text = post_ok(colocated, "/detokenize", {"tokens": context + greedy})["text"] if as_text else None
        got = lm_eval_loglikelihood(url, context, greedy, text)
        assert got[1] is True and got[0] == pytest.approx(want[0], abs=1e-4)
        text = post_ok(colocated, "/detokenize", {"tokens": context + other})["text"] if as_text else None
        assert lm_eval_loglikelihood(url, context, other, text)[1] is False


def test_openai_top_logprobs_shapes_through_the_router(pd_urls):
    chat = {"model": model_id(pd_urls["router"]), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}
    want = post_ok(pd_urls["colocated"], "/v1/chat/completions", chat)["choices"][0]["logprobs"]["content"]
    got = post_ok(pd_urls["router"], "/v1/chat/completions", chat)["choices"][0]["logprobs"]["content"]
    assert len(got) == len(want) == 3
    for g, w in zip(got, want, strict=True):
        assert [t["token"] for t in g["top_logprobs"]] == [t["token"] for t in w["top_logprobs"]]
        assert set(g["top_logprobs"][0]) == {"token", "logprob", "bytes"}
        assert g["top_logprobs"][0]["logprob"] == pytest.approx(g["logprob"], abs=1e-6)  # greedy
    completion = {"model": chat["model"], "prompt": "hello", "max_tokens": 2, "temperature": 0, "logprobs": 2}
    lp = post_ok(pd_urls["router"], "/v1/completions", completion)["choices"][0]["logprobs"]
    assert len(lp["top_logprobs"]) == 2 and all(len(top) <= 2 for top in lp["top_logprobs"])
