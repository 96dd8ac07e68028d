"""Transport: the signed side channel between nodes (``side_channel``) and the KV data-plane backends (``backends``).

The names below load their module on first use (PEP 562), so importing one zmq-free module of this package
(``messages``, ``errors``, ``backends.base``) does not load zmq with the side channel: the effect handlers and the
simulation import those alone.
"""

from __future__ import annotations

from fsm_pd.runtime.lazy import lazy_exports

_HOME = {
    "Abort": "messages",
    "BackendUnavailable": "backends",
    "BadPeerAddress": "errors",
    "CODEC": "messages",
    "ChannelClosed": "errors",
    "DROP_REASONS": "side_channel",
    "Heartbeat": "messages",
    "MalformedMessage": "messages",
    "Message": "messages",
    "MessageTooLarge": "errors",
    "MessageType": "messages",
    "OpenEntries": "backends",
    "PeerUnreachable": "errors",
    "Prepare": "messages",
    "Pulled": "messages",
    "Ready": "messages",
    "RejectedFrame": "signing",
    "SECRET_ENV": "signing",
    "SecretError": "signing",
    "SideChannel": "side_channel",
    "SideChannelError": "errors",
    "TransferBackend": "backends",
    "TransferError": "backends",
    "TransferFailed": "backends",
    "TransferTimeout": "backends",
    "UnknownBackendError": "backends",
    "backend_names": "backends",
    "create_backend": "backends",
    "generate_secret": "signing",
    "new_instance_id": "messages",
    "new_uuid": "backends",
    "parse_secret": "signing",
    "register_backend": "backends",
    "secret_env": "signing",
    "secret_from_env": "signing",
}

__all__, __getattr__ = lazy_exports(__name__, _HOME)
