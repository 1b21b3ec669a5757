"""The node client and route options against a keyless self-hosted server (issue 20.3).

The server here is a small real HTTP server in vLLM's shape as vLLM answers when started without
`--api-key` and without `--enable-prompt-tokens-details`: it records the headers it is sent and
reports usage with no `prompt_tokens_details`. (vLLM itself is in tests/slow/test_vllm_node.py.)
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from engine.protocol import (
    EngineError,
    GenerateRequest,
    GrammarQueueFullError,
    PrepareQueueFullError,
    SamplingParams,
    StaticTenantScope,
)
from gateway.app import create_app
from gateway.errors import from_engine_error
from gateway.remote import RemoteEngineClient
from gateway.settings import GatewaySettings, RouteConfig
from tenancy.pricing import UNPRICED, PriceBook
from tenancy.report import aggregate, render_table
from tenancy.service import TenancyService
from tests.gateway.gateway_fakes import LoopbackServer


class KeylessServer:
    """vLLM without --api-key / --enable-prompt-tokens-details: no auth, usage without details."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None, dict]] = []  # (path, Authorization header, body)
        self.app = Starlette(routes=[
            Route("/v1/completions", self._completion, methods=["POST"]),
            Route("/v1/chat/completions", self._completion, methods=["POST"]),
            Route("/v1/models", self._models),
            Route("/health", lambda _: JSONResponse({})),
        ])

    async def _models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "served", "max_model_len": 512}]})

    async def _completion(self, request: Request):
        body = await request.json()
        self.calls.append((request.url.path, request.headers.get("authorization"), body))
        chat = request.url.path.endswith("chat/completions")
        usage = {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}
        choice = {"index": 0, "finish_reason": "stop"}
        if not body.get("stream"):
            choice |= {"message": {"role": "assistant", "content": "ok"}} if chat else {"text": "ok"}
            return JSONResponse({"id": "x", "object": "chat.completion" if chat else "text_completion",
                                 "created": 1, "model": body.get("model"), "choices": [choice], "usage": usage})

        def chunk(payload: dict) -> str:
            return f"data: {json.dumps({'id': 'x', 'created': 1, 'model': body.get('model'), **payload})}\n\n"

        async def events():
            delta = {"delta": {"content": "ok"}} if chat else {"text": "ok", "token_ids": [42]}
            yield chunk({"choices": [{"index": 0, "finish_reason": "stop", **delta}]})
            yield chunk({"choices": [], "usage": usage})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture
def keyless():
    server = KeylessServer()
    with LoopbackServer(server.app) as srv:
        yield server, srv.url


def test_node_client_sends_no_authorization_and_sees_cached_tokens_unreported(keyless) -> None:
    server, url = keyless

    async def run() -> list:
        client = RemoteEngineClient(url, None)
        try:
            await client.refresh_models()
            assert client.state.cached_tokens_reported is None
            req = GenerateRequest(request_id="r", tenant=StaticTenantScope(namespace=b"\x01\x02", priority=3),
                                  sampling=SamplingParams(max_tokens=1), prompt_token_ids=[1, 2, 3])
            return [o async for o in client.generate(req)]
        finally:
            await client.aclose()

    outs = asyncio.run(run())
    path, auth, body = server.calls[-1]
    assert path == "/v1/completions" and auth is None  # keyless: no header at all
    assert body["prompt"] == [1, 2, 3] and body["cache_salt"] == "0102" and body["model"] == "served"
    assert "priority" not in body  # vLLM refuses it unless started with priority scheduling
    assert outs[0].new_token_ids == (42,) and outs[-1].finished and outs[-1].prompt_tokens == 7
    assert outs[-1].cached_tokens == 0
    # asked for the usage so far in every chunk; a server that ignores the option (usage at the end
    # only) still works, and until its end the outputs carry the prompt the gateway sent, none cached
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert (outs[0].prompt_tokens, outs[0].cached_tokens) == (3, 0)


def test_a_gateway_says_when_a_node_does_not_report_cached_tokens(keyless, tmp_path) -> None:
    server, url = keyless
    home = tmp_path / "gw"
    svc = TenancyService.open(home)
    key = svc.create_tenant("acme").api_key
    svc.close()
    route = RouteConfig(model="m", nodes=(url,))
    import httpx
    import openai

    with LoopbackServer(create_app(GatewaySettings(home=home, routes=(route,)))) as gw:
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        (node,) = httpx.get(f"{gw.url}/health", trust_env=False).json()["nodes"]
    assert node["cached_tokens"] == "unreported" and node["url"] == url
    assert server.calls[-1][0] == "/v1/chat/completions" and server.calls[-1][1] is None


@pytest.mark.parametrize("transport", ["litellm", "direct"])
def test_a_keyless_self_hosted_provider_route_works(keyless, tmp_path, transport, monkeypatch) -> None:
    """The issue's case: a litellm route to a vLLM started without --api-key failed with 502
    'Missing credentials' (streams: 200 and an in-band error)."""
    import openai

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    server, url = keyless
    home = tmp_path / "gw"
    svc = TenancyService.open(home)
    key = svc.create_tenant("acme").api_key
    svc.close()
    route = RouteConfig(model="m", provider="openai/served", api_base=f"{url}/v1", transport=transport,
                        max_model_len=512)
    with LoopbackServer(create_app(GatewaySettings(home=home, routes=(route,)))) as gw:
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
        whole = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        assert whole.choices[0].message.content == "ok"
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1, stream=True) if c.choices)
        assert streamed == "ok"
    auths = {auth for _, auth, _ in server.calls}
    # direct sends nothing; litellm's OpenAI client will not send a request without a key, so it
    # sends vLLM's documented placeholder, which a server without --api-key ignores
    assert auths == ({None} if transport == "direct" else {"Bearer EMPTY"})


