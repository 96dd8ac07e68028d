"""P->D transfer throughput of every backend against two baselines, between two real processes on 127.0.0.1.

    python bench/transfer.py [--json] [--runs 5] [--sizes 64,256] [--layers 16] [--backends jax,zmq,tcp]

Per payload size (a list of per-layer float32 arrays) it reports the median of ``--runs`` timings per path, after one
untimed warm-up per path that also checks the bytes; runs are interleaved across paths so that load from other
processes hits all of them alike:

* ``raw_tcp``      baseline (a): the same bytes over a plain TCP socket, ``sendall`` -> ``recv_into`` a warm buffer;
* ``raw_jax``      baseline (b): ``await_pull`` / ``pull`` of the same arrays with jax.experimental.transfer;
* ``raw+N copies``  the copy-bound ceilings: the raw socket transfer followed by N plain copies of all its bytes
  (warm buffer to warm buffer), timed together. Each end-to-end path is also given as a ratio to the ceiling of the
  copies it makes besides the socket's own (``x ceiling``, ``EXTRA_COPIES``);
* ``<backend>``    the backend's ``pull`` of an already published entry, verified (ready, error-free, shapes);
* ``<backend>+kernels``  end to end, one step after the other: ``gather_pages`` on P -> publish -> pull -> verify ->
  ``scatter_pages`` on D's model thread, timed on D from the request to the scattered pool being ready (includes the
  request's round trip to P);
* ``<backend>+overlap``  end to end as the handlers do it with a progressive backend, P's pool owned by a model
  thread: P sends straight from the pool's pages where the backend can (``tcp``: no gather at all) and else
  publishes first and gathers layer by layer while the stream sends; D writes each group of layers as it lands
  (``StreamedScatter``). ``<backend>+overlap/gather`` is the layer-by-layer gather on a backend that could send
  from the pages, for comparison;
* ``<backend>+overlap+crc``  the same with the KV checksum on, as the handlers do it (``kernels/kv_checksum.py``): P
  publishes; sending from the pool, each write of the send sums its bytes just before ``sendmsg`` (``SendSums``;
  else a helper thread sums the pages under a lease turn), and the values go out as a second entry once the send
  has summed everything; D pulls that entry beside the data, sums each piece of the data as it lands, and compares
  after the last write. Its cost is printed as the ratio to ``<backend>+overlap`` (``checksum cost``), medians and
  best runs of the same interleaved runs;
* ``<backend>+reshard P>D``  end to end between different tensor-parallel sizes (``--reshard P:D``, default 2:1):
  P's pool split over P virtual devices, D's over D, as the handlers do it (``transport/reshard.py``): P gathers and
  cuts its staging into the plan's pieces and publishes each; D pulls the pieces side by side on worker threads,
  joins each decode shard's pieces and scatters. Compare it with ``<backend>+kernels`` (one device on both sides).

GB/s are 1e9 bytes per second; every figure is also printed as a ratio to ``raw_tcp``. ``best ms`` is each path's
fastest run, and the ceiling ratio is also given best to best: on a machine that other processes load, the least
disturbed runs compare better than medians do. ``D cpu`` and ``P cpu`` are the
mean CPU time per run of each process, all threads counted (including the small request and release messages): on a
machine with few cores they say why a path is as fast as it is. The consumer (this process) spawns the producer as
``bench/transfer_producer.py`` and drives it with JSON lines on its stdin. Set ``FSM_PD_BENCH_HANG_DUMP=<seconds>`` to
dump all stacks and exit if a run hangs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time

import numpy as np
from transfer_setup import (
    HEAD_DIM,
    KV_HEADS,
    PAGE_SIZE,
    host_devices,
    kv_layout,
    layer_arrays,
    make_pool,
    page_ids,
    reshard_pairs,
    server_config,
    split_pool,
)


class Producer:
    def __init__(self, args: argparse.Namespace) -> None:
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transfer_producer.py")
        cmd = [sys.executable, script, "--layers", str(args.layers)]
        cmd += ["--backends", args.backends, "--backend-opts", args.backend_opts, "--reshard", args.reshard]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self.recv()

    def call(self, **cmd: object) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.recv()

    def recv(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"producer exited with {self.proc.wait()}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def bench_size(producer: Producer, args: argparse.Namespace, mib: int) -> dict:
    """Time every path on one payload size, interleaved run by run so that load from other processes on a shared
    machine hits all paths alike; each path gets one untimed warm-up (compiles, connects) that also checks bytes."""
    producer.call(op="setup", mib=mib)
    expected = layer_arrays(mib, args.layers)
    raw = raw_tcp_path(producer, expected)
    paths = {"raw_tcp": raw, "raw_jax": raw_jax_path(producer, args, mib, expected)}
    paths.update({ceiling_name(n): lambda check, n=n: raw(check, copies=n) for n in CEILINGS})
    owned = []
    for name in args.backends.split(","):
        backend, models, backend_paths_ = backend_paths(producer, args, mib, name, expected)
        owned += [backend, *models]
        paths.update(backend_paths_)
    for once in paths.values():
        once(check=True)
    times: dict[str, list[float]] = {path: [] for path in paths}
    cpu = {path: [0.0, 0.0] for path in paths}  # CPU seconds of D (this process) and P over all timed runs
    for _ in range(args.runs):
        for path, once in paths.items():
            before = (process_cpu_s(), process_cpu_s(producer.proc.pid))
            times[path].append(once(check=False))
            after = (process_cpu_s(), process_cpu_s(producer.proc.pid))
            cpu[path] = [total + a - b for total, a, b in zip(cpu[path], after, before, strict=True)]
    for thing in owned:
        thing.close()
    return {"nbytes": sum(a.nbytes for a in expected), "times": times, "cpu": cpu}


def process_cpu_s(pid: int | None = None) -> float:
    """User + system CPU seconds of a process, every thread counted (finished ones too). Linux only: NaN elsewhere.
    For P, /proc counts in clock ticks (10 ms), which is why the report gives means over all runs."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def raw_tcp_path(producer: Producer, expected: list[np.ndarray]):
    """``once(check, copies=0)``: the raw socket transfer, then ``copies`` plain copies of all its bytes from one
    warm buffer into another (the copy-bound ceiling of a handoff that makes that many copies besides the
    socket's own)."""
    nbytes = sum(a.nbytes for a in expected)
    tcp = socket.create_connection(("127.0.0.1", producer.hello["tcp_port"]))
    tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = np.empty(nbytes, np.uint8)  # one warm buffer: the best case any backend could reach
    copy = np.ones(nbytes, np.uint8)  # touched: warm as well
    view = memoryview(buf)

    def once(check: bool, copies: int = 0) -> float:
        start = time.perf_counter()
        tcp.sendall(nbytes.to_bytes(8, "little"))
        got = 0
        while got < nbytes:
            got += tcp.recv_into(view[got:])
        for _ in range(copies):
            np.copyto(copy, buf)
        elapsed = time.perf_counter() - start
        assert not check or buf.tobytes() == b"".join(a.tobytes() for a in expected), "raw tcp bytes differ"
        return elapsed

    return once


