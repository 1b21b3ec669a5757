"""The internal node API (``/internal/v1/*``): lets other gateways use this process's engine.

Enabled only when the process has a node token (``settings.node_token``); every call must carry
it as a Bearer token (compared in constant time). Wire format: ``gateway.node_wire``.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.protocol import EngineClient, EngineError
from gateway.deps import EngineDep, SettingsDep, bearer_key
from gateway.errors import OpenAIError, from_engine_error
from gateway.ingress import effective_temperature
from gateway.node_wire import output_to_wire, request_from_wire

router = APIRouter(prefix="/internal/v1", tags=["internal"])


async def require_node(settings: SettingsDep, engine: EngineDep,
                 authorization: Annotated[str | None, Header()] = None) -> EngineClient:
    if not settings.node_token:
        raise OpenAIError(404, "Unknown URL.", code="not_found")
    key = bearer_key(authorization) or ""
    if not hmac.compare_digest(key.encode(), settings.node_token.encode()):
        raise OpenAIError(401, "invalid node token", code="invalid_node_token", type="authentication_error")
    if engine is None:
        raise OpenAIError(503, "this process has no local engine", code="no_engine")
    return engine


NodeEngine = Annotated[EngineClient, Depends(require_node)]


async def _wire_request(request: Request) -> Any:
    try:
        gr = request_from_wire(await request.json())
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise OpenAIError(400, f"malformed node request: {exc}", code="invalid_node_request") from None
    # The same sampling bound as the public API: a node is reached by gateways, not only ours.
    temperature = effective_temperature(gr.sampling.temperature)
    if temperature != gr.sampling.temperature:
        gr = dataclasses.replace(gr, sampling=dataclasses.replace(gr.sampling, temperature=temperature))
    return gr


@router.post("/generate")
async def generate(request: Request, engine: NodeEngine) -> Any:
    gr = await _wire_request(request)
    stream = engine.generate(gr)
    # Pull the first output before answering, so that errors raised at admission (prompt too long,
    # overloaded) travel as an HTTP status with their code rather than inside a 200 stream.
    try:
        first = await anext(stream)
    except EngineError as exc:
        return from_engine_error(exc).response()
    except StopAsyncIteration:
        return OpenAIError(500, "engine produced no output", code="engine_error").response()

    async def lines() -> AsyncIterator[bytes]:
        try:
            yield (json.dumps(output_to_wire(first)) + "\n").encode()
            async for out in stream:
                yield (json.dumps(output_to_wire(out)) + "\n").encode()
        finally:
            await stream.aclose()  # a gone gateway aborts the request here

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@router.post("/abort")
async def abort(request: Request, engine: NodeEngine) -> dict[str, bool]:
    try:
        body = await request.json()
    except ValueError:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        body = None
    request_id = body.get("request_id") if isinstance(body, dict) else None
    if not isinstance(request_id, str) or not request_id:
        raise OpenAIError(400, 'the body must be a JSON object {"request_id": "<id>"}', code="invalid_node_request")
    await engine.abort(request_id)
    return {"ok": True}


@router.post("/count")
async def count(request: Request, engine: NodeEngine) -> dict[str, int]:
    gr = await _wire_request(request)
    # Tokenizing can take seconds: in a thread, as for the public API (issue 16.2).
    return {"prompt_tokens": await anyio.to_thread.run_sync(engine.count_prompt_tokens, gr)}


@router.get("/health")
async def health(engine: NodeEngine) -> JSONResponse:
    ok = await engine.health()
    return JSONResponse({"ok": ok}, status_code=200 if ok else 503)


@router.get("/stats")
async def stats(engine: NodeEngine) -> dict[str, Any]:
    return await engine.stats()


@router.get("/models")
async def models(engine: NodeEngine) -> dict[str, Any]:
    return {"models": [{"id": c.id, "max_model_len": c.max_model_len, "owned_by": c.owned_by}
                       for c in engine.models()]}
