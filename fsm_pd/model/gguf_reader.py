"""GGUF files (llama.cpp's format), read by the project itself: the header, the metadata and the tensor table.

``gguf.GGUFReader`` builds a numpy view for every element of every metadata array, and SmolLM2's file holds 49,152
tokens and 48,900 merges: opening it took about 6 s on 2 CPU cores, on the path to every cold start. Here an array
of numbers is one ``numpy.frombuffer`` and an array of strings one tight loop, and the file opens in about 0.1 s
(``docs/model.md``). The values are those ``ReaderField.contents()`` gives (Python ints, floats, bools,
strings, lists; nested arrays flattened, as it does); the tensors are read-only numpy views of the memory-mapped
file, shaped as ``GGUFReader`` shapes them, so ``gguf.quants.dequantize`` (still the library's) takes them as they are.

A walk over the file's layout (``read_layout``) also serves ``shapes_on_disk``, which must run before jax or ``gguf``
is imported: it skips the metadata by its lengths and reads the tensor table alone. Only ``GGUFFile`` imports
``gguf``, for its tensor types and their block sizes.

The layout (little-endian): ``GGUF``, a u32 version (2 or 3), u64 tensor and metadata counts; each metadata entry a
string key, a u32 value type and the value; each tensor a string name, a u32 dimension count, u64 dimensions
(innermost first), a u32 ggml type and a u64 offset into the data section, which starts at the next multiple of
``general.alignment`` (32 when absent). A string is a u64 byte length and UTF-8 bytes; an array a u32 item type, a
u64 count and the items.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 counted in 32 bits
DEFAULT_ALIGNMENT = 32
UINT32, STRING, ARRAY = 4, 8, 9
# numpy's dtype of each scalar value type, by GGUF's type id
SCALAR_DTYPES = {0: np.dtype("<u1"), 1: np.dtype("<i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"),
                 4: np.dtype("<u4"), 5: np.dtype("<i4"), 6: np.dtype("<f4"), 7: np.dtype("?"),
                 10: np.dtype("<u8"), 11: np.dtype("<i8"), 12: np.dtype("<f8")}
# the types ``GGUFReader`` hands out as typed arrays; any other (BF16, the block formats) as the rows' raw bytes
_TYPED_TENSORS = {0: np.dtype("<f4"), 1: np.dtype("<f2"), 24: np.dtype("i1"), 25: np.dtype("<i2"),
                  26: np.dtype("<i4"), 27: np.dtype("<i8"), 28: np.dtype("<f8")}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file read here: a bad magic or version, a length that runs past the end, a value of
    an unknown type, a repeated key or tensor name."""


@dataclass(frozen=True, slots=True)
class TableEntry:
    """One tensor of the table, as the header lists it."""

    name: str
    shape: tuple[int, ...]  # GGUF's order: innermost first
    type_id: int
    offset: int  # from the start of the data section


@dataclass(slots=True)
class Layout:
    """What ``read_layout`` found before the data section."""

    version: int
    metadata: dict[str, Any]  # empty when the walk skipped the values
    kinds: dict[str, int]  # key -> its value type id
    unreadable: dict[str, str]  # key -> why its value could not be decoded (a string that is not UTF-8)
    table: list[TableEntry]
    table_end: int  # the byte after the tensor table


