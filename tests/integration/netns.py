"""Separate "hosts" on one machine: Linux network namespaces joined by a bridge, for tests that need nodes that cannot
reach each other over loopback. Needs root and iproute2's ``ip``.

``Fabric`` makes a switch namespace holding a bridge, then one namespace per host with one veth leg ``eth0`` on the
bridge and one address on a private /24. Nothing is added to the namespace the test runs in, so no traffic leaves
the namespaces the fabric made. ``Fabric.run`` starts a process inside a host (``ip netns exec`` execs the command,
so the PID is the process's own); ``Fabric.client`` runs callables on a thread that has joined a host's network
namespace, so the test's own HTTP requests start there too. ``close`` stops the processes it started, by PID, and
deletes its namespaces, which deletes the veth pairs and the bridge with them.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from processes import dies_with_parent

CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/var/run/netns")


class FabricUnavailable(Exception):
    """This machine cannot build a fabric (not root, no ``ip``, namespaces or bridges not permitted): skip."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")


def _join_netns(name: str) -> None:
    """Move the calling thread (only it: setns is per thread) into network namespace ``name``."""
    fd = os.open(NETNS_DIR / name, os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}")
    finally:
        os.close(fd)


class Fabric:
    def __init__(self, prefix: str, subnet: str = "10.213.0") -> None:
        """Namespaces are named ``PREFIX-HOST``; hosts get ``SUBNET.N/24``. Raises ``FabricUnavailable``."""
        if os.name != "posix" or not hasattr(os, "geteuid") or os.geteuid() != 0:
            raise FabricUnavailable("network namespaces need root")
        if shutil.which("ip") is None:
            raise FabricUnavailable("iproute2's `ip` is not installed")
        self.prefix, self.subnet = prefix, subnet
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.clients: list[ThreadPoolExecutor] = []
        self.switch = f"{prefix}-switch"
        try:
            self._add_namespace(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
        except RuntimeError as exc:
            self.close()
            raise FabricUnavailable(f"cannot make a namespace with a bridge here: {exc}") from None

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self.namespaces.append(name)

    def add_host(self, name: str, last_octet: int) -> str:
        """A namespace ``PREFIX-NAME`` on the bridge; returns its address."""
        ns, leg, addr = f"{self.prefix}-{name}", f"v{last_octet}", f"{self.subnet}.{last_octet}"
        self._add_namespace(ns)
        _ip("-n", self.switch, "link", "add", leg, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", self.switch, "link", "set", leg, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        return addr

    def run(self, host: str, argv: list[str], *, log: Path, env: dict[str, str]) -> subprocess.Popen:
        with open(log, "w") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", f"{self.prefix}-{host}", *argv], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    preexec_fn=dies_with_parent())  # ip netns exec execs argv: it keeps the signal
        self.procs.append(proc)
        return proc

    def client(self, host: str) -> ThreadPoolExecutor:
        """A one-thread executor whose thread lives in ``host``'s network namespace."""
        pool = ThreadPoolExecutor(1, thread_name_prefix=f"netns-{host}", initializer=_join_netns,
                                  initargs=(f"{self.prefix}-{host}",))
        self.clients.append(pool)
        return pool

    def close(self) -> None:
        for pool in self.clients:
            pool.shutdown(wait=True, cancel_futures=True)
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        left = []
        for ns in reversed(self.namespaces):  # a namespace's veth legs go with it
            try:
                _ip("netns", "delete", ns)
            except RuntimeError as exc:
                left.append(str(exc))
        self.namespaces.clear()
        if left:
            raise RuntimeError("namespaces left behind: " + "; ".join(left))
