"""``fsm-pd``: the command line. Each subcommand parses its flags and calls one function elsewhere."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from fsm_pd.cli.pd_flags import PD_POLICIES  # the router's --pd-policy, jax- and fastapi-free

EXIT_OK, EXIT_UNREADABLE, EXIT_DIVERGED = 0, 2, 3
EXIT_PIPE_CLOSED = 141  # what a shell reports for a process SIGPIPE ended: the reader went away (replay ... | head)


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def cmd_simulate(args: argparse.Namespace) -> int:
    from fsm_pd.sim import SimConfig, simulate

    journal_dir = Path(args.journal_dir)
    for name in ("prefill.db", "decode.db"):
        for suffix in ("", "-wal", "-shm"):
            (journal_dir / (name + suffix)).unlink(missing_ok=True)  # a rerun starts a fresh history
    config = SimConfig(requests=args.requests, seed=args.seed, fault_rate=args.fault_rate,
                       shared_pool=1.0 if args.shared_pool else 0.0)
    summary = simulate(config, journal_dir, durability=args.durability)
    summary["journals"] = [str(journal_dir / "prefill.db"), str(journal_dir / "decode.db")]
    print(json.dumps(summary, indent=1))
    return EXIT_OK


def cmd_replay(args: argparse.Namespace) -> int:
    from fsm_pd.store import JournalError
    from fsm_pd.store.reader import open_with_archives

    try:
        readers, missing = open_with_archives(args.journals)
    except JournalError as exc:
        print(f"fsm-pd replay: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    files = [r.name for r in readers]
    print(f"fsm-pd replay: reading {', '.join(files)}", file=sys.stderr)
    for name in missing:
        print(f"fsm-pd replay: archive {name} is named by a journal but missing; its rooms are not shown",
              file=sys.stderr)
    out = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout  # noqa: SIM115
    try:
        if args.request is not None:
            return _replay_request(args, readers, files, out)
        return _replay_rooms(args, readers, files, out)
    except JournalError as exc:
        print(f"fsm-pd replay: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    finally:
        if out is not sys.stdout:
            out.close()
        for reader in readers:
            reader.close()


def _console(out):
    from rich.console import Console

    return Console(file=out, width=160 if not out.isatty() else None)


def _replay_rooms(args: argparse.Namespace, readers, files: list[str], out) -> int:
    """Every room (or one), streamed room by room in room order from every journal and archive at once."""
    from fsm_pd.report import HtmlWriter, JsonWriter, TableWriter
    from fsm_pd.store.reader import merged_sides
    from fsm_pd.store.replay import Summary, by_room, replay_sides

    rooms = by_room(replay_sides(merged_sides([r.sides(args.room) for r in readers])))
    writer = {"json": JsonWriter, "html": HtmlWriter}.get(args.format)
    writer = writer(out, files) if writer else TableWriter(_console(out), files)
    summary = Summary()
    for sides in rooms:
        summary.count(sides)
        if args.failed and not any(s.failed or not s.consistent for s in sides):
            continue
        writer.room(sides)
    if args.room is not None and summary.rooms == 0:
        print(f"fsm-pd replay: room {args.room} is in none of {', '.join(files)}", file=sys.stderr)
        return EXIT_UNREADABLE
    writer.close(summary)
    for d in summary.divergences:
        print(f"DIVERGED {d.describe()}", file=sys.stderr)
    return EXIT_OK if summary.consistent else EXIT_DIVERGED


def _replay_request(args: argparse.Namespace, readers, files: list[str], out) -> int:
    """Every attempt of one request: the rooms journaled with its rid, on any node, on one timeline."""
    from fsm_pd.report import render_request, request_json
    from fsm_pd.store.reader import merged_sides
    from fsm_pd.store.replay import replay_sides
    from fsm_pd.store.request import attempts, journal_rids

    for rid in journal_rids(args.request):  # the rid, or the id of an OpenAI answer (chatcmpl-RID)
        chain = attempts(replay_sides(merged_sides([iter(r.request_sides(rid)) for r in readers])))
        if chain:
            if rid != args.request:
                print(f"fsm-pd replay: request {args.request} is journaled as rid {rid}", file=sys.stderr)
            break
    if not chain:
        old = [r.name for r in readers if r.version == "1"]
        hint = f" ({', '.join(old)} predate request ids: schema version 1)" if old else ""
        print(f"fsm-pd replay: request {args.request} is in none of {', '.join(files)}{hint}", file=sys.stderr)
        return EXIT_UNREADABLE
    if args.format == "json":
        out.write(request_json(args.request, chain, files) + "\n")
    elif args.format == "html":
        from fsm_pd.report import HtmlWriter
        from fsm_pd.store.replay import Summary

        writer, summary = HtmlWriter(out, files), Summary()
        for attempt in chain:
            summary.count(attempt.sides)
            writer.room(attempt.sides)
        writer.close(summary)
    else:
        render_request(args.request, chain, files, _console(out))
    divergences = [s.divergence for a in chain for s in a.sides if s.divergence is not None]
    for d in divergences:
        print(f"DIVERGED {d.describe()}", file=sys.stderr)
    return EXIT_DIVERGED if divergences else EXIT_OK


def cmd_launch(args: argparse.Namespace) -> int:
    from rich.console import Console

    from fsm_pd.cli.flags import resolve_dtype, resolve_page_size
    from fsm_pd.cli.launch import launch

    # one dtype and one page size for every node, resolved here: nodes on a chip and on CPU cores must agree on the
    # pool's (a --node-arg --page-size after it wins)
    extra = ["--dtype", resolve_dtype(args.dtype), "--page-size", str(resolve_page_size(None)),
             "--kv-checksum", args.kv_checksum, *args.node_arg]
    limit = ["--max-request-bytes", str(args.max_request_bytes)] if args.max_request_bytes else []
    return launch(prefill=args.prefill, decode=args.decode, port=args.port, model=args.model,
                  backend=args.transfer_backend, journal_dir=Path(args.journal_dir), extra=[*extra, *limit],
                  console=Console(), warmup=args.warmup, prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
                  router_extra=[*limit, *router_extra(args)], uds=Path(args.uds) if args.uds else None,
                  prefill_extra=args.prefill_arg, decode_extra=args.decode_arg, layout=args.layout,
                  role_args=[*args.prefill_arg, *args.decode_arg, *args.router_arg])


def router_extra(args: argparse.Namespace) -> list[str]:
    """The router's own flags of a launch: ``--pd-policy`` (launch's own flag, for the router), then every
    ``--router-arg`` (which wins over it, being later)."""
    policy = [f"--pd-policy={args.pd_policy}"] if args.pd_policy is not None else []
    return [*policy, *args.router_arg]


def build_parser() -> argparse.ArgumentParser:
    from fsm_pd.cli.flag_values import one_line_errors, port, positive_int, transfer_backend
    from fsm_pd.cli.flags import add_model_flags
    from fsm_pd.cli.launch_layout import LAYOUTS
    from fsm_pd.net.body_limit import byte_count

    parser = argparse.ArgumentParser(
        prog="fsm-pd",
        description="Prefill/decode disaggregation for JAX; every KV handoff a journaled, replayable state machine.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sim = sub.add_parser(
        "simulate", help="run a deterministic prefill+decode simulation and write real journals",
        description="Run N requests through the real sender/receiver machines, effect interpreter and SQLite "
                    "journals, with a simulated network, data plane and virtual clock. The same seed gives the same "
                    "history. Prints a JSON summary; the journals go to DIR/prefill.db and DIR/decode.db.",
    )
    sim.add_argument("--requests", type=positive_int, default=100, help="number of requests (default 100)")
    sim.add_argument("--seed", type=int, default=0, help="RNG seed: the same seed gives the same history")
    sim.add_argument("--fault-rate", type=_fraction, default=0.0,
                     help="0..1: scales dropped/duplicated/delayed messages, failed pulls and bootstrap lookups, "
                          "client aborts and a prefill crash (default 0: everything succeeds)")
    sim.add_argument("--shared-pool", action="store_true",
                     help="run both roles as --role pd does on one set of devices: one process, one KV pool, and "
                          "handoffs that move page ownership (docs/simulation.md)")
    sim.add_argument("--journal-dir", default="sim", help="where to write prefill.db and decode.db (default ./sim)")
    sim.add_argument("--durability", choices=("full", "normal", "off"), default="normal",
                     help="journal fsync policy (default normal)")
    sim.set_defaults(func=cmd_simulate)

    rep = sub.add_parser(
        "replay", help="re-fire journaled transitions through the tables and explain each room",
        description="Read one or more journals (a prefill and a decode journal are merged by room), replay every "
                    "room through the same transition tables, and report final states, failure reasons and time "
                    "spent in each state. Rooms stream one at a time through the journals' room index, so memory "
                    "stays flat whatever their size. Exit 0 when every room replays consistently, 3 when any diverges, "
                    "2 when a journal cannot be read.",
    )
    rep.add_argument("journals", nargs="+", metavar="JOURNAL",
                     help="journal files (SQLite) or SQLAlchemy URLs; the archives they name (fsm-pd serve "
                          "--journal-keep) are read too, and every file read is listed on standard error")
    which = rep.add_mutually_exclusive_group()
    which.add_argument("--room", type=int, help="only this room (shows both sides on one timeline)")
    which.add_argument("--request", metavar="ID",
                       help="every attempt of this request (each a room, on any node: retries, migrations) on one "
                            "timeline: where each ran, state by state, why it failed, what came next. ID: the id "
                            "the client saw, an OpenAI answer's (chatcmpl-..., cmpl-...), a /generate answer's "
                            "meta_info.id or an error's error.rid")
    rep.add_argument("--failed", action="store_true", help="only rooms where a side failed (or that diverge)")
    rep.add_argument("--format", choices=("table", "json", "html"), default="table", help="output format")
    rep.add_argument("--out", help="write to this file instead of standard output")
    rep.set_defaults(func=cmd_replay)

    sub.add_parser(
        "serve", add_help=False, help="run one node: --role prefill|decode|colocated|router|bootstrap",
        description="Run one node of a PD deployment; `fsm-pd serve --role ROLE --help` lists that role's flags.",
    )

    launch = one_line_errors(sub.add_parser(
        "launch", help="start a local PD cluster (prefill, decode, router) and serve until Ctrl-C",
        description="Start N prefill nodes (each with its bootstrap server), M decode nodes and the built-in router "
                    "on 127.0.0.1, print the router's URL, and serve until Ctrl-C or SIGTERM; then stop every "
                    "process started here. A node that dies is reported and routed around while at least one prefill "
                    "and one decode node are alive. Logs and journals go to --journal-dir.",
    ), "fsm-pd launch")
    launch.add_argument("--prefill", type=positive_int, default=1, help="prefill nodes (default 1)")
    launch.add_argument("--decode", type=positive_int, default=1, help="decode nodes (default 1)")
    launch.add_argument("--port", type=port, default=30000,
                        help="the router's port, checked free before anything starts (default 30000)")
    launch.add_argument("--uds", default=None, metavar="DIR",
                        help="serve over unix sockets instead of TCP: every process listens on sockets in DIR and "
                             "opens no TCP socket; the router's API is DIR/router.sock (curl --unix-socket "
                             "DIR/router.sock http://localhost/v1/chat/completions ...; docs/operations.md, Serving "
                             "over unix sockets). Only the tcp and zmq transfer backends run over unix sockets")
    add_model_flags(launch)
    launch.add_argument("--transfer-backend", type=transfer_backend, default=None,
                        help="tcp | zmq | jax | a registered plugin (default tcp between nodes; one --role pd "
                             "process, --layout pd: its own, pool)")
    launch.add_argument("--layout", choices=LAYOUTS, default="auto",
                        help="nodes: a process per node and the router; pd: one `fsm-pd serve --role pd` process, a "
                             "prefill and a decode engine sharing the devices, one KV pool and handoffs that move "
                             "page ownership, listening where the router would (1 prefill, 1 decode, --tp 1, flags "
                             "through --node-arg only); auto (default): pd on a host whose accelerator one process at "
                             "a time may hold (a TPU's) when the cluster fits it, else nodes (docs/operations.md)")
    launch.add_argument("--prefill-tp", type=positive_int, default=1, metavar="N",
                        help="each prefill node's --tp: its model split over N devices (default 1)")
    launch.add_argument("--decode-tp", type=positive_int, default=1, metavar="N",
                        help="each decode node's --tp; may differ from --prefill-tp (default 1)")
    launch.add_argument("--kv-checksum", choices=("on", "off"), default="on",
                        help="each prefill and decode node's --kv-checksum: verify the KV of every handoff "
                             "(default on)")
    launch.add_argument("--node-arg", action="append", default=[], metavar="ARG",
                        help="pass ARG to every prefill and decode node's `fsm-pd serve` (repeatable; a flag with "
                             "a value as one word: --node-arg=--token-idle-timeout-secs=60; a flag only one role "
                             "takes goes with --prefill-arg or --decode-arg). Every command line is checked before "
                             "anything starts")
    launch.add_argument("--prefill-arg", action="append", default=[], metavar="ARG",
                        help="pass ARG to every prefill node alone (repeatable, as --node-arg: a flag only that role "
                             "takes, --prefill-arg=--disable-chunk-transfers)")
    launch.add_argument("--decode-arg", action="append", default=[], metavar="ARG",
                        help="pass ARG to every decode node alone (repeatable, as --node-arg: "
                             "--decode-arg=--on-transfer-failure=fail)")
    launch.add_argument("--pd-policy", choices=PD_POLICIES, default=None,
                        help="which requests the router sends through a prefill node (the router's --pd-policy): "
                             "auto, the default, only prompts long enough that a handoff pays (a short one is served "
                             "whole on a decode node); always: every request, classic PD; never: none "
                             "(docs/crossover.md)")
    launch.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                        help="pass ARG to the router's `fsm-pd serve --role router` (repeatable, as --node-arg: "
                             "--router-arg=--policy=cache_aware)")
    launch.add_argument("--max-request-bytes", type=byte_count, default=None, metavar="N",
                        help="a request body over N bytes is answered 413 at once, by the router and every node "
                             "(default: each node's from its model's context, 1 MiB plus 64 bytes a token, and the "
                             "router takes the smallest of its nodes')")
    launch.add_argument("--journal-dir", default="pd-cluster", help="journals and logs (default ./pd-cluster)")
    launch.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="skip the first chat request that launch sends through the router once every node is "
                             "up (it proves the whole path serves, and prints the answer and the time it took). "
                             "(Each node's own start-up compile is skipped by FSM_PD_SKIP_SERVER_WARMUP=1.)")
    launch.set_defaults(func=cmd_launch)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # each role has its own flags: cli.serve parses them (argparse cannot nest that)
        from fsm_pd.cli.serve import serve_main

        return serve_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:
        # whoever read our output stopped (| head): end quietly, as a command SIGPIPE ends, without a traceback;
        # standard output goes to /dev/null so that the interpreter's own flush at exit does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE_CLOSED


if __name__ == "__main__":
    sys.exit(main())
