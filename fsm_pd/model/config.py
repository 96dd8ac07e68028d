"""The decoder's hyper-parameters, read from an HF ``config.json`` into one frozen (hashable) record.

The record is passed to the jitted model functions as a static argument, so every field must be hashable and a change
of any field means a different compiled program.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# HF architecture name -> the family name this engine uses. Families differ only in a few switches (see ModelConfig).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_ARCH_BY_FAMILY = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}
_FAMILY_BY_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint asks for an architecture or a feature this engine does not implement."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling. ``linear`` divides positions by ``factor``; ``llama3`` rescales low frequencies only."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    family: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (always on for Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    dtype: str = "float32"  # parameters and activations
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def group_size(self) -> int:
        """Query heads that share one KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def to_hf(self) -> dict:
        """The ``config.json`` that ``from_hf`` reads back to this config (dtype aside)."""
        hf = {
            "architectures": [_ARCH_BY_FAMILY[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
            "torch_dtype": self.dtype,
        }
        if self.rope_scaling is not None:
            hf["rope_scaling"] = {
                "rope_type": self.rope_scaling.rope_type,
                "factor": self.rope_scaling.factor,
                "low_freq_factor": self.rope_scaling.low_freq_factor,
                "high_freq_factor": self.rope_scaling.high_freq_factor,
                "original_max_position_embeddings": self.rope_scaling.original_max_position_embeddings,
            }
        return hf

    @classmethod
    def from_hf(cls, hf: dict, *, dtype: str = "float32") -> ModelConfig:
        """Build from the parsed ``config.json`` of a Llama, Qwen2 or Qwen3 checkpoint."""
        family = _family_of(hf)
        if hf.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=true is not supported")
        if hf.get("use_sliding_window"):
            raise UnsupportedModelError("sliding-window attention (use_sliding_window=true) is not supported")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act={act!r} is not supported (only 'silu')")
        num_heads = int(hf["num_attention_heads"])
        theta, scaling = _rope_of(hf)
        return cls(
            family=family,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            dtype=dtype,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(hf.get("eos_token_id")),
        )


def _family_of(hf: dict) -> str:
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    if not archs and hf.get("model_type") in _FAMILY_BY_MODEL_TYPE:
        return _FAMILY_BY_MODEL_TYPE[hf["model_type"]]
    named = archs or [hf.get("model_type")]
    raise UnsupportedModelError(f"unsupported architecture {named}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")


def _rope_of(hf: dict) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 writes one ``rope_parameters`` dict; older configs split it into rope_theta + rope_scaling.
    params = hf.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = dict(hf.get("rope_scaling") or params)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return theta, None
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )


def _as_id_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
