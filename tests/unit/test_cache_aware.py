"""The router's cache-aware selection: conversations stick to the worker that saw their prefix, new ones spread to
the emptiest record, an imbalanced fleet falls back to the least busy worker, and records stay bounded."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fsm_pd.router.cache_aware import CHUNK, EVICT_TO, CacheAwarePicker, CacheAwareSettings, PrefixRecord, routing_key
from fsm_pd.router.fleet import Fleet, Worker

SYSTEM = "You are a helpful assistant who answers in one line. " * 3


@dataclass(eq=False)
class W:
    url: str
    outstanding: int = 0


def test_each_conversation_stays_where_its_history_went_and_new_ones_spread():
    workers = [W("a"), W("b")]
    picker = CacheAwarePicker()
    first = {c: picker.choose(workers, f"conversation {c}: " + "x" * 200).url for c in range(4)}
    assert sorted(first.values()) == ["a", "a", "b", "b"]  # no prefix known: the smaller record takes it
    for turn in range(1, 5):
        for c in range(4):
            history = f"conversation {c}: " + "x" * 200 + f" turn {turn}" * turn
            assert picker.choose(workers, history).url == first[c]


def test_a_shared_system_prompt_alone_does_not_pull_everything_to_one_worker():
    """The match must be more than cache_threshold of the request: a long new question after a short shared system
    prompt may go elsewhere."""
    workers = [W("a"), W("b")]
    picker = CacheAwarePicker(CacheAwareSettings(cache_threshold=0.5))
    picker.choose(workers, SYSTEM + "q" * 30)
    assert picker.choose(workers, SYSTEM + "r" * 1000).url == "b"
    assert picker.choose(workers, SYSTEM + "q" * 30 + " and more").url == "a"


def test_an_imbalanced_fleet_sends_to_the_least_busy_worker():
    workers = [W("a", outstanding=100), W("b", outstanding=10)]
    picker = CacheAwarePicker()
    picker.records["a"] = PrefixRecord(1 << 20)
    picker.records["a"].insert(SYSTEM)
    assert picker.choose(workers, SYSTEM).url == "b"  # a holds the prefix, but 100 > 10 + 64 and > 1.5 x 10
    workers[0].outstanding = 20
    assert picker.choose(workers, SYSTEM).url == "a"


def test_a_record_keeps_at_most_its_size_dropping_the_least_recently_used():
    record = PrefixRecord(max_chars=8 * CHUNK)
    old, new = "o" * (4 * CHUNK), "n" * (4 * CHUNK)
    record.insert(old)
    record.insert(new)
    record.insert(new)  # used again: the old one is the least recently used
    record.insert("m" * (2 * CHUNK))
    assert record.chars <= 8 * CHUNK and record.match(new) == 4 * CHUNK and record.match(old) < 4 * CHUNK


def test_a_full_record_walks_its_tree_once_per_tenth_of_its_size_not_per_request():
    """Eviction walks the whole tree on the router's event loop: it must not run on every request once full."""
    size = 100
    record = PrefixRecord(max_chars=size * CHUNK)
    keys = [f"{i:0{CHUNK}d}" for i in range(1000)]  # 1,000 distinct one-chunk prefixes
    for key in keys:
        record.insert(key)
    assert record.chars <= size * CHUNK and record.match(keys[-1]) == CHUNK and record.match(keys[0]) == 0
    assert record.evictions <= (len(keys) - size) / (size * (1 - EVICT_TO)) + 1, record.evictions


def test_routing_keys_come_from_text_chat_or_ids():
    assert routing_key({"text": "hello"}) == "hello"
    assert routing_key({"prompt": ["first", "second"]}) == "first"
    assert routing_key({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}) == \
        "<system>s<user>u"
    assert routing_key({"input_ids": [1, 2]}) == "[1, 2]" and routing_key("nonsense") == ""


def test_the_fleet_picks_by_prefix_for_both_roles():
    fleet = Fleet([Worker("prefill", "p1"), Worker("prefill", "p2")], [Worker("decode", "d1"), Worker("decode", "d2")],
                  policy="cache_aware")
    for worker in (*fleet.workers["prefill"], *fleet.workers["decode"]):
        worker.admitted = True
    key = SYSTEM + "tell me more"
    chosen = (fleet.pick("prefill", key=key), fleet.pick("decode", key=key))
    assert (fleet.pick("prefill", key=key + " please"), fleet.pick("decode", key=key + " please")) == chosen


@pytest.mark.parametrize("bad", [dict(cache_threshold=1.5), dict(balance_rel_threshold=0.5),
                                 dict(balance_abs_threshold=-1), dict(max_tree_chars=1)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        CacheAwareSettings(**bad)
