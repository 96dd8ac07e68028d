"""The bootstrap server on a real uvicorn socket on 127.0.0.1, driven over HTTP the way SGLang's prefill and decode
drive it (notes §2), plus fsm-pd's extras, the token, TTLs, bad input, and the client's retries."""

from __future__ import annotations

import dataclasses
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest
from processes import dies_with_parent

from fsm_pd.bootstrap import (
    BootstrapError,
    BootstrapServer,
    PrefillRegistry,
    RankRegistration,
    check_health,
    fetch_prefill_layout,
    query_dp_ranks,
    register_dp_rank,
    register_prefill_rank,
    resolve_prefill,
)
from fsm_pd.bootstrap import client as bootstrap_client
from fsm_pd.cli.launch import free_port

NOT_READY = "Prefill server not fully registered yet ({} workers registered)."
RANK_0 = {"prefill_dp_rank": 0, "prefill_cp_rank": 0, "target_tp_rank": 0, "target_pp_rank": 0}
LAYOUT_QUERY = {"prefill_dp_rank": -1, "prefill_cp_rank": -1, "target_tp_rank": -1, "target_pp_rank": -1}
KV_LAYOUT = {"num_layers": 2, "num_pages": 16, "page_size": 4, "kv_heads": 1, "head_dim": 8, "dtype": "float32"}


@dataclasses.dataclass
class SGLangPrefillServerInfo:
    """SGLang's decode-side ``PrefillServerInfo`` at db570fe619, field for field: the decode builds it with
    ``PrefillServerInfo(**response.json())``, so an extra key in the layout answer is a TypeError there."""

    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: int | None
    kv_cache_dtype: str | None
    follow_bootstrap_room: bool
    enable_dsa_cache_layer_split: bool = False
    prefill_http_port: int | None = None
    target_tp_rank: int | None = None
    target_tp_ranks: list | None = None
    target_cp_ranks: list | None = None
    target_pp_ranks: list | None = None
    required_dst_info_num: int | None = None
    required_prefill_response_num: int | None = None


def sglang_registration(port: int, *, tp_rank: int = 0, tp_size: int = 1, dp_rank: int = 0, dp_size: int = 1,
                        system_dp_rank: int = 0, system_dp_size: int = 1, **overrides: Any) -> dict:
    """The body an SGLang prefill rank PUTs (``CommonKVManager.register_to_bootstrap``), all 17 fields."""
    body = {
        "attn_tp_size": tp_size, "attn_tp_rank": tp_rank, "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": dp_size, "attn_dp_rank": dp_rank, "pp_size": 1, "pp_rank": 0,
        "system_dp_size": system_dp_size, "system_dp_rank": system_dp_rank, "rank_ip": "127.0.0.1",
        "rank_port": port, "page_size": 16, "kv_cache_dtype": "auto", "load_balance_method": "follow_bootstrap_room",
        "enable_dsa_cache_layer_split": False, "prefill_http_port": 30000,
    }
    body.update(overrides)
    return body


@pytest.fixture
def make_server():
    servers: list[BootstrapServer] = []

    def make(**kwargs: Any) -> BootstrapServer:
        server = BootstrapServer(**kwargs).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def http():
    with httpx.Client(timeout=5.0) as client:
        yield client


def route(http: httpx.Client, server: BootstrapServer, **params: Any) -> httpx.Response:
    return http.get(server.url + "/route", params=params)


# ---- SGLang's routes and shapes -----------------------------------------------------------------------------------


def test_listens_on_loopback_by_default(make_server, http):
    server = make_server()
    assert server.host == "127.0.0.1" and server.url == f"http://127.0.0.1:{server.port}"
    response = http.get(server.url + "/health")
    assert (response.status_code, response.text) == (200, "OK")


