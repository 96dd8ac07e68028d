"""The colocated engine with the tiny model: greedy output against a pool-free reference, stopping, streaming,
continuous batching, logprobs, aborts and the 400s."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from polling import until
from reference_model import greedy

from fsm_pd.model.loader import LoadedModel, load_model
from fsm_pd.model.sampling import SamplingParams
from fsm_pd.model.tokenizer import ByteTokenizer
from fsm_pd.serving.collect import generate
from fsm_pd.serving.colocated_engine import ColocatedEngine
from fsm_pd.serving.types import EngineError, GenerateRequest, RequestStream

# two computations of the model compared (logits, greedy tokens): float32 products at full precision on a TPU
# too (tests/on_chip.py)
pytestmark = [pytest.mark.chip, pytest.mark.usefixtures("full_precision")]  # chip: tests/on_tpu.sh

PAGES, PAGE_SIZE = 96, 4  # the same pool shape in every serving test, so jitted programs are reused


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


@pytest.fixture(scope="module")
def engine(model):
    e = ColocatedEngine(model, num_pages=PAGES, page_size=PAGE_SIZE)
    yield e
    e.close()


def request(rid, ids, seed=0, **sampling) -> GenerateRequest:
    params = SamplingParams(**{"temperature": 0.0, **sampling})
    return GenerateRequest(rid, list(ids), params, seed=seed)


def ids_of(outs) -> list[int]:
    return [o.token_id for o in outs]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def idle(engine) -> bool:
    info = engine.info()
    return info["pages_reserved"] == 0 and info["requests_live"] == 0


def test_greedy_matches_the_pool_free_reference(engine, model):
    prompt = model.tokenizer.encode("The quick brown fox")
    outs = run(generate(engine, request("g", prompt, max_new_tokens=6, ignore_eos=True)))
    # argmax over the full-sequence forward pass, no KV cache at all
    assert ids_of(outs) == greedy(model.params, prompt, 6, config=model.config)[0]
    again = run(generate(engine, request("g2", prompt, max_new_tokens=6, ignore_eos=True)))
    assert ids_of(again) == ids_of(outs)
    assert outs[-1].finish_reason == {"type": "length"}
    assert outs[-1].meta["prompt_tokens"] == len(prompt) and outs[-1].meta["completion_tokens"] == 6
    assert outs[-1].text == model.tokenizer.decode(ids_of(outs))
    assert until(lambda: idle(engine))


def test_max_new_tokens_and_stream_order(engine, model):
    prompt = model.tokenizer.encode("streaming")

    async def streamed():
        stream = RequestStream("s")
        engine.submit(dataclasses.replace(request("s", prompt, max_new_tokens=12), stream=True), stream)
        got = []
        async for out in stream:
            got.append(out)
        return got

    outs = run(streamed())
    whole = run(generate(engine, request("w", prompt, max_new_tokens=12)))
    assert len(outs) == 12 and ids_of(outs) == ids_of(whole)
    assert [o.finish_reason for o in outs[:-1]] == [None] * 11 and outs[-1].finish_reason == {"type": "length"}
    assert all(o.text is None for o in outs[:-1])


def test_stop_token_and_stop_string(engine, model):
    prompt = model.tokenizer.encode("stop here")
    base = run(generate(engine, request("b", prompt, max_new_tokens=24, ignore_eos=True)))
    tokens = ids_of(base)
    stop_id = tokens[5]
    outs = run(generate(engine, request("t", prompt, max_new_tokens=24, stop_token_ids=(stop_id,))))
    assert ids_of(outs) == tokens[: tokens.index(stop_id) + 1]
    assert outs[-1].finish_reason == {"type": "stop", "matched": stop_id}

    text = base[-1].text
    stop = text[len(text) // 2]
    outs = run(generate(engine, request("s", prompt, max_new_tokens=24, stop=(stop,))))
    assert outs[-1].finish_reason == {"type": "stop", "matched": stop}
    assert outs[-1].text == text[: text.index(stop)]
    assert ids_of(outs) == tokens[: len(outs)] and len(outs) < len(tokens)


def test_eos_stops_unless_ignored(model):
    prompt = model.tokenizer.encode("end of text")
    plain = ColocatedEngine(model, num_pages=PAGES, page_size=PAGE_SIZE)
    try:
        base = ids_of(run(generate(plain, request("b", prompt, max_new_tokens=16, ignore_eos=True))))
    finally:
        plain.close()
    # The tiny model rarely says EOS; a tokenizer that calls a token it does say EOS makes the stop observable.
    eos = base[4]
    tokenizer = ByteTokenizer(model.tokenizer.vocab_size)
    tokenizer.eos_token_ids = (eos,)
    eos_model = LoadedModel(model.name, model.config, model.params, tokenizer)
    e = ColocatedEngine(eos_model, num_pages=PAGES, page_size=PAGE_SIZE)
    try:
        outs = run(generate(e, request("e", prompt, max_new_tokens=16)))
        assert ids_of(outs) == base[: base.index(eos) + 1]
        assert outs[-1].finish_reason == {"type": "stop", "matched": eos}
        ignored = run(generate(e, request("i", prompt, max_new_tokens=16, ignore_eos=True)))
        assert ids_of(ignored) == base
    finally:
        e.close()


def test_concurrent_requests_match_each_run_alone(engine, model):
    prompts = [model.tokenizer.encode(f"request {i}: " + "abc" * i) for i in range(8)]
    alone = [ids_of(run(generate(engine, request(f"a{i}", p, max_new_tokens=10 + i)))) for i, p in enumerate(prompts)]

    async def together():
        return await asyncio.gather(
            *[generate(engine, request(f"c{i}", p, max_new_tokens=10 + i)) for i, p in enumerate(prompts)]
        )

    assert [ids_of(outs) for outs in run(together())] == alone
    assert until(lambda: idle(engine))


def test_sampling_depends_on_seed_not_on_batch(engine, model):
    prompt = model.tokenizer.encode("sample me")
    one = ids_of(run(generate(engine, request("x", prompt, seed=7, temperature=1.0, max_new_tokens=8))))

    async def crowd():
        reqs = [request(f"y{i}", prompt, seed=7 if i == 3 else i, temperature=1.0, max_new_tokens=8) for i in range(5)]
        return await asyncio.gather(*[generate(engine, r) for r in reqs])

    assert ids_of(run(crowd())[3]) == one


def test_logprobs(engine, model):
    prompt = model.tokenizer.encode("logprobs")
    outs = run(generate(engine, dataclasses.replace(request("l", prompt, max_new_tokens=4), return_logprob=True)))
    first = outs[0].input_token_logprobs
    assert len(first) == len(prompt) and first[0] is None and all(x <= 0 for x in first[1:])
    assert all(o.logprob is not None and o.logprob <= 0 for o in outs)
    assert all(o.input_token_logprobs is None for o in outs[1:])
    plain = run(generate(engine, request("p", prompt, max_new_tokens=4)))
    assert all(o.logprob is None for o in plain) and ids_of(plain) == ids_of(outs)


def test_abort_mid_stream_frees_pages(engine, model):
    assert until(lambda: idle(engine))
    baseline = engine.allocator.free_pages

    async def abort_after_three():
        stream = RequestStream("ab")
        engine.submit(
            request("ab", model.tokenizer.encode("a long answer"), max_new_tokens=200, ignore_eos=True), stream
        )
        got = 0
        with pytest.raises(EngineError) as err:
            async for _ in stream:
                got += 1
                if got == 3:
                    assert engine.abort("ab")
        return got, err.value

    got, err = run(abort_after_three())
    assert err.status == 499 and got >= 3
    assert not engine.abort("ab")  # already gone
    assert until(lambda: idle(engine) and engine.allocator.free_pages == baseline)


def test_requests_that_can_never_run_get_400(engine, model):
    with pytest.raises(EngineError) as err:
        engine.submit(request("long", [1] * engine.max_context), RequestStream("long", asyncio.new_event_loop()))
    assert err.value.status == 400 and "context length" in str(err.value)
    with pytest.raises(EngineError) as err:
        engine.submit(request("empty", []), RequestStream("empty", asyncio.new_event_loop()))
    assert err.value.status == 400
    assert engine.info()["requests_live"] == 0
