"""``fsm-pd serve --role pd``: a prefill engine and a decode engine in one process, behind one HTTP API.

A TPU VM lets one process at a time hold the chip, so PD there cannot be two processes. This runs the same engines a
PD cluster runs, unchanged, in one process: ``PrefillEngine`` (with its bootstrap server) and ``DecodeEngine``, each
with its own KV manager, state machines and journal (``DIR/prefill-0.db``, ``DIR/decode-0.db``, read by ``fsm-pd
replay`` as two nodes' journals). On one set of devices they share one KV pool, model thread and step loop
(``serving/shared_pool.py``), and a handoff moves page ownership (backend ``pool``); with a device each
(``--prefill-devices``/``--decode-devices``) each has its own pool and a handoff copies device to device.

In front (``--pd-front``): by default a node's app whose engine is the pair (``cli/pd_pair.py``: a request planned
once, submitted to both engines with a new room and its ``--pd-policy`` route); or the built-in router, which reaches
each engine's own app in process (``net/asgi_transport.py``). Either is behind ``PDFront`` (``pd_front.py``: start-up,
health, drain), and is the process's public API (``--port`` or ``--uds``).

The engines' side channels, bootstrap server and (for ``tcp``/``zmq``) transfer servers listen on unix sockets in a
private directory made at start and removed at exit, so the process opens no TCP socket unless its own API is on
``--port``.

The weights are loaded once: both engines take the same ``LoadedModel`` (its parameters are read-only; only pools
are donated, and each engine has its own). They load on a thread of their own while the engines are built and their
programs prepared, as on a node (``serve.py``); the pools are sized from the memory the weights will leave
(``pool_pages``). Where each role has a device of its own, the weights come first (they are copied to each).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

from fsm_pd.cli.flags import DEADLINE_FLAGS
from fsm_pd.cli.pd_flags import local_prefill_max_tokens, pd_backend
from fsm_pd.cli.pool_sizes import CPU_POOL_PAGES, free_after_weights, free_bytes, pool_budget
from fsm_pd.net.unix_sockets import UnixPathError, check_path, remove_listener_files, unix_address
from fsm_pd.runtime.process_exit import exit_now, on_exit

log = logging.getLogger("fsm_pd.serve")

OWN_HEALTH_TIMEOUT_S = 30.0  # the router's health checks of this process's engines: a busy model thread is no fault
NEVER = 1 << 30  # failures it takes to eject an engine of this process: never (there is no other to send to)
NODE_IDS = {"prefill": "prefill-0", "decode": "decode-0"}


def role_models(args: argparse.Namespace, model) -> dict:
    """{role: the model it runs}: the one loaded, on the first device; or, with ``--prefill-devices`` and
    ``--decode-devices``, a copy on each role's own device (``LoadedModel.on_device``)."""
    if args.prefill_devices is None:
        return {"prefill": model, "decode": model}
    import jax

    devices = jax.devices()
    wanted = args.prefill_devices + args.decode_devices
    if len(devices) < wanted:
        raise ValueError(f"--prefill-devices {args.prefill_devices} --decode-devices {args.decode_devices} needs "
                         f"{wanted} devices; this host has {len(devices)} ({devices[0].platform})")
    return {"prefill": model.on_device(devices[0]), "decode": model.on_device(devices[args.prefill_devices])}


def pool_pages(args: argparse.Namespace, models: dict, reading=None) -> tuple[int, int, str]:
    """(prefill pages, decode pages, how they were chosen). A size given by its flag wins; else, on a CPU, the nodes'
    default each; on an accelerator, ``--kv-memory-fraction`` of the device memory left free after the weights:
    split by ``--prefill-pool-share`` where both roles share a device, each role's own device's where they do not.
    ``reading``: the model's read (``meanwhile.py``), whose weights may still be on their way: the memory they will
    leave is known without waiting for them (``ModelMeanwhile.free_bytes``)."""
    import jax

    prefill, decode = args.prefill_pages, args.decode_pages
    if prefill is not None and decode is not None:
        return prefill, decode, "--prefill-pages and --decode-pages"
    device = models["prefill"].device or jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        return prefill or CPU_POOL_PAGES, decode or CPU_POOL_PAGES, f"{device.platform}: the nodes' default size"
    # as the device stores a page: narrow rows padded to whole lanes (the tiny model's twice its values' bytes)
    page_bytes = models["prefill"].page_bytes_on_device(args.page_size)
    if models["decode"].device not in (None, device):  # each role's pool on its own device: all of its free memory
        budgets = [pool_budget(free_bytes(models[role].device), page_bytes, args.kv_memory_fraction)
                   for role in ("prefill", "decode")]
        return (prefill or max(2, budgets[0]), decode or max(2, budgets[1]),
                f"{device.platform}: {args.kv_memory_fraction:g} of each role's device's free memory")
    free = free_after_weights(device, models["prefill"], reading)
    budget = pool_budget(free, page_bytes, args.kv_memory_fraction)
    if prefill is None and decode is None:
        prefill = max(2, int(budget * args.prefill_pool_share))
        decode = max(2, budget - prefill)
    elif prefill is None:
        prefill = max(2, budget - decode)
    else:
        decode = max(2, budget - prefill)
    how = (f"{device.platform}: {args.kv_memory_fraction:g} of {free / 2**30:.2f} GiB free after the weights, "
           f"{args.prefill_pool_share:g} of it to prefill ({page_bytes} bytes a page)")
    return prefill, decode, how


