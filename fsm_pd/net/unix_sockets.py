"""Unix sockets, the transport beside TCP: their addresses, their paths' limit, and listening on one safely.

A node started with ``--uds PATH`` opens no TCP socket at all (a host may allow none, not even on loopback). Its
addresses are written ``unix:PATH`` wherever a URL or an address is taken (a worker of the router, a bootstrap server,
the ``tcp`` backend's transfer endpoint) and ``ipc://PATH`` where ZeroMQ takes it (the side channel, the ``zmq``
backend). Paths are made absolute, since peers run in other directories.

Linux keeps a unix socket's path in ``sun_path``, 108 bytes with the final NUL: a longer path cannot be bound
(``check_path`` says so in one line, before anything is loaded). ``Listener`` removes a socket file that a crashed
run left behind, but only once a connection to it was refused: a live server's socket is never taken over, and
removes its file when it closes, unless another process has bound the path since.

``require_tcp`` is the other side: before ZeroMQ binds ``tcp://``, a plain socket tries first, because on a host that
refuses TCP libzmq aborts the whole process instead of raising.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat

__all__ = ["SUN_PATH_MAX", "UNIX_BACKENDS", "Listener", "TcpRefused", "UnixPathError", "check_path",
           "check_unix_backend", "clear_stale", "ipc_address", "ipc_file", "is_unix", "node_socket",
           "node_socket_paths", "prepare_zmq_bind", "remove_listener_files", "remove_socket", "require_tcp",
           "unix_address", "unix_path"]

PREFIX = "unix:"
UNIX_BACKENDS = ("tcp", "zmq")  # the transfer backends that can serve over a unix socket
SOCKETLESS_BACKENDS = ("pool", "device")  # the in-process ones open no socket at all (fsm-pd serve --role pd)
SUN_PATH_MAX = 107  # bytes of a path in sockaddr_un.sun_path (108) less its terminating NUL


class UnixPathError(ValueError):
    """A unix socket path that cannot be used: too long for ``sun_path``, or empty."""


class TcpRefused(OSError):
    """This host does not let the process open a TCP socket (where ZeroMQ would abort the process instead)."""


def is_unix(address: str | None) -> bool:
    """True for a ``unix:PATH`` address (or URL)."""
    return isinstance(address, str) and address.startswith(PREFIX)


def unix_path(address: str) -> str:
    """The absolute socket path of a ``unix:PATH`` address (also ``unix://PATH``); ``ValueError`` for another."""
    if not is_unix(address):
        raise ValueError(f"not a unix:PATH address: {address!r}")
    path = address[len(PREFIX):]
    if path.startswith("//"):
        path = path[2:]
    if not path:
        raise UnixPathError(f"{address!r} names no socket path")
    return os.path.abspath(path)


def unix_address(path: str) -> str:
    """``unix:ABSOLUTE_PATH``."""
    return PREFIX + os.path.abspath(path)


def ipc_address(path: str) -> str:
    """ZeroMQ's name of the unix socket at ``path``."""
    return "ipc://" + os.path.abspath(path)


def node_socket(http_path: str, name: str) -> str:
    """The path of a node's socket ``name`` beside its HTTP socket: ``/run/p.sock`` -> ``/run/p.NAME.sock``."""
    base = os.path.abspath(http_path)
    return (base.removesuffix(".sock") if base.endswith(".sock") else base) + f".{name}.sock"


def check_unix_backend(name: str) -> None:
    """``ValueError`` unless the transfer backend ``name`` can run over unix sockets."""
    if name == "jax":
        raise ValueError("the jax transfer backend (jax.experimental.transfer) connects over IPv4 or IPv6 only and "
                         "cannot run over unix sockets (--uds); use --transfer-backend tcp (or zmq)")
    if name not in UNIX_BACKENDS and name not in SOCKETLESS_BACKENDS:
        raise ValueError(f"the transfer backend {name!r} cannot run over unix sockets (--uds); use "
                         f"--transfer-backend {' or '.join(UNIX_BACKENDS)}")


def node_socket_paths(role: str, uds: str, bootstrap_uds: str | None = None) -> dict[str, str]:
    """Every unix socket a node of ``role`` started with ``--uds uds`` listens on, by what it is for."""
    paths = {"--uds": uds}
    if role in ("prefill", "decode"):
        paths.update({"its side channel": node_socket(uds, "side"), "its transfer server": node_socket(uds, "kv")})
    if role == "prefill":
        paths["its bootstrap server (--bootstrap-uds)"] = bootstrap_uds or node_socket(uds, "bootstrap")
    return paths


def check_path(path: str, what: str = "unix socket") -> str:
    """``path`` made absolute, or ``UnixPathError`` with one line that says why it cannot be bound."""
    if not path:
        raise UnixPathError(f"{what}: the unix socket path is empty")
    full = os.path.abspath(path)
    size = len(os.fsencode(full))
    if size > SUN_PATH_MAX:
        raise UnixPathError(f"{what}: the unix socket path {full} is {size} bytes, more than the {SUN_PATH_MAX} Linux "
                            "allows (sun_path); choose a shorter directory")
    return full


def clear_stale(path: str) -> None:
    """Make ``path`` free to bind: remove a socket file nobody listens on (a crashed run's). Raises ``OSError``
    (EADDRINUSE) when a server answers there, and ``FileExistsError`` when the path is not a socket."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(errno.EEXIST, f"{path} exists and is not a socket; not removing it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            pass  # nobody listens: left behind by a process that is gone
        except FileNotFoundError:
            return
        else:
            raise OSError(errno.EADDRINUSE, f"another process already listens on {path}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class Listener:
    """A listening unix stream socket at ``path`` (stale file removed first); ``close`` removes the file too, if it
    is still the one bound here. The open ones are known (``remove_listener_files``), for a process that ends
    without closing them."""

    listening: set[Listener] = set()

    def __init__(self, path: str, *, what: str = "unix socket", backlog: int = 2048):
        self.path = check_path(path, what)
        clear_stale(self.path)
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.socket.bind(self.path)
            self._inode = os.stat(self.path).st_ino
            self.socket.listen(backlog)
        except OSError:
            self.socket.close()
            raise
        Listener.listening.add(self)

    @property
    def address(self) -> str:
        return unix_address(self.path)

    def close(self) -> None:
        Listener.listening.discard(self)
        self.socket.close()
        remove_socket(self.path, self._inode)

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def remove_listener_files() -> None:
    """Remove the file of every ``Listener`` still open: for a process about to end at once (``os._exit``) while a
    server still listens, whose file would otherwise stay behind. The sockets themselves close with the process."""
    for listener in list(Listener.listening):
        remove_socket(listener.path, listener._inode)


def remove_socket(path: str, inode: int | None = None) -> None:
    """Remove the socket file at ``path``; with ``inode``, only while it is that file (no successor's)."""
    with contextlib.suppress(FileNotFoundError):
        found = os.stat(path)
        if stat.S_ISSOCK(found.st_mode) and (inode is None or found.st_ino == inode):
            os.unlink(path)


def require_tcp(host: str, what: str) -> None:
    """Raise ``TcpRefused`` when a TCP socket cannot be bound on ``host`` here (a plain socket tries, port 0)."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    bare = "0.0.0.0" if bare in ("", "*") else bare
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((bare, 0))
    except OSError as exc:
        raise TcpRefused(exc.errno, f"cannot open a TCP socket on {host} for {what}: {exc.strerror or exc}; where "
                                    "this host allows no TCP, serve over unix sockets (--uds PATH)") from exc


def prepare_zmq_bind(endpoint: str, what: str) -> None:
    """Check, before ZeroMQ binds ``endpoint``, what ZeroMQ would not: an ``ipc://`` path's length and that no live
    server holds it (libzmq removes whatever file is there), and for ``tcp://`` that this host allows TCP at all
    (libzmq aborts the process where it does not)."""
    if endpoint.startswith("ipc://"):
        clear_stale(check_path(endpoint[len("ipc://"):], what))
    elif endpoint.startswith("tcp://"):
        require_tcp(endpoint[len("tcp://"):].rpartition(":")[0], what)


def ipc_file(endpoint: str) -> tuple[str, int] | None:
    """``(path, inode)`` of the socket file ZeroMQ bound for an ``ipc://`` endpoint, for ``remove_socket`` when the
    socket closes (libzmq leaves the file behind); None for another endpoint."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://"):]
    return path, os.stat(path).st_ino
