"""Real PostgreSQL and Redis servers for tests: Debian's binaries, free loopback ports, temporary dirs.

``PostgresServer.start()`` runs ``initdb`` and ``postgres`` (as the ``postgres`` user when this
process is root: PostgreSQL refuses to run as root) in a fresh directory; ``new_database()`` hands
each test its own database. ``RedisServer`` can be stopped and started again on the same port (the
outage tests). Both raise ``Unavailable`` with the reason when the binaries are missing, which the
fixtures turn into a skip that says what to install.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

INSTALL_HINT = "apt-get install -y postgresql redis-server"


class Unavailable(RuntimeError):
    """The server cannot run here (binaries missing); the message says why."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)
    path = found[0] if found else shutil.which(name)
    if path is None:
        raise Unavailable(f"PostgreSQL's {name} is not installed ({INSTALL_HINT})")
    return path


class PostgresServer:
    """One throwaway PostgreSQL cluster on 127.0.0.1 (trust auth, fsync off: test data only)."""

    user = "prefixgate"

    def __init__(self) -> None:
        self.port = 0
        self.dir = Path()
        self._opts = ""
        self._run_as: list[str] = []

    def start(self) -> PostgresServer:
        initdb = _pg_bin("initdb")
        self.dir = Path(tempfile.mkdtemp(prefix="prefixgate-pg-"))
        if os.geteuid() == 0:
            try:
                owner = pwd.getpwnam("postgres")
            except KeyError:
                raise Unavailable("running as root and there is no 'postgres' user to run PostgreSQL as") from None
            os.chown(self.dir, owner.pw_uid, owner.pw_gid)
            runuser = shutil.which("runuser") or ("/usr/sbin/runuser" if os.path.exists("/usr/sbin/runuser") else None)
            if runuser is None:
                raise Unavailable("running as root and `runuser` is missing to start PostgreSQL as 'postgres'")
            self._run_as = [runuser, "-u", "postgres", "--"]
        data, sock = self.dir / "data", self.dir
        self._run([initdb, "-D", str(data), "-A", "trust", "-U", self.user, "--no-sync", "-E", "UTF8"])
        self.port = free_port()
        self._opts = f"-p {self.port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self.resume()
        return self

    def halt(self) -> None:
        """Stop the server, keeping its data and port (an outage); ``resume`` brings it back."""
        self._run([_pg_bin("pg_ctl"), "-D", str(self.dir / "data"), "-m", "immediate", "-w", "stop"])

    def resume(self) -> None:
        self._run([_pg_bin("pg_ctl"), "-D", str(self.dir / "data"), "-o", self._opts, "-l", str(self.dir / "log"),
                   "-w", "-t", "60", "start"])

    def _run(self, cmd: list[str]) -> None:
        try:
            result = subprocess.run([*self._run_as, *cmd], capture_output=True, text=True, timeout=120)
        except FileNotFoundError as exc:
            raise Unavailable(f"cannot run {exc.filename} ({INSTALL_HINT})") from None
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:2])} failed: {(result.stderr or result.stdout)[-2000:]}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database; returns its URL."""
        import psycopg

        name = "t_" + secrets.token_hex(6)
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        if self.port:
            subprocess.run([*self._run_as, _pg_bin("pg_ctl"), "-D", str(self.dir / "data"), "-m", "immediate",
                            "stop"], capture_output=True, timeout=60)
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisServer:
    """One ``redis-server`` on 127.0.0.1 without persistence; ``stop``/``start`` keep the port."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise Unavailable(f"redis-server is not installed ({INSTALL_HINT})")
        self._binary = binary
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="prefixgate-redis-"))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self._proc = subprocess.Popen(
            [self._binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.dir), "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not answer PING within 20 s")

    def flush(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            s.sendall(b"FLUSHALL\r\n")
            s.recv(16)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)
        self._proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


# -- helpers for tests that run on either store ----------------------------------------------------

def read_rows(svc: object, sql: str, params: Sequence[Any] = ()) -> list[dict]:
    """Rows of ``sql`` read through a TenancyService's own store (SQLite or PostgreSQL), on a new connection."""
    db = svc.database.connect()  # type: ignore[attr-defined]
    try:
        return db.query(sql, params)
    finally:
        db.close()


# -- pytest fixtures (imported by the conftest files that use them) ---------------------------------

import pytest  # noqa: E402

_Server = TypeVar("_Server", PostgresServer, RedisServer)


def started(server: type[_Server]) -> _Server:
    """A new ``server`` started, or a skip naming what to install (for a test that runs its own
    server; the constructor already looks for the binaries)."""
    try:
        return server().start()
    except Unavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def postgres_server() -> object:
    """A session's PostgreSQL cluster, or a skip naming what to install."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg is not installed (pip install 'prefixgate[fleet]')")
    server = started(PostgresServer)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_session_server() -> object:
    try:
        import redis  # noqa: F401
    except ImportError:
        pytest.skip("redis (redis-py) is not installed (pip install 'prefixgate[fleet]')")
    server = started(RedisServer)
    yield server
    server.close()


@pytest.fixture
def redis_server(redis_session_server: RedisServer) -> RedisServer:
    """The session's Redis, emptied for this test."""
    redis_session_server.flush()
    return redis_session_server
