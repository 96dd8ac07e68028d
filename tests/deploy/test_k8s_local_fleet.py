"""The cpu-1p1d overlay's rendered command lines serve a request: its prefill, decode and router containers run as
local processes on 127.0.0.1, each with its container's command, args and environment as the kubelet would give
them, and a chat completion goes through the router.

What differs from a pod, and nothing else (``LocalPods``):

- addresses: every pod is 127.0.0.1 (``status.podIP``, the ``--host 0.0.0.0`` bind, the router's POD.SERVICE names);
- ports: every (pod, container port) gets a free local port, since all pods listen on 30000 (``--port``,
  ``--bootstrap-port``, the ports in the router's URLs and its bootstrap port);
- paths: what lies under a volume mount lies under this test's temporary directory (journal, caches);
- the model: ``--model`` names the built-in tiny model instead of SmolLM2 (``fsm-pd serve --model tiny``), and
  ``FSM_PD_SKIP_SERVER_WARMUP=1`` skips the warm-up, as for every test node (tests/conftest.py); no other FSM_PD_*
  variable of the test's environment reaches the processes;
- the Secrets' keys are generated here; ``fsm-pd`` is this interpreter's ``-m fsm_pd.cli`` (the same entry point).

At the end each process gets SIGTERM, as the kubelet sends it, and must drain and exit 0 within the pod's
terminationGracePeriodSeconds.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
from k8s_manifests import (
    argv,
    container,
    environment,
    pod_names,
    pod_spec,
    render,
    workloads,
)
from real_parts import KUBECTL, KUBERNETES_VALIDATE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))  # the integration tests' helpers

from processes import Cluster, wait_health  # noqa: E402

from fsm_pd.cli.launch import free_port  # noqa: E402
from fsm_pd.transport import generate_secret  # noqa: E402

pytestmark = [KUBECTL, KUBERNETES_VALIDATE, pytest.mark.timeout(240)]
LOCAL_MODEL = "tiny"
PORT_FLAGS = ("--port", "--bootstrap-port")
SUITE_ENV = {"FSM_PD_SKIP_SERVER_WARMUP": "1"}


class LocalPods:
    """The overlay's pods mapped onto this machine: one local port per (pod, container port), one directory per
    (pod, volume), generated Secret values."""

    def __init__(self, rendered, tmp: Path):
        self.tmp, self.roles = tmp, workloads(rendered)
        self.secrets: dict[tuple[str, str], str] = {}
        self.ports: dict[tuple[str, int], int] = {}
        self.hosts: dict[str, str] = {}  # the router's host name of a pod (POD.SERVICE) -> the pod
        for role in ("prefill", "decode"):
            sts = self.roles[role]
            for pod in pod_names(sts):
                self.hosts[f"{pod}.{sts['spec']['serviceName']}"] = pod
                for port in container(sts)["ports"]:
                    self.ports[(pod, port["containerPort"])] = free_port()
        router = self.roles["router"]
        self.router_pod = router["metadata"]["name"] + "-local"
        for port in container(router)["ports"]:
            self.ports[(self.router_pod, port["containerPort"])] = free_port()

    def secret(self, name: str, key: str) -> str:
        if (name, key) not in self.secrets:  # the side-channel secret is hex; the tokens and the API key any text
            hexed = generate_secret().hex() if key == "side-channel-secret" else secrets.token_hex(16)
            self.secrets[(name, key)] = hexed
        return self.secrets[(name, key)]

    def url(self, role: str, pod: str) -> str:
        """Where the pod's container port named http listens here."""
        (http,) = [p["containerPort"] for p in container(self.roles[role])["ports"] if p["name"] == "http"]
        return f"http://127.0.0.1:{self.ports[(pod, http)]}"

    def value_from(self, pod: str):
        def resolve(source: dict) -> str:
            if "fieldRef" in source:
                return {"status.podIP": "127.0.0.1", "metadata.name": pod}[source["fieldRef"]["fieldPath"]]
            ref = source["secretKeyRef"]
            return self.secret(ref["name"], ref["key"])  # optional ones too: the API key is exercised
        return resolve

    def local_path(self, pod: str, mounts: dict[str, str], text: str) -> str:
        for mount, volume in sorted(mounts.items(), key=lambda m: -len(m[0])):
            if text == mount or text.startswith(mount.rstrip("/") + "/"):
                return str(self.tmp / pod / volume) + text[len(mount.rstrip("/")):]
        return text

    def local_url(self, url: str) -> str:
        parts = urlsplit(url)
        pod = self.hosts[parts.hostname]
        return urlunsplit(parts._replace(netloc=f"127.0.0.1:{self.ports[(pod, parts.port)]}"))

    def process(self, role: str, pod: str) -> tuple[list[str], dict[str, str]]:
        """The pod's process here: (argv, environment)."""
        ctr = container(self.roles[role])
        mounts = {m["mountPath"]: m["name"] for m in ctr.get("volumeMounts", [])}
        env = {name: self.local_path(pod, mounts, value)
               for name, value in environment(ctr, self.value_from(pod)).items()}
        # literal paths are mapped before $(VAR) expansion: the values of variables are mapped already
        words = argv({**ctr, "command": [self.local_path(pod, mounts, w) for w in ctr["command"]],
                      "args": [self.local_path(pod, mounts, w) for w in ctr.get("args", [])]}, env)
        assert not [w for w in words if "$(" in w], f"unexpanded references in {words}"
        local, last_url_pod = [], None
        for i, word in enumerate(words):
            flag = words[i - 1] if i else ""
            if flag == "--host":
                word = "127.0.0.1"
            elif flag in PORT_FLAGS:
                word = str(self.ports[(pod, int(word))])
            elif flag == "--model":
                word = LOCAL_MODEL
            elif word.startswith("http://"):
                last_url_pod = self.hosts[urlsplit(word).hostname]
                word = self.local_url(word)
            elif flag.startswith("http://") and words[i - 2] == "--prefill" and word.isdigit():
                word = str(self.ports[(last_url_pod, int(word))])  # the prefill pod's bootstrap port
            local.append(word)
        assert local[0] == "fsm-pd", local
        for path in {self.local_path(pod, mounts, m) for m in mounts}:
            Path(path).mkdir(parents=True, exist_ok=True)  # an emptyDir or a fresh volume claim: an empty directory
        # nothing of fsm-pd's in this test's environment stands in for what the manifest must give, but the warm-up
        # skip every test node gets
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("FSM_PD_")}
        return [sys.executable, "-m", "fsm_pd.cli", *local[1:]], {**inherited, **SUITE_ENV, **env}