class _Walk:
    """A position in the file's bytes; every read checks that it stays inside them, so a truncated file says where."""

    __slots__ = ("data", "size", "at")

    def __init__(self, data, at: int = 0):
        self.data, self.size, self.at = data, len(data), at

    def take(self, size: int, what: str) -> int:
        start, self.at = self.at, self.at + size
        if self.at > self.size:
            raise GGUFFormatError(f"{what} ({size} bytes at byte {start}) runs past the end of the file "
                                  f"({self.size} bytes)")
        return start

    def u32(self, what: str) -> int:
        return _U32.unpack_from(self.data, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack_from(self.data, self.take(8, what))[0]

    def raw_string(self, what: str):
        length = self.u64(f"{what}'s length")
        start = self.take(length, what)
        return self.data[start:self.at]

    def name(self, what: str) -> str:
        try:
            return self.raw_string(what).decode()
        except UnicodeDecodeError as err:
            raise GGUFFormatError(f"{what} at byte {self.at} is not UTF-8: {err}") from None

    def skip(self, kind: int, what: str) -> None:
        if kind == STRING:
            self.take(self.u64(f"{what}'s length"), what)
        elif kind == ARRAY:
            item, count = self.u32(f"{what}'s item type"), self.u64(f"{what}'s count")
            if item in SCALAR_DTYPES:
                self.take(count * SCALAR_DTYPES[item].itemsize, what)
            else:
                for _ in range(count):
                    self.skip(item, what)
        else:
            self.take(_scalar_dtype(kind, what).itemsize, what)

    def value(self, kind: int, what: str) -> Any:
        """The value ``ReaderField.contents()`` gives; raises UnicodeDecodeError for a string that is not UTF-8."""
        if kind == STRING:
            return self.raw_string(what).decode()
        if kind != ARRAY:
            dtype = _scalar_dtype(kind, what)
            return np.frombuffer(self.data, dtype, 1, self.take(dtype.itemsize, what)).tolist()[0]
        item, count = self.u32(f"{what}'s item type"), self.u64(f"{what}'s count")
        if item in SCALAR_DTYPES:
            dtype = SCALAR_DTYPES[item]
            if not count:  # frombuffer refuses an offset at the very end, even for nothing
                return []
            return np.frombuffer(self.data, dtype, count, self.take(count * dtype.itemsize, what)).tolist()
        if item == STRING:
            return self.strings(count, what)
        if item == ARRAY:
            return [leaf for _ in range(count) for leaf in self.value(ARRAY, what)]
        raise GGUFFormatError(f"{what} is an array of unknown value type {item}")

    def strings(self, count: int, what: str) -> list[str]:
        # the vocabulary and the merges: ~100,000 strings, so no call per string
        data, size, at, unpack = self.data, self.size, self.at, _U64.unpack_from
        out = []
        for _ in range(count):
            if at + 8 > size:
                break
            end = at + 8 + unpack(data, at)[0]
            if end > size:
                break
            out.append(data[at + 8:end].decode())
            at = end
        self.at = at
        if len(out) < count:
            raise GGUFFormatError(f"{what}: string {len(out)} of {count} at byte {at} runs past the end of the file "
                                  f"({size} bytes)")
        return out


def _scalar_dtype(kind: int, what: str) -> np.dtype:
    if kind not in SCALAR_DTYPES:
        raise GGUFFormatError(f"{what} has unknown value type {kind}")
    return SCALAR_DTYPES[kind]


def read_layout(data, *, values: bool = True) -> Layout:
    """Walk ``data`` (a GGUF file's bytes, e.g. an ``mmap``): the header, the metadata (decoded, or skipped by its
    lengths where ``values`` is false) and the tensor table. The tensors' data is neither read nor checked."""
    walk = _Walk(data)
    if bytes(data[:4]) != MAGIC:
        raise GGUFFormatError(f"magic {bytes(data[:4])!r} is not {MAGIC!r}")
    walk.take(4, "the magic")
    version = walk.u32("the version")
    if version not in VERSIONS:  # a big-endian file reads as a huge version
        raise GGUFFormatError(f"GGUF version {version} is not read here (versions {VERSIONS}, little-endian)")
    tensor_count, entry_count = walk.u64("the tensor count"), walk.u64("the metadata count")
    metadata: dict[str, Any] = {}
    kinds: dict[str, int] = {}
    unreadable: dict[str, str] = {}
    for index in range(entry_count):
        key = walk.name(f"metadata key {index}")
        kind = walk.u32(f"{key}'s value type")
        if key in kinds:
            raise GGUFFormatError(f"metadata key {key!r} appears twice")
        kinds[key] = kind
        if not values:
            walk.skip(kind, key)
            continue
        start = walk.at
        try:
            metadata[key] = walk.value(kind, key)
        except UnicodeDecodeError as err:  # only a caller that reads this key needs to hear of it
            walk.at = start
            walk.skip(kind, key)
            unreadable[key] = f"not UTF-8: {err}"
    table = []
    for index in range(tensor_count):
        name = walk.name(f"tensor name {index}")
        dims = walk.u32(f"{name}'s dimension count")
        shape = struct.unpack_from(f"<{dims}Q", data, walk.take(8 * dims, f"{name}'s shape"))
        table.append(TableEntry(name, shape, walk.u32(f"{name}'s type"), walk.u64(f"{name}'s offset")))
    names = [entry.name for entry in table]
    if len(set(names)) < len(names):
        twice = next(name for i, name in enumerate(names) if name in names[:i])
        raise GGUFFormatError(f"tensor name {twice!r} appears twice")
    return Layout(version, metadata, kinds, unreadable, table, walk.at)


@dataclass(frozen=True, slots=True)
class Tensor:
    """One tensor: ``data`` is what ``gguf.quants.dequantize`` takes (typed in numpy order for F32, F16 and the
    integer and f64 types; each row's raw bytes for BF16 and the block formats), a read-only view of the file."""

    name: str
    shape: tuple[int, ...]  # GGUF's order: innermost first
    tensor_type: Any  # a gguf.GGMLQuantizationType
    data: np.ndarray
    data_offset: int  # in the file


class GGUFFile:
    """A GGUF file, memory-mapped: ``metadata`` (key -> value; ``unreadable``: key -> why not), ``tensors`` (in the
    table's order), ``version``, ``alignment``, ``data_start`` (where the data section begins). Raises
    ``GGUFFormatError`` for a file that cannot be read so, ``OSError`` for one that cannot be opened."""

    def __init__(self, path: str | Path):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        with open(self.path, "rb") as handle:
            if (size := self.path.stat().st_size) < 24:  # mmap refuses an empty file, and a header is 24 bytes
                raise GGUFFormatError(f"{size} bytes are too few for a GGUF header (24)")
            # the views of the tensors keep the map open; it closes when the last of them goes
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        size = len(self._map)
        layout = read_layout(self._map)
        self.version, self.metadata, self.unreadable = layout.version, layout.metadata, layout.unreadable
        self.alignment = _alignment(layout)
        self.data_start = data_start = -(-layout.table_end // self.alignment) * self.alignment
        self.tensors: list[Tensor] = []
        for entry in layout.table:
            try:
                kind = GGMLQuantizationType(entry.type_id)
            except ValueError:
                raise GGUFFormatError(f"tensor {entry.name!r} has unknown ggml type {entry.type_id}") from None
            block, block_bytes = GGML_QUANT_SIZES[kind]
            rows = tuple(reversed(entry.shape))
            if not rows:
                raise GGUFFormatError(f"tensor {entry.name!r} has no dimensions")
            if rows[-1] % block:
                raise GGUFFormatError(f"tensor {entry.name!r} ({kind.name}): rows of {rows[-1]} values are not "
                                      f"whole blocks of {block}")
            nbytes = math.prod(rows) // block * block_bytes
            start = data_start + entry.offset
            if start + nbytes > size:
                raise GGUFFormatError(f"tensor {entry.name!r}'s data (bytes {start} to {start + nbytes}) runs past "
                                      f"the end of the file ({size} bytes)")
            if entry.type_id in _TYPED_TENSORS:
                dtype = _TYPED_TENSORS[entry.type_id]
                data = np.frombuffer(self._map, dtype, nbytes // dtype.itemsize, start).reshape(rows)
            else:
                byte_rows = (*rows[:-1], rows[-1] // block * block_bytes)
                data = np.frombuffer(self._map, np.uint8, nbytes, start).reshape(byte_rows)
            self.tensors.append(Tensor(entry.name, entry.shape, kind, data, start))



def _alignment(layout: Layout) -> int:
    if "general.alignment" not in layout.kinds:
        return DEFAULT_ALIGNMENT
    alignment = layout.metadata.get("general.alignment")
    # a u32, as llama.cpp writes it and as GGUFReader insists: where the data lies is not guessed
    if layout.kinds["general.alignment"] != UINT32 or not alignment or alignment & (alignment - 1):
        raise GGUFFormatError(f"general.alignment {alignment!r} is not a u32 power of two")
    return alignment
