"""Several decode steps in one program (``model/multi_step.py``) against the same steps taken one at a time: tokens,
sampling, where a row stops, what it writes, and a pool updated in place."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import numpy as np
import pytest

from fsm_pd.model.loader import LoadedModel, load_model
from fsm_pd.model.multi_step import StepRow, pack, table_widths
from fsm_pd.model.params import random_params
from fsm_pd.model.sampling import SamplingParams, sample
from fsm_pd.model.tiny import tiny_config
from fsm_pd.model.tokenizer import ByteTokenizer

# two computations of the model compared (greedy tokens, sampled tokens): float32 products at full precision on a
# TPU too (tests/on_chip.py)
pytestmark = pytest.mark.usefixtures("full_precision")

PAGES, PAGE_SIZE, STEPS = 96, 4, 8
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47, 48]]  # ragged: 5, 3 and 9 tokens
TABLES = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(len(PROMPTS))]  # 8 pages of 4 tokens each
SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


def prefilled(model):
    """A pool holding every prompt's KV, and each prompt's greedy first token."""
    pool = model.make_pool(model.make_kv_layout(PAGES, PAGE_SIZE))
    firsts = []
    for prompt, table in zip(PROMPTS, TABLES, strict=True):
        result = model.prefill(pool, prompt, table)
        pool = result.pool
        firsts.append(int(np.argmax(np.asarray(result.logits))))
    return pool, firsts


def one_at_a_time(model, params: list[SamplingParams], steps: int) -> list[list[int]]:
    """``steps`` tokens per prompt, a decode step and a host ``sample`` at a time (the decode loop's host path)."""
    pool, firsts = prefilled(model)
    tokens = [[first] for first in firsts]
    for step in range(steps):
        positions = [len(p) + len(t) - 1 for p, t in zip(PROMPTS, tokens, strict=True)]
        logits, pool = model.decode(pool, [t[-1] for t in tokens], positions, TABLES, bucket_rows=True)
        drawn = sample(logits, params, seeds=list(range(len(PROMPTS))), steps=[1 + step] * len(PROMPTS))
        for row, token in zip(tokens, drawn, strict=True):
            row.append(int(token))
    return [row[1:] for row in tokens]


def run_steps(model, rows_of, steps: int = STEPS, batch: int = 4, width: int = 16):
    """One dispatch of ``steps`` steps over the prefilled prompts; ``rows_of(firsts)`` makes its ``StepRow``s.
    Returns its tokens and the pool after it."""
    pool, firsts = prefilled(model)
    programs = model.programs(pool).steps
    packed = pack(rows_of(firsts), batch, width, steps, model.config.vocab_size)
    tokens, pool = programs.run(model.params, pool, packed, STEPS)
    return np.asarray(tokens), pool


def rows(firsts, params: list[SamplingParams], budget: int = STEPS, **override) -> list[StepRow]:
    return [StepRow(first, len(prompt), budget, table, seed=i, step=1, temperature=p.temperature, top_p=p.top_p,
                    top_k=p.top_k, min_p=p.min_p, **override)
            for i, (first, prompt, table, p) in enumerate(zip(firsts, PROMPTS, TABLES, params, strict=True))]


def test_a_dispatch_of_several_steps_makes_the_tokens_of_as_many_single_steps(model):
    """A ragged batch, greedy and sampled rows side by side: each step's inputs are the last step's tokens, patched
    on the device, and each row draws what the host sampler draws with its seed and step."""
    params = [SamplingParams(temperature=0.0), SAMPLED, SamplingParams(temperature=0.0)]
    want = one_at_a_time(model, params, STEPS)
    tokens, _ = run_steps(model, lambda firsts: rows(firsts, params))
    assert tokens[:3].tolist() == want
    assert (tokens[3] == -1).all()  # the padding row never ran


def written(pool, pages: list[int]) -> np.ndarray:
    """Which token slots of ``pages`` hold anything (layer 0): ``[pages, page_size]`` bools."""
    return np.abs(np.asarray(pool[0])[pages]).sum(axis=-1) > 0


def first_unique(want: list[list[int]]) -> tuple[int, int]:
    """A row and a step (not the first) whose token that row has not made before and no other row makes."""
    for r, row in enumerate(want):
        others = {t for i, other in enumerate(want) if i != r for t in other}
        for j in range(1, len(row)):
            if row[j] not in row[:j] and row[j] not in others:
                return r, j
    raise AssertionError(f"no token to stop at in {want}")


def test_a_row_stops_at_its_stop_token_and_writes_nothing_after_it(model):
    greedy = [SamplingParams(temperature=0.0)] * 3
    want = one_at_a_time(model, greedy, STEPS)
    r, j = first_unique(want)
    tokens, pool = run_steps(model, lambda firsts: rows(firsts, greedy, stop_ids=(want[r][j],)))
    assert tokens[r].tolist() == want[r][: j + 1] + [-1] * (STEPS - j - 1)
    assert all(tokens[i].tolist() == want[i] for i in range(3) if i != r)  # its neighbours went on
    # Its steps wrote the positions from its prompt's end (its first token's) to the stop token's input, j + 1 of
    # them; nothing after, where a row that went on would have written.
    slots = written(pool, TABLES[r]).reshape(-1)
    end = len(PROMPTS[r]) + j + 1
    assert slots[:end].all() and not slots[end:].any()


def test_a_row_stops_at_its_budget_and_writes_nothing_after_it(model):
    greedy = [SamplingParams(temperature=0.0)] * 3
    want = one_at_a_time(model, greedy, STEPS)

    def budgets(firsts):
        made = rows(firsts, greedy)
        return [made[0], dataclasses.replace(made[1], budget=2), made[2]]

    tokens, pool = run_steps(model, budgets)
    assert tokens[1].tolist() == want[1][:2] + [-1] * (STEPS - 2)
    assert tokens[0].tolist() == want[0]
    slots = written(pool, TABLES[1]).reshape(-1)
    assert slots[:5].all() and not slots[5:].any()  # 3 prompt tokens, then positions 3 and 4


def test_the_loop_ends_when_every_row_has_stopped(model):
    greedy = [SamplingParams(temperature=0.0)] * 3
    tokens, _ = run_steps(model, lambda firsts: rows(firsts, greedy, budget=3))
    assert (tokens[:, 3:] == -1).all() and (tokens[:3, :3] >= 0).all()


def test_fewer_steps_than_the_program_holds(model):
    greedy = [SamplingParams(temperature=0.0)] * 3
    want = one_at_a_time(model, greedy, 2)
    tokens, _ = run_steps(model, lambda firsts: rows(firsts, greedy), steps=2)
    assert tokens[:3, :2].tolist() == want and (tokens[:, 2:] == -1).all()


def test_the_dispatch_consumes_its_pool_in_place(model):
    """The loop holds nothing the size of the pool: its scratch memory is the same over a pool 32x larger, and every
    pool byte is the output's (written where it lies), as in a single step (``test_step_cost.py``)."""
    big_pool = model.make_pool(model.make_kv_layout(32 * PAGES, PAGE_SIZE))
    small, big = (model.programs(p).steps.compile(4, 16, STEPS).memory_analysis() for p in (prefilled(model)[0],
                                                                                            big_pool))
    layer = big_pool[0].nbytes
    assert abs(big.temp_size_in_bytes - small.temp_size_in_bytes) < layer // 100
    assert big.temp_size_in_bytes < layer // 8
    assert big.alias_size_in_bytes == sum(a.nbytes for a in big_pool)
    pool, firsts = prefilled(model)
    packed = pack(rows(firsts, [SamplingParams(temperature=0.0)] * 3), 4, 16, 2, model.config.vocab_size)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Some donated buffers were not usable" would be raised here
        _, after = model.programs(pool).steps.run(model.params, pool, packed, STEPS)
    assert all(layer.is_deleted() for layer in pool) and after[0].shape == pool[0].shape


def test_page_tables_are_as_wide_as_the_batch_needs():
    assert table_widths(512, 16) == [4, 16, 64, 256, 512]  # whole attention blocks (4 pages of 16), 4x apart
    assert table_widths(96, 4) == [16, 64, 96]
    assert table_widths(16, 4) == [16]
    with pytest.raises(ValueError, match="does not fit"):
        pack([StepRow(1, 0, 1, list(range(1, 18)))], 1, 16, 1, 272)


@pytest.mark.parametrize("kernels", ["jnp", "interpret"])
def test_the_tpu_kernels_take_one_table_width_and_batches_four_apart(monkeypatch, kernels):
    """The TPU decode kernel reads a row's pages up to its length whatever the table's width, and skips a padding
    row: one width there, batch buckets 4x apart; jnp gathers up to the width and pays for every row."""
    monkeypatch.setenv("FSM_PD_ATTENTION", kernels)
    config = dataclasses.replace(tiny_config(), num_heads=4, num_kv_heads=2, head_dim=64, hidden_size=128,
                                 num_layers=1)
    model = LoadedModel("widths", config, random_params(config, seed=1), ByteTokenizer(vocab_size=config.vocab_size))
    programs = model.programs(model.make_pool(model.make_kv_layout(130, 16)))
    assert programs.kernels == kernels
    full = programs.width
    assert programs.steps.widths == (table_widths(full, 16) if kernels == "jnp" else [full])
    assert len(table_widths(full, 16)) > 1
    # the batch buckets too: each a program; a padding row costs the kernels next to nothing
    loops = programs.steps
    assert loops.batches(64) == ([1, 2, 4, 8, 16, 32, 64] if kernels == "jnp" else [1, 4, 16, 64])
    assert loops.batches(128)[-1] == 128 and loops.batches(2) == ([1, 2] if kernels == "jnp" else [1, 2])
    assert [loops.batch_for(rows, 64) for rows in (1, 2, 3, 5, 16, 17, 64)] == (
        [1, 2, 4, 8, 16, 32, 64] if kernels == "jnp" else [1, 4, 4, 16, 16, 64, 64])


@pytest.mark.parametrize("page_size", [16, 64, 128], ids=lambda p: f"page-{p}")  # a TPU pool's candidates
@pytest.mark.parametrize("head_dim, heads, kv_heads", [(64, 9, 3), (128, 4, 2)], ids=["head_dim-64", "head_dim-128"])
def test_the_tpu_kernels_run_inside_the_loop(monkeypatch, head_dim, heads, kv_heads, page_size):
    """``FSM_PD_ATTENTION``'s kernels (the KV write by pages, the Pallas decode attention; interpret mode off a TPU)
    inside the loop give the jnp path's tokens: a ragged batch of two rows (one inside its first page, one 21 tokens
    past a page's end) and a padding row, eight steps, at each page size a TPU pool may get."""
    config = dataclasses.replace(tiny_config(), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                 hidden_size=128, num_layers=1)
    params = random_params(config, seed=5, std=0.1)
    prompts, tables = [[7, 8, 9, 10, 11], list(range(20, 41 + page_size))], [[3, 4], [5, 6, 7]]
    out = {}
    for kernels in ("jnp", "tpu" if jax.default_backend() == "tpu" else "interpret"):
        monkeypatch.setenv("FSM_PD_ATTENTION", kernels)
        model = LoadedModel(f"kernels-{kernels}", config, params, ByteTokenizer(vocab_size=config.vocab_size))
        pool = model.make_pool(model.make_kv_layout(16, page_size))
        assert model.programs(pool).kernels == kernels
        firsts = []
        for prompt, table in zip(prompts, tables, strict=True):
            result = model.prefill(pool, prompt, table)
            pool, firsts = result.pool, [*firsts, int(np.argmax(np.asarray(result.logits)))]
        rows = [StepRow(first, len(prompt), STEPS, table)
                for first, prompt, table in zip(firsts, prompts, tables, strict=True)]
        loops = model.programs(pool).steps
        tokens, pool = loops.run(model.params, pool, pack(rows, 4, loops.width_for(3), STEPS, config.vocab_size),
                                 STEPS)
        # the jnp write stores the padding rows' tokens in the pad page; the kernels' write never touches it
        out[kernels] = np.asarray(tokens).tolist(), bool(np.asarray(pool[0])[0].any())
    (jnp_tokens, jnp_pad), (kernel_tokens, kernel_pad) = out.values()
    assert kernel_tokens == jnp_tokens and all(t >= 0 for t in jnp_tokens[0] + jnp_tokens[1])
    assert jnp_pad and not kernel_pad  # each loop ran its own write
