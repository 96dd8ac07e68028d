"""The tensor-parallel model on 4 virtual CPU devices: the same greedy tokens as one device, a pool written in place.

Not collected by a plain ``pytest`` run: the device count is fixed when jax creates its CPU client, so
``tests/unit/test_tensor_parallel.py`` runs this file in a fresh interpreter with
``XLA_FLAGS=--xla_force_host_platform_device_count=4``. By hand::

    XLA_FLAGS=--xla_force_host_platform_device_count=4 pytest tests/unit/tp_mesh/tp_model_check.py
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsm_pd.kernels.layout import PAD_HEAD, kv_view
from fsm_pd.model.loader import LoadedModel, with_tensor_parallel
from fsm_pd.model.params import random_params
from fsm_pd.model.tiny import tiny_config, tiny_model_parts
from fsm_pd.model.tokenizer import ByteTokenizer

PAGE_SIZE = 4
PROMPT = [5, 17, 99, 3, 200, 41, 7, 7, 130, 12, 64, 250, 33]
STEPS = 12


@pytest.fixture(scope="module", autouse=True)
def four_devices():
    if jax.device_count() != 4:
        pytest.fail(f"needs XLA_FLAGS=--xla_force_host_platform_device_count=4, found {jax.device_count()} devices")


def random_llama(heads: int, kv_heads: int, head_dim: int = 8, *, qk_norm: bool = False, bias: bool = False,
                 layers: int = 2):
    """A random Llama of the tiny model's size with other head counts (weights as big as tiny's, so greedy picks
    are far from ties)."""
    config = dataclasses.replace(tiny_config(), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                 qk_norm=qk_norm, attention_bias=bias, family="qwen3" if qk_norm else "llama",
                                 num_layers=layers)
    return LoadedModel(f"llama-{heads}-{kv_heads}", config, random_params(config, seed=3, std=0.1),
                       ByteTokenizer(vocab_size=272))


def greedy(model: LoadedModel, prompt=PROMPT, steps=STEPS):
    """Prefill then ``steps`` greedy decode steps; returns the tokens, every step's logits and the final pool."""
    layout = model.make_kv_layout(16, PAGE_SIZE)
    pages = list(range(3, 3 + (len(prompt) + steps) // PAGE_SIZE + 1))
    result = model.prefill(model.make_pool(layout), prompt, pages)
    pool, logits = result.pool, [np.asarray(result.logits)]
    tokens = [int(np.argmax(logits[-1]))]
    for step in range(steps):
        out, pool = model.decode(pool, [tokens[-1]], [len(prompt) + step], [pages])
        logits.append(np.asarray(out[0]))
        tokens.append(int(np.argmax(logits[-1])))
    return tokens, logits, pool


CASES = {
    # name: (model, tp sizes): KV heads >= TP, KV heads < TP (replicated), and neither dividing (padded)
    "llama 8/4": (lambda: random_llama(8, 4), (2, 4)),
    "tiny 4/2": (lambda: LoadedModel("tiny", *tiny_model_parts()), (2, 4)),
    "smollm2-shaped 9/3": (lambda: random_llama(9, 3), (2, 3, 4)),
    "qwen3-style 6/2, qk-norm and bias": (lambda: random_llama(6, 2, qk_norm=True, bias=True), (4,)),
    # 13 layers: the forward pass runs as groups of 4, 4 and 5 layers (forward_shapes.layer_groups), each split
    "smollm2-shaped 9/3, 13 layers": (lambda: random_llama(9, 3, layers=13), (2,)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_equal_one_device(name):
    make, sizes = CASES[name]
    model = make()
    want, want_logits, want_pool = greedy(model)
    for tp in sizes:
        split = with_tensor_parallel(model, tp)
        got, logits, pool = greedy(split)
        assert got == want, f"{name}, tp {tp} ({split.tp.describe()}): {got} != {want}"
        np.testing.assert_allclose(np.stack(logits), np.stack(want_logits), atol=1e-4, rtol=1e-4)
        # every KV slot holds its model head's K and V (summation order aside); padding slots exact +0.0 bytes
        for layer, (mine, theirs) in enumerate(zip(pool, want_pool, strict=True)):
            mine, theirs = kv_view(np.asarray(mine), model.config.head_dim), kv_view(np.asarray(theirs),
                                                                                      model.config.head_dim)
            for slot, head in enumerate(split.tp.slot_heads):
                held = mine[:, :, slot]
                if head == PAD_HEAD:
                    assert not held.view(np.uint32).any(), f"layer {layer} padding slot {slot} is not +0.0"
                else:
                    np.testing.assert_allclose(held, theirs[:, :, head], atol=1e-5)


def test_the_split_is_as_designed():
    smol = with_tensor_parallel(random_llama(9, 3), 2).tp
    assert smol.slot_heads == (0, 1, 2, PAD_HEAD)
    assert smol.query_heads == (0, 1, 2, 3, 4, 5, 6, 7, 8, PAD_HEAD, PAD_HEAD, PAD_HEAD)
    assert (smol.shard_config.num_heads, smol.shard_config.num_kv_heads) == (6, 2)
    tiny = with_tensor_parallel(LoadedModel("tiny", *tiny_model_parts()), 4).tp
    assert tiny.slot_heads == (0, 0, 1, 1) and tiny.query_heads == (0, 1, 2, 3)
    assert "each KV head on 2 devices" in tiny.describe()
    layout = with_tensor_parallel(random_llama(8, 4), 2).make_kv_layout(16, PAGE_SIZE)
    assert (layout.tp, layout.shard_axis, layout.slots) == (2, "tp", 4)


def test_a_sharded_step_writes_the_pool_in_place():
    model = with_tensor_parallel(LoadedModel("tiny", *tiny_model_parts()), 2)
    sizes = {}
    for pages in (64, 4096):
        pool = model.make_pool(model.make_kv_layout(pages, 16))
        compiled = model.programs(pool).compile(8, 1)
        analysis = compiled.memory_analysis()
        # per device: each holds half the pool, and all of it is aliased to the output
        assert analysis.alias_size_in_bytes == sum(layer.nbytes for layer in pool) // 2
        sizes[pages] = analysis.temp_size_in_bytes
    assert sizes[64] == sizes[4096], f"temporaries grew with the pool: {sizes}"
    pool = model.make_pool(model.make_kv_layout(64, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Some donated buffers were not usable"
        after = model.prefill(pool, PROMPT, [1]).pool
    assert all(layer.is_deleted() for layer in pool)
    assert after[0].sharding == pool[0].sharding


def test_too_few_devices_is_a_clear_error():
    with pytest.raises(ValueError, match="jax sees 4 cpu device"):
        with_tensor_parallel(LoadedModel("tiny", *tiny_model_parts()), 8)


def test_logits_are_replicated_on_the_mesh():
    model = with_tensor_parallel(LoadedModel("tiny", *tiny_model_parts()), 4)
    out = model.prefill(model.make_pool(model.make_kv_layout(8, 16)), PROMPT, [1])
    assert out.logits.sharding.is_fully_replicated and len(out.logits.sharding.device_set) == 4
    assert jnp.isfinite(out.logits).all()
