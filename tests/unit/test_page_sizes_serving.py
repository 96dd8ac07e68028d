"""The engines at the page sizes a TPU pool may get (64 and 128 tokens a page; ``kernels/layout.py``'s
``PAGE_SIZES``), on the TPU kernels (``FSM_PD_ATTENTION=interpret`` off a TPU: Pallas's interpret mode; ``tpu`` on one):
a colocated engine and a prefill engine handing off to a decode engine (real side channel and bootstrap server, the
in-process ``fake`` data plane) give the greedy answers of the pool-free jnp reference, and their logprobs (a greedy
answer alone can outlast a wrong row of KV). The model has SmolLM2's heads
(9 of 64, 3 KV heads), so the kernels take it (the tiny model's head_dim 16 would run jnp whatever was asked), and one
layer: the kernels are per layer. The prompts: one inside its first page, one past a page's end.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from node_sockets import node_sockets
from reference_model import greedy
from test_serving_colocated import ids_of, request, run
from test_serving_pd import assert_idle, pd_request, through_pd

from fsm_pd.model.attention import ATTENTION_ENV
from fsm_pd.model.loader import LoadedModel
from fsm_pd.model.params import random_params
from fsm_pd.model.tiny import tiny_config
from fsm_pd.model.tokenizer import ByteTokenizer
from fsm_pd.serving.collect import generate
from fsm_pd.serving.colocated_engine import ColocatedEngine
from fsm_pd.serving.decode_engine import DecodeEngine
from fsm_pd.serving.prefill_engine import PrefillEngine

pytestmark = [pytest.mark.chip, pytest.mark.usefixtures("full_precision")]  # chip: tests/on_tpu.sh

KERNELS = "tpu" if jax.default_backend() == "tpu" else "interpret"
NEW_TOKENS = 6
TOLERANCE = 3e-2 if KERNELS == "tpu" else 1e-4  # float32 on a CPU; the chip's products as in test_tpu_attention.py
PAGES = 8


@pytest.fixture(scope="module")
def model():
    config = dataclasses.replace(tiny_config(), num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=128,
                                 num_layers=1)
    return LoadedModel("heads-64", config, random_params(config, seed=5, std=0.1),
                       ByteTokenizer(vocab_size=config.vocab_size))


def prompts_for(page_size: int) -> list[list[int]]:
    rng = np.random.default_rng(page_size)
    return [rng.integers(1, 250, size=n).tolist() for n in (5, page_size + 21)]


def assert_answers(outs, model, prompt: list[int]) -> None:
    # greedy tokens of the full-sequence forward pass (no pool, no kernels), and each one's logprob
    tokens, logprobs = greedy(model.params, prompt, NEW_TOKENS, config=model.config)
    assert ids_of(outs) == tokens, len(prompt)
    np.testing.assert_allclose([o.logprob for o in outs], logprobs, atol=TOLERANCE, err_msg=f"{len(prompt)} tokens")


def assert_kernels(model, page_size: int) -> None:
    """The programs the engines made for pools of ``page_size`` run the TPU kernels, not a fallback to jnp."""
    made = [programs for programs in model._programs.values() if programs._pool[0].shape[1] == page_size]
    assert made and all(programs.kernels == KERNELS for programs in made)


@pytest.mark.parametrize("page_size", [64, 128], ids=lambda p: f"page-{p}")
def test_a_colocated_engine_on_the_kernels_answers_as_the_reference(model, page_size, monkeypatch):
    monkeypatch.setenv(ATTENTION_ENV, KERNELS)
    engine = ColocatedEngine(model, num_pages=PAGES, page_size=page_size)
    try:
        for i, prompt in enumerate(prompts_for(page_size)):
            req = request(f"c{i}", prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True)
            assert_answers(run(generate(engine, dataclasses.replace(req, return_logprob=True))), model, prompt)
        assert_kernels(model, page_size)
    finally:
        engine.close()


def test_a_pd_pair_on_the_kernels_answers_as_the_reference(model, tmp_path, monkeypatch):
    page_size = 128
    monkeypatch.setenv(ATTENTION_ENV, KERNELS)
    p = PrefillEngine(model, num_pages=PAGES, page_size=page_size, backend="fake", journal=str(tmp_path / "p.db"),
                      **node_sockets(tmp_path, "p", bootstrap=True))
    d = DecodeEngine(model, num_pages=PAGES, page_size=page_size, backend="fake", secret=p.secret,
                     journal=str(tmp_path / "d.db"), **node_sockets(tmp_path, "d"))
    try:
        for i, prompt in enumerate(prompts_for(page_size)):
            req = pd_request(p, f"r{i}", prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True)
            assert_answers(run(through_pd(p, d, dataclasses.replace(req, return_logprob=True))), model, prompt)
        assert_kernels(model, page_size)
        assert_idle(p, d)
    finally:
        d.close()
        p.close()
