"""The transfer-backend contract, exercised between two real processes on 127.0.0.1 (``jax``, ``zmq`` and ``tcp``),
and on unix sockets (``tcp-uds``, ``zmq-ipc``: the byte-stream backends as a node started with ``--uds`` runs them).

This process is D (the consumer); P is ``transfer_producer.py`` in a subprocess driven over stdin/stdout. The
``fake`` backend runs the same contract in process. Deadline tests measure how long a failing pull took and assert
the bound the contract promises: a pull returns or raises within its ``timeout_s``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from processes import dies_with_parent
from xla_flags import with_host_devices

from fsm_pd.kernels import host_words
from fsm_pd.transport.backends import (
    TransferBackend,
    TransferError,
    TransferFailed,
    TransferTimeout,
    create_backend,
    new_uuid,
)
from fsm_pd.transport.backends.spec import default_sharding

HERE = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("transfer_producer", HERE / "transfer_producer.py")
transfer_producer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(transfer_producer)
make_arrays = transfer_producer.make_arrays

# How late past its own timeout a pull may end before the test calls it hung: only a hang, never slowness, fails a
# test here (a busy machine runs late; these tests are about which ending a pull gets, not how fast).
HANG_S = 15.0
NETWORK_BACKENDS = ["jax", "zmq", "tcp"]
OVER_UNIX = {"tcp-uds": "tcp", "zmq-ipc": "zmq"}  # these backends with ``uds``: their server on a unix socket


class Producer:
    """P in a subprocess; every call has its own timeout so that a wedged producer fails the test, not hangs it."""

    def __init__(self, backend: str, **opts: object) -> None:
        self.backend = backend
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "transfer_producer.py"), "--backend", backend, "--opts", json.dumps(opts)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            preexec_fn=dies_with_parent(),
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.address = self._reply(timeout=60)["address"]

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)

    def _reply(self, timeout: float = 30) -> dict:
        reply = json.loads(self._lines.get(timeout=timeout))
        assert "error" not in reply, reply
        return reply

    def call(self, **cmd: object) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def publish(self, seed: int, shapes: list, dtypes: list, hold_s: float = 30.0, uuid: int | None = None) -> int:
        return self.call(op="publish", seed=seed, shapes=shapes, dtypes=dtypes, hold_s=hold_s, uuid=uuid)["uuid"]

    def open_entries(self) -> tuple[int, int]:
        reply = self.call(op="open")
        return reply["count"], reply["nbytes"]

    def parked(self) -> set[int] | None:
        uuids = self.call(op="parked")["uuids"]
        return None if uuids is None else set(uuids)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.call(op="exit")
            self.proc.wait(timeout=20)


class InProcessProducer:
    """The same driver surface over a backend living in this process (``fake``, ``device``)."""

    def __init__(self, backend: str = "fake") -> None:
        self.backend = create_backend(backend)
        self.address = self.backend.address

    def publish(self, seed: int, shapes: list, dtypes: list, hold_s: float = 30.0, uuid: int | None = None) -> int:
        uuid = uuid or new_uuid()
        self.backend.publish(uuid, [jax.device_put(a) for a in make_arrays(seed, shapes, dtypes)], hold_s)
        return uuid

    def call(self, op: str, **kw: object) -> dict:
        getattr(self.backend, op)(**kw)
        return {"ok": True}

    def open_entries(self) -> tuple[int, int]:
        entries = self.backend.open_entries()
        return entries.count, entries.nbytes

    def parked(self) -> set[int] | None:
        return set(self.backend.parked_pulls())

    def close(self) -> None:
        self.backend.close()


# The backends whose producer says which pulls wait on it (``parked_pulls``). The jax backend's library parks pulls
# where nobody can see them: a test there could only give the pull a margin, and would pass with a pull that came
# late (a late pull meets the fail or the dead producer at once), so the tests of a pull already waiting leave it out.
SHOWS_PARKED = ["zmq", "tcp", "fake", "device"]
IN_PROCESS = ("fake", "device")  # their producer lives in this process
# The backends that report a pull's progress, so that a test knows bytes are flowing (jax hands over whole arrays).
PROGRESSIVE = ["zmq", "tcp"]


def wait_parked(producer: Producer | InProcessProducer, uuid: int) -> None:
    """Until a pull of ``uuid`` waits on the producer for it to be published."""
    assert producer.parked() is not None, f"{producer.backend} does not say which pulls wait on it"
    deadline = time.monotonic() + 30
    while uuid not in producer.parked():
        assert time.monotonic() < deadline, f"no pull of {uuid} ever waited on the producer"
        time.sleep(0.02)


def specs(shapes: list, dtypes: list) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(tuple(s), jnp.dtype(d)) for s, d in zip(shapes, dtypes, strict=True)]


def assert_bytes_equal(got: tuple[jax.Array, ...], expected: list[np.ndarray]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype
        assert np.asarray(g).tobytes() == e.tobytes()


def timed_failure(fn, *args) -> tuple[TransferError, float]:
    start = time.monotonic()
    with pytest.raises(TransferError) as info:
        fn(*args)
    return info.value, time.monotonic() - start


def start_producer(name: str, tmp: Path) -> Producer:
    """P for ``name``: a network backend, or one of ``OVER_UNIX`` on a socket in ``tmp``."""
    if name in OVER_UNIX:
        producer = Producer(OVER_UNIX[name], uds=str(tmp / f"{name}.sock"))
        assert producer.address.startswith(("unix:", "ipc://")) and str(tmp) in producer.address
        return producer
    return Producer(name)


@pytest.fixture(scope="module", params=[*NETWORK_BACKENDS, "fake", "device", "tcp-uds"])
def pair(request, tmp_path_factory) -> tuple[Producer | InProcessProducer, TransferBackend]:
    """A long-lived producer and this process's consumer backend, for tests that leave both healthy. The ``device``
    consumer is a backend of its own, as a decode engine's is beside its prefill engine's."""
    name = request.param
    in_process = name in IN_PROCESS
    producer = InProcessProducer(name) if in_process else start_producer(name, tmp_path_factory.mktemp("uds"))
    consumer = producer.backend if name == "fake" else create_backend(OVER_UNIX.get(name, name))
    yield producer, consumer
    producer.close()
    if name != "fake":
        consumer.close()


SMALL = (
    [[0], [1], [3, 5], [7, 11, 13], [1000], [2, 4, 8, 16], []],
    ["float32", "bfloat16", "int8", "uint8", "int32", "float16", "float32"],
)


# ---------------------------------------------------------------- data gets there, exactly


def test_small_mixed_arrays_arrive_byte_exact(pair):
    producer, consumer = pair
    shapes, dtypes = SMALL
    uuid = producer.publish(1, shapes, dtypes)
    got = consumer.pull(producer.address, uuid, specs(shapes, dtypes), 20)
    assert_bytes_equal(got, make_arrays(1, shapes, dtypes))
    producer.call(op="release", uuid=uuid)


@pytest.mark.parametrize("pair", ["zmq-ipc"], indirect=True)  # the rest of the contract is zmq's over TCP
def test_zmq_over_a_unix_socket_arrives_byte_exact(pair):
    test_small_mixed_arrays_arrive_byte_exact(pair)


@pytest.mark.parametrize("sizes_kib", [[4], [1, 33, 517], [1500, 1, 2049]])
def test_sizes_straddling_chunk_boundaries_arrive_byte_exact(pair, sizes_kib):
    producer, consumer = pair
    shapes, dtypes = [[k * 256] for k in sizes_kib], ["float32"] * len(sizes_kib)
    uuid = producer.publish(2, shapes, dtypes)
    assert_bytes_equal(consumer.pull(producer.address, uuid, specs(shapes, dtypes), 20), make_arrays(2, shapes, dtypes))
    producer.call(op="release", uuid=uuid)


@pytest.mark.parametrize("backend", NETWORK_BACKENDS)
def test_64_mib_of_layers_arrives_byte_exact(backend):
    shapes, dtypes = [[1 << 21]] * 8, ["float32"] * 8  # 8 layers x 8 MiB
    producer = Producer(backend)
    try:
        with create_backend(backend) as consumer:
            uuid = producer.publish(3, shapes, dtypes)
            got = consumer.pull(producer.address, uuid, specs(shapes, dtypes), 60)
            assert_bytes_equal(got, make_arrays(3, shapes, dtypes))
            producer.call(op="release", uuid=uuid)
            assert producer.open_entries() == (0, 0)
    finally:
        producer.close()


def test_held_results_survive_later_pulls(pair):
    """Receive memory is reused (zmq) only once nothing refers to it: kept results must never change."""
    producer, consumer = pair
    shapes, dtypes = [[1 << 19]] * 4, ["float32"] * 4  # 8 MiB: large enough for the receive-block pool
    first_uuid = producer.publish(4, shapes, dtypes)
    first = consumer.pull(producer.address, first_uuid, specs(shapes, dtypes), 30)
    for seed in (5, 6):
        uuid = producer.publish(seed, shapes, dtypes)
        assert_bytes_equal(
            consumer.pull(producer.address, uuid, specs(shapes, dtypes), 30), make_arrays(seed, shapes, dtypes)
        )
        producer.call(op="release", uuid=uuid)
    assert_bytes_equal(first, make_arrays(4, shapes, dtypes))
    producer.call(op="release", uuid=first_uuid)


# ---------------------------------------------------------------- nothing unverified is returned


@pytest.mark.parametrize(
    "wrong",
    [
        pytest.param((["float32"], [[64]], [[65]]), id="shape"),
        pytest.param((["float32"], [[64]], [[8, 8]]), id="same-bytes-shape"),
        pytest.param((["float32", "int32"], [[64]], None), id="same-bytes-dtype"),
        pytest.param((["float32"], [[64]], [[64], [1]]), id="extra-array"),
    ],
)
def test_spec_mismatch_fails_blaming_the_consumer(pair, wrong):
    producer, consumer = pair
    dtypes, shapes, wrong_shapes = wrong
    uuid = producer.publish(7, shapes, dtypes[:1])
    want = specs(shapes, dtypes[1:]) if wrong_shapes is None else specs(wrong_shapes, dtypes * len(wrong_shapes))
    err, elapsed = timed_failure(consumer.pull, producer.address, uuid, want, 10)
    assert isinstance(err, TransferFailed) and err.blame == "local", err
    assert "mismatch" in err.reason
    assert elapsed < 10, "failed by the mismatch, before its own deadline"
    producer.call(op="release", uuid=uuid)


def test_unknown_uuid_times_out_within_deadline(pair):
    # the pull waits out its whole deadline, on every backend: 0.5 s (1.5 s cost the module 6 s more), as the other
    # timed-out pulls here; every backend ends a pull on a timer at its deadline, not on a coarser poll
    producer, consumer = pair
    err, elapsed = timed_failure(consumer.pull, producer.address, new_uuid(), specs([[4]], ["float32"]), 0.5)
    assert isinstance(err, TransferTimeout), err
    assert elapsed >= 0.45, "not before its deadline"
    assert elapsed <= 0.5 + HANG_S, "hung past its deadline"


# ---------------------------------------------------------------- producer-side endings fail pulls fast


def test_fail_replaces_entry_and_pull_fails_fast(pair):
    producer, consumer = pair
    uuid = producer.publish(8, [[1024]], ["float32"])
    producer.call(op="fail", uuid=uuid, reason="prefill OOM")
    err, elapsed = timed_failure(consumer.pull, producer.address, uuid, specs([[1024]], ["float32"]), 10)
    assert isinstance(err, TransferFailed) and err.blame == "remote", err
    assert "prefill OOM" in err.reason
    assert elapsed < 10, "failed by the fail, before its own deadline"
    assert producer.open_entries() == (0, 0)


@pytest.mark.parametrize("pair", SHOWS_PARKED, indirect=True)
def test_fail_wakes_a_pull_that_is_already_waiting(pair):
    producer, consumer = pair
    uuid = new_uuid()
    result: queue.Queue = queue.Queue()

    def pull() -> None:
        try:
            consumer.pull(producer.address, uuid, specs([[16]], ["float32"]), 10)
            result.put(None)
        except TransferError as exc:
            result.put(exc)

    threading.Thread(target=pull, daemon=True).start()
    wait_parked(producer, uuid)
    failed = time.monotonic()
    producer.call(op="fail", uuid=uuid, reason="aborted by router")
    err = result.get(timeout=15)
    assert isinstance(err, TransferFailed) and "aborted by router" in err.reason, err
    assert time.monotonic() - failed < 10, "woken by the fail, not by its 10 s timeout"


def test_duplicate_pull_after_release_fails_fast(pair):
    producer, consumer = pair
    uuid = producer.publish(9, [[256]], ["int32"])
    consumer.pull(producer.address, uuid, specs([[256]], ["int32"]), 10)
    producer.call(op="release", uuid=uuid)
    err, elapsed = timed_failure(consumer.pull, producer.address, uuid, specs([[256]], ["int32"]), 10)
    assert isinstance(err, TransferFailed) and "released" in err.reason, err
    assert elapsed < 10, "failed by the release, before its own deadline"


def test_unpulled_hold_expires_frees_memory_and_fails_late_pulls(pair):
    producer, consumer = pair
    uuid = producer.publish(10, [[1 << 18]], ["float32"], hold_s=1.0)
    assert producer.open_entries() == (1, 1 << 20)
    deadline = time.monotonic() + 1.0 + 5
    while producer.open_entries() != (0, 0):
        assert time.monotonic() < deadline, "hold did not expire"
        time.sleep(0.1)
    err, elapsed = timed_failure(consumer.pull, producer.address, uuid, specs([[1 << 18]], ["float32"]), 10)
    assert isinstance(err, TransferFailed) and "expired" in err.reason, err
    assert elapsed < 10, "failed by the expiry, before its own deadline"


# ---------------------------------------------------------------- a dead producer never hangs the consumer


@pytest.mark.parametrize("backend", [*NETWORK_BACKENDS, "tcp-uds"])
def test_producer_killed_before_pull(backend, tmp_path):
    producer = start_producer(backend, tmp_path)
    uuid = producer.publish(11, [[1024]], ["float32"])
    producer.kill()
    with create_backend(OVER_UNIX.get(backend, backend)) as consumer:
        err, elapsed = timed_failure(consumer.pull, producer.address, uuid, specs([[1024]], ["float32"]), 3)
    assert isinstance(err, TransferTimeout | TransferFailed), err
    assert elapsed <= 3 + HANG_S


def _pull_in_thread(consumer, address, uuid, spec, timeout_s,
                    on_progress=None) -> tuple[threading.Thread, queue.Queue]:
    result: queue.Queue = queue.Queue()

    def run() -> None:
        try:
            result.put(consumer.pull(address, uuid, spec, timeout_s, on_progress))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            result.put(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


@pytest.mark.parametrize("backend", [b for b in SHOWS_PARKED if b in NETWORK_BACKENDS])
def test_producer_killed_while_pull_waits_for_publish(backend):
    producer = Producer(backend)
    with create_backend(backend) as consumer:
        uuid = new_uuid()
        thread, result = _pull_in_thread(consumer, producer.address, uuid, specs([[64]], ["float32"]), 4)
        wait_parked(producer, uuid)
        start = time.monotonic()
        producer.kill()
        err = result.get(timeout=4 + HANG_S + 5)
        assert isinstance(err, TransferTimeout | TransferFailed), err
        assert time.monotonic() - start <= 4 + HANG_S


@pytest.mark.parametrize("backend", PROGRESSIVE)
def test_producer_killed_mid_transfer(backend):
    """Freeze P (SIGSTOP) while bytes are flowing, so the pull is certainly mid-stream, then SIGKILL it. Only where
    the pull reports its progress: elsewhere (jax) nothing shows that bytes flow, and a pull frozen before it began
    or after it ended would pass for one frozen mid-stream."""
    shapes, dtypes = [[1 << 22]] * 8, ["float32"] * 8  # 128 MiB: long enough to catch in flight
    producer = Producer(backend)
    frozen = threading.Event()

    def freeze(index, host, final_bytes) -> None:  # on the pull's thread, as the first bytes land: the rest is to come
        if not frozen.is_set():
            os.kill(producer.proc.pid, signal.SIGSTOP)
            frozen.set()

    with create_backend(backend) as consumer:
        uuid = producer.publish(12, shapes, dtypes)
        timeout_s = 8.0
        begin = time.monotonic()
        thread, result = _pull_in_thread(consumer, producer.address, uuid, specs(shapes, dtypes), timeout_s, freeze)
        assert frozen.wait(timeout_s), "no bytes of the pull ever landed"
        time.sleep(0.3)  # frozen a while: the consumer sees a silent peer first, then a dead one
        producer.kill()
        err = result.get(timeout=timeout_s + HANG_S + 5)
        assert isinstance(err, TransferTimeout | TransferFailed), err
        # A killed peer closes its sockets: both backends notice that before the pull's deadline.
        assert time.monotonic() - begin < timeout_s, err


# Staging-like arrays, and one of rows that are not whole 512-byte rows of words (copied plainly either way)
WORDS = ([[2, 4, 16, 96], [2, 4, 16, 64], [7, 16, 33]], ["bfloat16", "float32", "bfloat16"])


@pytest.mark.parametrize("backend", PROGRESSIVE)
@pytest.mark.parametrize("words_on", ["producer", "consumer"])
def test_a_node_copying_words_and_one_copying_plainly_exchange_the_same_bytes(backend, words_on):
    """Either end may copy staging between device and host as 32-bit words (``kernels/host_words.py``, prepared on
    an accelerator, here on the CPU); the bytes on the wire are the same, so a node that copies words talks to one
    that does not, either way round."""
    shapes, dtypes = WORDS
    producer = Producer(backend)
    try:
        with create_backend(backend) as consumer:
            if words_on == "producer":
                prepared = producer.call(op="prepare_words", shapes=shapes, dtypes=dtypes, down=True, up=False)
                assert prepared["prepared"] == [True, True, False]
            else:
                assert [host_words.prepare(shape, dtype, default_sharding(), down=False, up=True)
                        for shape, dtype in zip(shapes, dtypes, strict=True)] == [True, True, False]
            before = Counter(host_words.copies)
            uuid = producer.publish(7, shapes, dtypes)
            assert_bytes_equal(consumer.pull(producer.address, uuid, specs(shapes, dtypes), 20),
                               make_arrays(7, shapes, dtypes))
            producer.call(op="release", uuid=uuid)
            sent, landed = producer.call(op="copies")["copies"], Counter(host_words.copies) - before
        if words_on == "producer":
            assert sent == {"down_words": 2, "down_plain": 1} and landed == {"up_plain": 3}, (sent, landed)
        else:
            assert sent == {"down_plain": 3} and landed == {"up_words": 2, "up_plain": 1}, (sent, landed)
    finally:
        producer.close()
        host_words.forget()


def test_device_pull_hands_over_the_published_arrays_without_a_copy():
    """Two engines of one process on one device: D gets P's very buffers (no host staging, no copy); the hold then
    ends on release, and D's arrays outlive it."""
    shapes, dtypes = [[64, 8], [3]], ["float32", "int32"]
    with create_backend("device") as p, create_backend("device") as d:
        staging = [jax.device_put(a) for a in make_arrays(11, shapes, dtypes)]
        uuid = new_uuid()
        p.publish(uuid, staging, 30)
        got = d.pull(p.address, uuid, specs(shapes, dtypes), 10)
        assert [g.unsafe_buffer_pointer() for g in got] == [a.unsafe_buffer_pointer() for a in staging]
        p.release(uuid)
        del staging
        assert p.open_entries().count == 0 and d.pulls == 1
        assert_bytes_equal(got, make_arrays(11, shapes, dtypes))


