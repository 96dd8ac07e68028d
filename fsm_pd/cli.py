"""``fsm-pd``: the command line. Each subcommand parses its flags and calls one function elsewhere."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

EXIT_OK, EXIT_UNREADABLE, EXIT_DIVERGED = 0, 2, 3


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def cmd_simulate(args: argparse.Namespace) -> int:
    from fsm_pd.sim import SimConfig, simulate

    journal_dir = Path(args.journal_dir)
    for name in ("prefill.db", "decode.db"):
        for suffix in ("", "-wal", "-shm"):
            (journal_dir / (name + suffix)).unlink(missing_ok=True)  # a rerun starts a fresh history
    config = SimConfig(requests=args.requests, seed=args.seed, fault_rate=args.fault_rate)
    summary = simulate(config, journal_dir, durability=args.durability)
    summary["journals"] = [str(journal_dir / "prefill.db"), str(journal_dir / "decode.db")]
    print(json.dumps(summary, indent=1))
    return EXIT_OK


def cmd_replay(args: argparse.Namespace) -> int:
    from rich.console import Console

    from fsm_pd.report import render_html, render_table, to_json
    from fsm_pd.store import JournalError, read_journal, replay

    rows = []
    for path in args.journals:
        try:
            rows.extend(read_journal(path))
        except JournalError as exc:
            print(f"fsm-pd replay: {exc}", file=sys.stderr)
            return EXIT_UNREADABLE
    result = replay(rows)
    rooms = result.rooms
    if args.room is not None:
        rooms = [r for r in rooms if r.room == args.room]
        if not rooms:
            print(f"fsm-pd replay: room {args.room} is in none of {', '.join(args.journals)}", file=sys.stderr)
            return EXIT_UNREADABLE
    if args.failed:
        failed_rooms = {r.room for r in rooms if r.failed or not r.consistent}
        rooms = [r for r in rooms if r.room in failed_rooms]

    out = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout  # noqa: SIM115
    try:
        if args.format == "json":
            out.write(to_json(result, rooms, args.journals) + "\n")
        elif args.format == "html":
            out.write(render_html(result, rooms, args.journals))
        else:
            console = Console(file=out, width=160 if not out.isatty() else None)
            render_table(result, rooms, args.journals, console)
    finally:
        if out is not sys.stdout:
            out.close()
    for d in result.divergences:
        print(f"DIVERGED {d.describe()}", file=sys.stderr)
    return EXIT_OK if result.consistent else EXIT_DIVERGED


def cmd_launch(args: argparse.Namespace) -> int:
    from rich.console import Console

    from fsm_pd.launch import launch

    return launch(prefill=args.prefill, decode=args.decode, port=args.port, model=args.model,
                  backend=args.transfer_backend, journal_dir=Path(args.journal_dir), extra=["--dtype", args.dtype],
                  console=Console(), warmup=args.warmup)


def build_parser() -> argparse.ArgumentParser:
    from fsm_pd.serve_cli import add_model_flags

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
    sim.add_argument("--requests", type=_positive_int, default=100, help="number of requests (default 100)")
    sim.add_argument("--seed", type=int, default=0, help="RNG seed: the same seed gives the same history")
    sim.add_argument("--fault-rate", type=_fraction, default=0.0,
                     help="0..1: scales dropped/duplicated/delayed messages, failed pulls and bootstrap lookups, "
                          "client aborts and a prefill crash (default 0: everything succeeds)")
    sim.add_argument("--journal-dir", default="sim", help="where to write prefill.db and decode.db (default ./sim)")
    sim.add_argument("--durability", choices=("full", "normal", "off"), default="normal",
                     help="journal fsync policy (default normal)")
    sim.set_defaults(func=cmd_simulate)

    rep = sub.add_parser(
        "replay", help="re-fire journaled transitions through the tables and explain each room",
        description="Read one or more journals (a prefill and a decode journal are merged by room), replay every "
                    "room through the same transition tables, and report final states, failure reasons and time "
                    "spent in each state. Exit 0 when every room replays consistently, 3 when any diverges, "
                    "2 when a journal cannot be read.",
    )
    rep.add_argument("journals", nargs="+", metavar="JOURNAL", help="journal files (SQLite) or SQLAlchemy URLs")
    rep.add_argument("--room", type=int, help="only this room (shows both sides on one timeline)")
    rep.add_argument("--failed", action="store_true", help="only rooms where a side failed (or that diverge)")
    rep.add_argument("--format", choices=("table", "json", "html"), default="table", help="output format")
    rep.add_argument("--out", help="write to this file instead of standard output")
    rep.set_defaults(func=cmd_replay)

    sub.add_parser(
        "serve", add_help=False, help="run one node: --role prefill|decode|colocated|router|bootstrap",
        description="Run one node of a PD deployment; `fsm-pd serve --role ROLE --help` lists that role's flags.",
    )

    launch = sub.add_parser(
        "launch", help="start a local PD cluster (prefill, decode, router) and serve until Ctrl-C",
        description="Start N prefill nodes (each with its bootstrap server), M decode nodes and the built-in router "
                    "on 127.0.0.1, print the router's URL, and serve until Ctrl-C or SIGTERM; then stop every "
                    "process started here. Logs and journals go to --journal-dir.",
    )
    launch.add_argument("--prefill", type=_positive_int, default=1, help="prefill nodes (default 1)")
    launch.add_argument("--decode", type=_positive_int, default=1, help="decode nodes (default 1)")
    launch.add_argument("--port", type=int, default=30000, help="the router's port (default 30000)")
    add_model_flags(launch)
    launch.add_argument("--transfer-backend", default="tcp", help="tcp | zmq | jax (default tcp)")
    launch.add_argument("--journal-dir", default="pd-cluster", help="journals and logs (default ./pd-cluster)")
    launch.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="skip the first chat request that launch sends through the router once every node is "
                             "up (it compiles what a short chat needs, and prints the answer and the time it took)")
    launch.set_defaults(func=cmd_launch)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # each role has its own flags: serve_cli parses them (argparse cannot nest that)
        from fsm_pd.serve_cli import serve_main

        return serve_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
