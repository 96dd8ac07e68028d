"""deploy/kubernetes, checked without a cluster: every kustomization renders with the real ``kubectl kustomize``, every
object validates against a current Kubernetes release's OpenAPI schemas (kubernetes-validate, strict: an unknown
field fails), and the manifests agree with the code: each command line parses with fsm-pd's own parsers, ports agree
between containers, Services, probes and the router's flags, probes name real routes of the apps, the grace period
outlasts the drain, and the router names every pod of each role (``k8s_manifests.py`` reads them)."""

from __future__ import annotations

import re
import tomllib
from urllib.parse import urlsplit

import pytest
from k8s_manifests import (
    OVERLAYS,
    RENDERED,
    REPO,
    WORKER_ROLES,
    container,
    container_port,
    objects,
    parsed,
    pod_names,
    pod_spec,
    render,
    workloads,
)
from real_parts import KUBECTL, KUBERNETES_VALIDATE

pytestmark = [KUBECTL, KUBERNETES_VALIDATE]
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


@pytest.fixture(params=RENDERED)
def rendered(request):
    return render(request.param)


def test_every_overlay_is_rendered():
    assert {"cpu-1p1d", "tpu-xpyd", "postgres-journal"} <= set(OVERLAYS)


MIN_KUBERNETES = "1.30"  # docs/deploy.md: the router's preStop sleep action is on by default from 1.30


@pytest.mark.parametrize("release", ["latest", MIN_KUBERNETES])
def test_objects_validate_against_kubernetes_schemas(rendered, release):
    """The newest release kubernetes-validate ships, and the oldest the docs name."""
    import kubernetes_validate

    version = kubernetes_validate.latest_version() if release == "latest" else release
    assert tuple(int(x) for x in version.split(".")[:2]) >= (1, 30), f"kubernetes-validate's newest is {version}"
    kinds = set()
    for obj in rendered:
        # strict: additionalProperties false, so a misspelt or misplaced field fails too; an unknown kind raises
        used = kubernetes_validate.validate(obj, version, strict=True)
        assert used == ".".join(version.split(".")[:2])  # that release's schemas, not an older one's
        kinds.add(obj["kind"])
    assert {"StatefulSet", "Deployment", "Service", "PodDisruptionBudget", "ServiceAccount"} <= kinds


def test_the_validator_refuses_a_misspelt_field():
    """The strict schemas do catch drift: a probe field spelt wrong is an error."""
    import copy

    import kubernetes_validate

    sts = copy.deepcopy(objects(render("base"), "StatefulSet")["fsm-pd-prefill"])
    container(sts)["readinessProbe"]["periodSecond"] = 5
    with pytest.raises(kubernetes_validate.ValidationError, match="periodSecond"):
        kubernetes_validate.validate(sts, kubernetes_validate.latest_version(), strict=True)


def test_every_command_line_parses_with_fsm_pds_own_parsers(rendered):
    roles = workloads(rendered)
    assert set(roles) == {"prefill", "decode", "router"}
    for role, workload in roles.items():
        line = parsed(workload)  # raises with argparse's message on an unknown flag or a bad value
        assert line.role == role
    prefill, decode = parsed(roles["prefill"]).args, parsed(roles["decode"]).args
    # the handshake compares the KV layouts: the model, its dtype and the page size must agree (TP may differ); the
    # decode node pulls with its own transfer backend, which must be the prefill's
    for field in ("model", "dtype", "page_size", "transfer_backend"):
        assert getattr(prefill, field) == getattr(decode, field), field


