"""The sampler's batch buckets a warm-up plans (``warmup_plan.sample_batches``): an engine's own, or, for the two
engines of ``--role pd`` that share one pool, one set for both, so the process compiles the samplers once. On the chip
the two plans had made 12 sampler programs before ready (25 s of compile) where a colocated node makes 8 (15 s)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fsm_pd.model.loader import load_model
from fsm_pd.serving.shared_pool import SharedPool
from fsm_pd.serving.warmup_plan import WarmupPlan, sample_batches


def prefill(shared=None):
    return SimpleNamespace(role="prefill", max_prefill_batch=8, shared=shared)


def decode(shared=None):
    return SimpleNamespace(role="decode", max_running=64, shared=shared,
                           loop=SimpleNamespace(max_recompute_batch=4), recompute=SimpleNamespace(max_batch=4))


@pytest.fixture
def pool():
    shared = SharedPool(load_model("tiny"), num_pages=8, page_size=16, chunked_prefill_size=64,
                        prefill_chunk_steps=4.0)
    yield shared
    shared.model_thread.close()


def test_engines_of_their_own_plan_their_own_buckets():
    assert sample_batches(prefill()) == [1, 2, 4, 8]
    assert sample_batches(decode()) == [1, 2, 4, 8, 16, 32, 64]


def test_two_engines_sharing_a_pool_plan_one_set_and_so_the_same_ready_samplers(pool):
    p, d = prefill(pool), decode(pool)
    pool.member("prefill", lambda: False, engine=p).start()
    decoding = pool.member("decode", lambda: False, engine=d)
    # an engine counts once it is whole (started): --role pd warms one up while it builds the other
    assert sample_batches(p) == [1, 2, 4, 8]
    decoding.start()
    assert sample_batches(p) == sample_batches(d) == [1, 2, 4, 8, 16, 32, 64]
    ready = [WarmupPlan([], sample_batches(e)).ready_samples for e in (p, d)]
    assert ready == [[1, 64], [1, 64]]  # 2 buckets before ready between them, not 3 ({1, 8} and {1, 64})
