"""bench/tpu.py on this machine's CPU (``--quick``): every figure comes with its roofline and share, the larger
pool's step is measured beside the default one's, and the report's table says what the JSON says."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import pytest

# appended, not put first: a bench module must never shadow an installed package for the rest of the run
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import tpu  # noqa: E402

# Not marked ``chip``: on a TPU host these run on the suite's CPU workers (tests/on_tpu.sh), and the chip runs both
# benches as the chip check's own parts (``tpu`` and ``parity``, bench/chip_check.py) right after the suite. Run in
# the chip's one process too, they held 46 s of its 370 (r9), the half that bounds the suite's time there.


def test_quick_run_reports_each_figure_against_its_roofline(tmp_path):
    """At one batch of 4 (--quick's figures at batch 1 too are bench/chip_check.py's: each batch is another compile of
    every program here, half of this test's time on the chip)."""
    out, table = tmp_path / "tpu.json", tmp_path / "tpu.md"
    assert tpu.main(["--quick", "--batches", "4", "--step-batches", "4", "--json", str(out), "--markdown",
                     str(table)]) == 0
    report = json.loads(out.read_text())
    # a CPU's peaks are measured here; a known accelerator's come from its datasheet
    assert report["peaks"] == ("measured here" if report["device"].startswith("cpu") else "datasheet")
    assert report["hbm_GBps"] > 0 and report["peak_TFLOPs"] > 0
    figures = report["models"]["smollm2-135m"]
    decode = figures["decode"]
    page = report["default_page_size"]
    pools = sorted({key.split("/")[2] for key in decode if key.split("/")[1] == f"page{page}"})
    assert len(pools) == 2, decode.keys()  # the default pool and the larger one, at the default page size
    for mode in ("jnp", "tpu"):  # each attention, measured in the same run
        for pool in pools:
            assert list(decode[f"{mode}/page{page}/{pool}"]) == ["4"]  # the batch asked for, though --quick
            for batch, step in decode[f"{mode}/page{page}/{pool}"].items():
                assert step["step_ms"] > 0 and step["roofline_ms"] > 0, (mode, pool, batch, step)
                assert abs(step["share"] - step["roofline_ms"] / step["step_ms"]) < 0.01
                if mode != "jnp":  # against the jnp step of the same pool
                    jnp_ms = decode[f"jnp/page{page}/{pool}"][batch]["step_ms"]
                    assert abs(step["vs_jnp"] - jnp_ms / step["step_ms"]) < 0.01 + 0.01 * step["vs_jnp"]
    for mode in ("jnp", "tpu"):
        prefill = next(iter(figures[f"prefill/{mode}"].values()))
        assert prefill["ms"] > 0 and prefill["share"] > 0
    copies = figures["copies"]
    assert copies["gather"]["GBps"] > 0 and copies["scatter"]["GBps"] > 0
    assert list(figures["steps"]) == ["4"]
    for batch, step in figures["steps"].items():  # several decode steps a dispatch against one at a time
        assert step["host_step_ms"] > 0 and step["k1_ms_per_token"] > 0 and step["k4_ms_per_token"] > 0, (batch, step)
        assert abs(step["speedup_vs_host_step"] - step["host_step_ms"] / step["k4_ms_per_token"]) < 0.01 + 0.01 * \
            step["speedup_vs_host_step"]
    text = table.read_text()
    first = decode[f"jnp/page{page}/{pools[0]}"]["4"]["step_ms"]
    assert f"{first} (" in text and "gather" in text


def test_parity_quick_run_finds_the_chunked_batched_path_equal_to_the_whole_prompt_reference(tmp_path):
    """bench/chip_parity.py on this machine (--quick): a child process computes the float32 reference; this one
    prefills in two chunks and decodes the prompts as one ragged batch, step by step and several steps a dispatch,
    in 64-token pages (a TPU pool's candidate), with jnp and with the TPU kernels (interpret mode off a TPU), which
    must really run: --quick's model has a head_dim they take. On a CPU in float32 they must agree at every step,
    else the chunked or batched path, or a kernel at that page size, changed the math."""
    import chip_parity

    out = tmp_path / "parity.json"
    kernels = "tpu" if jax.default_backend() == "tpu" else "interpret"
    assert chip_parity.main(["--quick", "--modes", f"jnp,{kernels}", "--page-sizes", "64", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for mode in ("jnp", kernels):
        for key in (mode, f"{mode}/multi-step"):
            figures = report["models"]["quick-64"][key]
            assert figures["kernels"] == mode, (key, figures)  # the attention asked for is the one that ran
            checked = figures["steps"] if "steps" in figures else figures["tokens"]
            if report["device"].startswith("cpu"):
                assert checked == figures["agree"] > 0, (key, figures)
                assert figures.get("rel_err_max", 0) < 1e-3, (key, figures)
            else:  # bf16 on an accelerator against the float32 reference: only near-ties may differ
                assert figures["differ"] == 0, (key, figures)


@pytest.mark.parametrize("page_size", [16, 64, 128])
def test_the_decode_pool_holds_the_largest_batch_at_every_page_size(page_size):
    """bench/tpu.py's defaults (--pages 2185, --context 512, batches up to 64): every batch is measured, none is
    skipped for want of pages, at each page size the chip compares; the pool is never smaller than --pages."""
    pages = tpu.decode_pool(2185, page_size, [1, 8, 64], 512)
    assert 1 + 64 * -(-513 // page_size) <= pages
    assert pages >= tpu.pages_of(2185, page_size)


class _Device:
    """A device that reports ``free`` bytes of its memory free (a mock: what ``memory_stats`` says on a TPU)."""

    platform = "tpu"

    def __init__(self, free: int):
        self.free = free

    def memory_stats(self) -> dict:
        return {"bytes_limit": 16 * 2**30, "bytes_in_use": 16 * 2**30 - self.free}


def test_the_larger_pool_is_the_largest_that_fits_the_memory_left():
    """The 1.7B shape's 4x pool (16 GB) ran out of a v5e's memory: the bench measures the largest pool 0.8 of the
    free memory holds instead; a pool that fits, or a device that reports no memory (the CPU), is left as asked."""
    model, _ = tpu.make_model("tiny", "float32", quick=True)
    page = model.page_bytes_on_device(16)
    assert tpu.fitting_pool(model, 1000, 16, _Device(free=10_000 * page)) == 1000
    assert tpu.fitting_pool(model, 1000, 16, _Device(free=500 * page)) == 400
    assert tpu.fitting_pool(model, 1000, 16, jax.devices("cpu")[0]) == 1000
