"""Where does PD pay? ``bench/goodput.py --sweep``: goodput over a grid of prompt and output lengths, for colocated,
classic PD (``--pd-policy always``) and PD with the selective policy (``--pd-policy auto``), on equal pinned cores.

Setup (``goodput.start_mode``): the colocated node on cores 0 and 1; for PD the prefill node on core 0 (with
``--serve-local``: it serves both roles), the decode node on core 1, and two routers in front of the same two nodes,
one per policy (so both PD modes meet the same nodes, compiled programs and caches; the ``always`` router never
sends a request whole, the ``auto`` one runs with ``--prefill-serves-local``). Each cell of the grid (a prompt
length, an output length) is its own workload: --requests requests of about that many prompt tokens (+-10%) and
exactly that many new tokens, greedy, EOS ignored, Poisson arrivals. Its SLO comes from isolated runs on the
colocated node (medians of five, times --ttft-scale and --tpot-scale, as goodput.py does for its mixes); goodput is
the highest rate of the grid at which 90% of requests attain it, found by a walk over the grid
(``goodput_search.find_goodput``). ``--repeat N`` runs every rate sweep N times with fresh
prompts (the prefix cache must not serve a repeat) and reports each goodput (and their lower median, a swept rate),
so a reader sees whether --requests was enough for a stable figure.

It writes ``crossover.png`` (goodput against prompt length, one panel per output length, one line per mode) and the
table between the markers of ``crossover.md`` in --docs-dir (docs/ by default; a fresh file when there is none).
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import goodput_search as g  # beside this script (goodput.py puts bench/ on the path)

BEGIN, END = "<!-- crossover-table:begin -->", "<!-- crossover-table:end -->"
MODES = ("colocated", "pd", "pd-policy")
START_BELOW = 0.6  # a search starts at this share of the goodput it expects (run_grid)
LABELS = {"colocated": "colocated (cores 0+1)", "pd": "PD, every request (always)",
          "pd-policy": "PD with the policy (auto)"}


def cell_requests(prompt: int, output: int, count: int, seed: str, vocab: int) -> list[tuple[list[int], int]]:
    """``count`` (prompt ids, new tokens): ids from the vocabulary past its first tenth (special and byte tokens)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = max(4, int(rng.gauss(prompt, prompt / 10)))
        out.append(([rng.randrange(vocab // 10, vocab) for _ in range(n)], output))
    return out


def run_grid(args, urls: dict[str, str], vocab: int, log, on_cell=None) -> list[dict]:
    """Every cell: its SLO, and per mode the goodput of each repeat and the rate sweeps behind them. ``on_cell(cells)``
    after each cell (the docs are rewritten as the grid goes: a sweep stopped halfway keeps what it measured)."""
    prompts = [int(p) for p in args.prompts.split(",")]
    outputs = [int(o) for o in args.outputs.split(",")]
    rates = [float(r) for r in args.rates.split(",")]
    cells = []
    for output in outputs:
        for prompt in prompts:
            iso = [g.stream(urls["colocated"], ids, n)
                   for ids, n in cell_requests(prompt, output, 5, f"{prompt} {output} isolated", vocab)]
            slo = {"ttft": args.ttft_scale * statistics.median(r["ttft"] for r in iso),
                   "tpot": args.tpot_scale * statistics.median(r["tpot"] for r in iso)}
            cell = {"prompt": prompt, "output": output, "slo": slo, "modes": {}}
            # where each search starts (find_goodput): below the likely goodput, since a walk up is cheap (higher
            # rates, shorter runs) and one down is not: colocated at START_BELOW x its goodput in the cell before (the
            # same output, a shorter prompt), the PD modes at START_BELOW x colocated's in this cell; a repeat at its
            # mode's previous goodput
            start = (START_BELOW * cells[-1]["modes"]["colocated"]["goodput"]
                     if cells and cells[-1]["output"] == output else None)
            for mode in MODES:
                for ids, n in cell_requests(prompt, output, 2, f"{prompt} {output} {mode} warm", vocab):
                    g.stream(urls[mode], ids, n)  # not measured: whatever a mode's first requests pay
                runs = []
                repeats = args.repeat if not args.repeat_prompts or prompt in args.repeat_prompts else 1
                for repeat in range(repeats):
                    log(f"prompt {prompt}, output {output}, {mode}, repeat {repeat + 1}/{repeats}")

                    def load(rate: float, prompt=prompt, output=output, repeat=repeat) -> list[tuple[list[int], int]]:
                        return cell_requests(prompt, output, g.requests_at(rate, args),
                                             f"{prompt} {output} {rate} {repeat}", vocab)

                    goodput, sweep, _ = g.find_goodput(urls[mode], load, rates, slo,
                                                       (runs and runs[-1]["goodput"]) or start or None)
                    runs.append({"goodput": goodput, "sweep": sweep})
                goodputs = [r["goodput"] for r in runs]
                cell["modes"][mode] = {"goodputs": goodputs, "goodput": statistics.median_low(goodputs),
                                       "stable": len(set(goodputs)) == 1, "runs": runs}
                if mode == "colocated":
                    start = START_BELOW * cell["modes"][mode]["goodput"] or start
            cells.append(cell)
            if on_cell is not None:
                on_cell(cells)
    return cells


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else ("n/a" if not a else "inf")


def table(cells: list[dict], settings: dict) -> str:
    """The markdown table: goodput per mode (each repeat's when they differ), the ratios, the policy's local share."""
    only = f" (prompts of {settings['repeat_prompts']} only; one elsewhere)" if settings.get("repeat_prompts") else ""
    more = (f" (more where their arrivals would span under {settings['min_seconds']:g} s)"
            if settings.get("min_seconds") else "")
    lines = [f"Model {settings['model']}, {settings['requests']} requests per rate{more}, rates "
             f"{settings['rates']} /s, {settings['repeat']} search(es) per cell and mode{only}, SLO TTFT <= "
             f"{settings['ttft_scale']:g}x and TPOT <= {settings['tpot_scale']:g}x the isolated medians.", "",
             "| prompt tokens | new tokens | colocated | PD (always) | PD (policy) | PD / colocated | "
             "policy / colocated | policy: local share at its goodput | repeats agree |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |"]
    for cell in cells:
        m = cell["modes"]

        def shown(mode: str, m=m) -> str:
            found = m[mode]
            if found["stable"]:
                return f"{found['goodput']:g}/s"
            return f"{found['goodput']:g}/s ({', '.join(f'{g:g}' for g in found['goodputs'])})"

        policy = m["pd-policy"]
        at = [s for run in policy["runs"] for s in run["sweep"] if s["rate"] == policy["goodput"]]
        local = f"{statistics.median(s['local_share'] for s in at):.0%}" if at else "-"
        agree = ("- (one run)" if all(len(found["goodputs"]) == 1 for found in m.values())
                 else "yes" if all(found["stable"] for found in m.values()) else "no")
        lines.append(f"| {cell['prompt']} | {cell['output']} | {shown('colocated')} | {shown('pd')} | "
                     f"{shown('pd-policy')} | {_ratio(m['pd']['goodput'], m['colocated']['goodput'])} | "
                     f"{_ratio(policy['goodput'], m['colocated']['goodput'])} | {local} | {agree} |")
    return "\n".join(lines)


def plot(cells: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: a file
    import matplotlib.pyplot as plt

    outputs = sorted({c["output"] for c in cells})
    fig, axes = plt.subplots(1, len(outputs), figsize=(5.5 * len(outputs), 4.2), squeeze=False)
    for ax, output in zip(axes[0], outputs, strict=True):
        row = sorted((c for c in cells if c["output"] == output), key=lambda c: c["prompt"])
        for mode, marker in zip(MODES, ("o", "s", "^"), strict=True):
            ax.plot([c["prompt"] for c in row], [c["modes"][mode]["goodput"] for c in row], marker=marker,
                    label=LABELS[mode])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("goodput (requests/s at >= 90% SLO attainment)")
        ax.set_title(f"{output} new tokens")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_docs(cells: list[dict], settings: dict, docs: Path) -> tuple[Path, Path]:
    """``crossover.png`` and the table between the markers of ``crossover.md`` (the page around it is kept)."""
    docs.mkdir(parents=True, exist_ok=True)
    png, page = docs / "crossover.png", docs / "crossover.md"
    plot(cells, png, f"{settings['model']}: goodput by prompt length\nP and D on one core each, colocated on both")
    block = f"{BEGIN}\n{table(cells, settings)}\n{END}"
    if page.exists() and BEGIN in (text := page.read_text()) and END in text:
        head, rest = text.split(BEGIN, 1)
        page.write_text(head + block + rest.split(END, 1)[1])
    else:
        page.write_text(f"# Crossover (bench/goodput.py --sweep)\n\n{block}\n\n"
                        "![goodput by prompt length](crossover.png)\n")
    return page, png