# Copies of the whole payload that an end-to-end path makes besides the socket's own two (send, receive), so that it
# is compared with the ceiling of as many copies: P's gather, D's scatter, and zmq's copy out of libzmq's buffers.
EXTRA_COPIES = {"tcp+overlap": 1, "tcp+overlap/gather": 2, "tcp+kernels": 2, "zmq+overlap": 3, "zmq+kernels": 3}
CEILINGS = (1, 2, 3)


def ceiling_name(copies: int) -> str:
    return f"raw+{copies} cop{'y' if copies == 1 else 'ies'}"


def raw_jax_path(producer: Producer, args: argparse.Namespace, mib: int, expected: list[np.ndarray]):
    import jax

    from fsm_pd.transport.backends.jax_api import shared_server

    conn = shared_server(server_config(json.loads(args.backend_opts))).connect(producer.hello["raw_jax"])
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device) for a in expected]

    def once(check: bool) -> float:
        uuid = producer.call(op="raw_publish", mib=mib)["uuid"]
        start = time.perf_counter()
        out = jax.block_until_ready(conn.pull(uuid, specs))
        elapsed = time.perf_counter() - start
        assert not check or all(np.array_equal(o, e) for o, e in zip(out, expected, strict=True)), "raw jax differs"
        return elapsed

    return once