def test_nodes_advertise_their_pod_ip_and_keep_a_stable_identity(rendered):
    for role in WORKER_ROLES:
        ctr = container(workloads(rendered)[role])
        env = {e["name"]: e for e in ctr["env"]}
        args = parsed(workloads(rendered)[role]).args
        assert args.host == "0.0.0.0" and args.advertise_host == "10.0.0.7"  # placeholder of status.podIP
        assert env[_var(ctr, "--advertise-host")]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env[_var(ctr, "--node-id")]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        # the side-channel secret comes from a Secret, never from the manifests
        assert "--side-channel-secret" not in ctr["command"] + ctr.get("args", [])
        assert env["FSM_PD_SIDE_CHANNEL_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "fsm-pd-secrets"
    # every node of the fleet signs its side channel with the same secret
    refs = {role: {e["name"]: e for e in container(workloads(rendered)[role])["env"]}["FSM_PD_SIDE_CHANNEL_SECRET"]
            for role in WORKER_ROLES}
    assert refs["prefill"] == refs["decode"]
    # the prefill's bootstrap server listens beyond loopback: its writes need the token, from the Secret too
    assert parsed(workloads(rendered)["prefill"]).args.bootstrap_token


def _var(ctr: dict, flag: str) -> str:
    """The variable a flag's value names: --advertise-host $(POD_IP) -> POD_IP."""
    words = ctr["command"] + ctr.get("args", [])
    value = words[words.index(flag) + 1]
    assert value.startswith("$(") and value.endswith(")"), f"{flag} {value} is not a $(VAR)"
    return value[2:-1]


def test_ports_agree_between_containers_services_probes_and_the_router(rendered):
    roles = workloads(rendered)
    services = objects(rendered, "Service")
    pods: dict[str, tuple[str, dict]] = {}  # the router's host name for each pod -> (role, its StatefulSet)
    for role in WORKER_ROLES:
        sts = roles[role]
        ctr, args = container(sts), parsed(sts).args
        ports = {p["name"]: p["containerPort"] for p in ctr["ports"]}
        assert ports["http"] == args.port
        if role == "prefill":
            assert ports["bootstrap"] == args.bootstrap_port
        for probe in PROBES:
            assert container_port(ctr, ctr[probe]["httpGet"]["port"]) == args.port, probe
        # the headless Service gives each pod its DNS name: POD.SERVICE
        svc = services[sts["spec"]["serviceName"]]
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"].get("publishNotReadyAddresses") is True
        _selects(svc, sts)
        for port in svc["spec"]["ports"]:
            assert container_port(ctr, port["targetPort"]) == port["port"], (svc["metadata"]["name"], port)
        pods |= {f"{pod}.{svc['metadata']['name']}": (role, sts) for pod in pod_names(sts)}

    router, named = parsed(roles["router"]).args, {"prefill": [], "decode": []}
    for url, *boot in [*router.prefill, *([u] for u in router.decode)]:
        role, sts = pods.get(urlsplit(url).hostname, (None, None))
        assert sts is not None, f"the router names {url}, which is no pod of a prefill or decode StatefulSet"
        assert (url in router.decode) == (role == "decode"), f"{url} is a {role} pod"
        args = parsed(sts).args
        assert urlsplit(url).port == args.port, url
        if role == "prefill":
            assert boot and int(boot[0]) == args.bootstrap_port, f"--prefill {url} {boot}"
        named[role].append(urlsplit(url).hostname)
    for role in WORKER_ROLES:  # every pod once: scaling a role means changing its replicas and this list together
        sts = roles[role]
        expected = [f"{pod}.{sts['spec']['serviceName']}" for pod in pod_names(sts)]
        assert sorted(named[role]) == sorted(expected), f"the router's {role} workers vs the StatefulSet's pods"

    ctr = container(roles["router"])
    assert {p["name"]: p["containerPort"] for p in ctr["ports"]}["http"] == router.port
    svc = services["fsm-pd-router"]
    _selects(svc, roles["router"])
    assert [container_port(ctr, p["targetPort"]) for p in svc["spec"]["ports"]] == [router.port]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container_port(ctr, ctr[probe]["httpGet"]["port"]) == router.port


def _selects(service: dict, workload: dict) -> None:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items(), service["metadata"]["name"]


def answers_get(app, path: str) -> bool:
    """Whether ``app`` routes ``GET path`` to a handler: Starlette's own matching, which the server runs for each
    request (a 404 or 405 otherwise)."""
    from starlette.routing import Match

    scope = {"type": "http", "method": "GET", "path": path, "root_path": "", "headers": [], "query_string": b""}
    return any(route.matches(scope)[0] == Match.FULL for route in app.router.routes)


def worker_app(role: str):
    """The app a node of ``role`` serves (``create_app``, as ``run_node`` builds it), over a stub engine."""
    from stub_engine import StubEngine, stub_tokenizer

    from fsm_pd.api import create_app

    return create_app(StubEngine(role=role), stub_tokenizer(), bootstrap_port=8998)


def router_app():
    from fsm_pd.router.app import create_router_app

    return create_router_app(["http://127.0.0.1:1"], ["http://127.0.0.1:2"])


def test_route_matching_tells_a_route_from_none():
    app = worker_app("prefill")
    assert answers_get(app, "/livez") and not answers_get(app, "/livezz") and not answers_get(app, "/generate")


def test_probes_point_at_the_apps_real_routes(rendered):
    """Startup waits for /startupz (ready once), readiness follows /health (starting, draining, unhealthy: 503),
    liveness /livez (503 only once the engine cannot serve again): operations.md, "Start-up, readiness and probes".
    The router's readiness is /readiness (503 until a worker it needs is ready), its liveness /liveness. Each path
    must be a GET route of the app the container serves."""
    meaning = {"startupProbe": "/startupz", "readinessProbe": "/health", "livenessProbe": "/livez"}
    router_meaning = {"readinessProbe": "/readiness", "livenessProbe": "/liveness"}
    for role, workload in workloads(rendered).items():
        ctr = container(workload)
        app = router_app() if role == "router" else worker_app(role)
        for probe in PROBES:
            if probe not in ctr:
                assert role == "router", f"{role} has no {probe}"
                continue
            path = ctr[probe]["httpGet"]["path"]
            assert answers_get(app, path), f"{role}'s {probe} GETs {path}, not a route of its app"
            assert path == (router_meaning if role == "router" else meaning)[probe], f"{role}'s {probe} is {path}"


def test_termination_outlasts_the_drain(rendered):
    """SIGTERM drains: --drain-timeout-secs for the open requests, then deregistration and the journal's close; the
    kubelet's SIGKILL comes after terminationGracePeriodSeconds, which must leave room for all of it."""
    for role in WORKER_ROLES:
        workload = workloads(rendered)[role]
        grace = pod_spec(workload)["terminationGracePeriodSeconds"]
        drain = parsed(workload).args.drain_timeout_secs
        assert grace >= drain + 10, f"{role}: grace {grace} s against a drain of {drain} s"
        assert "preStop" not in container(workload).get("lifecycle", {}), "SIGTERM itself drains"


def test_rolling_updates_keep_a_ready_node_of_each_role(rendered):
    """A StatefulSet replaces one pod at a time and waits until the new one is ready for minReadySeconds, longer than
    the router takes to send it requests (it checks an out-of-rotation worker every OUT_CHECK_INTERVAL_S); with two
    or more pods a role always has a ready one. The router surges. PodDisruptionBudgets keep one of each."""
    from fsm_pd.router.fleet import OUT_CHECK_INTERVAL_S

    roles = workloads(rendered)
    for role in WORKER_ROLES:
        spec = roles[role]["spec"]
        assert spec["updateStrategy"]["type"] == "RollingUpdate"
        assert spec.get("minReadySeconds", 0) > OUT_CHECK_INTERVAL_S + 5  # + the readiness probe's lag
        assert spec["updateStrategy"].get("rollingUpdate", {}).get("maxUnavailable", 1) == 1
    strategy = roles["router"]["spec"]["strategy"]
    assert strategy["rollingUpdate"]["maxUnavailable"] == 0 and strategy["rollingUpdate"]["maxSurge"] >= 1
    budgets = {obj["spec"]["selector"]["matchLabels"].get("app.kubernetes.io/component"): obj["spec"]
               for obj in objects(rendered, "PodDisruptionBudget").values()}
    assert {role: b.get("minAvailable") for role, b in budgets.items()} == {r: 1 for r in roles}


def test_the_base_and_the_tpu_fleet_update_without_a_gap():
    """Two pods or more per role (the cpu-1p1d overlay's single nodes cannot; docs/deploy.md says so)."""
    for kustomization in ("base", "overlays/tpu-xpyd", "overlays/postgres-journal"):
        for role, workload in workloads(render(kustomization)).items():
            assert workload["spec"]["replicas"] >= 2, (kustomization, role)


def test_tpu_overlay_asks_for_tpus_and_splits_tp_differently():
    roles = workloads(render("overlays/tpu-xpyd"))
    tps = {}
    for role in WORKER_ROLES:
        spec, tp = pod_spec(roles[role]), parsed(roles[role]).args.tp
        chips = int(container(roles[role])["resources"]["limits"]["google.com/tpu"])
        assert chips == tp, f"{role}: --tp {tp} on {chips} chips"
        rows, cols = (int(n) for n in spec["nodeSelector"]["cloud.google.com/gke-tpu-topology"].split("x"))
        assert rows * cols == chips, f"{role}: topology {rows}x{cols} for {chips} chips"
        assert spec["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"]
        tps[role] = tp
    assert tps["prefill"] != tps["decode"]


def test_postgres_overlay_takes_the_journal_url_from_a_secret():
    from fsm_pd.store.database import journal_url

    for role in WORKER_ROLES:
        workload = workloads(render("overlays/postgres-journal"))[role]
        ctr = container(workload)
        env = {e["name"]: e for e in ctr["env"]}
        name = _var(ctr, "--journal")
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "fsm-pd-journal", "key": "url"}
        assert "value" not in env[name]
        assert journal_url("postgresql://u:p@db:5432/fsm").startswith("postgresql+psycopg://")


