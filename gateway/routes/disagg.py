"""The split topology's node calls (``/internal/v1/kv/*``), beside the node API and behind its token.

    POST /internal/v1/kv/lookup    {request}                -> {"prompt_tokens", "cached_tokens", "running", "waiting",
                                                                "receiver": "host:port" | ""}
    POST /internal/v1/kv/prefill   {"request", "address", "skip_tokens"?} -> HandoffReport as JSON (prefill role only)
    GET  /internal/v1/kv/receiver                           -> {"address": "host:port" | null}
    GET  /internal/v1/kv/integrity                          -> {"ok", "error", "kv_blocks_used"}

A process whose engine has no split role answers 404 ``no_kv_role``.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from engine.disagg.api import KVHandoff
from engine.disagg.request_wire import request_from_wire
from engine.protocol import EngineClient, EngineError
from gateway.errors import OpenAIError, from_engine_error
from gateway.routes.internal import require_node

router = APIRouter(prefix="/internal/v1/kv", tags=["internal"])


async def require_handoff(engine: Annotated[EngineClient, Depends(require_node)]) -> KVHandoff:
    if not isinstance(engine, KVHandoff):
        raise OpenAIError(404, "this node has no prefill/decode role (serve --role prefill|decode)", code="no_kv_role")
    return engine


Handoff = Annotated[KVHandoff, Depends(require_handoff)]


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise OpenAIError(400, "malformed node request: not JSON", code="invalid_node_request") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "malformed node request: not an object", code="invalid_node_request")
    return body


def _wire(d: Any) -> Any:
    try:
        return request_from_wire(d)
    except (ValueError, KeyError, TypeError) as exc:
        raise OpenAIError(400, f"malformed node request: {exc}", code="invalid_node_request") from None


@router.post("/lookup")
async def lookup(request: Request, node: Handoff) -> Any:
    gr = _wire(await _body(request))
    try:
        return dataclasses.asdict(await node.lookup(gr))
    except EngineError as exc:
        return from_engine_error(exc).response()


@router.post("/prefill")
async def prefill(request: Request, node: Handoff) -> Any:
    body = await _body(request)
    gr = _wire(body.get("request"))
    address = body.get("address")
    if not isinstance(address, str) or ":" not in address:
        raise OpenAIError(400, "`address` must be the decode node's KV receiver as host:port", code="invalid_node_request")
    skip = body.get("skip_tokens", 0)
    if not isinstance(skip, int) or isinstance(skip, bool) or skip < 0:
        raise OpenAIError(400, "`skip_tokens` must be a non-negative integer", code="invalid_node_request")
    try:
        report = await node.prefill_and_send(gr, address, skip)
    except EngineError as exc:
        return from_engine_error(exc).response()
    out = dataclasses.asdict(report)
    out["transfer"]["status"] = report.transfer.status.value
    return out


@router.get("/receiver")
async def receiver(node: Handoff) -> dict[str, Any]:
    return {"address": node.receiver_address()}


@router.get("/integrity")
async def integrity(node: Handoff) -> dict[str, Any]:
    error = await node.check_integrity()
    stats = await node.stats()
    return {"ok": not error, "error": error, "kv_blocks_used": stats.get("kv_blocks_used")}
