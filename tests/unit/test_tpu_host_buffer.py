"""A node asks libtpu for a premapped host buffer sized for what it copies before jax opens a TPU, and never
overrides a user's size (``runtime/tpu_host_buffer.py``, ``model/shapes_on_disk.py``)."""

import contextlib
import json
import logging
import os
import struct

import pytest
from real_parts import SMOLLM2

from fsm_pd.cli import serve
from fsm_pd.model.shapes_on_disk import largest_array
from fsm_pd.runtime.tpu_host_buffer import DEFAULT_BYTES, MIN_BYTES, SIZE_ENV, ask_for_buffer, buffer_for


def test_the_buffer_holds_the_largest_copy_with_a_quarter_to_spare_from_256_mib_up():
    assert buffer_for(None) == DEFAULT_BYTES == 1 << 30  # not known: what holds a 1.7B model's embedding
    assert buffer_for(54 << 20) == MIN_BYTES == 256 << 20  # SmolLM2's embedding in bfloat16
    assert buffer_for(622_000_000) == 1 << 30  # Qwen3-1.7B's
    assert buffer_for(900 << 20) == 2 << 30  # a quarter to spare does not fit in 1 GiB
    assert buffer_for(1) == MIN_BYTES


def test_a_tpu_start_asks_for_a_size_and_only_then_reads_the_model():
    environ, read = {}, []
    assert ask_for_buffer("tpu", environ, lambda: read.append(1) or 54 << 20) == MIN_BYTES
    assert environ == {SIZE_ENV: str(MIN_BYTES)} and read == [1]
    environ = {SIZE_ENV: str(8 << 30)}  # the user's size wins, and nothing is read for it
    assert ask_for_buffer("tpu", environ, lambda: read.append(2)) is None
    assert environ == {SIZE_ENV: str(8 << 30)} and read == [1]
    for platform in ("cpu", "gpu", "cuda"):
        environ = {}
        assert ask_for_buffer(platform, environ, lambda: read.append(3)) is None
        assert environ == {} and read == [1]


def _gguf(path, tensors, kv):
    """A GGUF v3 file with the metadata ``kv`` ({key: (type id, packed value bytes)}) and ``tensors``
    ({name: shape}), no data: what ``largest_array`` reads is the header."""
    def string(text):
        raw = text.encode()
        return struct.pack("<Q", len(raw)) + raw
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv))
    for key, (kind, value) in kv.items():
        out += string(key) + struct.pack("<I", kind) + value
    for name, shape in tensors.items():
        out += string(name) + struct.pack(f"<I{len(shape)}Q", len(shape), *shape) + struct.pack("<IQ", 1, 0)
    path.write_bytes(out)
    return path


def test_largest_array_reads_a_gguf_header_past_its_metadata(tmp_path):
    tokens = [b"a", b"bc", b"def"] * 1000
    array_of_strings = struct.pack("<IQ", 8, len(tokens)) + b"".join(struct.pack("<Q", len(t)) + t for t in tokens)
    kv = {"general.name": (8, struct.pack("<Q", 4) + b"test"), "llama.embedding_length": (4, struct.pack("<I", 64)),
          "tokenizer.ggml.tokens": (9, array_of_strings),
          "tokenizer.ggml.scores": (9, struct.pack("<IQ", 6, 3) + struct.pack("<3f", 0, 1, 2)),
          "nested": (9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 4, 2) + struct.pack("<2I", 7, 8))}
    path = _gguf(tmp_path / "m.gguf", {"token_embd.weight": (64, 3000), "blk.0.attn_q.weight": (64, 64)}, kv)
    assert largest_array(str(path)) == 64 * 3000


def test_largest_array_reads_safetensors_headers(tmp_path):
    for index, shapes in enumerate(({"embed": [3000, 64], "q": [64, 64]}, {"lm_head": [4000, 64]})):
        header = json.dumps({"__metadata__": {"format": "pt"},
                             **{name: {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]}
                                for name, shape in shapes.items()}}).encode()
        (tmp_path / f"model-{index}.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    assert largest_array(str(tmp_path)) == 4000 * 64


def test_a_model_whose_headers_cannot_be_read_says_none(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file")
    assert largest_array(str(tmp_path / "bad.gguf")) is None
    assert largest_array(str(tmp_path / "missing.gguf")) is None
    truncated = _gguf(tmp_path / "t.gguf", {"w": (8, 8)}, {})
    truncated.write_bytes(truncated.read_bytes()[:-24])  # into its shape
    assert largest_array(str(truncated)) is None
    old = _gguf(tmp_path / "v1.gguf", {"w": (8, 8)}, {})
    old.write_bytes(old.read_bytes()[:4] + struct.pack("<I", 1) + old.read_bytes()[8:])  # version 1: 32-bit counts
    assert largest_array(str(old)) is None


@SMOLLM2
def test_smollm2s_largest_array_is_its_embedding():
    assert largest_array("smollm2") == 49152 * 576
    assert buffer_for(largest_array("smollm2") * 2) == MIN_BYTES


@pytest.mark.parametrize("role, extra, expected", [
    ("colocated", [], MIN_BYTES), ("pd", [], MIN_BYTES), ("pd", ["--prefill-devices", "1", "--decode-devices", "1"],
                                                            MIN_BYTES),
    ("pd", ["--transfer-backend", "zmq"], DEFAULT_BYTES),  # its handoff stages KV through the host
    ("prefill", [], DEFAULT_BYTES), ("decode", [], DEFAULT_BYTES)])
def test_serve_sizes_the_buffer_by_what_the_role_copies(monkeypatch, caplog, tmp_path, role, extra, expected):
    model = _gguf(tmp_path / "m.gguf", {"token_embd.weight": (576, 49152)}, {})
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    monkeypatch.delenv(SIZE_ENV, raising=False)
    args = serve.node_parser(role).parse_args(["--role", role, "--model", str(model), *extra])
    with caplog.at_level(logging.INFO, logger="fsm_pd.serve"):
        serve.ask_for_host_buffer(args, role)
    assert os.environ[SIZE_ENV] == str(expected)
    assert f"{expected >> 20} MiB" in caplog.text


def test_serve_leaves_a_cpu_start_alone(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv(SIZE_ENV, raising=False)
    args = serve.node_parser("colocated").parse_args(["--role", "colocated", "--model", "tiny"])
    serve.ask_for_host_buffer(args, "colocated")
    assert SIZE_ENV not in os.environ


class Opened(Exception):
    pass


def test_serve_main_asks_before_it_starts_opening_the_devices(monkeypatch, tmp_path):
    from fsm_pd.cli import side_by_side

    seen = {}

    def opening():
        seen["size"] = os.environ.get(SIZE_ENV)
        raise Opened

    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    monkeypatch.delenv(SIZE_ENV, raising=False)
    monkeypatch.setattr(side_by_side, "DeviceOpening", opening)
    with contextlib.suppress(Opened):
        serve.serve_main(["--role", "colocated", "--model", "tiny", "--uds", str(tmp_path / "node.sock")])
    assert seen == {"size": str(MIN_BYTES)}
