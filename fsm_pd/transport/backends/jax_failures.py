"""How the jax backend reads failures: the library's error text, the manifest, and a dead producer address.

The library reports every failure as a runtime error on a pulled buffer, with a free-text message. This module
turns those into the contract's exceptions with the right blame, and decides whether the connection that carried
them can still be trusted.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from fsm_pd.transport.backends.base import TransferError, TransferFailed, TransferTimeout
from fsm_pd.transport.backends.jax_manifest import STATUS_OK, Manifest, ManifestError
from fsm_pd.transport.backends.spec import layout_digest, spec_keys, summarize

ERROR_PREFIX = "fsm-pd: "  # marks errors a producer raised on purpose (tombstones), vs. transport failures
# Substrings of the library's messages (jaxlib 0.10.2, xla socket-server.cc / py_socket_transfer.cc).
_CONNECTION_LOST = ("Connection closed", "recv()", "InjectFailure", "Socket", "socket", "Connect")
_LAYOUT_ERRORS = ("out of range", "Invalid slicing", "deleted before transfers completed")


def classify_pull_error(text: str, address: str, uuid: int, timed_out: bool) -> tuple[TransferError, bool]:
    """The exception for a pulled buffer's error ``text``, and whether the connection is now suspect."""
    if timed_out:  # our watchdog poisoned the connection: whatever the text says, the deadline passed
        return TransferTimeout(f"transfer {uuid} from {address} timed out; connection poisoned ({text})"), True
    if ERROR_PREFIX in text:  # a tombstone: P ended the entry on purpose; the connection is fine
        return TransferFailed(text.split(ERROR_PREFIX, 1)[1]), False
    if "Pull expired" in text:
        return TransferTimeout(f"transfer {uuid} from {address}: producer expired the pull ({text})"), False
    if any(s in text for s in _LAYOUT_ERRORS):
        return TransferFailed(f"transfer {uuid}: layout does not match the published entry ({text})", "local"), False
    if any(s in text for s in _CONNECTION_LOST):
        return TransferFailed(f"connection to producer {address} lost during transfer {uuid} ({text})"), True
    return TransferFailed(f"transfer {uuid} from {address} failed: {text}"), True


def check_manifest(
    arr: jax.Array,
    uuid: int,
    want: Sequence[jax.ShapeDtypeStruct],
    classify: Callable[[Exception], TransferError],
) -> None:
    """Raise unless the pulled manifest is an open entry for ``uuid`` whose layout is exactly ``want``."""
    try:
        arr.block_until_ready()
        manifest = Manifest.decode(np.asarray(arr))
    except ManifestError as exc:
        raise TransferFailed(f"transfer {uuid}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - the runtime's error on a pulled buffer
        raise classify(exc) from exc
    if manifest.uuid != uuid:
        raise TransferFailed(f"asked for transfer {uuid}, producer answered with {manifest.uuid}")
    if manifest.status != STATUS_OK:  # a tombstone on jaxlibs without make_error_array
        raise TransferFailed(f"transfer {uuid} {manifest.text}")
    want_keys = spec_keys(want, count_shards=True)
    if manifest.digest != layout_digest(want_keys):
        raise TransferFailed(
            f"spec mismatch for transfer {uuid}: published {manifest.text}, expected {summarize(want_keys)}", "local"
        )


def refuse_dead_address(address: str, deadline: float) -> None:
    """Fail at once if nothing listens at ``address`` (``host:port`` of a producer's transfer server).

    The library's connect never fails: it retries every 2 s forever, so a pull to a dead producer would only end at
    its deadline. One plain TCP connect to the control port tells "refused" apart in well under a millisecond; any
    other outcome (slow, filtered) is left to the pull and its watchdog.
    """
    host, _, port = address.rpartition(":")
    timeout = min(1.0, max(0.05, deadline - time.monotonic()))
    try:
        probe = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    except ConnectionRefusedError as exc:
        raise TransferFailed(f"producer {address} is not listening (connection refused)") from exc
    except (OSError, ValueError):
        return
    probe.close()
