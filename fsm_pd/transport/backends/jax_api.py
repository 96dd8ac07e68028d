"""What this jaxlib's ``jax.experimental.transfer`` offers, and the one transfer server per process.

The API is experimental and grew piece by piece (see ``docs/data-plane.md``): ``make_error_array`` (0.7.2),
``_poison_connection`` (0.8.1), ``timeout=`` on ``pull``/``await_pull`` (0.10.1). Everything here is feature
detection on the installed build, so that the backend uses what exists and says what it cannot do.
"""

from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass

import jax

from fsm_pd.transport.addresses import with_port


@dataclass(frozen=True, slots=True)
class TransferFeatures:
    available: bool
    why_unavailable: str = ""
    timeouts: bool = False  # pull/await_pull accept an absolute deadline enforced (lazily) by the producer
    error_arrays: bool = False  # make_error_array: an entry that answers every pull with an error
    poison: bool = False  # TransferConnection._poison_connection: fail every pending pull on a connection
    reset_table: bool = False  # TransferServer._reset_rendevous_table: drop every entry (not used, only reported)


def detect_features() -> TransferFeatures:
    try:
        from jax._src.lib import _jax
        from jax.experimental import transfer  # noqa: F401 - importing is part of the check
    except ImportError as exc:
        return TransferFeatures(False, f"jax.experimental.transfer is not importable: {exc}")
    if not hasattr(_jax, "TransferServer") or not hasattr(_jax, "start_transfer_server"):
        # Built only for Linux jaxlibs.
        return TransferFeatures(False, f"jaxlib {jax.__version__} has no TransferServer (Linux-only native module)")
    conn_cls, server_cls = _jax.TransferConnection, _jax.TransferServer
    pull_sig = getattr(conn_cls._pull_flat, "__doc__", "") or ""
    await_sig = getattr(server_cls._await_pull_flat, "__doc__", "") or ""
    return TransferFeatures(
        available=True,
        timeouts="timeout" in pull_sig and "timeout" in await_sig,
        error_arrays=hasattr(_jax, "_make_error_array"),
        poison=hasattr(conn_cls, "_poison_connection"),
        reset_table=hasattr(server_cls, "_reset_rendevous_table"),
    )


def wall_deadline(monotonic_deadline: float) -> datetime.datetime:
    """The library wants an absolute wall-clock ``datetime``; our deadlines are monotonic."""
    return datetime.datetime.fromtimestamp(time.time() + (monotonic_deadline - time.monotonic()))


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    # Parallel bulk TCP channels. An empty list would select in-process queues, which crash (CHECK failure) as
    # soon as a second server exists in the process, so there is always at least one.
    channels: int = 4
    # Chunk size and concurrent device-to-host copies; host RAM cost is about 3 * parallel_copies * transfer_size
    # (the library default, 8 x 256 MiB, would reserve ~6 GiB per process).
    transfer_size: int = 8 << 20
    parallel_copies: int = 8

    def __post_init__(self) -> None:
        if self.channels < 1 or self.parallel_copies < 1 or self.transfer_size < 4096:
            raise ValueError(f"invalid transfer server config {self}")


_server_lock = threading.Lock()
_server: tuple[ServerConfig, object] | None = None


def shared_server(config: ServerConfig) -> object:
    """The process's transfer server, started on first use. Every backend in the process shares it.

    One server per process: each one reserves its own staging memory and ports, and uuids live in one namespace.
    The server lives until the process exits (the library has no stop call; dropping it would free entries that
    another backend in the process may still hold).
    """
    global _server
    with _server_lock:
        if _server is None:
            from jax.experimental import transfer

            client = jax.local_devices()[0].client
            server = transfer.start_transfer_server(
                client,
                with_port(config.host, config.port),
                [with_port(config.host, 0)] * config.channels,
                max_num_parallel_copies=config.parallel_copies,
                transfer_size=config.transfer_size,
                use_raw_buffers=False,  # entries own references: the source cannot vanish mid-transfer
            )
            _server = (config, server)
        elif _server[0] != config:
            raise ValueError(f"this process's transfer server already runs with {_server[0]}, not {config}")
        return _server[1]
