"""A GGUF model converted once: later starts read the parameter tree back from a safetensors file.

Reading SmolLM2's GGUF file costs about 7 s on 2 CPU cores, every start: the gguf library parses the whole
vocabulary field by field (about 5 s) and dequantizes every tensor (about 3 s). A restarted node does the same work
again for the same answer. So the first load writes what it built (the parameter tree, the config, the tokenizer)
to ``$FSM_PD_MODEL_CACHE`` (default ``~/.cache/fsm-pd/models``; ``off`` disables it), and a later load of the same
file reads that instead (``docs/serving.md`` has the figures).

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

import jax.numpy as jnp
import numpy as np

from fsm_pd.model.config import ModelConfig
from fsm_pd.model.params import check_params

log = logging.getLogger(__name__)

ENV = "FSM_PD_MODEL_CACHE"
# bump when what a GGUF load builds changes: entries of another format are never read. 2: entries of format 1 written
# on a TPU host hold some matrices in the device's column-major order (see ``host_tensor``), so none is trusted
FORMAT = 2
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


def load(entry: Path):
    """``(config, params, tokenizer)`` from an entry, or None when there is none or it cannot be read."""
    from safetensors import safe_open
    from tokenizers import Tokenizer as RawTokenizer

    from fsm_pd.model.tokenizer import HFTokenizer

    if not (entry / _META).is_file():
        return None
    try:
        meta = json.loads((entry / _META).read_text())
        config = ModelConfig.from_hf(meta["config"], dtype=meta["dtype"])
        params: dict = {"layers": [{} for _ in range(config.num_layers)]}
        with safe_open(str(entry / _PARAMS), framework="np") as tensors:
            for name in tensors.keys():  # noqa: SIM118 - safe_open is not a dict
                node, *path = name.split(".")
                value = jnp.asarray(tensors.get_tensor(name), dtype=config.dtype)
                if node == "layers":
                    params["layers"][int(path[0])][path[1]] = value
                else:
                    params[node] = value
        check_params(config, params)
        tokenizer = HFTokenizer(RawTokenizer.from_file(str(entry / _TOKENIZER)),
                                eos_token_ids=tuple(meta["eos_token_ids"]), chat_template=meta["chat_template"])
    except Exception as exc:  # noqa: BLE001 - whatever the damage, converting anew repairs it
        log.warning("converted model %s unreadable (%s: %s); converting again", entry, type(exc).__name__, exc)
        return None
    return config, params, tokenizer


def host_tensor(value) -> np.ndarray:
    """``value`` as a row-major float32 host array. A TPU hands some arrays to NumPy in the device's own order (a
    ``[49152, 576]`` embedding came back column-major on a v5e), and safetensors writes an array's memory as it lies,
    whatever its strides: that entry read back transposed garbage, and every warm start on the chip answered noise."""
    return np.ascontiguousarray(np.asarray(value, np.float32))


def save(entry: Path, config: ModelConfig, params: dict, tokenizer) -> None:
    """Write an entry (best effort: a full disk or a read-only home only costs the next start the conversion)."""
    from safetensors.numpy import save_file

    tensors = {name: host_tensor(value) for name, value in params.items() if name != "layers"}
    for i, layer in enumerate(params["layers"]):
        tensors.update({f"layers.{i}.{name}": host_tensor(value) for name, value in layer.items()})
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
