"""A PD fleet whose nodes sit on separate hosts: each process in its own network namespace on a private /24
(``netns.Fabric``), so no two nodes share a loopback and an address advertised wrongly cannot work by accident.

Two prefill and two decode ``fsm-pd serve`` nodes (tiny model, tcp transfers), each prefill with its bootstrap server
in process (the router names a prefill's bootstrap server by the host of its URL, as SGLang's does), a colocated
node, the built-in router and the real sglang-router, plus a client namespace the test's requests start from. The PD
nodes bind the wildcard ``0.0.0.0`` and advertise their own address (``--advertise-host``): a node that advertised
what it binds would send its peer to ``0.0.0.0``, which is the peer itself. Greedy answers through both routers
must equal the colocated node's, and every prefill and decode node must have handed off or received KV.

Runs as root where ``ip netns`` works (CI); skips with the reason elsewhere (a real part: ``tests/real_parts.py``).
Everything it made (processes by PID, namespaces with their veth pairs and bridge) is removed at the end, also when
the test fails.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time

import httpx
import pytest
from netns import Fabric, FabricUnavailable
from real_parts import SGLANG_ROUTER

from fsm_pd.transport import generate_secret, secret_env

pytestmark = pytest.mark.real_part("netns")  # the fleet fixture finds out whether namespaces can be built here

PORT, BOOTSTRAP_PORT = 30000, 8998  # every host has its own ports: the defaults everywhere
PREFILL = {"p1": 11, "p2": 12}
DECODE = {"d1": 21, "d2": 22}
OTHERS = {"colocated": 41, "router": 31, "sglang": 32, "client": 51}
PROMPTS = ["Hi", "The quick brown fox " * 3, "x" * 40, "PD across hosts", "0123456789" * 5, "end."]
STARTUP_S = 150  # eight processes start at once on a shared 2-core machine


def url(addr: str) -> str:
    return f"http://{addr}:{PORT}"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """``(fabric, client, addresses, processes)``: the running fleet, a client thread inside the client namespace."""
    try:
        fabric = Fabric(f"fsmpd{os.getpid() % 100000}")
    except FabricUnavailable as exc:
        pytest.skip(str(exc))
    tmp = tmp_path_factory.mktemp("netns-fleet")
    try:
        addrs = {name: fabric.add_host(name, n) for name, n in {**PREFILL, **DECODE, **OTHERS}.items()}
        # HF_ENDPOINT: sglang-router fetches a tokenizer named by model_path; a closed port in its own namespace
        env = {**os.environ, **secret_env(generate_secret()), "FSM_PD_MODEL": "tiny", "HF_ENDPOINT": "http://127.0.0.1:9"}
        serve = [sys.executable, "-m", "fsm_pd.cli", "serve", "--port", str(PORT), "--page-size", "16"]
        procs = {}
        for name in (*PREFILL, *DECODE):
            role = "prefill" if name in PREFILL else "decode"
            extra = ["--bootstrap-port", str(BOOTSTRAP_PORT)] if role == "prefill" else []
            procs[name] = fabric.run(name, [*serve, "--role", role, "--host", "0.0.0.0", "--advertise-host",
                                            addrs[name], "--node-id", name, "--journal", str(tmp / f"{name}.db"),
                                            *extra], log=tmp / f"{name}.log", env=env)
        procs["colocated"] = fabric.run("colocated", [*serve, "--role", "colocated", "--host", addrs["colocated"]],
                                        log=tmp / "colocated.log", env=env)
        client = fabric.client("client")
        client.submit(wait_ready, procs, addrs, tmp).result()
        workers = [a for p in PREFILL for a in ("--prefill", url(addrs[p]), str(BOOTSTRAP_PORT))]
        workers += [a for d in DECODE for a in ("--decode", url(addrs[d]))]
        procs["router"] = fabric.run("router", [*serve[:4], "--role", "router", "--host", "0.0.0.0", "--port",
                                                str(PORT), *workers, "--policy", "round_robin",
                                                "--pd-policy", "always"],
                                     log=tmp / "router.log", env=env)
        with contextlib.suppress(ImportError):
            import sglang_router  # noqa: F401

            procs["sglang"] = fabric.run("sglang", [
                sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", *workers,
                "--host", "0.0.0.0", "--port", str(PORT), "--prometheus-host", "127.0.0.1",
                "--prometheus-port", "29000", "--policy", "random"], log=tmp / "sglang.log", env=env)
        client.submit(wait_ready, procs, addrs, tmp).result()
        yield fabric, client, addrs, procs
    finally:
        fabric.close()


def wait_ready(procs: dict, addrs: dict, tmp) -> None:
    """(On the client thread.) Every process answers ``/health`` (sglang-router serves only once its workers are
    healthy)."""
    deadline = time.monotonic() + STARTUP_S
    for name, proc in procs.items():
        while True:
            if proc.poll() is not None:
                pytest.fail(f"{name} exited with {proc.returncode}: {(tmp / f'{name}.log').read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url(addrs[name]) + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"{name} not ready within {STARTUP_S}s: {(tmp / f'{name}.log').read_text()[-3000:]}")
            time.sleep(0.3)


def generate(base: str, prompt: str, max_new_tokens: int = 10, timeout: float = 60) -> list[int] | None:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                                 "ignore_eos": True}}
    answer = httpx.post(base + "/generate", json=body, timeout=timeout)
    return answer.json()["output_ids"] if answer.status_code == 200 else None


def all_greedy(base: str) -> list[list[int] | None]:
    return [generate(base, p) for p in PROMPTS]


def transfers_succeeded(base: str) -> float:
    """How many KV transfers this PD node finished successfully, from its Prometheus counter."""
    text = httpx.get(base + "/metrics", timeout=10).text
    found = re.findall(r'^fsm_pd_transfers_ended_total\{[^}]*outcome="success"[^}]*\} (\S+)$', text, re.M)
    return sum(float(v) for v in found)


@pytest.fixture(scope="module")
def colocated_answers(fleet):
    _, client, addrs, _ = fleet
    want = client.submit(all_greedy, url(addrs["colocated"])).result()
    assert all(ids is not None and len(ids) == 10 for ids in want), want
    assert len({tuple(ids) for ids in want}) >= 4, "varied prompts must give varied answers, or equality proves little"
    return want


def test_pd_nodes_on_separate_hosts_answer_as_colocated_behind_the_built_in_router(fleet, colocated_answers):
    _, client, addrs, _ = fleet
    assert client.submit(all_greedy, url(addrs["router"])).result() == colocated_answers
    counts = {n: client.submit(transfers_succeeded, url(addrs[n])).result() for n in (*PREFILL, *DECODE)}
    assert all(c >= 1 for c in counts.values()), f"every PD node must take part: {counts}"


@SGLANG_ROUTER
def test_pd_nodes_on_separate_hosts_answer_as_colocated_behind_sglang_router(fleet, colocated_answers):
    _, client, addrs, _ = fleet
    assert client.submit(all_greedy, url(addrs["sglang"])).result() == colocated_answers
