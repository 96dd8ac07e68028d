"""Graceful drain on real processes (tiny model, tcp, 127.0.0.1): a prefill node, a decode node and the built-in
router. SIGTERM or ``POST /drain`` makes a node refuse new requests (503, ``/health`` 503 draining), finish the open
ones within ``--drain-timeout-secs`` (aborting the rest with a 503 that names the drain), deregister from the
bootstrap server, close its journal and exit 0; a second SIGTERM exits at once. The decode node is restarted at
the same port and journal between the tests. First, on the same processes, ``--on-transfer-failure recompute``
(the default) end to end: with every pull failing (fault injection, held off by a pause file until then), the
router's answer is the undisturbed one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from processes import Cluster

from fsm_pd.store import read_journal

TOKENS = 200


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("drain")
    c = Cluster(tmp)
    pause = tmp / "faults-paused"
    pause.touch()
    c.env.update({"FSM_PD_FAULT_PULL": "1", "FSM_PD_FAULT_PAUSE_FILE": str(pause)})  # pull: the decode's stage
    try:
        p, boot, d = c.pd("tcp")
        router = c.router(p, boot, d)
        assert stream(router, "warm up", 4)[0] == "ok"
        yield c, p, d, router, pause
    finally:
        c.stop()


def proc_of(c: Cluster, url: str) -> subprocess.Popen:
    port = url.rsplit(":", 1)[1]
    return next(p for p in reversed(c.procs) if p.poll() is None and port in p.args)


def restart(c: Cluster, proc: subprocess.Popen, url: str, *extra: str) -> subprocess.Popen:
    """The same command line (port, journal), plus ``extra`` flags."""
    c.start(f"restarted-{len(c.procs)}", [*proc.args, *extra], url)
    return c.procs[-1]


def live_requests(url: str) -> int:
    return httpx.get(url + "/server_info", timeout=10).json()["internal_states"][0]["requests_live"]


def routed_again(router: str, timeout_s: float = 60) -> None:
    """Until a request through the router succeeds: it ejected the drained decode node, and takes the restarted one
    back at its next good health check after its cool-down."""
    deadline = time.monotonic() + timeout_s
    while stream(router, "are you back?", 2)[0] != "ok":
        assert time.monotonic() < deadline, "the router did not take the restarted node back"
        time.sleep(0.5)


def stream(url: str, prompt: str, tokens: int, *, first=None) -> tuple[str, int, str]:
    """A streamed /generate: ("ok", tokens received, "") or ("error", tokens, message). ``first`` is called once the
    first token arrived."""
    body = {"text": prompt, "stream": True, "sampling_params": {"max_new_tokens": tokens, "temperature": 0,
                                                                "ignore_eos": True}}
    got = 0
    with httpx.stream("POST", url + "/generate", json=body, timeout=120) as resp:
        if resp.status_code != 200:
            return "error", 0, resp.read().decode()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return "error", got, event["error"]["message"]
            got = len(event["output_ids"]) if "output_ids" in event else got + 1
            if first is not None and got >= 1:
                first()
                first = None
            if event["meta_info"].get("finish_reason"):
                return "ok", got, ""
    return "error", got, "no finish reason"


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in {url}/metrics")


def test_a_failed_transfer_is_recomputed_on_decode_through_the_router(fleet):
    c, p, d, router, pause = fleet
    body = {"text": "recompute me, please", "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                                "ignore_eos": True}}
    normal = httpx.post(router + "/generate", json=body, timeout=60).json()
    assert "kv_recompute" not in normal["meta_info"]
    pause.unlink()  # every pull of the decode node fails from now on
    answers, took = [], []
    try:
        for _ in range(2):
            began = time.monotonic()
            answers.append(httpx.post(router + "/generate", json=body, timeout=60))
            took.append(time.monotonic() - began)
    finally:
        pause.touch()
    for answer, within in zip(answers, took, strict=True):
        assert answer.status_code == 200, answer.text
        assert answer.json()["output_ids"] == normal["output_ids"] and answer.json()["text"] == normal["text"]
        recompute = answer.json()["meta_info"]["kv_recompute"]
        assert "injected fault: pull failed" in recompute["reason"]
        assert 0 < recompute["seconds"] <= within  # how long the recompute took: within the request's own time
    assert metric(d, "fsm_pd_transfer_recomputes_total") == 2


def test_sigterm_drains_a_decode_node_under_load(fleet):
    c, p, d, router, _ = fleet
    proc = proc_of(c, d)
    journal = c.tmp / f"decode-{d.rsplit(':', 1)[1]}.db"
    earlier = {row.room for row in read_journal(journal)}
    started = []
    with ThreadPoolExecutor(8) as pool:
        runs = [pool.submit(stream, router, f"drain me {i}", TOKENS, first=lambda: started.append(1))
                for i in range(8)]
        deadline = time.monotonic() + 60
        while len(started) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(started) == 8, "the streams did not start"
        signalled = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        # at once: /health says draining, a new request is refused with the reason
        health = httpx.get(d + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "draining", health.text
        refused = httpx.post(d + "/generate", json={"text": "late", "bootstrap_host": "127.0.0.1",
                                                    "bootstrap_port": 1, "bootstrap_room": 7}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining", refused.text
        metrics = httpx.get(d + "/metrics", timeout=5).text
        assert 'fsm_pd_drains_total{trigger="sigterm"} 1.0' in metrics and "fsm_pd_draining 1.0" in metrics
        outcomes = [r.result() for r in runs]
    assert outcomes == [("ok", TOKENS, "")] * 8  # every open stream finished
    assert proc.wait(timeout=60) == 0
    drained_s = time.monotonic() - signalled
    print(f"decode drain under 8 open streams of {TOKENS} tokens: exit 0 after {drained_s:.2f} s")
    text = (c.tmp / f"decode-{d.rsplit(':', 1)[1]}.log").read_text()
    for step in ("drain (sigterm): refusing new requests", "every request answered", "stopping the HTTP server",
                 "closing the engine and its journal", "stopped cleanly"):
        assert step in text, step
    # every room of the drain's requests ended in Success: nothing was cut short
    finals = {row.room: row.dst for row in read_journal(journal) if row.room not in earlier}
    assert finals and set(finals.values()) == {"Success"}


def test_drain_bound_aborts_what_is_left_and_post_drain(fleet):
    c, p, d, router, _ = fleet
    old = next(pr for pr in c.procs if d.rsplit(":", 1)[1] in pr.args)
    proc = restart(c, old, d, "--drain-timeout-secs", "1")
    routed_again(router)
    result = []
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(stream, router, "never ends", 4000, first=lambda: result.append(time.monotonic()))
        deadline = time.monotonic() + 60
        while not result and time.monotonic() < deadline and not run.done():
            time.sleep(0.01)
        assert result, f"the stream did not start: {run.result() if run.done() else 'no first token in 60 s'}"
        answer = httpx.post(d + "/drain", timeout=10)
        assert answer.status_code == 202 and answer.json()["trigger"] == "admin", answer.text
        status, got, message = run.result()
    # the router would move the aborted stream on, but its one decode node is draining (ejected, or refusing): the
    # client's error names the drain that cut the stream
    assert status == "error" and 0 < got < 4000, (status, got, message)
    assert "drain timeout of 1 s" in message, message
    assert proc.wait(timeout=30) == 0
    text = (c.tmp / f"restarted-{c.procs.index(proc)}.log").read_text()
    assert "aborted 1 of 1 open requests" in text and "stopped cleanly" in text


def test_prefill_deregisters_and_a_second_sigterm_exits_at_once(fleet):
    c, p, d, router, _ = fleet
    old = next(pr for pr in c.procs if d.rsplit(":", 1)[1] in pr.args)
    dproc = restart(c, old, d, "--drain-timeout-secs", "60")
    pproc = proc_of(c, p)
    os.kill(pproc.pid, signal.SIGTERM)  # idle: drains at once
    assert pproc.wait(timeout=30) == 0
    text = (c.tmp / f"prefill-{p.rsplit(':', 1)[1]}.log").read_text()
    assert "drain: deregistered from the bootstrap server at http://127.0.0.1:" in text, text[-2000:]
    # the decode node, with a request that will not finish: SIGTERM drains, a second SIGTERM exits at once
    with ThreadPoolExecutor(1) as pool:
        body = {"text": "x", "bootstrap_host": "127.0.0.1", "bootstrap_port": 9, "bootstrap_room": 99,
                "sampling_params": {"max_new_tokens": 4}}
        waiting = pool.submit(httpx.post, d + "/generate", json=body, timeout=60)  # waits for a prefill node
        deadline = time.monotonic() + 30
        while live_requests(d) != 1:  # the drain must have an open request to wait for
            assert time.monotonic() < deadline and not waiting.done(), "the request never became live on the node"
            time.sleep(0.05)
        os.kill(dproc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(d + "/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(dproc.pid, signal.SIGTERM)
        second = time.monotonic()
        assert dproc.wait(timeout=20) == 0
        assert time.monotonic() - second < 10
        with pytest.raises(httpx.HTTPError):
            waiting.result().raise_for_status()
