"""Bound and advertised addresses: what a node listens on (``--host``), what it tells peers (``--advertise-host``).

A node binds its sockets to one host and advertises, in everything a peer will connect to (the bootstrap
registration, the side channel's ``origin``/``reply_to``, the transfer endpoint), a host the peer can reach. The two
differ when a node binds a wildcard (``0.0.0.0``, ``::``) or sits behind NAT. A wildcard is never advertised: a peer
told ``tcp://0.0.0.0:PORT`` connects to itself, which only looks right while both nodes share a machine.

IPv6 literals go in brackets wherever a port follows (``tcp://[::1]:5555``, ``http://[::1]:30000``, ``[::1]:7000``),
and bare everywhere else (``socket.bind(("::1", 0))``, the bootstrap registration's ``rank_ip``).
"""

from __future__ import annotations

import ipaddress

__all__ = ["WildcardAddress", "advertised_host", "bare_host", "is_ipv6", "is_wildcard", "with_host", "with_port"]


class WildcardAddress(ValueError):
    """A node was asked to advertise a wildcard address, or binds one with nothing else to advertise."""


def bare_host(host: str) -> str:
    """``host`` without IPv6 brackets: ``[::1]`` -> ``::1``."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_ipv6(host: str) -> bool:
    """True for an IPv6 literal (bracketed or not); host names and IPv4 literals are False."""
    return ":" in bare_host(host)


def is_wildcard(host: str) -> bool:
    """True for an address that means "every interface" (``0.0.0.0``, ``::``, ``*``, empty): fine to bind, useless
    to advertise."""
    host = bare_host(host.strip())
    if host in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False  # a host name


def with_port(host: str, port: int | str) -> str:
    """``host:port``, IPv6 in brackets: the authority part of a URL or a ``tcp://`` endpoint."""
    host = bare_host(host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def with_host(address: str, host: str) -> str:
    """``address`` (``scheme://HOST:PORT`` or ``HOST:PORT``) with its host replaced by ``host``."""
    scheme, sep, rest = address.rpartition("://")
    _, colon, port = rest.rpartition(":")
    if not colon or not port.isdigit():
        raise ValueError(f"not a HOST:PORT address: {address!r}")
    return f"{scheme}{sep}{with_port(host, port)}"


def advertised_host(bind_host: str, advertise_host: str | None = None) -> str:
    """The host a node bound to ``bind_host`` tells its peers: ``advertise_host`` when given, else ``bind_host``.

    Raises ``WildcardAddress`` when the answer would be a wildcard: a node bound to ``0.0.0.0`` or ``::`` must be told
    which of its addresses the peers reach (``--advertise-host``).
    """
    if advertise_host is not None:
        if is_wildcard(advertise_host):
            raise WildcardAddress(f"--advertise-host {advertise_host!r} is a wildcard address; give the address "
                                  "(or host name) that peers on other machines connect to, e.g. 10.0.0.11")
        return bare_host(advertise_host.strip())
    if is_wildcard(bind_host):
        raise WildcardAddress(f"--host {bind_host!r} listens on every interface, so it says nothing about where peers "
                              "can reach this node; add --advertise-host with the address they connect to "
                              "(e.g. --advertise-host 10.0.0.11)")
    return bare_host(bind_host)
