"""``--role pd``'s own flags: the KV pools' sizes, P and D on devices of their own, the start-up wait, and the built-in
router's policy. Jax-free, as ``flags.py``."""

from __future__ import annotations

import argparse

from fsm_pd.cli.flag_values import at_least, seconds, share

# the router's --pd-policy modes and --local-prefill-max-tokens default (router/policy.py: MODES,
# DEFAULT_LOCAL_PREFILL_MAX_TOKENS), written here because importing the router package imports its app, too heavy
# for a command line that must fail in a second (tests/unit/test_serve_flag_checks.py holds them equal)
PD_POLICIES = ("auto", "always", "never")
DEFAULT_LOCAL_PREFILL_MAX_TOKENS = 256
PD_FRONTS = ("router", "direct")


def pd_backend(args: argparse.Namespace) -> str:
    """``--role pd``'s transfer backend: the one asked for, else ``pool`` (one pool on one set of devices) or, with
    the roles on devices of their own, ``device``."""
    if args.transfer_backend is not None:
        return args.transfer_backend
    return "device" if args.prefill_devices is not None or args.decode_devices is not None else "pool"


def local_prefill_max_tokens(args: argparse.Namespace, max_context: int) -> int:
    """``--pd-policy auto``'s threshold: the one asked for; else, where both engines share one pool, every prompt
    the model takes (``max_context``); else the router's default.

    On one pool the two routes run the same prefill in the same steps of one loop, and the handoff route adds its
    own work (a room on each side, their transitions and journal rows): on a TPU v5e the handoff route served
    0.94x and 0.91x of the local one's output at 2,000- and 4,000-token prompts, 0.90x at 900 (``docs/tpu.md``,
    rounds 14 and 15), with a decode TPOT p90 no better. The 256 of the router's default was measured between two
    processes, each with a core of its own (``router/policy.py``)."""
    if args.local_prefill_max_tokens is not None:
        return args.local_prefill_max_tokens
    return max_context if pd_backend(args) == "pool" else DEFAULT_LOCAL_PREFILL_MAX_TOKENS


DEFAULT_PD_STARTUP_WAIT_S = 300.0  # a cold start on a TPU v5e took 73-102 s to ready (docs/tpu.md)


def add_pd_flags(parser: argparse.ArgumentParser) -> None:
    """``--role pd``'s own: how the device's memory is split between the two engines' KV pools, and the router's
    policy."""
    pools = parser.add_argument_group(
        "the KV pools (both engines share the devices and the weights, loaded once)",
        "With --transfer-backend pool (the default) both engines share one pool of the two sizes added up; with "
        "another backend each has its own. On an accelerator, by default they take KV_SHARE of the device memory "
        "left free once the weights are loaded, split by --prefill-pool-share; on a CPU each share is 512 pages (the "
        "nodes' --num-pages default). --prefill-pages / --decode-pages set a share outright.")
    pools.add_argument("--prefill-pages", type=at_least(2), default=None, metavar="N",
                       help="the prefill engine's pool in pages, the padding page included (it holds a prompt's KV "
                            "only until the decode engine has taken it)")
    pools.add_argument("--decode-pages", type=at_least(2), default=None, metavar="N",
                       help="the decode engine's pool in pages (it holds every running request's whole context)")
    pools.add_argument("--prefill-pool-share", type=share, default=0.25, metavar="F",
                       help="on an accelerator, the prefill pool's share of the memory both pools take, the rest the "
                            "decode pool's: above 0, below 1 (default 0.25)")
    pools.add_argument("--kv-memory-fraction", type=share, default=0.8, metavar="KV_SHARE",
                       help="on an accelerator, the share of the device memory left after the weights that the two "
                            "pools take together, the rest kept for activations and programs: above 0, below 1 "
                            "(default 0.8)")
    split = parser.add_argument_group(
        "P and D on devices of their own (tpu-inference's one-host layout: a chip for prefill, a chip for decode)",
        "Without these both engines run on the first device (one pool: --transfer-backend pool). With them, the "
        "prefill engine takes the first N devices and the decode engine the next M, each with its own copy of the "
        "weights and its own pool, and a handoff copies the request's pages device to device (--transfer-backend "
        "device). One device a role for now.")
    split.add_argument("--prefill-devices", type=at_least(1), default=None, metavar="N",
                       help="devices of the prefill engine (with --decode-devices)")
    split.add_argument("--decode-devices", type=at_least(1), default=None, metavar="M",
                       help="devices of the decode engine (with --prefill-devices)")
    parser.add_argument("--startup-wait-secs", type=seconds(), default=DEFAULT_PD_STARTUP_WAIT_S, metavar="S",
                        help="a request that arrives while the process starts (both engines compile) waits this long "
                             "for it to be ready, then is served; past it, 503 starting (default "
                             f"{DEFAULT_PD_STARTUP_WAIT_S:g}; /health is 503 starting until ready)")
    router = parser.add_argument_group("in front of the two engines: a node's app over both (default), or the built-in "
                                       "router (fsm-pd serve --role router's); either routes by --pd-policy")
    router.add_argument("--pd-front", choices=PD_FRONTS, default="direct",
                        help="what serves the process's HTTP API: direct (default): a node's app over both engines, "
                             "which plans a request once and submits it to each engine itself (cli/pd_pair.py); "
                             "router: the built-in router, which calls each engine's own app in process (a second "
                             "app, template and several event-loop turns a request: on a TPU v5e, 36 ms more of a "
                             "decode-heavy TTFT outside the engines than a colocated node's)")
    router.add_argument("--pd-policy", choices=PD_POLICIES, default="auto",
                        help="which requests go through the prefill engine: auto (default): prompts over "
                             "--local-prefill-max-tokens, the rest are prefilled by the decode engine itself; always: "
                             "every request (each a handoff); never: none")
    router.add_argument("--local-prefill-max-tokens", type=at_least(0), default=None,
                        help="with auto: prompts of at most this many tokens are prefilled on the decode engine "
                             "(default: every prompt where both engines share one pool, --transfer-backend pool, "
                             "since there the handoff only adds its own cost; "
                             f"{DEFAULT_LOCAL_PREFILL_MAX_TOKENS} with the roles on devices of their own)")
