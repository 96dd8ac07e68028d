"""``fsm-pd launch``: a whole local PD cluster with one command.

Starts N prefill nodes (each with its bootstrap server), M decode nodes and the built-in router, every one a
``fsm-pd serve`` child process on 127.0.0.1 sharing a freshly generated side-channel secret, waits until each
answers ``/health``, prints the router's URL, and serves until Ctrl-C or SIGTERM. Then it stops exactly the processes
it started (SIGTERM, then SIGKILL after a grace period). If any node dies on its own, the whole cluster is stopped
and the exit status says so.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console

from fsm_pd.transport import generate_secret, secret_env

HEALTH_TIMEOUT_S = 300.0  # the first start compiles the model's kernels
STOP_GRACE_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Child:
    name: str
    argv: list[str]
    url: str
    log: Path
    proc: subprocess.Popen | None = field(default=None, repr=False)


def plan(prefill: int, decode: int, port: int, model: str, backend: str, journal_dir: Path,
         extra: list[str]) -> list[Child]:
    """The processes to start: prefill nodes, decode nodes, then the router that fronts them."""
    serve = [sys.executable, "-m", "fsm_pd.cli", "serve"]
    common = ["--host", "127.0.0.1", "--model", model, "--transfer-backend", backend, *extra]
    children, router_args = [], []
    for i in range(prefill):
        http, boot = free_port(), free_port()
        children.append(Child(f"prefill-{i}", [*serve, "--role", "prefill", "--port", str(http),
                                               "--bootstrap-port", str(boot), "--node-id", f"prefill-{i}",
                                               "--journal", str(journal_dir / f"prefill-{i}.db"), *common],
                              f"http://127.0.0.1:{http}", journal_dir / f"prefill-{i}.log"))
        router_args += ["--prefill", f"http://127.0.0.1:{http}", str(boot)]
    for i in range(decode):
        http = free_port()
        children.append(Child(f"decode-{i}", [*serve, "--role", "decode", "--port", str(http),
                                              "--node-id", f"decode-{i}",
                                              "--journal", str(journal_dir / f"decode-{i}.db"), *common],
                              f"http://127.0.0.1:{http}", journal_dir / f"decode-{i}.log"))
        router_args += ["--decode", f"http://127.0.0.1:{http}"]
    children.append(Child("router", [*serve, "--role", "router", "--host", "127.0.0.1", "--port", str(port),
                                     *router_args], f"http://127.0.0.1:{port}", journal_dir / "router.log"))
    return children


def wait_healthy(child: Child, deadline: float) -> None:
    while time.time() < deadline:
        if child.proc.poll() is not None:
            raise RuntimeError(f"{child.name} exited with {child.proc.returncode}; see {child.log}")
        try:
            if httpx.get(child.url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{child.name} did not answer {child.url}/health within {HEALTH_TIMEOUT_S:.0f} s; "
                       f"see {child.log}")


def stop(children: list[Child]) -> None:
    """SIGTERM every process we started, in reverse order, then SIGKILL whatever outlives the grace period."""
    running = [c for c in reversed(children) if c.proc is not None and c.proc.poll() is None]
    for child in running:
        child.proc.send_signal(signal.SIGTERM)
    deadline = time.time() + STOP_GRACE_S
    for child in running:
        try:
            child.proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()


def launch(*, prefill: int, decode: int, port: int, model: str, backend: str, journal_dir: Path,
           extra: list[str], console: Console) -> int:
    journal_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **secret_env(generate_secret())}
    children = plan(prefill, decode, port, model, backend, journal_dir, extra)
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        with console.status("starting the cluster") as status:
            for child in children:
                status.update(f"starting {child.name} ({child.url}); log: {child.log}")
                log = open(child.log, "w")  # noqa: SIM115 - the child keeps writing to it
                child.proc = subprocess.Popen(child.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                              stdin=subprocess.DEVNULL)
                wait_healthy(child, time.time() + HEALTH_TIMEOUT_S)
        router = children[-1].url
        console.print(f"[bold green]fsm-pd is serving {model} at {router}[/] "
                      f"({prefill} prefill, {decode} decode, {backend} transfers; journals and logs in {journal_dir})")
        console.print(f"  curl {router}/generate -d '{{\"text\": \"Hello\", \"sampling_params\": "
                      f"{{\"max_new_tokens\": 16, \"temperature\": 0}}}}'")
        console.print(f"  python -c \"import openai; print(openai.OpenAI(base_url='{router}/v1', api_key='-')"
                      f".completions.create(model='{model}', prompt='Hello', max_tokens=16).choices[0].text)\"")
        console.print("  Ctrl-C stops every process started here.")
        while not stopping.wait(0.5):
            dead = [c for c in children if c.proc.poll() is not None]
            if dead:
                console.print(f"[bold red]{dead[0].name} exited with {dead[0].proc.returncode}; stopping the "
                              f"cluster (see {dead[0].log})[/]")
                return 1
        console.print("stopping")
        return 0
    except RuntimeError as exc:
        console.print(f"[bold red]fsm-pd launch: {exc}[/]")
        return 1
    finally:
        stop(children)
