"""``--role pd``'s pools on an accelerator keep their size when the free memory moves by a few MiB
(``pool_sizes.free_granules``): their size is every program's shape, and a warm start must find each in the compile
cache. On the chip a warm start read the free memory after its weights had arrived, padded to the chip's tiles, where
the cold one had read their size from their shapes, and compiled the pool's 4 programs again."""

from __future__ import annotations

import argparse

from fsm_pd.cli.pool_sizes import FREE_GRANULE_BYTES
from fsm_pd.cli.serve_pd import pool_pages

GiB, MiB = 2**30, 2**20


class Accelerator:
    platform = "tpu"

    def __init__(self, in_use: int) -> None:
        self.in_use = in_use

    def memory_stats(self) -> dict:
        return {"bytes_limit": 16 * GiB, "bytes_in_use": self.in_use}


class Model:
    def __init__(self, device) -> None:
        self.device = device

    def page_bytes_on_device(self, page_size: int) -> int:
        return 30 * 2 * 3 * 16 * 128 * 2  # SmolLM2's page of 16 tokens, K and V, 3 heads padded to 128 lanes


def pages(in_use: int) -> tuple[int, int]:
    model = Model(Accelerator(in_use))
    args = argparse.Namespace(prefill_pages=None, decode_pages=None, page_size=16, kv_memory_fraction=0.8,
                              prefill_pool_share=0.3)
    prefill, decode, _ = pool_pages(args, {"prefill": model, "decode": model})
    return prefill, decode


def test_a_few_mib_more_or_less_in_use_leave_the_pools_as_they_are():
    weights = 270 * MiB  # SmolLM2 in bf16, as its shapes say
    assert pages(weights) == pages(weights + 9 * MiB) == pages(weights - 9 * MiB)


def test_a_granule_less_free_memory_gives_smaller_pools():
    assert sum(pages(300 * MiB + FREE_GRANULE_BYTES)) < sum(pages(300 * MiB))
