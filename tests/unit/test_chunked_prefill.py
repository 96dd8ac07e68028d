"""Chunked prefill: a prompt longer than the step budget prefills over several steps and answers as a whole prefill
does (tokens, and prompt logprobs across the chunks' boundaries), colocated and through PD; on a colocated node the
running streams get tokens between the chunks."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
from node_sockets import node_sockets
from test_serving_colocated import PAGE_SIZE, PAGES, ids_of, request, run, until
from test_serving_pd import pd_request, through_pd

from fsm_pd.model.loader import LoadedModel, load_model
from fsm_pd.model.params import random_params
from fsm_pd.serving.collect import generate
from fsm_pd.serving.colocated_engine import ColocatedEngine
from fsm_pd.serving.decode_engine import DecodeEngine
from fsm_pd.serving.prefill_engine import PrefillEngine
from fsm_pd.serving.types import RequestStream

# two computations of the model compared (logits, greedy tokens): float32 products at full precision on a TPU
# too (tests/on_chip.py)
pytestmark = [pytest.mark.chip, pytest.mark.usefixtures("full_precision")]  # chip: tests/on_tpu.sh

CHUNK = 32  # tokens a step prefills: the prompts below take 2 to 8 steps


@pytest.fixture(scope="module")
def model():
    """The tiny model with sharp attention (see test_prefix_cache_serving): a chunk that saw the wrong KV shows."""
    tiny = load_model("tiny")
    return LoadedModel("tiny-sharp", tiny.config, random_params(tiny.config, seed=0, std=0.5), tiny.tokenizer)


def prompts(tokenizer) -> list[list[int]]:
    text = "a long prompt that will not fit one prefill step, so it goes in chunks; " * 4
    return [tokenizer.encode(text[: n]) for n in (40, 63, 64, 65, 130, 250)]


def test_colocated_chunks_answer_as_a_whole_prefill_with_the_same_prompt_logprobs(model):
    whole = ColocatedEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, chunked_prefill_size=512, radix_cache=False)
    chunked = ColocatedEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, chunked_prefill_size=CHUNK,
                              radix_cache=False)

    async def both(engine, tag):
        return await asyncio.gather(*(generate(engine, dataclasses.replace(
            request(f"{tag}{i}", x, max_new_tokens=8, ignore_eos=True), return_logprob=True))
            for i, x in enumerate(prompts(model.tokenizer))))

    try:
        want, got = run(both(whole, "w")), run(both(chunked, "c"))
        assert [ids_of(o) for o in got] == [ids_of(o) for o in want]
        for a, b in zip(got, want, strict=True):
            mine, theirs = a[0].input_token_logprobs, b[0].input_token_logprobs
            assert mine[0] is None and len(mine) == len(theirs)
            np.testing.assert_allclose(mine[1:], theirs[1:], atol=2e-4)
        assert until(lambda: chunked.info()["requests_live"] == 0 and chunked.info()["pages_reserved"] == 0)
    finally:
        whole.close()
        chunked.close()


def test_pd_prefill_node_chunks_answer_as_colocated(model, tmp_path):
    colocated = ColocatedEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, radix_cache=False)
    p = PrefillEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", journal=str(tmp_path / "p.db"),
                      chunked_prefill_size=CHUNK, **node_sockets(tmp_path, "p", bootstrap=True))
    d = DecodeEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", secret=p.secret,
                     journal=str(tmp_path / "d.db"), **node_sockets(tmp_path, "d"))
    try:
        for i, x in enumerate(prompts(model.tokenizer)):
            want = ids_of(run(generate(colocated, request(f"w{i}", x, max_new_tokens=6, ignore_eos=True))))
            assert ids_of(run(through_pd(p, d, pd_request(p, f"g{i}", x, max_new_tokens=6, ignore_eos=True)))) == want
        info = p.info()  # every prompt token computed once, in chunks, or taken from the cache (the prompts overlap)
        total = sum(map(len, prompts(model.tokenizer)))
        assert info["prefill_computed_tokens"] + info["prefill_cached_tokens"] == total
    finally:
        d.close()
        p.close()
        colocated.close()


def test_a_long_prompt_does_not_stall_the_running_streams(model):
    """While a prompt of eight chunks prefills, a stream already decoding gets a token at every step: its tokens
    keep coming between the long prompt's arrival and its first token."""
    engine = ColocatedEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, chunked_prefill_size=CHUNK,
                             radix_cache=False)
    running = request("running", model.tokenizer.encode("short"), max_new_tokens=60, ignore_eos=True)
    long_prompt = model.tokenizer.encode("x" * (8 * CHUNK))

    async def scene():
        stream = RequestStream("running")
        engine.submit(running, stream)
        seen = [await anext(aiter(stream))]  # decoding now
        long = asyncio.ensure_future(generate(engine, request("long", long_prompt, max_new_tokens=1)))
        arrivals = []  # ("running" | "long", order) as the engine answers them
        async for out in stream:
            seen.append(out)
            if long.done() and not any(tag == "long" for tag, _ in arrivals):
                arrivals.append(("long", len(seen)))
            arrivals.append(("running", len(seen)))
        await long
        return arrivals, len(seen)

    try:
        arrivals, total = run(scene())
        before_long = next((i for i, (tag, _) in enumerate(arrivals) if tag == "long"), len(arrivals))
        # eight chunk steps, each followed by a decode step of the running stream
        assert before_long >= 7, arrivals[:12]
        assert total == 60
    finally:
        engine.close()
