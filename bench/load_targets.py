"""The servers the load bench measures (``load.py``), started one at a time: one process may hold the chip.

A target is one ``fsm-pd serve`` process: ``colocated`` (one node) or ``pd-POLICY`` (``--role pd``: prefill engine,
decode engine and router in one process, with ``--pd-policy POLICY``). It serves on a unix socket under the run's
directory (``--uds``), or on a free TCP port of 127.0.0.1, with the compile cache and the converted-model cache
(``FSM_PD_COMPILE_CACHE``, ``FSM_PD_MODEL_CACHE``) in a directory the bench names: a ``fill`` start of a target
fills them and is stopped, the ``measured`` start after it finds them full, as a user's second start does. Its time
to ready is read from the process's start: when ``/health`` first answers 200, when the first chat, sent right after,
is answered (a chat refused in between is recorded with its status and retried), and when ``/server_info`` says its
background compile is done (``background_compile`` in its ``startup``; for ``--role pd``, in both engines'). The
process is stopped by its PID: SIGTERM, a wait for it to drain and exit, then SIGKILL. ``compiles`` reads how many
programs it compiled, per engine and phase, so that the bench can tell which it compiled under load.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from fsm_pd.cli.launch import free_port
from fsm_pd.net import unix_http
from fsm_pd.net.unix_sockets import unix_address

TARGETS = {"colocated": ["--role", "colocated"],
           "pd-auto": ["--role", "pd", "--pd-policy", "auto"],
           "pd-always": ["--role", "pd", "--pd-policy", "always"],
           "pd-never": ["--role", "pd", "--pd-policy", "never"],
           # the same, with the built-in router in front instead of a node's app over both (cli/pd_pair.py)
           "pd-auto-router": ["--role", "pd", "--pd-policy", "auto", "--pd-front", "router"],
           "pd-always-router": ["--role", "pd", "--pd-policy", "always", "--pd-front", "router"],
           "pd-never-router": ["--role", "pd", "--pd-policy", "never", "--pd-front", "router"]}
STEPS_SUFFIX = re.compile(r"\+k([1-9][0-9]*)$")  # "colocated+k8": the target at 8 decode steps a dispatch
STOP_GRACE_S = 60  # a node drains for at most --drain-timeout-secs (default 30) after SIGTERM, then exits


@dataclass
class Target:
    name: str
    argv: list[str]
    url: str  # the base URL the client takes: http://127.0.0.1:PORT or unix_http's form of unix:PATH
    log: Path
    caches: Path | None = None  # FSM_PD_COMPILE_CACHE and FSM_PD_MODEL_CACHE go under it; None: the user's own
    proc: subprocess.Popen | None = None
    started: float = 0.0  # time.monotonic() just before the process was started
    refused_first_chats: list = field(default_factory=list)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def known(name: str) -> bool:
    """A key of ``TARGETS``, or one with ``+kN``: the same server at N decode steps a dispatch."""
    return STEPS_SUFFIX.sub("", name) in TARGETS


def serve_args(name: str) -> list[str]:
    steps = STEPS_SUFFIX.search(name)
    base = TARGETS[STEPS_SUFFIX.sub("", name)]
    return [*base, "--decode-steps-per-dispatch", steps.group(1)] if steps else list(base)


def target(name: str, model: str, run_dir: Path, tcp: bool = False, node_args: tuple[str, ...] = (),
           caches: Path | None = None, start: str = "measured") -> Target:
    """``name`` (``known``) as a command, not yet started. ``start``: ``measured``, or ``fill`` (the start that fills
    ``caches``), whose socket, log and journals are its own (``NAME-fill.*``)."""
    files = name if start == "measured" else f"{name}-{start}"
    argv = [sys.executable, "-m", "fsm_pd.cli", "serve", *serve_args(name), "--model", model]
    if tcp:
        port = free_port()
        argv += ["--host", "127.0.0.1", "--port", str(port)]
        url = f"http://127.0.0.1:{port}"
    else:
        sock = run_dir / f"{files}.sock"
        argv += ["--uds", str(sock)]
        url = unix_http.http_url(unix_address(str(sock)))
    if name.startswith("pd-"):
        argv += ["--journal-dir", str(journals(run_dir, files))]
    return Target(name, [*argv, *node_args], url, run_dir / f"{files}.log", caches)


def journals(run_dir: Path, name: str) -> Path:
    return run_dir / f"{name}-journals"


def cache_env(caches: Path | None, env: dict | None = None) -> dict:
    """The environment ``env`` (default this process's) of a node whose compile cache and converted-model cache are
    under ``caches``."""
    env = dict(os.environ if env is None else env)
    if caches is None:
        return env
    return {**env, "FSM_PD_COMPILE_CACHE": str(caches / "jax"), "FSM_PD_MODEL_CACHE": str(caches / "models")}


def handoffs(journal_dir: Path) -> dict | None:
    """What ``fsm-pd replay`` tells of a pd target's handoffs, read from its journals once it stopped: rooms (a
    request served whole, ``--pd-policy`` auto's local route, is counted apart: ``local``), how many ended Success on
    both sides, and the time each side spent in Transferring (``xfer`` in replay's table),
    milliseconds at p50, p90 and max. The prefill side's is the whole handoff: from its KV ready to D's PULLED."""
    files = sorted(str(f) for f in journal_dir.glob("*.db"))
    if not files:
        return None
    out = subprocess.run([sys.executable, "-m", "fsm_pd.cli", "replay", *files, "--format", "json"],
                         capture_output=True, text=True, timeout=300)
    if out.returncode not in (0, 3):
        return {"error": out.stderr.strip()[-300:]}
    rooms: dict[int, dict[str, dict]] = {}
    local = 0
    for side in json.loads(out.stdout)["rooms"]:
        if side["role"] not in ("prefill", "decode"):  # a record of a request served whole (role local), no handoff
            local += 1
            continue
        rooms.setdefault(side["room"], {})[side["role"]] = side
    report: dict = {"rooms": len(rooms), "local": local, "consistent": out.returncode == 0,
                    "success": sum(all(s["final"] == "Success" for s in r.values()) and len(r) == 2
                                   for r in rooms.values())}
    for role in ("prefill", "decode"):
        xfer = sorted(1000 * r[role]["time_in_state"]["Transferring"] for r in rooms.values()
                      if role in r and "Transferring" in r[role]["time_in_state"])
        if xfer:
            report[f"{role}_xfer_ms"] = {"p50": statistics.median(xfer), "p90": xfer[int(0.9 * (len(xfer) - 1))],
                                         "max": xfer[-1], "n": len(xfer)}
    return report


def start(t: Target, env: dict | None = None) -> None:
    """``env``: the process's environment (default this one's): a baseline checkout's ``PYTHONPATH``, say."""
    # a session of its own: a Ctrl-C at the terminal reaches the bench alone, which then stops the node gracefully
    with open(t.log, "w") as out:
        t.started = time.monotonic()
        t.proc = subprocess.Popen(t.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  cwd=t.log.parent, env=cache_env(t.caches, env), start_new_session=True)


def wait_health(t: Target, timeout_s: float) -> float:
    """Seconds from the start to the first ``/health`` 200."""
    deadline = time.monotonic() + timeout_s
    with unix_http.client(timeout=2) as http:
        while time.monotonic() < deadline:
            if t.proc.poll() is not None:
                raise RuntimeError(f"{t.name} exited with {t.proc.returncode} before it was healthy:\n{t.log_tail()}")
            try:
                if http.get(t.url + "/health").status_code == 200:
                    return time.monotonic() - t.started
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.05)
    raise TimeoutError(f"{t.name}: /health not 200 within {timeout_s:.0f} s:\n{t.log_tail()}")


