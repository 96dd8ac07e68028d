"""A GGUF model converted once: later starts read the parameter tree back from a safetensors file.

Converting SmolLM2's GGUF file costs about 2 s on 2 CPU cores, every start (7 to 10 s while the ``gguf`` package's
reader parsed the vocabulary; ``docs/model.md``): dequantizing, casting and laying out every tensor. A restarted node
does the same work again for the same answer. So the first load writes what it built (the parameter tree, the config,
the tokenizer) to ``$FSM_PD_MODEL_CACHE`` (default ``~/.cache/fsm-pd/models``; ``off`` disables it), and a later load
of the same file reads that instead (``docs/serving.md`` has the figures).

An entry holds the parameters as the node runs them: in the serving dtype (bfloat16 on an accelerator, stored as its
16-bit patterns, which safetensors' NumPy side knows no name for) and in the tree's own layout (fused, transposed).
Loading one reads the file into host arrays and puts them on the device in one transfer, converting nothing; the
host read needs no device, so a node does it while its accelerator opens (``model/meanwhile.py``).

The entry is keyed by the file (its resolved path, size and modification time), the dtype and ``FORMAT``, so a
changed file or a changed conversion is converted anew. An entry is written to a temporary directory and renamed into
place, so a node killed mid-write leaves no half entry; an unreadable entry is converted again. Processes that start
together (``fsm-pd launch``'s nodes) convert once: one holds the entry's lock (``converting``) while it converts, the
others wait for it and read what it saved; a process that dies converting lets the lock go with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from fsm_pd.model.config import ModelConfig
from fsm_pd.model.params import check_params

log = logging.getLogger(__name__)

ENV = "FSM_PD_MODEL_CACHE"
# bump when what a GGUF load builds changes: entries of another format are never read. 2: entries of format 1 written
# on a TPU host hold some matrices in the device's column-major order (see ``host_tensor``), so none is trusted.
# 3: tensors in the serving dtype (format 2 held float32, cast again at every load)
FORMAT = 3
# dtypes safetensors' NumPy side cannot name: stored as the unsigned integers of their width, viewed back on load
_STORED_AS = {"bfloat16": np.uint16}
_PARAMS, _META, _TOKENIZER = "params.safetensors", "meta.json", "tokenizer.json"


def cache_root(environ=os.environ) -> Path | None:
    """Where converted models live, or None when the cache is off."""
    explicit = environ.get(ENV)
    if explicit == "off":
        return None
    if explicit:
        return Path(explicit)
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fsm-pd" / "models"


def entry_dir(root: Path, source: Path, dtype: str) -> Path:
    stat = source.stat()
    key = f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}|{FORMAT}"
    return root / f"{source.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


@contextlib.contextmanager
def converting(entry: Path) -> Iterator[None]:
    """Hold ``entry``'s lock (a file beside it, ``flock``): one process at a time converts into an entry, and one
    that waited here finds the entry the other saved. Best effort, as the cache is: where the lock file cannot be
    made (a read-only cache), the conversion runs unlocked."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        handle = open(entry.parent / f"{entry.name}.lock", "a")  # noqa: SIM115 - held across the yield
    except OSError as exc:
        log.warning("cannot lock the converted model %s (%s); converting without the lock", entry, exc)
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is converting the model into %s; waiting for it", entry)
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield  # the lock goes when the file is closed (or the process ends)


def load_meta(entry: Path):
    """``(config, tokenizer)`` from an entry, or None when there is none or it cannot be read. Cheap: no tensor."""
    from tokenizers import Tokenizer as RawTokenizer

    from fsm_pd.model.tokenizer import HFTokenizer

    if not (entry / _META).is_file():
        return None
    try:
        meta = json.loads((entry / _META).read_text())
        config = ModelConfig.from_hf(meta["config"], dtype=meta["dtype"])
        tokenizer = HFTokenizer(RawTokenizer.from_file(str(entry / _TOKENIZER)),
                                eos_token_ids=tuple(meta["eos_token_ids"]), chat_template=meta["chat_template"])
    except Exception as exc:  # noqa: BLE001 - whatever the damage, converting anew repairs it
        log.warning("converted model %s unreadable (%s: %s); converting again", entry, type(exc).__name__, exc)
        return None
    return config, tokenizer


