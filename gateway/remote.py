"""``RemoteEngineClient``: an ``EngineClient`` for an engine node reached over the internal node API.

See ``gateway.node_wire`` for the wire format. Closing the ``generate`` iterator (client gone)
closes the HTTP stream, which the node sees as a disconnect and aborts the request there.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from engine.protocol import (
    EngineError,
    EngineOverloadedError,
    GenerateRequest,
    ModelCard,
    PromptTooLongError,
    RequestOutput,
)
from gateway.node_wire import output_from_wire, request_to_wire

_BY_CODE: dict[str, type[EngineError]] = {
    PromptTooLongError.code: PromptTooLongError,
    EngineOverloadedError.code: EngineOverloadedError,
}


class NodeUnavailableError(EngineError):
    status = 503
    code = "node_unavailable"


def _error_from_response(status: int, body: bytes) -> EngineError:
    try:
        err = json.loads(body)["error"]
        message, code = str(err.get("message")), err.get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        message, code = body.decode(errors="replace")[:200] or f"node returned HTTP {status}", None
    cls = _BY_CODE.get(code or "")
    if cls is not None:
        return cls(message)
    exc = EngineError(message)
    exc.status = status if status >= 400 else 502
    exc.code = code or "node_error"
    return exc


class RemoteEngineClient:
    """Talks to one node at ``base_url`` with the shared ``token``."""

    def __init__(self, base_url: str, token: str | None, *, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"authorization": f"Bearer {token}"} if token else {}
        self._timeout = httpx.Timeout(timeout_s, connect=5.0)
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=self._timeout)
        self._models: list[ModelCard] = []

    async def refresh_models(self) -> list[ModelCard]:
        """Fetch the node's model cards (``models()`` returns the last fetched list)."""
        resp = await self._http.get("/internal/v1/models")
        resp.raise_for_status()
        self._models = [ModelCard(**c) for c in resp.json()["models"]]
        return self._models

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        try:
            async with self._http.stream("POST", "/internal/v1/generate", json=request_to_wire(request)) as resp:
                if resp.status_code != 200:
                    raise _error_from_response(resp.status_code, await resp.aread())
                async for line in resp.aiter_lines():
                    if line.strip():
                        yield output_from_wire(json.loads(line))
        except httpx.TransportError as exc:
            raise NodeUnavailableError(f"engine node {self.base_url} unreachable: {exc!r}") from exc

    async def abort(self, request_id: str) -> None:
        # Best effort and idempotent: a closed stream aborts the request on the node anyway.
        with contextlib.suppress(httpx.HTTPError):
            await self._http.post("/internal/v1/abort", json={"request_id": request_id})

    async def health(self) -> bool:
        try:
            resp = await self._http.get("/internal/v1/health", timeout=2.0)
            return resp.status_code == 200
        except httpx.HTTPError:
            return False

    async def stats(self) -> dict[str, Any]:
        resp = await self._http.get("/internal/v1/stats")
        resp.raise_for_status()
        return resp.json()

    def models(self) -> list[ModelCard]:
        return list(self._models)

    def count_prompt_tokens(self, request: GenerateRequest) -> int:
        """Blocking round trip to the node's tokenizer (not used on the gateway's hot path)."""
        with httpx.Client(base_url=self.base_url, headers=self._headers, timeout=10.0) as http:
            resp = http.post("/internal/v1/count", json=request_to_wire(request))
        if resp.status_code != 200:
            raise _error_from_response(resp.status_code, resp.content)
        return int(resp.json()["prompt_tokens"])

    def tokenize(self, request: GenerateRequest) -> list[int]:
        raise NotImplementedError("an engine node tokenizes its own requests")

    async def aclose(self) -> None:
        await self._http.aclose()