def wait_first_answer(t: Target, body: dict, timeout_s: float) -> float:
    """Seconds from the start to the first answered chat (``body``, not streamed), sent as soon as ``/health`` said
    200; each refusal on the way is kept in ``t.refused_first_chats`` (seconds since start, status, reason)."""
    deadline = time.monotonic() + timeout_s
    with unix_http.client(timeout=httpx.Timeout(timeout_s, connect=10)) as http:
        while time.monotonic() < deadline:
            if t.proc.poll() is not None:
                raise RuntimeError(f"{t.name} exited with {t.proc.returncode}:\n{t.log_tail()}")
            try:
                response = http.post(t.url + "/v1/chat/completions", json=body)
                if response.status_code == 200:
                    return time.monotonic() - t.started
                failure = (response.status_code, response.text[:300])
            except httpx.HTTPError as err:
                failure = (0, f"{type(err).__name__}: {err}"[:300])
            t.refused_first_chats.append({"at_s": round(time.monotonic() - t.started, 3), "status": failure[0],
                                          "reason": failure[1]})
            time.sleep(0.5)
    raise TimeoutError(f"{t.name}: no chat answered within {timeout_s:.0f} s:\n{t.log_tail()}")


def background_state(info: dict) -> dict:
    """Each engine's background compile as ``/server_info`` tells it: ``{engine: None (not ready yet), "running", or
    what it compiled ({"programs", "seconds", "demanded"}, or {"skipped": True})}``; a node's under ``node``,
    ``--role pd``'s per engine (``engines_startup``: prefill, decode)."""
    # --pd-front direct: the pair's own info, the app's engine's, is where they are (cli/pd_pair.py)
    pair = (info.get("internal_states") or [{}])[0] or {}
    engines = info.get("engines_startup") or pair.get("engines_startup") or {"node": info.get("startup")}
    return {engine: (startup or {}).get("background_compile") for engine, startup in engines.items()}