def test_device_pull_of_a_node_that_is_gone_fails_fast():
    """A closed producer (its engine stopped), or an address no engine of this process publishes at, is a refused
    connection: the pull fails at once, blaming the peer, and a pull parked on the producer wakes when it closes."""
    with create_backend("device") as d:
        p = create_backend("device")
        address, uuid = p.address, new_uuid()
        result: queue.Queue = queue.Queue()

        def pull() -> None:
            try:
                d.pull(address, uuid, specs([[4]], ["float32"]), 10)
                result.put(None)
            except TransferError as exc:
                result.put(exc)

        threading.Thread(target=pull, daemon=True).start()
        wait_parked(_Parked(p), uuid)
        p.close()
        err = result.get(timeout=5)
        assert isinstance(err, TransferFailed) and err.blame == "remote" and "closed" in err.reason, err
        err, elapsed = timed_failure(d.pull, address, new_uuid(), specs([[4]], ["float32"]), 10)
        assert isinstance(err, TransferFailed) and "no device transfer node" in err.reason and elapsed < 1, err
        err, _ = timed_failure(d.pull, "device://0/1", new_uuid(), specs([[4]], ["float32"]), 10)
        assert "another process" in err.reason, err


class _Parked:
    def __init__(self, backend: TransferBackend) -> None:
        self.backend = backend

    def parked(self) -> set[int]:
        return set(self.backend.parked_pulls())


