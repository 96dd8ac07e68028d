"""Tensor parallelism: the decoder run SPMD over a 1-D mesh of ``tp`` devices, Megatron-style.

Every device holds a share of each layer:

- attention: the fused Q/K/V projection is split by columns (a device computes its own query heads and the KV heads
  they read), the output projection by rows; the devices' partial sums are added with one ``psum``;
- MLP: gate/up split by columns, down by rows, one ``psum``;
- the KV pool is split on its KV-head axis (``KVLayout.pool_spec``), so a device writes and reads only its own KV
  heads and attention needs no communication; embeddings, norms and the LM head are replicated, so every device
  computes the same logits.

Heads that do not divide. The pool's KV slots follow ``kernels.layout.kv_slot_heads``: each device gets the same
number of slots, holding a model KV head, a copy of one (when ``tp`` > KV heads, as SGLang replicates them) or a
padding head. A slot carries its KV head's query heads: all of them, or one r-th each when the head is copied r
times (padded with zero query heads to a multiple of r). A padding head has zero weights, so its K and V are zero,
its scores are 0 and its rows of the output projection are zero: it adds exactly 0. SmolLM2 (9 query heads, 3 KV
heads) on 2 devices gets 4 slots: 2 per device, the last one padding, with 3 zero query heads.

The shard's forward pass is ``decoder.forward_group``, the one-device code, with the shard's ``ModelConfig`` (its
head and MLP counts) and ``psum`` as its ``reduce``, under ``jax.shard_map``. The pool enters and leaves
``shard_map`` split the same way and is donated, so a step still writes it in place (``tests/unit/test_step_cost.py``
holds that on one device, ``tests/unit/tp_mesh/tp_model_check.py`` for a pool split over 2).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fsm_pd.kernels.layout import PAD_HEAD, kv_slot_heads
from fsm_pd.kernels.pool_format import PoolJit
from fsm_pd.model.config import ModelConfig
from fsm_pd.model.decoder import forward_group

TP_AXIS = "tp"
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"

# How each parameter is split over the mesh; every other one (embeddings, norms, LM head) is replicated.
_SPLIT = {
    "wqkv": PartitionSpec(None, TP_AXIS),  # columns: [q | k | v] of each device's heads, device after device
    "bqkv": PartitionSpec(TP_AXIS),
    "w_gate_up": PartitionSpec(None, TP_AXIS),  # columns: [gate | up] of each device's share, device after device
    "wo": PartitionSpec(TP_AXIS, None),  # rows of each device's query heads
    "w_down": PartitionSpec(TP_AXIS, None),
}


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """How one model is split over a mesh. Hashable: the compiled forward pass takes it as a static argument."""

    mesh: Mesh
    config: ModelConfig  # the whole model's
    shard_config: ModelConfig  # one device's share: its query heads, KV slots and MLP columns
    slot_heads: tuple[int, ...]  # per KV slot, all devices in order: the model KV head, or PAD_HEAD
    query_heads: tuple[int, ...]  # per query-head slot, all devices in order: the model query head, or PAD_HEAD

    @property
    def size(self) -> int:
        return int(self.mesh.devices.size)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def describe(self) -> str:
        """What each device holds, for logs and ``/server_info``."""
        copies, padding = Counter(self.slot_heads)[0], self.slot_heads.count(PAD_HEAD)
        notes = [f"each KV head on {copies} devices"] if copies > 1 else []
        notes += [f"{padding} padding KV slot(s)"] if padding else []
        shard = self.shard_config
        return (f"{self.size} devices, each with {shard.num_heads} query heads, {shard.num_kv_heads} KV slots and "
                f"{shard.intermediate_size} MLP columns" + (f" ({', '.join(notes)})" if notes else ""))


def query_slot_heads(config: ModelConfig, slot_heads: tuple[int, ...]) -> tuple[int, ...]:
    """The model query head of each query-head slot, in slot order: slot ``s``'s share of its KV head's group."""
    copies = Counter(slot_heads)[0]  # every head is copied equally often (kv_slot_heads)
    group = config.group_size
    per_slot = -(-group // copies)
    out, seen = [], Counter()
    for head in slot_heads:
        replica = seen[head]
        seen[head] += 1
        for i in range(per_slot):
            member = replica * per_slot + i
            out.append(head * group + member if head != PAD_HEAD and member < group else PAD_HEAD)
    return tuple(out)


def tp_mesh(tp: int) -> Mesh:
    """The first ``tp`` devices of the default backend as a 1-D mesh; on CPU, as many virtual devices as
    ``--xla_force_host_platform_device_count`` made (``fsm-pd serve --tp`` sets it)."""
    devices = jax.devices()
    if len(devices) < tp:
        platform = devices[0].platform
        hint = (f"; on CPU, start the process with XLA_FLAGS={DEVICE_COUNT_FLAG}={tp} (fsm-pd serve --tp does)"
                if platform == "cpu" else "")
        raise ValueError(f"tensor parallelism over {tp} devices, but jax sees {len(devices)} {platform} "
                         f"device(s){hint}")
    return Mesh(np.array(devices[:tp]), (TP_AXIS,))


def plan_split(config: ModelConfig, tp: int, mesh: Mesh | None = None) -> TensorParallel:
    """Which heads and MLP columns each of ``tp`` devices holds."""
    mesh = mesh if mesh is not None else tp_mesh(tp)
    slots = kv_slot_heads(config.num_kv_heads, tp)
    queries = query_slot_heads(config, slots)
    shard = dataclasses.replace(config, num_heads=len(queries) // tp, num_kv_heads=len(slots) // tp,
                                intermediate_size=-(-config.intermediate_size // tp))
    return TensorParallel(mesh, config, shard, slots, queries)


def _pick(heads: np.ndarray, index: tuple[int, ...], axis: int) -> np.ndarray:
    """``heads`` taken along ``axis`` in ``index`` order, zeros where the index is ``PAD_HEAD``."""
    zero = np.zeros_like(np.take(heads, [0], axis=axis))
    padded = np.concatenate([heads, zero], axis=axis)
    last = heads.shape[axis]
    return np.take(padded, [last if i == PAD_HEAD else i for i in index], axis=axis)


def _devices_side_by_side(parts: list[np.ndarray], tp: int) -> np.ndarray:
    """``parts`` each ``[..., tp * n_i]`` (device-major): device 0's share of every part, then device 1's, ..."""
    blocks = []
    for device in range(tp):
        for part in parts:
            width = part.shape[-1] // tp
            blocks.append(part[..., device * width : (device + 1) * width])
    return np.concatenate(blocks, axis=-1)


def _split_qkv(plan: TensorParallel, value: np.ndarray) -> np.ndarray:
    c, dh = plan.config, plan.config.head_dim
    lead = value.shape[:-1]
    q_out, kv_out = c.num_heads * dh, c.num_kv_heads * dh
    q = value[..., :q_out].reshape(*lead, c.num_heads, dh)
    k = value[..., q_out : q_out + kv_out].reshape(*lead, c.num_kv_heads, dh)
    v = value[..., q_out + kv_out :].reshape(*lead, c.num_kv_heads, dh)
    axis = len(lead)
    parts = [_pick(q, plan.query_heads, axis), _pick(k, plan.slot_heads, axis), _pick(v, plan.slot_heads, axis)]
    return _devices_side_by_side([p.reshape(*lead, -1) for p in parts], plan.size)


def _split_gate_up(plan: TensorParallel, value: np.ndarray) -> np.ndarray:
    inter = plan.config.intermediate_size
    pad = plan.shard_config.intermediate_size * plan.size - inter  # zero columns: silu(0) * 0 adds nothing
    gate, up = (np.pad(part, ((0, 0), (0, pad))) for part in (value[:, :inter], value[:, inter:]))
    return _devices_side_by_side([gate, up], plan.size)


def _split_rows(plan: TensorParallel, name: str, value: np.ndarray) -> np.ndarray:
    if name == "wo":
        dh = plan.config.head_dim
        heads = value.reshape(plan.config.num_heads, dh, -1)
        return _pick(heads, plan.query_heads, 0).reshape(len(plan.query_heads) * dh, -1)
    pad = plan.shard_config.intermediate_size * plan.size - value.shape[0]
    return np.pad(value, ((0, pad), (0, 0)))


def shard_params(plan: TensorParallel, params: dict) -> dict:
    """The parameter tree rearranged for ``plan`` (head and MLP shares device after device) and placed on its mesh:
    split parameters as ``_SPLIT`` says, the rest replicated."""

    def place(name: str, value) -> jax.Array:
        host = np.asarray(value)
        if name in ("wqkv", "bqkv"):
            host = _split_qkv(plan, host)
        elif name == "w_gate_up":
            host = _split_gate_up(plan, host)
        elif name in ("wo", "w_down"):
            host = _split_rows(plan, name, host)
        return jax.device_put(host, NamedSharding(plan.mesh, _SPLIT.get(name, PartitionSpec())))

    out = {name: place(name, value) for name, value in params.items() if name != "layers"}
    out["layers"] = [{name: place(name, value) for name, value in layer.items()} for layer in params["layers"]]
    return out


def layer_specs(layers) -> list[dict]:
    """``shard_map``'s in_specs for layers placed by ``shard_params``."""
    return [{name: _SPLIT.get(name, PartitionSpec()) for name in layer} for layer in layers]


