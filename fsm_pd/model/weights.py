"""HF safetensors checkpoints <-> the engine's parameter tree (``params.py``).

Reads a single ``model.safetensors``, a sharded one (``model.safetensors.index.json``) or any ``*.safetensors`` in the
directory, and maps HF tensor names onto the tree, transposing linear weights from HF's ``[out, in]`` to ``[in, out]``.
The inverse (``save_hf_checkpoint``) lets tests and tools write checkpoints without torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from fsm_pd.model.config import ModelConfig
from fsm_pd.model.params import check_params, fused_parts, layer_shapes, top_shapes

INDEX_FILE = "model.safetensors.index.json"

# param name -> (HF names under model.layers.{i}., concatenated in this order; linear weights to transpose?)
_LAYER_TENSORS = {
    "attn_norm": (("input_layernorm.weight",), False),
    "wqkv": (("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), True),
    "bqkv": (("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), False),
    "wo": (("self_attn.o_proj.weight",), True),
    "q_norm": (("self_attn.q_norm.weight",), False),
    "k_norm": (("self_attn.k_norm.weight",), False),
    "mlp_norm": (("post_attention_layernorm.weight",), False),
    "w_gate_up": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), True),
    "w_down": (("mlp.down_proj.weight",), True),
}
_TOP_TENSORS = {
    "embed": (("model.embed_tokens.weight",), False),
    "final_norm": (("model.norm.weight",), False),
    "lm_head": (("lm_head.weight",), True),
}


class CheckpointError(ValueError):
    """The checkpoint's files are missing, inconsistent, or lack tensors the config needs."""


def tensor_plan(config: ModelConfig) -> Iterator[tuple[tuple, tuple[str, ...], bool]]:
    """``(tree path, HF names, transpose)`` for every parameter the config needs, in a stable order.

    A parameter with several HF names is their concatenation along the last axis, after transposing each.
    """
    for name in top_shapes(config):
        hf_names, transpose = _TOP_TENSORS[name]
        yield (name,), hf_names, transpose
    for i in range(config.num_layers):
        for name in layer_shapes(config):
            hf_names, transpose = _LAYER_TENSORS[name]
            yield ("layers", i, name), tuple(f"model.layers.{i}.{n}" for n in hf_names), transpose


def locate_tensors(directory: Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to the safetensors file that holds it."""
    from safetensors import safe_open

    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map")
        files = {name: directory / file for name, file in weight_map.items()}
        absent = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if absent:
            raise CheckpointError(f"{index} names shard files that are not in {directory}: {absent}")
        return files
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors (or {INDEX_FILE}) in {directory}")
    files = {}
    for shard in shards:
        with safe_open(str(shard), framework="np") as handle:
            files.update({name: shard for name in handle.keys()})  # noqa: SIM118 - safe_open is not a Mapping
    return files


def load_params(directory: Path, config: ModelConfig) -> dict:
    """Read the tensors ``config`` needs, cast to ``config.dtype``; extra tensors (e.g. rotary buffers) are ignored."""
    from safetensors import safe_open

    located = locate_tensors(directory)
    plan = list(tensor_plan(config))
    missing = [hf_name for _, hf_names, _ in plan for hf_name in hf_names if hf_name not in located]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise CheckpointError(f"checkpoint {directory} lacks {len(missing)} tensor(s) the config needs: {shown}")

    params: dict = {"layers": [{} for _ in range(config.num_layers)]}
    with ExitStack() as stack:
        handles: dict[Path, object] = {}

        def read(hf_name: str) -> np.ndarray:
            file = located[hf_name]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(file), framework="np"))
            return handles[file].get_tensor(hf_name)

        for path, hf_names, transpose in plan:
            parts = [read(n).T if transpose else read(n) for n in hf_names]
            host = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)
            _set(params, path, jnp.asarray(host, dtype=config.dtype))
    try:
        check_params(config, params)
    except ValueError as err:
        raise CheckpointError(f"checkpoint {directory} does not match its config: {err}") from err
    return params


def save_hf_checkpoint(directory: Path, config: ModelConfig, params: dict, *, max_shard_tensors: int | None = None):
    """Write ``params`` as HF-named safetensors; with ``max_shard_tensors``, as shards plus an index file."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    widths = fused_parts(config)
    tensors = {}
    for path, hf_names, transpose in tensor_plan(config):
        host = np.asarray(_get(params, path))
        parts = [host] if len(hf_names) == 1 else np.split(host, np.cumsum(widths[path[-1]])[:-1], axis=-1)
        for hf_name, part in zip(hf_names, parts, strict=True):
            tensors[hf_name] = np.ascontiguousarray(part.T if transpose else part)
    if max_shard_tensors is None:
        save_file(tensors, str(directory / "model.safetensors"))
        return
    names = list(tensors)
    chunks = [names[i : i + max_shard_tensors] for i in range(0, len(names), max_shard_tensors)]
    weight_map = {}
    for k, chunk in enumerate(chunks):
        file = f"model-{k + 1:05d}-of-{len(chunks):05d}.safetensors"
        save_file({name: tensors[name] for name in chunk}, str(directory / file))
        weight_map.update({name: file for name in chunk})
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))


def _set(tree: dict, path: tuple, value) -> None:
    node = tree
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _get(tree: dict, path: tuple):
    for key in path:
        tree = tree[key]
    return tree
