"""Fault drills on real processes under a steady mixed load: kill and restart a node, stop it (SIGSTOP) for a while,
send it input that must not hurt it. Each drill returns its figures; ``test_restarts.py`` asserts on them and
``bench/fault_drill.py`` prints them.

The rig is ``test_faults.Rig``: ``fsm-pd serve`` prefill (with its bootstrap server), decode and the built-in router,
tcp backend, every deadline ``DEADLINE_S`` and a 0.5 s heartbeat.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
from fault_rig import DEADLINE_S, Rig, generate, info
from load_mix import LoadMix, Outcome

WORKERS = 32


def _in_flight_at(outcomes: list[Outcome], at: float) -> list[Outcome]:
    return [o for o in outcomes if o.started < at < o.ended]


def _first_success_after(url: str, since: float, limit_s: float) -> float:
    """Seconds from ``since`` until a request sent after it succeeds (one request at a time)."""
    while time.monotonic() - since < limit_s:
        if generate(url, "are you back?").ok:
            return time.monotonic() - since
        time.sleep(0.05)
    raise AssertionError(f"no request succeeded within {limit_s}s")


def _counts(outcomes: list[Outcome]) -> dict:
    return {r: sum(o.result == r for o in outcomes) for r in ("ok", "error", "hung", "silent")}


def kill_and_restart(rig: Rig, role: str, *, workers: int = WORKERS, load_timeout: float = 60.0) -> dict:
    """SIGKILL ``role`` under load, restart it with the same command line (address, ports, journal)."""
    node = rig.p if role == "prefill" else rig.d
    rig.warm_up()
    with LoadMix(rig.router, workers=workers, timeout=load_timeout) as load:
        load.wait_ok(workers, 120)
        killed = time.monotonic()
        node.kill()
        # the requests the dead node held must all end before it comes back
        deadline = killed + 3 * DEADLINE_S + 30
        while load.running_since(killed) and time.monotonic() < deadline:
            time.sleep(0.1)
        restarted = time.monotonic()
        node.restart()  # returns once its /health answers 200
        healthy = time.monotonic()
        recovery = _first_success_after(rig.router, healthy, 30)
        load.wait_ok(workers, 120)
    outcomes = load.snapshot()
    hit = _in_flight_at(outcomes, killed)
    figures = {
        "drill": f"kill and restart {role}",
        **_counts(outcomes),
        "total": len(outcomes),
        "in_flight_at_kill": len(hit),
        "in_flight_results": _counts(hit),
        "in_flight_max_end_s": round(max((o.ended - killed for o in hit), default=0.0), 2),
        "restart_to_health_s": round(healthy - killed, 2),
        "process_start_to_health_s": round(healthy - restarted, 2),
        "health_to_first_success_s": round(recovery, 2),
    }
    rig.p.wait_baseline()
    rig.d.wait_baseline()
    rig.replay()  # exits 0: both journals replay consistently
    return figures


def stop_and_continue(rig: Rig, role: str, *, seconds: float = 20.0, workers: int = WORKERS) -> dict:
    """SIGSTOP ``role`` under load for ``seconds``, then SIGCONT: every request ends by its deadline meanwhile."""
    node = rig.p if role == "prefill" else rig.d
    rig.warm_up()
    recomputes = info(rig.d.url)["recomputes"]
    with LoadMix(rig.router, workers=workers, timeout=seconds + 40) as load:
        load.wait_ok(workers, 120)
        stopped = time.monotonic()
        os.kill(node.proc.pid, signal.SIGSTOP)  # the process this rig started
        try:
            time.sleep(seconds)
        finally:
            os.kill(node.proc.pid, signal.SIGCONT)
        resumed = time.monotonic()
        recovery = _first_success_after(rig.router, resumed, 60)
        load.wait_ok(workers, 120)
    outcomes = load.snapshot()
    during = [o for o in outcomes if o.started < resumed and o.ended > stopped]
    figures = {
        "drill": f"SIGSTOP {role} {seconds:g}s",
        **_counts(outcomes),
        "total": len(outcomes),
        "overlapping_the_stop": len(during),
        "overlapping_results": _counts(during),
        "longest_request_s": round(max((o.seconds for o in outcomes), default=0.0), 2),
        "continue_to_first_success_s": round(recovery, 2),
        # requests whose prefill node stopped while the decode node held their pages: it prefilled them itself
        "decode_recomputes": info(rig.d.url)["recomputes"] - recomputes,
    }
    rig.p.wait_baseline()
    rig.d.wait_baseline()
    rig.replay()
    return figures


def bad_input(rig: Rig, *, workers: int = 8) -> dict:
    """Reused and out-of-range rooms, absurd sampling values, NaN and a lone surrogate, sent while ordinary
    requests run: each bad one gets a 4xx, no ordinary one fails, both nodes stay healthy."""
    rig.warm_up()
    statuses: dict[str, list[int]] = {}
    room = 12345
    with LoadMix(rig.router, workers=workers) as load, httpx.Client(timeout=3 * DEADLINE_S + 30) as client:
        load.wait_ok(workers, 120)

        def send(name: str, url: str, *, json=None, content=None) -> None:
            headers = {"content-type": "application/json"} if content is not None else None
            try:
                status = client.post(url, json=json, content=content, headers=headers).status_code
            except httpx.TimeoutException:
                status = 0  # no answer at all: the node is stuck, which the callers must see
            statuses.setdefault(name, []).append(status)

        boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": rig.boot}
        short = {"max_new_tokens": 2, "temperature": 0}
        for target, url in (("prefill", rig.p.url), ("decode", rig.d.url)):
            reuse = {"text": "reused room", "sampling_params": short, **boot, "bootstrap_room": room}
            send(f"{target}: room, first use", url + "/generate", json=reuse)  # fails alone (no peer), or succeeds
            send(f"{target}: the same room again", url + "/generate", json=reuse)
            send(f"{target}: room 2**63", url + "/generate", json={**reuse, "bootstrap_room": 2**63})
        router = rig.router + "/generate"
        send("top_k 10**12", router, json={"text": "x", "sampling_params": {**short, "top_k": 10**12}})
        send("temperature NaN", router, content=b'{"text":"x","sampling_params":{"temperature":NaN}}')
        send("top_p Infinity", router, content=b'{"text":"x","sampling_params":{"top_p":Infinity}}')
        send("lone surrogate in text", router, content=b'{"text":"\\ud800"}')
        send("lone surrogate in chat", rig.router + "/v1/chat/completions",
             content=b'{"model":"m","messages":[{"role":"user","content":"\\ud800"}]}')
        send("lone surrogate in stop", router, content=b'{"text":"x","sampling_params":{"stop":["\\ud800"]}}')
        load.wait_ok(workers, 120)
    healthy = {n.role: httpx.get(n.url + "/health", timeout=10).status_code for n in (rig.p, rig.d)}
    rig.p.wait_baseline()
    rig.d.wait_baseline()
    outcomes = load.snapshot()
    errors = sorted({f"{o.status} {o.detail[:160]}" for o in outcomes if o.result != "ok"})
    return {"drill": "bad input", **_counts(outcomes), "statuses": statuses, "health": healthy, "errors": errors[:5]}
