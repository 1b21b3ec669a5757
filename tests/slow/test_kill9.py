"""kill -9 the server while streams are in flight, restart it: the ledger is consistent.

Before the kill we read the rows SQLite has committed (a separate read connection: WAL readers see
only committed transactions). After the restart every one of them is still there, unchanged, the
database passes ``PRAGMA integrity_check``, no row is partial (NOT NULL columns hold, statuses are
valid) and the server serves again.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import pytest
from security_helpers import auth

from tests import serverutil
from tests.serverutil import scrape, serve_tiny

pytestmark = pytest.mark.slow


def _rows(db: Path) -> dict[str, tuple]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return {r[0]: r for r in con.execute("SELECT * FROM usage")}
    finally:
        con.close()


def _stream_forever(url: str, key: str, stop: threading.Event, done: list[int]) -> None:
    body = {"model": "tiny", "stream": True, "max_tokens": 24, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "write a long answer about refunds"}]}
    while not stop.is_set():
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=auth(key), timeout=60) as r:
                for _ in r.iter_lines():
                    pass
            done.append(r.status_code)
        except httpx.HTTPError:
            if stop.is_set():
                return
            time.sleep(0.1)


def test_kill9_during_streaming_load_keeps_the_ledger_consistent(slow_home) -> None:
    home, keys = slow_home
    db = home / "prefixgate.db"  # the tenancy database (ledger table `usage`)
    for rounds in range(2):  # kill twice: recovery after a kill must itself survive a kill
        url, proc = serve_tiny(home, "--kv-blocks", "512")
        stop, done = threading.Event(), []
        threads = [threading.Thread(target=_stream_forever, args=(url, keys[n], stop, done), daemon=True)
                   for n in ("acme", "beta") * 8]
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while len(done) < 20 and time.time() < deadline:
            time.sleep(0.2)
        assert len(done) >= 20, "too few requests completed before the kill"
        committed = _rows(db)
        os.kill(proc.pid, signal.SIGKILL)  # mid-stream: 16 streams are open right now
        proc.wait(10)
        stop.set()
        for t in threads:
            t.join(30)
        assert committed, f"round {rounds}: no ledger row was committed before the kill"

        url, proc = serve_tiny(home, "--kv-blocks", "512")
        try:
            con = sqlite3.connect(db, timeout=10)
            try:
                assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            finally:
                con.close()
            after = _rows(db)
            lost = set(committed) - set(after)
            assert not lost, f"committed rows lost after kill -9: {sorted(lost)[:5]}"
            changed = [rid for rid in committed if after[rid] != committed[rid]]
            assert not changed, f"committed rows changed: {changed[:5]}"
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
            try:
                bad = con.execute(
                    "SELECT count(*) FROM usage WHERE status NOT IN ('ok','error','aborted') OR prompt_tokens < 0 "
                    "OR cached_tokens < 0 OR cached_tokens > prompt_tokens OR completion_tokens < 0").fetchone()[0]
            finally:
                con.close()
            assert bad == 0
            r = httpx.post(f"{url}/v1/chat/completions", headers=auth(keys["acme"]), timeout=60,
                           json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
        finally:
            serverutil.stop(proc, timeout=30)


TIER_FLAGS = ("--kv-blocks", "48", "--nvme-bytes", "64MiB")  # few HBM blocks: prompts spill to <home>/nvme


def _complete(url: str, key: str, prompt: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", headers=auth(key), timeout=60,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_kill9_keeps_the_nvme_tier_consistent_and_decryptable(tmp_path: Path) -> None:
    import random

    from security_helpers import make_home, random_prompt

    home, keys = make_home(tmp_path / "home")
    rng = random.Random(3)
    secret = "kill9-tier. " + random_prompt(rng, 160)
    url, proc = serve_tiny(home, *TIER_FLAGS)
    _complete(url, keys["acme"], secret)
    for _ in range(6):  # evict it from HBM: it is demoted, encrypted, to the NVMe tier
        _complete(url, keys["acme"], random_prompt(rng, 160))
    time.sleep(1.0)
    segs = list((home / "nvme").rglob("*.seg"))
    assert segs, "nothing spilled: the test would prove nothing"
    stop, done = threading.Event(), []
    threads = [threading.Thread(target=_stream_forever, args=(url, keys[n], stop, done), daemon=True)
               for n in ("acme", "beta") * 4]
    for t in threads:
        t.start()
    while len(done) < 8:
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)  # streams open, evictions and demotions in flight
    proc.wait(10)
    stop.set()
    for t in threads:
        t.join(30)
    index = next((home / "nvme").rglob("index.sqlite"))
    con = sqlite3.connect(index, timeout=10)
    try:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        con.close()
    url, proc = serve_tiny(home, *TIER_FLAGS)
    try:
        # the restarted engine finds the spilled prefix in the index, and its blocks decrypt
        usage = _complete(url, keys["acme"], secret)
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 16, usage
        assert _complete(url, keys["beta"], secret)["prompt_tokens_details"]["cached_tokens"] == 0
        metrics = scrape(url, timeout=10)
        failures = [ln for ln in metrics.splitlines()
                    if ln.startswith("prefixgate_tier_auth_failures_total{") and not ln.endswith(" 0.0")]
        assert not failures, failures
    finally:
        serverutil.stop(proc, timeout=30)