def backend_paths(producer: Producer, args: argparse.Namespace, mib: int, name: str, expected: list[np.ndarray]):
    """The transfer-only path and the end-to-end paths of one backend (``+overlap`` only where it is progressive)."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    import jax

    from fsm_pd.control.jax_kv import JaxKV
    from fsm_pd.control.overlap import StreamedScatter
    from fsm_pd.effects.checksums import read_trailer
    from fsm_pd.effects.chunked import TRAILER_WORDS, Trailer
    from fsm_pd.kernels import page_bucket, scatter_pages
    from fsm_pd.model.model_thread import ModelThread
    from fsm_pd.transport.backends import create_backend
    from fsm_pd.transport.reshard import piece_uuid, plan_between

    backend = create_backend(name, **json.loads(args.backend_opts).get(name, {}))
    address = producer.hello["addresses"][name]
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in expected]
    layout, pages = kv_layout(mib, args.layers)
    staging_spec = [jax.ShapeDtypeStruct(layout.staging_shape(page_bucket(pages)), np.float32)]
    dst_ids = page_ids(layout, pages, seed=3)
    model = ModelThread(make_pool(layout, seed=4), name="bench-model")  # D's pool, owned as in a decode node
    kv = JaxKV(layout, model, progressive=True)
    pulls = ThreadPoolExecutor(1, thread_name_prefix="bench-entry-pull")  # a decode node's second pull worker
    sums_entry = Trailer(1, TRAILER_WORDS + 1 + layout.num_layers)

    def transfer(check: bool) -> float:
        uuid = producer.call(op="publish", backend=name, mib=mib)["uuid"]
        start = time.perf_counter()
        out = backend.pull(address, uuid, specs, 60.0)
        elapsed = time.perf_counter() - start
        producer.call(op="release", backend=name, uuid=uuid)
        assert not check or all(np.array_equal(o, e) for o, e in zip(out, expected, strict=True)), name
        return elapsed

    def sequential(check: bool) -> float:
        start = time.perf_counter()
        uuid = producer.call(op="gather_publish", backend=name, mib=mib)["uuid"]
        (staging,) = backend.pull(address, uuid, staging_spec, 60.0)

        def write(owner: ModelThread) -> None:
            owner.pool = jax.block_until_ready(scatter_pages(owner.pool, staging, dst_ids, layout=layout))

        model.call(write)
        return finish(uuid, start, check, "kernels")

    def overlapped(check: bool, from_pages: bool = True, checksum: bool = False) -> float:
        start = time.perf_counter()
        answer = producer.call(op="stream_publish", backend=name, mib=mib, from_pages=from_pages, checksum=checksum)
        uuid = answer["uuid"]
        stream = StreamedScatter(model, layout, dst_ids.tolist(), checksum=checksum)
        if checksum:  # as DecodeEffects.pull: the checksum entry, pulled beside the data (it waits on P)
            entry = pulls.submit(backend.pull, address, piece_uuid(uuid, 1), kv.pull_spec(0, sums_entry), 60.0)
        backend.pull(address, uuid, staging_spec, 60.0, on_progress=stream.on_progress)
        if not checksum:
            stream.finish().result()
            return finish(uuid, start, check, "overlap")
        plan = plan_between(layout.to_dict(), layout.to_dict())

        def written_and_verified(owner: ModelThread) -> list:  # as DecodeEffects.scatter: one job after the writes
            stream.written(owner)
            return stream.checksums(owner) or kv.received_checksum(owner, dst_ids.tolist(), plan)

        got = model.call(written_and_verified)
        _, sums = read_trailer(kv.read_trailer(entry.result()[0]), layout.num_layers)
        assert got == sums, f"{name}+overlap+crc: checksum mismatch"
        return finish(uuid, start, check, "overlap", pieces=2)

    def finish(uuid: int, start: float, check: bool, path: str, pieces: int = 1) -> float:
        elapsed = time.perf_counter() - start
        producer.call(op="release", backend=name, uuid=uuid, pieces=pieces)
        if check:  # D's pages now hold what P's pool (rebuilt here from its seed) has in the gathered pages
            src_pool, src_ids = make_pool(layout, seed=1), page_ids(layout, pages, seed=2)
            for src, dst in zip(src_pool, model.pool, strict=True):
                assert np.array_equal(np.asarray(src)[src_ids], np.asarray(dst)[dst_ids]), f"{name}+{path}"
        return elapsed

    paths = {name: transfer, f"{name}+kernels": sequential}
    if backend.progressive:
        paths[f"{name}+overlap"] = overlapped
        paths[f"{name}+overlap+crc"] = lambda check: overlapped(check, checksum=True)
    if backend.sends_pages:  # the same overlap with P's layer-by-layer gather instead of sending from the pool
        paths[f"{name}+overlap/gather"] = lambda check: overlapped(check, from_pages=False)
    owned = [model, SimpleNamespace(close=pulls.shutdown)]
    for src_tp, dst_tp in reshard_pairs(args.reshard):
        path, parts = reshard_path(producer, backend, name, mib, args.layers, src_tp, dst_tp)
        paths[f"{name}+reshard {src_tp}>{dst_tp}"] = path
        owned += parts
    return backend, owned, paths


def reshard_path(producer: Producer, backend, name: str, mib: int, layers: int, src_tp: int, dst_tp: int):
    """End to end between a prefill split over ``src_tp`` devices and a decode split over ``dst_tp``: the handlers'
    steps (``JaxKV`` on both sides, the pieces pulled side by side as ``ThreadedPuller`` does)."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from fsm_pd.control.jax_kv import JaxKV
    from fsm_pd.model.model_thread import ModelThread
    from fsm_pd.transport.reshard import piece_uuid, plan_reshard

    layout, pages = kv_layout(mib, layers, dst_tp)
    src_layout, _ = kv_layout(mib, layers, src_tp)
    dst_ids = page_ids(layout, pages, seed=3)
    model = ModelThread(split_pool(make_pool(layout, seed=4), layout), name="bench-reshard-model")
    kv = JaxKV(layout, model, progressive=False)
    plan = plan_reshard(KV_HEADS, src_tp, dst_tp)
    address = producer.hello["addresses"][name]
    workers = ThreadPoolExecutor(4, thread_name_prefix="bench-pull")  # the decode node's pull workers

    def once(check: bool) -> float:
        start = time.perf_counter()
        uuid = producer.call(op="reshard_publish", backend=name, mib=mib, src_tp=src_tp, dst_tp=dst_tp)["uuid"]
        pulls = [workers.submit(backend.pull, address, piece_uuid(uuid, p.index), kv.pull_spec(pages, p), 60.0)
                 for p in plan.pieces]
        pieces = tuple(future.result()[0] for future in pulls)
        model.call(lambda owner: kv.scatter(owner, pieces, dst_ids.tolist(), None, plan))
        elapsed = time.perf_counter() - start
        producer.call(op="release", backend=name, uuid=uuid, pieces=len(plan.pieces))
        if check:  # 8 KV heads split 1, 2 or 4 ways: no padding, no copies, so D's pages equal P's gathered ones
            src_pool, src_ids = make_pool(src_layout, seed=1), page_ids(src_layout, pages, seed=2)
            for src, dst in zip(src_pool, model.pool, strict=True):
                assert np.array_equal(np.asarray(src)[src_ids], np.asarray(dst)[dst_ids]), f"{name}+reshard"
        return elapsed

    return once, [model, SimpleNamespace(close=workers.shutdown)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sizes", default="64,256", help="payload sizes in MiB")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--backends", default="jax,zmq,tcp")
    parser.add_argument("--backend-opts", default="{}", help='JSON options per backend, e.g. {"zmq": {"window": 4}}')
    parser.add_argument("--reshard", default="2:1", metavar="P:D[,P:D]",
                        help="tensor-parallel splits for the +reshard rows (virtual CPU devices; '' for none)")
    args = parser.parse_args()
    page_mib = args.layers * PAGE_SIZE * 2 * KV_HEADS * HEAD_DIM * 4 / (1 << 20)  # one page of every layer
    if any(int(s) < page_mib for s in args.sizes.split(",")):
        parser.error(f"--sizes: each size must be at least {page_mib:g} MiB, one page of each of the {args.layers} "
                     f"layers (--layers)")
    host_devices(args)

    producer = Producer(args)
    report = {"runs": args.runs, "layers": args.layers, "cpus": os.cpu_count(), "sizes": []}
    try:
        for mib in (int(s) for s in args.sizes.split(",")):
            result = bench_size(producer, args, mib)
            base = statistics.median(result["times"]["raw_tcp"])
            rows = {}
            for path, secs in result["times"].items():
                median = statistics.median(secs)
                cpu_d, cpu_p = (total / len(secs) for total in result["cpu"][path])
                copies = EXTRA_COPIES.get(path)
                ceiling = None if copies is None else statistics.median(result["times"][ceiling_name(copies)])
                ceiling_best = None if copies is None else min(result["times"][ceiling_name(copies)])
                rows[path] = {
                    "gbps": round(result["nbytes"] / median / 1e9, 3),
                    "ratio_to_raw_tcp": round(base / median, 3),
                    "ratio_to_ceiling": None if ceiling is None else round(ceiling / median, 3),
                    "ceiling": None if copies is None else ceiling_name(copies),
                    # the least disturbed run of each, for a machine that others load: a second estimate
                    "best_ms": round(min(secs) * 1e3, 2),
                    "best_ratio_to_ceiling": None if ceiling is None else round(ceiling_best / min(secs), 3),
                    "median_ms": round(median * 1e3, 2),
                    "runs_ms": [round(s * 1e3, 2) for s in secs],
                    "cpu_ms_per_run": {"decode": round(cpu_d * 1e3, 1), "prefill": round(cpu_p * 1e3, 1)},
                }
            # what the KV checksum costs: each +crc path against the same path without it, from the same runs
            cost = {path: {"median": round(row["median_ms"] / rows[path.removesuffix("+crc")]["median_ms"], 3),
                           "best": round(row["best_ms"] / rows[path.removesuffix("+crc")]["best_ms"], 3)}
                    for path, row in rows.items() if path.endswith("+crc")}
            report["sizes"].append({"mib": mib, "paths": rows, "checksum_cost": cost})
    finally:
        producer.close()
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for entry in report["sizes"]:
        print(f"\n{entry['mib']} MiB in {args.layers} float32 arrays, median of {args.runs}")
        print(f"  {'path':<22}{'GB/s':>8}{'x raw_tcp':>11}{'median ms':>11}{'best ms':>9}{'D cpu ms':>10}"
              f"{'P cpu ms':>10}  x ceiling (median, best)")
        for path, row in entry["paths"].items():
            cpu = row["cpu_ms_per_run"]
            ceiling = "" if row["ceiling"] is None else (
                f"{row['ratio_to_ceiling']:>8.2f}, {row['best_ratio_to_ceiling']:.2f} ({row['ceiling']})")
            print(f"  {path:<22}{row['gbps']:>8.2f}{row['ratio_to_raw_tcp']:>11.2f}{row['median_ms']:>11.1f}"
                  f"{row['best_ms']:>9.1f}{cpu['decode']:>10.1f}{cpu['prefill']:>10.1f}{ceiling}")
        for path, cost in entry["checksum_cost"].items():
            print(f"  checksum cost, {path} / {path.removesuffix('+crc')}: {cost['median']:.3f} (medians), "
                  f"{cost['best']:.3f} (best runs)")


if __name__ == "__main__":
    main()
