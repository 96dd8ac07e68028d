"""Load bench: a colocated node against ``--role pd`` (policies auto, always, never) under streamed chats, over unix
sockets, so that it runs on a host that allows no TCP socket (a TPU VM; issue 48, point 7).

Each target is started alone, one after the other (one process at a time may hold the chip), from the same --model,
on a unix socket under --uds-dir (--tcp: on 127.0.0.1 instead); this bench waits for ``/health`` 200 and for its first
answered chat (both timed from the process's start: time to ready), warms it with one wave of every mix, then sends
each mix's --requests streamed chats (``/v1/chat/completions``, greedy, ``ignore_eos``), --streams at a time:

- prefill-heavy: prompts of about --long-tokens (900) tokens, 16 new tokens each;
- decode-heavy: prompts of about --short-tokens (30), 128 new;
- mixed: every third prompt long, the rest short, 48 new.

Prompts are digits behind a unique tag, sized for the model's tokenizer from the server's own counts
(``load_mixes.py``); every answer's ``usage`` must show the planned prompt tokens and exactly max_tokens new ones.

Per target and mix it reports output tok/s, req/s, TTFT and TPOT at p50 and p90, and goodput: requests per second
that met the SLO, which is derived from isolated latencies measured first on the colocated node (one stream, medians,
per mix and prompt kind): TTFT <= --ttft-scale (5) x the isolated TTFT and TPOT <= --tpot-scale (2) x the isolated
TPOT. Each pd target's figures are also given as ratios of colocated's, measured in the same run. It prints markdown
tables and writes --json PATH. It exits 1 when a request went unanswered or a token count was wrong.

    python bench/load.py [--model tiny|smollm2|PATH.gguf] [--targets colocated,pd-auto,pd-always,pd-never]
                         [--mixes prefill-heavy,decode-heavy,mixed] [--requests 48] [--streams 16] [--json PATH]
    python bench/load.py --quick          # the tiny model, 16 requests per mix: about a minute on a CPU

The processes it starts are stopped by PID (SIGTERM, then SIGKILL after a minute), on Ctrl-C and errors too.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
import load_client  # noqa: E402 - beside this script
import load_targets  # noqa: E402
from load_mixes import LONG, MIXES, SHORT, PromptPlan, chat, isolated_slo, ratios, request_body, summary  # noqa: E402

err = Console(stderr=True)
PHASE_TAGS = {"probe": 0, "warm": 100_000, "isolated": 200_000, "load": 300_000}  # tag ranges, one per phase
PROMPT_TOLERANCE = 2  # tokens an answer's prompt_tokens may differ from the plan (a tokenizer that groups digits)
PROBE_DIGITS = 200


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny (default), smollm2, or a .gguf file or HF directory")
    parser.add_argument("--targets", default=",".join(load_targets.TARGETS),
                        help=f"comma-separated, run in this order (default {','.join(load_targets.TARGETS)})")
    parser.add_argument("--mixes", default=",".join(MIXES), help=f"comma-separated (default {','.join(MIXES)})")
    parser.add_argument("--requests", type=int, default=None, help="requests per mix and target (default 48; 16 "
                                                                   "with --quick)")
    parser.add_argument("--streams", type=int, default=16, help="requests in flight at a time (default 16)")
    parser.add_argument("--isolated", type=int, default=None,
                        help="requests per mix and prompt kind sent one at a time for the SLO (default 5; 2 with "
                             "--quick)")
    parser.add_argument("--long-tokens", type=int, default=900, help="a long prompt's tokens (default 900)")
    parser.add_argument("--short-tokens", type=int, default=30,
                        help="a short prompt's tokens (default 30; at least the chat template's own)")
    parser.add_argument("--ttft-scale", type=float, default=5.0)
    parser.add_argument("--tpot-scale", type=float, default=2.0)
    parser.add_argument("--quick", action="store_true", help="the tiny model and fewer requests (CI)")
    parser.add_argument("--tcp", action="store_true", help="serve on 127.0.0.1 ports instead of unix sockets")
    parser.add_argument("--uds-dir", type=Path, default=None,
                        help="where the sockets, logs and journals go (default: a temporary directory, removed)")
    parser.add_argument("--node-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for every target's fsm-pd serve, repeatable "
                             "(--node-arg=--dtype=bfloat16)")
    parser.add_argument("--ready-timeout", type=float, default=900, help="seconds a start may take (default 900)")
    parser.add_argument("--request-timeout", type=float, default=600)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    if args.quick and args.model != "tiny":
        parser.error("--quick runs the tiny model")
    args.requests = args.requests or (16 if args.quick else 48)
    args.isolated = args.isolated or (2 if args.quick else 5)
    args.targets = [t for t in args.targets.split(",") if t]
    args.mixes = [m for m in args.mixes.split(",") if m]
    for name, known in (("targets", load_targets.TARGETS), ("mixes", MIXES)):
        unknown = [v for v in getattr(args, name) if v not in known]
        if unknown:
            parser.error(f"unknown {name}: {', '.join(unknown)} (known: {', '.join(known)})")
    return args


def plan_prompts(url: str, lengths: dict) -> PromptPlan:
    """Two probes (no digits, PROBE_DIGITS digits) read the template's overhead and the tokens per digit."""
    counts = []
    for i, digits in enumerate((0, PROBE_DIGITS)):
        response = load_client.whole_chat(url, request_body(chat(PHASE_TAGS["probe"] + i, digits, i), 1,
                                                            stream=False))
        response.raise_for_status()
        counts.append(response.json()["usage"]["prompt_tokens"])
    return PromptPlan(counts[0], (counts[1] - counts[0]) / PROBE_DIGITS, lengths)


