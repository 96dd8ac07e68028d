"""A node started from a GGUF file, as a process on a unix socket, cold then warm on the same caches: it names each
start-up phase (the device and the weights on threads of their own), answers its first request once ready, and on
the warm start loads every program of its ready set from the compile cache, its forward passes as the serialized
executables the cold start wrote (``model/executables.py``, switched on: it is off on the CPU by default), tracing
none of them. The same for ``--role pd``, whose ``/server_info`` and ``/metrics`` carry the process's start-up as a
node's do (``bench/startup.py --roles pd``). A colocated node started again on its compile cache alone (the
executables gone) answers the same and writes no executable the compile cache handed it (XLA:CPU would write it
without its code)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import httpx
import pytest
from test_gguf_loader import gguf_tensors, small_config, write_gguf
from xla_flags import for_cold_starts

from fsm_pd.model import executables
from fsm_pd.model.params import random_params

PHASES = {"imports", "device", "model", "weights", "engine", "programs"}
# Every node here starts on an empty compile cache and compiles its ready set, then answers one request: XLA's
# cheapest compiles (-O0 on the CPU, ``xla_flags.for_cold_starts``). The warm starts read the cold one's programs all
# the same (same flags, same cache keys).
COLD_START_FLAGS = for_cold_starts()


def _client(sock) -> httpx.Client:
    return httpx.Client(base_url="http://localhost", transport=httpx.HTTPTransport(uds=str(sock)), timeout=60)


def _start(role: str, gguf, tmp_path, env: dict, name: str) -> dict:
    """Start the node, wait for ready, ask it one question, read what it says of its start; stop it."""
    sock = tmp_path / f"{name}.sock"
    argv = [sys.executable, "-m", "fsm_pd.cli", "serve", "--role", role, "--model", str(gguf), "--uds", str(sock),
            "--num-pages" if role != "pd" else "--prefill-pages", "64"]
    if role == "pd":
        argv += ["--decode-pages", "64", "--journal-dir", str(tmp_path / f"{name}-journals")]
    log = tmp_path / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                                stdin=subprocess.DEVNULL)
    try:
        with _client(sock) as client:
            deadline = time.monotonic() + 240
            while True:
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
            answer = client.post("/generate", json={"input_ids": [5, 6, 7, 8],
                                                    "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
            assert answer.status_code == 200, answer.text
            info = client.get("/server_info").json()
            return {"answer": answer.json(), "startup": info["startup"],
                    "engines": info["internal_states"][0].get("engines_startup"),
                    "metrics": client.get("/metrics").text, "log": log.read_text()}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("role", ["colocated", "pd"])
def test_a_node_names_its_phases_answers_once_ready_and_loads_every_program_from_the_cache_when_warm(tmp_path, role):
    config = small_config()
    gguf = write_gguf(tmp_path / "m.gguf", config, gguf_tensors(config, random_params(config, seed=7, std=0.5)))
    env = {**os.environ, "FSM_PD_COMPILE_CACHE": str(tmp_path / "jax"), "FSM_PD_MODEL_CACHE": str(tmp_path / "models"),
           "FSM_PD_SKIP_SERVER_WARMUP": "0", "FSM_PD_EXECUTABLE_CACHE": "on", "XLA_FLAGS": COLD_START_FLAGS}
    cold = _start(role, gguf, tmp_path, env, "cold")
    warm = _start(role, gguf, tmp_path, env, "warm")
    for run in (cold, warm):
        startup = run["startup"]
        assert startup["status"] == "ready" and set(startup["phases"]) >= PHASES, startup
        assert 'fsm_pd_startup_seconds{phase="weights"}' in run["metrics"]
        said = re.search(r"ready [0-9.]+ s after the process started \(([^;)]*)", run["log"])
        assert said and {part.split(" ")[0] for part in said.group(1).split(", ")} >= PHASES, run["log"]
        # each phase's span on the process's clock: the threads' phases overlap the main thread's
        spans, ready = startup["timeline"], startup["ready_after_s"]
        assert set(spans) == set(startup["phases"]), spans
        assert all(0 <= a <= b <= ready + 0.05 for name, (a, b) in spans.items() if name != "first_request"), spans
        assert all(b - a >= startup["phases"][name] - 0.05 for name, (a, b) in spans.items()), spans
        # the device and the model's threads start with the process, before the engine is built
        assert spans["imports"][0] == 0 and all(spans[name][0] <= spans["engine"][0]
                                                for name in ("device", "model", "weights")), spans
        if role == "pd":  # the decode engine's programs are prepared while the prefill engine is built
            decode = run["engines"]["decode"]["timeline"]
            assert decode["programs"][0] < spans["engine"][1] <= decode["programs"][1], (decode, spans)
            # and the process's programs phase (its log line, /metrics) counts that warm-up, not the prefill
            # engine's alone, which finds nearly everything prepared
            assert spans["programs"][0] <= decode["programs"][0] and startup["phases"]["programs"] >= \
                run["engines"]["decode"]["phases"]["programs"], (startup, run["engines"]["decode"])
    assert warm["answer"]["text"] == cold["answer"]["text"]
    kinds = warm["startup"]["programs_before_ready"]
    assert kinds and sum(k["programs"] for k in kinds.values()) >= 10, kinds
    compiled = {kind: k["programs"] - k["from_cache"] - k["from_executable"] for kind, k in kinds.items()}
    assert not any(compiled.values()), f"compiled on a warm start instead of loading from the cache: {compiled}"
    cold_kinds = cold["startup"]["programs_before_ready"]
    assert not any(k["from_cache"] + k["from_executable"] for k in cold_kinds.values()), {
        kind: (k["from_cache"], k["from_executable"], k["programs"]) for kind, k in cold_kinds.items()}
    # the forward passes, the samplers and the logprob programs loaded whole as the executables the cold start wrote:
    # not one traced
    forward = {kind: kinds[kind] for kind in ("decode", "prefill", "sampling", "logprobs") if kind in kinds}
    assert {"decode", "prefill", "sampling"} <= set(forward), kinds
    assert all(k["from_executable"] == k["programs"] > 0 and k["trace_s"] == k["lower_s"] == 0
               for k in forward.values()), forward
    assert list((tmp_path / "jax" / "executables").glob("*.exe")), "the cold start wrote them"
    if role != "colocated":
        return
    shutil.rmtree(tmp_path / "jax" / "executables")
    again = _start(role, gguf, tmp_path, env, "again")
    assert again["answer"]["text"] == cold["answer"]["text"]
    kinds = again["startup"]["programs_before_ready"]
    assert sum(k["from_cache"] for k in kinds.values()) >= 10 and not any(k["from_executable"] for k in kinds.values())
    written = list((tmp_path / "jax" / "executables").glob("*.exe"))
    assert all(executables.OBJECT_CODE in entry.read_bytes() for entry in written), "none from the compile cache"


@pytest.mark.timeout(300)
def test_weights_found_broken_after_the_node_listens_end_it_with_status_2_and_leave_no_socket(tmp_path):
    """The ready set is prepared beside the server's imports, and ready waits for the weights: a GGUF file whose
    config reads but whose tensors do not (one is missing) fails once the programs are compiled, after the node
    listens (a cold compile of the ready set takes seconds, the app a second). The process then ends with its one
    line and status 2, its ``--uds`` socket file gone."""
    config = small_config()
    tensors = gguf_tensors(config, random_params(config, seed=7, std=0.5))
    gguf = write_gguf(tmp_path / "m.gguf", config, tensors, skip={"blk.1.ffn_gate.weight"})
    sock = tmp_path / "node.sock"
    env = {**os.environ, "FSM_PD_COMPILE_CACHE": str(tmp_path / "jax"), "FSM_PD_MODEL_CACHE": str(tmp_path / "models"),
           "FSM_PD_SKIP_SERVER_WARMUP": "0", "XLA_FLAGS": COLD_START_FLAGS}
    result = subprocess.run([sys.executable, "-m", "fsm_pd.cli", "serve", "--role", "colocated", "--model", str(gguf),
                             "--uds", str(sock), "--num-pages", "64"], env=env, cwd=tmp_path, capture_output=True,
                            text=True, timeout=240, stdin=subprocess.DEVNULL)
    out = result.stdout + result.stderr
    assert result.returncode == 2 and "cannot load model" in out and "blk.1.ffn_gate.weight" in out, out[-3000:]
    assert f"serving HTTP on unix socket {sock}" in out, out[-3000:]  # it listened before the weights failed it
    assert not sock.exists()
