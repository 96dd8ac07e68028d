"""Top logprobs (the k most likely tokens per position) against a numpy log-softmax of the pool-free reference
logits: the prefill's for prompt positions, the host's for output tokens, the READY wire form, and a PD pair equal
to a colocated engine."""

from __future__ import annotations

import asyncio
import dataclasses

import jax
import numpy as np
import pytest
from reference_model import reference_logits
from test_serving_colocated import PAGE_SIZE, PAGES, request, run
from test_serving_pd import pd, pd_request, through_pd  # noqa: F401 (pd is a fixture)

from fsm_pd.model.loader import load_model
from fsm_pd.serving import top_logprobs
from fsm_pd.serving.collect import generate
from fsm_pd.serving.colocated_engine import ColocatedEngine
from fsm_pd.serving.types import EngineError, RequestStream

# two computations of the model compared (logits, greedy tokens): float32 products at full precision on a TPU
# too (tests/on_chip.py)
pytestmark = [pytest.mark.chip, pytest.mark.usefixtures("full_precision")]  # chip: tests/on_tpu.sh

ATOL = 2e-5  # float32 on CPU, same weights: only summation order differs from the reference
# A log-softmax computed on the chip (the prefill's rows for prompt positions): a TPU's float32 exp and log are
# approximations, which put a whole row's normalizer off by ~1.7e-5 of it (+-6e-5 at -3.8 on the v5e, the same for
# every token of the row), while the gaps between the row's values stay within ATOL as on a CPU. The row's level is
# held to this, its shape to ATOL; on a CPU both to ATOL.
DEVICE_LEVEL = ATOL if jax.default_backend() == "cpu" else 3e-4


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


@pytest.fixture(scope="module")
def engine(model):
    e = ColocatedEngine(model, num_pages=PAGES, page_size=PAGE_SIZE)
    yield e
    e.close()


def reference_log_softmax(model, ids) -> np.ndarray:
    """``[len(ids), V]``: row ``i`` is the distribution of the token after ``ids[: i + 1]``."""
    logits = reference_logits(model.params, ids, config=model.config).astype(np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))


def assert_top_matches(row, ref_row: np.ndarray, k: int, level: float = ATOL) -> None:
    """``row`` holds the k best tokens of ``ref_row``, best first: its values are the reference's k largest, and
    each id has its value in the reference (near-ties may swap ids, never values). The values' distances from the
    best are held to ``ATOL``, the best itself to ``level`` (``DEVICE_LEVEL`` where the chip computed the row)."""
    assert len(row) == k
    values = np.array([lp for lp, _ in row])
    ids = [tid for _, tid in row]
    assert list(values) == sorted(values, reverse=True) and len(set(ids)) == k
    best = np.sort(ref_row)[::-1][:k]
    np.testing.assert_allclose(values[0], best[0], atol=level)
    np.testing.assert_allclose(values - values[0], best - best[0], atol=ATOL)
    np.testing.assert_allclose(values - values[0], ref_row[ids] - best[0], atol=ATOL)


def test_prefill_top_logprobs_match_the_reference(model):
    prompts = [model.tokenizer.encode("top alternatives of a prompt"), model.tokenizer.encode("another one"),
               model.tokenizer.encode("none here")]
    pool = model.make_pool(model.make_kv_layout(64, 4))
    pages = [list(range(1, 9)), list(range(9, 17)), list(range(17, 25))]
    out = model.prefill_batch(pool, prompts, pages, return_logprobs=True, top_logprobs=[5, 20, 0])
    assert out.token_top_logprobs[2] is None  # k = 0: nothing computed for that prompt
    for prompt, k, rows, chosen in zip(prompts[:2], (5, 20), out.token_top_logprobs, out.token_logprobs,
                                       strict=False):
        ref = reference_log_softmax(model, prompt)
        assert rows[0] is None and len(rows) == len(prompt)
        for pos in range(1, len(prompt)):
            assert_top_matches(rows[pos], ref[pos - 1], k, DEVICE_LEVEL)
            # the chosen token's logprob and the alternatives come from one log-softmax: equal when it is the best
            if rows[pos][0][1] == prompt[pos]:
                assert chosen[pos] == rows[pos][0][0]


