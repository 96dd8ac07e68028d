"""A KVManager in its own process, driven by JSON lines on stdin (one answer per line on stdout).

Used by the two-process integration tests: the test starts a prefill and a decode process, tells them which rooms
to create, kills them at chosen moments, and reads their journals afterwards. The pool of a prefill node is filled
with seeded random data; a decode node's starts at zero.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the test doubles beside conftest.py
from pool_admission import pool_admission

from fsm_pd.control import KVManager
from fsm_pd.kernels import KVLayout, gather_pages
from fsm_pd.transport import secret_from_env


def make_pool(layout: KVLayout, seed: int | None, sharding):
    rng = np.random.default_rng(seed)
    arrays = []
    for _ in range(layout.num_layers):
        host = (
            rng.standard_normal(layout.layer_shape, dtype=np.float32)
            if seed is not None
            else np.zeros(layout.layer_shape, np.float32)
        )
        arrays.append(jax.device_put(jnp.asarray(host, dtype=layout.dtype), sharding))
    return tuple(arrays)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", required=True)
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--journal", required=True)
    parser.add_argument("--backend", default="zmq")
    parser.add_argument("--layout", required=True, help="KVLayout as JSON")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--deadlines", default="{}")
    parser.add_argument("--backend-options", default="{}")
    parser.add_argument("--bootstrap-port", type=int, default=None, help="prefill: serve a bootstrap server here")
    parser.add_argument("--heartbeat", default="{}", help="heartbeat settings as JSON: interval_s, max_failures")
    parser.add_argument("--kv-checksum", choices=("on", "off"), default="on")
    args = parser.parse_args()

    layout = KVLayout.from_dict(json.loads(args.layout))
    pool_sharding = staging_sharding = None
    if layout.shard_axis is not None:
        mesh = jax.make_mesh((len(jax.devices()),), (layout.shard_axis,))
        pool_sharding = jax.sharding.NamedSharding(mesh, layout.pool_spec())
        staging_sharding = jax.sharding.NamedSharding(mesh, layout.staging_spec())
    manager = KVManager(
        role=args.role,
        node_id=args.node_id,
        layout=layout,
        journal=args.journal,
        secret=secret_from_env(),
        backend=args.backend,
        backend_options=json.loads(args.backend_options),
        deadlines=json.loads(args.deadlines),
        pool=make_pool(layout, args.seed, pool_sharding),
        staging_sharding=staging_sharding,
        heartbeat=json.loads(args.heartbeat),
        admission=pool_admission(layout.num_pages) if args.role == "decode" else None,
        kv_checksum=args.kv_checksum == "on",
    )
    bootstrap = None
    if args.bootstrap_port is not None:
        from fsm_pd.bootstrap import BootstrapServer  # here: FastAPI loads only in the nodes that serve one

        bootstrap = BootstrapServer(port=args.bootstrap_port).start()
        manager.register_with(bootstrap.url)

    def digest(pages: list[int]) -> str:
        gathered = manager.model.call(lambda owner: np.asarray(gather_pages(owner.pool, pages, layout=layout)))
        return hashlib.sha256(np.ascontiguousarray(gathered[:, : len(pages)]).tobytes()).hexdigest()

    def answer(obj) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    answer(
        {
            "side_channel": manager.side_channel.address,
            "transfer": manager.backend.address,
            "pid": os.getpid(),
            "recovered": manager.recovered,
            "devices": len(jax.devices()),
            "bootstrap": bootstrap.url if bootstrap else None,
        }
    )
    for line in sys.stdin:
        cmd = json.loads(line)
        op, room = cmd["op"], cmd.get("room")
        try:
            if op == "add_sender":
                manager.add_sender(room, cmd["pages"], cmd.get("prompt_len", 0))
                out = {}
            elif op == "kv_ready":
                manager.kv_ready(room, first_token=cmd.get("first_token", 0))
                out = {}
            elif op == "add_receiver":
                where = {k: cmd[k] for k in ("prefill_addr", "bootstrap_addr") if k in cmd}
                manager.add_receiver(room, cmd["page_count"], **where)
                out = {}
            elif op == "wait":
                state = manager.wait(room, cmd.get("timeout", 30))
                out = {"state": state.name if state is not None else None, "reason": manager.reason(room)}
            elif op == "state":
                state = manager.poll(room)
                out = {"state": state.name if state is not None else None, "reason": manager.reason(room)}
            elif op == "suspect":  # missed its last heartbeat, not yet declared dead
                out = {"suspect": manager.peers.monitor.suspect(cmd["addr"])}
            elif op == "digest":
                pages = cmd.get("pages") or manager.admission.allocator.pages_of(room)
                out = {"digest": digest(pages), "pages": pages}
            elif op == "abort":
                manager.abort(room, cmd.get("reason", "aborted"))
                out = {}
            elif op == "finish":
                manager.finish(room)
                manager.model.call(lambda owner: None)  # the free is queued on the model thread: wait for it
                out = {}
            elif op == "counters":
                manager.model.call(lambda owner: None)  # let queued frees (model-thread jobs) land first
                out = manager.counters()
            elif op == "quit":
                manager.close()
                if bootstrap is not None:
                    bootstrap.stop()
                answer({})
                # Everything the test reads is written (the journal is closed, the answer flushed): the interpreter's
                # own teardown (joining pool threads, jax's exit hooks) would only add up to a second to every stop.
                os._exit(0)
            else:
                out = {"error": f"unknown op {op}"}
        except Exception as exc:  # noqa: BLE001 - report to the test instead of dying
            out = {"error": f"{type(exc).__name__}: {exc}"}
        answer(out)


if __name__ == "__main__":
    main()
