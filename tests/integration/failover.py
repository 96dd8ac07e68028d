"""Fleet failover on real processes, shared by ``test_fleet_failover.py`` and ``bench/fleet_failover.py``: 2 prefill
+ 2 decode ``fsm-pd serve`` nodes (tiny model, tcp; fault_rig's heartbeats, 15 s room deadlines) behind the built-in
router or the real sglang-router, 32 concurrent greedy requests of mixed kinds, and the phases: an undisturbed
baseline, SIGKILL a prefill node mid-load, SIGSTOP a decode node mid-stream (SIGCONT after), SIGKILL a decode node
mid-stream, kill the last prefill node. No pytest
here: the bench imports it after the README's install alone.
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


def _error(r: httpx.Response) -> dict:
    try:
        return r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return {"message": r.text[:300]}


def send(router: str, kind: str, i: int, tokens: int, first_chunk=None) -> dict:
    """One request; its status (0: the connection broke), output (ids for /generate, text for chat), whether a
    stream ended with [DONE] and no error event, seconds, and the error if any."""
    path, body = request(kind, i, tokens)
    started = time.monotonic()
    out: dict = {"kind": kind, "i": i}
    try:
        with httpx.Client(timeout=120) as client:
            if not body["stream"]:
                r = client.post(router + path, json=body)
                out["status"] = r.status_code
                if r.status_code == 200:
                    doc = r.json()
                    out["output"] = doc["output_ids"] if kind == "generate" else doc["choices"][0]["message"][
                        "content"]
                else:
                    out["error"] = _error(r)
            else:
                with client.stream("POST", router + path, json=body) as r:
                    out["status"] = r.status_code
                    if r.status_code != 200:
                        r.read()
                        out["error"] = _error(r)
                    else:
                        out.update(_read_stream(r, kind, first_chunk))
    except httpx.HTTPError as err:
        out.update(status=0, error={"message": f"{type(err).__name__}: {err}"})
    out["seconds"] = time.monotonic() - started
    return out


def _read_stream(r: httpx.Response, kind: str, first_chunk) -> dict:
    text, ids, done, out, roles = "", [], False, {}, 0
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
            roles += "role" in event["choices"][0]["delta"] if event["choices"] else 0
            text += event["choices"][0]["delta"].get("content") or "" if event["choices"] else ""
    out["output"] = ids if kind == "generate-stream" else text
    if kind == "chat-stream" and roles != 1 and "error" not in out:  # a migrated stream must not repeat its head
        out["error"] = {"message": f"{roles} role chunks"}
    out["complete"] = done and "error" not in out
    if not out["complete"] and "error" not in out:
        out["error"] = {"message": "the stream ended without [DONE]"}
    return out


class Progress:
    """What a running load has done so far: which requests have had a streamed chunk, which have ended."""

    def __init__(self) -> None:
        self.chunks: set[int] = set()
        self.ended: set[int] = set()

    def mid_stream(self, streams: set[int]) -> set[int]:
        return (self.chunks - self.ended) & streams


def run_load(router: str, tokens: int, kinds=KINDS, during=None) -> list[dict]:
    """CONCURRENCY requests at once; ``during(progress)`` runs on this thread meanwhile."""
    progress = Progress()

    def one(i: int) -> dict:
        try:
            return send(router, kinds[i % len(kinds)], i, tokens, lambda: progress.chunks.add(i))
        finally:
            progress.ended.add(i)

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = [pool.submit(one, i) for i in range(CONCURRENCY)]
        if during is not None:
            during(progress)
        return [f.result() for f in futures]


def metric(router: str, name: str) -> dict[str, float]:
    found = {}
    for line in httpx.get(router + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name):
            labels, _, value = line.rpartition(" ")
            found[labels[len(name):]] = float(value)
    return found


def kill(proc) -> None:
    os.kill(proc.pid, signal.SIGKILL)  # a node this test started
    proc.wait(timeout=10)


def loads(urls: list[str]) -> dict[str, int]:
    """Requests each node runs now (-1: no answer)."""
    def load(url: str) -> int:
        try:
            return sum(rank["num_reqs"] for rank in httpx.get(url + "/get_load", timeout=5).json())
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return -1
    return {url: load(url) for url in urls}


def by_request(results: list[dict]) -> dict:
    return {(r["kind"], r["i"]): r.get("output") for r in results}



def start_fleet(cluster: Cluster, router: str = "builtin", builtin_flags: tuple[str, ...] = ()
                ) -> tuple[str, list[str], list[str], dict]:
    """2 prefill + 2 decode nodes and a router (``builtin`` or ``sglang``; ``builtin_flags``: more flags for the
    built-in one): (router URL, prefill URLs, decode URLs, node URL -> its process)."""
    # fault_rig's heartbeats (a dead peer fails its rooms within ~1 s), but 15 s room deadlines: after a kill the
    # survivors take twice the load and compile new batch shapes, which 2 busy cores can take seconds to do
    cluster.env = {**cluster.env, **ENV, **{k: "15" for k in ENV if k.endswith("_TIMEOUT")},
                   "FSM_PD_MODEL": "tiny"}  # the suite sets it too; the bench runs without the suite
    boots = [free_port(), free_port()]
    urls = cluster.serve_many(*[("prefill", "--bootstrap-port", str(b), "--transfer-backend", "tcp") for b in boots],
                              ("decode", "--transfer-backend", "tcp"), ("decode", "--transfer-backend", "tcp"))
    prefills, decodes = urls[:2], urls[2:]
    procs = dict(zip(prefills + decodes, cluster.procs, strict=True))
    port = free_port()
    if router == "builtin":
        argv = [sys.executable, "-m", "fsm_pd.cli", "serve", "--role", "router", "--port", str(port),
                "--health-check-interval-secs", "0.5", "--health-check-timeout-secs", "2", "--pd-policy", "always",
                *builtin_flags]
    else:  # sglang-router 0.3.2 with its defaults for retries and breakers, health checks as often as ours
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--host", "127.0.0.1",
                "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                "--health-check-interval-secs", "1"]
    for p, boot in zip(prefills, boots, strict=True):
        argv += ["--prefill", p, str(boot)]
    for d in decodes:
        argv += ["--decode", d]
    url = cluster.start("router", argv, f"http://127.0.0.1:{port}")
    return url, prefills, decodes, procs


def summary(results: list[dict], baseline: list[dict] | None = None) -> dict:
    """ok / failed, latency, the first errors, and (against ``baseline``) how many outputs differ."""
    ok = [r for r in results if r["status"] == 200 and r.get("complete", True)]
    out = {"ok": len(ok), "failed": len(results) - len(ok),
           "median_s": round(statistics.median(r["seconds"] for r in results), 2),
           "max_s": round(max(r["seconds"] for r in results), 2),
           "errors": sorted({f"{r['status']} {json.dumps(r.get('error'))[:160]}" for r in results
                             if r not in ok})[:4],
           "failed_by_kind": {kind: sum(r["kind"] == kind for r in results if r not in ok)
                              for kind in KINDS if any(r["kind"] == kind and r not in ok for r in results)}}
    if baseline is not None:
        before = by_request(baseline)
        out["differ_from_baseline"] = sum(r.get("output") != before[(r["kind"], r["i"])] for r in ok)
    return out


def _until_both_decodes_admitted(router: str, timeout_s: float = 60.0) -> None:
    """After SIGCONT: until the router takes the stopped decode back (the built-in router's /health says; for
    another router, a pause as long as its health checks need)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            admitted = httpx.get(router + "/health", timeout=10).json().get("admitted")
        except (httpx.HTTPError, ValueError, AttributeError):
            admitted = None
        if admitted is None:
            time.sleep(5.0)
            return
        if admitted.get("decode") == 2:
            return
        time.sleep(0.2)
    raise AssertionError("the router did not take the stopped decode node back within 60 s of SIGCONT")


