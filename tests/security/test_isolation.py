"""Tenant isolation of the prefix cache, at engine and HTTP level, and of usage data.

The same prompt from two tenants must never share a cache entry: the second tenant computes the
whole prompt (``cached_tokens == 0``) and the engine holds two disjoint sets of indexed blocks. A
client-supplied ``cache_salt`` (vLLM's field) changes nothing: the namespace is derived by the server.
"""

from __future__ import annotations

import uuid

import pytest
from security_helpers import assert_openai_error, auth

from engine.protocol import GenerateRequest, SamplingParams, StaticTenantScope

# Every test puts its own marker first: a shared leading block would be a legitimate own-tenant hit.
PROMPT = ("Our refund policy: items may be returned within 30 days with a receipt. " * 12).strip()


def _complete(client, key: str, prompt: str = PROMPT, **extra) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    r = client.post("/v1/completions", json=body, headers=auth(key))
    assert r.status_code == 200, r.text
    return r.json()["usage"]


@pytest.fixture(scope="module")
def llm_engine(sec_home):
    from engine.config import EngineConfig
    from engine.launch import build_llm_engine, default_tiny_dir

    home, _ = sec_home
    return build_llm_engine(EngineConfig(model_dir=default_tiny_dir(home), num_kv_blocks=256))


def _run(engine, scope, prompt: str) -> int:
    """Run one request to completion on a synchronous LLMEngine -> its cached_tokens."""
    req = GenerateRequest(request_id=uuid.uuid4().hex, tenant=scope, prompt=prompt,
                          sampling=SamplingParams(max_tokens=1, temperature=0))
    engine.add_request(req)
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            last = out
    assert last is not None and last.finished and last.finish_reason in ("stop", "length")
    return last.cached_tokens


def test_engine_same_prompt_two_namespaces_share_no_block(llm_engine) -> None:
    a, b = StaticTenantScope(namespace=b"ns-a", metrics_label="a"), StaticTenantScope(namespace=b"ns-b", metrics_label="b")
    prompt = "engine-level. " + PROMPT
    assert _run(llm_engine, a, prompt) == 0
    assert _run(llm_engine, b, prompt) == 0  # same tokens, other namespace: a miss
    hit_a, hit_b = _run(llm_engine, a, prompt), _run(llm_engine, b, prompt)
    assert hit_a > 0 and hit_a == hit_b  # each namespace now hits its own copy
    pool = llm_engine.cache
    assert pool.indexed_by(b"ns-a") == pool.indexed_by(b"ns-b") == hit_a // llm_engine.block_size
    # one namespace's blocks are evictable without touching the other's index
    llm_engine.check_integrity()


def test_engine_namespace_is_the_only_key(llm_engine) -> None:
    """A namespace that is a prefix of another, or equal up to case, is still a different cache."""
    prompt = "prefix-namespace. " + PROMPT
    scopes = [StaticTenantScope(namespace=ns) for ns in (b"tenant", b"tenant\x00", b"Tenant", b"tenan")]
    for scope in scopes:
        assert _run(llm_engine, scope, prompt) == 0


def test_http_same_prompt_two_tenants(gateway) -> None:
    client, keys, _ = gateway
    prompt = "http-level. " + PROMPT
    assert _complete(client, keys["acme"], prompt)["prompt_tokens_details"]["cached_tokens"] == 0
    assert _complete(client, keys["beta"], prompt)["prompt_tokens_details"]["cached_tokens"] == 0
    again = _complete(client, keys["acme"], prompt)
    assert again["prompt_tokens_details"]["cached_tokens"] >= again["prompt_tokens"] - 16


@pytest.mark.parametrize("salt_field", ["cache_salt", "prompt_cache_key", "user"])
def test_http_client_salt_changes_nothing(gateway, salt_field: str) -> None:
    """A tenant cannot join another tenant's cache by naming a salt, nor leave its own."""
    client, keys, app = gateway
    # beta guesses every salt it could (acme's name, the namespace hex, empty), each on a prompt
    # that only acme has sent so far (a repeat would be a legitimate hit on beta's own copy)
    for i, salt in enumerate(("acme", "", "tenant:acme", "00" * 32)):
        prompt = f"salted-{salt_field}-{i}. " + PROMPT
        _complete(client, keys["acme"], prompt)
        usage = _complete(client, keys["beta"], prompt, **{salt_field: salt})
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0, (salt_field, salt)
    # acme with a random salt still hits its own cache: the salt is ignored, not mixed in
    usage = _complete(client, keys["acme"], prompt, **{salt_field: uuid.uuid4().hex})
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_http_streaming_reports_no_cross_tenant_hit(gateway) -> None:
    client, keys, _ = gateway
    prompt = "streamed. " + PROMPT
    _complete(client, keys["acme"], prompt)
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 2,
            "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body, headers=auth(keys["beta"])) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    import json

    usage = json.loads(lines[-2][6:])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_usage_endpoint_shows_only_the_callers_rows(gateway) -> None:
    client, keys, app = gateway
    _complete(client, keys["acme"], PROMPT + " usage-a")
    _complete(client, keys["beta"], PROMPT + " usage-b")
    app.state.tenancy.flush()
    for name in ("acme", "beta"):
        rep = client.get("/v1/usage", headers=auth(keys[name])).json()
        tenants = {row["tenant"] for row in rep["rows"]}
        assert tenants == {name}, rep
        # naming the other tenant is refused (403, OpenAI shape) and returns none of its rows
        other = "beta" if name == "acme" else "acme"
        r2 = client.get("/v1/usage", params={"tenant": other}, headers=auth(keys[name]))
        assert r2.status_code == 403, r2.text
        assert_openai_error(r2.json(), 403)
        assert other not in r2.text
        own = client.get("/v1/usage", params={"tenant": name}, headers=auth(keys[name])).json()
        assert {row["tenant"] for row in own["rows"]} == {name}
    admin = client.get("/v1/usage", headers=auth(keys["admin"])).json()
    assert {"acme", "beta"} <= {row["tenant"] for row in admin["rows"]}
    one = client.get("/v1/usage", params={"tenant": "beta"}, headers=auth(keys["admin"])).json()
    assert {row["tenant"] for row in one["rows"]} == {"beta"}


def test_dashboard_data_is_scoped_to_the_caller(gateway) -> None:
    client, keys, _ = gateway
    r = client.get("/dashboard/data", headers=auth(keys["beta"]))
    if r.status_code == 200:
        text = r.text
        assert "acme" not in text, "beta's dashboard mentions tenant acme"
    else:
        assert r.status_code in (401, 403), r.text


def test_metrics_need_an_admin_key_and_show_no_prompt_text(gateway) -> None:
    client, keys, _ = gateway
    assert client.get("/metrics").status_code == 401  # #16.10: every tenant's numbers are not public
    assert client.get("/metrics", headers=auth(keys["acme"])).status_code == 403
    text = client.get("/metrics", headers=auth(keys["admin"])).text
    assert "prefixgate_gateway_requests_total" in text
    assert "refund policy" not in text
