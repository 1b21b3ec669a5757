"""Issue 16 items 2, 4, 9 (gateway part) and 11: bounded work, ASCII headers, a ledger row per outcome.

Against the real in-process gateway (tiny engine thread, real tenancy on SQLite). Each test names
the item it pins; the property tests over the whole schema are in ``test_request_properties.py``.
"""

from __future__ import annotations

import json
import sqlite3
import uuid

import pytest
from security_helpers import assert_openai_error, auth

CHAT = "/v1/chat/completions"


def _chat(content: str = "hello", **over) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **over}


def _post(client, key: str, body: dict, path: str = CHAT):
    return client.post(path, content=json.dumps(body), headers={**auth(key), "Content-Type": "application/json"})


def _expect(r, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = assert_openai_error(r.json(), status)
    if code is not None:
        assert err["code"] == code, err
    return err


def _rows(app, tenant_name: str) -> list[dict]:
    """The tenant's committed ledger rows, read from the database file as an outside reader would."""
    tenancy = app.state.tenancy
    tenancy.flush()
    tid = tenancy.get_tenant_by_name(tenant_name).tenant_id
    con = sqlite3.connect(f"file:{app.state.settings.home / 'prefixgate.db'}?mode=ro", uri=True, timeout=10)
    con.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in con.execute(
            "SELECT * FROM usage WHERE tenant_id = ? ORDER BY created_at, rowid", [tid])]
    finally:
        con.close()


# --- 16.2: one request must not freeze the gateway ------------------------------------------------------


def test_300k_prompts_are_refused_at_ingress(gateway) -> None:
    """The attack body ("prompt": ["a"] * 300000, 1.5 MB) is a 400 from the schema's list bound."""
    client, keys, _ = gateway
    err = _expect(_post(client, keys["acme"], {"model": "tiny", "prompt": ["a"] * 300_000, "max_tokens": 1},
                        "/v1/completions"), 400)
    assert "300000 entries" in err["message"] and err["param"] == "prompt"


def test_prompt_and_choice_counts_are_bounded(gateway) -> None:
    client, keys, app = gateway
    s = app.state.settings
    _expect(_post(client, keys["acme"], {"model": "tiny", "prompt": ["a b"] * (s.max_prompts + 1), "max_tokens": 1},
                  "/v1/completions"), 400)
    n = s.max_n
    prompts = s.max_choices // n + 1  # under max_prompts, but prompts x n over max_choices
    assert prompts <= s.max_prompts
    err = _expect(_post(client, keys["acme"], {"model": "tiny", "prompt": ["a b"] * prompts, "n": n,
                                               "max_tokens": 1}, "/v1/completions"), 400)
    assert err["param"] == "n"


def test_a_message_over_the_character_limit_is_refused_before_tokenizing(gateway) -> None:
    """A multi-megabyte message is a 400 request_too_large; the engine never sees it."""
    client, keys, app = gateway
    limit = app.state.settings.max_prompt_chars
    err = _expect(_post(client, keys["acme"], _chat("x" * (limit + 1))), 400, "request_too_large")
    assert str(limit) in err["message"]


def test_refused_requests_count_against_the_rate_limit(gateway) -> None:
    """16.9: a tenant at rpm=2 that sends two oversized requests is out of requests for the minute."""
    client, _, app = gateway
    name = f"rpm-{uuid.uuid4().hex[:8]}"
    key = app.state.tenancy.create_tenant(name, rpm=2).api_key
    for _ in range(2):
        _expect(_post(client, key, {"model": "tiny", "prompt": ["a"] * 100, "max_tokens": 1}, "/v1/completions"), 400)
    r = _post(client, key, _chat())
    _expect(r, 429, "rate_limit_exceeded")
    # an over-limit tenant's huge body is refused without being tokenized (no 400 about the template)
    _expect(_post(client, key, {"model": "tiny", "prompt": ["a b c"] * 60, "max_tokens": 1}, "/v1/completions"),
            429, "rate_limit_exceeded")


def test_bodies_the_schema_refuses_count_against_the_rate_limit(gateway) -> None:
    """16.9: a 400 from the schema (here: nesting) also takes a request of the minute."""
    client, _, app = gateway
    key = app.state.tenancy.create_tenant(f"rpm-schema-{uuid.uuid4().hex[:8]}", rpm=2).api_key
    for _ in range(2):
        _expect(_post(client, key, _chat(extra_field=_deep(100))), 400)
    _expect(_post(client, key, _chat()), 429, "rate_limit_exceeded")


def test_stored_client_strings_are_bounded(gateway) -> None:
    """16.9: a 3 MB model name (or user, or prompt_cache_key) is a 400, never a stored ledger row."""
    client, keys, app = gateway
    for field, value in (("model", "m" * 3_000_000), ("user", "u" * 300), ("prompt_cache_key", "k" * 300)):
        body = _chat(**{field: value})
        err = _expect(_post(client, keys["beta"], body), 400)
        assert err["param"] == field
    assert all(len(r["model"]) <= 256 for r in _rows(app, "beta"))