def private_dir() -> str:
    """A directory only this process uses for its sockets; under $TMPDIR, or /tmp where that path is too long for a
    socket's name."""
    for parent in (None, "/tmp"):
        path = tempfile.mkdtemp(prefix="fsm-pd-", dir=parent)
        try:
            check_path(os.path.join(path, "prefill.bootstrap.sock"), "the private sockets")
            return path
        except UnixPathError:
            os.rmdir(path)
    raise UnixPathError("no directory short enough for the engines' unix sockets (set TMPDIR to a short path)")


def import_engines() -> None:
    """What ``build_engines`` imports; its own imports then find the modules, or wait for the one under way."""
    import fsm_pd.serving.decode_engine  # noqa: F401
    import fsm_pd.serving.prefill_engine  # noqa: F401


def build_engines(args: argparse.Namespace, models: dict, links: str, pages: tuple[int, int], built=None):
    """The two engines, on unix sockets in ``links``, journaling into ``--journal-dir``; they share a secret. With
    the ``pool`` backend they share one pool of ``sum(pages)`` pages and one step loop too (``SharedPool``). Their
    nodes share one loop thread (``NodeLoop``): a handoff's messages are decided where they land, with no hop.

    The decode engine comes first and is handed to ``built`` at once: its programs (on one pool, nearly all the
    process has) can be prepared while the prefill engine is built (its bootstrap server, its registration there,
    the imports they need: a second of the 2.1 s engine phase on a TPU v5e, round r17)."""
    from fsm_pd.control.config import DEFAULTS as ROOM_DEFAULTS
    from fsm_pd.control.node_loop import NodeLoop
    from fsm_pd.serving.decode_engine import DecodeEngine
    from fsm_pd.serving.prefill_engine import PrefillEngine
    from fsm_pd.serving.shared_pool import SharedPool
    from fsm_pd.transport import generate_secret

    secret = generate_secret()
    Path(args.journal_dir).mkdir(parents=True, exist_ok=True)
    backend = pd_backend(args)
    shared = None
    if backend == "pool":
        shared = SharedPool(models["prefill"], num_pages=sum(pages), page_size=args.page_size,
                            chunked_prefill_size=args.chunked_prefill_size,
                            prefill_chunk_steps=args.prefill_chunk_steps)
    loop = shared.node_loop if shared is not None else NodeLoop("pd")

    def node(role: str, num_pages: int) -> dict:
        deadlines = {t: getattr(args, t) for t in DEADLINE_FLAGS
                     if getattr(args, t, None) is not None and t in ROOM_DEFAULTS[role]}
        return dict(node_id=NODE_IDS[role], journal=str(Path(args.journal_dir) / f"{NODE_IDS[role]}.db"),
                    secret=secret, backend=backend, deadlines=deadlines,
                    kv_checksum=args.kv_checksum == "on", uds=os.path.join(links, f"{role}.sock"),
                    num_pages=num_pages, page_size=args.page_size, prefill_chunk_steps=args.prefill_chunk_steps,
                    shared=shared, loop=loop, contained_crash=True, in_process=True,
                    durability=args.journal_durability,
                    decode_steps_per_dispatch=args.decode_steps_per_dispatch)

    decode = DecodeEngine(models["decode"], on_transfer_failure=args.on_transfer_failure,
                          radix_cache=args.disaggregation_decode_enable_radix_cache, **node("decode", pages[1]))
    try:
        if built is not None:
            built(decode)
        prefill = PrefillEngine(models["prefill"], bootstrap_port=0,
                                bootstrap_uds=os.path.join(links, "prefill.bootstrap.sock"), bootstrap_token=None,
                                radix_cache=not args.disable_radix_cache,
                                chunked_prefill_size=args.chunked_prefill_size,
                                chunk_transfers=not args.disable_chunk_transfers, **node("prefill", pages[0]))
    except BaseException:
        decode.close()
        raise
    return prefill, decode