def phases(router: str, prefills: list[str], decodes: list[str], procs: dict, short: int = 8, long: int = 160,
           warm_rounds: int = 0) -> dict:
    """Run every phase in order; each phase's results (lists of ``send`` answers) and the baselines. The first
    round compiles: ``warm_rounds`` more before the baseline give it undisturbed timings (the test needs only its
    outputs)."""
    for round_ in range(3 + warm_rounds):  # a round that missed a deadline while compiling is run again
        baseline_short = run_load(router, short)
        baseline_long = run_load(router, long)
        if round_ >= warm_rounds and not summary(baseline_short)["failed"] and not summary(baseline_long)["failed"]:
            break
    found = {"baseline_short": baseline_short, "baseline_long": baseline_long}
    victims: dict[str, str] = {}
    at_kill: dict[str, dict] = {}

    def kill_prefill_holding_requests(progress: Progress) -> None:
        # a prefill node that holds none would die unnoticed: the phase would prove nothing
        deadline = time.monotonic() + 60
        while max((seen := loads(prefills)).values()) <= 0:
            assert time.monotonic() < deadline, "no prefill node ever held a request of the load"
            time.sleep(0.01)
        at_kill["prefill"], victims["prefill"] = seen, max(prefills, key=seen.get)
        kill(procs[victims["prefill"]])

    found["prefill_kill"] = run_load(router, short, during=kill_prefill_holding_requests)
    streams = {i for i in range(CONCURRENCY) if KINDS[i % len(KINDS)].endswith("stream")}

    def busiest_decode_mid_stream(progress: Progress, role: str) -> str:
        """The decode node that holds the most requests once an eighth of the streams are mid-stream (tokens out, not
        ended): a fault then breaks streams. Waiting for a share of all streams to have tokens let the first ones end
        and left the rest in prefill, and a fast decode could then be faulted with no stream on it; long answers
        (``long`` tokens) keep several streams open at once even when the prefill node serializes their starts."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if 8 * len(progress.mid_stream(streams)) >= len(streams):
                seen = loads(decodes)
                if max(seen.values()) > 0:
                    at_kill[role] = seen
                    return max(decodes, key=seen.get)
            time.sleep(0.005)
        raise AssertionError(f"no decode node held streams mid-way within 60 s ({len(progress.chunks)} had tokens)")

    def kill_decode_mid_stream(progress: Progress) -> None:
        victims["decode"] = busiest_decode_mid_stream(progress, "decode")
        kill(procs[victims["decode"]])

    def stop_decode_mid_stream(progress: Progress) -> None:
        victims["decode_stopped"] = busiest_decode_mid_stream(progress, "decode_stopped")
        os.kill(procs[victims["decode_stopped"]].pid, signal.SIGSTOP)  # a node this test started

    found["decode_stop"] = run_load(router, long, during=stop_decode_mid_stream)
    os.kill(procs[victims["decode_stopped"]].pid, signal.SIGCONT)
    _until_both_decodes_admitted(router)
    found["decode_kill"] = run_load(router, long, during=kill_decode_mid_stream)
    found["victims"], found["load_at_kill"] = victims, at_kill
    kill(procs[next(p for p in prefills if p != victims["prefill"])])
    found["no_prefill"] = run_load(router, short)
    return found