def requests_for(phase: str, mix_name: str, count: int, plan: PromptPlan) -> list[tuple[str, dict]]:
    """``count`` requests of a mix, the same on every target; tags unique per phase and mix (no shared prefix)."""
    mix = MIXES[mix_name]
    base = PHASE_TAGS[phase] + list(MIXES).index(mix_name) * 10_000
    return [(kind, request_body(chat(base + i, plan.digits(kind), base + i), mix.max_tokens))
            for i, kind in enumerate(mix.kinds(count))]


def isolated_requests(mix_name: str, count: int, plan: PromptPlan) -> list[tuple[str, dict]]:
    mix = MIXES[mix_name]
    base = PHASE_TAGS["isolated"] + list(MIXES).index(mix_name) * 10_000
    return [(kind, request_body(chat(base + k * 1000 + i, plan.digits(kind), base + k * 1000 + i), mix.max_tokens))
            for k, kind in enumerate(mix.kinds_present()) for i in range(count)]


def check(records: list[dict], mix_name: str, plan: PromptPlan, where: str) -> list[str]:
    """What went wrong in a phase's answers: a request not answered in full, a wrong count of new tokens (ignore_eos:
    exactly max_tokens) or of prompt tokens (the plan's)."""
    problems = []
    want_new = MIXES[mix_name].max_tokens
    for i, r in enumerate(records):
        label = f"{where}, {mix_name} request {i} ({r['kind']})"
        if not r["ok"]:
            problems.append(f"{label}: not answered: status {r['status']}, {r['error']}")
            continue
        if r["completion_tokens"] != want_new:
            problems.append(f"{label}: {r['completion_tokens']} new tokens, asked for {want_new} with ignore_eos")
        expected = plan.expected_tokens(r["kind"])
        if abs(r["prompt_tokens"] - expected) > PROMPT_TOLERANCE:
            problems.append(f"{label}: {r['prompt_tokens']} prompt tokens, planned {expected}")
    return problems


