"""The largest array of a model, read from its files' headers before anything loads (jax-free, no ``gguf`` import).

A node sizes libtpu's host buffer before jax opens the chip (``runtime/tpu_host_buffer.py``), and a copy larger than
that buffer goes 20x slower, so it needs the largest array it will move: the weights go up one array at a time.
``gguf.GGUFReader`` took 5.0 s for SmolLM2's header on a 2-core machine (it decodes every token of the vocabulary);
here a GGUF file's metadata is skipped by its lengths, and only the tensor table is read (``gguf_reader.read_layout``,
tens of milliseconds; it imports numpy, not jax or ``gguf``). An HF directory's ``*.safetensors`` headers are JSON.
``None`` where a file cannot be read this way: the caller then asks for a size that holds any array of a model up to
a few billion parameters.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path

from fsm_pd.model.gguf_reader import read_layout
from fsm_pd.model.specs import NAMED_MODELS, TINY_SPEC, resolve_named_model

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
        table = read_layout(data, values=False).table
    return max((math.prod(entry.shape) for entry in table), default=0) or None
