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


def cmd_serve(args: argparse.Namespace) -> int:
    from fsm_pd.bootstrap.__main__ import serve as serve_bootstrap

    return serve_bootstrap(args)


def build_parser() -> argparse.ArgumentParser:
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

    from fsm_pd.bootstrap.__main__ import DESCRIPTION as BOOTSTRAP_DESCRIPTION
    from fsm_pd.bootstrap.__main__ import EPILOG as BOOTSTRAP_EPILOG
    from fsm_pd.bootstrap.__main__ import add_arguments as add_bootstrap_arguments

    serve = sub.add_parser(
        "serve", help="run one node of a PD deployment",
        description="Run one node of a prefill/decode deployment. Roles served today: bootstrap (the standalone "
                    "bootstrap server; a prefill node also runs one in-process by default).\n\n"
                    + BOOTSTRAP_DESCRIPTION,
        epilog=BOOTSTRAP_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--role", required=True, choices=("bootstrap",), help="which node to run")
    add_bootstrap_arguments(serve)
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
