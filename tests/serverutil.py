"""Start a real ``prefixgate serve`` (tiny model) on a free loopback port, for tests and benchmarks.

One helper, so that every end-to-end test and ``benchmarks/load.py`` starts, waits for and stops
the server the same way. The server's output goes to a temporary file, not a pipe: a pipe nobody
drains blocks a chatty server once it fills, and the file still lets a failed start say why.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


# `serve_tiny` servers accept this bearer token on /metrics (PREFIXGATE_METRICS_TOKEN); see `scrape`.
METRICS_TOKEN = "serverutil-metrics-token"


def scrape(url: str, timeout: float = 30.0) -> str:
    """``GET {url}/metrics`` with the metrics token of a ``serve_tiny`` server -> the Prometheus text."""
    r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, timeout=timeout,
                  trust_env=False)
    r.raise_for_status()
    return r.text


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Poll ``cond`` until it holds or ``timeout`` seconds pass; returns its last value (the caller asserts)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return bool(cond())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tenant_key(home: Path, name: str, **settings: object) -> str:
    """A new tenant's first API key, written to the tenancy store under ``home`` (SQLite) before a
    server opens it; ``settings`` as ``TenancyService.create_tenant`` takes them."""
    from tenancy.service import TenancyService

    svc = TenancyService.open(home)
    try:
        key = svc.create_tenant(name, **settings).api_key
        svc.flush()
    finally:
        svc.close()
    return key


def serve_tiny(home: Path, *flags: str, env: dict[str, str] | None = None,
               timeout: float = 180.0, port: int | None = None) -> tuple[str, subprocess.Popen]:
    """Start ``serve --model tiny`` under ``home`` with extra ``flags`` and wait for ``/health``.

    Returns ``(url, proc)``; stop it with :func:`stop`. ``env`` is added to this process's
    environment. ``port``: listen there (a restart on the same address) instead of a free port.
    Raises RuntimeError (with the server's last output) if it exits or is not healthy within
    ``timeout`` seconds; the process is killed then.
    """
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "NO_PROXY": "127.0.0.1,localhost",
                "PREFIXGATE_METRICS_TOKEN": METRICS_TOKEN, **(env or {})}
    # The child keeps its own descriptor of the (unlinked) file after ours closes.
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli.main", "serve", "--home", str(home), "--port", str(port),
             "--model", "tiny", "--log-level", "warning", *flags],
            cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=1.0, trust_env=False).status_code == 200:
                    return url, proc
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        stop(proc)
        log.seek(0)
        tail = log.read().decode(errors="replace")[-4000:]
    raise RuntimeError(f"server at {url} did not become healthy (exit status {proc.returncode}):\n{tail}")

def stop(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def error_lines(stderr: str) -> list[str]:
    """The lines of a CLI's stderr that are not notices.

    A command may first say that it created the home or a secret (``prefixgate: created home
    directory ...``, ``prefixgate: warning: created a new ...``); "one line, exit 2" is about what
    remains: the error itself.
    """
    notices = ("prefixgate: warning:", "prefixgate: created home directory")
    return [line for line in stderr.strip().splitlines() if line and not line.startswith(notices)]
