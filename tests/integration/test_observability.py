"""Observability on a real 1P1D cluster (tiny model, tcp transfers) behind the built-in router and the real
sglang-router: SGLang's timing fields in ``meta_info`` (whole and streamed), the per-phase histograms and outcome
counters in each node's ``/metrics``, the failed-room log line and its replay command, and the Grafana dashboard's
PromQL checked against what the nodes really export.

A failed transfer is made with the decode node's fault injection (``FSM_PD_FAULT_PULL=1``), held off by a pause file
until the successful requests are counted. Where the ``prometheus`` binary is installed (Debian: ``apt-get install
prometheus``), a real Prometheus scrapes the two nodes and runs every dashboard query. One cluster for the module;
processes stopped by PID; 127.0.0.1 only.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from processes import Cluster, dies_with_parent, free_port
from prometheus_client.parser import text_string_to_metric_families

from fsm_pd.store import read_journal

TIMEOUT_S = 120
PHASE_FIELDS = ("bootstrap_duration", "waiting_duration", "transfer_duration")
DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
BODY = {"text": "observe me", "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("observability")
    pause = tmp / "pause-faults"
    pause.touch()
    c = Cluster(tmp)
    c.env.update({"FSM_PD_FAULT_PULL": "1", "FSM_PD_FAULT_PAUSE_FILE": str(pause)})  # pull is decode's stage only
    try:
        p, boot, d = c.pd("tcp")
        urls = {"prefill": p, "decode": d, "router": c.router(p, boot, d)}
        try:
            import sglang_router  # noqa: F401

            port = free_port()
            urls["sglang-router"] = c.start("sglang-router", [
                sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill", p, str(boot),
                "--decode", d, "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(free_port()), "--policy", "random"], f"http://127.0.0.1:{port}")
        except ImportError:
            pass
        yield c, urls, pause
    finally:
        c.stop()


def scrape(url: str) -> dict[tuple, float]:
    """``/metrics`` as (sample name, labels without node/role) -> value."""
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200
    found = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("role", "node")))
            found[(s.name, labels)] = s.value
    return found


def ended(found: dict, outcome: str, reason: str) -> float:
    return found[("fsm_pd_transfers_ended_total", (("outcome", outcome), ("reason", reason)))]


def assert_timing(meta: dict) -> None:
    for name in (*PHASE_FIELDS, "queue_time"):
        assert isinstance(meta[name], float) and meta[name] >= 0, (name, meta)
    # the decode's room is created after its request arrived: the phases fit inside the request's latency
    assert sum(meta[name] for name in (*PHASE_FIELDS, "queue_time")) <= meta["e2e_latency"] + 0.01, meta


def stream_chunks(url: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=TIMEOUT_S) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                chunks.append(json.loads(line[5:]))
    return chunks


def test_timing_metrics_failures_and_dashboard(cluster):
    c, urls, pause = cluster
    routers = [urls[name] for name in ("router", "sglang-router") if name in urls]
    done = 0
    for url in routers:
        r = httpx.post(url + "/generate", json=BODY, timeout=TIMEOUT_S)
        assert r.status_code == 200, r.text
        assert_timing(r.json()["meta_info"])
        chunks = stream_chunks(url, BODY)
        assert len(chunks) == 3  # one per token; the first already has the transfer's timing
        for chunk in chunks:
            assert_timing(chunk["meta_info"])
        assert len({chunk["meta_info"]["transfer_duration"] for chunk in chunks}) == 1  # one transfer, one figure
        done += 2

    # every transfer done so far, counted once per phase on each role, all successes
    for role in ("prefill", "decode"):
        found = scrape(urls[role])
        for phase in ("bootstrap", "waiting", "transfer"):
            assert found[("fsm_pd_transfer_phase_seconds_count", (("phase", phase),))] == done, (role, phase)
        assert ended(found, "success", "none") == done
        assert sum(v for (name, labels), v in found.items()
                   if name == "fsm_pd_transfers_ended_total" and ("outcome", "failed") in labels) == 0

    # now the decode node's pulls fail: one request through the built-in router (which may retry it: every attempt
    # is a room of its own, and fails the same way)
    pause.unlink()
    httpx.post(urls["router"] + "/generate", json={**BODY, "rid": "obs-failed-1"}, timeout=TIMEOUT_S)
    failed = ended(scrape(urls["decode"]), "failed", "transfer_error")
    assert failed >= 1
    deadline = time.time() + 30
    while time.time() < deadline and ended(scrape(urls["prefill"]), "failed", "peer_aborted") < failed:
        time.sleep(0.2)  # the prefill side fails its room when the decode node's ABORT arrives
    for role in ("prefill", "decode"):
        found = scrape(urls[role])
        classes = {labels: v for (name, labels), v in found.items()
                   if name == "fsm_pd_transfers_ended_total" and ("outcome", "failed") in labels and v}
        reason = "transfer_error" if role == "decode" else "peer_aborted"
        assert classes == {(("outcome", "failed"), ("reason", reason)): failed}, (role, classes)
        # a failure is not a success, and is not timed into the phase histograms
        assert ended(found, "success", "none") == done
        assert found[("fsm_pd_transfer_phase_seconds_count", (("phase", "transfer"),))] == done

    # the decode node logged each failed room in one JSON line, whose replay command explains it
    node = f"decode-{urls['decode'].rsplit(':', 1)[1]}"
    log = (c.tmp / f"{node}.log").read_text()
    records = [json.loads(line[line.index("{"):]) for line in log.splitlines() if '"event":"failed_room"' in line]
    assert len(records) == failed
    journal = c.tmp / f"{node}.db"
    for record in records:
        assert record["role"] == "decode" and record["node"] == node and record["state"] == "Transferring"
        assert record["reason_class"] == "transfer_error" and "injected fault" in record["reason"]
        first_row = next(r for r in read_journal(journal) if r.room == record["room"])
        assert record["rid"] == first_row.event["rid"] == "obs-failed-1"  # the client's, journaled with the room
    argv = shlex.split(records[0]["replay"])
    assert argv == ["fsm-pd", "replay", "--room", str(records[0]["room"]), str(journal)]
    replayed = subprocess.run([sys.executable, "-m", "fsm_pd.cli", *argv[1:]], capture_output=True, text=True,
                              timeout=60)
    assert replayed.returncode == 0, replayed.stderr
    assert "pull failed" in replayed.stdout and "Transferring -> Failed" in replayed.stdout

    # every metric the dashboard queries, with the labels it filters on, is in a real node's /metrics
    exported: dict[str, set[str]] = {}
    for role in ("prefill", "decode"):
        text = httpx.get(urls[role] + "/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                exported.setdefault(s.name, set()).update(s.labels)
    selectors = dashboard_selectors(json.loads(DASHBOARD.read_text()))
    assert len(selectors) >= 15
    for metric, labels in selectors:
        assert metric in exported, f"the dashboard queries {metric}, which no node exports"
        assert labels <= exported[metric] | {"instance", "job"}, (metric, labels - exported[metric])


SELECTOR = re.compile(r"\b(fsm_pd_[a-z0-9_]+)\s*(\{[^}]*\})?")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)")


def dashboard_selectors(dashboard: dict) -> list[tuple[str, set[str]]]:
    """(metric, label names it filters on) of every fsm-pd series selector in the panels' PromQL."""
    found = []
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert exprs and all("fsm_pd_" in e for e in exprs)
    for expr in exprs:
        for metric, braces in SELECTOR.findall(expr):
            found.append((metric, {m[0] for m in MATCHER.findall(braces or "")}))
    return found


