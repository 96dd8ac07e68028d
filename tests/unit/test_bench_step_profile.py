"""bench/step_profile.py: a decode step's device time from a profiler trace, on this machine's CPU (``--quick``), and
the reading of a TPU's trace planes (a device plane's ``XLA Ops`` and ``XLA Modules`` lines) on one written here in
the XSpace's text form, read back through the same ``jax.profiler.ProfileData`` the bench reads a chip's trace with."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from jax.profiler import ProfileData

# appended, not put first: a bench module must never shadow an installed package for the rest of the run
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import step_profile  # noqa: E402


def test_quick_run_reports_the_steps_device_time_by_op_and_category(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert step_profile.main(["--quick", "--batches", "4", "--steps-per-dispatch", "2", "--calls", "3", "--json",
                              str(out)]) == 0
    report = json.loads(out.read_text())
    runs = report["batches"]["4"]
    assert list(runs) == ["decode", "k2"]
    table = capsys.readouterr().out
    for f in runs.values():
        assert "error" not in f, f
        assert f["wall_ms"] > 0 and f["traced_ms"] > 0 and f["roofline_ms"] > 0, f
        assert f["ops_from"].startswith("host ops"), f  # a CPU's XLA ops are thunk events on the host plane
        assert f["busy_ms"] > 0 and f["op_us"] > 0, f
        assert f["from_hlo"] > 0.9, f  # the compiled programs' HLO names the ops the trace shows
        assert abs(f["roofline_of_busy"] - f["roofline_ms"] / f["busy_ms"]) < 0.01 * f["roofline_of_busy"] + 1e-3
        assert abs(sum(c["share"] for c in f["categories"].values()) - 1) < 0.01, f["categories"]
        assert f["categories"]["matmul"]["us"] > 0 and f["categories"]["attention (XLA ops)"]["us"] > 0, f
        assert f["top_ops"] and all(o["us"] > 0 for o in f["top_ops"]), f["top_ops"]
        assert f"wall {f['wall_ms']} ms" in table and f["top_ops"][0]["op"][:28] in table
    assert runs["k2"]["categories"]["sampling"]["us"] > 0  # the K-step program samples on the device
    assert runs["k2"]["tokens_a_call"] == 2 and runs["k2"]["programs"] == pytest.approx(0.5)  # one a dispatch


# Two programs whose op names collide (``fusion.1``), as XLA names ops per module: the op's module decides its kind.
GROUP_HLO = """HloModule jit_forward_group, is_scheduled=true

%fused_computation.1 (param_0: bf16[576,960], param_1: bf16[64,1,576]) -> bf16[64,1,960] {
  %param_0 = bf16[576,960]{1,0:T(8,128)(2,1)} parameter(0)
  %param_1 = bf16[64,1,576]{2,0,1:T(8,128)(2,1)} parameter(1)
  ROOT %convolution.1 = bf16[64,1,960]{2,0,1:T(8,128)(2,1)} convolution(%param_1, %param_0), dim_labels=b0f_io->b0f
}

ENTRY %main.20 (x: bf16[64,1,576], w: bf16[576,960], pool: bf16[2185,16,384]) -> bf16[2185,16,384] {
  %x = bf16[64,1,576]{2,0,1:T(8,128)(2,1)} parameter(0)
  %w = bf16[576,960]{1,0:T(8,128)(2,1)} parameter(1)
  %pool = bf16[2185,16,384]{2,1,0:T(8,128)(2,1)} parameter(2)
  %fusion.1 = bf16[64,1,960]{2,0,1:T(8,128)(2,1)} fusion(%w, %x), kind=kOutput, calls=%fused_computation.1, metadata={op_name="jit(forward_group)/jit(_paged_layer)/dot_general"}
  %decode_step.12 = (f32[64,16,128]{2,1,0:T(8,128)}, bf16[2185,16,384]{2,1,0:T(8,128)(2,1)}) custom-call(%fusion.1, %pool), custom_call_target="tpu_custom_call", metadata={op_name="jit(forward_group)/jit(_paged_layer)/jit(decode_step)/pallas_call"}
  %while.1 = (s32[], f32[8]{0}) while(%decode_step.12), condition=%cond, body=%body
  ROOT %pool.2 = bf16[2185,16,384]{2,1,0:T(8,128)(2,1)} get-tuple-element(%decode_step.12), index=1
}
"""  # noqa: E501 - HLO as XLA prints it
HEAD_HLO = """HloModule jit_final_logits, is_scheduled=true

%fused_computation.9 (param_0.1: f32[576,64]) -> f32[64,576] {
  %param_0.1 = f32[576,64]{1,0} parameter(0)
  ROOT %transpose.3 = f32[64,576]{1,0} transpose(%param_0.1), dimensions={1,0}
}