def run_target(t: load_targets.Target, args, state: dict, result: dict) -> None:
    """Start, time to ready, warm, (isolated latencies, once), the mixes: the target's figures go into ``result`` as
    they come (a failure halfway keeps what came before). ``state`` carries the prompt plan and the SLO from the
    first target that made them, and the problems found."""
    load_targets.start(t)
    result |= {"argv": t.argv[1:], "pid": t.proc.pid}
    err.print(f"{t.name}: started, pid {t.proc.pid}")
    result["health_s"] = load_targets.wait_health(t, args.ready_timeout)
    first = request_body(chat(PHASE_TAGS["probe"] + 9, 8, 9), 4, stream=False)
    result["first_answer_s"] = load_targets.wait_first_answer(t, first, args.ready_timeout)
    result["refused_first_chats"] = t.refused_first_chats
    err.print(f"{t.name}: /health 200 at {result['health_s']:.1f} s, first answer at {result['first_answer_s']:.1f} s")
    if state.get("plan") is None:
        state["plan"] = plan_prompts(t.url, {LONG: args.long_tokens, SHORT: args.short_tokens})
        err.print(f"prompt plan: {state['plan']}")
    plan = state["plan"]
    clock = time.monotonic()
    for mix in args.mixes:  # one wave of each mix: its batch shapes compile here, not during the load
        records, _ = load_client.closed_loop(t.url, requests_for("warm", mix, min(args.streams, args.requests), plan),
                                             args.streams, args.request_timeout)
        state["problems"] += check(records, mix, plan, f"{t.name} warm-up")
    result["warm_s"], clock = time.monotonic() - clock, time.monotonic()
    if state.get("slo") is None:
        slo = {}
        for mix in args.mixes:
            records, _ = load_client.closed_loop(t.url, isolated_requests(mix, args.isolated, plan), 1,
                                                 args.request_timeout)
            state["problems"] += check(records, mix, plan, f"{t.name} isolated")
            slo[mix] = isolated_slo(records, args.ttft_scale, args.tpot_scale)
        state["slo"], state["slo_from"] = slo, t.name
        result["isolated_s"] = time.monotonic() - clock
    before = load_targets.compiles(t.url)
    result["mixes"] = {}
    for mix in args.mixes:
        records, took = load_client.closed_loop(t.url, requests_for("load", mix, args.requests, plan),
                                                args.streams, args.request_timeout)
        state["problems"] += check(records, mix, plan, t.name)
        result["mixes"][mix] = summary(records, took, state["slo"][mix]) | {"records": records}
        err.print(f"{t.name} {mix}: {result['mixes'][mix]['output_tok_s']:.0f} output tok/s")
    after = load_targets.compiles(t.url)
    result["compiles"], result["compiled_during_load"] = after, load_targets.compiled_since(before, after)


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown(report: dict) -> str:
    lines = [f"model {report['model']}, {report['streams']} streams, {report['requests']} requests per mix, "
             f"over {'TCP' if report['tcp'] else 'unix sockets'}; SLO from {report['slo_from']} alone: "
             f"TTFT <= {report['ttft_scale']:g}x, TPOT <= {report['tpot_scale']:g}x the isolated median", "",
             "| target | mix | output tok/s | req/s | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) | goodput req/s "
             "(met) | tok/s vs colocated | goodput vs colocated | TPOT p90 vs colocated |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, result in report["targets"].items():
        for mix, s in result.get("mixes", {}).items():
            r = report["ratios"].get(name, {}).get(mix, {})
            lines.append(f"| {name} | {mix} | {s['output_tok_s']:.0f} | {s['req_s']:.2f} | {ms(s['ttft_p50_s'])} / "
                         f"{ms(s['ttft_p90_s'])} | {ms(s['tpot_p50_s'])} / {ms(s['tpot_p90_s'])} | "
                         f"{s.get('goodput_req_s', 0):.2f} ({s.get('slo_met', 0)}/{s['requests']}) | "
                         f"{times(r.get('output_tok_s'))} | {times(r.get('goodput'))} | {times(r.get('tpot_p90'))} |")
    lines += ["", "| mix | kind | isolated TTFT (ms) | isolated TPOT (ms) | SLO TTFT / TPOT (ms) |",
              "| --- | --- | ---: | ---: | ---: |"]
    for mix, kinds in report["slo"].items():
        for kind, k in kinds.items():
            lines.append(f"| {mix} | {kind} | {ms(k['isolated_ttft_s'])} | {ms(k['isolated_tpot_s'])} | "
                         f"{ms(k['ttft_s'])} / {ms(k['tpot_s'])} |")
    lines += ["", "| target | /health 200 (s) | first answer (s) | chats refused before it | routes "
                  "(all mixes) | compiled during the load: serving, background | exit |",
              "| --- | ---: | ---: | ---: | --- | ---: | ---: |"]
    for name, result in report["targets"].items():
        routes: dict[str, int] = {}
        for s in result.get("mixes", {}).values():
            for route, n in s["routes"].items():
                routes[route] = routes.get(route, 0) + n
        lines.append(f"| {name} | {seconds(result.get('health_s'))} | {seconds(result.get('first_answer_s'))} | "
                     f"{len(result.get('refused_first_chats', []))} | "
                     f"{', '.join(f'{k} {v}' for k, v in sorted(routes.items()))} | "
                     f"{during(result, 'serving')}, {during(result, 'background')} | {result.get('exit_code')} |")
    lines += handoff_lines(report)
    return "\n".join(lines)


def handoff_lines(report: dict) -> list[str]:
    """The pd targets' handoffs, from replay of their journals: the prefill side's xfer is the whole handoff."""
    rows = [(name, r["handoffs"]) for name, r in report["targets"].items() if r.get("handoffs")]
    if not rows:
        return []
    lines = ["", "| target | rooms (Success both sides) | replay | P xfer p50 / p90 / max (ms) "
             "| D xfer p50 / p90 / max (ms) |", "| --- | ---: | --- | ---: | ---: |"]
    for name, h in rows:
        if "error" in h:
            lines.append(f"| {name} | - | {h['error']} | - | - |")
            continue
        sides = [" / ".join(f"{h[k][q]:.2f}" for q in ("p50", "p90", "max")) if k in h else "-"
                 for k in ("prefill_xfer_ms", "decode_xfer_ms")]
        lines.append(f"| {name} | {h['rooms']} ({h['success']}) | {'ok' if h['consistent'] else 'DIVERGED'} | "
                     f"{sides[0]} | {sides[1]} |")
    return lines


def during(result: dict, phase: str) -> str:
    if "compiled_during_load" not in result:
        return "-"
    return f"{sum(p.get(phase, 0) for p in result['compiled_during_load'].values()):.0f}"


def with_ratios(report: dict) -> dict:
    base = report["targets"].get("colocated", {}).get("mixes", {})
    report["ratios"] = {name: {mix: ratios(s, base[mix]) for mix, s in result.get("mixes", {}).items()
                               if mix in base}
                        for name, result in report["targets"].items() if name != "colocated" and base}
    return report


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # stop the nodes through the finally below, as on Ctrl-C
    state: dict = {"problems": []}
    report: dict = {"command": ["bench/load.py", *(sys.argv[1:] if argv is None else argv)], "model": args.model,
                    "streams": args.streams, "requests": args.requests, "tcp": args.tcp, "ttft_scale": args.ttft_scale,
                    "tpot_scale": args.tpot_scale, "targets": {}}
    # colocated first when asked for: the SLO comes from its isolated latencies
    order = sorted(args.targets, key=lambda name: name != "colocated")
    with tempfile.TemporaryDirectory(prefix="fsm-pd-load-") as scratch:
        run_dir = args.uds_dir or Path(scratch)
        run_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        interrupted = False
        for name in order:
            t = load_targets.target(name, args.model, run_dir.resolve(), args.tcp, tuple(args.node_arg))
            result = report["targets"][name] = {}
            try:
                run_target(t, args, state, result)
            except KeyboardInterrupt:
                interrupted = True
            except Exception as error:  # noqa: BLE001 - the next target still runs; the report says what failed
                state["problems"].append(f"{name}: {type(error).__name__}: {error}")
            finally:
                clock, running = time.monotonic(), t.proc is not None and t.proc.poll() is None
                result["exit_code"] = load_targets.stop(t)
                result["stop_s"] = time.monotonic() - clock
                if name.startswith("pd-"):
                    result["handoffs"] = load_targets.handoffs(load_targets.journals(run_dir.resolve(), name))
            if running and result["exit_code"] != 0:  # a node drains and exits 0 on SIGTERM
                state["problems"].append(f"{name} exited with {result['exit_code']} on SIGTERM:\n{t.log_tail()}")
            if interrupted:
                break
        report["seconds"] = time.monotonic() - started
    plan = state.get("plan")
    report |= {"slo": state.get("slo") or {}, "slo_from": state.get("slo_from"), "problems": state["problems"],
               "prompt_plan": None if plan is None else {"overhead": plan.overhead, "per_digit": plan.per_digit,
                                                         "tokens": {k: plan.expected_tokens(k) for k in plan.lengths}}}
    with_ratios(report)
    print(markdown(report))
    for problem in state["problems"]:
        err.print(f"[red]problem:[/red] {problem}", markup=True, highlight=False)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    if interrupted:
        return 130
    return 1 if state["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
