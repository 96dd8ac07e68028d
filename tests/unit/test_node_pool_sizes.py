"""A node's KV pool without ``--num-pages`` (``cli/pool_sizes.node_pages``): on an accelerator, ``--kv-memory-fraction``
of the memory the weights leave, in whole 256 MiB, counted in pages as the device stores them; on a CPU, or over a
mesh (``--tp``), 512; the flag wins everywhere. Fakes stand in for the model and its device (the sizes on a real
chip are in docs/tpu.md)."""

from __future__ import annotations

from argparse import Namespace

import pytest

from fsm_pd.cli.flags import node_parser
from fsm_pd.cli.pool_sizes import CPU_POOL_PAGES, FREE_GRANULE_BYTES, node_pages

GIB = 2**30


class Device:
    def __init__(self, platform: str, limit: int = 0, in_use: int = 0):
        self.platform, self._stats = platform, {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self):
        return self._stats


class Model:
    def __init__(self, device: Device, tp=None, page_bytes: int = 368_640):
        self.device, self.tp, self._page_bytes = device, tp, page_bytes

    def page_bytes_on_device(self, page_size: int) -> int:
        return self._page_bytes * page_size // 16


def args(*words: str) -> Namespace:
    parsed = node_parser("colocated").parse_args(["--role", "colocated", "--model", "tiny", *words])
    parsed.page_size = parsed.page_size or 16  # start_model sets it from the platform
    return parsed


def test_on_an_accelerator_the_pool_takes_its_share_of_what_the_weights_leave_in_whole_granules():
    device = Device("tpu", limit=16 * GIB, in_use=GIB // 2 + 1)  # 15.5 GiB less a byte free: 15.25 GiB in granules
    pages, how = node_pages(args(), Model(device))
    free = (16 * GIB - GIB // 2 - 1) // FREE_GRANULE_BYTES * FREE_GRANULE_BYTES
    assert pages == int(free * 0.8) // 368_640 and pages > 30_000
    assert "0.8 of 15.25 GiB free" in how
    assert node_pages(args("--kv-memory-fraction", "0.5"), Model(device))[0] == int(free * 0.5) // 368_640


@pytest.mark.parametrize("model", [Model(Device("cpu")), Model(Device("tpu", limit=16 * GIB), tp=object())],
                         ids=["cpu", "tensor-parallel"])
def test_a_cpu_or_a_mesh_keeps_the_default_size(model):
    assert node_pages(args(), model)[0] == CPU_POOL_PAGES


def test_the_flag_wins():
    assert node_pages(args("--num-pages", "300"), Model(Device("tpu", limit=16 * GIB))) == (300, "--num-pages")


def test_a_bad_fraction_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        args("--kv-memory-fraction", "1.5")
    assert exit_.value.code == 2 and "kv-memory-fraction" in capsys.readouterr().err
