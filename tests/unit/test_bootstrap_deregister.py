"""A draining prefill node takes its rank out of the bootstrap server (``POST /deregister``, fsm-pd's own route):
only the instance that registered it may, with the token the writes need; lookups then answer 503 until a rank
registers again."""

from __future__ import annotations

import httpx
import pytest
from real_parts import TCP

from fsm_pd.bootstrap import (
    BootstrapError,
    BootstrapServer,
    PrefillRegistry,
    RankRegistration,
    deregister_prefill_rank,
    register_prefill_rank,
    resolve_prefill,
)


def rank(instance: str, port: int = 7000) -> RankRegistration:
    return RankRegistration(rank_ip="127.0.0.1", rank_port=port, page_size=4, kv_cache_dtype="bfloat16",
                            side_channel=f"tcp://127.0.0.1:{port}", instance=instance)


def test_only_the_registered_instance_removes_its_rank():
    registry = PrefillRegistry()
    registry.register(rank("a" * 16))
    assert registry.deregister(rank("b" * 16)) == "replaced"  # a late call from a process already replaced
    assert registry.is_ready()
    assert registry.deregister(rank("a" * 16)) == "removed"
    assert not registry.is_ready() and registry.lookup(0, 0, 0, 0) is None
    assert registry.deregister(rank("a" * 16)) == "absent"
    assert registry.register(rank("c" * 16, port=7001)) == 1  # the layout stays; a restarted node registers again
    assert registry.lookup(0, 0, 0, 0)["instance"] == "c" * 16


@TCP
def test_deregister_over_http_with_the_token():
    with BootstrapServer(port=0, token="t0ken") as server:
        register_prefill_rank(server.url, rank("a" * 16).to_json(), token="t0ken")
        with pytest.raises(BootstrapError) as refused:
            deregister_prefill_rank(server.url, rank("a" * 16).to_json())  # no token: a write like PUT /route
        assert refused.value.status == 401
        assert deregister_prefill_rank(server.url, rank("b" * 16).to_json(), token="t0ken") is False  # 409
        assert resolve_prefill(server.url, retries=0)["instance"] == "a" * 16
        assert deregister_prefill_rank(server.url, rank("a" * 16).to_json(), token="t0ken") is True
        assert deregister_prefill_rank(server.url, rank("a" * 16).to_json(), token="t0ken") is False  # 404
        lookup = httpx.get(server.url + "/route", params={"prefill_dp_rank": 0, "prefill_cp_rank": 0,
                                                         "target_tp_rank": 0, "target_pp_rank": 0}, timeout=5)
        assert lookup.status_code == 503  # decode nodes retry this (15 tries, 1 s apart) until a rank is back
        bad = httpx.post(server.url + "/deregister", json={"rank_ip": "x"},
                         headers={"Authorization": "Bearer t0ken"}, timeout=5)
        assert bad.status_code == 400


@TCP
def test_deregister_from_a_server_that_is_gone_raises():
    server = BootstrapServer(port=0).start()
    url = server.url
    server.stop()
    with pytest.raises(BootstrapError, match="deregistering at"):
        deregister_prefill_rank(url, rank("a" * 16).to_json())