def test_layout_is_503_until_every_rank_registered_then_sglangs_exact_keys(make_server, http):
    server = make_server()
    response = route(http, server, **LAYOUT_QUERY)
    assert (response.status_code, response.text) == (503, NOT_READY.format(0))

    assert http.put(server.url + "/route", json=sglang_registration(7001, tp_rank=0, tp_size=2)).text == "OK"
    response = route(http, server, **LAYOUT_QUERY)
    assert (response.status_code, response.text) == (503, NOT_READY.format(1))
    # a rank lookup is 503 too while the layout is incomplete, even for the rank that is there
    assert route(http, server, **RANK_0).status_code == 503
    # the same rank again (a restart) must not count as the missing one
    assert http.put(server.url + "/route", json=sglang_registration(7003, tp_rank=0, tp_size=2)).status_code == 200
    assert route(http, server, **LAYOUT_QUERY).status_code == 503

    assert http.put(server.url + "/route", json=sglang_registration(7002, tp_rank=1, tp_size=2)).status_code == 200
    response = route(http, server, **LAYOUT_QUERY)
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    info = SGLangPrefillServerInfo(**response.json())  # raises on any key SGLang's decode does not know
    assert dataclasses.asdict(info) == response.json()  # ... and no key of SGLang's is missing
    assert info == SGLangPrefillServerInfo(attn_tp_size=2, attn_cp_size=1, dp_size=1, pp_size=1, page_size=16,
                                           kv_cache_dtype="auto", follow_bootstrap_room=True, prefill_http_port=30000)
    # the re-registration replaced rank 0's address
    ranks = route(http, server, **RANK_0).json()
    assert ranks == {"rank_ip": "127.0.0.1", "rank_port": 7003}


def test_rank_lookup_is_sglangs_pair_and_dp_groups_follow_system_dp(make_server, http):
    server = make_server()
    for dp in range(2):  # two plain DP replicas: attn_dp_size 1, system_dp_size 2
        body = sglang_registration(7100 + dp, system_dp_rank=dp, system_dp_size=2, load_balance_method="round_robin")
        assert http.put(server.url + "/route", json=body).status_code == 200
    layout = route(http, server, **LAYOUT_QUERY).json()
    assert (layout["dp_size"], layout["follow_bootstrap_room"]) == (2, False)
    for dp in range(2):
        response = route(http, server, prefill_dp_rank=dp, prefill_cp_rank=0, target_tp_rank=0, target_pp_rank=0)
        assert response.status_code == 200
        assert response.json() == {"rank_ip": "127.0.0.1", "rank_port": 7100 + dp}  # SGLang's keys, nothing else


def test_unknown_rank_is_404_with_sglangs_text(make_server, http):
    server = make_server()
    http.put(server.url + "/route", json=sglang_registration(7001))
    response = route(http, server, prefill_dp_rank=0, prefill_cp_rank=0, target_tp_rank=5, target_pp_rank=0)
    assert (response.status_code, response.text) == (404, "Bootstrap info not found for dp_rank=0 cp_rank=0 "
                                                          "tp_rank=5 pp_rank=0")
    # a partly -1 query is not the layout query: it names a rank that cannot exist
    response = route(http, server, prefill_dp_rank=-1, prefill_cp_rank=0, target_tp_rank=0, target_pp_rank=0)
    assert response.status_code == 404


@pytest.mark.parametrize("params", [
    {},
    {"prefill_dp_rank": 0, "prefill_cp_rank": 0, "target_tp_rank": 0},
    {"prefill_dp_rank": 0, "prefill_cp_rank": 0, "target_tp_rank": 0, "target_pp_rank": ""},
    {"prefill_dp_rank": -1, "prefill_cp_rank": -1, "target_pp_rank": -1},
])
def test_missing_route_parameters_are_400(make_server, http, params):
    server = make_server()
    response = route(http, server, **params)
    assert (response.status_code, response.text) == (400, "Missing inputs for bootstrap server.")


@pytest.mark.parametrize("bad", ["x", "1.5", "0x1", "1e3"])
def test_non_integer_route_parameter_is_400_naming_it(make_server, http, bad):
    server = make_server()
    response = route(http, server, prefill_dp_rank=0, prefill_cp_rank=0, target_tp_rank=bad, target_pp_rank=0)
    assert response.status_code == 400 and "target_tp_rank must be an integer" in response.text


