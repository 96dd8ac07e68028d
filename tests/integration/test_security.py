"""Security checks across the HTTP APIs, the bootstrap server and the wires (issue 7, part 4).

- The optional API key guards every route of an engine server and of the router (whole, streamed and OpenAI
  requests included), except the health and metrics probes.
- The bootstrap server's token guards its writes, end to end through the CLI process and fsm-pd's own client.
- Request bodies are bounded: an oversized body is 413 on the engine API, the router and the bootstrap server,
  whether it declares its length or comes chunked.
- Nothing in the package can unpickle: no pickle-family import or call anywhere, and a side-channel exchange plus a
  zmq-backend transfer run with unpickling disabled.
- Nodes listen on 127.0.0.1 unless told otherwise: every listening socket of real `fsm-pd serve` processes.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import openai
import pytest
from polling import until
from processes import dies_with_parent, free_port, wait_health
from stub_engine import StubEngine, stub_server

import fsm_pd
from fsm_pd.api import AppServer, create_app
from fsm_pd.control.resolver import register_prefill
from fsm_pd.router import create_router_app
from fsm_pd.router.policy import CLASSIC_PD
from fsm_pd.transport import generate_secret, secret_env

KEY = "sekrit-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Written out here, not imported: a route opened by mistake must fail this test. The probes are open because a
# kubelet probes without the key.
OPEN_PATHS = {"/health", "/health_generate", "/metrics", "/livez", "/startupz", "/readiness", "/liveness"}
PACKAGE = Path(fsm_pd.__file__).parent
LAYOUT = {"num_layers": 2, "num_pages": 16, "page_size": 4, "kv_heads": 1, "head_dim": 8, "dtype": "float32"}

BODIES = {
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
    "/v1/completions": {"model": "stub-model", "prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/abort_request": {"rid": "nobody"},
}


def routes(app) -> list[tuple[str, str]]:
    """Every (method, path) the app serves: its API (from the OpenAPI schema, which lists every route it includes)
    and the docs and schema routes FastAPI adds itself."""
    found = {(m.upper(), path) for path, ops in app.openapi()["paths"].items() for m in ops}
    for route in app.routes:
        for method in getattr(route, "methods", None) or ():
            if method != "HEAD":
                found.add((method, route.path))
    return sorted(found)


def call(client: httpx.Client, method: str, path: str, headers: dict | None = None) -> httpx.Response:
    body = BODIES.get(path, {}) if method == "POST" else None
    return client.request(method, path, json=body, headers=headers)


@contextlib.contextmanager
def served(app):
    with AppServer(app) as server, httpx.Client(base_url=server.url, timeout=15) as client:
        yield server.url, client


# ---- the API key -------------------------------------------------------------------------------------------------


def assert_key_guards_every_route(app, client: httpx.Client) -> None:
    checked = 0
    for method, path in routes(app):
        bare, wrong = call(client, method, path), call(client, method, path, {"Authorization": "Bearer nope"})
        scheme = call(client, method, path, {"Authorization": KEY})  # the key without "Bearer "
        keyed = call(client, method, path, AUTH)
        if path in OPEN_PATHS:
            assert 401 not in (bare.status_code, wrong.status_code), (method, path)
            continue
        for answer in (bare, wrong, scheme):
            assert answer.status_code == 401, (method, path, answer.status_code, answer.text[:200])
            assert answer.headers["www-authenticate"] == "Bearer"
            assert answer.json()["error"]["code"] == 401
        assert keyed.status_code != 401, (method, path)
        checked += 1
    assert checked >= 10


def test_api_key_guards_every_route_of_an_engine_server():
    engine = StubEngine()
    app = create_app(engine, engine.tokenizer, api_key=KEY)
    try:
        with served(app) as (_, client):
            assert_key_guards_every_route(app, client)
    finally:
        engine.close()


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_api_key_guards_streamed_requests_before_any_event(path):
    with stub_server(api_key=KEY) as (url, engine), httpx.Client(base_url=url, timeout=15) as client:
        body = {**BODIES[path], "stream": True}
        with client.stream("POST", path, json=body) as refused:
            assert refused.status_code == 401
            assert refused.headers["content-type"] == "application/json"
            assert "data:" not in refused.read().decode()
        assert engine.submitted == []  # nothing reached the engine
        with client.stream("POST", path, json=body, headers=AUTH) as ok:
            assert ok.status_code == 200
            assert ok.read().decode().rstrip().endswith("data: [DONE]")


def test_openai_client_without_the_key_is_refused():
    with stub_server(api_key=KEY) as (url, _):
        wrong = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, timeout=15)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model="stub-model", prompt="hi", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            wrong.chat.completions.create(model="stub-model", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2, stream=True)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        right = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=15)
        assert right.completions.create(model="stub-model", prompt="hi", max_tokens=2).choices[0].text


def test_api_key_guards_every_route_of_the_router():
    prefill, decode = StubEngine(role="prefill"), StubEngine(role="decode")
    with contextlib.ExitStack() as stack:
        p = stack.enter_context(AppServer(create_app(prefill, prefill.tokenizer, api_key=KEY, bootstrap_port=1)))
        d = stack.enter_context(AppServer(create_app(decode, decode.tokenizer, api_key=KEY)))
        app = create_router_app([(p.url, 1)], [d.url], api_key=KEY, pd_policy=CLASSIC_PD)
        _, client = stack.enter_context(served(app))
        assert_key_guards_every_route(app, client)
        with client.stream("POST", "/v1/completions", json={**BODIES["/v1/completions"], "stream": True}) as r:
            assert r.status_code == 401
        stack.callback(prefill.close)
        stack.callback(decode.close)


# ---- the bootstrap token, end to end -----------------------------------------------------------------------------


@contextlib.contextmanager
def bootstrap_process(*args: str, env: dict | None = None):
    proc = subprocess.Popen([sys.executable, "-m", "fsm_pd.cli", "serve", "--role", "bootstrap", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, preexec_fn=dies_with_parent())
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), proc.stderr.read()[-2000:]
        yield proc, url
    finally:
        proc.send_signal(signal.SIGTERM)  # the process this test started
        proc.wait(timeout=15)
        proc.stdout.close()
        proc.stderr.close()


def test_bootstrap_token_from_the_environment_guards_registration_end_to_end():
    from fsm_pd.bootstrap import BootstrapError, resolve_prefill

    with bootstrap_process(env={"FSM_PD_BOOTSTRAP_TOKEN": "boot-tok"}) as (_, url):
        where = dict(host="127.0.0.1", side_channel="tcp://127.0.0.1:5555", transfer_addr="127.0.0.1:6000",
                     backend="zmq", layout=LAYOUT, node_id="prefill-0", backoff_base_s=0.01)
        for token in (None, "wrong"):
            started = time.monotonic()
            with pytest.raises(BootstrapError) as refused:
                register_prefill(url, token=token, **where)
            assert refused.value.status == 401 and time.monotonic() - started < 5  # final at once, no retries
        # nothing was registered by the refused attempts; reads need no token
        lookup = httpx.get(url + "/route", params={"prefill_dp_rank": 0, "prefill_cp_rank": 0,
                                                   "target_tp_rank": 0, "target_pp_rank": 0}, timeout=5)
        assert lookup.status_code == 503
        register_prefill(url, token="boot-tok", **where)
        assert resolve_prefill(url, retries=0)["side_channel"] == "tcp://127.0.0.1:5555"
        dp = httpx.post(url + "/register_dp_rank", json={"bootstrap_room": 1, "dp_rank": 0}, timeout=5)
        assert dp.status_code == 401


# ---- bounded bodies ----------------------------------------------------------------------------------------------


def raw_post(url: str, path: str, total: int, *, chunked: bool, headers: dict | None = None,
             method: str = "POST") -> int:
    """Send a body of ``total`` bytes the way a client that does not wait would, and return the answer's status.

    A server that refuses early answers while the body is still coming; an HTTP client library that is still
    writing then often sees a reset instead of the answer. So this writes on a raw socket, stops as soon as the
    answer is readable (or the body is complete), and then reads it."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    head = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    head.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        sent, piece = 0, b"x" * 65536
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            while sent < total and not select.select([sock], [], [], 0)[0]:
                chunk = piece[: total - sent]
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
                sent += len(chunk)
            if chunked and sent >= total:
                sock.sendall(b"0\r\n\r\n")
        answer = b""
        while b"\r\n" not in answer:
            data = sock.recv(4096)
            if not data:
                break
            answer += data
    return int(answer.split(b" ", 2)[1])


