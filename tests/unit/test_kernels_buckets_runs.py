"""Page-count buckets and the run-length encoding the DMA kernels consume."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsm_pd.kernels import bucket_sizes, page_bucket, page_runs
from fsm_pd.kernels.page_buckets import POW2_LIMIT, STEP


def test_bucket_examples():
    assert [page_bucket(n) for n in (1, 2, 3, 5, 8, 9, POW2_LIMIT)] == [1, 2, 4, 8, 8, 16, POW2_LIMIT]
    assert page_bucket(POW2_LIMIT + 1) == POW2_LIMIT + STEP
    assert page_bucket(POW2_LIMIT + STEP) == POW2_LIMIT + STEP
    assert page_bucket(POW2_LIMIT + STEP + 1) == POW2_LIMIT + 2 * STEP


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, None])
def test_bucket_rejects_non_positive_ints(bad):
    with pytest.raises(ValueError, match="page count must be a positive int"):
        page_bucket(bad)


@settings(max_examples=200)
@given(n=st.integers(1, 4 * POW2_LIMIT + 3 * STEP))
def test_bucket_is_the_smallest_listed_size_that_fits(n):
    sizes = bucket_sizes(n)
    assert page_bucket(n) == sizes[-1] >= n
    assert all(size < n for size in sizes[:-1])  # so no smaller bucket would hold n pages
    assert page_bucket(n) < 2 * n or n <= 1  # padding never doubles a request's bytes
    assert page_bucket(page_bucket(n)) == page_bucket(n)


def test_runs_of_the_tpu_inference_example():
    runs = page_runs(np.array([5, 6, 7, 8, 10, 11, 17, 18, 19]), 16)
    assert runs.num_runs.tolist() == [3]
    assert runs.page_starts[:3].tolist() == [5, 10, 17]
    assert runs.row_starts[:3].tolist() == [0, 4, 6]
    assert runs.lengths[:3].tolist() == [4, 2, 3]
    assert all(a.dtype == np.int32 and a.shape == (16,) for a in (runs.page_starts, runs.row_starts, runs.lengths))


@settings(max_examples=200)
@given(ids=st.lists(st.integers(1, 60), min_size=1, max_size=40, unique=True), sort=st.booleans())
def test_runs_expand_back_to_the_ids_and_are_maximal(ids, sort):
    ids = sorted(ids) if sort else ids
    bucket = page_bucket(len(ids))
    runs = page_runs(np.array(ids), bucket)
    count = int(runs.num_runs[0])
    expanded = []
    for start, row, length in zip(runs.page_starts[:count], runs.row_starts[:count], runs.lengths[:count], strict=True):
        assert row == len(expanded) and length >= 1
        expanded.extend(range(start, start + length))
    assert expanded == ids
    # Maximal: two neighbouring runs never join up (else one DMA would have done).
    ends = runs.page_starts[: count - 1] + runs.lengths[: count - 1]
    assert not np.any(ends == runs.page_starts[1:count])
    assert not np.any(runs.lengths[count:])


def test_runs_reject_more_ids_than_the_bucket():
    with pytest.raises(ValueError, match="do not fit a bucket of 2"):
        page_runs(np.array([1, 2, 3]), 2)
