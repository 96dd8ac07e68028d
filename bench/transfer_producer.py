"""The producer (P) of ``bench/transfer.py``: it holds the payloads and pools, publishes them on each backend as a
prefill node does, and answers the consumer's JSON lines on its stdin (one JSON line each on its stdout). The
consumer starts it; it is not run by hand.

    python bench/transfer_producer.py --layers 16 --backends jax,zmq,tcp --backend-opts '{}' --reshard 2:1
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
from functools import partial

import numpy as np
from transfer_setup import (
    KV_HEADS,
    host_devices,
    kv_layout,
    layer_arrays,
    make_pool,
    page_ids,
    server_config,
    split_pool,
)


def serve(args: argparse.Namespace) -> None:
    host_devices(args)
    import jax

    from fsm_pd.control.jax_kv import JaxKV
    from fsm_pd.effects.checksums import trailer_words
    from fsm_pd.kernels import gather_pages
    from fsm_pd.model.model_thread import ModelThread
    from fsm_pd.transport.backends import create_backend, new_uuid
    from fsm_pd.transport.backends.jax_api import shared_server
    from fsm_pd.transport.reshard import piece_uuid, plan_between

    opts = json.loads(args.backend_opts)
    backends = {name: create_backend(name, **opts.get(name, {})) for name in args.backends.split(",")}
    raw_server = shared_server(server_config(opts))  # the same server (and config) as the jax backend's
    arrays: dict[int, list] = {}
    pools: dict[int, tuple] = {}
    models: dict[int, ModelThread] = {}  # P's pool per size, owned as in a prefill node once a handoff used it
    split_pools: dict[tuple[int, int], tuple] = {}
    tcp_payload = np.empty(0, np.uint8)
    listener = socket.create_server(("127.0.0.1", 0))

    def tcp_loop() -> None:
        while True:  # one connection per payload size
            conn, _ = listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while header := conn.recv(8):
                conn.sendall(memoryview(tcp_payload)[: int.from_bytes(header, "little")])
            conn.close()

    threading.Thread(target=tcp_loop, daemon=True).start()
    addresses = {n: b.address for n, b in backends.items()}
    send({"tcp_port": listener.getsockname()[1], "raw_jax": raw_server.address(), "addresses": addresses})
    for line in sys.stdin:
        cmd = json.loads(line)
        op, mib = cmd["op"], cmd.get("mib")
        if op == "setup":
            arrays[mib] = [jax.device_put(a) for a in layer_arrays(mib, args.layers)]
            layout, _ = kv_layout(mib, args.layers)
            pools[mib] = make_pool(layout, seed=1)
            tcp_payload = np.concatenate([np.asarray(a).view(np.uint8) for a in arrays[mib]])
            jax.block_until_ready((arrays[mib], pools[mib]))
            send({"ok": True})
        elif op == "raw_publish":
            uuid = new_uuid()
            raw_server.await_pull(uuid, arrays[mib])
            send({"uuid": uuid})
        elif op == "publish":
            uuid = new_uuid()
            backends[cmd["backend"]].publish(uuid, arrays[mib], 60.0)
            send({"uuid": uuid})
        elif op == "gather_publish":
            layout, pages = kv_layout(mib, args.layers)
            staging = gather_pages(pools[mib], page_ids(layout, pages, seed=2), layout=layout)
            uuid = new_uuid()
            backends[cmd["backend"]].publish(uuid, [staging], 60.0)  # publish waits for nothing: pull does
            send({"uuid": uuid})
        elif op == "stream_publish":  # what the prefill handler does on its model thread: JaxKV's overlapped path
            layout, pages = kv_layout(mib, args.layers)
            uuid = new_uuid()
            if mib not in models:
                models[mib] = ModelThread(pools[mib], name="bench-prefill-model")
            owner = models[mib]
            backend, ids = backends[cmd["backend"]], page_ids(layout, pages, seed=2).tolist()
            kv = JaxKV(layout, owner, progressive=True)
            if cmd.get("from_pages", True):
                publish = kv.publish_while_gathering
            else:
                publish = partial(gather_layers_and_publish, layout=layout)

            checksum = bool(cmd.get("checksum"))

            def job(owner, publish=publish, uuid=uuid, ids=ids, kv=kv, layout=layout, backend=backend,
                    checksum=checksum) -> None:
                # the handler's order: publish (READY goes at once), then the checksum of the pages as this job
                # leaves them, on a helper thread while the data streams, published as the entry after the data
                publish(owner, transfer=backend, uuid=uuid, pages=ids, hold_timeout_s=60.0,
                        on_published=lambda rows: send({"uuid": uuid}))  # D pulls at once
                if checksum:
                    def done(sums, uuid=uuid, backend=backend, kv=kv, layers=layout.num_layers) -> None:
                        words = trailer_words(0, [sums[0]], layers)
                        backend.publish(piece_uuid(uuid, 1), (kv.trailer(words),), 60.0)

                    kv.checksum_later(owner, ids, plan_between(layout.to_dict(), layout.to_dict()), done)

            owner.call(job)
        elif op == "reshard_publish":  # what the prefill handler does when D's split differs from ours
            from types import SimpleNamespace

            from fsm_pd.control.jax_kv import JaxKV
            from fsm_pd.transport.reshard import piece_uuid, plan_reshard

            layout, pages = kv_layout(mib, args.layers, cmd["src_tp"])
            if (mib, layout.tp) not in split_pools:  # the same pool, split once: a prefill node's pool stays put
                split_pools[(mib, layout.tp)] = split_pool(pools[mib], layout)
            holder = SimpleNamespace(pool=split_pools[(mib, layout.tp)])
            plan = plan_reshard(KV_HEADS, cmd["src_tp"], cmd["dst_tp"])
            pieces = JaxKV(layout, holder, progressive=False).gather(holder, page_ids(layout, pages, seed=2).tolist(),
                                                                     plan)
            uuid = new_uuid()
            for index, piece in enumerate(pieces):
                backends[cmd["backend"]].publish(piece_uuid(uuid, index), [piece], 60.0)
            send({"uuid": uuid})
        elif op == "release":
            from fsm_pd.transport.reshard import piece_uuid

            for index in range(cmd.get("pieces", 1)):
                backends[cmd["backend"]].release(piece_uuid(cmd["uuid"], index))
            send({"ok": True})
        elif op == "exit":
            break
    for backend in backends.values():
        backend.close()


def gather_layers_and_publish(owner, *, transfer, uuid, pages, hold_timeout_s, on_published, layout) -> None:
    """JaxKV's overlapped publish for a backend that cannot send from the pages: gather layer by layer."""
    from fsm_pd.control.overlap import publish_while_gathering

    publish_while_gathering(transfer, uuid, owner.pool, pages, layout, hold_timeout_s, on_published)


def send(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--backends", required=True)
    parser.add_argument("--backend-opts", default="{}")
    parser.add_argument("--reshard", default="")
    serve(parser.parse_args())


if __name__ == "__main__":
    main()
