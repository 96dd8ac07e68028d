"""The load bench's tables (``load.py``): from its report (the JSON it writes), the markdown it prints.

Per target and mix, each measured run's row and, over two runs or more, the median row; a pd target's rows carry
ratios to colocated's median. Then the SLO, each start of each target (the one that filled the caches, the measured
one: times to ready, to the first answer and to the end of the background compile), the routes and the programs
compiled during the warm-up wave and during each measured run, the pd targets' handoffs from replay, and in bold
every warning (a program compiled during a measured run, a background compile that never finished).
"""

from __future__ import annotations

import load_phases
from load_mixes import ratios


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown(report: dict) -> str:
    runs = report.get("runs", 1)
    how = ("each target started once on empty caches" if report.get("cold") else
           "each target started once to fill its caches, stopped, then measured on a second start")
    lines = [f"model {report['model']}, {report['streams']} streams, {report['requests']} requests per mix, "
             f"{runs} measured run(s) per mix on one start ({how}), over {'TCP' if report['tcp'] else 'unix sockets'}"
             f"; SLO from {report['slo_from']} alone: TTFT <= {report['ttft_scale']:g}x, TPOT <= "
             f"{report['tpot_scale']:g}x the isolated median", "",
             "| target | mix | run | output tok/s | req/s | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) | goodput req/s "
             "(met) | tok/s vs colocated | goodput vs colocated | TPOT p90 vs colocated |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    base = report["targets"].get("colocated", {}).get("mixes", {})
    for name, result in report["targets"].items():
        for mix, median in result.get("mixes", {}).items():
            each = [run["mixes"][mix] for run in result.get("runs", ()) if mix in run["mixes"]]
            for i, s in enumerate(each, 1):
                r = ratios(s, base[mix]) if name != "colocated" and mix in base else {}
                lines.append(row(name, mix, str(i), s, r))
            if len(each) > 1:
                lines.append(row(name, mix, "**median**", median, report["ratios"].get(name, {}).get(mix, {})))
    lines += ["", "| mix | kind | isolated TTFT (ms) | isolated TPOT (ms) | SLO TTFT / TPOT (ms) |",
              "| --- | --- | ---: | ---: | ---: |"]
    for mix, kinds in report["slo"].items():
        for kind, k in kinds.items():
            lines.append(f"| {mix} | {kind} | {ms(k['isolated_ttft_s'])} | {ms(k['isolated_tpot_s'])} | "
                         f"{ms(k['ttft_s'])} / {ms(k['tpot_s'])} |")
    lines += ["", "| target | start | /health 200 (s) | first answer (s) | chats refused before it | background "
                  "compile done (s) | background compile: programs in s | exit |",
              "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    for name, result in report["targets"].items():
        for label, start in (("fill", result.get("fill_start")), ("measured", result)):
            if start is None or "pid" not in start:
                continue
            lines.append(f"| {name} | {label} | {seconds(start.get('health_s'))} | "
                         f"{seconds(start.get('first_answer_s'))} | {len(start.get('refused_first_chats', []))} | "
                         f"{seconds(start.get('background_done_s'))} | {background(start.get('background'))} | "
                         f"{start.get('exit_code')} |")
    lines += ["", "| target | routes (all runs and mixes) | compiled during the warm-up wave: serving, background "
                  "| compiled during each measured run: serving, background |", "| --- | --- | ---: | ---: |"]
    for name, result in report["targets"].items():
        routes: dict[str, int] = {}
        for s in result.get("mixes", {}).values():
            for route, n in s["routes"].items():
                routes[route] = routes.get(route, 0) + n
        per_run = "; ".join(compiled(run.get("compiled_during_load")) for run in result.get("runs", ())) or "-"
        lines.append(f"| {name} | {', '.join(f'{k} {v}' for k, v in sorted(routes.items()))} | "
                     f"{compiled(result.get('compiled_during_warmup'))} | {per_run} |")
    lines += handoff_lines(report)
    lines += budget_lines(report)
    lines += step_loop_lines(report)
    lines += load_phases.lines(report)
    if report.get("warnings"):
        lines += ["", *(f"**WARNING: {warning}**" for warning in report["warnings"])]
    return "\n".join(lines)


def row(name: str, mix: str, run: str, s: dict, r: dict) -> str:
    met = s.get("slo_met")
    return (f"| {name} | {mix} | {run} | {s['output_tok_s']:.0f} | {s['req_s']:.2f} | {ms(s['ttft_p50_s'])} / "
            f"{ms(s['ttft_p90_s'])} | {ms(s['tpot_p50_s'])} / {ms(s['tpot_p90_s'])} | "
            f"{s.get('goodput_req_s') or 0:.2f} ({'-' if met is None else f'{met:g}'}/{s['requests']}) | "
            f"{times(r.get('output_tok_s'))} | {times(r.get('goodput'))} | {times(r.get('tpot_p90'))} |")


def background(state: dict | None) -> str:
    """Each engine's background compile: ``node 24 in 27.5 s``, ``prefill ..., decode ...``; NOT DONE where an
    engine had not finished when the bench stopped waiting."""
    if not state:
        return "-"
    parts = []
    for engine, report in state.items():
        if not isinstance(report, dict):
            parts.append(f"{engine} NOT DONE ({report or 'not ready'})")
        elif report.get("skipped"):
            parts.append(f"{engine} skipped")
        else:
            parts.append(f"{engine} {report.get('programs', 0)} in {report.get('seconds', 0):.1f} s")
    return ", ".join(parts)


def compiled(grown: dict | None) -> str:
    """Programs compiled over a stretch (``load_targets.compiled_since``): serving, background; - when unknown."""
    if grown is None:
        return "-"
    return ", ".join(f"{sum(p.get(phase, 0) for p in grown.values()):.0f}" for phase in ("serving", "background"))


def handoff_lines(report: dict) -> list[str]:
    """The pd targets' handoffs, from replay of their journals: the prefill side's xfer is the whole handoff."""
    rows = [(name, r["handoffs"]) for name, r in report["targets"].items() if r.get("handoffs")]
    if not rows:
        return []
    lines = ["", "| target | rooms (Success both sides) | served whole | replay | P xfer p50 / p90 / max (ms) "
             "| D xfer p50 / p90 / max (ms) |", "| --- | ---: | ---: | --- | ---: | ---: |"]
    for name, h in rows:
        if "error" in h:
            lines.append(f"| {name} | - | - | {h['error']} | - | - |")
            continue
        sides = [" / ".join(f"{h[k][q]:.2f}" for q in ("p50", "p90", "max")) if k in h else "-"
                 for k in ("prefill_xfer_ms", "decode_xfer_ms")]
        lines.append(f"| {name} | {h['rooms']} ({h['success']}) | {h.get('local', 0)} | "
                     f"{'ok' if h['consistent'] else 'DIVERGED'} | "
                     f"{sides[0]} | {sides[1]} |")
    return lines


def budget_lines(report: dict) -> list[str]:
    """Each target's prefill budget at its end (``StepBudget.state``): what bounded its prefill steps beside the
    decoding streams, the first thing to read where a target's TTFT falls behind."""
    rows = [(name, r["prefill_budget"]) for name, r in report["targets"].items() if r.get("prefill_budget")]
    if not rows:
        return []
    lines = ["", "| target | decode step (ms) | prefill step (ms) by padded tokens (times timed) | steps cut |",
             "| --- | ---: | --- | ---: |"]
    for name, b in rows:
        sizes = ", ".join(f"{t}: {ms:.1f} ({b['prefill_samples'].get(t, 0)})" for t, ms in b["prefill_ms"].items())
        decode = "-" if b["decode_ms"] is None else f"{b['decode_ms']:.1f}"
        lines.append(f"| {name} | {decode} | {sizes or '-'} | {b['cut_steps']} |")
    return lines


def step_loop_lines(report: dict) -> list[str]:
    """Each target's step loop over its measured runs (``StepDriver.timing``): its steps, and the gaps between them,
    after a step that asked for more (a wait behind the model thread's other jobs) and after one that had nothing
    left (idle until a kick). Two schedulers whose steps cost the same but whose output differs differ here."""
    rows = [(name, r["step_loop"]) for name, r in report["targets"].items() if r.get("step_loop")]
    if not rows:
        return []
    lines = ["", "| target | steps | step (ms, mean) | waits after a step asking for more: n, mean / max (ms) | "
                 "idle between steps (s) |", "| --- | ---: | ---: | --- | ---: |"]
    for name, t in rows:
        step = 1e3 * t["busy_s"] / t["steps"] if t["steps"] else 0.0
        wait = 1e3 * t["waited_s"] / t["waits"] if t["waits"] else 0.0
        longest = "-" if t["waited_max_s"] is None else f"{1e3 * t['waited_max_s']:.2f}"  # not above an earlier one
        lines.append(f"| {name} | {t['steps']} | {step:.2f} | {t['waits']}, {wait:.2f} / {longest} | "
                     f"{t['idle_s']:.2f} |")
    return lines


def with_ratios(report: dict) -> dict:
    """Each pd target's median figures as ratios of colocated's median, mix by mix."""
    base = report["targets"].get("colocated", {}).get("mixes", {})
    report["ratios"] = {name: {mix: ratios(s, base[mix]) for mix, s in result.get("mixes", {}).items()
                               if mix in base}
                        for name, result in report["targets"].items() if name != "colocated" and base}
    return report