def assert_oversized_refused(url: str, path: str, limit: int, headers: dict | None = None,
                             method: str = "POST") -> None:
    for chunked in (False, True):
        status = raw_post(url, path, limit + 1, chunked=chunked, headers=headers, method=method)
        assert status == 413, (path, chunked, status)
    at_limit = httpx.request(method, url + path, content=b" " * limit,
                             headers={"content-type": "application/json", **(headers or {})}, timeout=30)
    assert at_limit.status_code != 413, path


def test_oversized_bodies_are_413_on_the_engine_api():
    limit = 4096
    engine = StubEngine()
    try:
        with served(create_app(engine, engine.tokenizer, max_body_bytes=limit)) as (url, client):
            for path in BODIES:
                assert_oversized_refused(url, path, limit)
            assert engine.submitted == []
            assert client.post("/generate", json=BODIES["/generate"]).status_code == 200  # and it still serves
    finally:
        engine.close()


def test_the_default_body_limit_holds_with_an_api_key_too():
    from fsm_pd.net.body_limit import request_bytes_for

    with stub_server(api_key=KEY) as (url, engine):
        # the default follows the engine's context, and /health says it, for a router in front
        limit = request_bytes_for(engine.max_context)
        assert httpx.get(url + "/health", timeout=10).json()["max_request_bytes"] == limit
        assert_oversized_refused(url, "/v1/chat/completions", limit, AUTH)
        # without the key the answer is 401 before a byte of the body is read
        assert httpx.post(url + "/generate", content=b"x" * 1024, timeout=10).status_code == 401
        assert engine.submitted == []


