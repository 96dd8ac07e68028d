"""The bootstrap registry and wire shapes without HTTP: readiness, conflicts, room TTL on a fake clock, validation."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsm_pd.bootstrap import (
    SERVER_INFO_KEYS,
    BadRequest,
    PrefillRegistry,
    RankRegistration,
    RegistrationConflict,
    backoff_delay,
)
from fsm_pd.bootstrap.wire import parse_dp_rank_query, parse_dp_rank_registration, parse_route_query


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def rank(tp_rank: int = 0, tp_size: int = 1, port: int = 7000, **kw) -> RankRegistration:
    return RankRegistration(rank_ip="127.0.0.1", rank_port=port, page_size=4, kv_cache_dtype="bfloat16",
                            attn_tp_size=tp_size, attn_tp_rank=tp_rank, **kw)


def test_ready_once_every_distinct_rank_is_in():
    registry = PrefillRegistry()
    assert registry.expected_count is None and not registry.is_ready() and registry.server_info() is None
    assert registry.register(rank(0, 3)) == 1
    assert registry.register(rank(0, 3, port=7009)) == 1  # a re-registration replaces, it does not count twice
    assert registry.register(rank(2, 3)) == 2
    assert registry.expected_count == 3 and not registry.is_ready()
    assert registry.lookup(0, 0, 1, 0) is None
    registry.register(rank(1, 3))
    assert registry.is_ready()
    info = registry.server_info()
    assert tuple(info) == SERVER_INFO_KEYS
    assert (info["attn_tp_size"], info["page_size"], info["kv_cache_dtype"]) == (3, 4, "bfloat16")
    assert registry.lookup(0, 0, 0, 0) == {"rank_ip": "127.0.0.1", "rank_port": 7009}


def test_layout_conflicts_and_expected_ranks_are_refused():
    registry = PrefillRegistry(expected_ranks=2)
    assert registry.expected_count == 2
    with pytest.raises(RegistrationConflict, match="expects 2 prefill ranks"):
        registry.register(rank(0, 4))
    registry.register(rank(0, 2))
    with pytest.raises(RegistrationConflict, match="kv_cache_dtype='float32'"):
        registry.register(RankRegistration(rank_ip="h", rank_port=1, page_size=4, kv_cache_dtype="float32",
                                           attn_tp_size=2, attn_tp_rank=1))
    assert registry.registered_count == 1


def test_room_entries_expire_exactly_at_the_ttl_and_are_bounded():
    clock = FakeClock()
    registry = PrefillRegistry(entry_ttl_s=10.0, max_room_entries=3, clock=clock)
    registry.register_room(1, 0)
    clock.now += 5
    registry.register_room(2, 1)
    clock.now += 4.999
    assert registry.query_rooms([1, 2, 3]) == {"1": 0, "2": 1}
    clock.now += 0.001
    assert registry.query_rooms([1, 2]) == {"2": 1}
    registry.register_room(2, 5)  # re-registering refreshes the stamp and the value
    clock.now += 9
    assert registry.query_rooms([2]) == {"2": 5}
    for room in (3, 4, 5):
        registry.register_room(room, 0)
    assert registry.room_count == 3 and registry.query_rooms([2]) == {}  # the oldest went first


def test_registration_round_trips_and_carries_only_the_extras_set():
    reg = rank(side_channel="tcp://127.0.0.1:1", kv_layout={"page_size": 4})
    body = reg.to_json()
    assert {"side_channel", "kv_layout"} <= set(body) and "node_id" not in body
    assert RankRegistration.from_json(json.loads(json.dumps(body))) == reg
    assert reg.rank_info() == {"rank_ip": "127.0.0.1", "rank_port": 7000, "side_channel": "tcp://127.0.0.1:1",
                               "kv_layout": {"page_size": 4}}


def test_sglang_integers_may_come_as_text_and_unknown_keys_are_ignored():
    body = {**rank().to_json(), "rank_port": "7001", "attn_tp_size": 1.0, "cp_strategy": "zigzag"}
    del body["load_balance_method"], body["prefill_http_port"]
    reg = RankRegistration.from_json(body)
    assert (reg.rank_port, reg.attn_tp_size, reg.load_balance_method) == (7001, 1, "follow_bootstrap_room")


def test_route_and_dp_rank_parsers():
    assert parse_route_query({"prefill_dp_rank": "-1", "prefill_cp_rank": "-1", "target_tp_rank": "-1",
                              "target_pp_rank": "-1"}) == (-1, -1, -1, -1)
    with pytest.raises(BadRequest, match="Missing inputs"):
        parse_route_query({"prefill_dp_rank": "0"})
    assert parse_dp_rank_registration({"bootstrap_room": "12", "dp_rank": 1}) == (12, 1)
    assert parse_dp_rank_query({"bootstrap_rooms": [1, "2"]}) == [1, 2]


def test_backoff_is_sglangs_capped_doubling_with_jitter():
    for attempt, ceiling in ((0, 1.0), (1, 2.0), (4, 16.0), (5, 30.0), (12, 30.0)):
        for _ in range(50):
            assert 0.75 * ceiling <= backoff_delay(attempt) < ceiling
    assert 0.075 <= backoff_delay(0, base_s=0.1) < 0.1


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4), max_leaves=12)
FIELDS = ["attn_tp_size", "attn_tp_rank", "attn_cp_size", "attn_cp_rank", "attn_dp_size", "attn_dp_rank", "pp_size",
          "pp_rank", "system_dp_size", "system_dp_rank", "rank_ip", "rank_port", "page_size", "kv_cache_dtype",
          "prefill_http_port", "side_channel", "kv_layout", "node_id", "load_balance_method"]


@settings(max_examples=300, deadline=None)
@given(base=st.just(rank().to_json()), changes=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=4))
def test_any_json_registration_either_parses_or_is_a_bad_request(base, changes):
    """Whatever a client sends, the server's parser answers a registration or a 400, never another exception."""
    try:
        reg = RankRegistration.from_json({**base, **changes})
    except BadRequest as exc:
        assert str(exc)
    else:
        assert 0 <= reg.attn_tp_rank < reg.attn_tp_size and 1 <= reg.rank_port <= 65535


@settings(max_examples=200, deadline=None)
@given(data=JSON)
def test_any_json_dp_rank_body_either_parses_or_is_a_bad_request(data):
    for parse in (parse_dp_rank_registration, parse_dp_rank_query, RankRegistration.from_json):
        with contextlib.suppress(BadRequest):
            parse(data)
