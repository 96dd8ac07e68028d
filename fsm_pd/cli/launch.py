"""``fsm-pd launch``: a whole local PD cluster with one command.

(On a host whose accelerator one process at a time may hold, a TPU's, the default cluster is one ``fsm-pd serve
--role pd`` process in the router's place instead: ``launch_layout.py``. What follows is the layout of nodes.)

Starts N prefill nodes (each with its bootstrap server) and M decode nodes at once (they load the model side by side),
then the built-in router, every one a ``fsm-pd serve`` child process on 127.0.0.1 (or, with ``uds``, on unix sockets
in one directory and no TCP at all) sharing a freshly generated side-channel secret, and waits until each answers
``/health`` (each node first prepares the programs that cover every request and compiles the rest in the
background: from the command to the first answer, about 14 s for SmolLM2 on 2 CPU cores the first time and 5 s once
the caches hold the programs and the converted model; README). Every command line, the router's port and the journal
directory are checked first: a bad one ends launch with one line, status 2, before anything starts.
Then it sends one chat request through the router, prints its answer and the time from the command to that
answer, prints the router's URL, and serves until Ctrl-C or SIGTERM. Then it stops exactly the processes
it started, each with one SIGTERM, so that each node drains: they run in process groups of their own, out of reach
of the terminal's Ctrl-C (``children.py``). A node that dies on its own is reported and the cluster keeps
serving (the router's health checks and retries route around it: ``docs/fleet.md``) while at least one decode node is
alive, and one prefill node too under the router's ``--pd-policy always`` (under ``auto``, the default, a decode node
prefills every prompt itself once no prefill node is left); when a role it needs has none left, or the router dies,
the whole cluster is stopped and the exit status says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
from rich.console import Console

from fsm_pd.cli import launch_layout

# the processes: started, watched, stopped (``free_port``, ``Child``, ``stop``, ``wait_healthy`` and ``exit_cause``
# are also used from here by the tests and benches)
from fsm_pd.cli.children import (  # noqa: F401
    HEALTH_TIMEOUT_S,
    Child,
    Stop,
    StopSignals,
    exit_cause,
    free_port,
    start,
    stop,
    wait_admitted,
    wait_healthy,
    wait_ready,
)
from fsm_pd.cli.flags import accelerator_host
from fsm_pd.net import unix_http
from fsm_pd.net.unix_http import http_url
from fsm_pd.net.unix_sockets import (
    UnixPathError,
    check_path,
    check_unix_backend,
    clear_stale,
    is_unix,
    node_socket,
    node_socket_paths,
    unix_address,
    unix_path,
)
from fsm_pd.transport import generate_secret, secret_env

WARMUP_QUESTION = "What is the capital of France?"
WARMUP_TIMEOUT_S = 300.0


def plan(prefill: int, decode: int, port: int, model: str, backend: str, journal_dir: Path,
         extra: list[str], prefill_tp: int = 1, decode_tp: int = 1, router_extra: Sequence[str] = (),
         uds: Path | None = None, prefill_extra: Sequence[str] = (), decode_extra: Sequence[str] = ()) -> list[Child]:
    """The processes to start: prefill nodes, decode nodes, then the router that fronts them. ``prefill_tp`` and
    ``decode_tp``: each node's ``--tp`` (they may differ: the handoff reshards the KV). ``extra`` goes to every
    prefill and decode node's command line, ``prefill_extra`` and ``decode_extra`` to one role's nodes alone (a flag
    only that role takes), ``router_extra`` to the router's. ``uds``: every process listens on unix sockets in that
    directory instead of TCP ports (``NAME.sock`` and the node's sockets beside it; the router on
    ``uds/router.sock``)."""
    serve = [sys.executable, "-m", "fsm_pd.cli", "serve"]
    common = ["--host", "127.0.0.1", "--model", model, "--transfer-backend", backend, *extra]
    children, router_args = [], []

    def child(name: str, role: str, argv: list[str], port: int) -> Child:
        log = journal_dir / f"{name}.log"
        if uds is None:
            return Child(name, [*argv, "--port", str(port)], f"http://127.0.0.1:{port}", log)
        path = str((uds / f"{name}.sock").absolute())
        return Child(name, [*argv, "--uds", path], unix_address(path), log, sockets=node_socket_paths(role, path))

    for i in range(prefill):
        name = f"prefill-{i}"
        node = child(name, "prefill", [*serve, "--role", "prefill", "--node-id", name, "--journal",
                                       str(journal_dir / f"{name}.db"), "--tp", str(prefill_tp), *common,
                                       *prefill_extra],
                     0 if uds is not None else free_port())
        if uds is None:
            boot = str(free_port())
            node.argv += ["--bootstrap-port", boot]
        else:  # the default beside its --uds, named so the router's flags read plainly
            boot_path = node_socket(unix_path(node.url), "bootstrap")
            node.argv += ["--bootstrap-uds", boot_path]
            boot = unix_address(boot_path)
        children.append(node)
        router_args += ["--prefill", node.url, boot]
    for i in range(decode):
        name = f"decode-{i}"
        node = child(name, "decode", [*serve, "--role", "decode", "--node-id", name, "--journal",
                                      str(journal_dir / f"{name}.db"), "--tp", str(decode_tp), *common,
                                      *decode_extra],
                     0 if uds is not None else free_port())
        children.append(node)
        router_args += ["--decode", node.url]
    children.append(child("router", "router", [*serve, "--role", "router", "--host", "127.0.0.1", *router_args,
                                               *router_extra], port))
    return children


def check_sockets(children: Sequence[Child]) -> str | None:
    """The first unix socket path of ``children`` that Linux cannot bind (over 107 bytes), or None."""
    for child in children:
        for what, path in child.sockets.items():
            try:
                check_path(path, f"{child.name}: {what}")
            except UnixPathError as exc:
                return str(exc)
    return None


def check_commands(children: Sequence[Child]) -> str | None:
    """Parse and check each child's command line as its ``fsm-pd serve`` would (``serve_checks``, but for the
    side-channel secret, which launch makes); the first error, or None. So that a flag passed through
    (``--node-arg``, ``--prefill-arg``, ``--decode-arg``, ``--router-arg``) that a node would refuse stops launch
    before anything starts."""
    import contextlib
    import io

    from fsm_pd.cli.checks import listener_problem, node_problem
    from fsm_pd.cli.flags import role_parser

    for child in children:
        parser, argv = role_parser(child.argv[child.argv.index("serve") + 1:])
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                args = parser.parse_args(argv)
        except SystemExit:
            return f"{child.name}: " + stderr.getvalue().strip().splitlines()[-1]
        problem = listener_problem(args) if child.name == "router" else node_problem(args, secret=False)
        if problem is not None:
            return f"{child.name}: fsm-pd serve: error: {problem}"
    return None


def chip_holder(children: Sequence[Child]) -> Child:
    """The one process that gets the accelerator on a host where one process at a time can hold it (a TPU's): a
    ``--role pd`` process alone (``launch_layout.py``), else the first decode node, which serves every short prompt
    whole and every stream's tokens; the others run on the host's CPU cores (``JAX_PLATFORMS=cpu``)."""
    return next(child for child in children if child.name == launch_layout.PD_NAME or child.name.startswith("decode-"))


def launch_problem(port: int, journal_dir: Path, uds: Path | None, model: str) -> str | None:
    """What launch's own flags stop at before anything starts: a model that is not there, the router's port taken
    (unless it listens on a unix socket), a journal directory that cannot be written."""
    from fsm_pd.cli.checks import model_problem, port_problem, writable_problem

    return (model_problem(model) or (port_problem("--port", "127.0.0.1", port) if uds is None else None)
            or writable_problem("--journal-dir", journal_dir, directory=True))


def needed_roles(router_extra: Sequence[str]) -> tuple[str, ...]:
    """The roles the router cannot serve without: decode, and prefill too when it sends every request through one
    (``--pd-policy always``); under ``auto`` and ``never`` a decode node prefills prompts itself."""
    args = list(router_extra)
    policy = next((a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
                   for i, a in enumerate(args) if a.split("=", 1)[0] == "--pd-policy"), "auto")
    return ("prefill", "decode") if policy == "always" else ("decode",)


def survivors(nodes: list[Child], reported: set[str], console: Console,
              needed: Sequence[str] = ("prefill", "decode")) -> dict[str, int]:
    """Nodes alive per role; says once about each node that exited (the router's health checks stop sending
    there, and its requests in flight are retried on the others)."""
    left, newly = {"prefill": 0, "decode": 0}, False
    for child in nodes:
        role = child.name.split("-")[0]
        if child.proc.poll() is None:
            left[role] += 1
        elif child.name not in reported:
            reported.add(child.name)
            newly = True
            console.print(f"[bold yellow]{child.name} exited with {child.proc.returncode} (see {child.log}); the "
                          f"router routes around it[/]")
    if newly and all(left[role] for role in needed):
        console.print(f"still serving, on {left['prefill']} prefill and {left['decode']} decode node(s)")
    return left


def warm_up(router: str, model: str) -> str:
    """One greedy chat request through the router; its answer: proof that the whole path serves before the user's
    first request."""
    body = {"model": model, "messages": [{"role": "user", "content": WARMUP_QUESTION}], "max_tokens": 32,
            "temperature": 0}
    response = unix_http.request("POST", http_url(router + "/v1/chat/completions"), json=body,
                                 timeout=WARMUP_TIMEOUT_S)
    if response.status_code != 200:
        raise RuntimeError(f"the warm-up request failed with {response.status_code}: {response.text[:300]}")
    return response.json()["choices"][0]["message"]["content"]


def how_to_reach(router: str, model: str) -> list[str]:
    """The commands ``launch`` prints: a chat with curl, and with the openai package."""
    chat = {"messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 32, "temperature": 0}
    ask = (f".chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'What is 2+2?'}}], "
           "temperature=0).choices[0].message.content")
    if is_unix(router):
        path = unix_path(router)
        return [f"  curl --unix-socket {path} http://localhost/v1/chat/completions -H 'Content-Type: "
                f"application/json' -d '{json.dumps(chat)}'",
                f"  python -c \"import httpx, openai; print(openai.OpenAI(base_url='http://localhost/v1', api_key='-', "
                f"http_client=httpx.Client(transport=httpx.HTTPTransport(uds='{path}'))){ask})\""]
    return [f"  curl {router}/v1/chat/completions -H 'Content-Type: application/json' -d '{json.dumps(chat)}'",
            f"  python -c \"import openai; print(openai.OpenAI(base_url='{router}/v1', api_key='-'){ask})\""]


def launch(*, prefill: int, decode: int, port: int, model: str, backend: str, journal_dir: Path,
           extra: list[str], console: Console, warmup: bool = True, prefill_tp: int = 1, decode_tp: int = 1,
           router_extra: Sequence[str] = (), uds: Path | None = None, prefill_extra: Sequence[str] = (),
           decode_extra: Sequence[str] = (), layout: str = "auto", role_args: Sequence[str] = ()) -> int:
    """``backend``: the nodes' transfer backend, None for the default (tcp between nodes; one ``--role pd`` process's
    own, ``pool``). ``layout``: ``launch_layout.LAYOUTS``; ``role_args``: the flags given for one role or the router
    alone (``--prefill-arg``, ``--decode-arg``, ``--router-arg``), which one process cannot take."""
    started = time.time()
    # launch's own flags first: planning picks the nodes' free TCP ports (unless --uds), which a host without TCP
    # refuses, and a missing model must not be blamed on that
    error = launch_problem(port, journal_dir, uds, model)
    if error is not None:
        print(f"fsm-pd launch: error: {error}", file=sys.stderr)  # one line, whatever the terminal's width
        return 2
    try:
        layout = launch_layout.choose(layout, accelerator_host(),
                                      launch_layout.one_process_problem(prefill, decode, prefill_tp, decode_tp,
                                                                        role_args))
    except ValueError as exc:
        print(f"fsm-pd launch: error: {exc}", file=sys.stderr)
        return 2
    if layout == "pd":
        children = [launch_layout.plan_one_process(port, model, backend, journal_dir, extra, router_extra, uds)]
    else:
        children = plan(prefill, decode, port, model, backend or "tcp", journal_dir, extra, prefill_tp, decode_tp,
                        router_extra, uds, prefill_extra, decode_extra)
    # the router's parser comes with the router's imports (0.9 s): checked only when it is given flags to check
    error = check_sockets(children) or check_commands(children if router_extra or layout == "pd" else children[:-1])
    if error is None and uds is not None and layout == "nodes":
        try:
            check_unix_backend(backend or "tcp")
        except ValueError as exc:
            error = str(exc)
    if error is not None:
        print(f"fsm-pd launch: error: {error}", file=sys.stderr)  # one line, whatever the terminal's width
        return 2
    journal_dir.mkdir(parents=True, exist_ok=True)
    if uds is not None:
        uds.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **secret_env(generate_secret())}
    # one process: it is the cluster's front and its only node (what the router's death means, it means)
    nodes, router_child = (children, children[0]) if layout == "pd" else (children[:-1], children[-1])
    signals = StopSignals()  # Ctrl-C, SIGTERM, SIGHUP: the first stops the cluster (each node drains), the next hurry
    signals.install()
    chip = chip_holder(children) if accelerator_host() else None
    try:
        with console.status("starting the cluster") as status:
            with signals.held():  # no child is left started but not known
                for child in children:  # the router too: it sends nothing to a node until that node is ready
                    start(child, env if chip is None or child is chip else {**env, "JAX_PLATFORMS": "cpu"})
            status.stop()  # the nodes' progress bars take the terminal meanwhile
            how = ("one process, a prefill and a decode engine on this host's devices; --layout nodes: a "
                   "process per node" if layout == "pd" else ", ".join(c.name for c in nodes))
            console.print(f"starting {how} ({model}; logs in {journal_dir})", soft_wrap=True, highlight=False)
            phases = wait_ready(nodes, time.time() + HEALTH_TIMEOUT_S, console)
            for name, times in phases.items():
                console.print(f"  {name} ready: " + ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds
                                                             in times.items()), highlight=False)
            status.start()
            if layout == "nodes":
                status.update(f"waiting for the router ({router_child.url}) to take the nodes in")
                wait_admitted(router_child, {"prefill": prefill, "decode": decode}, time.time() + HEALTH_TIMEOUT_S)
            router = router_child.url
            if warmup:
                status.update(f"asking {WARMUP_QUESTION!r} through the router")
                answer = warm_up(router, model)
                console.print(f"{WARMUP_QUESTION} -> {answer!r}  (first answer {time.time() - started:.1f} s "
                              "after the command)", soft_wrap=True, markup=False, highlight=False)
        if layout == "pd":
            console.print(f"[bold green]fsm-pd is serving {model} at {router}[/] (one --role pd process: a prefill "
                          f"and a decode engine on this host's devices, {backend or 'pool'} handoffs; journals "
                          f"and log in {journal_dir}; --layout nodes: a process per node)")
        else:
            console.print(f"[bold green]fsm-pd is serving {model} at {router}[/] ({prefill} prefill, {decode} decode, "
                          f"{backend or 'tcp'} transfers; journals and logs in {journal_dir})")
        if layout == "nodes" and not any(arg.startswith("--pd-policy") for arg in router_extra):
            console.print("  the router hands a prompt to a prefill node only where that pays: a long one goes "
                          "through prefill and decode, a short one is served whole on a decode node (--pd-policy "
                          "auto; each answer's X-FSM-PD-Route and X-FSM-PD-Route-Reason headers say which, and why, "
                          "and a /generate answer's meta_info.pd_route too; docs/crossover.md)",
                          soft_wrap=True, highlight=False)
        for line in how_to_reach(router, model):
            console.print(line, soft_wrap=True, highlight=False, markup=False)
        console.print("  Ctrl-C stops every process started here: each node finishes its open requests first "
                      "(its --drain-timeout-secs); a second Ctrl-C stops them at once.")
        reported: set[str] = set()
        needed = needed_roles(router_extra)
        while True:
            time.sleep(0.5)
            if router_child.proc.poll() is not None:
                what = "the router" if layout == "nodes" else "the --role pd process"
                console.print(f"[bold red]{what} exited with {router_child.proc.returncode}; stopping the "
                              f"cluster (see {router_child.log})[/]")
                return 1
            if layout == "pd":
                continue
            left = survivors(nodes, reported, console, needed)
            if not all(left[role] for role in needed):
                role = next(r for r in needed if not left[r])
                console.print(f"[bold red]no {role} node is left; stopping the cluster[/]")
                return 1
    except Stop:
        console.print("stopping: each node finishes its open requests, then exits (Ctrl-C again: at once)")
        return 0
    except (RuntimeError, httpx.HTTPError) as exc:
        console.print(f"[bold red]fsm-pd launch: {exc}[/]")
        return 1
    finally:
        signals.stopping()  # a signal from here on only hurries the stop
        stop(children, signals.hurry)
        for child in children:  # what a process killed before it could clean up left behind
            for path in child.sockets.values():
                with contextlib.suppress(OSError):
                    clear_stale(path)