def test_oversized_bodies_are_413_on_the_router():
    prefill, decode = StubEngine(role="prefill"), StubEngine(role="decode")
    with contextlib.ExitStack() as stack:
        p = stack.enter_context(AppServer(create_app(prefill, prefill.tokenizer, bootstrap_port=1,
                                                     max_body_bytes=6000)))
        d = stack.enter_context(AppServer(create_app(decode, decode.tokenizer, max_body_bytes=5000)))
        url, client = stack.enter_context(served(create_router_app([(p.url, 1)], [d.url], pd_policy=CLASSIC_PD)))
        # the router refuses what one of its workers would: the smallest limit their /health reports
        assert until(lambda: client.get("/server_info").json()["max_request_bytes"] == 5000)
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            assert_oversized_refused(url, path, 5000)
        assert prefill.submitted == [] and decode.submitted == []
        assert client.post("/generate", json=BODIES["/generate"]).status_code == 200
        stack.callback(prefill.close)
        stack.callback(decode.close)


def test_oversized_bodies_are_413_on_the_bootstrap_server_process():
    with bootstrap_process("--max-body-bytes", "2048", "--token", "t") as (_, url):
        for path in ("/route", "/register_dp_rank", "/query_dp_ranks"):
            assert_oversized_refused(url, path, 2048, {"Authorization": "Bearer t"},
                                     method="PUT" if path == "/route" else "POST")
        assert httpx.get(url + "/health", timeout=5).status_code == 200


# ---- no pickle on any wire ---------------------------------------------------------------------------------------

PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib", "copyreg"}
PICKLE_CALLS = {"recv_pyobj", "send_pyobj", "recv_serialized", "loads_pickle"}


def test_no_module_of_the_package_imports_or_calls_pickle():
    offences = []
    sources = sorted(PACKAGE.rglob("*.py"))
    assert len(sources) > 50
    for path in sources:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        where = path.relative_to(PACKAGE.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                offences += [f"{where}:{node.lineno} import {a.name}" for a in node.names
                             if a.name.split(".")[0] in PICKLE_MODULES]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLE_MODULES:
                offences.append(f"{where}:{node.lineno} from {node.module} import ...")
            elif isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name in PICKLE_CALLS:
                    offences.append(f"{where}:{node.lineno} calls {name}")
                for kw in node.keywords:  # np.load(..., allow_pickle=True), torch.load(weights_only=False)
                    if kw.arg == "allow_pickle" and not (isinstance(kw.value, ast.Constant) and not kw.value.value):
                        offences.append(f"{where}:{node.lineno} allow_pickle")
                    if kw.arg == "weights_only" and not (isinstance(kw.value, ast.Constant) and kw.value.value):
                        offences.append(f"{where}:{node.lineno} weights_only")
                if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant) \
                        and str(node.args[0].value).split(".")[0] in PICKLE_MODULES:
                    offences.append(f"{where}:{node.lineno} imports a pickle module dynamically")
    assert offences == []


