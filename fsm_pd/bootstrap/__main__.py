"""``python -m fsm_pd.bootstrap``: run a standalone bootstrap server until SIGINT or SIGTERM.

The first line on stdout is the server's URL (``http://127.0.0.1:PORT``, or ``unix:PATH`` with ``--uds``), so a
launcher that passed ``--port 0`` can read where it landed; logs go to stderr. ``add_arguments`` and ``serve`` are
what ``fsm-pd serve --role bootstrap`` reuses.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from fsm_pd.bootstrap.server import DEFAULT_MAX_BODY_BYTES, BootstrapServer
from fsm_pd.net.unix_sockets import UnixPathError, check_path

TOKEN_ENV = "FSM_PD_BOOTSTRAP_TOKEN"
DESCRIPTION = """\
Run the bootstrap server of a prefill/decode deployment: prefill ranks register where they listen (PUT /route),
decode nodes look them up (GET /route), and a decode's heartbeat probes GET /health. Speaks SGLang's bootstrap
protocol, so SGLang prefill and decode servers can use it too; see docs/bootstrap.md."""
EPILOG = f"""\
token: with --token (or ${TOKEN_ENV}, which keeps it out of the process list) the writes, PUT /route and
POST /register_dp_rank, need "Authorization: Bearer <token>" and get 401 without it. Reads stay open, since
SGLang's decode sends no token. Bind another address than 127.0.0.1 only on a network you trust, and with a token.
"""


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8998,
                        help="port to listen on; 0 picks a free one (default: 8998, SGLang's bootstrap port)")
    parser.add_argument("--uds", default=None, metavar="PATH",
                        help="listen on this unix socket instead of --host/--port, and open no TCP socket; prefill "
                             "and decode nodes then name it unix:PATH (docs/operations.md, Serving over unix sockets)")
    parser.add_argument("--token", default=None,
                        help=f"shared token the writes must carry as a bearer token (default: ${TOKEN_ENV}, "
                             "else no token)")
    parser.add_argument("--expected-ranks", type=_positive_int, default=None,
                        help="how many prefill ranks will register; a registration describing another count is "
                             "refused (default: whatever the first registration's layout says)")
    parser.add_argument("--entry-ttl-s", type=_positive_float, default=120.0,
                        help="seconds a bootstrap_room -> dp_rank entry is kept (default: 120, as SGLang's "
                             "SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL)")
    parser.add_argument("--max-body-bytes", type=_positive_int, default=DEFAULT_MAX_BODY_BYTES,
                        help=f"larger request bodies get 413 (default: {DEFAULT_MAX_BODY_BYTES})")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="log level on stderr (default: INFO)")


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None
    if args.uds is not None:
        try:
            check_path(args.uds, "--uds")
        except UnixPathError as exc:
            print(f"fsm-pd bootstrap: {exc}", file=sys.stderr)
            return 2
    elif token is None and not _is_loopback(args.host):
        logging.getLogger(__name__).warning(
            "listening on %s without a token: anyone who reaches it can register prefill ranks", args.host)
    server = BootstrapServer(args.host, args.port, expected_ranks=args.expected_ranks, token=token,
                             entry_ttl_s=args.entry_ttl_s, max_body_bytes=args.max_body_bytes, uds=args.uds)
    try:
        server.start()
    except (OSError, RuntimeError) as exc:
        where = args.uds or f"{args.host}:{args.port}"
        print(f"fsm-pd bootstrap: cannot listen on {where}: {exc}", file=sys.stderr)
        return 1
    print(server.url, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):  # a timed wait lets the signal handler run promptly everywhere
            pass
    finally:
        server.stop()
    return 0


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsm_pd.bootstrap", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
