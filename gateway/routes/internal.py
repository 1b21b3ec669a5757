"""The engine-node API: this process's engine behind the OpenAI-compatible API that vLLM speaks.

Enabled only when the process has a node token (``settings.node_token``). A request that carries
it as its Bearer token (compared in constant time) on one of these paths is a node call from a
gateway; every other request goes on to the public, tenant-authenticated API unchanged::

    POST /v1/completions        prompt = token ids or text, cache_salt = the tenant namespace (hex)
    POST /v1/chat/completions   messages (+ tools), cache_salt as above
                                stream_options: {"include_usage", "continuous_usage_stats"} as vLLM
    GET  /v1/models             {"object": "list", "data": [{"id", "max_model_len", ...}]}
    POST /internal/v1/drain     {"draining": true|false} -> {"draining", "inflight"}   (default true)
    GET  /internal/v1/stats     the engine's stats (running, waiting, KV blocks...)
    GET  /health                503 {"status": "draining"} while draining (anyone may probe it)

A node call is not a tenant's request: no quotas, no ledger row (the calling gateway records it),
no spill of the request's blocks to lower tiers (the node holds no tenant data key). The tenant is
only its namespace: ``cache_salt`` as hex bytes (what gateways send), or the salt's UTF-8 bytes
for any other string, as vLLM treats it as opaque. Draining (``POST /internal/v1/drain`` or
SIGUSR1): new node calls get 503 ``node_draining`` (a gateway retries them on another node),
calls in flight finish, ``/health`` answers 503 so that probes take the node out of rotation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import json
import signal
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import State
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.protocol import (
    EngineClient,
    EngineError,
    GenerateRequest,
    RequestOutput,
    SamplingParams,
    StaticTenantScope,
)
from gateway.deps import EngineDep, SettingsDep, bearer_key
from gateway.errors import OpenAIError, from_engine_error
from gateway.ingress import effective_temperature

NODE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/internal/v1/drain",
                        "/internal/v1/stats"})
UNSALTED_NAMESPACE = b"prefixgate-node-unsalted"  # vLLM shares blocks of unsalted requests; so do we


async def require_node(settings: SettingsDep, engine: EngineDep,
                       authorization: Annotated[str | None, Header()] = None) -> EngineClient:
    """The node-token check for ``/internal/v1/*`` routers (the split topology's KV calls use it)."""
    if not settings.node_token:
        raise OpenAIError(404, "Unknown URL.", code="not_found")
    key = bearer_key(authorization) or ""
    if not hmac.compare_digest(key.encode(), settings.node_token.encode()):
        raise OpenAIError(401, "invalid node token", code="invalid_node_token", type="authentication_error")
    if engine is None:
        raise OpenAIError(503, "this process has no local engine", code="no_engine")
    return engine


NodeEngine = Annotated[EngineClient, Depends(require_node)]


@dataclass
class NodeDrain:
    """Whether this node takes new node calls, and how many are in flight."""

    draining: bool = False
    inflight: int = 0


class StreamOptions(BaseModel):
    """vLLM's ``stream_options``: ``include_usage`` adds a usage chunk at the end;
    ``continuous_usage_stats`` (with ``include_usage``, as in vLLM) also puts the usage so far in
    every chunk, so a caller whose stream ends early (aborted, failed) still knows the prompt and
    cached tokens the prefill counted. Off by default: OpenAI clients do not expect it."""

    include_usage: bool = False
    continuous_usage_stats: bool = False

    @property
    def continuous(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


class _NodeBody(BaseModel):
    """The sampling fields both OpenAI-compatible calls share (vLLM's names for its extensions)."""

    model_config = ConfigDict(extra="ignore")  # like vLLM: unknown fields are ignored, not refused

    model: str | None = None
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0)
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=512)
    # the sending gateway's opaque tenant key (hex): quotas and fairness per tenant, not per namespace
    prefixgate_tenant: str | None = Field(None, min_length=2, max_length=128, pattern=r"^(?:[0-9a-fA-F]{2})+$")
    priority: int = 0
    return_token_ids: bool = False

    def sampling(self) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=self.max_tokens, temperature=effective_temperature(self.temperature), top_p=self.top_p,
            top_k=max(self.top_k, 0), seed=self.seed, stop=stop, stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            logit_bias=tuple((int(t), float(b)) for t, b in (self.logit_bias or {}).items()),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, min_p=self.min_p, min_tokens=self.min_tokens)

    def scope(self) -> StaticTenantScope:
        key = bytes.fromhex(self.prefixgate_tenant) if self.prefixgate_tenant else b""  # b"": the namespace
        return StaticTenantScope(namespace=namespace_of(self.cache_salt), metrics_label="remote", cipher=None,
                                 priority=self.priority, tenant_key=key)


NodeBodyT = TypeVar("NodeBodyT", bound=_NodeBody)


class NodeCompletionBody(_NodeBody):
    prompt: list[int] | str = Field(min_length=1)


class NodeChatBody(_NodeBody):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None


def namespace_of(cache_salt: str | None) -> bytes:
    """The engine namespace for a ``cache_salt``: hex as bytes (a gateway's namespace), else UTF-8."""
    if cache_salt is None:
        return UNSALTED_NAMESPACE
    try:
        return bytes.fromhex(cache_salt)
    except ValueError:
        return cache_salt.encode()


def _usage(out: RequestOutput) -> dict[str, Any]:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


class _Shape:
    """The OpenAI response shape of one call: text completion or chat completion."""

    def __init__(self, chat: bool, model: str, token_ids: bool) -> None:
        self.chat, self.model, self.token_ids = chat, model, token_ids
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": kind + (".chunk" if chunk and self.chat else ""),
                "created": self.created, "model": self.model}

    def delta(self, text: str, ids: tuple[int, ...], finish: str | None,
              usage_so_far: RequestOutput | None = None) -> dict[str, Any]:
        """One stream chunk; ``usage_so_far``: the output whose counts the chunk carries as its
        ``usage`` (continuous usage stats), None for none (the field is left out, as vLLM does)."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if self.chat:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice.update(text=text, logprobs=None)
        if self.token_ids:
            choice["token_ids"] = list(ids)
        chunk = {**self._head(True), "choices": [choice]}
        if usage_so_far is not None:
            chunk["usage"] = _usage(usage_so_far)
        return chunk

    def usage_chunk(self, last: RequestOutput) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": _usage(last)}

    def whole(self, text: str, ids: list[int], last: RequestOutput) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish_reason or "stop"}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None)
        if self.token_ids:
            choice["token_ids"] = ids
        return {**self._head(False), "choices": [choice], "usage": _usage(last)}


def _sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def build_node_app(state: State) -> FastAPI:
    """The node API as an app of its own, over the main app's ``state`` (settings, engine, drain)."""
    node = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @node.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @node.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return OpenAIError(400, f"malformed node request: {exc.errors()[0].get('msg')}",
                           code="invalid_node_request").response()

    def engine() -> EngineClient:
        if state.engine is None:
            raise OpenAIError(503, "this process has no local engine", code="no_engine")
        return state.engine

    async def parse(request: Request, model: type[NodeBodyT]) -> NodeBodyT:
        try:
            return model.model_validate(await request.json())
        except (ValueError, ValidationError) as exc:  # malformed JSON is a ValueError too
            first = exc.errors()[0] if isinstance(exc, ValidationError) else {"msg": str(exc), "loc": ()}
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise OpenAIError(400, f"malformed node request: {where} {first['msg']}".replace("  ", " "),
                              code="invalid_node_request") from None

    async def run(body: _NodeBody, gr: GenerateRequest, chat: bool) -> Response:
        drain: NodeDrain = state.node_drain
        if drain.draining:
            raise OpenAIError(503, "this engine node is draining; send the request to another node",
                              code="node_draining", headers={"retry-after": "1"})
        eng = engine()
        shape = _Shape(chat, body.model or gr.model or "", body.return_token_ids)
        drain.inflight += 1
        stream = eng.generate(gr)
        # Pull the first output before answering, so that errors raised at admission (prompt too long,
        # overloaded) travel as an HTTP status with their code rather than inside a 200 stream.
        try:
            first = await anext(stream)
        except EngineError as exc:
            drain.inflight -= 1
            return from_engine_error(exc).response()
        except StopAsyncIteration:
            drain.inflight -= 1
            return OpenAIError(500, "engine produced no output", code="engine_error").response()
        except BaseException:
            drain.inflight -= 1
            raise

        async def outputs() -> AsyncGenerator[RequestOutput, None]:
            try:
                yield first
                async for out in stream:
                    yield out
            finally:
                drain.inflight -= 1
                await stream.aclose()  # a gone gateway aborts the request here

        if body.stream:
            options = body.stream_options or StreamOptions()

            async def chunks() -> AsyncIterator[bytes]:
                # aclosing: a gateway gone mid-stream closes this generator, and that must reach the
                # engine's stream now (its abort), not whenever the inner generator is collected.
                async with contextlib.aclosing(outputs()) as outs:
                    async for out in outs:
                        if out.new_text or out.new_token_ids or out.finished:
                            yield _sse(shape.delta(out.new_text, out.new_token_ids,
                                                   (out.finish_reason or "stop") if out.finished else None,
                                                   out if options.continuous else None))
                        if out.finished and options.include_usage:
                            yield _sse(shape.usage_chunk(out))
                yield b"data: [DONE]\n\n"

            return StreamingResponse(chunks(), media_type="text/event-stream")
        text: list[str] = []
        ids: list[int] = []
        last = first
        async with contextlib.aclosing(outputs()) as outs:
            async for out in outs:
                text.append(out.new_text)
                ids.extend(out.new_token_ids)
                last = out
        return JSONResponse(shape.whole("".join(text), ids, last))

    def model_name(body: _NodeBody) -> str | None:
        return body.model if body.model and any(c.id == body.model for c in engine().models()) else None

    @node.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: NodeCompletionBody = await parse(request, NodeCompletionBody)
        prompt = {"prompt": body.prompt} if isinstance(body.prompt, str) else {"prompt_token_ids": body.prompt}
        try:
            gr = GenerateRequest(request_id="node-" + uuid.uuid4().hex, tenant=body.scope(), sampling=body.sampling(),
                                 model=model_name(body), **prompt)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), code="invalid_node_request") from None
        return await run(body, gr, chat=False)

    @node.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body: NodeChatBody = await parse(request, NodeChatBody)
        try:
            gr = GenerateRequest(request_id="node-" + uuid.uuid4().hex, tenant=body.scope(), sampling=body.sampling(),
                                 model=model_name(body), messages=body.messages, tools=body.tools)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), code="invalid_node_request") from None
        return await run(body, gr, chat=True)

    @node.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": c.id, "object": "model", "created": state.started_at, "owned_by": c.owned_by,
             "max_model_len": c.max_model_len} for c in engine().models()]}

    @node.get("/internal/v1/stats")
    async def stats() -> dict[str, Any]:
        return await engine().stats()

    @node.post("/internal/v1/drain")
    async def drain(request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            want = json.loads(raw).get("draining", True) if raw.strip() else True
        except (ValueError, AttributeError):
            want = None
        if not isinstance(want, bool):
            raise OpenAIError(400, 'the body must be empty or {"draining": true|false}', code="invalid_node_request")
        state.node_drain.draining = want
        return dataclasses.asdict(state.node_drain)

    return node


def _token_of(scope: Scope) -> str | None:
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            return bearer_key(value.decode("latin-1"))
    return None


class NodeApiMiddleware:
    """Sends node calls (node token + node path) to the node app, and answers ``/health`` while
    draining; everything else reaches the public API untouched."""

    def __init__(self, app: ASGIApp, state: State) -> None:
        self.app = app
        self.state = state
        self.node = build_node_app(state)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = self.state.settings.node_token
        if scope["type"] == "http" and token:
            path = scope["path"]
            if path == "/health" and self.state.node_drain.draining:
                response = JSONResponse({"status": "draining", "inflight": self.state.node_drain.inflight},
                                        status_code=503)
                return await response(scope, receive, send)
            if path in NODE_PATHS:
                given = _token_of(scope) or ""
                if hmac.compare_digest(given.encode(), token.encode()):
                    return await self.node(scope, receive, send)
        await self.app(scope, receive, send)


def install_drain_signal(state: State) -> None:
    """SIGUSR1 starts draining (systemd ``ExecReload``, a Kubernetes preStop hook): no new node
    calls, in-flight ones finish. Only where the loop can take signal handlers (main thread, POSIX)."""
    import asyncio

    if not state.settings.node_token:
        return
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError, AttributeError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, _start_draining, state)


def _start_draining(state: State) -> None:
    state.node_drain.draining = True
