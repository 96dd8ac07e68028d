"""The parameter tree of the decoder: its shapes, and random initialisation for the built-in and benchmark models.

Layout (linear weights stored ``[in, out]`` so the forward pass is ``x @ w``)::

    {"embed": [V, D], "final_norm": [D], "lm_head": [D, V] (absent when tied),
     "layers": [ {"attn_norm": [D], "wqkv": [D, (H + 2*KVH)*Dh], "wo": [H*Dh, D],
                  "bqkv": [(H + 2*KVH)*Dh] (attention_bias), "q_norm"/"k_norm": [Dh] (qk_norm),
                  "mlp_norm": [D], "w_gate_up": [D, 2*I], "w_down": [I, D]}, ... ]}

Q, K and V share one matrix, and so do the MLP's gate and up projections: at decode batch sizes one wide matmul is
~25% faster on the CPU than two or three narrow ones reading the same input. ``fused_parts`` says how they split.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fsm_pd.model.config import ModelConfig


def layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, dh, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_out, kv_out = config.num_heads * dh, config.num_kv_heads * dh
    qkv_out = q_out + 2 * kv_out
    shapes = {
        "attn_norm": (d,),
        "wqkv": (d, qkv_out),
        "wo": (q_out, d),
        "mlp_norm": (d,),
        "w_gate_up": (d, 2 * inter),
        "w_down": (inter, d),
    }
    if config.attention_bias:
        shapes["bqkv"] = (qkv_out,)
    if config.qk_norm:
        shapes.update(q_norm=(dh,), k_norm=(dh,))
    return shapes


def fused_parts(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Widths of the parts concatenated along the last axis of each fused parameter, in order."""
    q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    qkv = (q_out, kv_out, kv_out)
    return {"wqkv": qkv, "bqkv": qkv, "w_gate_up": (config.intermediate_size, config.intermediate_size)}


def top_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = {"embed": (config.vocab_size, config.hidden_size), "final_norm": (config.hidden_size,)}
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (config.hidden_size, config.vocab_size)
    return shapes


def abstract_params(config: ModelConfig, sharding=None) -> dict:
    """The parameter tree's shapes and dtype, as ``jax.ShapeDtypeStruct`` placed by ``sharding``: what a program
    is compiled from while the weights themselves still load."""
    def leaf(shape: tuple[int, ...]) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.dtype(config.dtype), sharding=sharding)

    return {**{name: leaf(shape) for name, shape in top_shapes(config).items()},
            "layers": [{name: leaf(shape) for name, shape in layer_shapes(config).items()}
                       for _ in range(config.num_layers)]}


def check_params(config: ModelConfig, params: dict) -> None:
    """Raise ``ValueError`` naming the first parameter whose presence or shape disagrees with ``config``."""
    for name, shape in top_shapes(config).items():
        _check_one(name, params.get(name), shape)
    if len(params.get("layers", ())) != config.num_layers:
        raise ValueError(f"expected {config.num_layers} layers, got {len(params.get('layers', ()))}")
    for i, layer in enumerate(params["layers"]):
        for name, shape in layer_shapes(config).items():
            _check_one(f"layers[{i}].{name}", layer.get(name), shape)


def _check_one(name: str, value, shape: tuple[int, ...]) -> None:
    if value is None:
        raise ValueError(f"parameter {name} is missing")
    if tuple(value.shape) != shape:
        raise ValueError(f"parameter {name} has shape {tuple(value.shape)}, expected {shape}")


def random_params(config: ModelConfig, seed: int = 0, std: float = 0.02) -> dict:
    """Fixed-seed random weights: norms at 1, biases and matrices ``N(0, std)``; identical on every machine."""
    rng = np.random.default_rng(seed)  # numpy, not jax.random: its stream does not depend on the jax version

    def draw(name: str, shape: tuple[int, ...]) -> jnp.ndarray:
        if name.endswith("norm"):
            value = np.ones(shape, dtype=np.float32)
        else:
            value = rng.normal(0.0, std, size=shape).astype(np.float32)
        return jnp.asarray(value, dtype=config.dtype)

    params = {name: draw(name, shape) for name, shape in top_shapes(config).items()}
    params["layers"] = [
        {name: draw(name, shape) for name, shape in layer_shapes(config).items()} for _ in range(config.num_layers)
    ]
    return params


def cast_params(params: dict, dtype: str) -> dict:
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype=dtype), params)


def count_params(params: dict) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
