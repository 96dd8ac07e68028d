"""Selective disaggregation end to end (``fsm_pd/router/policy.py``): real prefill and decode processes (the tiny
model) behind three built-in routers on 127.0.0.1 (``--pd-policy auto``, ``always`` and ``never``). A short prompt
goes local and a long one through the prefill node; the receipts in ``meta_info``, the journals (``replay
--request``) and the router's metrics say so; greedy tokens are the same on either path; the idle-prefill alarm
fires for a "PD" fleet whose prefill node served nothing and not for the policy's short prompts."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from polling import until
from processes import Cluster, post_ok

from fsm_pd.cli.launch import free_port

THRESHOLD = 32  # --local-prefill-max-tokens: SHORT goes local, LONG through the prefill node


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("selective_pd"))
    try:
        p, boot, d = cluster.pd("zmq")
        routers = {mode: cluster.router(p, boot, d, "--pd-policy", mode, "--local-prefill-max-tokens",
                                        str(THRESHOLD), "--prefill-idle-window", "2")
                   for mode in ("auto", "always", "never")}
        yield cluster, routers
    finally:
        cluster.stop()


rng = random.Random(34)
SHORT = [rng.randrange(20, 250) for _ in range(12)]
LONG = [rng.randrange(20, 250) for _ in range(80)]


def generate(url: str, ids: list[int], rid: str) -> dict:
    return post_ok(url, "/generate", {"input_ids": ids, "rid": rid,
                                      "sampling_params": {"max_new_tokens": 8, "temperature": 0}})


def metric(url: str, name: str) -> float:
    """The value of the sample named exactly ``name`` (labels included, in the exporter's order), else 0."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.rsplit(" ", 1)[0] == name:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def replay_story(cluster: Cluster, rid: str) -> str:
    journals = sorted(str(f) for f in cluster.tmp.glob("*.db"))
    out = subprocess.run([sys.executable, "-m", "fsm_pd.cli", "replay", "--request", rid, "--format", "json",
                          *journals], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return " ".join(json.loads(out.stdout)["story"])


def test_the_policy_routes_short_prompts_local_and_long_ones_through_prefill(fleet):
    cluster, routers = fleet
    short = generate(routers["auto"], SHORT, "short-auto")
    long = generate(routers["auto"], LONG, "long-auto")

    receipt = short["meta_info"]["pd_route"]
    assert receipt["path"] == "local" and receipt["prefill"] is None
    assert (receipt["pages"], receipt["bytes"]) == (0, 0)
    assert receipt["reason"] == f"{len(SHORT)} prompt tokens <= {THRESHOLD}"
    receipt = long["meta_info"]["pd_route"]
    assert receipt["path"] == "pd" and receipt["prefill"].startswith("prefill-")
    assert receipt["pages"] >= len(LONG) // 16 and receipt["bytes"] > 0
    assert receipt["reason"] == f"{len(LONG)} prompt tokens > {THRESHOLD}"

    # the journal: a local record on the decode node, and the decode room's create event with the reason
    assert f"routed local ({len(SHORT)} prompt tokens <= {THRESHOLD})" in replay_story(cluster, "short-auto")
    assert f"routed pd ({len(LONG)} prompt tokens > {THRESHOLD})" in replay_story(cluster, "long-auto")

    assert metric(routers["auto"], 'fsm_pd_router_routed_total{path="local"}') == 1
    assert metric(routers["auto"], 'fsm_pd_router_routed_total{path="pd"}') == 1
    # the window of 2 saw a long prompt and the prefill node completed it: no alarm
    assert metric(routers["auto"], "fsm_pd_router_prefill_idle_alarm") == 0


def test_greedy_tokens_are_the_same_on_either_path(fleet):
    _, routers = fleet
    for ids in (SHORT, LONG):
        answers = {mode: generate(routers[mode], ids, f"same-{mode}-{len(ids)}") for mode in ("always", "never")}
        assert answers["always"]["meta_info"]["pd_route"]["path"] == "pd"
        assert answers["never"]["meta_info"]["pd_route"]["path"] == "local"
        assert answers["always"]["output_ids"] == answers["never"]["output_ids"]
        assert len(answers["never"]["output_ids"]) == 8


def test_the_idle_prefill_alarm_fires_when_long_prompts_never_reach_prefill(fleet):
    _, routers = fleet
    for i in range(2):
        generate(routers["never"], LONG, f"never-long-{i}")
    assert metric(routers["never"], "fsm_pd_router_prefill_idle_alarm") == 1
    assert metric(routers["never"], 'fsm_pd_router_routed_total{path="pd"}') == 0
    # short prompts sent local by auto do not raise it
    for i in range(2):
        generate(routers["auto"], SHORT, f"auto-short-{i}")
    assert metric(routers["auto"], "fsm_pd_router_prefill_idle_alarm") == 0


def test_a_prefill_node_without_serve_local_refuses_a_local_request(fleet):
    cluster, _ = fleet
    prefill = next(u for u in cluster_urls(cluster) if "prefill" in u[0])[1]
    r = httpx.post(prefill + "/generate", json={"input_ids": SHORT, "bootstrap_room": 5,
                                               "fsm_pd_route": {"path": "local", "reason": "test"}}, timeout=30)
    assert r.status_code == 400 and "--serve-local" in r.text


def test_an_openai_client_reads_the_route_and_replays_the_id_it_saw(fleet):
    """OpenAI answers have no ``meta_info``: the route is in headers, and the id they carry (``cmpl-RID``,
    ``chatcmpl-RID``) is what ``replay --request`` takes."""
    cluster, routers = fleet
    whole = httpx.post(routers["auto"] + "/v1/completions", json={"prompt": LONG, "max_tokens": 4, "temperature": 0},
                       timeout=120)
    assert whole.status_code == 200, whole.text
    assert whole.headers["x-fsm-pd-route"] == "pd"
    assert whole.headers["x-fsm-pd-route-reason"] == f"{len(LONG)} prompt tokens > {THRESHOLD}"
    assert whole.json()["id"].startswith("cmpl-")
    assert f"routed pd ({len(LONG)} prompt tokens > {THRESHOLD})" in replay_story(cluster, whole.json()["id"])
    chat = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", routers["auto"] + "/v1/chat/completions", json=chat, timeout=120) as streamed:
        assert streamed.status_code == 200 and streamed.headers["x-fsm-pd-route"] == "local"
        first = json.loads(next(line for line in streamed.iter_lines() if line.startswith("data: "))[6:])
    assert first["id"].startswith("chatcmpl-")
    assert "routed local (" in replay_story(cluster, first["id"])


def cluster_urls(cluster: Cluster) -> list[tuple[str, str]]:
    """(log name, URL) of the nodes a ``Cluster`` started, from their command lines."""
    found = []
    for proc in cluster.procs:
        argv = proc.args
        if "--role" in argv and argv[argv.index("--role") + 1] in ("prefill", "decode"):
            found.append((argv[argv.index("--role") + 1], f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"))
    return found


def test_a_prefill_node_that_serves_both_roles_takes_short_prompts_when_decode_is_busier(tmp_path):
    """No idle core: with --serve-local on P and --prefill-serves-local on the router, a short prompt goes to P
    whole when D has more requests in flight; greedy tokens are D's. D is held busy by stopping its process
    (SIGSTOP) while one request waits on it, so the router's in-flight counts are known."""
    cluster = Cluster(tmp_path)
    try:
        boot = free_port()
        p, d = cluster.serve_many(("prefill", "--bootstrap-port", str(boot), "--serve-local"), ("decode",))
        decode_proc = cluster.procs[1]
        router = cluster.router(p, boot, d, "--pd-policy", "auto", "--local-prefill-max-tokens", str(THRESHOLD),
                                "--prefill-serves-local")
        generate(router, LONG, "warm")  # the router's health checks have seen both nodes up (through P and D)
        answers = {}
        os.kill(decode_proc.pid, signal.SIGSTOP)
        try:
            waiting = threading.Thread(target=lambda: answers.update(first=generate(router, SHORT, "on-decode")))
            waiting.start()  # both idle: the tie goes to the decode node, which is stopped
            assert until(lambda: httpx.get(router + "/server_info", timeout=10).json()["decode"][0]["outstanding"]
                         == 1, timeout_s=30), "the first request never reached the stopped decode node"
            whole = generate(router, SHORT, "on-prefill")
        finally:
            os.kill(decode_proc.pid, signal.SIGCONT)
        waiting.join(60)
        receipt = whole["meta_info"]["pd_route"]
        assert receipt["path"] == "local" and receipt["node"].startswith("prefill-"), receipt
        assert "on the prefill node (0 in flight against decode's 1)" in receipt["reason"]
        assert answers["first"]["meta_info"]["pd_route"]["node"].startswith("decode-")
        assert whole["output_ids"] == answers["first"]["output_ids"]  # greedy: the same tokens on either node
        assert "on the prefill node" in replay_story(cluster, "on-prefill")
        assert metric(p, 'fsm_pd_local_prefills_total{node="' + receipt["node"] + '",role="prefill"}') == 1
    finally:
        cluster.stop()


def test_prompt_logprobs_come_from_the_node_that_prefilled(fleet):
    """PD: the router merges the prefill node's prompt logprobs; local: the decode node gives its own."""
    _, routers = fleet
    answers = {mode: post_ok(routers[mode], "/generate", {
        "input_ids": SHORT, "return_logprob": True, "rid": f"logprobs-{mode}",
        "sampling_params": {"max_new_tokens": 4, "temperature": 0}}) for mode in ("always", "never")}
    pd, local = (answers[m]["meta_info"]["input_token_logprobs"] for m in ("always", "never"))
    assert len(pd) == len(local) == len(SHORT)
    assert [t for _, t, _ in pd] == [t for _, t, _ in local] == SHORT
    assert local[0][0] is None and pd[0][0] is None
    assert all(abs(a[0] - b[0]) < 1e-3 for a, b in zip(pd[1:], local[1:], strict=True))
