"""What a start costs: one node to its first answer, and ``fsm-pd launch`` to its first answer, cold and warm.

On the model a user gets (SmolLM2 unless --model), with the defaults a user gets, each in a fresh process:

1. ``fsm-pd serve --role R`` for each role in --roles (default colocated and decode; ``pd`` is the one-process
   PD node): first with an empty compile cache and an empty converted-model cache (cold), then again on what the
   first run left (warm). For each run: the time from the process's start to ready (``/health`` 200) and to the end
   of its first answer, each start-up phase (``fsm_pd_startup_seconds``: imports, device, model, weights, engine,
   programs; the device and the weights on threads of their own, beside the others), and per kind of program how
   many it prepared, how many came from the compile cache and how many were loaded as serialized executables
   (``model/executables.py``), and the seconds spent tracing, lowering, in the backend and loading executables
   (``fsm_pd_program_prepare_seconds``, ``fsm_pd_programs``);
2. ``fsm-pd launch`` (1 prefill, 1 decode, the router), cold then warm: the seconds from the command to the first
   answer it prints, as a newcomer sees them.

Every process gets its own caches under a temporary directory, so nothing this machine compiled before helps the
cold runs. A node answers its first request here on the colocated and pd roles (a decode node needs a prefill node
beside it for that: launch measures the pair), then (unless --no-burst) a burst of 16 mixed prompts (8 to 900
tokens, 8 at a time) while its background compile still runs. The serving compiles of each node
(``fsm_pd_compiles_total{phase="serving"}``, read after all that) are printed too, and must be 0.

    python bench/startup.py [--model smollm2] [--roles colocated,decode,pd] [--no-launch] [--no-burst] [--repeat N]
                            [--warm N] [--json] [--baseline REF | --against-env NAME=VALUE] [--uds] [--logs DIR]

``--uds``: every node and launch serve over unix sockets (``--uds``), as on a TPU host, which allows no TCP socket.
``--baseline REF``: every run is made on the code of git revision REF (or of a checkout in the directory REF) too,
right after this code's (on a shared, loaded machine both see about the same load), and the medians' ratios are
printed. ``--against-env NAME=VALUE``: the same, on this code with the environment variable set (for instance
``FSM_PD_EXECUTABLE_CACHE=off``). ``--repeat N``: N runs of each (role, cache) and launch; the tables show the median
run. ``--warm N``: N warm starts after each cold one, on its caches (default 1). ``--logs DIR``: every node's log is
kept there (a node that fails shows its log's end either way).

Every warm start's first answer must be its cold start's, word for word (greedy decoding), and every variant's the
same: the bench says so, or names the runs that differ and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from fsm_pd.cli.launch import free_port
from fsm_pd.transport import generate_secret, secret_env

err = Console(stderr=True)
REPO = Path(__file__).resolve().parents[1]
QUESTION = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}


def metric_rows(text: str, name: str) -> list[tuple[dict, float]]:
    rows = []
    for line in text.splitlines():
        match = re.match(rf"^{name}(?:\{{(.*)\}})? (\S+)$", line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
            rows.append((labels, float(match.group(2))))
    return rows


def client_for(where: int | str) -> httpx.Client:
    """A client of a node on 127.0.0.1:``where`` (a port), or on the unix socket ``where`` (a path)."""
    if isinstance(where, int):
        return httpx.Client(base_url=f"http://127.0.0.1:{where}")
    return httpx.Client(base_url="http://localhost", transport=httpx.HTTPTransport(uds=where))


def python_path(code: Path) -> str:
    """The checkout ``code`` first; what PYTHONPATH had stays behind it (a TPU host's wheels: PYTHONPATH=/tmp/site)."""
    return os.pathsep.join([str(code), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])


ANSWERS = ("colocated", "pd")  # the roles that answer a request alone


def run_node(role: str, model: str, caches: Path, tmp: Path, uds: bool = False, with_burst: bool = True,
             code: Path = REPO, extra_env: dict | None = None, keep_log: Path | None = None) -> dict:
    """Start one node of the checkout ``code`` (with ``extra_env`` set), wait for ready, ask it one question (a
    colocated or pd node), read its metrics, stop it; its log is copied to ``keep_log``."""
    port = free_port() if not uds else time.monotonic_ns() % 10**9  # a name for its files; no port then
    where = str(tmp / f"{role}-{port}.sock") if uds else port
    argv = [sys.executable, "-m", "fsm_pd.cli", "serve", "--role", role, "--model", model,
            *(["--uds", where] if uds else ["--port", str(port)])]
    if role in ("prefill", "decode"):
        argv += ["--journal", str(tmp / f"{role}-{port}.db")]
    if role == "pd":
        argv += ["--journal-dir", str(tmp / f"{role}-{port}")]
    if role == "prefill" and not uds:  # on unix sockets its bootstrap server listens beside --uds
        argv += ["--bootstrap-port", str(free_port())]
    env = {**os.environ, **secret_env(generate_secret()), "FSM_PD_COMPILE_CACHE": str(caches / "jax"),
           "FSM_PD_MODEL_CACHE": str(caches / "models"),
           "PYTHONPATH": python_path(code), **(extra_env or {})}
    log = tmp / f"{role}-{port}.log"
    client = client_for(where)
    started = time.time()
    with open(log, "w") as out:  # cwd: python -m puts it first on sys.path, before PYTHONPATH
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL, cwd=tmp)
    try:
        ready = _wait_ready(client, proc, log)
        result = {"ready_s": ready - started}
        if role in ANSWERS:
            response = client.post("/generate", json=QUESTION, timeout=300)
            if response.status_code != 200:
                raise RuntimeError(f"the first answer was {response.status_code}: {response.text[:300]}\n"
                                   f"{_tail(log)}")
            result["first_answer_s"] = time.time() - started
            result["answer"] = response.json().get("output_ids")
            if with_burst:
                result["burst_s"] = burst(client)
        text = client.get("/metrics", timeout=10).text
        result["phases"] = {labels["phase"]: value
                            for labels, value in metric_rows(text, "fsm_pd_startup_seconds")}
        # per kind, as it stood at ready (the metrics go on counting the background compile)
        result["kinds"] = (client.get("/server_info", timeout=10).json().get("startup") or {}).get(
            "programs_before_ready", {})
        result["compiles"] = {labels["phase"]: int(value)
                              for labels, value in metric_rows(text, "fsm_pd_compiles_total")}
        return result
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if keep_log is not None:
            keep_log.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(log, keep_log)


