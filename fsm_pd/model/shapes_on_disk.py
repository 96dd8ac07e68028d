"""The largest array of a model, read from its files' headers before anything loads (jax-free, no ``gguf`` import).

A node sizes libtpu's host buffer before jax opens the chip (``runtime/tpu_host_buffer.py``), and a copy larger than
that buffer goes 20x slower, so it needs the largest array it will move: the weights go up one array at a time.
``gguf.GGUFReader`` took 5.0 s for SmolLM2's header on a 2-core machine (it decodes every token of the vocabulary);
here a GGUF file's metadata is skipped by its lengths, and only the tensor table is read (tens of milliseconds). An HF
directory's ``*.safetensors`` headers are JSON. ``None`` where a file cannot be read this way: the caller then asks
for a size that holds any array of a model up to a few billion parameters.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path

from fsm_pd.model.specs import NAMED_MODELS, TINY_SPEC, resolve_named_model

GGUF_MAGIC = b"GGUF"
# the byte sizes of GGUF's scalar metadata types by type id (8 is a string, 9 an array)
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
TINY_ELEMENTS = 1 << 16  # the built-in model's arrays are a few thousand values; a bound, not a figure


def largest_array(spec: str) -> int | None:
    """The element count of the largest array in the model ``--model`` names, or None if its files do not say."""
    try:
        if spec == TINY_SPEC:
            return TINY_ELEMENTS
        path = resolve_named_model(spec) if spec in NAMED_MODELS else Path(spec)
        if path.is_dir():
            return _largest_in_safetensors(sorted(path.glob("*.safetensors")))
        return _largest_in_gguf(path)
    except (OSError, ValueError, KeyError, struct.error):
        return None


def _largest_in_safetensors(files: list[Path]) -> int | None:
    largest = None
    for file in files:
        with open(file, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                largest = max(largest or 0, math.prod(entry["shape"]))
    return largest


def _largest_in_gguf(path: Path) -> int | None:
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        version, tensors, entries = struct.unpack_from("<IQQ", data, 4)
        if version not in (2, 3):  # version 1 counted in 32 bits; a big-endian file reads as a huge version
            raise ValueError(f"{path}: GGUF version {version} is not read here")
        at = 24
        for _ in range(entries):
            at = _skip_string(data, at)  # the key
            (kind,) = struct.unpack_from("<I", data, at)
            at = _skip_value(data, at + 4, kind)
        largest = 0
        for _ in range(tensors):
            at = _skip_string(data, at)  # the name
            (dims,) = struct.unpack_from("<I", data, at)
            shape = struct.unpack_from(f"<{dims}Q", data, at + 4)
            at += 4 + 8 * dims + 4 + 8  # the shape, then the type and the offset
            largest = max(largest, math.prod(shape))
        return largest or None


def _skip_string(data, at: int) -> int:
    (length,) = struct.unpack_from("<Q", data, at)
    return at + 8 + length


def _skip_value(data, at: int, kind: int) -> int:
    if kind == _STRING:
        return _skip_string(data, at)
    if kind == _ARRAY:
        item, count = struct.unpack_from("<IQ", data, at)
        at += 12
        if item in _SCALAR_BYTES:
            return at + count * _SCALAR_BYTES[item]
        for _ in range(count):
            at = _skip_value(data, at, item)
        return at
    return at + _SCALAR_BYTES[kind]
