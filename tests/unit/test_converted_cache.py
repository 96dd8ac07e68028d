"""The converted-model cache (``model/converted.py``) reads back exactly the parameters it saved.

A TPU hands some arrays to NumPy column-major; safetensors writes memory as it lies, so such an entry read back
transposed values and every warm start on the chip answered noise. Here a column-major array stands for the chip's.
"""

import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest
from test_gguf_loader import gguf_tensors, small_config, write_gguf
from tokenizers import Tokenizer, models, pre_tokenizers

from fsm_pd.model import converted
from fsm_pd.model.params import random_params
from fsm_pd.model.tiny import tiny_model_parts
from fsm_pd.model.tokenizer import HFTokenizer

# device programs: on a TPU host they run in the process that holds the chip (tests/on_tpu.sh)
pytestmark = pytest.mark.chip


def word_tokenizer() -> HFTokenizer:
    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return HFTokenizer(raw, eos_token_ids=(2,), chat_template="{{ messages }}")


def test_an_entry_reads_back_every_tensor_also_when_the_device_handed_it_over_column_major(tmp_path):
    config, _, _ = tiny_model_parts("float32")
    params = random_params(config, seed=3)
    params["embed"] = np.asfortranarray(np.asarray(params["embed"]))  # as np.asarray of a TPU array can be
    params["layers"][0]["w_down"] = np.asfortranarray(np.asarray(params["layers"][0]["w_down"]))
    entry = tmp_path / "entry"
    converted.save(entry, config, params, word_tokenizer())
    loaded = converted.load(entry)
    assert loaded is not None
    config2, params2, tokenizer2 = loaded
    assert config2 == config
    assert np.array_equal(np.asarray(params2["embed"]), np.asarray(params["embed"]))
    for layer, layer2 in zip(params["layers"], params2["layers"], strict=True):
        for name, value in layer.items():
            assert np.array_equal(np.asarray(layer2[name]), np.asarray(value)), name
    assert tokenizer2.encode("hello world") == [1, 2] and tokenizer2.eos_token_ids == (2,)


def test_an_entry_of_another_format_is_not_read(tmp_path, monkeypatch):
    config, _, _ = tiny_model_parts("bfloat16")
    source = tmp_path / "model.gguf"
    source.write_bytes(b"x")
    old = converted.entry_dir(tmp_path, source, "bfloat16")
    monkeypatch.setattr(converted, "FORMAT", converted.FORMAT + 1)
    assert converted.entry_dir(tmp_path, source, "bfloat16") != old
    params = {k: v for k, v in random_params(config, seed=1).items()}
    converted.save(old, config, params, word_tokenizer())
    assert converted.load(old) is not None and jnp.asarray(converted.load(old)[1]["embed"]).dtype == jnp.bfloat16


# A process that converts one GGUF file into the cache dir ``root``, counting each conversion in ``count``: it waits
# for ``go`` (so two start converting together) and holds each conversion 0.5 s (the real one takes ~29 s).
RACER = """
import sys, time
from pathlib import Path
from fsm_pd.model import loader

gguf, root, count, ready, go = map(Path, sys.argv[1:6])
convert = loader._convert_gguf


def counted(*args, **kwargs):
    with count.open("a") as f:
        f.write("converted\\n")
    time.sleep(0.5)
    return convert(*args, **kwargs)


loader._convert_gguf = counted
ready.touch()
while not go.exists():
    time.sleep(0.001)
model = loader.load_gguf(gguf, cache=root)
print("embed", float(abs(model.params["embed"]).sum()))
"""


def test_two_processes_starting_together_convert_once_and_both_load_it(tmp_path):
    config = small_config()
    gguf = write_gguf(tmp_path / "m.gguf", config, gguf_tensors(config, random_params(config, seed=5)))
    root, count, go = tmp_path / "cache", tmp_path / "count", tmp_path / "go"
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(gguf), str(root), str(count),
                                str(tmp_path / f"ready-{i}"), str(go)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        while not all((tmp_path / f"ready-{i}").exists() for i in range(2)):
            assert all(r.poll() is None for r in racers), [r.communicate() for r in racers]
            time.sleep(0.01)
        go.touch()
        outputs = [r.communicate(timeout=120) for r in racers]
    finally:
        for racer in racers:
            racer.kill()
    for racer, (_, err) in zip(racers, outputs, strict=True):
        assert racer.returncode == 0, err
        assert "could not save" not in err and "WARNING" not in err, err
    assert count.read_text().splitlines() == ["converted"]  # one process converted; the other waited and read it
    assert outputs[0][0] == outputs[1][0] and outputs[0][0].startswith("embed")
    assert [p.name for p in root.iterdir() if not p.name.endswith(".lock")] == [converted.entry_dir(
        root, gguf, "float32").name]


def test_an_entry_holds_the_weights_in_the_serving_dtype_and_reads_them_back_unconverted(tmp_path):
    """A bfloat16 model's entry holds bfloat16 bits (stored as uint16, which safetensors' NumPy side can name), read
    back as bfloat16 host arrays bit for bit: a load converts nothing, and needs no device."""
    from safetensors import safe_open

    config, _, _ = tiny_model_parts("bfloat16")
    params = random_params(config, seed=2)
    entry = tmp_path / "entry"
    converted.save(entry, config, params, word_tokenizer())
    with safe_open(str(entry / "params.safetensors"), framework="np") as tensors:
        assert {str(tensors.get_tensor(name).dtype) for name in tensors.keys()} == {"uint16"}  # noqa: SIM118
    meta = converted.load_meta(entry)
    assert meta is not None and meta[0] == config
    host = converted.load_host_params(entry, config)
    assert host is not None and isinstance(host["embed"], np.ndarray) and str(host["embed"].dtype) == "bfloat16"
    assert np.array_equal(host["embed"].view(np.uint16), np.asarray(params["embed"]).view(np.uint16))
    for layer, layer2 in zip(params["layers"], host["layers"], strict=True):
        for name, value in layer.items():
            assert np.array_equal(layer2[name].view(np.uint16), np.asarray(value).view(np.uint16)), name
