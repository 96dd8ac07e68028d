"""The side channel's errors, apart from the sockets: the effect handlers catch them without loading zmq."""

from __future__ import annotations


class SideChannelError(Exception):
    """Base of the errors ``SideChannel`` raises."""


class PeerUnreachable(SideChannelError):
    """The peer did not take the frame within ``send_timeout_s`` (dead, not yet started, or gone)."""


class BadPeerAddress(SideChannelError, ValueError):
    """The address is not one this channel can connect to (addresses arrive in messages: treat them as input)."""


class MessageTooLarge(SideChannelError, ValueError):
    """The encoded frame exceeds ``max_frame_bytes``; a peer with the same limit would drop it."""


class ChannelClosed(SideChannelError):
    """The channel was closed."""
