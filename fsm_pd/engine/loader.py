"""``load_model``: the one entry point from a model spec ("tiny" or a checkpoint directory) to a runnable model."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp

from fsm_pd.engine import model as decoder
from fsm_pd.engine.config import ModelConfig
from fsm_pd.engine.tokenizer import Tokenizer, load_hf_tokenizer
from fsm_pd.engine.weights import load_params
from fsm_pd.kernels.layout import KVLayout

TINY_SPEC = "tiny"


@dataclass(slots=True)
class LoadedModel:
    """A model ready to run. The methods are thin conveniences over the pure functions in ``engine.model``."""

    name: str
    config: ModelConfig
    params: dict
    tokenizer: Tokenizer

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.tokenizer.eos_token_ids or self.config.eos_token_ids

    def make_kv_layout(self, num_pages: int, page_size: int, *, dtype: str | None = None) -> KVLayout:
        """The pool layout this model writes, for ``num_pages`` pages (page 0 included) of ``page_size`` tokens."""
        return KVLayout(
            num_layers=self.config.num_layers,
            num_pages=num_pages,
            page_size=page_size,
            kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim,
            dtype=dtype or self.config.dtype,
        )

    def make_pool(self, layout: KVLayout) -> tuple[jax.Array, ...]:
        """A zeroed pool for ``layout``, placed on the default device (sharding over ``shard_axis`` is the caller's)."""
        expected = self.make_kv_layout(layout.num_pages, layout.page_size, dtype=layout.dtype)
        if layout.transfer_key() | {"shard_axis": None} != expected.transfer_key():
            raise ValueError(f"layout {layout} does not fit this model (expected {expected})")
        return tuple(jnp.zeros(layout.layer_shape, dtype=layout.dtype) for _ in range(layout.num_layers))

    def prefill(self, pool, token_ids: Sequence[int], page_ids: Sequence[int], **kwargs) -> decoder.PrefillResult:
        return decoder.prefill(self.config, self.params, pool, token_ids, page_ids, **kwargs)

    def prefill_batch(self, pool, prompts, page_ids, **kwargs) -> decoder.PrefillResult:
        return decoder.prefill_batch(self.config, self.params, pool, prompts, page_ids, **kwargs)

    def decode(self, pool, tokens, positions, page_tables) -> tuple[jax.Array, tuple]:
        return decoder.decode(self.config, self.params, pool, tokens, positions, page_tables)


def load_model(spec: str = TINY_SPEC, *, dtype: str = "float32") -> LoadedModel:
    """Load ``"tiny"`` (built in) or an HF checkpoint directory holding ``config.json``, ``*.safetensors`` and
    ``tokenizer.json``.

    Raises ``FileNotFoundError`` for a missing directory or file, ``UnsupportedModelError`` for an architecture or
    feature the decoder lacks, and ``CheckpointError`` for missing or mis-shaped tensors.
    """
    if spec == TINY_SPEC:
        from fsm_pd.engine.tiny import tiny_model_parts

        config, params, tokenizer = tiny_model_parts(dtype)
        return LoadedModel(TINY_SPEC, config, params, tokenizer)
    directory = Path(spec).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(f"model {spec!r} is neither {TINY_SPEC!r} nor an existing directory")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: not an HF checkpoint directory")
    config = ModelConfig.from_hf(json.loads(config_file.read_text()), dtype=dtype)
    tokenizer = load_hf_tokenizer(directory, config_eos_ids=config.eos_token_ids)
    params = load_params(directory, config)
    return LoadedModel(str(directory), config, params, tokenizer)
