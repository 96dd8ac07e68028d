"""Tensor parallelism (``model/tensor_parallel.py``): the head split here, the model on 4 virtual devices in a fresh
interpreter (jax fixes its CPU device count when it first creates the CPU client; see ``tp_mesh/tp_model_check.py``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from device_count_run import run_checks
from real_parts import TCP

from fsm_pd.kernels.layout import PAD_HEAD, KVLayout, kv_slot_heads
from fsm_pd.model.tensor_parallel import query_slot_heads
from fsm_pd.model.tiny import tiny_config

CHECKS = Path(__file__).parent / "tp_mesh" / "tp_model_check.py"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_model_on_a_four_device_mesh():
    result = run_checks(CHECKS, 4, cwd=CHECKS.parents[3], timeout=900)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize("heads, kv_heads, tp, expected", [
    (8, 4, 2, (0, 1, 2, 3, 4, 5, 6, 7)),  # two query heads per KV head, KV heads split
    (4, 2, 4, (0, 1, 2, 3)),  # KV heads copied twice: each copy takes half its group
    (9, 3, 3, tuple(range(9))),
    (9, 3, 2, (*range(9), PAD_HEAD, PAD_HEAD, PAD_HEAD)),  # the padding KV slot brings 3 zero query heads
    (3, 3, 2, (0, 1, 2, PAD_HEAD)),
    (6, 2, 4, (0, 1, 2, PAD_HEAD, 3, 4, 5, PAD_HEAD)),  # a group of 3 on 2 copies: 2 + 1 and a zero head
    # padded to 4 KV slots, each copied twice: a group of 3 splits 2 + 1 (+ a zero head)
    (9, 3, 8, (0, 1, 2, PAD_HEAD, 3, 4, 5, PAD_HEAD, 6, 7, 8, PAD_HEAD, *[PAD_HEAD] * 4)),
])
def test_query_heads_follow_their_kv_slot(heads, kv_heads, tp, expected):
    config = dataclasses.replace(tiny_config(), num_heads=heads, num_kv_heads=kv_heads)
    slots = kv_slot_heads(kv_heads, tp)
    queries = query_slot_heads(config, slots)
    assert queries == expected
    per_slot = len(queries) // len(slots)
    for slot, head in enumerate(slots):  # every query head sits in a slot of its own KV head
        for query in queries[slot * per_slot : (slot + 1) * per_slot]:
            assert query == PAD_HEAD or query // config.group_size == head
    assert sorted(q for q in queries if q != PAD_HEAD) == list(range(heads))  # each exactly once


def test_a_layout_with_tp_counts_its_slots():
    layout = KVLayout(num_layers=2, num_pages=4, page_size=8, kv_heads=3, head_dim=16, shard_axis="tp", tp=2)
    assert layout.slot_heads == (0, 1, 2, PAD_HEAD) and layout.page_shape == (8, 128)
    assert KVLayout.from_dict({k: v for k, v in layout.to_dict().items() if k != "tp"}).tp == 1  # older peers
    assert layout.transfer_key() == KVLayout(num_layers=2, num_pages=9, page_size=8, kv_heads=3,
                                             head_dim=16).transfer_key()
    with pytest.raises(ValueError, match="needs a shard_axis"):
        KVLayout(num_layers=2, num_pages=4, page_size=8, kv_heads=3, head_dim=16, tp=2)


@TCP
def test_a_tp_prefill_node_registers_one_entry_per_rank():
    """SGLang's prefill ranks each PUT /route with their attn_tp_rank; the server answers the -1 layout query only once
    every rank of attn_tp_size registered, which SGLang's decode relies on. A drain takes every rank out."""
    from fsm_pd.bootstrap import BootstrapServer, fetch_prefill_layout, resolve_prefill
    from fsm_pd.control.resolver import deregister_prefill, register_prefill

    layout = KVLayout(num_layers=2, num_pages=4, page_size=8, kv_heads=3, head_dim=16, shard_axis="tp", tp=3)
    node = dict(host="127.0.0.1", side_channel="tcp://127.0.0.1:7000", transfer_addr="tcp://127.0.0.1:7100",
                backend="tcp", layout=layout.to_dict(), node_id="prefill-0", instance="a" * 16)
    with BootstrapServer(port=0) as server:
        register_prefill(server.url, **node)
        assert fetch_prefill_layout(server.url, retries=0)["attn_tp_size"] == 3
        for rank in range(3):
            assert resolve_prefill(server.url, tp_rank=rank, retries=0)["side_channel"] == node["side_channel"]
        assert deregister_prefill(server.url, **node)
        with pytest.raises(LookupError):
            resolve_prefill(server.url, tp_rank=2, retries=0)


def test_serve_asks_jax_for_enough_host_devices():
    from fsm_pd.cli.serve import ask_for_host_devices

    env = {"XLA_FLAGS": "--xla_cpu_foo=1 --xla_force_host_platform_device_count=2"}
    ask_for_host_devices(4, env)
    assert env["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=4"
    ask_for_host_devices(3, env)  # already enough: left alone
    assert env["XLA_FLAGS"].endswith("=4")
    empty: dict = {}
    ask_for_host_devices(2, empty)
    assert empty == {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}


@TCP
def test_launch_passes_each_role_its_tp(tmp_path):
    from fsm_pd.cli.launch import plan

    children = plan(1, 1, 30000, "tiny", "tcp", tmp_path, [], prefill_tp=2, decode_tp=4)
    tp = {child.name: child.argv[child.argv.index("--tp") + 1] for child in children if "--tp" in child.argv}
    assert tp == {"prefill-0": "2", "decode-0": "4"}
