"""The project's GGUF reader (``model/gguf_reader.py``) against the ``gguf`` package's ``GGUFReader``, on files
written by ``gguf.GGUFWriter`` (llama.cpp's own writer) and on the real SmolLM2 file: the same metadata values, of
the same Python types, as ``ReaderField.contents()``; the same tensors, byte for byte, shaped the same; and a clear
``GGUFFormatError`` wherever a file is cut short or malformed."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from real_parts import SMOLLM2

from fsm_pd.model.gguf_file import GGUFError, field, open_gguf
from fsm_pd.model.gguf_reader import GGUFFile, GGUFFormatError, read_layout

SCALARS = [("u8", 200, V.UINT8), ("i8", -100, V.INT8), ("u16", 60000, V.UINT16), ("i16", -30000, V.INT16),
           ("u32", 4_000_000_000, V.UINT32), ("i32", -2_000_000_000, V.INT32), ("f32", 1e-5, V.FLOAT32),
           ("u64", 2**63 + 5, V.UINT64), ("i64", -(2**62), V.INT64), ("f64", 0.1, V.FLOAT64),
           ("yes", True, V.BOOL), ("no", False, V.BOOL), ("text", "héllo wörld ✓", V.STRING), ("empty", "", V.STRING)]
ARRAYS = [("a.u8", [0, 255, 7], V.UINT8), ("a.i16", [-1, 2, -3], V.INT16), ("a.u32", [1, 2**32 - 1], V.UINT32),
          ("a.i32", [3, 3, 1, 1, 4], V.INT32), ("a.f32", [0.5, -1e-5, 3.25], V.FLOAT32),
          ("a.f64", [0.1, 2.5], V.FLOAT64), ("a.u64", [2**64 - 1, 0], V.UINT64), ("a.i64", [-(2**63), 1], V.INT64),
          ("a.bool", [True, False, True], V.BOOL), ("a.str", ["Ġ t", "", "<|im_start|>", "é✓", "x" * 300], V.STRING)]


def write(path, *, alignment=None, extra=(), tensors=None):
    """A file with every metadata type, nested arrays, and F32, F16, BF16 and Q8_0 tensors (3-D among them)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, value, kind in SCALARS:
        writer.add_key_value(key, value, kind)
    for key, value, kind in ARRAYS:
        writer.add_key_value(key, value, V.ARRAY, sub_type=kind)
    writer.add_array("nested.ints", [[1, 2, 3], [4], [5, 6]])
    writer.add_array("nested.strings", [["a", "bc"], ["def"]])
    writer.add_array("nested.deep", [[[1.5], [2.5, 3.5]], [[4.5]]])
    for key, value, kind, sub in extra:
        writer.add_key_value(key, value, kind, sub_type=sub)
    rng = np.random.default_rng(0)
    values = rng.standard_normal((64, 96)).astype(np.float32)
    for name, array, kind in tensors if tensors is not None else [
        ("f32", rng.standard_normal((3, 5, 7)).astype(np.float32), None),
        ("f16", rng.standard_normal((6, 10)).astype(np.float16), None),
        ("bf16", gguf.quants.quantize(values, Q.BF16), Q.BF16),
        ("q8_0", gguf.quants.quantize(values, Q.Q8_0), Q.Q8_0),
        ("odd", rng.standard_normal(13).astype(np.float32), None),  # 52 bytes: the next tensor needs padding
        ("q8_0.3d", gguf.quants.quantize(rng.standard_normal((2, 3, 64)).astype(np.float32), Q.Q8_0), Q.Q8_0),
        ("i32", np.arange(9, dtype=np.int32), None),
    ]:
        writer.add_tensor(name, array, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_same_as_gguf_reader(path):
    """Every metadata value and every tensor of ``path``, read both ways, are the same."""
    mine, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # GGUFReader's own header pseudo-fields
    assert list(mine.metadata) == keys
    for key in keys:
        expected, got = theirs.fields[key].contents(), mine.metadata[key]
        assert got == expected and type(got) is type(expected), key
        if isinstance(expected, list):
            assert [type(v) for v in got] == [type(v) for v in expected], key
    assert mine.alignment == theirs.alignment and mine.version == theirs.fields["GGUF.version"].contents()
    assert [t.name for t in mine.tensors] == [t.name for t in theirs.tensors]
    for ours, ref in zip(mine.tensors, theirs.tensors, strict=True):
        assert ours.shape == tuple(ref.shape.tolist()) and ours.tensor_type == ref.tensor_type, ref.name
        assert ours.data_offset == ref.data_offset, ref.name
        assert ours.data.dtype == ref.data.dtype and ours.data.shape == ref.data.shape, ref.name
        assert ours.data.tobytes() == ref.data.tobytes(), ref.name
        assert not ours.data.flags.writeable, ref.name
    return mine


@pytest.mark.parametrize("alignment", [None, 8, 64, 256])
def test_every_type_reads_as_gguf_readers_contents(tmp_path, alignment):
    mine = assert_same_as_gguf_reader(write(tmp_path / "m.gguf", alignment=alignment))
    assert mine.alignment == (alignment or 32)
    assert mine.metadata["nested.ints"] == [1, 2, 3, 4, 5, 6]  # flattened, as contents() does
    assert mine.metadata["a.str"][3] == "é✓" and mine.metadata["u64"] == 2**63 + 5
    for tensor in mine.tensors[:-1]:  # not the I32 one, which the library does not dequantize
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        assert values.shape == tuple(reversed(tensor.shape)), tensor.name


def test_alignment_moves_the_data(tmp_path):
    """The data section starts at the next multiple of the alignment: a reader that ignored it would read the
    tensors from the wrong bytes (the header ends off a 256-byte boundary here)."""
    path = write(tmp_path / "m.gguf", alignment=256)
    table_end = read_layout(path.read_bytes()).table_end
    mine = GGUFFile(path)
    assert table_end % 256 and mine.data_start == mine.tensors[0].data_offset == -(-table_end // 256) * 256


def test_a_walk_that_skips_the_values_finds_the_same_table(tmp_path):
    path = write(tmp_path / "m.gguf")
    with open(path, "rb") as handle:
        data = handle.read()
    full, skipped = read_layout(data), read_layout(data, values=False)
    assert skipped.metadata == {} and skipped.kinds == full.kinds
    assert skipped.table == full.table and skipped.table_end == full.table_end
    assert full.kinds["a.str"] == V.ARRAY and full.kinds["f32"] == V.FLOAT32


def raw_gguf(entries: list[tuple[str, int, bytes]], version: int = 3) -> bytes:
    """A GGUF file of metadata alone, written by hand: what GGUFWriter will not write (empty arrays, bad types)."""
    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text.encode())) + text.encode()
    body = b"".join(string(key) + struct.pack("<I", kind) + value for key, kind, value in entries)
    return b"GGUF" + struct.pack("<IQQ", version, 0, len(entries)) + body