def test_chosen_and_top_on_the_host_match_numpy():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(3, 50)).astype(np.float32) * 4
    logits[1, [7, 9]] = logits[1].max() + 1  # a tie for the best: the lower id first
    tokens = np.array([int(np.argmax(logits[0])), 9, 4])
    chosen, tops = top_logprobs.chosen_and_top(logits, tokens, [3, 2, 0])
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(axis=-1, keepdims=True))
    np.testing.assert_allclose(chosen, ref[np.arange(3), tokens], atol=1e-5)
    assert [tid for _, tid in tops[0]] == list(np.argsort(-ref[0])[:3])
    assert [tid for _, tid in tops[1]] == [7, 9] and tops[2] is None
    assert chosen[0] == tops[0][0][0]  # greedy: exactly the best value (lm-eval's is_greedy test compares them)
    assert top_logprobs.chosen_and_top(logits, tokens, [25, 0, 0])[1][0].__len__() == 20  # capped at 20


def test_wire_round_trip_is_lossless_and_checked():
    first = [(-0.25, 3), (-1.5, 7)]
    prompt = [None, [(-0.125, 1), (-2.0, 2)], [(np.float32(-0.3).item(), 5), (-4.0, 0)]]  # float32 values
    text = top_logprobs.to_wire(first, prompt)
    assert len(text) == top_logprobs.wire_bytes(2, 3)
    assert top_logprobs.from_wire(text) == (first, prompt)
    assert top_logprobs.to_wire(None, None) is None and top_logprobs.from_wire(None) == (None, None)
    with pytest.raises(ValueError):
        top_logprobs.from_wire(text[:-8])
    with pytest.raises(ValueError):
        top_logprobs.to_wire(first, [None, [(-0.1, 1)]])  # rows of different k


def test_colocated_output_top_logprobs_match_the_reference(engine, model):
    prompt = model.tokenizer.encode("output alternatives")
    req = dataclasses.replace(request("t", prompt, max_new_tokens=5), return_logprob=True, top_logprobs_num=4)
    outs = run(generate(engine, req))
    ids = prompt + [o.token_id for o in outs]
    ref = reference_log_softmax(model, ids)
    for i, out in enumerate(outs):
        assert_top_matches(out.top_logprobs, ref[len(prompt) - 1 + i], 4)
        assert out.top_logprobs[0][1] == out.token_id and out.logprob == out.top_logprobs[0][0]  # greedy
    rows = outs[0].input_top_logprobs
    assert rows[0] is None and len(rows) == len(prompt)
    for pos in range(1, len(prompt)):
        assert_top_matches(rows[pos], ref[pos - 1], 4, DEVICE_LEVEL)
    assert all(o.input_top_logprobs is None for o in outs[1:])
    plain = run(generate(engine, dataclasses.replace(req, rid="t0", top_logprobs_num=0)))
    assert all(o.top_logprobs is None for o in plain) and plain[0].input_top_logprobs is None


def test_pd_top_logprobs_equal_colocated(pd, engine, model):  # noqa: F811
    p, d = pd
    prompt = model.tokenizer.encode("alternatives over the wire")
    req = dataclasses.replace(pd_request(p, "pt", prompt, max_new_tokens=4), return_logprob=True,
                              top_logprobs_num=3)
    through = run(through_pd(p, d, req))
    alone = run(generate(engine, dataclasses.replace(req, rid="pt-c", bootstrap=None)))
    assert [o.token_id for o in through] == [o.token_id for o in alone]
    # the first token's and the prompt's rows crossed in READY; the rest the decode node computed
    assert through[0].input_top_logprobs == alone[0].input_top_logprobs
    for a, b in zip(through, alone, strict=True):
        assert a.logprob == b.logprob
        assert [t for _, t in a.top_logprobs] == [t for _, t in b.top_logprobs]
        np.testing.assert_allclose([v for v, _ in a.top_logprobs], [v for v, _ in b.top_logprobs], atol=ATOL)


def test_pd_refuses_top_logprobs_too_large_for_ready(pd, model):  # noqa: F811
    p, _ = pd
    req = dataclasses.replace(pd_request(p, "big", [65] * 4000, max_new_tokens=1), return_logprob=True,
                              top_logprobs_num=20)
    assert top_logprobs.wire_bytes(20, 4000) > top_logprobs.WIRE_BUDGET_BYTES
    with pytest.raises(EngineError) as err:
        p.submit(req, RequestStream("big", loop=asyncio.new_event_loop()))
    assert err.value.status == 400 and "top_logprobs_num=20" in str(err.value)
