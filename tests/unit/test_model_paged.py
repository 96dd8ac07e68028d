"""The paged decoder against the contiguous reference: attention alone, whole-model prefill, decode and batching."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_model

from fsm_pd.model import decoder
from fsm_pd.model.attention import paged_attention, reference_attention
from fsm_pd.model.loader import load_model
from fsm_pd.model.params import random_params
from fsm_pd.model.tiny import tiny_config

# two computations of the model compared (logits, greedy tokens): float32 products at full precision on a TPU
# too (tests/on_chip.py)
pytestmark = [pytest.mark.chip, pytest.mark.usefixtures("full_precision")]  # chip: tests/on_tpu.sh

ATOL = 2e-5  # float32 on CPU, same weights: only summation order differs between the two paths


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def fresh_pool(model, num_pages=32, page_size=4):
    return model.make_pool(model.make_kv_layout(num_pages, page_size))


def reference_logits(model, ids):
    return reference_model.reference_logits(model.params, ids, config=model.config)  # a program per length bucket


PROMPT = [72, 101, 108, 108, 111, 44, 32, 112, 97, 103, 101, 100, 32, 75, 86, 33, 10]  # 17 tokens


def test_paged_attention_matches_contiguous_reference_on_scattered_pages():
    rng = np.random.default_rng(1)
    seq, heads, kv_heads, dim, page_size = 11, 4, 2, 8, 4
    q, k, v = (rng.normal(size=(seq, h, dim)).astype(np.float32) for h in (heads, kv_heads, kv_heads))
    pool = np.zeros((9, page_size, 2 * kv_heads * dim), np.float32)
    table = np.asarray([[6, 2, 8]], np.int32)  # out of order on purpose
    # each under jit, as the model runs it: op by op they were 61 programs, each compiled for the chip
    out, pool = jax.jit(paged_attention)(q[None], k[None], v[None], pool, table, np.asarray([0], np.int32),
                                         np.asarray([seq], np.int32))
    expected = jax.jit(reference_attention)(q, k, v)
    np.testing.assert_allclose(np.asarray(out)[0], np.asarray(expected), atol=1e-5)
    # K/V of position 5 sit in the table's second page, offset 1, K then V of each head.
    row = np.asarray(pool)[2, 1].reshape(kv_heads, 2, dim)
    np.testing.assert_array_equal(row[:, 0], k[5])
    np.testing.assert_array_equal(row[:, 1], v[5])


def test_prefill_logits_and_logprobs_match_reference(tiny):
    result = tiny.prefill(fresh_pool(tiny), PROMPT, [3, 9, 4, 12, 7], return_logprobs=True)
    ref = reference_logits(tiny, PROMPT)
    np.testing.assert_allclose(np.asarray(result.logits), ref[-1], atol=ATOL)
    ref_logprobs = np.asarray(jax.nn.log_softmax(ref, axis=-1))
    expected = [float(ref_logprobs[i, PROMPT[i + 1]]) for i in range(len(PROMPT) - 1)]
    assert result.token_logprobs[0] is None
    assert len(result.token_logprobs) == len(PROMPT)
    np.testing.assert_allclose(result.token_logprobs[1:], expected, atol=ATOL)


def test_prompt_over_many_small_pages_gives_the_one_page_logits(tiny):
    many = tiny.prefill(fresh_pool(tiny, page_size=4), PROMPT, [9, 3, 14, 2, 11])
    one = tiny.prefill(fresh_pool(tiny, num_pages=4, page_size=64), PROMPT, [1])
    np.testing.assert_allclose(np.asarray(many.logits), np.asarray(one.logits), atol=ATOL)


def test_decode_steps_after_prefill_match_reference(tiny):
    pages = [5, 1, 7, 2, 9, 3]  # room for 24 tokens
    result = tiny.prefill(fresh_pool(tiny), PROMPT, pages)
    pool, ids = result.pool, list(PROMPT)
    token = int(np.argmax(np.asarray(result.logits)))
    for _ in range(5):
        logits, pool = tiny.decode(pool, [token], [len(ids)], [pages])
        ids.append(token)
        np.testing.assert_allclose(np.asarray(logits)[0], reference_logits(tiny, ids)[-1], atol=ATOL)
        token = int(np.argmax(np.asarray(logits)[0]))


def with_sentinel(layer, page=13, value=7.0):
    host = np.array(layer)  # a copy
    host[page] = value
    return jax.device_put(host, layer.sharding)


def test_batched_decode_with_padding_rows_leaves_other_pages_alone(tiny):
    pool = fresh_pool(tiny, num_pages=16)
    prompts = {0: (PROMPT[:6], [3, 4]), 1: (PROMPT[:9], [6, 8, 10])}
    for ids, pages in prompts.values():
        pool = tiny.prefill(pool, ids, pages).pool
    pool = tiny.prefill(pool, [1, 2], [12]).pool
    # A sentinel in a page nobody owns: the padding row (3 rows -> bucket of 4) must write only to the pad page.
    # (Set and read on the host: on the device each step is a program of its own.)
    pool = tuple(map(with_sentinel, pool))
    tokens = [65, 66, 67]
    positions = [len(prompts[0][0]), len(prompts[1][0]), 2]
    tables = [[3, 4, 0], [6, 8, 10], [12, 0, 0]]
    logits, pool = tiny.decode(pool, tokens, positions, tables)
    assert logits.shape == (3, tiny.config.vocab_size)
    for row, (ids, _) in prompts.items():
        expected = reference_logits(tiny, ids + [tokens[row]])[-1]
        np.testing.assert_allclose(np.asarray(logits)[row], expected, atol=ATOL)
    np.testing.assert_allclose(np.asarray(logits)[2], reference_logits(tiny, [1, 2, 67])[-1], atol=ATOL)
    for layer in pool:
        assert (np.asarray(layer)[13] == 7.0).all()


def test_chunked_prefill_equals_whole_prefill(tiny):
    pages = [2, 6, 3, 8, 5]
    whole = tiny.prefill(fresh_pool(tiny), PROMPT, pages)
    first = tiny.prefill(fresh_pool(tiny), PROMPT[:7], pages)
    second = tiny.prefill(first.pool, PROMPT[7:], pages, start_pos=7)
    np.testing.assert_allclose(np.asarray(second.logits), np.asarray(whole.logits), atol=ATOL)


def test_prefill_batch_equals_one_by_one(tiny):
    prompts = [PROMPT, PROMPT[:3], PROMPT[4:12]]
    pages = [[1, 2, 3, 4, 5], [6], [7, 8]]
    batch = tiny.prefill_batch(fresh_pool(tiny), prompts, pages)
    for row, (ids, own) in enumerate(zip(prompts, pages, strict=True)):
        single = tiny.prefill(fresh_pool(tiny), ids, own)
        np.testing.assert_allclose(np.asarray(batch.logits)[row], np.asarray(single.logits), atol=ATOL)


def test_prompts_in_one_bucket_share_one_compiled_program(tiny):
    pool = fresh_pool(tiny, num_pages=40)
    # 9, 13 and 14 tokens: all in the 16-token bucket, and 3 or 4 pages of 4 -> the 4-page bucket.
    pool = tiny.prefill(pool, PROMPT[:9], [1, 2, 3]).pool
    before = decoder.TRACE_COUNTS["forward_group"]
    pool = tiny.prefill(pool, PROMPT[:13], [4, 5, 6, 7]).pool
    pool = tiny.prefill(pool, PROMPT[:14], [8, 9, 10, 11]).pool
    assert decoder.TRACE_COUNTS["forward_group"] == before


@pytest.mark.parametrize(
    "pages, error",
    [([1, 0, 2, 3, 4], "padding page"), ([1, 2, 3], "need 5 pages"), ([1, 2, 3, 4, 99], "out of range")],
)
def test_prefill_rejects_bad_page_lists(tiny, pages, error):
    with pytest.raises(ValueError, match=error):
        tiny.prefill(fresh_pool(tiny), PROMPT, pages)


@pytest.mark.parametrize(
    "positions, tables, error",
    [
        ([4], [[3, 0]], "padding page"),  # position 4 falls in the table's page 0
        ([2, 8], [[3, 0], [5, 6]], "needs 3 pages"),
        ([1], [[40]], "out of range"),
    ],
)
def test_decode_rejects_bad_page_tables(tiny, positions, tables, error):
    with pytest.raises(ValueError, match=error):
        tiny.decode(fresh_pool(tiny), [1] * len(positions), positions, tables)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_variants_paged_match_reference(family):
    config = dataclasses.replace(
        tiny_config(), family=family, attention_bias=family == "qwen2", qk_norm=family == "qwen3",
        tie_word_embeddings=False, rope_theta=1e6,
    )  # fmt: skip
    params = random_params(config, seed=3, std=0.1)
    if family == "qwen3":  # random norms, so the per-head q/k norm weights are exercised, not all ones
        for layer in params["layers"]:
            layer["q_norm"] = layer["q_norm"] * jnp.linspace(0.5, 1.5, config.head_dim)
            layer["k_norm"] = layer["k_norm"] * jnp.linspace(1.5, 0.5, config.head_dim)
    pool = tuple(jnp.zeros((8, 4, 2 * config.num_kv_heads * config.head_dim)) for _ in range(config.num_layers))
    result = decoder.prefill(config, params, pool, PROMPT[:10], [4, 2, 6])
    ref = reference_model.reference_logits(params, PROMPT[:10], config=config)
    np.testing.assert_allclose(np.asarray(result.logits), ref[-1], atol=ATOL)


def test_bfloat16_model_and_pool_stay_close_to_float32(tiny):
    half = load_model("tiny", dtype="bfloat16")
    pool = half.make_pool(half.make_kv_layout(16, 4))
    assert pool[0].dtype == jnp.bfloat16
    result = half.prefill(pool, PROMPT, [1, 2, 3, 4, 5])
    logits, _ = half.decode(result.pool, [65], [len(PROMPT)], [[1, 2, 3, 4, 5]])
    expected = reference_logits(tiny, PROMPT + [65])[-1]
    assert logits.dtype == jnp.float32
    # bfloat16 keeps 8 mantissa bits: ~0.4% per rounding, a few percent of the logit spread after two layers.
    assert float(np.abs(np.asarray(logits)[0] - expected).max()) < 0.05 * float(np.ptp(expected))
