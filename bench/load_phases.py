"""Where a load run's time to first token went, as the servers saw it (``load.py``).

Each server keeps ``fsm_pd_request_phase_seconds`` (queue, prefill, admission, first_token) and, on a PD engine,
``fsm_pd_transfer_phase_seconds`` (bootstrap, waiting, transfer), per role: ``serving/request_phases.py``. Read
before and after a run, their sums and counts give each phase's mean per request over that run; beside the client's
mean TTFT, what is left is the path outside the engines (the router, the HTTP apps, the stream's first chunk). A
``--role pd`` process shows both engines' phases on one ``/metrics``; a colocated node its own.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fsm_pd.net import unix_http

FAMILIES = {"fsm_pd_request_phase_seconds": "", "fsm_pd_transfer_phase_seconds": "transfer "}
ROLE_LETTER = {"prefill": "P", "decode": "D", "colocated": "C"}


def read(url: str) -> dict[str, tuple[float, float]]:
    """``{"ROLE phase": (sum, count)}`` from the server's ``/metrics``; empty where it cannot be read."""
    try:
        with unix_http.client(timeout=10) as http:
            return parse(http.get(url + "/metrics").text)
    except httpx.HTTPError:
        return {}


def parse(text: str) -> dict[str, tuple[float, float]]:
    """``read``'s figures from a ``/metrics`` text."""
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        prefix = FAMILIES.get(family.name)
        if prefix is None:
            continue
        for sample in family.samples:
            kind = sample.name.removeprefix(family.name)
            if kind not in ("_sum", "_count"):
                continue
            role = ROLE_LETTER.get(sample.labels.get("role", ""), sample.labels.get("role", "?"))
            entry = out.setdefault(f"{role} {prefix}{sample.labels.get('phase', '?')}", [0.0, 0.0])
            entry[kind == "_count"] += sample.value
    return {name: (s, n) for name, (s, n) in out.items()}


def means_ms(before: dict, after: dict) -> dict[str, float]:
    """Each phase's mean per request between two ``read``s, in ms (phases no request passed left out)."""
    means = {}
    for name, (s, n) in after.items():
        s0, n0 = before.get(name, (0.0, 0.0))
        if n > n0:
            means[name] = round((s - s0) / (n - n0) * 1000, 2)
    return means


def lines(report: dict) -> list[str]:
    """One row per target and mix (the first run's phases beside its client's mean TTFT)."""
    rows = []
    for name, result in report["targets"].items():
        for run in result.get("runs", [])[:1]:
            for mix, figures in run.get("mixes", {}).items():
                if figures.get("phases_ms"):
                    phases = ", ".join(f"{phase} {value:.1f}" for phase, value in figures["phases_ms"].items())
                    ttft = figures.get("ttft_mean_s")
                    rows.append(f"| {name} | {mix} | {'-' if ttft is None else f'{ttft * 1000:.1f}'} | {phases} |")
    if not rows:
        return []
    return ["", "Where the TTFT went (run 1, means per request, ms; P prefill engine, D decode engine, C colocated; "
            "first_token: from the request's arrival at that engine):", "",
            "| target | mix | client TTFT mean | the servers' phases |", "| --- | --- | ---: | --- |", *rows]
