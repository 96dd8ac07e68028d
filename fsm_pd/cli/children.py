"""The processes ``fsm-pd launch`` starts: each in a process group of its own, watched until it is ready, and stopped
with exactly one SIGTERM, so that it drains.

A terminal's Ctrl-C sends SIGINT to its foreground process group. Were the nodes in launch's group, each would get
that SIGINT (which stops a node without draining) and then launch's own SIGTERM, which a node takes as its second
signal and exits at once (``api/drain.py``): the open requests were cut. In groups of their own they hear only launch,
once (``StopSignals``, ``stop``): each node drains, finishing its open requests within its ``--drain-timeout-secs``,
and exits 0. A second Ctrl-C tells them again, and they exit at once.
"""

from __future__ import annotations

import contextlib
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console

from fsm_pd.net import unix_http
from fsm_pd.net.unix_http import http_url

HEALTH_TIMEOUT_S = 600.0  # a node answers /health once its ready set is prepared (seconds; this bounds a slow host)
# a node's drain (--drain-timeout-secs, default 30 s), the aborts' grace (5 s) and its journal's close: then SIGKILL
STOP_GRACE_S = 45.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now, for a server started next. It is drawn below the kernel's ephemeral range,
    where no outgoing connection takes its local port (a port the kernel hands to ``bind(0)`` is one an outgoing
    connection can take before our server binds it), and never one this process handed out before."""
    low = max(_ephemeral_low(), 2048)  # an ephemeral range that starts lower leaves no port outside it
    for _ in range(1000):
        port = random.randrange(max(1024, low // 2), low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port on {host} below {low}")


def _ephemeral_low() -> int:
    try:  # Linux; elsewhere the IANA range's start
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


@dataclass
class Child:
    name: str
    argv: list[str]
    url: str  # http://127.0.0.1:PORT, or unix:PATH
    log: Path
    proc: subprocess.Popen | None = field(default=None, repr=False)
    sockets: dict[str, str] = field(default_factory=dict)  # with --uds: every unix socket it listens on


def start(child: Child, env: dict) -> None:
    """Start ``child`` logging to its file, in a process group of its own: a signal to launch's group (a terminal's
    Ctrl-C) does not reach it; launch tells it (``stop``)."""
    log = open(child.log, "w")  # noqa: SIM115 - the child keeps writing to it
    child.proc = subprocess.Popen(child.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  stdin=subprocess.DEVNULL, process_group=0)


def get(url: str, timeout: float) -> httpx.Response:
    """``GET url`` (``http://`` or ``unix:PATH/...``)."""
    return unix_http.request("GET", http_url(url), timeout=timeout)


def exit_cause(log: Path) -> str | None:
    """The line of a child's log that says why it exited: the last that names an error (a server's shutdown lines
    come after it), else the last line."""
    lines = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
    return next((line for line in reversed(lines) if "error" in line.lower()), lines[-1] if lines else None)


def health(child: Child) -> tuple[bool, dict]:
    """Whether ``child`` is ready (``/health`` 200), and what it says of its start-up while it is not; raises
    when it exited."""
    if child.proc.poll() is not None:
        cause = exit_cause(child.log)
        raise RuntimeError(f"{child.name} exited with {child.proc.returncode}{f': {cause}' if cause else ''} "
                           f"(log: {child.log})")
    try:
        response = get(child.url + "/health", timeout=2.0)
    except httpx.HTTPError:
        return False, {"phase": "starting"}  # not listening yet: the interpreter and its imports
    if response.status_code == 200:
        return True, {}
    try:
        return False, response.json()
    except ValueError:
        return False, {}


def wait_healthy(child: Child, deadline: float) -> None:
    while time.time() < deadline:
        if health(child)[0]:
            return
        time.sleep(0.25)
    raise RuntimeError(f"{child.name} did not answer {child.url}/health within {HEALTH_TIMEOUT_S:.0f} s; "
                       f"see {child.log}")


def wait_admitted(router: Child, counts: dict[str, int], deadline: float) -> None:
    """Wait until ``router`` answers ``/health`` and routes to every node (``admitted``, per role, after its first
    round of health checks)."""
    while time.time() < deadline:
        if health(router)[0]:
            try:
                said = get(router.url + "/health", timeout=2.0).json()
                if said.get("checked") and said.get("admitted") == counts:
                    return
            except (httpx.HTTPError, ValueError):
                pass
        time.sleep(0.1)
    raise RuntimeError(f"the router did not take the nodes in within {HEALTH_TIMEOUT_S:.0f} s; see {router.log}")


def wait_ready(nodes: list[Child], deadline: float, console: Console) -> dict[str, dict]:
    """Wait until every node is ready, showing each one's start-up in the terminal: its phase, then the programs
    it prepares (done out of total, and the time left). Returns each node's start-up phases (``/server_info``)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.fields[node]:<10} {task.description:<28}"), BarColumn(), MofNCompleteColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as bars:
        tasks = {c.name: bars.add_task("starting", node=c.name, total=None) for c in nodes}
        waiting = list(nodes)
        while waiting:
            if time.time() > deadline:
                raise RuntimeError(f"{', '.join(c.name for c in waiting)} not ready within {HEALTH_TIMEOUT_S:.0f} s"
                                   f"; see {waiting[0].log}")
            for child in list(waiting):
                ready, status = health(child)
                status = one_status(status)
                task = tasks[child.name]
                if ready:
                    done = bars.tasks[task].total or 1
                    bars.update(task, description="ready", total=done, completed=done)
                    waiting.remove(child)
                elif progress := status.get("progress"):
                    bars.update(task, description=progress.get("step", ""), total=progress["total"],
                                completed=progress["done"])
                else:
                    bars.update(task, description=status.get("phase", "starting"))
            time.sleep(0.25)
    return {c.name: startup_phases(c) for c in nodes}


def one_status(status: dict) -> dict:
    """A node's start-up status as ``/health`` says it; a ``--role pd`` process's, which has one per engine
    (``engines``), as one: the programs of both, and the phase of the first engine that is not done."""
    engines = [s for s in (status.get("engines") or {}).values() if isinstance(s, dict)]
    if not engines:
        return status
    progress = [s["progress"] for s in engines if s.get("progress")]
    phase = next((s.get("phase") for s in engines if s.get("status") != "ready" and s.get("phase")), "starting")
    out = {"phase": phase}
    if progress:
        out["progress"] = {"step": next((p.get("step", "") for p in progress if p["done"] < p["total"]), phase),
                           "done": sum(p["done"] for p in progress), "total": sum(p["total"] for p in progress)}
    return out


def startup_phases(child: Child) -> dict:
    try:
        return (get(child.url + "/server_info", timeout=5.0).json().get("startup") or {}).get("phases", {})
    except (httpx.HTTPError, ValueError):
        return {}


class Stop(BaseException):  # noqa: N818 - not an error: the request to stop (as KeyboardInterrupt, no handler swallows it)
    """A signal asked launch to stop the cluster (raised in the main thread, wherever it waits)."""


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP for launch: the first raises ``Stop`` in the main thread (its waits for the nodes
    and the warm-up request end at once), each later one sets ``hurry``. ``held`` sections (starting a child) are not
    cut: a signal there raises when they end."""

    def __init__(self) -> None:
        self.received = 0
        self.hurry = threading.Event()
        self._held = self._raised = False

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def stopping(self) -> None:
        """From now on a signal only hurries the stop (launch stops for another reason)."""
        self.received = max(self.received, 1)
        self._raised = True

    def _on_signal(self, sig: int, _frame) -> None:
        self.received += 1
        if self.received > 1:
            self.hurry.set()
        elif not self._held:
            self._raised = True
            raise Stop(signal.Signals(sig).name)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self._held = True
        try:
            yield
        finally:
            self._held = False
        if self.received and not self._raised:
            self._raised = True
            raise Stop("a signal while starting")


def stop(children: Sequence[Child], hurry: threading.Event | None = None, grace_s: float = STOP_GRACE_S) -> None:
    """One SIGTERM to every process started here, in reverse order (the router first): each node drains and exits.
    When ``hurry`` is set (a second Ctrl-C) each one still running gets a second SIGTERM and exits at once; whatever
    outlives ``grace_s`` is killed."""
    running = [c for c in reversed(children) if c.proc is not None and c.proc.poll() is None]
    for child in running:
        child.proc.send_signal(signal.SIGTERM)
    deadline, hurried = time.monotonic() + grace_s, False
    while running and time.monotonic() < deadline:
        if hurry is not None and hurry.is_set() and not hurried:
            hurried = True
            for child in running:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        running = [c for c in running if c.proc.poll() is None]
    for child in running:
        child.proc.kill()
        child.proc.wait()