def test_other_methods_on_route_are_405(make_server, http):
    server = make_server()
    response = http.delete(server.url + "/route")
    assert response.status_code == 405 and set(response.headers["allow"].split(", ")) == {"GET", "PUT"}
    assert http.post(server.url + "/route", json={}).status_code == 405


def test_dp_rank_of_a_room_is_registered_and_queried(make_server, http):
    server = make_server()
    big_room = 2**63 - 1
    for room, dp in ((11, 0), (12, 1), (big_room, 3)):
        response = http.post(server.url + "/register_dp_rank", json={"bootstrap_room": room, "dp_rank": dp})
        assert (response.status_code, response.text) == (200, "OK")
    response = http.post(server.url + "/query_dp_ranks", json={"bootstrap_rooms": [11, 12, 13, big_room]})
    assert response.status_code == 200
    assert response.json() == {"11": 0, "12": 1, str(big_room): 3}  # string keys; the unknown room left out
    assert http.post(server.url + "/query_dp_ranks", json={"bootstrap_rooms": []}).json() == {}


class StepClock:
    """The registry's clock, moved by the test: what expires is decided by the TTL, not by this machine's speed."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_dp_rank_entries_expire_after_the_ttl(make_server, http):
    clock = StepClock()
    server = make_server(registry=PrefillRegistry(entry_ttl_s=1.0, clock=clock))

    def query() -> dict:
        return http.post(server.url + "/query_dp_ranks", json={"bootstrap_rooms": [1, 2]}).json()

    http.post(server.url + "/register_dp_rank", json={"bootstrap_room": 1, "dp_rank": 1})
    http.post(server.url + "/register_dp_rank", json={"bootstrap_room": 2, "dp_rank": 0})
    assert query() == {"1": 1, "2": 0}
    clock.now += 0.5  # steps that add up exactly in binary floating point
    http.post(server.url + "/register_dp_rank", json={"bootstrap_room": 2, "dp_rank": 2})  # refreshes room 2
    clock.now += 0.375
    assert query() == {"1": 1, "2": 2}  # room 1 is 0.875 s old
    clock.now += 0.125
    assert query() == {"2": 2}  # room 1 is 1 s old, room 2 0.5 s
    clock.now += 0.5
    assert query() == {}


# ---- fsm-pd's additions ---------------------------------------------------------------------------------------------


def test_extra_rank_fields_come_back_on_rank_lookup_only(make_server, http):
    server = make_server()
    extras = {"side_channel": "tcp://127.0.0.1:5555", "transfer_addr": "127.0.0.1:6000",
              "transfer_backend": "zmq", "kv_layout": KV_LAYOUT, "node_id": "prefill-0",
              "instance": "0123456789abcdef"}
    assert http.put(server.url + "/route", json={**sglang_registration(7001), **extras}).status_code == 200
    response = route(http, server, **RANK_0)
    assert response.json() == {"rank_ip": "127.0.0.1", "rank_port": 7001, **extras}
    layout = route(http, server, **LAYOUT_QUERY).json()
    SGLangPrefillServerInfo(**layout)
    assert not set(extras) & set(layout)


def test_a_restarted_prefill_rank_replaces_its_predecessor_and_lookups_name_the_new_instance(make_server, http):
    server = make_server()
    first = {"side_channel": "tcp://127.0.0.1:5555", "node_id": "prefill-0", "instance": "aaaaaaaaaaaaaaaa"}
    again = {"side_channel": "tcp://127.0.0.1:5556", "node_id": "prefill-0", "instance": "bbbbbbbbbbbbbbbb"}
    for extras in (first, again):
        assert http.put(server.url + "/route", json={**sglang_registration(7001), **extras}).status_code == 200
    assert route(http, server, **RANK_0).json() == {"rank_ip": "127.0.0.1", "rank_port": 7001, **again}
    assert server.registry.registered_count == 1
    SGLangPrefillServerInfo(**route(http, server, **LAYOUT_QUERY).json())


def test_token_guards_writes_and_leaves_reads_open(make_server, http):
    server = make_server(token="s3cret")
    body = sglang_registration(7001)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                    {"Authorization": "Basic czNjcmV0"}):
        response = http.put(server.url + "/route", json=body, headers=headers)
        assert response.status_code == 401, headers
        assert response.headers["www-authenticate"] == "Bearer"
        response = http.post(server.url + "/register_dp_rank", json={"bootstrap_room": 1, "dp_rank": 0},
                             headers=headers)
        assert response.status_code == 401, headers
    assert route(http, server, **LAYOUT_QUERY).text.endswith("(0 workers registered).")  # nothing got in

    good = {"Authorization": "Bearer s3cret"}
    assert http.put(server.url + "/route", json=body, headers=good).status_code == 200
    assert http.post(server.url + "/register_dp_rank", json={"bootstrap_room": 1, "dp_rank": 0},
                     headers=good).status_code == 200
    # what SGLang's decode calls carries no token and must keep working
    assert route(http, server, **LAYOUT_QUERY).status_code == 200
    assert route(http, server, **RANK_0).json() == {
        "rank_ip": "127.0.0.1", "rank_port": 7001}
    assert http.post(server.url + "/query_dp_ranks", json={"bootstrap_rooms": [1]}).json() == {"1": 0}
    assert http.get(server.url + "/health").status_code == 200


def test_a_layout_conflict_is_refused_with_409(make_server, http):
    server = make_server()
    assert http.put(server.url + "/route", json=sglang_registration(7001, tp_size=2)).status_code == 200
    response = http.put(server.url + "/route", json=sglang_registration(7002, tp_rank=1, tp_size=4))
    assert response.status_code == 409 and "attn_tp_size=4" in response.text
    response = http.put(server.url + "/route", json=sglang_registration(7002, tp_rank=1, tp_size=2, page_size=32))
    assert response.status_code == 409 and "page_size" in response.text

    pinned = make_server(expected_ranks=4)
    response = http.put(pinned.url + "/route", json=sglang_registration(7001, tp_size=2))
    assert response.status_code == 409 and "expects 4 prefill ranks" in response.text


MALFORMED_REGISTRATIONS = [
    b"",
    b"{bad json",
    b"[]",
    b'"a string"',
    b"\xff\xfe\x00",
    b"[" * 50_000,  # nesting deep enough to exhaust the JSON parser's recursion
    b'{"attn_tp_size": ' + b"9" * 5000 + b"}",  # an integer past Python's digit limit
    b"{}",
]


def _with(**changes: Any) -> bytes:
    body = {**sglang_registration(7001), **changes}
    body = {k: v for k, v in body.items() if v is not DROP}
    return httpx.Request("PUT", "http://x", json=body).content


DROP = object()
BAD_FIELDS = [
    _with(rank_port=DROP), _with(kv_cache_dtype=DROP), _with(rank_port="abc"), _with(rank_port=70000),
    _with(rank_port=True), _with(attn_tp_rank=1.5), _with(attn_tp_rank=2, attn_tp_size=2), _with(attn_tp_size=0),
    _with(pp_rank=-1), _with(page_size=None), _with(rank_ip=""), _with(rank_ip=["127.0.0.1"]),
    _with(side_channel=5), _with(kv_layout=[1, 2]), _with(node_id=""), _with(prefill_http_port="http"),
    _with(instance=""), _with(instance=7), _with(instance="x" * 2000),
    _with(attn_dp_size=10**9),
]


@pytest.mark.parametrize("body", MALFORMED_REGISTRATIONS + BAD_FIELDS)
def test_malformed_registrations_get_400_with_a_reason(make_server, http, body):
    server = make_server()
    response = http.put(server.url + "/route", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.text and "Internal" not in response.text
    assert route(http, server, **LAYOUT_QUERY).text.endswith("(0 workers registered).")


@pytest.mark.parametrize(("path", "body"), [
    ("/register_dp_rank", b"{bad"), ("/register_dp_rank", b"{}"), ("/register_dp_rank", b'{"bootstrap_room": 1}'),
    ("/register_dp_rank", b'{"bootstrap_room": "x", "dp_rank": 0}'),
    ("/register_dp_rank", b'{"bootstrap_room": -1, "dp_rank": 0}'),
    ("/register_dp_rank", b'{"bootstrap_room": 1, "dp_rank": -2}'),
    ("/register_dp_rank", b'{"bootstrap_room": 1, "dp_rank": null}'),
    ("/query_dp_ranks", b""), ("/query_dp_ranks", b"[1, 2]"), ("/query_dp_ranks", b'{"bootstrap_rooms": 5}'),
    ("/query_dp_ranks", b'{"bootstrap_rooms": [1, "x"]}'), ("/query_dp_ranks", b'{"bootstrap_rooms": [{}]}'),
])
def test_malformed_dp_rank_bodies_get_400(make_server, http, path, body):
    server = make_server()
    response = http.post(server.url + path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.text


def test_oversized_bodies_are_refused_with_413(make_server, http):
    server = make_server(max_body_bytes=1024)
    rooms = {"bootstrap_rooms": list(range(1000))}
    response = http.post(server.url + "/query_dp_ranks", json=rooms)  # declared by Content-Length
    assert response.status_code == 413 and "limit is 1024" in response.text

    def chunks():  # no Content-Length: the limit must hold on the bytes actually received
        for _ in range(64):
            yield b" " * 100

    response = http.post(server.url + "/query_dp_ranks", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413
    # a body under the limit still works, and the server is still serving
    assert http.post(server.url + "/query_dp_ranks", json={"bootstrap_rooms": [1]}).status_code == 200


# ---- the client ------------------------------------------------------------------------------------------------------


def test_client_registers_resolves_and_probes_health(make_server):
    server = make_server(token="tok")
    reg = RankRegistration(rank_ip="127.0.0.1", rank_port=7001, page_size=4, kv_cache_dtype="float32",
                           side_channel="tcp://127.0.0.1:5555", transfer_addr="127.0.0.1:6000",
                           transfer_backend="zmq", kv_layout=KV_LAYOUT, node_id="prefill-0", prefill_http_port=8100)
    register_prefill_rank(server.url, reg.to_json(), token="tok", backoff_base_s=0.01)
    found = resolve_prefill(server.url.removeprefix("http://"), retries=0)  # SGLang's bare host:port works too
    assert found == {"rank_ip": "127.0.0.1", "rank_port": 7001, "side_channel": "tcp://127.0.0.1:5555",
                     "transfer_addr": "127.0.0.1:6000", "transfer_backend": "zmq", "kv_layout": KV_LAYOUT,
                     "node_id": "prefill-0"}
    layout = fetch_prefill_layout(server.url, retries=0)
    assert SGLangPrefillServerInfo(**layout).page_size == 4 and layout["prefill_http_port"] == 8100

    register_dp_rank(server.url, 42, 0, token="tok")
    with pytest.raises(BootstrapError) as refused:
        register_dp_rank(server.url, 43, 0)
    assert refused.value.status == 401
    assert query_dp_ranks(server.url, [42, 43]) == {42: 0}

    assert check_health(server.url, timeout=1.0)
    url = server.url
    server.stop()
    started = time.monotonic()
    assert not check_health(url, timeout=1.0)
    assert time.monotonic() - started < 1.5


def test_register_retries_until_the_server_comes_up(make_server):
    port = free_port()
    late: list[BootstrapServer] = []
    timer = threading.Timer(0.5, lambda: late.append(make_server(port=port)))
    timer.start()
    try:
        register_prefill_rank(f"http://127.0.0.1:{port}", sglang_registration(7001), attempts=8,
                              backoff_base_s=0.1, backoff_cap_s=0.4, timeout_s=1.0)
    finally:
        timer.join()
    assert late and late[0].registry.registered_count == 1


@pytest.fixture
def waits(monkeypatch) -> list[float]:
    """The seconds the bootstrap client's retries wait, recorded instead of slept."""
    recorded: list[float] = []
    monkeypatch.setattr(bootstrap_client, "sleep", recorded.append)
    return recorded