def test_unpriced_is_tokens_and_no_money() -> None:
    book = PriceBook()
    p = book.price(UNPRICED, 100, 60, 10)
    assert (p.cost_usd, p.saved_usd, p.priced_as) == (0.0, 0.0, "unpriced")
    assert book.price("gpt-4o", 100, 60, 10).cost_usd > 0  # a priced route is unchanged
    now = datetime.now(UTC)
    row = {"tenant": "acme", "tenant_id": "t1", "status": "ok", "prompt_tokens": 100, "cached_tokens": 60,
           "completion_tokens": 10, "ttft_s": 0.1, "created_at": now.timestamp()}
    rows = [{**row, "model": "self", "cost_usd": 0.0, "saved_usd": 0.0, "priced_as": "unpriced"},
            {**row, "model": "gpt-4o", "cost_usd": 0.5, "saved_usd": 0.25, "priced_as": "gpt-4o"}]
    rep = aggregate(rows, tenant_ids=None, since=None, until=now + timedelta(seconds=1))
    by_model = {r["model"]: r for r in rep["rows"]}
    assert by_model["self"]["cost_usd"] is None and by_model["self"]["prompt_tokens"] == 100
    assert by_model["gpt-4o"]["cost_usd"] == 0.5 and rep["totals"]["cost_usd"] == 0.5
    line = next(x for x in render_table(rep).splitlines() if x.lstrip().startswith("acme") and "self" in x)
    assert " - " in line and "unpriced" in line


def test_only_a_prefixgate_node_gets_the_tenant_key_and_the_node_counts_by_it() -> None:
    """A node's quotas and fairness go by the sending gateway's tenant key (one per tenant, whatever
    its share scope), not by ``cache_salt``; vLLM never sees the field."""
    from gateway.remote import request_body
    from gateway.routes.internal import NodeCompletionBody

    tenant = StaticTenantScope(namespace=b"\x01\x02", tenant_key=b"\xab" * 4)
    req = GenerateRequest(request_id="r", tenant=tenant, sampling=SamplingParams(max_tokens=1), prompt_token_ids=[1])
    _, to_vllm = request_body(req, "m")
    _, to_node = request_body(req, "m", prefixgate_node=True)
    assert "prefixgate_tenant" not in to_vllm and to_node["prefixgate_tenant"] == "abababab"
    scope = NodeCompletionBody.model_validate({"prompt": [1], **to_node}).scope()
    assert scope.namespace == b"\x01\x02" and scope.tenant_key == b"\xab" * 4
    # a gateway that sends no key (an older one): one tenant per namespace, as before
    plain = NodeCompletionBody.model_validate({"prompt": [1], "cache_salt": "0102"}).scope()
    assert plain.tenant_key == plain.namespace == b"\x01\x02"


def test_penalties_and_vllm_extras_reach_a_node_and_come_back_as_the_same_sampling() -> None:
    """presence / frequency penalties cross to vLLM and PrefixGate nodes under OpenAI's names; a zero
    penalty is not sent (vLLM's default is the same), and the node rebuilds the sampling it was sent."""
    from gateway.remote import request_body
    from gateway.routes.internal import NodeCompletionBody

    sampling = SamplingParams(max_tokens=3, temperature=0.0, presence_penalty=0.5, frequency_penalty=-1.25,
                              repetition_penalty=1.1, min_p=0.05, min_tokens=2)
    req = GenerateRequest(request_id="r", tenant=StaticTenantScope(), sampling=sampling, prompt_token_ids=[1])
    _, to_vllm = request_body(req, "m")
    assert to_vllm["presence_penalty"] == 0.5 and to_vllm["frequency_penalty"] == -1.25
    assert (to_vllm["repetition_penalty"], to_vllm["min_p"], to_vllm["min_tokens"]) == (1.1, 0.05, 2)
    _, to_node = request_body(req, "m", prefixgate_node=True)
    assert NodeCompletionBody.model_validate({"prompt": [1], **to_node}).sampling() == sampling
    plain = GenerateRequest(request_id="p", tenant=StaticTenantScope(), sampling=SamplingParams(), prompt_token_ids=[1])
    sent = request_body(plain, "m")[1]
    assert not {"presence_penalty", "repetition_penalty", "min_p", "min_tokens"} & set(sent)


@pytest.mark.parametrize("error", [GrammarQueueFullError, PrepareQueueFullError])
def test_a_nodes_full_tenant_queue_comes_back_as_a_429_with_its_retry_hint(error: type[EngineError]) -> None:
    """A PrefixGate node refuses a schema when its tenant has the most grammar compiles waiting, and
    a request when its tenant has the most waiting to be prepared (tokenized): a 429
    (``grammar_queue_full``, ``prepare_queue_full``) with ``Retry-After``. The gateway in front must
    answer its client the same (it once rebuilt an anonymous error: the 429 without the retry hint)."""
    refusal = from_engine_error(error("too many of your requests are waiting; retry"))
    node = Starlette(routes=[Route("/v1/completions", lambda _: refusal.response(), methods=["POST"])])

    async def run() -> None:
        client = RemoteEngineClient(url, None)
        try:
            req = GenerateRequest(request_id="r", tenant=StaticTenantScope(), prompt_token_ids=[1, 2, 3],
                                  sampling=SamplingParams(max_tokens=1))
            [o async for o in client.generate(req)]
        finally:
            await client.aclose()

    with LoopbackServer(node) as srv:
        url = srv.url
        with pytest.raises(error) as info:
            asyncio.run(run())
    answer = from_engine_error(info.value)
    assert (answer.status, answer.code, answer.headers) == (429, error.code, {"retry-after": "1"})