def test_rendered_1p1d_commands_serve_a_request_through_the_router(tmp_path):
    pods = LocalPods(render("overlays/cpu-1p1d"), tmp_path)
    cluster = Cluster(tmp_path)
    nodes = {}
    try:
        for role in ("prefill", "decode"):
            (pod,) = pod_names(pods.roles[role])  # 1P1D
            words, env = pods.process(role, pod)
            assert words[words.index("--advertise-host") + 1] == "127.0.0.1"
            nodes[role] = (pod, cluster.launch(pod, words, env))
        for role, (pod, proc) in nodes.items():
            wait_health(pods.url(role, pod), proc, timeout=180)
        words, env = pods.process("router", pods.router_pod)
        router_proc = cluster.launch("router", words, env)
        router = pods.url("router", pods.router_pod)
        wait_admitted(router, router_proc)

        key = pods.secrets[("fsm-pd-secrets", "api-key")]
        # over the router's --local-prefill-max-tokens (256; the router estimates 304 tokens): a prompt its default
        # policy hands over, where a short one would be served whole on the decode node
        question = "Name a colour of the sea. " * 40
        body = {"messages": [{"role": "user", "content": question}], "max_tokens": 8, "temperature": 0}
        refused = httpx.post(router + "/v1/chat/completions", json=body, timeout=30)
        assert refused.status_code == 401, refused.text  # the Secret's api-key reached the router
        answer = httpx.post(router + "/v1/chat/completions", json=body, timeout=120,
                            headers={"Authorization": f"Bearer {key}"})
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert choice["message"]["content"] and answer.json()["usage"]["completion_tokens"] >= 1
        # the KV went across (a failed handoff would still answer: the decode node recomputes the prompt itself),
        # so the advertised addresses, the bootstrap port and the shared secret all worked
        for role, (pod, _) in nodes.items():
            assert transfers(pods.url(role, pod)) == {"success": 1.0}, role
        # the journals went to the volume's local stand-in, one per node, named by the pod (--node-id $(POD_NAME))
        for role, (pod, _) in nodes.items():
            assert (tmp_path / pod / "data" / "journal" / f"{pod}.db").is_file(), role

        # the kubelet's SIGTERM: each node drains and exits 0 within its grace period
        for role, (pod, proc) in nodes.items():
            grace = pod_spec(pods.roles[role])["terminationGracePeriodSeconds"]
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=grace) == 0, f"{pod} exited with {proc.returncode}"
            assert time.monotonic() - started < grace
    finally:
        cluster.stop()


def transfers(node: str) -> dict[str, float]:
    """The node's ended KV transfers by outcome, from its /metrics (fsm_pd_transfers_ended_total)."""
    from prometheus_client.parser import text_string_to_metric_families

    ended: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(node + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "fsm_pd_transfers_ended_total" and sample.value:
                ended[sample.labels["outcome"]] = ended.get(sample.labels["outcome"], 0.0) + sample.value
    return ended


def wait_admitted(router: str, proc, timeout: float = 60) -> None:
    """Until the router answers /health and has taken its one prefill and one decode worker in."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"the router exited with {proc.returncode}"
        try:
            said = httpx.get(router + "/health", timeout=2).json()
            if said.get("checked") and said.get("admitted") == {"prefill": 1, "decode": 1}:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the router at {router} did not take its workers in within {timeout} s")