def test_pods_run_locked_down_and_write_only_to_volumes(rendered):
    """Non-root, read-only root filesystem, no capabilities, RuntimeDefault seccomp, no service-account token; what a
    node writes (its journal file, the compile and model caches) lies on its volume claim, so a restarted pod finds
    its journal and starts with a warm compile cache; /tmp is an emptyDir."""
    for role, workload in workloads(rendered).items():
        spec, ctr = pod_spec(workload), container(workload)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
        sc = ctr["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        mounts = {m["mountPath"]: m["name"] for m in ctr["volumeMounts"]}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        assert "emptyDir" in volumes[mounts["/tmp"]]
        if role == "router":
            continue
        claims = {t["metadata"]["name"] for t in workload["spec"]["volumeClaimTemplates"]}
        env = {e["name"]: e.get("value") for e in ctr["env"]}
        journal = parsed(workload).args.journal
        writes = [env["FSM_PD_COMPILE_CACHE"], env["FSM_PD_MODEL_CACHE"]]
        writes += [journal] if "://" not in journal else []
        for path in writes:
            mount = max((m for m in mounts if path.startswith(m.rstrip("/") + "/")), key=len, default=None)
            assert mount is not None and mounts[mount] in claims, f"{role} writes {path} outside its volume claim"


def test_labels_follow_the_recommended_ones(rendered):
    for obj in rendered:
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "fsm-pd" and labels["app.kubernetes.io/part-of"] == "fsm-pd"
    for role, workload in workloads(rendered).items():
        assert workload["metadata"]["labels"]["app.kubernetes.io/component"] == role
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector == {"app.kubernetes.io/name": "fsm-pd", "app.kubernetes.io/component": role}
        assert selector.items() <= workload["spec"]["template"]["metadata"]["labels"].items()


def test_image_is_the_projects_version(rendered):
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for workload in workloads(rendered).values():
        image = container(workload)["image"]
        assert image.startswith("fsm-pd:" + version), image


def test_the_docs_create_every_secret_key_the_pods_read():
    """docs/deploy.md's `kubectl create secret generic NAME --from-literal=KEY=...` commands make what the manifests'
    secretKeyRefs name (the optional ones included)."""
    lines = (REPO / "docs" / "deploy.md").read_text().replace("\\\n", " ").splitlines()  # continuations joined
    created = {(command.group(1), key) for line in lines
               if (command := re.search(r"kubectl create secret generic (\S+)", line))
               for key in re.findall(r"--from-literal=([\w.-]+)=", line)}
    read = {(ref["name"], ref["key"]) for kustomization in RENDERED
            for workload in workloads(render(kustomization)).values()
            for entry in container(workload).get("env", []) if (ref := entry.get("valueFrom", {}).get("secretKeyRef"))}
    assert read and read == created
