"""PrefillResolver against a real bootstrap server: lookups name the prefill process's instance, are cached, and are
forgotten by bootstrap URL, by side-channel address, or by address and instance, so that a decode node asks afresh
once the prefill node it knew is dead or replaced; and rooms waiting on a dead server's lookup hold no worker."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from processes import free_port

from fsm_pd.bootstrap import BootstrapServer
from fsm_pd.control.resolver import PrefillResolver, register_prefill
from fsm_pd.control.workers import ThreadedResolver

LAYOUT = {"num_layers": 2, "num_pages": 16, "page_size": 4, "kv_heads": 1, "head_dim": 8, "dtype": "float32"}
OLD_ADDR, NEW_ADDR = "tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556"


@pytest.fixture
def server():
    with BootstrapServer() as running:
        yield running


def register(server: BootstrapServer, side_channel: str, instance: str | None) -> None:
    register_prefill(server.url, host="127.0.0.1", side_channel=side_channel, transfer_addr="127.0.0.1:6000",
                     backend="tcp", layout=LAYOUT, node_id="prefill-0", instance=instance, attempts=1)


def test_a_lookup_names_the_instance_and_a_forgotten_one_finds_the_restarted_node(server):
    resolver = PrefillResolver(retries=0)
    ctx = {"bootstrap_addr": server.url.removeprefix("http://")}
    register(server, OLD_ADDR, "aaaaaaaaaaaaaaaa")
    assert resolver(ctx) == {"prefill_addr": OLD_ADDR, "peer": "prefill-0", "bootstrap_url": server.url,
                             "prefill_instance": "aaaaaaaaaaaaaaaa"}

    register(server, NEW_ADDR, "bbbbbbbbbbbbbbbb")  # the prefill node restarted and re-registered
    assert resolver(ctx)["prefill_instance"] == "aaaaaaaaaaaaaaaa"  # cached until told otherwise
    assert resolver.forget_peer(NEW_ADDR) == 0  # nothing cached there
    assert resolver.forget_peer(OLD_ADDR, instance="bbbbbbbbbbbbbbbb") == 0  # a report about another instance
    assert resolver.forget_peer(OLD_ADDR, instance="aaaaaaaaaaaaaaaa") == 1
    assert resolver(ctx) == {"prefill_addr": NEW_ADDR, "peer": "prefill-0", "bootstrap_url": server.url,
                             "prefill_instance": "bbbbbbbbbbbbbbbb"}

    # a late report about the dead instance leaves the lookup of its successor alone
    assert resolver.forget_peer(NEW_ADDR, instance="aaaaaaaaaaaaaaaa") == 0
    register(server, NEW_ADDR, "cccccccccccccccc")  # restarted again, at the same address this time
    assert resolver(ctx)["prefill_instance"] == "bbbbbbbbbbbbbbbb"
    assert resolver.forget_peer(NEW_ADDR) == 1  # dead: whatever instance was cached there
    assert resolver(ctx)["prefill_instance"] == "cccccccccccccccc"


def test_forget_by_url_still_drops_every_entry_of_that_server(server):
    resolver = PrefillResolver(retries=0)
    ctx = {"bootstrap_addr": server.url}
    register(server, OLD_ADDR, "aaaaaaaaaaaaaaaa")
    resolver(ctx)
    register(server, NEW_ADDR, "bbbbbbbbbbbbbbbb")
    resolver.forget(server.url)
    assert resolver(ctx)["prefill_addr"] == NEW_ADDR


def test_a_node_that_registered_no_instance_and_a_direct_address_give_none(server):
    resolver = PrefillResolver(retries=0)
    register(server, OLD_ADDR, None)
    assert "prefill_instance" not in resolver({"bootstrap_addr": server.url})
    assert resolver({"prefill_addr": NEW_ADDR}) == {"prefill_addr": NEW_ADDR, "peer": "prefill"}


def test_rooms_waiting_on_a_dead_bootstrap_server_hold_no_worker_from_a_live_one(server):
    """A prefill node died with its bootstrap server: its lookup is retried for seconds. Rooms that wait on it join
    that one lookup instead of each holding a worker, so a room of a live node is looked up (or answered from the
    cache, at once) before the dead server's lookup gives up."""
    register(server, OLD_ADDR, "aaaaaaaaaaaaaaaa")
    dead = {"bootstrap_addr": f"127.0.0.1:{free_port()}"}  # nothing listens there
    live = {"bootstrap_addr": server.url.removeprefix("http://")}
    answered: list[str] = []
    all_done = threading.Event()

    def done(name: str):
        def report(found, error):
            answered.append(name if error is None else f"{name} failed")
            if len(answered) == 6:
                all_done.set()
        return report

    with ThreadPoolExecutor(max_workers=2) as workers:
        lookups = PrefillResolver(retries=2, interval_s=1.0)
        resolver = ThreadedResolver(lambda: lookups, workers)
        for _ in range(4):
            resolver.resolve(dead, done("dead"))
        resolver.resolve(live, done("live"))  # not cached yet: a worker must be free for it
        assert all_done.wait(0) is False
        while "live" not in answered and len(answered) < 5:
            threading.Event().wait(0.01)
        resolver.resolve(live, done("live, cached"))
        assert answered[-1] == "live, cached"  # answered before resolve() returned, from the cache
        assert all_done.wait(30), answered
    assert answered == ["live", "live, cached"] + ["dead failed"] * 4, answered
