"""Property tests over the request schema (issue 16, "Tests"): whatever the body, the gateway
answers a 200 or an OpenAI-shaped 4xx with ASCII headers, the ledger keeps committing and
``/health`` keeps answering.

Against the real in-process gateway (tiny engine thread, real tenancy). Deterministic: the
examples are derived from the test (``derandomize``), bounded in number; the long, randomized
variant against a real ``prefixgate serve`` is ``tests/slow/test_request_properties_e2e.py``.
"""

from __future__ import annotations

import json
import sqlite3

import pytest
from hypothesis import HealthCheck, given, settings
from request_strategies import CHAT_BASE, CHAT_FIELDS, COMPLETION_BASE, COMPLETION_FIELDS, bodies
from security_helpers import assert_openai_error, auth

FAST = settings(max_examples=70, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


def check_response(r) -> None:
    """200 (JSON or a complete SSE stream) or an OpenAI-shaped 4xx; never a 5xx; ASCII headers."""
    assert r.status_code < 500, (r.status_code, r.text[:400])
    for name, value in r.headers.items():
        assert value.isascii() and value.isprintable(), (name, value)
    if r.status_code == 200:
        if r.headers["content-type"].startswith("text/event-stream"):
            events = [e for e in r.text.split("\n\n") if e.startswith("data: ")]
            assert events[-1] == "data: [DONE]", events[-3:]
            assert not any('"error"' in e for e in events), events  # no 5xx hidden in a 200 stream
        else:
            assert "choices" in r.json()
    else:
        assert_openai_error(r.json(), r.status_code)


def _committed_rows(app) -> int:
    app.state.tenancy.flush()
    con = sqlite3.connect(f"file:{app.state.settings.home / 'prefixgate.db'}?mode=ro", uri=True, timeout=10)
    try:
        return con.execute("SELECT count(*) FROM usage").fetchone()[0]
    finally:
        con.close()


def _still_serving(client, key: str, app) -> None:
    before = _committed_rows(app)
    ok = client.post("/v1/chat/completions", json={**CHAT_BASE, "messages": [{"role": "user", "content": "ping"}]},
                     headers=auth(key))
    assert ok.status_code == 200, ok.text
    assert _committed_rows(app) == before + 1  # the ledger is not wedged by anything sent before
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("path, base, fields", [
    ("/v1/chat/completions", CHAT_BASE, CHAT_FIELDS),
    ("/v1/completions", COMPLETION_BASE, COMPLETION_FIELDS),
], ids=["chat", "completions"])
def test_any_body_is_a_200_or_an_openai_4xx(gateway, path: str, base: dict, fields: dict) -> None:
    client, keys, app = gateway
    headers = {**auth(keys["acme"]), "Content-Type": "application/json"}

    @FAST
    @given(raw=bodies(base, fields))
    def run(raw: bytes) -> None:
        check_response(client.post(path, content=raw, headers=headers))

    run()
    _still_serving(client, keys["acme"], app)


def test_surrogates_and_nul_in_every_string_field(gateway) -> None:
    """Deterministic corner: the attack strings in each string field of a chat body."""
    client, keys, app = gateway
    headers = {**auth(keys["beta"]), "Content-Type": "application/json"}
    for value in ("\ud800", "a\udfffb", "\x00", "имя\x00", "\ud83d\ude42"):
        for field in ("user", "prompt_cache_key", "model", "stop", "cache_salt"):
            raw = json.dumps({**CHAT_BASE, field: value}, ensure_ascii=True).encode()
            check_response(client.post("/v1/chat/completions", content=raw, headers=headers))
        for where in ("content", "name"):
            msg = {"role": "user", "content": "hi", where: value}
            raw = json.dumps({**CHAT_BASE, "messages": [msg]}, ensure_ascii=True).encode()
            check_response(client.post("/v1/chat/completions", content=raw, headers=headers))
    _still_serving(client, keys["beta"], app)
