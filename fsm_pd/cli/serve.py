"""``fsm-pd serve --role ROLE``: run one node. Its role's flags (``serve_flags.py``) parsed, it loads the model,
builds the engine, prepares its programs on a start-up thread and serves HTTP until it is drained.

What a start waits on goes side by side (``side_by_side.py``): the devices open and the model is read on threads of
their own while the main thread imports the server and builds the engine, and the programs are prepared from the
weights' shapes; the node waits for the weights only before it says it is ready.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from fsm_pd.cli.checks import listener_problem, node_problem
from fsm_pd.cli.flag_values import one_line_errors
from fsm_pd.cli.flags import (
    DEADLINE_FLAGS,
    ROLES,
    SERVE_HELP,
    node_parser,
    role_parser,
    split_role,
)
from fsm_pd.net.http_protocol import read_timeouts_from_args
from fsm_pd.runtime.process_exit import exit_now, on_exit


def ask_for_host_devices(tp: int, environ=os.environ) -> None:
    """Make jax's CPU platform offer at least ``tp`` devices: ``--xla_force_host_platform_device_count`` in
    ``XLA_FLAGS``, unless it already asks for as many. It must be set before jax creates its CPU client, so call
    this before anything imports jax. It concerns the host platform only: on a TPU or GPU host the mesh takes the
    accelerators, and the flag changes nothing there."""
    flag = "--xla_force_host_platform_device_count"
    flags = environ.get("XLA_FLAGS", "").split()
    asked = [f for f in flags if f.startswith(flag + "=")]
    if asked and int(asked[-1].split("=", 1)[1]) >= tp:
        return
    environ["XLA_FLAGS"] = " ".join([f for f in flags if not f.startswith(flag + "=")] + [f"{flag}={tp}"])
    if "jax" in sys.modules:
        logging.getLogger("fsm_pd.serve").warning("jax was imported before --tp could ask for %d host devices", tp)


def ask_for_host_buffer(args: argparse.Namespace, role: str) -> None:
    """Before jax opens a TPU: libtpu's host buffer sized for what this node copies through it, unless the environment
    names a size (``runtime/tpu_host_buffer.py``: libtpu's default of 4 GiB took 5.7 s to open on the v5e host, 1 GiB
    2.6 s, 256 MiB 1.2 s; the open holds every thread of the start meanwhile). A colocated node, or a pd node whose
    handoff keeps the KV on the devices (``pool``, ``device``), copies only its weights; any other node may stage KV
    through the host too, so it takes the default."""
    from fsm_pd.cli.flags import expected_platform, resolve_dtype
    from fsm_pd.cli.pd_flags import pd_backend
    from fsm_pd.runtime.tpu_host_buffer import SIZE_ENV, ask_for_buffer

    def largest_bytes() -> int | None:
        if not (role == "colocated" or (role == "pd" and pd_backend(args) in ("pool", "device"))):
            return None
        from fsm_pd.model.shapes_on_disk import largest_array

        elements = largest_array(args.model)
        return None if elements is None else elements * (4 if resolve_dtype(args.dtype, "tpu") == "float32" else 2)

    asked = ask_for_buffer(expected_platform(), largest_bytes=largest_bytes)
    if asked is not None:
        logging.getLogger("fsm_pd.serve").info("libtpu's premapped host buffer: %d MiB (%s; set it to choose)",
                                               asked >> 20, SIZE_ENV)


def serve_main(argv: Sequence[str]) -> int:
    """Parse and check the command line of ``--role``'s process, all before anything heavy is imported: a refused
    value, a port already taken or a path that cannot be written ends it in a second with one line and status 2
    (``serve_flags``, ``serve_checks``); then run it."""
    role, _ = split_role(argv)
    if role is None:
        help_parser = argparse.ArgumentParser(prog="fsm-pd serve", description=SERVE_HELP,
                                              formatter_class=argparse.RawDescriptionHelpFormatter)
        help_parser.add_argument("--role", choices=ROLES, required=True, help="which node to run")
        one_line_errors(help_parser).parse_args(argv)  # prints help for -h, or the missing --role error
        return 2
    if role not in ROLES:
        return _refuse(f"argument --role: invalid choice: {role!r} (choose from {', '.join(ROLES)})")
    if role == "bootstrap":
        from fsm_pd.bootstrap.__main__ import add_arguments, serve

        parser = one_line_errors(argparse.ArgumentParser(prog="fsm-pd serve"))
        parser.add_argument("--role", choices=ROLES, required=True)
        add_arguments(parser)
        args = parser.parse_args(argv)
        return _refuse(problem) if (problem := listener_problem(args)) else serve(args)
    if role == "router":
        if (refused := router_socket_problem(argv)) is not None:  # before the router's modules, which import jax
            return _refuse(refused)
        from fsm_pd.router.app import router_main

        parser, words = role_parser(argv)
        if problem := listener_problem(parser.parse_args(words)):
            return _refuse(problem)
        router_main(words, parser)
        return 0
    parser = node_parser(role)
    args = parser.parse_args(argv)
    if (refused := check_unix_sockets(args)) is not None:  # before the model loads: one line, exit 2
        return _refuse(refused)
    if role in ("prefill", "decode") and args.uds is None:
        from fsm_pd.transport.addresses import WildcardAddress, advertised_host

        try:
            advertised_host(args.host, args.advertise_host)
        except WildcardAddress as exc:
            parser.error(str(exc))  # before the model loads: exit 2 with the one line
    if problem := node_problem(args):
        return _refuse(problem)
    from fsm_pd.net.http_server import log_to_stderr

    log_to_stderr(args.log_level)
    from fsm_pd.runtime.stack_samples import start_from_env

    start_from_env()  # FSM_PD_STACK_SAMPLES=PATH: where this process's threads spend their time
    if args.log_level != "debug":
        quiet_absent_backends()
    if args.tp > 1:
        ask_for_host_devices(args.tp)
    ask_for_host_buffer(args, role)
    from fsm_pd.cli.side_by_side import DeviceOpening, read_model_meanwhile

    opening = DeviceOpening()
    reading = read_model_meanwhile(args)
    if role == "pd":
        from fsm_pd.cli.serve_pd import run_pd

        return run_pd(args, opening, reading)
    return run_node(args, opening, reading)


def check_unix_sockets(args: argparse.Namespace) -> str | None:
    """Why a node started with ``--uds`` cannot listen where it would (a path past Linux's limit, a transfer backend
    that needs TCP), or None."""
    if args.uds is None:
        return None
    from fsm_pd.net.unix_sockets import UnixPathError, check_path, check_unix_backend, node_socket_paths

    try:
        for what, path in node_socket_paths(args.role, args.uds, getattr(args, "bootstrap_uds", None)).items():
            check_path(path, what)
        if args.role in ("prefill", "decode"):
            check_unix_backend(args.transfer_backend)
    except (UnixPathError, ValueError) as exc:
        return str(exc)
    return None


def router_socket_problem(argv: Sequence[str]) -> str | None:
    """Why the router's ``--uds`` path cannot be bound (past Linux's limit), read from its words alone: the router's
    own parser comes with its modules, which import jax, and on a TPU host importing jax prints a warning, so a
    refusal checked there is no longer one line."""
    words = argparse.ArgumentParser(add_help=False)
    words.add_argument("--uds", default=None)
    uds = words.parse_known_args(list(argv))[0].uds
    if uds is None:
        return None
    from fsm_pd.net.unix_sockets import UnixPathError, check_path

    try:
        check_path(uds, "--uds")
    except UnixPathError as exc:
        return str(exc)
    return None


def quiet_absent_backends() -> None:
    """Drop jax's INFO line about each accelerator backend it cannot start ("Unable to initialize backend 'tpu':
    ... libtpu.so ...", on every start of a CPU host): an absent accelerator is not news. A backend that fails for
    another reason still warns, and ``--log-level debug`` shows the lines."""
    def keep(record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.INFO and record.getMessage().startswith("Unable to initialize backend"))

    logging.getLogger("jax._src.xla_bridge").addFilter(keep)


def _refuse(problem: str) -> int:
    print(f"fsm-pd serve: error: {problem}", file=sys.stderr)
    return 2


def run_node(args: argparse.Namespace, opening, reading) -> int:
    """``opening``, ``reading``: the devices opening and the model being read (``side_by_side.py``)."""
    from fsm_pd.serving.startup import Startup

    startup = Startup()  # timed from the process's start: the interpreter and the imports below count
    from fsm_pd.cli.side_by_side import start_model, weights_in
    from fsm_pd.model import compiles

    startup.record("imports", startup.since_start())
    compiles.install()
    try:
        model = start_model(args, startup, opening, reading)
    except (FileNotFoundError, ValueError) as exc:  # missing file or package, unsupported or corrupt checkpoint,
        print(f"fsm-pd serve: cannot load model {args.model!r}: {exc}", file=sys.stderr)  # too few devices for --tp
        return 2
    if model.tp is not None:
        logging.getLogger("fsm_pd.serve").info("tensor parallel: %s", model.tp.describe())
    from fsm_pd.net.unix_sockets import TcpRefused

    try:
        with startup.phase("engine"):
            engine = build_engine(args, model, reading)
    except TcpRefused as exc:  # a host that allows no TCP: say so, where libzmq would have aborted the process
        print(f"fsm-pd serve: {exc}", file=sys.stderr)
        return 2
    if hasattr(engine, "manager"):  # finished rooms move to archives (--journal-keep, --journal-max-rows)
        from fsm_pd.store.retention import attach_from_args

        try:
            attach_from_args(engine.manager.journal, args)
        except ValueError as exc:
            engine.close()
            print(f"fsm-pd serve: {exc}", file=sys.stderr)
            return 2
    from fsm_pd.net.unix_sockets import remove_listener_files

    on_exit(remove_listener_files)  # a failed start-up ends the process at once: --uds's socket file goes too
    # The programs are prepared from here on, while this thread imports and builds the HTTP app: on a TPU the
    # server's imports (fastapi's models, mostly) came after the chip's open and held ready back by a second.
    # Ready waits for the app as for the weights.
    app_built = threading.Event()
    threading.Thread(target=prepare_programs, args=({engine: startup}, args.skip_server_warmup,
                                                    lambda: app_built.is_set() and app.state.drain.in_flight > 0,
                                                    lambda: weights_in(model, [startup], reading), app_built),
                     name="start-up", daemon=True).start()
    with startup.phase("imports"):
        from fsm_pd.api import create_app
        from fsm_pd.api.drain import serve_draining
        from fsm_pd.api.runner import WaitDeadlines
        from fsm_pd.runtime.gc_policy import apply_serving_gc_policy
    wait = WaitDeadlines(args.first_token_timeout_secs, args.token_idle_timeout_secs)  # positive: serve_flags
    app = create_app(engine, model.tokenizer, api_key=args.api_key, model_name=args.served_model_name or args.model,
                     model_path=args.model,
                     bootstrap_port=None if args.uds else getattr(args, "bootstrap_port", None),
                     drain_timeout_s=args.drain_timeout_secs, startup=startup, wait=wait,
                     max_body_bytes=args.max_request_bytes)
    apply_serving_gc_policy()
    app_built.set()
    try:
        serve_draining(app, args.host, args.port, log_level=args.log_level,
                       read_timeouts=read_timeouts_from_args(args), uds=args.uds)
    finally:
        logging.getLogger("fsm_pd.serve").info("closing the engine and its journal")
        engine.close()
    logging.getLogger("fsm_pd.serve").info("stopped cleanly")
    exit_now(0)


def prepare_programs(starts: dict, skip: bool, busy, weights=lambda: None, app_built: threading.Event | None = None,
                     more=None) -> None:
    """The start-up thread of a node (``starts``: {engine: its ``Startup``}) or of ``--role pd`` (both engines, which
    share one pool and so one set of programs: the second warm-up finds the first's): prepare the programs any
    request needs (``warmup.warm_up``), wait for the weights (``weights()``: they load meanwhile) and for the app
    that will serve (``app_built``: the main thread imports and builds it meanwhile), mark every engine
    ready at once, then compile the rest in the background while no request is in flight (``busy``). ``more``: a
    call that waits for engines still being built and returns them the same way, warmed up after those of
    ``starts`` (``--role pd`` starts this thread once its decode engine exists and builds the prefill engine
    meanwhile); the first of them is the process's, whose start-up the log line tells. A failure here leaves a
    process that can never serve: it exits 1."""
    from fsm_pd.model import compiles
    from fsm_pd.runtime.gc_policy import freeze_survivors
    from fsm_pd.serving.warmup import compile_rest, warm_up

    log = logging.getLogger("fsm_pd.serve")
    first = next(iter(starts.values()))
    try:
        if not skip:
            for engine, startup in starts.items():
                with startup.phase("programs"):
                    warm_up(engine, progress=True, startup=startup)
        if more is not None:
            later = more()
            first = next(iter(later.values()), first)
            for engine, startup in later.items() if not skip else ():
                with startup.phase("programs"):
                    warm_up(engine, progress=True, startup=startup)
            for startup in starts.values():  # the earlier warm-ups, most of the work: the process's phase too
                if (span := startup.timeline().get("programs")) is not None:
                    first.record("programs", startup.status()["phases"]["programs"], startup.started_at + span[0])
            starts = {**later, **starts}
        weights()
        if app_built is not None:
            app_built.wait()
        compiles.serving()
        costs = {kind: {**vars(cost), "seconds": round(cost.seconds, 3)} for kind, cost in compiles.costs().items()}
        freeze_survivors()  # the ready set's programs live as long as the node: out of the full collections' way
        for startup in starts.values():
            startup.mark_ready(costs)
        phases, spans = first.status()["phases"], first.timeline()
        log.info("ready %.1f s after the process started (%s%s)", first.ready_after,
                 ", ".join(f"{name} {seconds:.1f} s [{spans[name][0]:.1f}-{spans[name][1]:.1f}]"
                           for name, seconds in phases.items()),
                 "; the device and the weights on threads of their own, beside the others" if "model" in phases
                 else "; the device on a thread of its own, beside the imports")
        if skip:
            for startup in starts.values():
                startup.background_done({"skipped": True})
        else:  # one engine's rest after the other's: two compiling threads would only contend with the requests
            pending = list(starts.items())

            def next_rest(report: dict | None = None, done=None) -> None:
                if done is not None:
                    done.background_done(report)
                if pending:
                    engine, startup = pending.pop(0)
                    compile_rest(engine, busy=busy, on_done=lambda r, s=startup: next_rest(r, s))
                elif done is not None:
                    freeze_survivors()  # and so do the background's

            next_rest()
    except BaseException as exc:  # noqa: BLE001 - whatever it was, the process cannot serve: say so and exit
        for startup in starts.values():
            startup.mark_failed(f"{type(exc).__name__}: {exc}")
        log.exception("start-up failed; exiting")
        for engine in starts:
            engine.close()
        exit_now(1)


def node_secret(args: argparse.Namespace) -> bytes | None:
    """A prefill or decode node's side-channel secret (``--side-channel-secret``, else the environment's); raises
    ``SecretError`` when there is none or it is malformed. None for a colocated node, which has no side channel."""
    if args.role == "colocated":
        return None
    from fsm_pd.transport import parse_secret, secret_from_env

    return parse_secret(args.side_channel_secret) if args.side_channel_secret else secret_from_env()


def build_engine(args: argparse.Namespace, model, reading=None):
    """The role's engine on ``model``; its pool's size from ``--num-pages``, or from the device's free memory
    (``pool_sizes.node_pages``; ``reading``: the model being read, whose weights may still be on their way)."""
    from fsm_pd.cli.pool_sizes import node_pages

    num_pages, how = node_pages(args, model, reading)
    logging.getLogger("fsm_pd.serve").info("KV pool: %d pages of %d tokens (%s)", num_pages, args.page_size, how)
    sizes = {"num_pages": num_pages, "page_size": args.page_size}
    if args.role == "colocated":
        from fsm_pd.serving.colocated_engine import ColocatedEngine

        return ColocatedEngine(model, radix_cache=not args.disable_radix_cache,
                               chunked_prefill_size=args.chunked_prefill_size,
                               prefill_chunk_steps=args.prefill_chunk_steps,
                               decode_steps_per_dispatch=args.decode_steps_per_dispatch, **sizes)
    secret = node_secret(args)
    journal = args.journal or str(Path("journals") / f"{args.node_id}.db")
    if "://" not in journal:
        Path(journal).parent.mkdir(parents=True, exist_ok=True)
    deadlines = {t: getattr(args, t) for t in DEADLINE_FLAGS if getattr(args, t, None) is not None}
    common = dict(node_id=args.node_id, journal=journal, secret=secret, backend=args.transfer_backend,
                  deadlines=deadlines, host=args.host, advertise_host=args.advertise_host,
                  kv_checksum=args.kv_checksum == "on", uds=args.uds, durability=args.journal_durability,
                  decode_steps_per_dispatch=args.decode_steps_per_dispatch, **sizes)
    if args.role == "prefill":
        from fsm_pd.net.unix_sockets import node_socket
        from fsm_pd.serving.prefill_engine import PrefillEngine

        bootstrap_uds = (args.bootstrap_uds or node_socket(args.uds, "bootstrap")) if args.uds else None
        return PrefillEngine(model, bootstrap_port=args.bootstrap_port, bootstrap_token=args.bootstrap_token,
                             bootstrap_uds=bootstrap_uds,
                             radix_cache=not args.disable_radix_cache, chunked_prefill_size=args.chunked_prefill_size,
                             chunk_transfers=not args.disable_chunk_transfers, serve_local=args.serve_local,
                             prefill_chunk_steps=args.prefill_chunk_steps, **common)
    from fsm_pd.serving.decode_engine import DecodeEngine

    return DecodeEngine(model, on_transfer_failure=args.on_transfer_failure,
                        radix_cache=args.disaggregation_decode_enable_radix_cache,
                        prefill_chunk_steps=args.prefill_chunk_steps, **common)


if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:]))