def test_empty_arrays(tmp_path):
    path = tmp_path / "e.gguf"
    path.write_bytes(raw_gguf([("ints", V.ARRAY, struct.pack("<IQ", V.INT32, 0)),
                               ("strings", V.ARRAY, struct.pack("<IQ", V.STRING, 0))]))
    assert assert_same_as_gguf_reader(path).metadata == {"ints": [], "strings": []}


def test_a_string_that_is_not_utf8_fails_only_where_it_is_read(tmp_path):
    extra = [("bad.text", b"ok \xff", V.STRING, None), ("bad.list", [b"fine", b"\xc3("], V.ARRAY, V.STRING)]
    path = write(tmp_path / "m.gguf", extra=extra)
    mine = GGUFFile(path)
    assert set(mine.unreadable) == {"bad.text", "bad.list"} and "bad.text" not in mine.metadata
    assert mine.metadata["i32"] == -2_000_000_000 and len(mine.tensors) == 7  # the walk went on past them
    reader = open_gguf(path)
    with pytest.raises(GGUFError, match="metadata 'bad.list' cannot be read: not UTF-8"):
        field(reader, "bad.list")
    assert field(reader, "text") == "héllo wörld ✓" and field(reader, "absent", 3) == 3


@pytest.mark.parametrize("entries, version, message", [
    ([], 1, "version 1 is not read here"),
    ([], 3 << 24, "version 50331648 is not read here"),  # a big-endian file's 3
    ([("x", 13, b"")], 3, "x has unknown value type 13"),
    ([("x", V.ARRAY, struct.pack("<IQ", 13, 1))], 3, "x is an array of unknown value type 13"),
    ([("x", V.UINT8, b"\1"), ("x", V.UINT8, b"\2")], 3, "'x' appears twice"),
    ([("general.alignment", V.UINT32, struct.pack("<I", 48))], 3, "48 is not a u32 power of two"),
    ([("general.alignment", V.UINT64, struct.pack("<Q", 64))], 3, "64 is not a u32 power of two"),
])
def test_malformed_headers_are_refused(tmp_path, entries, version, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(raw_gguf(entries, version) + bytes(64))
    with pytest.raises(GGUFFormatError, match=message):
        GGUFFile(path)
    with pytest.raises(GGUFError, match="bad.gguf is not a readable GGUF file"):
        open_gguf(path)


def test_a_tensor_name_twice_is_refused(tmp_path):
    path = write(tmp_path / "m.gguf", tensors=[("w", np.zeros(4, np.float32), None)])
    whole = bytearray(path.read_bytes())
    table = read_layout(bytes(whole)).table_end - (8 + 1 + 4 + 8 + 4 + 8)  # one entry: name, dims, shape, type, offset
    entry = whole[table:table + 33]
    whole[8:16] = struct.pack("<Q", 2)  # two tensors, the second the first again
    path.write_bytes(bytes(whole[:table + 33]) + entry + bytes(whole[table + 33:]))
    with pytest.raises(GGUFFormatError, match="tensor name 'w' appears twice"):
        GGUFFile(path)


def test_bad_magic_and_too_short(tmp_path):
    (tmp_path / "magic.gguf").write_bytes(b"GGML" + bytes(64))
    with pytest.raises(GGUFFormatError, match="magic b'GGML'"):
        GGUFFile(tmp_path / "magic.gguf")
    for size in (0, 10, 23):
        (tmp_path / "short.gguf").write_bytes((b"GGUF\3\0\0\0" + bytes(16))[:size])
        with pytest.raises(GGUFError, match=f"{size} bytes are too few for a GGUF header"):
            open_gguf(tmp_path / "short.gguf")


def test_every_cut_short_of_the_last_tensor_is_refused(tmp_path):
    """Cut anywhere in the header (the keys, the string arrays, the tensor table) or in any tensor's data, the file
    is a ``GGUFFormatError`` that says what ran past the end, never another error or a wrong read."""
    whole = write(tmp_path / "m.gguf").read_bytes()
    tensors = GGUFFile(tmp_path / "m.gguf").tensors
    in_data = [at for t in tensors for at in (t.data_offset + 1, t.data_offset + t.data.nbytes - 1)]
    cut = tmp_path / "cut.gguf"
    for size in [*range(24, tensors[0].data_offset + 1), *in_data]:
        cut.write_bytes(whole[:size])
        with pytest.raises(GGUFFormatError, match="past the end of the file"):
            GGUFFile(cut)
    end = tensors[-1].data_offset + tensors[-1].data.nbytes
    cut.write_bytes(whole[:end])  # only the padding after the last tensor is missing: all there is, is read
    assert GGUFFile(cut).tensors[-1].data.tobytes() == tensors[-1].data.tobytes()


def test_a_tensor_past_the_end_is_named(tmp_path):
    whole = write(tmp_path / "m.gguf").read_bytes()
    last = GGUFFile(tmp_path / "m.gguf").tensors[-1]
    (tmp_path / "cut.gguf").write_bytes(whole[:last.data_offset + last.data.nbytes - 1])
    with pytest.raises(GGUFError, match=r"cut\.gguf is not a readable GGUF file: .*tensor 'i32''s data"):
        open_gguf(tmp_path / "cut.gguf")


@SMOLLM2
def test_smollm2_reads_as_gguf_reader_reads_it():
    from fsm_pd.model.specs import resolve_named_model

    mine = assert_same_as_gguf_reader(resolve_named_model("smollm2"))
    assert len(mine.metadata["tokenizer.ggml.tokens"]) == 49152 and len(mine.tensors) == 272
