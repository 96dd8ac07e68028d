"""Load bench: a colocated node against ``--role pd`` (policies auto, always, never) under streamed chats, over unix
sockets, so that it runs on a host that allows no TCP socket (a TPU VM; issue 48, point 7), warm and steady.

Each target is started alone, one after the other (one process at a time may hold the chip), from the same --model,
on a unix socket under --uds-dir (--tcp: on 127.0.0.1 instead), twice: a first start fills the compile cache and the
converted-model cache (``FSM_PD_COMPILE_CACHE``, ``FSM_PD_MODEL_CACHE``, under --uds-dir's ``caches``, one pair for
the run as a user has one), and is stopped once its background compile ended; the measured start then finds them
full, as a user's second start does (--cold: one start only, on empty caches of its own). Of each start it prints the
seconds from the process's start to ``/health`` 200, to the first answered chat (measured start) and to the end of
its background compile, which ``/server_info`` tells (``startup.background_compile``; ``--role pd``: both engines',
``engines_startup``): nothing is sent to a measured start before that end, so that no program compiles under load.
Then one wave of every mix, and --runs measured runs (default 2; 1 with --quick), each sending every mix's
--requests streamed chats (``/v1/chat/completions``, greedy, ``ignore_eos``), --streams at a time:

- prefill-heavy: prompts of about --long-tokens (900) tokens, 16 new tokens each;
- decode-heavy: prompts of about --short-tokens (30), 128 new;
- mixed: every third prompt long, the rest short, 48 new.

Prompts are digits behind a tag unique to the request (no prefix is shared, not even between runs), sized for the
model's tokenizer from the server's own counts (``load_mixes.py``); every answer's ``usage`` must show the planned
prompt tokens and exactly max_tokens new ones.

Per target, mix and run it reports output tok/s, req/s, TTFT and TPOT at p50 and p90, and goodput: requests per
second that met the SLO, which is derived from isolated latencies measured first on the colocated node (one stream,
medians, per mix and prompt kind): TTFT <= --ttft-scale (5) x the isolated TTFT and TPOT <= --tpot-scale (2) x the
isolated TPOT; over two runs or more, each figure's median over the runs too. Each pd target's figures are given as
ratios of colocated's median, measured in the same run. Then the SLO, each start's times, the routes, the programs
compiled during the warm-up wave and during each run (a WARNING, loud, where a measured run compiled any), and the pd
targets' handoffs as ``fsm-pd replay`` reads them from their journals, and each target's prefill budget at its end
(``/server_info``'s ``prefill_budget``: the decode step's cost and each prefill size's, which bound its prefill steps
beside the decoding streams), and where the first run's TTFT went: each server phase's mean per request beside the
client's mean TTFT (``load_phases.py``). It prints progress lines as it goes (on stderr, with the seconds since it
began), markdown tables at the end, and writes --json PATH. It exits 1 when a request went unanswered or a token
count was wrong.

    python bench/load.py [--model tiny|smollm2|PATH.gguf] [--targets colocated,pd-auto,pd-always,pd-never]
                         [--mixes prefill-heavy,decode-heavy,mixed] [--requests 48] [--streams 16] [--runs 2]
                         [--cold] [--uds-dir DIR] [--json PATH]
    python bench/load.py --quick          # the tiny model, 16 requests per mix, one run: a minute or two on a CPU

The processes it starts are stopped by PID (SIGTERM, then SIGKILL after a minute), on Ctrl-C and errors too.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from rich.console import Console
from rich.markup import escape

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:  # run as a script; a test that imports it has appended it (never first: it would shadow)
    sys.path.insert(0, HERE)
import load_client  # noqa: E402 - beside this script
import load_phases  # noqa: E402
import load_report  # noqa: E402
import load_targets  # noqa: E402
from load_mixes import LONG, MIXES, SHORT, PromptPlan, chat, isolated_slo, median_of_runs, request_body, summary  # noqa: E402

err = Console(stderr=True, soft_wrap=True)  # a progress line is one line, in a log too
# tag ranges, one per phase (and per run of the load: 300_000 + 100_000 x run), 10_000 per mix; six digits in all
PHASE_TAGS = {"probe": 0, "warm": 100_000, "isolated": 200_000, "load": 300_000}
MAX_RUNS = 7
MAX_REQUESTS = 10_000
PROMPT_TOLERANCE = 2  # tokens an answer's prompt_tokens may differ from the plan (a tokenizer that groups digits)
PROBE_DIGITS = 200


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny (default), smollm2, or a .gguf file or HF directory")
    parser.add_argument("--targets", default=",".join(load_targets.TARGETS),
                        help=f"comma-separated, run in this order (default {','.join(load_targets.TARGETS)}); "
                             "NAME+kN: that server at N decode steps a dispatch (colocated+k8)")
    parser.add_argument("--mixes", default=",".join(MIXES), help=f"comma-separated (default {','.join(MIXES)})")
    parser.add_argument("--requests", type=int, default=None, help="requests per mix and target (default 48; 16 "
                                                                   "with --quick)")
    parser.add_argument("--streams", type=int, default=16, help="requests in flight at a time (default 16)")
    parser.add_argument("--runs", type=int, default=None,
                        help=f"measured runs of every mix on each target's one measured start, each row printed "
                             f"with the median's (default 2; 1 with --quick; at most {MAX_RUNS})")
    parser.add_argument("--cold", action="store_true",
                        help="start each target once, on empty caches, instead of once to fill the caches and again "
                             "to measure")
    parser.add_argument("--background-timeout", type=float, default=300,
                        help="seconds a start may take, after ready, to finish its background compile before the "
                             "bench goes on without it, with a warning (default 300)")
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
                        help="where the sockets, logs, journals and caches go (default: a temporary directory, "
                             "removed); a directory an earlier run left makes its fill starts short")
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
    args.runs = args.runs or (1 if args.quick else 2)
    if not 1 <= args.runs <= MAX_RUNS or not 1 <= args.requests <= MAX_REQUESTS:
        parser.error(f"--runs goes from 1 to {MAX_RUNS}, --requests from 1 to {MAX_REQUESTS} (a request's tag has six "
                     "digits)")
    args.targets = [t for t in args.targets.split(",") if t]
    args.mixes = [m for m in args.mixes.split(",") if m]
    for name, known, is_known in (("targets", list(load_targets.TARGETS) + ["NAME+kN"], load_targets.known),
                                  ("mixes", MIXES, MIXES.__contains__)):
        unknown = [v for v in getattr(args, name) if not is_known(v)]
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


def requests_for(phase: str, mix_name: str, count: int, plan: PromptPlan, run: int = 0) -> list[tuple[str, dict]]:
    """``count`` requests of a mix, the same on every target; tags unique per phase, run and mix (no shared prefix:
    a later run would find an earlier one's prompts in the prefix cache)."""
    mix = MIXES[mix_name]
    base = PHASE_TAGS[phase] + run * 100_000 + list(MIXES).index(mix_name) * 10_000
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


def say(state: dict, line: str) -> None:
    """A progress line, with the seconds since the bench began (a chip run has a budget to keep)."""
    err.print(f"[{time.monotonic() - state['began']:5.0f} s] {line}", highlight=False, markup=False)


def warn(state: dict, warning: str) -> None:
    state["warnings"].append(warning)
    err.print(f"[bold red]WARNING: {escape(warning)}[/bold red]", highlight=False)


@contextmanager
def running(t: load_targets.Target, record: dict, state: dict) -> Iterator[None]:
    """Start ``t`` and stop it by its PID when the block ends (errors and Ctrl-C too): its pid, exit status and the
    seconds the stop took go into ``record``; a node drains and exits 0 on SIGTERM, anything else is a problem."""
    load_targets.start(t)
    record |= {"argv": t.argv[1:], "pid": t.proc.pid}
    try:
        yield
    finally:
        clock, alive = time.monotonic(), t.proc.poll() is None
        record["exit_code"] = load_targets.stop(t)
        record["stop_s"] = time.monotonic() - clock
        if alive and record["exit_code"] != 0:
            state["problems"].append(f"{t.name} exited with {record['exit_code']} on SIGTERM:\n{t.log_tail()}")


def settle(t: load_targets.Target, args, state: dict, record: dict, label: str) -> None:
    """A started target to steady serving: ``/health`` 200, (measured start) its first answered chat, then the end of
    its background compile, each timed from the process's start. A compile that has not ended within
    --background-timeout of the wait's start is warned of, and the bench goes on."""
    say(state, f"{t.name} ({label} start): pid {t.proc.pid}")
    record["health_s"] = load_targets.wait_health(t, args.ready_timeout)
    said = f"{t.name} ({label} start): /health 200 at {record['health_s']:.1f} s"
    if label == "measured":
        first = request_body(chat(PHASE_TAGS["probe"] + 9, 8, 9), 4, stream=False)
        record["first_answer_s"] = load_targets.wait_first_answer(t, first, args.ready_timeout)
        record["refused_first_chats"] = t.refused_first_chats
        said += f", first answer at {record['first_answer_s']:.1f} s"
    say(state, f"{said}; waiting for its background compile")
    record["background_done_s"], record["background"] = load_targets.wait_background(t, args.background_timeout)
    done = record["background_done_s"]
    say(state, f"{t.name} ({label} start): background compile " + (f"done at {done:.1f} s" if done is not None else
        "NOT done") + f" ({load_report.background(record['background'])})")
    if done is None:
        warn(state, f"{t.name} ({label} start): its background compile had not finished after "
                    f"--background-timeout ({args.background_timeout:.0f} s): what it still compiles lands in "
                    f"{'the load' if label == 'measured' else 'the measured start'}")


def run_target(name: str, args, run_dir: Path, state: dict, result: dict) -> None:
    """Unless --cold, a first start that fills the caches and is stopped once its background compile ended (none
    where an earlier run in this --uds-dir filled them for the same model and node arguments); then the measured start
    on those caches: time to ready, warm-up wave, (isolated latencies, once), --runs runs of the mixes. The target's
    figures go into ``result`` as they come (a failure halfway keeps what came before). ``state`` carries the prompt
    plan and the SLO from the first target that made them, the problems and the warnings."""
    make = partial(load_targets.target, name, args.model, run_dir, args.tcp, tuple(args.node_arg))
    caches = run_dir / "caches" if not args.cold else Path(tempfile.mkdtemp(prefix=f"{name}-cold-", dir=run_dir))
    filled, what = caches / f"filled-{name}.json", json.dumps({"model": args.model, "node_args": args.node_arg})
    if not args.cold and filled.exists() and filled.read_text() == what:
        say(state, f"{name}: the caches in {caches} were filled for it by an earlier run: no fill start")
    elif not args.cold:
        fill = make(caches=caches, start="fill")
        record = result["fill_start"] = {}
        with running(fill, record, state):
            settle(fill, args, state, record, "fill")
        say(state, f"{name} (fill start): stopped in {record['stop_s']:.1f} s")
        if record["exit_code"] == 0 and record["background_done_s"] is not None:
            filled.write_text(what)
    t = make(caches=caches)
    try:
        with running(t, result, state):
            settle(t, args, state, result, "measured")
            measure(t, args, state, result)
    finally:
        if name.startswith("pd-"):
            result["handoffs"] = load_targets.handoffs(load_targets.journals(run_dir, name))


def measure(t: load_targets.Target, args, state: dict, result: dict) -> None:
    """On the settled measured start: the warm-up wave, the isolated latencies (first target only), the runs."""
    if state.get("plan") is None:
        state["plan"] = plan_prompts(t.url, {LONG: args.long_tokens, SHORT: args.short_tokens})
        say(state, f"prompt plan: {state['plan']}")
    plan = state["plan"]
    clock, before = time.monotonic(), load_targets.compiles(t.url)
    for mix in args.mixes:  # one wave of each mix: the first batch of each shape is not in the figures
        records, _ = load_client.closed_loop(t.url, requests_for("warm", mix, min(args.streams, args.requests), plan),
                                             args.streams, args.request_timeout)
        state["problems"] += check(records, mix, plan, f"{t.name} warm-up")
    result["warm_s"], clock = time.monotonic() - clock, time.monotonic()
    result["compiled_during_warmup"] = load_targets.compiled_since(before, load_targets.compiles(t.url))
    say(state, f"{t.name}: warm-up wave in {result['warm_s']:.1f} s (compiled during it: serving, background "
               f"{load_report.compiled(result['compiled_during_warmup'])})")
    if state.get("slo") is None:
        slo = {}
        for mix in args.mixes:
            records, _ = load_client.closed_loop(t.url, isolated_requests(mix, args.isolated, plan), 1,
                                                 args.request_timeout)
            state["problems"] += check(records, mix, plan, f"{t.name} isolated")
            slo[mix] = isolated_slo(records, args.ttft_scale, args.tpot_scale)
        state["slo"], state["slo_from"] = slo, t.name
        result["isolated_s"] = time.monotonic() - clock
        say(state, f"{t.name}: isolated latencies for the SLO in {result['isolated_s']:.1f} s")
    result["runs"], result["mixes"] = [], {}
    loop_before = load_targets.step_loop(t.url)
    for run in range(args.runs):
        before = load_targets.compiles(t.url)
        this: dict = {"mixes": {}}
        result["runs"].append(this)
        for mix in args.mixes:
            phases = load_phases.read(t.url)
            records, took = load_client.closed_loop(t.url, requests_for("load", mix, args.requests, plan, run),
                                                    args.streams, args.request_timeout)
            state["problems"] += check(records, mix, plan, f"{t.name} run {run + 1}")
            ttfts = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
            this["mixes"][mix] = summary(records, took, state["slo"][mix]) | {
                "records": records, "phases_ms": load_phases.means_ms(phases, load_phases.read(t.url)),
                "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None}
            say(state, f"{t.name} run {run + 1}/{args.runs} {mix}: {this['mixes'][mix]['output_tok_s']:.0f} output "
                       f"tok/s in {took:.1f} s")
        after = load_targets.compiles(t.url)
        this["compiled_during_load"] = grown = load_targets.compiled_since(before, after)
        result["compiles"] = after
        if any(grown.values()):
            warn(state, f"{t.name} compiled programs during measured run {run + 1} (serving, background: "
                        f"{load_report.compiled(grown)}): its figures include compiles, not steady serving")
    for mix in args.mixes:
        result["mixes"][mix] = median_of_runs([run["mixes"][mix] for run in result["runs"]])
    result["prefill_budget"] = load_targets.prefill_budget(t.url)
    result["step_loop"] = load_targets.step_loop_since(loop_before, load_targets.step_loop(t.url))


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # stop the nodes through the finally below, as on Ctrl-C
    state: dict = {"problems": [], "warnings": [], "began": time.monotonic()}
    report: dict = {"command": ["bench/load.py", *(sys.argv[1:] if argv is None else argv)], "model": args.model,
                    "streams": args.streams, "requests": args.requests, "runs": args.runs, "cold": args.cold,
                    "tcp": args.tcp, "ttft_scale": args.ttft_scale, "tpot_scale": args.tpot_scale, "targets": {}}
    # colocated first when asked for: the SLO comes from its isolated latencies
    order = sorted(args.targets, key=lambda name: name != "colocated")
    interrupted = False
    with tempfile.TemporaryDirectory(prefix="fsm-pd-load-") as scratch:
        run_dir = (args.uds_dir or Path(scratch)).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        for name in order:
            result = report["targets"][name] = {}
            try:
                run_target(name, args, run_dir, state, result)
            except KeyboardInterrupt:
                interrupted = True
                break
            except Exception as error:  # noqa: BLE001 - the next target still runs; the report says what failed
                state["problems"].append(f"{name}: {type(error).__name__}: {error}")
        report["seconds"] = time.monotonic() - state["began"]
    plan = state.get("plan")
    report |= {"slo": state.get("slo") or {}, "slo_from": state.get("slo_from"), "problems": state["problems"],
               "warnings": state["warnings"],
               "prompt_plan": None if plan is None else {"overhead": plan.overhead, "per_digit": plan.per_digit,
                                                         "tokens": {k: plan.expected_tokens(k) for k in plan.lengths}}}
    load_report.with_ratios(report)
    print(load_report.markdown(report))
    for problem in state["problems"]:
        err.print(f"[red]problem:[/red] {escape(problem)}", highlight=False)
    for warning in state["warnings"]:  # again at the end, where a reader of the run's tail sees them
        err.print(f"[bold red]WARNING: {escape(warning)}[/bold red]", highlight=False)
    err.print(f"done in {report['seconds']:.0f} s", highlight=False)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    if interrupted:
        return 130
    return 1 if state["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