NO_UNPICKLE = textwrap.dedent("""
    import pickle, _pickle, sys, threading, time

    def refuse(*args, **kwargs):
        raise AssertionError("something tried to unpickle")

    for module in (pickle, _pickle):
        module.loads = module.load = refuse
        module.Unpickler = refuse
    unpickled = []
    sys.addaudithook(lambda event, args: unpickled.append(args) if event == "pickle.find_class" else None)

    import jax, numpy as np
    from fsm_pd.transport import generate_secret
    from fsm_pd.transport.backends import create_backend
    from fsm_pd.transport.messages import Abort, Heartbeat, Prepare, Pulled, Ready
    from fsm_pd.transport.side_channel import SideChannel

    secret = generate_secret()
    got, arrived, pong = [], threading.Event(), threading.Event()
    def inbox(msg):
        got.append(msg)
        if len(got) == 4:
            arrived.set()
    a = SideChannel(node_id="a", secret=secret, on_message=inbox)
    b = SideChannel(node_id="b", secret=secret, on_message=lambda m: None)
    b.add_observer(lambda m: pong.set() if isinstance(m, Heartbeat) and m.pong else None)
    layout = {"num_pages": 4, "page_size": 2}
    for msg in (b.stamp(Prepare, room=1, transfer_id=1, reply_to=b.address, layout=layout, page_count=1,
                        prompt_len=3),
                b.stamp(Ready, room=1, transfer_id=1, uuid=5, transfer_addr="127.0.0.1:1", backend="zmq",
                        layout=layout, page_count=1, first_token=3, first_logprob=-0.5, input_logprobs=[-1.0]),
                b.stamp(Pulled, room=1, transfer_id=1), b.stamp(Abort, room=2, reason="r"),
                b.stamp(Heartbeat, room=0, pong=False)):
        b.send(a.address, msg)
    assert arrived.wait(10), got
    assert pong.wait(10)  # the ping was answered

    p, d = create_backend("zmq", host="127.0.0.1"), create_backend("zmq", host="127.0.0.1")
    data = np.arange(4 * 8, dtype=np.float32).reshape(4, 8)
    p.publish(77, [jax.device_put(data)], 30.0)
    (pulled,) = d.pull(p.address, 77, [jax.ShapeDtypeStruct((4, 8), np.float32)], 30.0)
    assert np.asarray(pulled).tobytes() == data.tobytes()
    for thing in (a, b, p, d):
        thing.close()
    assert unpickled == [], unpickled
    print("ok")
""")


def test_side_channel_and_zmq_backend_work_with_unpickling_disabled():
    done = subprocess.run([sys.executable, "-c", NO_UNPICKLE], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


# ---- listening addresses -----------------------------------------------------------------------------------------


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that ``pid`` holds, from /proc (IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = local.split(":")
            assert len(hex_addr) == width
            if width == 8:
                address = ".".join(str(b) for b in reversed(bytes.fromhex(hex_addr)))
            else:  # four little-endian 32-bit words
                raw = b"".join(bytes.fromhex(hex_addr[i:i + 8])[::-1] for i in range(0, 32, 8))
                address = ":".join(raw[i:i + 2].hex() for i in range(0, 16, 2))
            found.append((address, int(hex_port, 16)))
    return found


@contextlib.contextmanager
def serve_process(role: str, port: int, tmp_path: Path, *extra: str):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **secret_env(generate_secret())}
    log = open(tmp_path / f"{role}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "fsm_pd.cli", "serve", "--role", role, "--port", str(port),
                             "--num-pages", "64", "--log-level", "warning", *extra],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                            preexec_fn=dies_with_parent())
    try:
        wait_health(f"http://127.0.0.1:{port}", proc, timeout=180)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)  # the process this test started
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def test_a_bootstrap_server_process_listens_on_loopback_only():
    with bootstrap_process() as (proc, url):
        sockets = listening_sockets(proc.pid)
        assert sockets == [("127.0.0.1", int(url.rsplit(":", 1)[1]))]


def test_colocated_and_prefill_nodes_listen_on_loopback_only(tmp_path):
    port = free_port()
    with serve_process("colocated", port, tmp_path) as proc:
        assert listening_sockets(proc.pid) == [("127.0.0.1", port)]
    port, bootstrap = free_port(), free_port()
    with serve_process("prefill", port, tmp_path, "--bootstrap-port", str(bootstrap),
                       "--journal", str(tmp_path / "p.db")) as proc:
        sockets = listening_sockets(proc.pid)
        # HTTP, bootstrap, side channel and the zmq transfer server: four sockets, all on loopback
        assert {("127.0.0.1", port), ("127.0.0.1", bootstrap)} <= set(sockets)
        assert len(sockets) >= 4 and {address for address, _ in sockets} == {"127.0.0.1"}, sockets
        info = httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=10).json()
        assert json.dumps(info)  # the node serves; its internals name only loopback addresses
        assert "0.0.0.0" not in json.dumps(info)


def test_a_prefill_nodes_built_in_bootstrap_server_takes_a_token(tmp_path):
    from fsm_pd.serving.prefill_engine import PrefillEngine

    engine = PrefillEngine("tiny", num_pages=16, page_size=4, journal=str(tmp_path / "p.db"), bootstrap_token="t0k")
    try:
        url = engine.bootstrap_url
        rank = httpx.get(url + "/route", params={"prefill_dp_rank": 0, "prefill_cp_rank": 0, "target_tp_rank": 0,
                                                 "target_pp_rank": 0}, timeout=5)
        assert rank.status_code == 200 and rank.json()["node_id"] == "prefill-0", "it registered with its token"
        forged = httpx.put(url + "/route", json=rank.json(), timeout=5)
        assert forged.status_code == 401
    finally:
        engine.close()
