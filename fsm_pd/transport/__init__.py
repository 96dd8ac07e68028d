"""Transport: the signed side channel between nodes (``side_channel``) and the KV data-plane backends (``backends``)."""

from fsm_pd.transport.messages import (
    CODEC,
    Abort,
    AbortAck,
    Heartbeat,
    MalformedMessage,
    Message,
    MessageType,
    Prepare,
    Pulled,
    Ready,
)
from fsm_pd.transport.side_channel import (
    DROP_REASONS,
    BadPeerAddress,
    ChannelClosed,
    MessageTooLarge,
    PeerUnreachable,
    SideChannel,
    SideChannelError,
)
from fsm_pd.transport.signing import (
    SECRET_ENV,
    RejectedFrame,
    SecretError,
    generate_secret,
    parse_secret,
    secret_env,
    secret_from_env,
)

__all__ = [
    "CODEC",
    "DROP_REASONS",
    "SECRET_ENV",
    "Abort",
    "AbortAck",
    "BadPeerAddress",
    "ChannelClosed",
    "Heartbeat",
    "MalformedMessage",
    "Message",
    "MessageTooLarge",
    "MessageType",
    "PeerUnreachable",
    "Prepare",
    "Pulled",
    "Ready",
    "RejectedFrame",
    "SecretError",
    "SideChannel",
    "SideChannelError",
    "generate_secret",
    "parse_secret",
    "secret_env",
    "secret_from_env",
]
