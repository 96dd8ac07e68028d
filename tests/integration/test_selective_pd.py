"""Selective disaggregation end to end (``fsm_pd/router/policy.py``): real prefill and decode processes (the tiny
model) behind three built-in routers on 127.0.0.1 (``--pd-policy auto``, ``always`` and ``never``). A short prompt
goes local and a long one through the prefill node; the receipts in ``meta_info``, the journals (``replay
--request``) and the router's metrics say so; greedy tokens are the same on either path; the idle-prefill alarm
fires for a "PD" fleet whose prefill node served nothing and not for the policy's short prompts."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import httpx
import pytest
from processes import Cluster, post_ok

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
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            if line.split(" ")[0] == name or name.endswith("}"):
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