def test_a_unix_socket_is_removed_on_close_and_a_killed_producers_replaced(tmp_path):
    """A producer that closes removes its socket file; one that was killed leaves it, refuses pulls at once (nobody
    listens), and does not stop the next producer from taking the path."""
    path = tmp_path / "p.kv.sock"
    closing = Producer("tcp", uds=str(path))
    assert path.is_socket()
    closing.close()
    assert not path.exists()
    killed = Producer("tcp", uds=str(path))
    uuid = killed.publish(13, [[256]], ["float32"])
    killed.kill()
    assert path.is_socket()  # left behind
    with create_backend("tcp") as consumer:
        err, elapsed = timed_failure(consumer.pull, killed.address, uuid, specs([[256]], ["float32"]), 10)
        assert isinstance(err, TransferFailed) and "cannot connect" in str(err) and elapsed < 5, err
        successor = Producer("tcp", uds=str(path))
        try:
            uuid = successor.publish(14, [[256]], ["float32"])
            got = consumer.pull(successor.address, uuid, specs([[256]], ["float32"]), 20)
            assert_bytes_equal(got, make_arrays(14, [[256]], ["float32"]))
        finally:
            successor.close()


@pytest.mark.parametrize("backend", NETWORK_BACKENDS)
def test_consumer_recovers_after_a_timed_out_pull(backend):
    """A timed-out pull drops its connection; the next pull to the same producer connects fresh and succeeds."""
    producer = Producer(backend)
    try:
        with create_backend(backend) as consumer:
            err, _ = timed_failure(consumer.pull, producer.address, new_uuid(), specs([[8]], ["float32"]), 0.5)
            assert isinstance(err, TransferTimeout)
            uuid = producer.publish(13, [[300]], ["int32"])
            assert_bytes_equal(
                consumer.pull(producer.address, uuid, specs([[300]], ["int32"]), 10),
                make_arrays(13, [[300]], ["int32"]),
            )
    finally:
        producer.close()


