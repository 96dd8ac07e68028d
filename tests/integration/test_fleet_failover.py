"""Requests survive a failed node: 2 prefill + 2 decode ``fsm-pd serve`` processes (tiny model, tcp, short deadlines
and heartbeats) behind the built-in router, 32 concurrent mixed streamed and whole requests, greedy.

One cluster, three phases in order (each needs the damage of the one before): SIGKILL one prefill node mid-load,
every request succeeds with the undisturbed run's output; SIGKILL one decode node mid-stream, every stream completes
with the undisturbed output (``/generate`` streams migrate; whole answers are re-run); then kill the last prefill
node, and requests fail fast with 503 and the reason. Prints the figures (``pytest -s``).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fault_rig import ENV
from processes import Cluster, free_port

CONCURRENCY = 32
KINDS = ("generate", "generate-stream", "chat", "chat-stream")


def request(kind: str, i: int, tokens: int) -> tuple[str, dict]:
    prompt = f"request {i}: " + "abc " * (i % 5)
    if kind.startswith("generate"):
        return "/generate", {"text": prompt, "stream": kind.endswith("stream"), "sampling_params": {
            "max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    return "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": prompt}],
                                    "max_tokens": tokens, "temperature": 0, "stream": kind.endswith("stream")}


def send(router: str, kind: str, i: int, tokens: int, first_chunk=None) -> dict:
    """One request; its status, output (ids for /generate, text for chat), seconds, and error if any."""
    path, body = request(kind, i, tokens)
    started = time.monotonic()
    out: dict = {"kind": kind, "i": i}
    with httpx.Client(timeout=120) as client:
        if not body["stream"]:
            r = client.post(router + path, json=body)
            out["status"] = r.status_code
            doc = r.json()
            if r.status_code == 200:
                out["output"] = doc["output_ids"] if kind == "generate" else doc["choices"][0]["message"]["content"]
            else:
                out["error"] = doc["error"]
        else:
            with client.stream("POST", router + path, json=body) as r:
                out["status"] = r.status_code
                if r.status_code != 200:
                    r.read()
                    out["error"] = r.json()["error"]
                else:
                    text, ids, done = "", [], False
                    for line in r.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            break
                        event = json.loads(line[6:])
                        if "error" in event:
                            out["error"] = event["error"]
                            break
                        if first_chunk is not None:
                            first_chunk()
                        if kind == "generate-stream":
                            ids = event["output_ids"]
                        else:
                            text += event["choices"][0]["delta"].get("content") or ""
                    out["output"] = ids if kind == "generate-stream" else text
                    out["complete"] = done and "error" not in out
    out["seconds"] = time.monotonic() - started
    return out


def run_load(router: str, tokens: int, kinds=KINDS, during=None) -> list[dict]:
    """CONCURRENCY requests at once; ``during(results_so_far_count)`` runs on this thread meanwhile."""
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        chunks = []
        futures = [pool.submit(send, router, kinds[i % len(kinds)], i, tokens, lambda i=i: chunks.append(i))
                   for i in range(CONCURRENCY)]
        if during is not None:
            during(chunks)
        return [f.result() for f in futures]


def metric(router: str, name: str) -> dict[str, float]:
    found = {}
    for line in httpx.get(router + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name):
            labels, _, value = line.rpartition(" ")
            found[labels[len(name):]] = float(value)
    return found


@pytest.fixture
def fleet(tmp_path):
    cluster = Cluster(tmp_path)
    # fault_rig's heartbeats (a dead peer fails its rooms within ~1 s), but 15 s room deadlines: after a kill the
    # survivors take twice the load and compile new batch shapes, which 2 busy cores can take seconds to do
    cluster.env = {**cluster.env, **ENV, **{k: "15" for k in ENV if k.endswith("_TIMEOUT")}}
    try:
        prefills, boots = [], []
        for _ in range(2):
            boots.append(free_port())
            prefills.append(cluster.serve("prefill", "--bootstrap-port", str(boots[-1]), "--transfer-backend", "tcp"))
        decodes = [cluster.serve("decode", "--transfer-backend", "tcp") for _ in range(2)]
        port = free_port()
        argv = [sys.executable, "-m", "fsm_pd.cli", "serve", "--role", "router", "--port", str(port),
                "--health-check-interval-secs", "0.5", "--health-check-timeout-secs", "2"]
        for p, boot in zip(prefills, boots, strict=True):
            argv += ["--prefill", p, str(boot)]
        for d in decodes:
            argv += ["--decode", d]
        router = cluster.start("router", argv, f"http://127.0.0.1:{port}")
        procs = dict(zip(prefills + decodes, cluster.procs, strict=False))
        yield router, prefills, decodes, procs
    finally:
        cluster.stop()


def kill(proc) -> None:
    os.kill(proc.pid, signal.SIGKILL)  # a node this test started
    proc.wait(timeout=10)


def by_request(results: list[dict]) -> dict:
    return {(r["kind"], r["i"]): r.get("output") for r in results}


@pytest.mark.timeout(600)
def test_requests_survive_a_killed_prefill_and_a_killed_decode(fleet):
    router, prefills, decodes, procs = fleet
    short, long = 8, 48
    for _ in range(2):  # the first rounds compile (and may miss the short deadlines); the second is the baseline
        baseline_short = run_load(router, short)
        baseline_long = run_load(router, long, kinds=KINDS[:3])
    failed = [r for r in baseline_short + baseline_long if r["status"] != 200 or not r.get("complete", True)]
    assert failed == []
    quiet = statistics.median(r["seconds"] for r in baseline_short)
    figures = {"baseline_median_s": round(quiet, 2)}

    # 1. SIGKILL a prefill node while 32 requests are in flight: every one succeeds, with the undisturbed output
    hit = run_load(router, short, during=lambda chunks: (time.sleep(0.3), kill(procs[prefills[0]])))
    assert [r for r in hit if r["status"] != 200 or not r.get("complete", True)] == []
    assert by_request(hit) == by_request(baseline_short)
    retries = metric(router, "fsm_pd_router_retries_total")
    figures["prefill_kill"] = {"ok": sum(r["status"] == 200 for r in hit), "of": len(hit),
                               "median_s": round(statistics.median(r["seconds"] for r in hit), 2),
                               "max_s": round(max(r["seconds"] for r in hit), 2), "retries": retries}

    # 2. SIGKILL a decode node once the streams have started: every stream completes, output undisturbed
    streams = {i for i in range(CONCURRENCY) if KINDS[:3][i % 3].endswith("stream")}

    def kill_decode_mid_stream(chunks):
        deadline = time.monotonic() + 60
        while set(chunks) < streams and time.monotonic() < deadline:  # every stream has tokens out
            time.sleep(0.01)
        kill(procs[decodes[0]])

    moved = run_load(router, long, kinds=KINDS[:3], during=kill_decode_mid_stream)
    assert [r for r in moved if r["status"] != 200 or not r.get("complete", True)] == []
    assert by_request(moved) == by_request(baseline_long)
    migrations = metric(router, "fsm_pd_router_migrations_total")
    assert sum(migrations.values()) >= 1, (migrations, metric(router, "fsm_pd_router_retries_total"))
    long_quiet = statistics.median(r["seconds"] for r in baseline_long)
    figures["decode_kill"] = {"ok": sum(r["status"] == 200 for r in moved), "of": len(moved),
                              "baseline_median_s": round(long_quiet, 2),
                              "median_s": round(statistics.median(r["seconds"] for r in moved), 2),
                              "max_s": round(max(r["seconds"] for r in moved), 2), "migrations": migrations}

    # 3. The last prefill node goes too: requests fail fast with 503 and the reason
    kill(procs[prefills[1]])
    dead = run_load(router, short)
    assert {r["status"] for r in dead} == {503}, [r for r in dead if r["status"] != 503][:3]
    assert all("prefill" in r["error"]["message"] for r in dead), dead[0]
    assert max(r["seconds"] for r in dead) < 5.0, max(r["seconds"] for r in dead)
    refused = metric(router, "fsm_pd_router_failover_refused_total")
    figures["no_prefill"] = {"statuses": sorted({r["status"] for r in dead}),
                             "max_s": round(max(r["seconds"] for r in dead), 2),
                             "codes": sorted({str(r["error"].get("code")) for r in dead}), "refused": refused,
                             "ejections": metric(router, "fsm_pd_router_worker_ejections_total")}
    # once the health checks have ejected it, the router does not even try: 503 at once, naming the ejected workers
    deadline = time.monotonic() + 20
    while httpx.get(router + "/health", timeout=10).json()["admitted"]["prefill"] and time.monotonic() < deadline:
        time.sleep(0.1)
    fast = [send(router, "generate", i, short) for i in range(4)]
    assert {r["error"]["code"] for r in fast} == {"no_healthy_prefill"}, fast
    assert all("ejected" in r["error"]["message"] for r in fast)
    figures["no_prefill"]["ejected_max_s"] = round(max(r["seconds"] for r in fast), 3)
    assert max(r["seconds"] for r in fast) < 1.0
    print("\nfleet failover figures:", json.dumps(figures))
