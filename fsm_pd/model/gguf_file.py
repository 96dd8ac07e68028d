"""GGUF files (llama.cpp's format) to a ``ModelConfig`` and the engine's parameter tree.

``gguf_reader.GGUFFile`` parses the file (the ``gguf`` package's own reader took seconds over a vocabulary) and the
``gguf`` package dequantizes blocks; this module maps the metadata (``llama.*``, ``qwen2.*``, ``qwen3.*`` keys) onto the
config and the tensor names onto the tree. Two things differ from an HF checkpoint:

- llama.cpp's converter reorders the rows of Llama's Q and K projections so that each head's rotary pairs sit next
  to each other (its RoPE rotates adjacent elements; HF's rotates the two halves of a head). ``unpermute_rotary``
  puts them back. Qwen2/Qwen3 files are written without that reordering.
- A tensor's dimensions are listed innermost first (``ne``), so a ``[out, in]`` HF matrix is listed ``[in, out]``;
  the reader's arrays are already in numpy (outermost first) order, i.e. HF's ``[out, in]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from fsm_pd.model.config import ModelConfig, RopeScaling, UnsupportedModelError
from fsm_pd.model.gguf_reader import GGUFFile
from fsm_pd.model.params import check_params, layer_shapes, top_shapes
from fsm_pd.model.weights import CheckpointError

# Block formats this loader dequantizes (all through gguf.quants); anything else is refused by name.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
FAMILY_BY_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_VALUES_AT_ONCE = 1 << 17  # a slice dequantized at once: 512 KiB of float32, about a core's L2

# param name -> (GGUF names under blk.{i}., concatenated in this order)
_LAYER_TENSORS = {
    "attn_norm": ("attn_norm.weight",),
    "wqkv": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
    "bqkv": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "wo": ("attn_output.weight",),
    "q_norm": ("attn_q_norm.weight",),
    "k_norm": ("attn_k_norm.weight",),
    "mlp_norm": ("ffn_norm.weight",),
    "w_gate_up": ("ffn_gate.weight", "ffn_up.weight"),
    "w_down": ("ffn_down.weight",),
}
_TOP_TENSORS = {"embed": ("token_embd.weight",), "final_norm": ("output_norm.weight",), "lm_head": ("output.weight",)}
_NOT_TRANSPOSED = {"embed", "final_norm", "attn_norm", "mlp_norm", "bqkv", "q_norm", "k_norm"}


class GGUFError(CheckpointError):
    """The GGUF file is unreadable, truncated, or holds a tensor this loader cannot use."""


def open_gguf(path: Path) -> GGUFFile:
    """The header, metadata and tensor table of ``path`` (memory-mapped: tensors are read when dequantized)."""
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} not found")
    try:
        return GGUFFile(path)
    except (OSError, ValueError) as err:  # GGUFFormatError is a ValueError, as are mmap's own refusals
        raise GGUFError(f"{path} is not a readable GGUF file: {type(err).__name__}: {err}") from err


def field(reader: GGUFFile, key: str, default=None):
    """The value of metadata ``key`` (a scalar, a string or a list), ``default`` when absent."""
    if key in reader.unreadable:
        raise GGUFError(f"metadata {key!r} cannot be read: {reader.unreadable[key]}")
    return reader.metadata.get(key, default)


def config_from_gguf(reader: GGUFFile, *, dtype: str = "float32", path: str = "") -> ModelConfig:
    """Map ``general.architecture`` and its ``ARCH.*`` keys onto a ``ModelConfig``."""
    arch = field(reader, "general.architecture")
    if arch not in FAMILY_BY_ARCH:
        raise UnsupportedModelError(f"{path}: GGUF architecture {arch!r} is not supported; "
                                    f"supported: {sorted(FAMILY_BY_ARCH)}")
    tensors = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise UnsupportedModelError(f"{path}: per-frequency RoPE factors (rope_freqs.weight, Llama 3.1 style) "
                                    "are not supported")

    def need(key: str):
        value = field(reader, f"{arch}.{key}")
        if value is None:
            raise GGUFError(f"{path}: metadata {arch}.{key} is missing")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    vocab = field(reader, f"{arch}.vocab_size") or len(field(reader, "tokenizer.ggml.tokens", ()))
    if not vocab:
        raise GGUFError(f"{path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens gives the vocabulary size")
    scaling = None
    scaling_type = field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling_type == "linear":
        scaling = RopeScaling(rope_type="linear", factor=float(need("rope.scaling.factor")))
    elif scaling_type != "none":
        raise UnsupportedModelError(f"{path}: rope scaling {scaling_type!r} is not supported (none or linear)")
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        family=FAMILY_BY_ARCH[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=_decimal(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_decimal(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        dtype=dtype,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _decimal(value) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: within each head, rows ``(2i, 2i+1)`` go back to ``(i, i + head_dim/2)``.

    ``weight`` is ``[num_heads * head_dim, ...]`` (a weight or a bias) in GGUF order; the result is in HF order.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise GGUFError(f"{rows} rows do not split into {num_heads} heads of rotary pairs")
    pairs = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(pairs.swapaxes(1, 2)).reshape(weight.shape)


def tensor_plan(config: ModelConfig) -> Iterator[tuple[tuple, tuple[str, ...]]]:
    """``(tree path, GGUF names)`` for every parameter the config needs; several names are concatenated."""
    for name in top_shapes(config):
        yield (name,), _TOP_TENSORS[name]
    for i in range(config.num_layers):
        for name in layer_shapes(config):
            yield ("layers", i, name), tuple(f"blk.{i}.{n}" for n in _LAYER_TENSORS[name])


def dequantize(tensor, dtype=np.float32) -> np.ndarray:
    """One reader tensor in numpy order (HF's ``[out, in]``), checked against its declared shape: the float32 values
    ``gguf.quants`` gives, cast to ``dtype``."""
    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise GGUFError(f"tensor {tensor.name!r} has type {kind}, which this loader does not dequantize; "
                        f"supported: {', '.join(SUPPORTED_TYPES)}")
    expected = tuple(reversed(tensor.shape))
    try:
        values = _dequantize(tensor.data, kind, np.dtype(dtype))
    except Exception as err:
        raise GGUFError(f"tensor {tensor.name!r} ({kind}) cannot be dequantized: {err}") from err
    if values.shape != expected:
        raise GGUFError(f"tensor {tensor.name!r} ({kind}) holds shape {values.shape}, its header says {expected}")
    return values


def _dequantize(data: np.ndarray, kind: str, dtype: np.dtype) -> np.ndarray:
    """``gguf.quants.dequantize(data)`` cast to ``dtype``, the same bits, in slices of rows: the library dequantizes
    16 rows per call of its block code, and those calls' overhead was most of SmolLM2's conversion (2.2 s for its
    tensors, 0.9 s in slices of about ``_VALUES_AT_ONCE`` values); a slice is cast while it is in the cache. A block's
    values depend on that block alone, so how the rows are sliced changes no bit."""
    from gguf import quants

    if kind == "F32":
        return data.astype(dtype, copy=False)  # to float32: the file's own bytes, mapped
    rows = data.reshape(-1, data.shape[-1])
    blocks = None if kind == "F16" else getattr(quants, kind)  # the library's class of the format, named after it
    width = rows.shape[1] if blocks is None else rows.shape[1] // blocks.type_size * blocks.block_size
    out = np.empty((len(rows), width), dtype)
    step = max(1, _VALUES_AT_ONCE // width)
    for start in range(0, len(rows), step):
        part = rows[start:start + step]
        out[start:start + step] = part.astype(np.float32) if blocks is None else blocks.dequantize_rows(part)
    return out.reshape(*data.shape[:-1], width)


def load_gguf_params(reader: GGUFFile, config: ModelConfig, *, path: str = "",
                     on_tensor: Callable[[str], None] | None = None) -> dict:
    """Dequantize the tensors ``config`` needs into the parameter tree of host arrays, cast to ``config.dtype``.

    ``on_tensor(name)`` is called after each GGUF tensor (for a progress bar).
    """
    by_name = {t.name: t for t in reader.tensors}
    plan = list(tensor_plan(config))
    missing = [n for _, names in plan for n in names if n not in by_name]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise GGUFError(f"{path} lacks {len(missing)} tensor(s) the config needs: {shown}")
    # Only llama.cpp's Llama converter reorders Q/K rows (HF rotates halves, llama.cpp adjacent pairs).
    permuted = config.family == "llama"
    heads_of = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    dtype = jnp.dtype(config.dtype)

    params: dict = {"layers": [{} for _ in range(config.num_layers)]}
    for tree_path, names in plan:
        parts = []
        for name in names:
            value = dequantize(by_name[name], dtype)
            role = name.split(".")[-2]
            if permuted and role in heads_of:
                value = unpermute_rotary(value, heads_of[role])
            parts.append(value if tree_path[-1] in _NOT_TRANSPOSED else value.T)
            if on_tensor is not None:
                on_tensor(name)
        host = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)
        node = params
        for key in tree_path[:-1]:
            node = node[key]
        # row-major, as a converted entry reads back: a transposed view is copied again by ``converted.save`` and
        # by the transfer to the device (0.36 s for SmolLM2's to a CPU, 0.09 s row-major), so once here instead
        node[tree_path[-1]] = np.ascontiguousarray(host)  # on the host: the caller places it
    try:
        check_params(config, params)
    except ValueError as err:
        raise GGUFError(f"{path} does not match its own metadata: {err}") from err
    return params