def _tail(log: Path, lines: int = 40) -> str:
    """The end of a node's log, for an error that must not lose it with the temporary directory."""
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(its log {log} cannot be read: {exc})"


def burst(client: httpx.Client, requests: int = 16, at_once: int = 8) -> float:
    """Right after the first answer (the background compile still running): ``requests`` prompts of 8 to 900 tokens,
    ``at_once`` at a time; the seconds they took. The node's serving compiles, read after, must still be 0."""
    lengths = [8 + (892 * i) // (requests - 1) for i in range(requests)]
    bodies = [{"input_ids": [(7 * i + j) % 250 + 10 for j in range(n)],  # within the tiny model's vocabulary too
               "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
              for i, n in enumerate(lengths)]
    started = time.time()
    with ThreadPoolExecutor(at_once) as pool:
        for response in pool.map(lambda body: client.post("/generate", json=body, timeout=600), bodies):
            response.raise_for_status()
    return time.time() - started


def _wait_ready(client: httpx.Client, proc: subprocess.Popen, log: Path, timeout: float = 900) -> float:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the node exited with {proc.returncode}; the end of its log:\n{_tail(log)}")
        try:
            if client.get("/health", timeout=2).status_code == 200:
                return time.time()
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"not ready within {timeout} s; the end of its log:\n{_tail(log)}")


def run_launch(model: str, caches: Path, tmp: Path, code: Path | None = None, uds: bool = False) -> float:
    """``fsm-pd launch`` until it prints its first answer; the seconds it reports from the command to it. ``code``:
    a checkout whose fsm_pd runs instead of this one (the baseline)."""
    env = {**os.environ, "FSM_PD_COMPILE_CACHE": str(caches / "jax"), "FSM_PD_MODEL_CACHE": str(caches / "models")}
    if code is not None:
        env["PYTHONPATH"] = python_path(code)
    run = tmp / f"launch-{time.monotonic_ns()}"
    argv = [sys.executable, "-m", "fsm_pd.cli", "launch", "--model", model,
            *(["--uds", str(run / "s")] if uds else ["--port", str(free_port())]), "--journal-dir", str(run)]
    # cwd: python -m puts it first on sys.path, before PYTHONPATH: run from this checkout, it would shadow ``code``
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                            stdin=subprocess.DEVNULL, cwd=tmp)
    try:
        for line in proc.stdout:
            match = re.search(r"first answer ([0-9.]+) s after the command", line)
            if match:
                return float(match.group(1))
        raise RuntimeError(f"fsm-pd launch exited with {proc.wait()} before its first answer")
    finally:
        proc.send_signal(2)  # SIGINT: launch stops the processes it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def checkout(ref: str, tmp: Path) -> Path:
    """The files of git revision ``ref``, unpacked under ``tmp`` (``git archive``: the repository is left as it is);
    ``ref`` itself where it is a directory (a checkout made before)."""
    if Path(ref).is_dir():
        return Path(ref).resolve()
    tree = tmp / "baseline"
    tree.mkdir()
    archive = subprocess.run(["git", "archive", ref], check=True, cwd=REPO, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def median_run(runs: list[dict]) -> dict:
    """The run whose time to ready is the median (its phases and kinds belong together)."""
    return sorted(runs, key=lambda r: r["ready_s"])[len(runs) // 2]


# the start-up phases, in order; device and weights run on threads of their own, beside the others
PHASES = ("imports", "device", "model", "weights", "engine", "programs")


def node_table(results: dict) -> Table:
    table = Table(title="one node, from its process's start (s; median run)")
    for column in ("code", "role", "cache", *PHASES, "ready", "first answer", "burst", "serving compiles"):
        table.add_column(column, justify="left" if column in ("code", "role", "cache") else "right")
    for (code, role, cache), r in results.items():
        p = r["phases"]
        table.add_row(code, role, cache, *(f"{p[k]:.1f}" if k in p else "-" for k in PHASES),
                      f"{r['ready_s']:.1f}", f"{r['first_answer_s']:.1f}" if "first_answer_s" in r else "-",
                      f"{r['burst_s']:.1f}" if "burst_s" in r else "-", str(r["compiles"].get("serving", 0)))
    return table


def kinds_table(results: dict) -> Table:
    table = Table(title="programs prepared before ready, per kind (count, from the compile cache, loaded as "
                        "serialized executables, executables refused and compiled over; seconds)")
    for column in ("code", "role", "cache", "kind", "programs", "from cache", "executables", "refused", "trace",
                   "lower", "backend", "load"):
        table.add_column(column, justify="left" if column in ("code", "role", "cache", "kind") else "right")
    for (code, role, cache), r in results.items():
        for kind, k in sorted(r["kinds"].items()):  # a baseline without serialized executables has no such figures
            table.add_row(code, role, cache, kind, str(k["programs"]), str(k["from_cache"]),
                          str(k.get("from_executable", "-")), str(k.get("refused", "-")),
                          *(f"{k[f'{step}_s']:.2f}" if f"{step}_s" in k else "-"
                            for step in ("trace", "lower", "backend", "load")))
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--roles", default="colocated,decode", help="comma-separated node roles to start alone")
    parser.add_argument("--no-launch", dest="launch", action="store_false", help="skip fsm-pd launch")
    parser.add_argument("--no-burst", dest="burst", action="store_false",
                        help="no burst of prompts after a node's first answer")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each (role, cache) and of each launch; medians are printed (default 1)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    parser.add_argument("--uds", action="store_true", help="serve over unix sockets (a TPU host allows no TCP)")
    parser.add_argument("--baseline", metavar="REF",
                        help="also time every node and fsm-pd launch, cold and warm, on git revision REF (or a "
                             "directory holding another checkout), each run beside this code's (so both see the "
                             "same load); ratios of the medians are printed")
    parser.add_argument("--against-env", metavar="NAME=VALUE",
                        help="as --baseline, on this code with the environment variable NAME set to VALUE")
    parser.add_argument("--warm", type=int, default=1, help="warm starts after each cold one (default 1)")
    parser.add_argument("--logs", type=Path, help="keep every node's log in this directory")
    args = parser.parse_args()
    if args.baseline and args.against_env:
        parser.error("--baseline or --against-env, not both")
    if args.against_env and "=" not in args.against_env:
        parser.error("--against-env takes NAME=VALUE")
    args.other = args.baseline or args.against_env
    with tempfile.TemporaryDirectory(prefix="fsm-pd-startup-") as tmp_name:
        tmp = Path(tmp_name)
        codes = {"this": (REPO, {})}  # name: (checkout, environment added)
        if args.baseline:
            codes[args.baseline] = (checkout(args.baseline, tmp), {})
        if args.against_env:
            codes[args.against_env] = (REPO, dict([args.against_env.split("=", 1)]))
        runs: dict = {}  # (code, role, cache): each run's figures
        for i in range(args.repeat):
            for role in [r for r in args.roles.split(",") if r]:  # --roles '': launch only
                for k, (name, (code, extra)) in enumerate(codes.items()):
                    caches = tmp / f"caches-{role}-{i}-{k}"  # a cold run's empty caches, then its warm runs'
                    for j, cache in enumerate(["cold", *["warm"] * args.warm]):
                        err.print(f"{role} ({name}), {cache}, run {i + 1} of {args.repeat}")
                        keep = args.logs / f"{role}-{k}-{i}-{j}-{cache}.log" if args.logs else None
                        figures = run_node(role, args.model, caches, tmp, uds=args.uds, with_burst=args.burst,
                                           code=code, extra_env=extra, keep_log=keep)
                        runs.setdefault((name, role, cache), []).append({**figures, "run": i})
            if args.launch:
                for k, (name, (code, _)) in enumerate(codes.items()):
                    caches = tmp / f"caches-launch-{i}-{k}"
                    for cache in ("cold", "warm"):
                        err.print(f"fsm-pd launch ({name}), {cache}, run {i + 1} of {args.repeat}")
                        runs.setdefault((name, "launch", cache), []).append(
                            {"ready_s": run_launch(args.model, caches, tmp, code=code, uds=args.uds)})
    report(runs, args)
    return 0 if same_answers(runs) else 1


def same_answers(runs: dict) -> bool:
    """Whether every node's first answer is the same (each warm start's its cold start's, each variant's this
    code's): printed either way."""
    answers = {(code, role, cache, r["run"], n): r["answer"] for (code, role, cache), found in runs.items()
               for n, r in enumerate(found) if "answer" in r}
    differ = [f"{code} {role} {cache} run {run + 1} ({n + 1}): {answer}" for (code, role, cache, run, n), answer
              in answers.items() if answer != answers.get(("this", role, "cold", 0, 0))]
    if differ:
        err.print("[red]answers differ from this code's first cold start:[/red] " + "; ".join(differ))
    elif answers:
        err.print(f"answers: all {len(answers)} first answers the same as their role's first cold start")
    return not differ


def report(runs: dict, args: argparse.Namespace) -> None:
    console = Console(width=200)  # the tables whole, also into a file
    nodes = {key: median_run(found) for key, found in runs.items() if key[1] != "launch"}
    if nodes:
        console.print(node_table(nodes))
        console.print(kinds_table(nodes))
        console.print("each run, (ready, first answer) s: " + "; ".join(
            f"{code} {role} {cache} {[(round(r['ready_s'], 1), round(r.get('first_answer_s', 0), 1)) for r in found]}"
            for (code, role, cache), found in runs.items() if role != "launch"))
    launches = {(code, cache): [r["ready_s"] for r in found] for (code, role, cache), found in runs.items()
                if role == "launch"}
    for (code, cache), found in launches.items():
        console.print(f"fsm-pd launch ({code}), {cache}: first answer {statistics.median(found):.1f} s after the "
                      f"command (median; each run: {found})")
    if args.other:
        ratios = []
        for (code, role, cache), found in runs.items():
            if code == "this" and (args.other, role, cache) in runs:
                this = statistics.median(r["ready_s"] for r in found)
                base = statistics.median(r["ready_s"] for r in runs[(args.other, role, cache)])
                what = "first answer" if role == "launch" else "ready"
                ratios.append(f"{role} {cache} {what} {this:.1f} s against {base:.1f} s: {this / base:.2f}x")
                phase = [statistics.median(r["phases"]["programs"] for r in rs if "programs" in r.get("phases", {}))
                         for rs in (found, runs[(args.other, role, cache)])
                         if any("programs" in r.get("phases", {}) for r in rs)]
                if len(phase) == 2:  # what serialized executables save is here: the ready set's programs
                    ratios.append(f"{role} {cache} programs phase {phase[0]:.1f} s against {phase[1]:.1f} s: "
                                  f"{phase[0] / phase[1]:.2f}x")
        console.print(f"this code against {args.other} (medians): " + "; ".join(ratios))
    if args.json:
        print(json.dumps({"nodes": {"/".join(key): r for key, r in nodes.items()},
                          "launch": {f"{code}/{cache}": found for (code, cache), found in launches.items()}},
                         indent=1))


if __name__ == "__main__":
    sys.exit(main())