def run_pd(args: argparse.Namespace, opening, reading) -> int:
    """``opening``, ``reading``: the devices opening and the model being read (``side_by_side.py``)."""
    from fsm_pd.serving.startup import Startup

    startup = Startup()  # the prefill engine's, timed from the process's start; the decode engine's shares it
    from fsm_pd.cli.serve import prepare_programs
    from fsm_pd.cli.side_by_side import start_model, weights_in
    from fsm_pd.model import compiles
    from fsm_pd.store.retention import attach_from_args

    startup.record("imports", startup.since_start())
    compiles.install()
    # the engines' modules import on a thread while this one waits for the devices to open (a TPU v5e's open took
    # 3.7 s in round r16), instead of after it, on the way to ready: they were most of the 2.1 s engine phase there
    # (fastapi for the bootstrap server, SQLAlchemy for the journals, the machines, zmq: 1.3 of build_engines' 1.9 s
    # on a CPU, by cProfile)
    threading.Thread(target=import_engines, name="engine-imports", daemon=True).start()
    try:
        model = start_model(args, startup, opening, reading)
    except (FileNotFoundError, ValueError) as exc:
        print(f"fsm-pd serve: cannot load model {args.model!r}: {exc}", file=sys.stderr)
        return 2
    try:
        models = role_models(args, model)
    except ValueError as exc:
        print(f"fsm-pd serve: {exc}", file=sys.stderr)
        return 2
    prefill_pages, decode_pages, how = pool_pages(args, models, reading)
    where = {role: str(m.device) if m.device is not None else "the first device" for role, m in models.items()}
    log.info("KV pools: prefill %d pages on %s, decode %d pages on %s (%s)", prefill_pages, where["prefill"],
             decode_pages, where["decode"], how)
    links = private_dir()
    on_exit(lambda: shutil.rmtree(links, ignore_errors=True))  # a failed start-up ends the process at once
    on_exit(remove_listener_files)  # --uds's socket file too
    servers: list[AppServer] = []
    engines = ()
    decode_startup = Startup(startup.started_at)
    front_built, prefill_built = threading.Event(), threading.Event()
    both: dict = {}  # {engine: its Startup}, prefill first (the process's), once both are built

    def programs_of(decode) -> None:
        """The programs are prepared from the decode engine's build on (``build_engines``), while this thread builds
        the prefill engine, then imports and builds the front (as a node's, serve.run_node); ready waits for the
        front as for the weights."""
        def the_prefill_engine() -> dict:
            prefill_built.wait()
            if not both:
                raise RuntimeError("the prefill engine was not built")
            return {engine: its for engine, its in both.items() if engine is not decode}

        threading.Thread(target=prepare_programs, args=({decode: decode_startup}, args.skip_server_warmup,
                                                        lambda: front_built.is_set() and front.drain.in_flight > 0,
                                                        lambda: weights_in(model, [startup, decode_startup], reading),
                                                        front_built, the_prefill_engine),
                         name="start-up", daemon=True).start()

    try:
        try:
            with startup.phase("engine"):
                engines = build_engines(args, models, links, (prefill_pages, decode_pages), built=programs_of)
            for engine in engines:
                attach_from_args(engine.manager.journal, args)
            both.update(zip(engines, (startup, decode_startup), strict=True))
        finally:
            prefill_built.set()
        spans = startup.timeline()
        for name, seconds in startup.status()["phases"].items():  # the process's imports, weights and engines
            decode_startup.record(name, seconds, startup.started_at + spans[name][0])
        starts = both
        with startup.phase("imports"):
            from fsm_pd.api.drain import ABORT_GRACE_S, DrainingServer
            from fsm_pd.api.runner import WaitDeadlines
            from fsm_pd.cli.pd_front import PDFront
            from fsm_pd.model.compiles import CompileCollector
            from fsm_pd.net.http_protocol import read_timeouts_from_args
            from fsm_pd.net.http_server import AppServer, _uvicorn_config, run
            from fsm_pd.router.app import create_router_app
            from fsm_pd.router.core import PrefillWorker
            from fsm_pd.router.fleet import BreakerSettings
            from fsm_pd.router.policy import PolicySettings
            from fsm_pd.router.retries import RetrySettings
            from fsm_pd.runtime.gc_policy import apply_serving_gc_policy
            from fsm_pd.serving.startup import StartupCollector
        wait = WaitDeadlines(args.first_token_timeout_secs, args.token_idle_timeout_secs)
        bootstrap = unix_address(os.path.join(links, "prefill.bootstrap.sock"))

        def info_extra() -> dict:
            return {"startup": startup.status(),
                    "engines_startup": {engine.role: its.status() for engine, its in starts.items()}}

        if args.pd_front == "direct":
            app, registry = direct_app(args, engines, model.tokenizer, bootstrap, startup, wait, info_extra)
        else:
            local_apps = engine_apps({engine.manager.uds: (engine, its) for engine, its in starts.items()},
                                     model.tokenizer, api_key=args.api_key,
                                     model_name=args.served_model_name or args.model, model_path=args.model,
                                     drain_timeout_s=args.drain_timeout_secs, wait=wait,
                                     max_body_bytes=args.max_request_bytes)
            for uds, engine_app in local_apps.items():
                servers.append(AppServer(engine_app, uds=uds, log_level="warning",
                                         read_timeouts=read_timeouts_from_args(args)).start())
            # its engines are this process's own: no slow health check ejects one (a dead one makes /health 503,
            # and the front refuses requests), and a request reaches the router only once both are ready; a stream
            # its one decode engine breaks has no other to move to, so the router relays the engine's bytes as they
            # come rather than parsing every event for a migration (issue 48: 15% of the interpreter's time)
            app = create_router_app(
                [PrefillWorker(servers[0].url, bootstrap)], [servers[1].url], api_key=args.api_key,
                pd_policy=PolicySettings(args.pd_policy, local_prefill_max_tokens(args, engines[1].max_context)),
                health_interval_s=1.0, health_timeout_s=OWN_HEALTH_TIMEOUT_S,
                breaker=BreakerSettings(health_failures=NEVER, request_failures=NEVER),
                retry=RetrySettings(migrate=False), startup_wait_s=args.startup_wait_secs, local_apps=local_apps,
                max_body_bytes=args.max_request_bytes,  # None: the engines' limit (their /health)
                server_info_extra=info_extra)
            registry = app.state.metrics.registry
        registry.register(EngineFamilies([r for engine in engines for r in engine.registries]))
        registry.register(StartupCollector(startup))  # the process's start-up, as a node's /metrics has it
        registry.register(CompileCollector())
        front = PDFront(app, engines, list(starts.values()), drain_timeout_s=args.drain_timeout_secs,
                        startup_wait_s=args.startup_wait_secs, registry=registry)
        apply_serving_gc_policy()
        front_built.set()
        log.info("serving prefill and decode in one process (%s transfers; links in %s; journals in %s)",
                 pd_backend(args), links, args.journal_dir)
        config = _uvicorn_config(front, args.log_level, read_timeouts_from_args(args),
                                 timeout_graceful_shutdown=ABORT_GRACE_S)
        run(DrainingServer(config, front.drain), args.host, args.port, args.uds)
    finally:
        log.info("closing the engines and their journals")
        for server in reversed(servers):
            with contextlib.suppress(Exception):
                server.stop()
        for engine in engines:
            engine.close()
        shutil.rmtree(links, ignore_errors=True)
    log.info("stopped cleanly")
    exit_now(0)
    return 0