def test_register_gives_up_after_its_attempts_with_jittered_backoff(caplog, waits):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(BootstrapError, match="gave up after 3 attempts") as failed:
        register_prefill_rank(url, sglang_registration(7001), attempts=3, backoff_base_s=0.2, timeout_s=0.5)
    assert len(waits) == 2 and 0.15 <= waits[0] < 0.2 and 0.3 <= waits[1] < 0.4, waits  # base * 2**k * U[.75, 1)
    assert failed.value.status is None and "ConnectError" in str(failed.value)
    assert any(r.levelname == "ERROR" and "gave up" in r.getMessage() for r in caplog.records)


def test_register_refusal_is_final_at_once(make_server, waits):
    server = make_server(token="tok")
    with pytest.raises(BootstrapError, match="HTTP 401") as refused:
        register_prefill_rank(server.url, sglang_registration(7001), token="other", attempts=5, backoff_base_s=1.0)
    assert refused.value.status == 401 and waits == []  # no backoff: a refusal is not retried
    with pytest.raises(BootstrapError, match="HTTP 400"):
        register_prefill_rank(server.url, {"rank_ip": "127.0.0.1"}, token="tok", backoff_base_s=1.0)


def test_resolve_succeeds_once_the_rank_registers_during_its_retries(make_server):
    server = make_server()
    timer = threading.Timer(0.4, lambda: register_prefill_rank(server.url, {**sglang_registration(7001),
                                                                            "side_channel": "tcp://127.0.0.1:1"}))
    timer.start()
    try:
        found = resolve_prefill(server.url, retries=50, interval=0.05)
    finally:
        timer.join()
    assert found == {"rank_ip": "127.0.0.1", "rank_port": 7001, "side_channel": "tcp://127.0.0.1:1"}