POOL_SPEC = PartitionSpec(None, None, TP_AXIS)  # KVLayout.pool_spec() with shard_axis = TP_AXIS


# the pools' results row-major, as they come in: a shard's rows may be narrower than 128 lanes (kernels/pool_format.py)
@partial(PoolJit, pool="pools", results=lambda pools: (None, pools), static_argnames=("tp",),
         donate_argnames=("pools",))
def group_sharded(layers, pools, x, starts, lengths, page_tables, *, tp: TensorParallel):
    """``decoder.forward_group`` over ``tp``'s mesh: same arguments and results (``x`` replicated, the pools split on
    their KV-head axis), ``layers`` from ``shard_params``. The embedding and the head need no ``shard_map``: their
    parameters are replicated, so they run as they are on every device (``programs.ForwardPrograms``)."""
    specs = tuple(POOL_SPEC for _ in pools)
    reduce = partial(jax.lax.psum, axis_name=TP_AXIS)

    def body(*args):
        real = None
        if PAD_HEAD in tp.slot_heads:  # this device's row of the padding table
            table = np.array(tp.slot_heads).reshape(tp.size, -1) != PAD_HEAD
            real = jnp.asarray(table)[jax.lax.axis_index(TP_AXIS)]
        return forward_group(*args, config=tp.shard_config, reduce=reduce, real_kv=real)

    # check_vma=False: attention's online-softmax loop starts from constants (the same on every device) and carries
    # per-device values; the varying-axes check would reject that carry although every output spec is honest.
    sharded = jax.shard_map(body, mesh=tp.mesh, in_specs=(layer_specs(layers), specs, *[PartitionSpec()] * 4),
                            out_specs=(PartitionSpec(), specs), check_vma=False)
    return sharded(layers, pools, x, starts, lengths, page_tables)
