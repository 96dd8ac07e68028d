"""Unix sockets beside TCP (``fsm_pd.net.unix_sockets``, ``fsm_pd.net.unix_http``): ``unix:PATH`` addresses and
what each part makes of them, the 107-byte path limit (checked, one line, before anything loads), listening with a
stale file replaced and a live one refused, and the TCP probe that turns libzmq's abort into a Python error."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from fastapi import FastAPI

from fsm_pd.api.request_checks import NodeIdentity
from fsm_pd.api.requests import resolve_bootstrap
from fsm_pd.bootstrap.wire import BadRequest, RankRegistration
from fsm_pd.control.resolver import prefill_registration
from fsm_pd.net.http_server import AppServer
from fsm_pd.net.unix_http import http_url, split_socket
from fsm_pd.net.unix_sockets import (
    SUN_PATH_MAX,
    Listener,
    TcpRefused,
    UnixPathError,
    check_path,
    check_unix_backend,
    node_socket,
    node_socket_paths,
    require_tcp,
    unix_path,
)
from fsm_pd.router.app import PrefillWorker, parse_prefill_specs
from fsm_pd.router.merge import check_bootstrap, with_bootstrap
from fsm_pd.serving.types import Bootstrap
from fsm_pd.transport import SideChannel, generate_secret


@pytest.fixture
def short_dir(tmp_path_factory):
    """A directory whose path leaves room under the limit (pytest's tmp_path can be long)."""
    path = tmp_path_factory.mktemp("u")
    assert len(str(path)) < 60
    return path


def test_unix_addresses_parse_to_absolute_paths():
    assert unix_path("unix:/run/fsm/p.sock") == "/run/fsm/p.sock" == unix_path("unix:///run/fsm/p.sock")
    assert unix_path("unix:p.sock") == os.path.join(os.getcwd(), "p.sock")
    with pytest.raises(ValueError, match="not a unix:PATH"):
        unix_path("http://127.0.0.1:30000")
    with pytest.raises(UnixPathError):
        unix_path("unix:")


def test_a_nodes_sockets_sit_beside_its_http_socket():
    assert node_socket("/run/p.sock", "side") == "/run/p.side.sock" == node_socket("/run/p", "side")
    assert node_socket_paths("router", "/r.sock") == {"--uds": "/r.sock"}
    assert sorted(node_socket_paths("decode", "/d.sock").values()) == ["/d.kv.sock", "/d.side.sock", "/d.sock"]
    paths = node_socket_paths("prefill", "/p.sock", "/b.sock")
    assert "/b.sock" in paths.values() and len(paths) == 4


def test_the_path_limit_is_the_kernels(short_dir):
    fits = str(short_dir / ("a" * (SUN_PATH_MAX - len(str(short_dir)) - 1)))
    assert len(os.fsencode(fits)) == SUN_PATH_MAX and check_path(fits) == fits
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(fits)  # the kernel takes 107 bytes ...
    with socket.socket(socket.AF_UNIX) as s, pytest.raises(OSError):
        s.bind(fits + "b")  # ... and not 108
    with pytest.raises(UnixPathError) as info:
        check_path(fits + "b", "--uds")
    message = str(info.value)
    assert "\n" not in message and message.startswith("--uds: ") and "108 bytes" in message and "sun_path" in message
    multibyte = str(short_dir / ("é" * ((SUN_PATH_MAX - len(str(short_dir))) // 2 + 1)))  # 2 bytes a character
    assert len(multibyte) < SUN_PATH_MAX  # in characters: bytes are what counts
    with pytest.raises(UnixPathError, match="bytes, more than the 107"):
        check_path(multibyte)


def test_a_stale_socket_is_replaced_a_live_one_refused_and_close_removes_the_file(short_dir):
    path = str(short_dir / "s.sock")
    with socket.socket(socket.AF_UNIX) as crashed:
        crashed.bind(path)  # bound, never listened, closed: what a killed process leaves
    assert os.path.exists(path)
    with Listener(path) as live:
        assert live.address == f"unix:{path}"
        with pytest.raises(OSError) as info:
            Listener(path)
        assert info.value.errno == errno.EADDRINUSE and "already listens" in str(info.value)
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(path)  # the refused second listener left the first one's file alone
    assert not os.path.exists(path)
    (short_dir / "plain").write_text("not a socket")
    with pytest.raises(FileExistsError, match="not a socket"):
        Listener(str(short_dir / "plain"))


def test_close_leaves_a_successors_socket(short_dir):
    path = str(short_dir / "s.sock")
    first = Listener(path)
    os.unlink(path)  # replaced meanwhile (a restarted node bound the path)
    with Listener(path):
        first.close()
        assert os.path.exists(path)


def test_a_host_that_refuses_tcp_gets_a_python_error_before_zmq_binds(monkeypatch):
    def refused(*args, **kwargs):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr("fsm_pd.net.unix_sockets.socket.socket", refused)
    with pytest.raises(TcpRefused, match=r"--uds PATH"):
        require_tcp("127.0.0.1", "the test")
    with pytest.raises(TcpRefused, match="the side channel of p"):
        SideChannel(node_id="p", secret=generate_secret(), on_message=print, bind="tcp://127.0.0.1:0")


def test_the_side_channel_on_a_unix_socket(short_dir):
    secret, heard = generate_secret(), []
    a_path, b_path = short_dir / "a.side.sock", short_dir / "b.side.sock"
    with socket.socket(socket.AF_UNIX) as crashed:
        crashed.bind(str(a_path))  # a stale file where a starts
    a = SideChannel(node_id="a", secret=secret, on_message=print, bind=f"ipc://{a_path}")
    b = SideChannel(node_id="b", secret=secret, on_message=print, bind=f"ipc://{b_path}")
    try:
        assert a.address == f"ipc://{a_path}"
        with pytest.raises(OSError, match="already listens"):  # libzmq would have taken a's path over
            SideChannel(node_id="c", secret=secret, on_message=print, bind=f"ipc://{a_path}")
        a.add_observer(heard.append)
        a.ping(b.address)
        deadline = time.monotonic() + 10
        while not heard and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [(m.sender, m.pong, m.origin) for m in heard] == [("b", True, b.address)]
    finally:
        a.close()
        b.close()
    assert not a_path.exists() and not b_path.exists()


def test_only_the_byte_stream_backends_run_over_unix_sockets():
    check_unix_backend("tcp")
    check_unix_backend("zmq")
    with pytest.raises(ValueError, match=r"IPv4 or IPv6 only"):
        check_unix_backend("jax")
    with pytest.raises(ValueError, match="'rdma' cannot run over unix sockets"):
        check_unix_backend("rdma")


def test_http_urls_find_their_socket_along_the_path(short_dir):
    path = str(short_dir / "p.sock")
    assert http_url(f"unix:{path}") == f"http+unix://localhost{path}"
    assert http_url("http://127.0.0.1:30000") == "http://127.0.0.1:30000"
    with Listener(path):
        assert split_socket(path + "/v1/chat/completions") == (path, "/v1/chat/completions")
        assert split_socket(path) == (path, "/")
        assert httpx.URL(http_url(f"unix:{path}") + "/health").path == path + "/health"
    with pytest.raises(FileNotFoundError, match="no unix socket along"):
        split_socket(path + "/health")


def test_a_client_finds_a_socket_it_reached_before_without_a_system_call(short_dir, monkeypatch):
    """``split_socket`` stats every component of a request's path; a router's async client routes on the event
    loop, every request and health check. Once a socket was reached, its requests go to it without (issue 51)."""
    from fsm_pd.net import unix_http

    path = str(short_dir / "w.sock")
    stats = []  # the URL paths whose components were stat'ed to find their socket
    monkeypatch.setattr(unix_http, "split_socket", lambda p: stats.append(p) or split_socket(p))
    app = FastAPI()
    app.get("/health")(lambda: {"ok": True})
    app.get("/v1/models")(lambda: {"data": []})
    with AppServer(app, uds=path), unix_http.client(timeout=10) as client:
        base = http_url(f"unix:{path}")
        assert client.get(base + "/health").json() == {"ok": True}
        assert stats == [path + "/health"]  # the first request found the socket along its path
        stats.clear()
        for _ in range(3):
            assert client.get(base + "/health").status_code == 200
        assert client.get(base + "/v1/models").json() == {"data": []}
        assert stats == []
    with unix_http.client(timeout=10) as client, pytest.raises(httpx.ConnectError):
        client.get(http_url(f"unix:{path}") + "/health")  # the server is gone: its file too


def test_a_client_given_an_ssl_context_makes_none_for_its_sockets(short_dir, monkeypatch):
    """Every httpx transport loads the CA bundle for an SSL context of its own unless given one (several ms of
    CPU); a client's ``verify`` reaches its sockets' transports, so a bench that makes a client a stream shares one."""
    import ssl

    from fsm_pd.net import unix_http

    path = str(short_dir / "v.sock")
    context = ssl.create_default_context()
    loads = []  # httpx makes its contexts with ssl.create_default_context (its CA file, or $SSL_CERT_FILE's)
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **k: loads.append(1) or context)
    app = FastAPI()
    app.get("/health")(lambda: {"ok": True})

    async def get() -> httpx.Response:
        async with unix_http.async_client(timeout=10, verify=context) as client:
            return await client.get(http_url(f"unix:{path}") + "/health")

    with AppServer(app, uds=path):
        assert asyncio.run(get()).json() == {"ok": True}
    assert loads == []  # neither the client nor its socket's transport loaded the bundle


def test_the_router_names_a_unix_bootstrap_server_in_bootstrap_host():
    specs = parse_prefill_specs([["unix:/s/p.sock", "unix:/s/p.bootstrap.sock"], ["http://p:1", "8998"]])
    assert specs == [PrefillWorker("unix:/s/p.sock", "unix:/s/p.bootstrap.sock"), PrefillWorker("http://p:1", 8998)]
    sent = with_bootstrap({"text": "hi"}, "http+unix://localhost/s/p.sock", "unix:/s/p.bootstrap.sock", 7)
    assert sent == {"text": "hi", "bootstrap_host": "unix:/s/p.bootstrap.sock", "bootstrap_port": None,
                    "bootstrap_room": 7}
    assert with_bootstrap({}, "http://[::1]:1", 8998, 7)["bootstrap_host"] == "[::1]"
    with pytest.raises(ValueError, match="unix:BOOTSTRAP_SOCKET"):
        check_bootstrap("unix:/s/p.sock", 8998)
    check_bootstrap("http://p:1", "unix:/s/b.sock")  # a TCP worker may still name a bootstrap socket


def test_a_decode_node_takes_a_unix_bootstrap_without_a_port():
    node = NodeIdentity(role="decode", max_context=64, model_names=frozenset({"m"}), bootstrap_port=None)
    boot = resolve_bootstrap(node, "unix:/s/p.bootstrap.sock", None, 5)
    assert boot == Bootstrap("unix:/s/p.bootstrap.sock", 0, 5) and boot.addr == "unix:/s/p.bootstrap.sock"


def test_a_prefill_on_unix_sockets_registers_its_side_channel_path_and_port_0():
    layout = {"page_size": 16, "dtype": "float32", "tp": 1}
    reg = prefill_registration(host=None, side_channel="ipc:///s/p.side.sock", transfer_addr="unix:/s/p.kv.sock",
                               backend="tcp", layout=layout, node_id="p")
    assert (reg.rank_ip, reg.rank_port) == ("unix:/s/p.side.sock", 0)
    assert RankRegistration.from_json(reg.to_json()) == reg  # the bootstrap server takes it
    with pytest.raises(BadRequest, match="rank_port must be a TCP port"):
        RankRegistration.from_json({**reg.to_json(), "rank_ip": "10.0.0.1"})


@pytest.mark.parametrize("role", ["decode", "router", "bootstrap"])
def test_serve_refuses_a_path_too_long_in_one_line_before_loading_anything(short_dir, role):
    long = str(short_dir / ("x" * 120)) + ".sock"
    # jax may not be imported before the refusal: on a TPU host importing it prints a warning (a second line)
    no_jax = "import sys; sys.modules['jax'] = None; from fsm_pd.cli.main import main; sys.exit(main(sys.argv[1:]))"
    argv = [sys.executable, "-c", no_jax, "serve", "--role", role, "--uds", long]
    if role == "router":
        argv += ["--prefill", "unix:/s/p.sock", "unix:/s/b.sock", "--decode", "unix:/s/d.sock"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    said = done.stderr.strip()
    assert "\n" not in said and "more than the 107 Linux allows" in said and long in said


def test_serve_refuses_the_jax_backend_over_unix_sockets(short_dir):
    done = subprocess.run([sys.executable, "-m", "fsm_pd.cli", "serve", "--role", "decode", "--uds",
                           str(short_dir / "d.sock"), "--transfer-backend", "jax"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "jax transfer backend" in done.stderr and "IPv4 or IPv6" in done.stderr
