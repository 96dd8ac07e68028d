"""A private PostgreSQL server for a test or a bench: ``initdb`` into a temp dir, ``postgres`` on its own port on
127.0.0.1 (and a unix socket in the same dir), stopped by PID. No pytest here, so that ``bench/`` can use it.

PostgreSQL refuses to run as root; as root the server runs as the ``postgres`` user that the Debian package creates
(else ``nobody``), started with ``Popen(user=...)`` so that the PID we hold is the server's own. ``find_bin_dir``
says where the binaries are, or None when PostgreSQL is not installed (``.ci/run`` installs the Debian package).
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from processes import dies_with_parent

from fsm_pd.cli.launch import free_port

PROGRAMS = ("initdb", "postgres")
SUPERUSER = "fsm"


def find_bin_dir() -> str | None:
    """The directory holding ``initdb`` and ``postgres``: on PATH, or Debian's /usr/lib/postgresql/N/bin."""
    on_path = shutil.which("initdb")
    candidates = [os.path.dirname(os.path.realpath(on_path))] if on_path else []
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version, reverse=True)
    for folder in candidates:
        if all(os.access(os.path.join(folder, p), os.X_OK) for p in PROGRAMS):
            return folder
    return None


def missing() -> str | None:
    """Why a server cannot be run and spoken to here (None: it can): the PostgreSQL binaries, and psycopg."""
    if find_bin_dir() is None:
        return ("PostgreSQL is not installed (no initdb/postgres on PATH or in /usr/lib/postgresql/*/bin; "
                "apt-get install -y postgresql)")
    if importlib.util.find_spec("psycopg") is None:
        return "the PostgreSQL driver psycopg is not installed (pip install 'fsm-pd[postgres]')"
    return None


def _version(folder: str) -> int:
    try:
        return int(folder.split("/")[-2])
    except ValueError:
        return 0


class PostgresServer:
    """One ``postgres`` process on 127.0.0.1:``port``; ``url(db)`` is a SQLAlchemy URL for database ``db``.

    ``fsync=False`` is for tests that only need a real server (faster on a busy disk); benches keep it on.
    """

    def __init__(self, *, fsync: bool = True):
        self.bin = find_bin_dir()
        if self.bin is None:
            raise FileNotFoundError("PostgreSQL is not installed (no initdb/postgres on PATH or in "
                                    "/usr/lib/postgresql/*/bin); on Debian: apt-get install -y postgresql")
        self.fsync = fsync
        self.dir = tempfile.mkdtemp(prefix="fsm-pd-pg-")
        self.data = os.path.join(self.dir, "data")
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(self.dir, "postgres.log")
        self._user: dict = {}
        if os.geteuid() == 0:
            name = "postgres" if _user_exists("postgres") else "nobody"
            entry = pwd.getpwnam(name)
            os.chown(self.dir, entry.pw_uid, entry.pw_gid)
            self._user = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}

    def start(self, timeout: float = 60.0) -> PostgresServer:
        if not os.path.isdir(self.data):
            subprocess.run([os.path.join(self.bin, "initdb"), "-D", self.data, "-U", SUPERUSER, "--auth=trust",
                            "--encoding=UTF8", "--no-sync"], check=True, capture_output=True, cwd=self.dir,
                           **self._user)
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [os.path.join(self.bin, "postgres"), "-D", self.data, "-p", str(self.port), "-k", self.dir,
                 "-c", "listen_addresses=127.0.0.1", "-c", f"fsync={'on' if self.fsync else 'off'}"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.dir, **self._user,
                preexec_fn=dies_with_parent(signal.SIGQUIT))  # postgres' immediate shutdown: its backends too
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.proc.returncode}: {self.log()[-2000:]}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                if self._accepts():
                    return self
            if time.monotonic() > deadline:
                raise TimeoutError(f"postgres on port {self.port} not ready within {timeout}s: {self.log()[-2000:]}")
            time.sleep(0.1)

    def _accepts(self) -> bool:
        import psycopg

        try:
            psycopg.connect(self.dsn("postgres"), connect_timeout=2).close()
        except psycopg.OperationalError:  # "the database system is starting up"
            return False
        return True

    def dsn(self, db: str) -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{db}"

    def url(self, db: str) -> str:
        """A SQLAlchemy URL as an operator would write it for ``--journal`` (fsm-pd picks the psycopg driver)."""
        return self.dsn(db)

    def create_database(self, db: str) -> str:
        import psycopg

        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{db}"')
        return self.url(db)

    def sql(self, db: str, query: str, params: tuple = ()) -> list[tuple]:
        """Run one query with plain psycopg (not fsm-pd's code): what the tests check the journal with."""
        import psycopg

        with psycopg.connect(self.dsn(db)) as conn:
            return conn.execute(query, params).fetchall()

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self, mode: str = "fast", timeout: float = 30.0) -> None:
        """Stop the server by its PID: ``fast`` (SIGINT: disconnect clients, clean shutdown) or ``immediate``
        (SIGQUIT: every backend quits at once, recovery on the next start, like a crash; SIGKILL would orphan them)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGQUIT if mode == "immediate" else signal.SIGINT)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True
