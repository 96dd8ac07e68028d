"""A serving engine compiles programs per batch bucket, never per batch size.

Each program XLA compiles costs a node a few MB the first time (its code, and compile scratch the allocator keeps);
the memory soak (bench/soak.py, docs/serving.md) found decode batches of a size never seen before (14 of bucket 16)
compiling a slice and a pad thousands of requests in. Batches of 5, 6 and 7 share bucket 8: once one has run, the
others must compile nothing that depends on the size.
"""

from __future__ import annotations

import asyncio
import logging

import jax
import pytest

from fsm_pd.model.loader import load_model
from fsm_pd.model.sampling import SamplingParams
from fsm_pd.serving.collect import generate
from fsm_pd.serving.colocated_engine import ColocatedEngine
from fsm_pd.serving.types import GenerateRequest

# device programs: on a TPU host they run in the process that holds the chip (tests/on_tpu.sh); at full precision
# there, as the serving tests that share this pool shape are: the programs compiled here are theirs too (programs are
# shared per pool shape and precision)
pytestmark = [pytest.mark.chip, pytest.mark.usefixtures("full_precision")]

PAGES, PAGE_SIZE = 96, 4  # the serving tests' pool shape: their programs are reused


@pytest.fixture(scope="module")
def engine():
    e = ColocatedEngine(load_model("tiny"), num_pages=PAGES, page_size=PAGE_SIZE)
    yield e
    e.close()


async def batch(engine, size: int, tag: str) -> list[list[int]]:
    """``size`` requests submitted together (prefilled in one batch, decoded together), greedy and sampled."""
    requests = [GenerateRequest(f"{tag}{i}", [3 + i, 40, 41, 42, 43, 44],
                                SamplingParams(temperature=0.0 if i % 2 else 0.8, max_new_tokens=6, ignore_eos=True),
                                seed=i)
                for i in range(size)]
    outs = await asyncio.gather(*(generate(engine, r) for r in requests))
    return [[o.token_id for o in out] for out in outs]


def test_batches_of_one_bucket_compile_nothing_per_size(engine, caplog):
    first = asyncio.run(batch(engine, 5, "warm"))
    assert all(len(out) == 6 for out in first)
    was = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)  # for every thread: the engine compiles on its model thread
    try:
        with caplog.at_level(logging.WARNING):
            later = asyncio.run(batch(engine, 6, "six")) + asyncio.run(batch(engine, 7, "seven"))
    finally:
        jax.config.update("jax_log_compiles", was)
    assert all(len(out) == 6 for out in later)
    compiled = [r.getMessage()[:120] for r in caplog.records if r.getMessage().startswith("Compiling")]
    per_size = [m for m in compiled if "slice" in m or "_pad" in m]
    assert not per_size, per_size
    # The same prompt and seed give the same tokens at every batch size: the padding rows left in change no real row.
    assert later[:5] == first and later[6:11] == first