# --- 16.4: non-Latin text in a cache-break explanation --------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_non_latin_break_detail_is_an_ascii_header_and_billed_right(gateway, stream: bool) -> None:
    client, keys, app = gateway
    tag = uuid.uuid4().hex[:6]
    before = len(_rows(app, "acme"))

    def send(value: str):
        system = f"You are the {tag} assistant.\nuser_имя: {value}\n" + "Follow the rules carefully. " * 30
        body = {"model": "tiny", "max_tokens": 2, "stream": stream,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": "привет"}]}
        return _post(client, keys["acme"], body)

    first, second = send("Иван"), send("Пётр")
    for r in (first, second):
        assert r.status_code == 200, r.text[:300]
        for name, value in r.headers.items():
            assert value.isascii(), (name, value)
    if not stream:
        cache = second.headers.get("x-prefixgate-cache", "")
        assert "break=" in cache and "%D0%" in cache, cache  # the detail survives, percent-encoded UTF-8
    rows = _rows(app, "acme")[before:]
    assert [r["status"] for r in rows] == ["ok", "ok"], rows


# --- 16.11: 500s that must be 400s ----------------------------------------------------------------------


def _deep(n: int) -> dict:
    d: dict = {}
    for _ in range(n):
        d = {"a": d}
    return d


@pytest.mark.parametrize("body", [
    _chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
    _chat(messages=[{"role": "user", "content": [{"type": "text", "text": ["x"]}]}]),
    _chat(messages=[{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}]),
    _chat(messages=[{"role": "user", "content": [{"text": "no type"}]}]),
    _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": _deep(400)}}]),
    _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": _deep(800)}}]),
    _chat(extra_field=_deep(600)),
    _chat(stop=["s"] * 5),
    _chat(stop="s" * 5000),
], ids=["text-int", "text-list", "text-dict", "part-without-type", "tools-400-deep", "tools-800-deep",
        "extra-600-deep", "five-stops", "long-stop"])
def test_malformed_fields_are_400s(gateway, body: dict) -> None:
    client, keys, _ = gateway
    _expect(_post(client, keys["acme"], body), 400)


def test_denormal_temperature_is_greedy_not_a_500(gateway) -> None:
    client, keys, _ = gateway
    greedy = _post(client, keys["acme"], _chat("tell me", temperature=0, max_tokens=4))
    tiny = _post(client, keys["acme"], _chat("tell me", temperature=1e-300, max_tokens=4))
    assert greedy.status_code == tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["message"]["content"] == greedy.json()["choices"][0]["message"]["content"]


def test_lone_surrogate_user_for_a_user_scope_tenant_is_a_400(gateway) -> None:
    client, _, app = gateway
    key = app.state.tenancy.create_tenant(f"per-user-{uuid.uuid4().hex[:8]}", share_scope="user").api_key
    raw = b'{"model": "tiny", "max_tokens": 1, "user": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}'
    r = client.post(CHAT, content=raw, headers={**auth(key), "Content-Type": "application/json"})
    assert _expect(r, 400)["param"] == "user"
    assert _post(client, key, _chat(user="имя")).status_code == 200  # non-Latin is fine, only broken text is not


@pytest.mark.parametrize("since", ["0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00", "99999999999w"])
def test_usage_since_out_of_range_is_a_400(gateway, since: str) -> None:
    client, keys, _ = gateway
    r = client.get("/v1/usage", params={"since": since}, headers=auth(keys["acme"]))
    assert _expect(r, 400)["param"] == "since"


# --- unit level -----------------------------------------------------------------------------------------


def test_header_text_is_printable_ascii_and_reversible() -> None:
    from urllib.parse import unquote

    from gateway.pipeline import header_text

    for value in ("cached=3; break=PC002; detail=user_имя; pos=5", "a\r\nb", "100% done", "ok; plain=1"):
        out = header_text(value)
        assert out.isascii() and out.isprintable() and unquote(out) == value
    assert header_text("cached=3; break=PC001") == "cached=3; break=PC001"


def test_canon_refuses_deep_bodies_with_a_value_error() -> None:
    from promptlint.canon import MAX_DEPTH, CanonDepthError, canonicalize, json_depth

    body = {"messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": _deep(900)}}]}
    with pytest.raises(CanonDepthError):
        canonicalize(body, "safe")
    ok = {"messages": [{"role": "user", "content": "x"}], "extra": _deep(MAX_DEPTH - 2)}
    assert json_depth(ok) == MAX_DEPTH
    assert canonicalize(ok, "reorder").body["extra"] == ok["extra"]


def test_scan_counts_text_and_names_where_it_failed() -> None:
    from pydantic_core import PydanticCustomError

    from gateway.ingress import MAX_DEPTH, MAX_ITEMS, scan

    shape = scan({"ab": [{"c": "déf"}, 1, 2.5, None], "ids": list(range(10_000))})
    assert (shape.depth, shape.chars) == (3, len("ab") + len("c") + len("déf") + len("ids"))
    for bad, where in (({"a": [{"b": "x\ud800"}]}, "a[0].b"), ({"k\udfff": 1}, "body"),
                       ({"p": ["s"] * (MAX_ITEMS + 1)}, "p"), (_deep(MAX_DEPTH + 1), "a")):
        with pytest.raises(PydanticCustomError) as info:
            scan(bad)
        assert info.value.context["param"] == where, (where, info.value.context)