@pytest.mark.parametrize(
    "missing",
    [("error_arrays",), ("timeouts",), ("error_arrays", "timeouts", "poison")],
    ids=["no-make_error_array", "no-timeouts", "jax-0.7-like"],
)
def test_jax_backend_keeps_the_contract_on_older_jaxlib_feature_sets(missing):
    """Older jaxlibs lack make_error_array (<0.7.2), poisoning (<0.8.1) or timeouts (<0.10.1): same outcomes."""
    from dataclasses import replace

    from fsm_pd.transport.backends.jax_api import detect_features

    features = replace(detect_features(), **dict.fromkeys(missing, False))
    with create_backend("jax", features=features) as p, create_backend("jax", features=features) as d:
        spec = specs([[32]], ["float32"])
        for ending in ("release", "fail"):
            uuid = new_uuid()
            p.publish(uuid, [jnp.arange(32, dtype=jnp.float32)], 30)
            if ending == "release":
                np.testing.assert_array_equal(d.pull(p.address, uuid, spec, 5)[0], np.arange(32, dtype=np.float32))
                p.release(uuid)
            else:
                p.fail(uuid, "prefill crashed")
            err, elapsed = timed_failure(d.pull, p.address, uuid, spec, 5)
            assert isinstance(err, TransferFailed) and ("released" if ending == "release" else "crashed") in err.reason
            assert elapsed < 5, "failed before its own deadline"
        err, elapsed = timed_failure(d.pull, p.address, new_uuid(), spec, 0.5)
        assert isinstance(err, TransferTimeout) and elapsed <= 0.5 + HANG_S
        assert p.open_entries().count == 0


@pytest.mark.parametrize("backend", NETWORK_BACKENDS)
def test_sharded_staging(backend):
    """4-way split staging arrives with its sharding; a replicated spec is re-placed (zmq and tcp, which move whole
    arrays) or refused as a layout mismatch before any garbage is returned (jax, which moves per-shard buffers)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": with_host_devices(4)}
    run = subprocess.run(
        [sys.executable, str(HERE / "transfer_sharded_check.py"), backend],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["same"] is True
    if backend in ("zmq", "tcp"):
        assert result["replicated"] == "ok"
    else:
        assert "mismatch" in result["replicated"] and result["blame"] == "local", result