def engine_apps(engines: dict, tokenizer, **options) -> dict:
    """``--pd-front router``: each engine's HTTP app, by the key it comes with (its unix socket): ``engines`` maps it
    to the engine and its ``Startup``; ``options`` are ``create_app``'s."""
    from fsm_pd.api import create_app

    return {key: create_app(engine, tokenizer, startup=startup, **options)
            for key, (engine, startup) in engines.items()}


def direct_app(args: argparse.Namespace, engines, tokenizer, bootstrap: str, startup, wait, info_extra):
    """``--pd-front direct``: a node's app over both engines (``cli/pd_pair.py``), and the registry its
    ``/metrics`` shows beside the app's own."""
    from prometheus_client import CollectorRegistry

    from fsm_pd.api import create_app
    from fsm_pd.cli.pd_pair import PDPair
    from fsm_pd.router.policy import PolicySettings

    policy = PolicySettings(args.pd_policy, local_prefill_max_tokens(args, engines[1].max_context))
    pair = PDPair(*engines, policy, bootstrap, info_extra=info_extra)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(pair)  # its requests by path
    app = create_app(pair, tokenizer, api_key=args.api_key, model_name=args.served_model_name or args.model,
                     model_path=args.model, drain_timeout_s=args.drain_timeout_secs, startup=startup, wait=wait,
                     max_body_bytes=args.max_request_bytes, registries=[registry])
    return app, registry


class EngineFamilies:
    """Both engines' metrics on the router's ``/metrics``: a family both have (``fsm_pd_rooms``, with their ``role``
    and ``node`` labels) is one family there, as the text format requires."""

    def __init__(self, registries: list) -> None:
        self.registries = registries

    def collect(self):
        from prometheus_client.metrics_core import Metric

        merged: dict[str, Metric] = {}
        for registry in self.registries:
            for family in registry.collect():
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                into.samples.extend(family.samples)
        yield from merged.values()
