"""The value types of the command line's flags: each checks a value as argparse parses it, so that a refused one ends
the command with one line (``one_line_errors``) before anything loads. Jax-free."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    parse.__name__ = f"integer of at least {low}"
    return parse


positive_int = at_least(1)


def port(text: str) -> int:
    """An argparse type: a TCP port, 0 to 65535 (0: any free one)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 0 to 65535, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 0 to 65535, got {value}")
    return value


def seconds(*, zero: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds, above 0 (or at least 0 with ``zero``)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"must be {'at least 0' if zero else 'above 0'} seconds, got {text}")
        return value

    parse.__name__ = "seconds"
    return parse


def transfer_backend(text: str) -> str:
    """An argparse type: the name of a transfer backend, built in or a plugin's (``fsm_pd.transfer_backends``): an
    unknown one ends the command here, before any backend, model or node is started."""
    from fsm_pd.transport.backends.registry import backend_names  # jax-free: naming backends imports none of them

    known = backend_names()
    if text not in known:
        raise argparse.ArgumentTypeError(f"unknown transfer backend {text!r} (known: {', '.join(known)})")
    return text


def one_line_errors(parser: argparse.ArgumentParser, prog: str = "fsm-pd serve") -> argparse.ArgumentParser:
    """``parser`` with argparse's errors as one line, ``PROG: error: MESSAGE``, exit status 2, without the usage
    (a node's takes thirty lines, and the line that matters would scroll away)."""
    parser.prog = prog
    parser.error = lambda message: parser.exit(2, f"{prog}: error: {message}\n")  # type: ignore[method-assign]
    return parser


def share(text: str) -> float:
    """A fraction strictly between 0 and 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number between 0 and 1, got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be above 0 and below 1, got {text}")
    return value


def steps(text: str) -> float:
    """--prefill-chunk-steps: a finite number, at least 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be at least 0, got {text}")
    return value
