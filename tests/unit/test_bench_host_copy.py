"""bench/host_copy.py on this machine's CPU (``--quick``): every way of moving a staging array to the host and back
is timed, and each one's bytes on the host are the staging array's own, so that a faster way could carry the wire
format unchanged."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))  # appended: never shadows an installed package
import host_copy  # noqa: E402


def test_quick_run_times_every_way_and_each_reads_the_staging_bytes(tmp_path):
    assert host_copy.main(["--quick", "--json", str(tmp_path / "out.json")]) == 0
    report = json.loads((tmp_path / "out.json").read_text())
    ways = {name: v for name, v in report.items() if isinstance(v, dict)}
    assert {"as_is", "words", "words_async", "up_as_is", "up_words"} <= set(ways), report
    assert all(v["GBps"] > 0 for v in ways.values()), report
    assert all(v["same_bytes"] for v in ways.values() if "same_bytes" in v), report
    assert report["words_shape"].startswith("uint32[") and report["words_shape"].endswith(", 128]")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_words_are_the_staging_bytes_in_row_major_order(dtype):
    """The device-side bitcast keeps the bytes where a host reading them as the staging dtype expects them."""
    staging = jax.random.normal(jax.random.key(1), (2, 4, 16, 96), jnp.float32).astype(dtype)
    words = host_copy.as_words(staging)
    assert words.shape == (staging.nbytes // 4 // 128, 128) and words.dtype == jnp.uint32
    assert np.asarray(words).tobytes() == np.asarray(staging).tobytes()
