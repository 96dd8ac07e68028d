"""Server processes a test (or a bench) starts on 127.0.0.1 and stops by PID: ``Cluster`` runs ``fsm-pd serve`` nodes
and the built-in router with a shared side-channel secret, each logging to a file beside its journal. Every process a
test starts dies with the process that started it (``dies_with_parent``), however that one ends. No pytest here, so
that ``bench/`` scripts can use it after the README's install alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time

import httpx

from fsm_pd.cli.launch import free_port
from fsm_pd.transport import generate_secret, secret_env

PAGE_SIZE = 16
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def dies_with_parent(sig: int = signal.SIGKILL):
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when the thread that starts it ends, so that no
    server outlives a test process killed before its teardown ran (a pytest-xdist worker SIGKILLed, a run stopped by
    ``timeout``: the orphans kept their ports, and the next run failed on them). Linux's parent-death signal survives
    ``exec`` (``ip netns exec``, ``unshare`` pass it on) but follows the starting *thread*: start long-lived children
    from the test's own thread, not from a pool's. SIGKILL by default (a SIGSTOPped node dies too); SIGTERM for a
    process that stops its own children on it (``fsm-pd launch``: its nodes, each in a group of its own, would stay).
    None where the kernel has no such signal: the children are stopped by PID at teardown, as before."""
    if sys.platform != "linux":
        return None
    prctl, parent = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()  # looked up before the fork

    def arm() -> None:
        if prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() != parent:  # the parent died before the signal was armed: nobody would send it
            os.kill(os.getpid(), sig)

    return arm


def wait_health(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"{url} exited with {proc.returncode}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.05)  # every node a test starts waits here: 0.3 s sleeps lost 0.15 s a start on average
    raise TimeoutError(f"{url} not healthy within {timeout}s")


class Cluster:
    """Processes this test starts, stopped (SIGTERM, then SIGKILL) by PID at the end."""

    def __init__(self, tmp_path):
        self.tmp, self.procs = tmp_path, []
        self.env = {**os.environ, **secret_env(generate_secret()), "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}

    def start(self, name: str, argv: list[str], url: str, env: dict | None = None) -> str:
        wait_health(url, self.launch(name, argv, env))
        return url

    def launch(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        """Start ``argv`` without waiting for it (several processes start faster side by side); ``env`` defaults to
        the cluster's."""
        with open(self.tmp / f"{name}.log", "w") as log:  # the child writes through its own copy of the descriptor
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env or self.env,
                                    stdin=subprocess.DEVNULL, preexec_fn=dies_with_parent())
        self.procs.append(proc)
        return proc

    def serve(self, role: str, *extra: str) -> str:
        return self.serve_many((role, *extra))[0]

    def serve_many(self, *nodes: tuple[str, ...], env: dict | None = None) -> list[str]:
        """Start every node (``(role, *flags)``) at once and return their URLs, in order, once each answers
        ``/health``: loading the model and compiling on both cores takes about half the time of one after the
        other."""
        return self.healthy([self.launch_node(role, *extra, env=env) for role, *extra in nodes])

    def launch_node(self, role: str, *extra: str, env: dict | None = None) -> tuple[str, subprocess.Popen]:
        """``fsm-pd serve --role role`` on a free port, with its own journal; (its URL, its process) at once."""
        port = free_port()
        argv = [sys.executable, "-m", "fsm_pd.cli", "serve", "--role", role, "--port", str(port),
                "--page-size", str(PAGE_SIZE), *extra]
        if role in ("prefill", "decode"):
            argv += ["--journal", str(self.tmp / f"{role}-{port}.db"), "--node-id", f"{role}-{port}"]
        return f"http://127.0.0.1:{port}", self.launch(f"{role}-{port}", argv, env)

    @staticmethod
    def healthy(started: list[tuple[str, subprocess.Popen]]) -> list[str]:
        """The URLs of ``launch_node``'s answers, once each of them answers ``/health``."""
        for url, proc in started:
            wait_health(url, proc)
        return [url for url, _ in started]

    def pd(self, backend: str, *others: tuple[str, ...]) -> tuple:
        """A prefill node (and its bootstrap port) and a decode node, started with ``others`` (``(role, *flags)``)
        side by side: ``(prefill URL, bootstrap port, decode URL, *others' URLs)``."""
        boot = free_port()
        p, d, *rest = self.serve_many(("prefill", "--bootstrap-port", str(boot), "--transfer-backend", backend),
                                      ("decode", "--transfer-backend", backend), *others)
        return (p, boot, d, *rest)

    def router(self, p: str, boot: int, d: str, *extra: str) -> str:
        port = free_port()
        return self.start("router", [sys.executable, "-m", "fsm_pd.cli", "serve", "--role", "router", "--port",
                                     str(port), "--prefill", p, str(boot), "--decode", d, "--pd-policy", "always",
                                     *extra],  # classic PD unless ``extra`` says otherwise (the last flag wins)
                          f"http://127.0.0.1:{port}")

    def stop(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def pd_beside_colocated(cluster: Cluster, backend: str = "zmq") -> dict[str, str]:
    """A PD pair behind the built-in router (and behind the real sglang-router when that package is installed), and a
    colocated node to compare with: ``{"colocated", "router", "prefill", "decode", "sglang-router"?}`` -> base
    URL."""
    p, boot, d, colocated = cluster.pd(backend, ("colocated",))
    found = {"colocated": colocated, "router": cluster.router(p, boot, d), "prefill": p, "decode": d}
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return found
    port = free_port()
    found["sglang-router"] = cluster.start("sglang-router", [
        sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill", p, str(boot),
        "--decode", d, "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(free_port()), "--policy", "random"], f"http://127.0.0.1:{port}")
    return found


def post_ok(url: str, path: str, body: dict, timeout_s: float = 180) -> dict | list:
    """POST ``body`` as JSON, assert a 200 (the answer's text in the message otherwise), return the parsed answer."""
    r = httpx.post(url + path, json=body, timeout=timeout_s)
    assert r.status_code == 200, r.text
    return r.json()


def routers(urls: dict[str, str]) -> list[str]:
    """The routers of ``pd_beside_colocated``'s answer that are running."""
    return [urls[name] for name in ("router", "sglang-router") if name in urls]