ENTRY %main.4 (x: f32[576,64]) -> f32[64,576] {
  %x = f32[576,64]{1,0} parameter(0)
  ROOT %fusion.1 = f32[64,576]{1,0} fusion(%x), kind=kLoop, calls=%fused_computation.9
}
"""


def xspace(planes: str) -> ProfileData:
    return ProfileData.from_text_proto(planes)


def event(metadata: int, start_us: float, end_us: float) -> str:
    return f"events {{ metadata_id: {metadata} offset_ps: {int(start_us * 1e6)} " \
           f"duration_ps: {int((end_us - start_us) * 1e6)} }}"


def tpu_trace() -> ProfileData:
    """Two programs, 2 us apart; in the first a while loop holds the attention kernel and a matmul fusion; in the
    second a fusion of the same name that transposes, and an op no program's HLO names."""
    names = ["jit_forward_group(7)", "jit_final_logits(9)", "while.1", "decode_step.12", "fusion.1", "mystery.3"]
    metadata = " ".join(f'event_metadata {{ key: {i} value {{ id: {i} name: "{name}" }} }}'
                        for i, name in enumerate(names, 1))
    modules = " ".join([event(1, 0, 10), event(2, 12, 15)])
    ops = " ".join([event(3, 0, 8), event(4, 1, 5), event(5, 5, 7), event(5, 12, 13), event(6, 13.5, 14)])
    return xspace(f'planes {{ id: 1 name: "/host:CPU" }} planes {{ id: 2 name: "/device:TPU:0" '
                  f'lines {{ id: 1 name: "XLA Modules" timestamp_ns: 1000 {modules} }} '
                  f'lines {{ id: 2 name: "XLA Ops" timestamp_ns: 1000 {ops} }} {metadata} }}')


def test_a_tpu_trace_is_read_from_its_device_plane_with_nested_ops_counted_once():
    where, ops, programs = step_profile.device_events(tpu_trace())
    assert where == "/device:TPU:0"
    assert [p[0] for p in programs] == ["jit_forward_group", "jit_final_logits"]  # the program id dropped
    assert [(op[0], op[1]) for op in ops] == [("while.1", "jit_forward_group"), ("decode_step.12", "jit_forward_group"),
                                             ("fusion.1", "jit_forward_group"), ("fusion.1", "jit_final_logits"),
                                             ("mystery.3", "jit_final_logits")]
    hlo = dict(step_profile.hlo_ops(text) for text in (GROUP_HLO, HEAD_HLO))
    f = step_profile.summarize(ops, programs, 1, hlo, top=10)
    assert f["busy_ms"] == pytest.approx(0.0095)  # [0, 8] + [12, 13] + [13.5, 14] us
    assert f["op_us"] == pytest.approx(9.5)  # the loop's own 2 us, not its 8: its body's ops are counted once
    assert f["idle_between_programs_ms"] == pytest.approx(0.002)
    assert f["idle_inside_programs_ms"] == pytest.approx(0.0035)  # 13 us of programs, 9.5 busy
    assert f["programs"] == 2
    kinds = {kind: (c["count"], c["us"]) for kind, c in f["categories"].items()}
    assert kinds == {"attention kernel / custom call": (1, 4), "matmul": (1, 2), "copies/transposes": (1, 1),
                     "other": (2, 2.5)}
    assert f["ops"] == 5
    assert f["from_hlo"] == pytest.approx(9 / 9.5, abs=1e-3)  # all but the op no HLO names
    top = {(o["op"], o["module"]): (o["category"], o["us"], o["count"]) for o in f["top_ops"]}
    assert top[("while.1", "jit_forward_group")] == ("other", 2, 1)
    assert top[("fusion.1", "jit_forward_group")] == ("matmul", 2, 1)
    assert top[("fusion.1", "jit_final_logits")] == ("copies/transposes", 1, 1)


def test_a_trace_without_op_events_says_which_planes_and_lines_it_saw():
    trace = xspace(f'planes {{ id: 1 name: "/device:TPU:0" lines {{ id: 1 name: "Steps" timestamp_ns: 0 '
                   f'{event(1, 0, 5)} }} event_metadata {{ key: 1 value {{ id: 1 name: "step 0" }} }} }}')
    where, ops, programs = step_profile.device_events(trace)
    assert (ops, programs) == ([], [])
    assert where == "no op events on any plane (planes seen: /device:TPU:0: Steps (1))"
    report = {"device": "tpu: TPU v5 lite", "model": "m", "weights": "random", "dtype": "bfloat16", "page_size": 16,
              "context": 512, "hbm_GBps": 819.0, "batches": {1: {"decode": {
                  "tokens_a_call": 1, "wall_ms": 2.5, "traced_ms": 2.7, "roofline_ms": 0.34, "ops_from": where}}}}
    text = step_profile.table(report)
    assert "wall 2.5 ms" in text and f"no device ops in the trace: {where}" in text
