"""What ``fsm-pd serve`` and ``fsm-pd launch`` check after parsing and before anything loads: the ports a process
will listen on are free (a bind test, as the server will bind), the files it will write can be written, the values
argparse cannot judge alone are sound, and a PD node has its side-channel secret. Each check gives the first
problem as one line, or None, in well under a second, so a bad command line never waits for a model to load.

The bind test is a test, not a reservation: a port another process takes between it and the server's own bind still
fails there (uvicorn's error), only later.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
from collections.abc import Iterable
from pathlib import Path

from fsm_pd.net.http_protocol import read_timeouts_from_args


def port_problem(flag: str, host: str, port: int) -> str | None:
    """Why a server could not listen on ``host:port`` now (``flag`` names where the port came from), or None. Port
    0 (any free port) is always fine. The socket is bound as uvicorn binds it (SO_REUSEADDR: a port whose last
    connections linger in TIME_WAIT is free), so what is refused here would be refused there."""
    if not 0 <= port <= 65535:
        return f"{flag} {port}: not a TCP port (0 to 65535)"
    if port == 0:
        return None
    bare = host.strip("[]")
    try:
        with socket.socket(socket.AF_INET6 if ":" in bare else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((bare, port))
    except OSError as exc:
        why = {errno.EADDRINUSE: "another process listens there (address already in use)",
               errno.EACCES: "permission denied (ports below 1024 need privileges)",
               errno.EADDRNOTAVAIL: f"{bare} is not an address of this machine"}.get(exc.errno, exc.strerror or exc)
        return f"{flag} {port}: cannot listen on {host}:{port}: {why}"
    return None


def writable_problem(flag: str, target: str | os.PathLike, *, directory: bool = False) -> str | None:
    """Why the file ``target`` (or the directory, with ``directory``) could not be created or written, or None. What
    does not exist yet is judged by its nearest existing parent, which must be a writable directory."""
    path = Path(os.path.expanduser(target)).absolute()
    if path.exists():
        if directory != path.is_dir():
            return f"{flag} {target}: {'not a directory' if directory else 'a directory, not a file'}"
        if not os.access(path, os.W_OK):
            return f"{flag} {target}: not writable"
        if directory or os.access(path.parent, os.W_OK | os.X_OK):
            return None
        return f"{flag} {target}: {path.parent} is not writable (SQLite writes its -wal file beside the journal)"
    parent = next(p for p in path.parents if p.exists())
    if not parent.is_dir():
        return f"{flag} {target}: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{flag} {target}: cannot be created, {parent} is not writable"
    return None


def first(problems: Iterable[str | None]) -> str | None:
    return next((p for p in problems if p is not None), None)


def node_problem(args: argparse.Namespace, *, secret: bool = True) -> str | None:
    """A prefill, decode or colocated node's command line, parsed (``serve_flags.node_parser``). ``secret`` False:
    the side-channel secret is not looked for (``launch`` makes one for its nodes)."""
    return first(_node_problems(args, secret))


def model_problem(spec: str) -> str | None:
    """Why ``--model spec`` names nothing this host can load (a named model's package missing, no such file), or
    None; its contents are read only when it loads."""
    from fsm_pd.model.specs import model_problem as why  # jax-free

    problem = why(spec)
    return None if problem is None else f"--model {spec}: {problem}"


def _node_problems(args: argparse.Namespace, secret: bool):
    yield model_problem(args.model)
    if getattr(args, "uds", None) is None:  # on unix sockets it binds no port (a host may refuse TCP altogether)
        yield from _port_problems(args)
    yield _read_timeouts_problem(args)
    if args.compile_cache not in (None, "off"):
        yield writable_problem("--compile-cache", args.compile_cache, directory=True)
    if args.role == "colocated":
        return
    if args.role == "pd":
        yield from _pd_problems(args)
        return
    if args.role in ("prefill", "decode") and args.transfer_backend in ("pool", "device"):
        yield (f"--transfer-backend {args.transfer_backend}: it hands KV between the two engines of one process; "
               "a prefill or decode node of its own needs tcp, zmq or jax (or run both engines in one process: "
               "--role pd)")
    if secret:
        yield _secret_problem(args)
    if args.journal is None:
        yield writable_problem("--journal (default)", Path("journals") / f"{args.node_id}.db")
    elif "://" not in args.journal:
        yield writable_problem("--journal", args.journal)
    else:
        yield journal_url_problem(args.journal)
    if args.journal_max_rows < 0:
        yield f"--journal-max-rows {args.journal_max_rows}: must be at least 0 (0: no cap)"
    if args.journal_archive_dir:
        yield writable_problem("--journal-archive-dir", args.journal_archive_dir, directory=True)


def journal_url_problem(url: str) -> str | None:
    """Why ``--journal URL`` names no database a journal can use (not a URL, no such dialect, its driver not
    installed), or None: the engine the node would make, made and dropped; it connects to nothing."""
    from fsm_pd.store.database import DatabaseUrlError, create_journal_engine, journal_url

    try:
        create_journal_engine(journal_url(url), "normal").dispose()
    except DatabaseUrlError as exc:
        return f"--journal: {exc}"
    return None


def _pd_problems(args: argparse.Namespace):
    """``--role pd``: its engines' links run over unix sockets (so a backend must run on one), one split of the
    devices for both, and the journals' directory."""
    from fsm_pd.cli.pd_flags import pd_backend
    from fsm_pd.net.unix_sockets import check_unix_backend

    split = args.prefill_devices is not None or args.decode_devices is not None
    if split and (args.prefill_devices is None or args.decode_devices is None):
        yield "--prefill-devices and --decode-devices go together: each role's devices, or neither"
    elif split and (args.prefill_devices, args.decode_devices) != (1, 1):
        yield (f"--prefill-devices {args.prefill_devices} --decode-devices {args.decode_devices}: one device a role "
               "for now (a role over several devices needs tensor parallelism, not yet on --role pd)")
    if split and args.transfer_backend == "pool":
        yield ("--transfer-backend pool: the engines share one pool only on one set of devices; with "
               "--prefill-devices and --decode-devices each has its own (the default there is device)")
    backend = pd_backend(args)
    try:
        check_unix_backend(backend)
    except ValueError:
        yield (f"--transfer-backend {backend}: the {backend} transfer backend cannot run over the unix sockets that "
               "link --role pd's two engines; use pool (the default), device, tcp or zmq")
    if args.tp > 1:
        yield f"--tp {args.tp}: --role pd runs both engines on one device for now (--tp 1)"
    yield writable_problem("--journal-dir", args.journal_dir, directory=True)
    if args.journal_max_rows < 0:
        yield f"--journal-max-rows {args.journal_max_rows}: must be at least 0 (0: no cap)"
    if args.journal_archive_dir:
        yield writable_problem("--journal-archive-dir", args.journal_archive_dir, directory=True)


def _port_problems(args: argparse.Namespace):
    yield port_problem("--port", args.host, args.port)
    if args.role == "prefill":
        if args.bootstrap_port == args.port and args.port != 0:
            yield f"--bootstrap-port {args.bootstrap_port}: the same port as --port; the bootstrap server needs its own"
        yield port_problem("--bootstrap-port", args.host, args.bootstrap_port)


def listener_problem(args: argparse.Namespace) -> str | None:
    """The router's or the standalone bootstrap server's command line: its port (unless it listens on a unix
    socket), and its read timeouts."""
    on_port = getattr(args, "uds", None) is None
    return first((port_problem("--port", args.host, args.port) if on_port else None, _read_timeouts_problem(args)))


def _read_timeouts_problem(args: argparse.Namespace) -> str | None:
    try:
        read_timeouts_from_args(args)
    except ValueError as exc:
        return str(exc)
    return None


def _secret_problem(args: argparse.Namespace) -> str | None:
    from fsm_pd.transport import SecretError, parse_secret, secret_from_env

    try:
        parse_secret(args.side_channel_secret) if args.side_channel_secret else secret_from_env()
    except SecretError as exc:
        return str(exc)
    return None
