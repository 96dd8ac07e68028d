"""``launch.free_port``: the ports fsm-pd launch (and every test that starts a server) hands to a server it starts."""

from __future__ import annotations

import socket

from real_parts import TCP

from fsm_pd.cli import children, launch

pytestmark = TCP  # a free port is one a TCP socket can bind on 127.0.0.1 (tests/real_parts.py)


def test_ports_are_below_the_ephemeral_range_and_never_handed_out_twice():
    low = children._ephemeral_low()
    ports = [launch.free_port() for _ in range(1000)]  # without the rule, a repeat is all but certain
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < low for p in ports)  # no outgoing connection can take one before its server binds it


def test_a_port_someone_listens_on_is_skipped(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", launch.free_port()))
        held.listen()
        taken = held.getsockname()[1]
        children._handed_out.discard(taken)
        draws = iter([taken, taken, *range(taken + 1, taken + 100)])
        monkeypatch.setattr(children.random, "randrange", lambda *_: next(draws))
        assert launch.free_port() > taken