def test_resolve_gives_up_within_its_bound_when_no_rank_registers(make_server, waits):
    server = make_server()
    with pytest.raises(LookupError, match=r"gave up after 4 tries; last: HTTP 503: Prefill server not fully"):
        resolve_prefill(server.url, retries=3, interval=0.1)
    assert waits == [0.1, 0.1, 0.1]

    with pytest.raises(LookupError, match="ConnectError"):
        resolve_prefill(f"127.0.0.1:{free_port()}", retries=1, interval=0.05, timeout_s=0.5)


def test_resolve_of_an_unknown_rank_fails_at_once(make_server, waits):
    server = make_server()
    register_prefill_rank(server.url, sglang_registration(7001))
    with pytest.raises(LookupError, match="HTTP 404: Bootstrap info not found for dp_rank=0 cp_rank=0 tp_rank=3"):
        resolve_prefill(server.url, tp_rank=3, retries=10, interval=1.0)
    assert waits == []  # a 404 is an answer, not retried


# ---- a separate process ----------------------------------------------------------------------------------------------


def test_standalone_server_process_serves_register_and_resolve(tmp_path):
    env = {**os.environ, "FSM_PD_BOOTSTRAP_TOKEN": "proc-token"}
    proc = subprocess.Popen([sys.executable, "-m", "fsm_pd.bootstrap", "--port", "0", "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=dies_with_parent())
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 30.0)
        assert ready, "the server printed no URL within 30s"
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        assert check_health(url)

        with pytest.raises(BootstrapError, match="HTTP 401"):
            register_prefill_rank(url, sglang_registration(7001), attempts=1)
        register_prefill_rank(url, {**sglang_registration(7001), "node_id": "p0"}, token="proc-token")
        assert resolve_prefill(url, retries=0) == {"rank_ip": "127.0.0.1", "rank_port": 7001, "node_id": "p0"}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        stderr = proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
    assert code == 0, stderr
