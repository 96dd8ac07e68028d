"""Run-length encoding of page ids into contiguous copies, for the DMA kernels.

A page list like ``[5, 6, 7, 8, 10, 11]`` is two copies, not six: pages 5..8 land in staging rows 0..3 and pages
10..11 in rows 4..5. Allocators hand out mostly consecutive pages, so a DMA per run instead of per page cuts the
descriptor count (and the fixed cost of each) by the run length.

The arrays are padded to the bucket length so that their shape, like the staging shape, changes only with the bucket;
the kernel reads ``num_runs`` at run time and ignores the padding entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class PageRuns:
    """Contiguous runs: run ``i`` is pages ``page_starts[i] .. +lengths[i]`` <-> rows ``row_starts[i] .. +lengths[i]``.

    All arrays are int32; ``num_runs`` has shape ``[1]`` (a scalar the kernel prefetches), the others ``[bucket]``.
    """

    num_runs: np.ndarray
    page_starts: np.ndarray
    row_starts: np.ndarray
    lengths: np.ndarray


def page_runs(page_ids: np.ndarray, bucket: int) -> PageRuns:
    """Encode validated, distinct ``page_ids`` (in staging-row order) as runs of consecutive pages."""
    ids = np.asarray(page_ids, dtype=np.int64)
    if not 1 <= ids.size <= bucket:
        raise ValueError(f"{ids.size} page ids do not fit a bucket of {bucket}")
    # A run breaks wherever the next id is not this id + 1.
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    row_starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((row_starts, [ids.size])))
    count = row_starts.size

    def padded(values: np.ndarray) -> np.ndarray:
        out = np.zeros(bucket, dtype=np.int32)
        out[:count] = values
        return out

    return PageRuns(
        num_runs=np.array([count], dtype=np.int32),
        page_starts=padded(ids[row_starts]),
        row_starts=padded(row_starts),
        lengths=padded(lengths),
    )
