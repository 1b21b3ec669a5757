"""Gateway HTTP API with a fake engine and fake tenancy, injected two ways: through ``create_app``
(the completion routes then take their raw-ASGI fast path, ``gateway.routes.completions_asgi``) and
through FastAPI's ``dependency_overrides`` (they then go through FastAPI's routes). Every test runs
on both, so the two paths answer alike."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from gateway_fakes import FakeEngine, FakeTenancy

from engine.protocol import GrammarQueueFullError
from gateway.app import create_app
from gateway.deps import get_engine, get_tenancy
from gateway.ports import QuotaExceededError
from gateway.settings import GatewaySettings


@pytest.fixture(params=["injected", "overridden"])
def parts(request):
    engine, tenancy = FakeEngine(), FakeTenancy()
    keys = {"a": tenancy.add("acme"), "b": tenancy.add("beta"), "admin": tenancy.add("ops", admin=True)}
    settings = GatewaySettings(max_body_bytes=64 * 1024, max_n=4)
    if request.param == "injected":
        app = create_app(settings, engine=engine, tenancy=tenancy)
    else:
        app = create_app(settings)
        app.dependency_overrides[get_engine] = lambda: engine
        app.dependency_overrides[get_tenancy] = lambda: tenancy
    with TestClient(app) as client:
        yield client, engine, tenancy, keys


def auth(key):
    return {"Authorization": f"Bearer {key}"}


CHAT = {"model": "tiny", "messages": [{"role": "system", "content": "you are a terse helpful assistant " * 3},
                                      {"role": "user", "content": "hello there"}], "max_tokens": 3}


def assert_openai_error(resp, status, code=None, param=None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def sse_events(text):
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def test_chat_completion_shape_usage_and_cache_per_tenant(parts):
    client, engine, tenancy, keys = parts
    first = client.post("/v1/chat/completions", json=CHAT, headers=auth(keys["a"]))
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "tiny"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"] == " w0 w1 w2"
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 3 and usage["prompt_tokens"] > 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + 3
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    again = client.post("/v1/chat/completions", json=CHAT, headers=auth(keys["a"])).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    other = client.post("/v1/chat/completions", json=CHAT, headers=auth(keys["b"])).json()
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # one ledger row per request, priced, with the backend and status
    assert [r.status for r in tenancy.rows] == ["ok", "ok", "ok"]
    assert [r.tenant_id for r in tenancy.rows] == ["t-acme", "t-acme", "t-beta"]
    assert tenancy.rows[1].cached_tokens == again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert tenancy.rows[0].backend == "local" and tenancy.rows[0].ttft_s is not None
    assert first.headers["x-prefixgate-canonical"] == "none"


def test_stream_with_include_usage(parts):
    client, _, tenancy, keys = parts
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    resp = client.post("/v1/chat/completions", json=body, headers=auth(keys["a"]))
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    chunks = sse_events(resp.text)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == " w0 w1 w2"
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert all(c["usage"] is None for c in chunks[:-1])
    assert tenancy.rows[-1].status == "ok" and tenancy.rows[-1].completion_tokens == 3


def test_stream_without_usage_has_no_usage_chunk(parts):
    client, _, _, keys = parts
    resp = client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=auth(keys["a"]))
    chunks = sse_events(resp.text)
    assert all(c["choices"] for c in chunks) and all("usage" not in c for c in chunks)


def test_text_completions_prompt_shapes(parts):
    client, engine, _, keys = parts
    resp = client.post("/v1/completions", json={"model": "tiny", "prompt": "one two three", "max_tokens": 2},
                       headers=auth(keys["a"]))
    body = resp.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == " w0 w1"
    assert body["usage"]["prompt_tokens"] == 3
    resp = client.post("/v1/completions", json={"model": "tiny", "prompt": [[5, 6, 7, 8], [9]], "max_tokens": 1},
                       headers=auth(keys["a"]))
    body = resp.json()
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["usage"]["prompt_tokens"] == 5
    assert list(engine.requests[-1].prompt_token_ids) in ([5, 6, 7, 8], [9])
    stream = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": True},
                         headers=auth(keys["a"]))
    chunks = sse_events(stream.text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == " w0 w1"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_n_choices_use_distinct_seeds_and_n_limit(parts):
    client, engine, _, keys = parts
    resp = client.post("/v1/chat/completions", json={**CHAT, "n": 2, "seed": 3, "max_tokens": 1},
                       headers=auth(keys["a"]))
    body = resp.json()
    assert [c["message"]["content"] for c in body["choices"]] == [" w3", " w4"]
    assert body["usage"]["completion_tokens"] == 2
    assert sorted(r.sampling.seed for r in engine.requests[-2:]) == [3, 4]
    assert_openai_error(client.post("/v1/chat/completions", json={**CHAT, "n": 5}, headers=auth(keys["a"])),
                        400, param="n")


def test_sampling_fields_reach_the_engine(parts):
    client, engine, _, keys = parts
    body = {**CHAT, "temperature": 0, "top_p": 0.5, "stop": ["\n", "END"], "max_completion_tokens": 2,
            "max_tokens": 9, "user": "u1", "some_new_openai_field": {"x": 1}}
    assert client.post("/v1/chat/completions", json=body, headers=auth(keys["a"])).status_code == 200
    s = engine.requests[-1].sampling
    assert (s.temperature, s.top_p, s.stop, s.max_tokens) == (0.0, 0.5, ("\n", "END"), 2)


def test_auth_errors(parts):
    client, _, _, _ = parts
    err = assert_openai_error(client.post("/v1/chat/completions", json=CHAT), 401, code="invalid_api_key")
    assert err["type"] == "authentication_error" and "API key" in err["message"]
    assert_openai_error(client.post("/v1/chat/completions", json=CHAT, headers=auth("sk-nope")), 401,
                        code="invalid_api_key")
    assert_openai_error(client.get("/v1/models", headers={"Authorization": "Basic abc"}), 401)


def test_validation_and_malformed_json_use_the_openai_shape(parts):
    client, _, _, keys = parts
    h = auth(keys["a"])
    assert_openai_error(client.post("/v1/chat/completions", json={"model": "tiny"}, headers=h), 400,
                        code="missing_required_parameter", param="messages")
    assert_openai_error(client.post("/v1/chat/completions", json={**CHAT, "temperature": 3}, headers=h), 400,
                        param="temperature")
    assert_openai_error(client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "x"}]}, headers=h),
                        400)
    bad = client.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [',
                      headers={**h, "content-type": "application/json"})
    assert_openai_error(bad, 400, code="invalid_json")
    assert_openai_error(client.post("/v1/chat/completions", content=b"[1, 2]", headers=h), 400, code="invalid_json")
    assert_openai_error(client.post("/v1/chat/completions", json={**CHAT, "top_logprobs": 2}, headers=h), 400,
                        param="top_logprobs")  # logprobs themselves are served (tests/gateway/test_tools_sdk.py)
    assert_openai_error(client.post("/v1/chat/completions", json={**CHAT, "presence_penalty": -3}, headers=h), 400,
                        param="presence_penalty")
    assert_openai_error(client.post("/v1/chat/completions", json={**CHAT, "tool_choice": "required"}, headers=h),
                        400, param="tool_choice")
    assert_openai_error(client.post("/v1/chat/completions", json={**CHAT, "stop": ["a", "b", "c", "d", "e"]},
                                    headers=h), 400, param="stop")
    assert_openai_error(client.get("/v1/nothing-here", headers=h), 404)


def test_unknown_model_is_404(parts):
    client, _, tenancy, keys = parts
    assert_openai_error(client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}, headers=auth(keys["a"])),
                        404, code="model_not_found", param="model")
    assert tenancy.rows[-1].status == "error"  # refused after auth: still one ledger row


def test_context_length_exceeded(parts):
    client, _, _, keys = parts
    err = assert_openai_error(
        client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 250}, headers=auth(keys["a"])),
        400, code="context_length_exceeded")
    assert "maximum context length is 256" in err["message"]
    long_prompt = {"model": "tiny", "prompt": "tok " * 300}
    assert_openai_error(client.post("/v1/completions", json=long_prompt, headers=auth(keys["a"])), 400,
                        code="context_length_exceeded", param="prompt")


def test_default_max_tokens_fits_the_context(parts):
    client, engine, _, keys = parts
    prompt = {"model": "tiny", "prompt": "tok " * 250}
    assert client.post("/v1/completions", json=prompt, headers=auth(keys["a"])).status_code == 200
    assert engine.requests[-1].sampling.max_tokens == 6  # 256 - 250, not the 256 default


def test_rate_limit_and_budget_429(parts):
    client, _, tenancy, keys = parts
    tenancy.quota_error = QuotaExceededError("rate", "Rate limit reached: 10 requests per minute", 2.2)
    resp = client.post("/v1/chat/completions", json=CHAT, headers=auth(keys["a"]))
    assert_openai_error(resp, 429, code="rate_limit_exceeded")
    # rounded up: waiting 2 s would come back 0.2 s early, into another 429
    assert resp.headers["retry-after"] == "3" and "x-should-retry" not in resp.headers
    assert resp.json()["error"]["type"] == "requests"
    tenancy.quota_error = QuotaExceededError("tokens", "Rate limit reached: 1000 tokens per minute", 0.4)
    resp = client.post("/v1/chat/completions", json=CHAT, headers=auth(keys["a"]))
    assert_openai_error(resp, 429, code="rate_limit_exceeded")
    assert resp.json()["error"]["type"] == "tokens" and resp.headers["retry-after"] == "1"  # OpenAI's type
    tenancy.quota_error = QuotaExceededError("budget", "Monthly budget of $5.00 is exhausted", 3600.5)
    resp = client.post("/v1/chat/completions", json=CHAT, headers=auth(keys["a"]))
    assert_openai_error(resp, 429, code="insufficient_quota")
    assert resp.json()["error"]["type"] == "insufficient_quota"
    assert resp.headers["x-should-retry"] == "false" and resp.headers["retry-after"] == "3601"  # the period's end
    tenancy.quota_error = QuotaExceededError("tokens", "This request alone exceeds 1000 tokens per minute", None)
    resp = client.post("/v1/chat/completions", json=CHAT, headers=auth(keys["a"]))
    assert_openai_error(resp, 429, code="rate_limit_exceeded")
    assert resp.headers["x-should-retry"] == "false" and "retry-after" not in resp.headers


def test_body_size_limit_413(parts):
    client, _, _, keys = parts
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 70_000}]}
    assert_openai_error(client.post("/v1/chat/completions", json=big, headers=auth(keys["a"])), 413,
                        code="request_too_large")


def test_engine_errors_map_to_status(parts):
    client, engine, tenancy, keys = parts
    engine.overloaded = True
    resp = client.post("/v1/chat/completions", json=CHAT, headers=auth(keys["a"]))
    assert_openai_error(resp, 503, code="engine_overloaded")
    assert tenancy.rows[-1].status == "error"
    # A stream that fails before its first token gets the real status (issue 17), so SDK retries work,
    # and its ledger row says error.
    rows = len(tenancy.rows)
    stream = client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=auth(keys["a"]))
    assert_openai_error(stream, 503, code="engine_overloaded")
    assert stream.headers["retry-after"] == "1"
    assert len(tenancy.rows) == rows + 1 and tenancy.rows[-1].status == "error"


def test_a_tenants_full_grammar_queue_is_a_429_to_retry_naming_the_schema(parts):
    """The engine refuses a schema when the tenant already has the most compiles waiting
    (``GrammarQueueFullError``): too many in flight, not a bad request, so a 429 rate_limit_error
    with ``Retry-After`` (the openai SDK retries it) that names the field the schema came from,
    whole or streamed."""
    client, engine, _, keys = parts
    engine.refusal = GrammarQueueFullError("too many of your JSON schemas are waiting to compile; retry")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    for stream in (False, True):
        resp = client.post("/v1/chat/completions", json={**body, "stream": stream}, headers=auth(keys["a"]))
        err = assert_openai_error(resp, 429, code="grammar_queue_full", param="response_format")
        assert err["type"] == "rate_limit_error" and resp.headers["retry-after"] == "1"


def test_client_cache_salt_is_ignored(parts):
    client, engine, _, keys = parts
    client.post("/v1/chat/completions", json=CHAT, headers=auth(keys["a"]))
    salted = client.post("/v1/chat/completions", json={**CHAT, "cache_salt": "beta-steal"}, headers=auth(keys["a"]))
    assert salted.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert engine.requests[-1].tenant.namespace == engine.requests[-2].tenant.namespace


def test_models_health_metrics_usage(parts):
    client, _, _, keys = parts
    models = client.get("/v1/models", headers=auth(keys["a"])).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    assert client.get("/v1/models/tiny", headers=auth(keys["a"])).json()["id"] == "tiny"
    assert_openai_error(client.get("/v1/models/nope", headers=auth(keys["a"])), 404, code="model_not_found")
    assert client.get("/health").json()["status"] == "ok"
    client.post("/v1/chat/completions", json=CHAT, headers=auth(keys["a"]))
    text = client.get("/metrics", headers=auth(keys["admin"])).text  # /metrics: admin key or metrics token
    assert 'prefixgate_gateway_requests_total{backend="local",outcome="ok",status="ok",tenant="acme"} 1.0' in text
    assert "prefixgate_gateway_ttft_seconds_bucket" in text
    assert client.get("/v1/usage", headers=auth(keys["a"])).json()["requests"] == 1
    assert_openai_error(client.get("/v1/usage?since=yesterday", headers=auth(keys["a"])), 400, param="since")


def test_dashboard_data_scoped_by_key(parts):
    client, _, _, keys = parts
    client.post("/v1/chat/completions", json=CHAT, headers=auth(keys["a"]))
    client.post("/v1/chat/completions", json=CHAT, headers=auth(keys["a"]))
    client.post("/v1/chat/completions", json=CHAT, headers=auth(keys["b"]))
    page = client.get("/dashboard")
    assert page.status_code == 200 and 'src="dashboard/assets/dashboard.js"' in page.text
    assert "http" not in page.text.split("<script")[1]  # vendored assets only, no CDN
    admin = client.get("/dashboard/data", headers=auth(keys["admin"])).json()
    assert admin["scope"] == "all" and [t["tenant"] for t in admin["tenants"]] == ["acme", "beta"]
    acme = admin["tenants"][0]
    assert acme["requests"] == 2 and 0 < acme["hit_rate"] < 1 and acme["saved_usd"] > 0
    own = client.get("/dashboard/data", headers=auth(keys["b"])).json()
    assert own["scope"] == "own" and [t["tenant"] for t in own["tenants"]] == ["beta"]
    assert_openai_error(client.get("/dashboard/data"), 401)


def test_chat_template_failure_is_a_400(parts):
    client, engine, _, keys = parts

    def refuse(request):
        raise ValueError("Conversation roles must alternate user/assistant/user/assistant")

    engine.tokenize = refuse  # the gateway tokenizes once, through the chat template
    err = assert_openai_error(client.post("/v1/chat/completions", json=CHAT, headers=auth(keys["a"])), 400,
                              param="messages")
    assert "roles must alternate" in err["message"]


def test_prompt_is_tokenized_once_and_ids_go_to_the_engine(parts):
    """Issue 17: the gateway tokenizes (off the loop) and passes ids on; the engine does not tokenize again."""
    client, engine, _, keys = parts
    calls = []
    tokenize = engine.tokenize
    engine.tokenize = lambda request: calls.append(request) or tokenize(request)
    r = client.post("/v1/chat/completions", json={**CHAT, "n": 2}, headers=auth(keys["a"]))
    assert r.status_code == 200, r.text
    assert len(calls) == 1 and calls[0].messages is not None  # one prompt, one tokenization for both choices
    sent = engine.requests[-2:]
    assert all(g.messages is None and list(g.prompt_token_ids) == tokenize(calls[0]) for g in sent)
