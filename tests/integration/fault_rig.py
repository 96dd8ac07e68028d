"""The fault rig: ``fsm-pd serve`` prefill (with its bootstrap server), decode and the built-in router as real
processes, with short deadlines and heartbeats from the ``FSM_PD_*`` environment and fault injection behind a pause
file; plus the one-request client the fault tests and drills use. ``test_faults.py``, ``test_restarts.py`` (through
``drills.py``) and ``bench/fault_drill.py`` build on it.

Each node reads its faults from a fault file (``FSM_PD_FAULT_FILE``) that ``set_faults`` rewrites while it runs, so one
rig serves fault after fault (the ``shared_rig`` fixture of ``conftest.py``): a node start, an import of jax and the
first compiles each, is what a rig costs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
from processes import PAGE_SIZE, Cluster, free_port

from fsm_pd.effects.faults import FaultConfig

DEADLINE_S = 4.0  # every deadline of both nodes
ENV = {
    "FSM_PD_BOOTSTRAP_TIMEOUT": str(DEADLINE_S),
    "FSM_PD_ADMISSION_TIMEOUT": str(DEADLINE_S),  # the decode node's wait for pages (none here: its pool is large)
    "FSM_PD_WAITING_TIMEOUT": str(DEADLINE_S),
    "FSM_PD_PULL_HOLD_TIMEOUT": str(DEADLINE_S),
    "FSM_PD_TRANSFER_TIMEOUT": str(DEADLINE_S),
    "FSM_PD_HEARTBEAT_INTERVAL": "0.5",
    "FSM_PD_HEARTBEAT_MAX_FAILURE": "2",
}
# a room passes at most three deadlines on each side; plus scheduling noise of three servers on 2 cores
REQUEST_BOUND_S = 3 * DEADLINE_S + 8
TOKENS = 6
PROMPTS = ["Hi", "a" * (PAGE_SIZE + 1), "The quick brown fox " * 3, "0123456789" * 5, "?", "z" * (PAGE_SIZE * 3)]


@dataclass
class Outcome:
    status: int
    body: dict
    seconds: float

    @property
    def ok(self) -> bool:
        return self.status == 200


def generate(url: str, prompt: str = "Hello", tokens: int = TOKENS) -> Outcome:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    started = time.monotonic()
    answer = httpx.post(url + "/generate", json=body, timeout=REQUEST_BOUND_S + 30)
    return Outcome(answer.status_code, answer.json(), time.monotonic() - started)


def assert_clean(outcome: Outcome) -> None:
    """A full answer, or an HTTP error with an error body; in either case within the bound."""
    assert outcome.seconds <= REQUEST_BOUND_S, f"took {outcome.seconds:.1f}s: {outcome}"
    if outcome.ok:
        assert len(outcome.body["output_ids"]) == TOKENS, outcome
    else:
        assert outcome.status >= 400 and outcome.body["error"]["message"], outcome


def info(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=10).json()["internal_states"][0]


class Rig:
    """One prefill (with its bootstrap server), one decode, the built-in router: processes this test started."""

    def __init__(self, tmp_path, *, prefill_env=None, decode_env=None, host="127.0.0.1", wrap=None):
        self.cluster, self.tmp = Cluster(tmp_path), tmp_path
        self.pause = tmp_path / "faults-paused"
        self.pause.touch()
        self.warm_failures: set = set()
        base = {**self.cluster.env, **ENV, "FSM_PD_FAULT_PAUSE_FILE": str(self.pause)}
        self.fault_files = {role: tmp_path / f"{role}-faults" for role in ("prefill", "decode")}
        self.envs = {role: {**base, "FSM_PD_FAULT_FILE": str(self.fault_files[role]), **(env or {})}
                     for role, env in (("prefill", prefill_env), ("decode", decode_env))}
        self.boot = free_port()
        try:
            self.p, self.d = self.nodes(("prefill", "--bootstrap-port", str(self.boot)), ("decode",))
            # one attempt per request: the fault tests count each fault's rooms and reasons on the nodes, which a
            # retry (another room, docs/fleet.md) would add to
            self.router = self.cluster.router(self.p.url, self.boot, self.d.url, "--retry-policy", "fail")
            self.router_proc = self.cluster.procs[-1]
        except BaseException:  # nobody else holds this rig yet: stop what it started before it failed
            self.cluster.stop()
            raise

    def nodes(self, *nodes: tuple[str, ...]) -> list[Node]:
        """Start the nodes (``(role, *flags)``) side by side, each with its role's environment."""
        started = [self.cluster.launch_node(role, *extra, env=self.envs[role]) for role, *extra in nodes]
        self.cluster.healthy(started)
        return [Node(self, spec[0], url, proc) for spec, (url, proc) in zip(nodes, started, strict=True)]

    def warm_up(self, concurrency: int = 8) -> None:
        """Fault-free requests (the pause file exists) until a round all succeeds: the first ones compile the
        kernels and may miss the short deadlines. Their failures are left out of ``failures()``."""
        for _ in range(6):
            with ThreadPoolExecutor(concurrency) as pool:
                outcomes = list(
                    pool.map(lambda i: generate(self.router, PROMPTS[i % len(PROMPTS)]), range(concurrency))
                )
            if all(o.ok for o in outcomes):
                break
        assert all(o.ok for o in outcomes), outcomes
        self.p.baseline, self.d.baseline = self.p.wait_idle(), self.d.wait_idle()
        for node in (self.p, self.d):  # the same counters, as gauges on /metrics
            text = httpx.get(node.url + "/metrics", timeout=10).text
            want = f'fsm_pd_kv_pages_free{{node="{node.role}-{node.url.rsplit(":", 1)[1]}",role="{node.role}"}} '
            assert want + f"{float(node.baseline['pages_free'])}" in text, text
            assert "fsm_pd_open_transfer_entries" in text and "fsm_pd_rooms_open" in text
        self.warm_failures = {(r["role"], r["room"]) for r in self.replay() if r["final"] == "Failed"}

    def set_faults(self, prefill: dict[str, str] | None = None, decode: dict[str, str] | None = None) -> None:
        """Each node's faults from now on (``FSM_PD_FAULT_*`` settings; none for a role not given), over what its
        environment sets, once each node reports them (its ``/server_info`` reads a changed fault file)."""
        for node, settings in ((self.p, prefill or {}), (self.d, decode or {})):
            path = self.fault_files[node.role]
            new = path.with_suffix(".new")
            new.write_text("".join(f"{name}={value}\n" for name, value in settings.items()))
            new.replace(path)  # whole, at once: the node never reads half a file
            want = FaultConfig.from_env({**self.envs[node.role], **settings}).describe()
            assert info(node.url)["faults"] == want, (node.role, info(node.url)["faults"], want)

    def reusable(self) -> bool:
        """Every process alive and healthy, and both nodes idle (within the longest a room lasts), for another test."""
        procs = [self.p.proc, self.d.proc, self.router_proc]
        urls = [self.p.url, self.d.url, self.router]
        try:
            if any(proc.poll() is not None for proc in procs) or any(
                    httpx.get(url + "/health", timeout=5).status_code != 200 for url in urls):
                return False
            self.p.wait_idle(REQUEST_BOUND_S)
            self.d.wait_idle(REQUEST_BOUND_S)
        except (httpx.HTTPError, AssertionError):
            return False
        return True

    def faults_on(self) -> None:
        self.pause.unlink()

    def faults_off(self) -> None:
        self.pause.touch()

    def follow_up(self) -> None:
        self.faults_off()
        outcome = generate(self.router, "follow-up")
        assert outcome.ok, outcome

    def check_recovered(self) -> None:
        """Survivors healthy, a follow-up succeeds, every counter back at its baseline."""
        for node in (self.p, self.d):
            assert httpx.get(node.url + "/health", timeout=5).status_code == 200
        self.follow_up()
        self.p.wait_baseline()
        self.d.wait_baseline()

    def replay(self) -> list[dict]:
        """``fsm-pd replay --format json`` on every journal: exit status 0 (consistent), the rooms."""
        journals = sorted(str(j) for j in self.tmp.glob("*.db"))
        done = subprocess.run(
            [sys.executable, "-m", "fsm_pd.cli", "replay", *journals, "--format", "json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        doc = json.loads(done.stdout)
        assert doc["consistent"] and not doc["divergences"]
        return doc["rooms"]

    def failures(self) -> dict[str, list[str]]:
        """role -> reasons of its failed rooms; every Failed room has one. (A node's records beside its rooms, a
        peer found dead after a room ended say, are not rooms: ``store/roles.py``.)"""
        found: dict[str, list[str]] = {"prefill": [], "decode": []}
        for room in self.replay():
            if room["role"] not in found:
                continue
            if room["final"] == "Failed" and (room["role"], room["room"]) not in self.warm_failures:
                assert room["reason"], room
                found[room["role"]].append(room["reason"])
        return found

    def stop(self) -> None:
        self.cluster.stop()


class Node:
    def __init__(self, rig: Rig, role: str, url: str, proc: subprocess.Popen):
        self.rig, self.role, self.url, self.proc = rig, role, url, proc
        self.baseline: dict | None = None

    def leaks(self) -> dict:
        return info(self.url)["leaks"]

    def wait_idle(self, timeout: float = 20) -> dict:
        deadline = time.time() + timeout
        while True:
            leaks = self.leaks()
            idle = {k: v for k, v in leaks.items() if k not in ("pages_free",)}
            if not any(idle.values()) or time.time() > deadline:
                assert not any(idle.values()), f"{self.role} not idle: {leaks}"
                return leaks
            time.sleep(0.05)

    def wait_baseline(self, timeout: float = 3 * DEADLINE_S + 10) -> None:
        deadline = time.time() + timeout
        while (leaks := self.leaks()) != self.baseline and time.time() < deadline:
            time.sleep(0.05)
        assert leaks == self.baseline, f"{self.role} leaks: {leaks} != baseline {self.baseline}"

    def wait_state(self, state: str, timeout: float = 20) -> None:
        deadline = time.time() + timeout
        while info(self.url)["rooms_by_state"].get(state, 0) == 0:
            assert time.time() < deadline, f"no {self.role} room reached {state}"
            time.sleep(0.05)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def restart(self) -> None:
        """The same command line, ports and journal: the node recovers its rooms from the journal."""
        self.rig.cluster.start(f"{self.role}-restarted-{len(self.rig.cluster.procs)}", list(self.proc.args), self.url,
                               self.rig.envs[self.role])
        self.proc = self.rig.cluster.procs[-1]
        self.baseline = self.wait_idle() if self.baseline is None else self.baseline