def background_done(state: dict) -> bool:
    return bool(state) and all(isinstance(report, dict) for report in state.values())


def wait_background(t: Target, timeout_s: float) -> tuple[float | None, dict]:
    """Wait until every engine of the started target says its background compile is done: the seconds from the
    start to then (None when ``timeout_s`` passed first) and the last ``background_state``."""
    deadline = time.monotonic() + timeout_s
    state: dict = {}
    with unix_http.client(timeout=10) as http:
        while True:
            if t.proc.poll() is not None:
                raise RuntimeError(f"{t.name} exited with {t.proc.returncode}:\n{t.log_tail()}")
            with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError):  # a busy node: ask again
                state = background_state(http.get(t.url + "/server_info").json())
            if background_done(state):
                return time.monotonic() - t.started, state
            if time.monotonic() >= deadline:
                return None, state
            time.sleep(0.25)


def stop(t: Target, grace_s: float = STOP_GRACE_S) -> int | None:
    """Stop the process this bench started, by its PID: SIGTERM, up to ``grace_s`` to exit, then SIGKILL. Its exit
    status (0 for a clean drain), or None when it was never started."""
    proc = t.proc
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def _compiles_on(http, url: str) -> dict | None:
    text = http.get(url + "/metrics").text
    if "fsm_pd_compiles_total" not in text:
        return None
    found: dict[str, float] = {}
    for match in re.finditer(r'^fsm_pd_compiles_total\{[^}]*phase="(\w+)"[^}]*\} (\S+)$', text, re.M):
        found[match.group(1)] = found.get(match.group(1), 0) + float(match.group(2))
    return found


def _engine_url(router_info: dict) -> str | None:
    """An engine of a ``--role pd`` process, from its router's ``/server_info``: the prefill engine's (the decode
    engine shares its pool, its budget and the process's compile counter); None for anything else."""
    workers = [worker["url"] for role in ("prefill", "decode") for worker in router_info.get(role) or ()]
    return workers[0] if workers else None


def compiles(url: str) -> dict:
    """``fsm_pd_compiles_total`` by phase (startup, background, serving): the node's own, or, where the process is
    ``--role pd`` and its /metrics are the router's, the process's as an engine behind it shows it
    (``/server_info``): the counter counts the process's programs, so both engines show the same one."""
    try:
        with unix_http.client(timeout=10) as http:
            own = _compiles_on(http, url)
            if own is not None:
                return {"node": own}
            engine = _engine_url(http.get(url + "/server_info").json())
            return {"process": _compiles_on(http, engine) or {}} if engine else {}
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return {}


def prefill_budget(url: str) -> dict | None:
    """The prefill budget's state (``StepBudget.state``, ``/server_info``'s ``prefill_budget``): the node's own, or
    for ``--role pd`` its prefill engine's (the decode engine shares it). None when it cannot be read."""
    return engine_field(url, "prefill_budget")


def step_loop(url: str) -> dict | None:
    """The scheduler's step loop so far (``StepDriver.timing``, ``/server_info``'s ``step_loop``): the node's, or for
    ``--role pd`` its engines' one loop. None when it cannot be read."""
    return engine_field(url, "step_loop")


def step_loop_since(before: dict | None, after: dict | None) -> dict | None:
    """What the step loop did between two readings: sums as differences. The longest wait is the process's so far,
    so it is the runs' own only where it grew; else None (no wait of theirs was longer than an earlier one)."""
    if not before or not after:
        return None
    grown = {key: round(after[key] - before[key], 6) for key in after if key != "waited_max_s"}
    longest = after["waited_max_s"] if after["waited_max_s"] > before["waited_max_s"] else None
    return grown | {"waited_max_s": longest}


def engine_field(url: str, key: str) -> dict | None:
    """A field of the engine's ``/server_info``: the node's own, or for ``--role pd`` its prefill engine's."""
    def engine_state(info: dict) -> dict | None:  # a node's engine fields: SGLang's internal_states
        state = (info.get("internal_states") or [{}])[0]  # --pd-front direct: the pair's, each engine's under it
        return state.get(key) or state.get("engines", {}).get("prefill", {}).get(key)

    try:
        with unix_http.client(timeout=10) as http:
            info = http.get(url + "/server_info").json()
            if "internal_states" in info:
                return engine_state(info)
            engine = _engine_url(info)
            return engine_state(http.get(engine + "/server_info").json()) if engine else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None


def compiled_since(before: dict, after: dict) -> dict:
    """Programs compiled between two ``compiles`` readings, per engine and phase (0s left out)."""
    grown = {engine: {phase: n - before.get(engine, {}).get(phase, 0) for phase, n in phases.items()}
             for engine, phases in after.items()}
    return {engine: {phase: n for phase, n in phases.items() if n} for engine, phases in grown.items()}
