"""Where the PD engines a test builds in one process listen: 127.0.0.1, or unix sockets on a host with no TCP.

A prefill or decode engine listens on TCP by default (its side channel, a prefill's bootstrap server, a transfer
server), as a node does. On a host that allows no TCP socket at all (a TPU host: ``tests/on_tpu.sh``;
``real_parts.TCP_MISSING``) the tests' engines listen on unix sockets in the test's directory instead, as a node
started with ``--uds`` does, so that the tests of in-process PD still run there, on the chip. The handlers, the
side channel's messages and the data plane are the same; only the sockets' family differs. The same goes for an
HTTP server a test starts in process (``AppServer``), which a client of ``fsm_pd.net.unix_http`` reaches either way.
Where TCP works (CI), nothing changes: ``node_sockets`` adds no argument.

A node on unix sockets takes only a transfer backend that can listen on one (``unix_sockets.check_unix_backend``).
The tests' ``fake`` backend listens nowhere at all (``fake_backend.py``), so where TCP is missing it is one of them:
``allow_the_fake_backend``, called by ``tests/conftest.py``.
"""

from __future__ import annotations

from pathlib import Path

from real_parts import TCP_MISSING

from fsm_pd.net import unix_sockets


def node_sockets(directory: str | Path, name: str, *, bootstrap: bool = False) -> dict[str, str]:
    """The keyword arguments that put an engine, a ``KVManager`` or an ``AppServer`` on the unix socket
    ``directory/name.sock`` (and the sockets a node names beside it) where this host has no TCP; none where it has.
    ``bootstrap``: a prefill engine's bootstrap server too."""
    if TCP_MISSING is None:
        return {}
    path = str(Path(directory) / f"{name}.sock")
    sockets = {"uds": path}
    if bootstrap:
        sockets["bootstrap_uds"] = unix_sockets.node_socket(path, "bootstrap")
    return sockets


def allow_the_fake_backend() -> None:
    if TCP_MISSING is not None and "fake" not in unix_sockets.UNIX_BACKENDS:
        unix_sockets.UNIX_BACKENDS = (*unix_sockets.UNIX_BACKENDS, "fake")