@pytest.mark.real_part("prometheus", missing=None if shutil.which("prometheus") else
                       "prometheus is not on PATH (apt-get install prometheus)")
def test_a_real_prometheus_runs_every_dashboard_query(cluster, tmp_path):
    """After the test above: Prometheus scrapes both nodes and answers each panel's PromQL with series."""
    _, urls, _ = cluster
    port = free_port()
    targets = [urls[role].split("//", 1)[1] for role in ("prefill", "decode")]
    config = tmp_path / "prometheus.yml"  # JSON is YAML
    scrape = {"job_name": "fsm-pd", "static_configs": [{"targets": targets}]}
    config.write_text(json.dumps({"global": {"scrape_interval": "1s"}, "scrape_configs": [scrape]}))
    api = f"http://127.0.0.1:{port}"
    with open(tmp_path / "prometheus.log", "w") as log:
        proc = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=dies_with_parent())
    try:
        def query(expr: str) -> list:
            r = httpx.get(api + "/api/v1/query", params={"query": expr}, timeout=10)
            assert r.status_code == 200 and r.json()["status"] == "success", (expr, r.text)
            return r.json()["data"]["result"]

        deadline = time.time() + 60
        while time.time() < deadline:  # ready, both targets up, with enough scrapes for a rate over 10 s
            try:
                ready = httpx.get(api + "/-/ready", timeout=5).status_code == 200
            except httpx.HTTPError:
                ready = False
            if ready and len(query("count_over_time(up[10s]) >= 3")) == 2:
                break
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
            time.sleep(0.5)
        else:
            raise AssertionError("prometheus did not scrape both nodes three times")
        exprs = [t["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for t in panel.get("targets", [])]
        empty = []
        for expr in exprs:
            concrete = expr.replace("$__rate_interval", "10s").replace("$node", ".*").replace("$instance", ".*")
            if not query(concrete):
                empty.append(expr)
        # only the error panel may be empty: no request was answered with an error status
        assert all('status!~"2.."' in expr for expr in empty), empty
    finally:
        proc.terminate()
        proc.wait(timeout=20)