def load_host_params(entry: Path, config: ModelConfig) -> dict | None:
    """The parameter tree of an entry as host arrays in ``config.dtype``, checked against ``config``; None when it
    cannot be read. Touches no device."""
    from safetensors import safe_open

    dtype = _numpy_dtype(config.dtype)
    try:
        params: dict = {"layers": [{} for _ in range(config.num_layers)]}
        with safe_open(str(entry / _PARAMS), framework="np") as tensors:
            for name in tensors.keys():  # noqa: SIM118 - safe_open is not a dict
                node, *path = name.split(".")
                value = _from_disk(tensors.get_tensor(name), dtype)
                if node == "layers":
                    params["layers"][int(path[0])][path[1]] = value
                else:
                    params[node] = value
        check_params(config, params)
    except Exception as exc:  # noqa: BLE001 - whatever the damage, converting anew repairs it
        log.warning("converted model %s unreadable (%s: %s); converting again", entry, type(exc).__name__, exc)
        return None
    return params


def load(entry: Path):
    """``(config, params, tokenizer)`` from an entry, the parameters on the default device, or None when there is
    none or it cannot be read."""
    import jax

    if (meta := load_meta(entry)) is None:
        return None
    config, tokenizer = meta
    if (host := load_host_params(entry, config)) is None:
        return None
    return config, jax.device_put(host), tokenizer


def _numpy_dtype(name: str) -> np.dtype:
    """NumPy's dtype of a config's dtype name (bfloat16 is ``ml_dtypes``', which jax brings)."""
    if name in _STORED_AS:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def _from_disk(value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A tensor read back in ``dtype``: viewed, where it was stored as the unsigned integers of its width; one of
    another dtype is refused (the entry is then converted anew)."""
    if value.dtype == dtype:
        return value
    if value.dtype.kind != "u" or value.dtype.itemsize != dtype.itemsize:
        raise ValueError(f"a tensor stored as {value.dtype}, expected {dtype}")
    return value.view(dtype)


def host_tensor(value, dtype: str) -> np.ndarray:
    """``value`` as a row-major host array in ``dtype``, as it is written (bfloat16 as its 16-bit patterns). A TPU
    hands some arrays to NumPy in the device's own order (a ``[49152, 576]`` embedding came back column-major on a
    v5e), and safetensors writes an array's memory as it lies, whatever its strides: that entry read back transposed
    garbage, and every warm start on the chip answered noise."""
    array = np.ascontiguousarray(np.asarray(value).astype(_numpy_dtype(dtype), copy=False))
    return array.view(_STORED_AS[dtype]) if dtype in _STORED_AS else array


def save(entry: Path, config: ModelConfig, params: dict, tokenizer) -> None:
    """Write an entry (best effort: a full disk or a read-only home only costs the next start the conversion)."""
    from safetensors.numpy import save_file

    tensors = {name: host_tensor(value, config.dtype) for name, value in params.items() if name != "layers"}
    for i, layer in enumerate(params["layers"]):
        tensors.update({f"layers.{i}.{name}": host_tensor(value, config.dtype) for name, value in layer.items()})
    meta = {"format": FORMAT, "dtype": config.dtype, "config": config.to_hf(),
            "eos_token_ids": list(tokenizer.eos_token_ids), "chat_template": tokenizer.chat_template}
    staging = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=entry.parent))
        save_file(tensors, str(staging / _PARAMS))
        tokenizer._inner.save(str(staging / _TOKENIZER))
        (staging / _META).write_text(json.dumps(meta))  # last: its presence marks a whole entry
        os.replace(staging, entry)
        log.info("converted model saved to %s: later starts read it instead of the GGUF file", entry)
    except OSError as exc:
        log.warning("could not save the converted model to %s: %s", entry, exc)
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
