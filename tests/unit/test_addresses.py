"""Bound vs advertised addresses (``fsm_pd.transport.addresses``) and ``fsm-pd serve --advertise-host``'s refusal of
a wildcard with nothing to advertise."""

from __future__ import annotations

import pytest

from fsm_pd.cli.serve import serve_main
from fsm_pd.serving.types import Bootstrap
from fsm_pd.transport.addresses import (
    WildcardAddress,
    advertised_host,
    bare_host,
    is_wildcard,
    with_host,
    with_port,
)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "", "*", " 0.0.0.0 ", "0:0:0:0:0:0:0:0"])
def test_wildcards(host):
    assert is_wildcard(host)


@pytest.mark.parametrize("host", ["127.0.0.1", "10.213.0.11", "::1", "[fd00::5]", "prefill-0.internal", "localhost"])
def test_not_wildcards(host):
    assert not is_wildcard(host)


def test_ipv6_goes_in_brackets_before_a_port_and_bare_elsewhere():
    assert with_port("::1", 80) == "[::1]:80" == with_port("[::1]", 80)
    assert with_port("10.0.0.1", 80) == "10.0.0.1:80" and with_port("node-a", "0") == "node-a:0"
    assert bare_host("[fd00::1]") == "fd00::1" and bare_host("10.0.0.1") == "10.0.0.1"
    assert Bootstrap("::1", 8998, 0).addr == "[::1]:8998" == Bootstrap("[::1]", 8998, 0).addr


def test_with_host_replaces_only_the_host():
    assert with_host("tcp://0.0.0.0:5555", "10.213.0.11") == "tcp://10.213.0.11:5555"
    assert with_host("tcp://[::]:5555", "fd00::11") == "tcp://[fd00::11]:5555"
    assert with_host("tcp://[::ffff:0.0.0.0]:7", "[::1]") == "tcp://[::1]:7"
    assert with_host("0.0.0.0:7000", "node-b") == "node-b:7000"  # the jax backend's form, no scheme
    with pytest.raises(ValueError, match="HOST:PORT"):
        with_host("tcp://10.0.0.1", "10.0.0.2")


def test_the_advertised_host_defaults_to_the_bound_one_and_is_never_a_wildcard():
    assert advertised_host("127.0.0.1") == "127.0.0.1"
    assert advertised_host("[::1]") == "::1"  # bare: the bootstrap registration's rank_ip
    assert advertised_host("0.0.0.0", "10.213.0.11") == "10.213.0.11"
    assert advertised_host("10.213.0.11", "prefill-0.example") == "prefill-0.example"  # NAT: bind one, name another
    with pytest.raises(WildcardAddress, match="--advertise-host"):
        advertised_host("0.0.0.0")
    with pytest.raises(WildcardAddress, match="--advertise-host"):
        advertised_host("::")
    with pytest.raises(WildcardAddress, match="wildcard"):
        advertised_host("10.213.0.11", "0.0.0.0")


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_serve_refuses_a_wildcard_host_without_advertise_host_before_loading_a_model(role, capsys):
    with pytest.raises(SystemExit) as exit_:
        # a model that does not exist: reaching the model loader would fail differently (exit 2 with "cannot load")
        serve_main(["--role", role, "--host", "0.0.0.0", "--model", "/nonexistent.gguf"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--host '0.0.0.0' listens on every interface" in err and "--advertise-host" in err
    assert "cannot load model" not in err


def test_serve_names_advertise_host_in_its_help(capsys):
    with pytest.raises(SystemExit):
        serve_main(["--role", "decode", "--help"])
    out = capsys.readouterr().out
    assert "--advertise-host ADDR" in out and "reply_to" in out
