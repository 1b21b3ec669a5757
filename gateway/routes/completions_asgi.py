"""``POST /v1/chat/completions`` and ``POST /v1/completions`` as raw ASGI, in front of FastAPI.

The two routes that carry the traffic skip FastAPI's routing and dependency solving (~400 Python
calls a request, a third of what the gateway itself added in front of a loopback upstream;
benchmarks/gateway.py profile). They run the very same ``completions.handle`` as the FastAPI
routes, so auth, quotas, admission, canonicalization, routing, the status line held until the
first token or the error, usage, ledger and miss tracking are one implementation::

    BodySizeLimit -> NodeApiMiddleware -> CompletionRoutes -+-> handle()        (a valid body)
                                                            +-> a door's handler (a body over 64 KiB)
                                                            +-> FastAPI app     (everything else)

What this path does not answer goes to the FastAPI app unchanged, the body replayed: another
method or path, a body that is not JSON (or not sent as JSON), a small body the schema refuses (so
that its 400, and the refused-request accounting that follows authentication, stay FastAPI's), a
small body of the other doors, and apps whose tests override dependencies (``app.dependency_overrides``).

Authentication comes first, before the body is read, here and for every path that does costly
work (``AUTH_FIRST_PATHS``: the Responses and Messages doors and cache warming too, which FastAPI
serves): the key is in the headers, so a client without a valid key gets its 401 without the
server parsing a byte of its body (a 4 MB token-id body used to cost 0.4 s of event loop before
its 401). A body over ``OFF_LOOP_BYTES`` is then validated in the tenant's worker thread
(``TenantThreads``), not on the event loop, on every one of these paths: only an authenticated
tenant gets there, and it holds at most its share of the pool. Such a body is answered here
whatever it holds: served through the door's own handler (the very function FastAPI calls), or
refused with the 400 FastAPI would give, counted by the same hook (``errors.refused_body``); handing
it to FastAPI would have parsed it again, on the event loop. The token-id bound is decided on its
raw bytes first (``ingress.excess_token_ids``): 2 M ids are never decoded to be counted.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Generic, TypeVar

from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError
from starlette.datastructures import State
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.protocol import EngineError
from gateway.anthropic_api import CountTokensRequest, MessagesRequest
from gateway.deps import authenticate_bearer
from gateway.errors import OpenAIError, from_engine_error, refused_body, render
from gateway.ingress import excess_token_ids
from gateway.ports import TenancyError, TenancyPort, TenantCtx, tenancy_error
from gateway.responses_api import ResponsesRequest
from gateway.routes.cache import WarmRequest, warm
from gateway.routes.completions import Parts, handle
from gateway.routes.messages import anthropic_tenant, count_tokens, create_message
from gateway.routes.responses import create_response
from gateway.schemas import ChatCompletionRequest, CompletionRequest

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class _Door(Generic[M]):
    """A POST path whose body costs work to parse: its schema, and the handler that serves a body
    validated here (the route's own function: FastAPI calls the same one)."""

    schema: type[M]
    serve: Callable[[M, Request, TenantCtx, Parts], Awaitable[object]]
    every_size: bool = False  # served here at any size (the completion routes); else only bodies over OFF_LOOP_BYTES


async def _completion(kind: str, body: ChatCompletionRequest | CompletionRequest, request: Request,
                      ctx: TenantCtx, parts: Parts) -> Response:
    return await handle(kind, body, ctx, parts, request.receive)


async def _count_tokens(body: CountTokensRequest, request: Request, ctx: TenantCtx, parts: Parts) -> object:
    return await count_tokens(body, ctx, parts)


async def _warm(body: WarmRequest, request: Request, ctx: TenantCtx, parts: Parts) -> object:
    return await warm(body, ctx, parts)


# (each door has its own schema type: the registry holds them side by side)
_DOORS: dict[str, _Door] = {
    "/v1/chat/completions": _Door(ChatCompletionRequest, partial(_completion, "chat"), every_size=True),
    "/v1/completions": _Door(CompletionRequest, partial(_completion, "completion"), every_size=True),
    "/v1/responses": _Door(ResponsesRequest, create_response),
    "/v1/messages": _Door(MessagesRequest, create_message),
    "/v1/messages/count_tokens": _Door(CountTokensRequest, _count_tokens),
    "/v1/cache/warm": _Door(WarmRequest, _warm),
}

# Every POST path whose body costs work to parse: authenticated before its body is read.
AUTH_FIRST_PATHS = frozenset(_DOORS)
# Bodies larger than this are validated in a worker thread: below it the parse costs less than the
# thread hop (~1 ms at 64 KiB), above it up to ~0.5 s (4 MiB of many small strings).
OFF_LOOP_BYTES = 64 * 1024


def replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands out ``body`` (already read) as one message, then the real ones."""
    pending = True

    async def again() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body (``BodySizeLimit`` bounds it), or None if the client left first."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _is_json(content_type: bytes | None) -> bool:
    """What FastAPI parses as JSON: no content type, ``application/json`` or ``application/*+json``
    (anything else it hands to the schema as bytes, which refuses them)."""
    if content_type is None:
        return True
    maintype, _, subtype = content_type.split(b";", 1)[0].strip().lower().partition(b"/")
    return maintype == b"application" and (subtype == b"json" or subtype.endswith(b"+json"))


def _validated(schema: type[M], body: bytes) -> M | None:
    """``body`` parsed and validated in one pass of pydantic's JSON parser (not ``json.loads`` and
    then the model), or None for FastAPI to answer.

    Whatever this parser refuses but ``json.loads`` would take (a UTF-8 BOM, UTF-16, a lone
    surrogate escape, which the scan refuses anyway) goes to FastAPI too, which parses it with
    ``json.loads`` and validates it as before: the answer is the same, only slower.
    """
    if not body:
        return None
    try:
        return schema.model_validate_json(body)
    except ValidationError:  # jiter's own depth limit included
        return None


def validated_or_refused(schema: type[M], body: bytes) -> M:
    """A large ``body`` validated as FastAPI would, without FastAPI (it runs in a worker thread).

    Raises ``RequestValidationError`` carrying the errors FastAPI would have raised (locations
    under ``body``), or ``OpenAIError`` where FastAPI answers a 400 of its own (a body ``json.loads``
    cannot even start on). The token-id bound comes first, on the raw bytes; then pydantic's JSON
    parser, one pass for a valid body; only a body it refuses is parsed again as FastAPI parses it
    (``json.loads``, then the model), so that the answer is FastAPI's to the letter: its errors'
    wording differs from the JSON parser's ("a valid list", not "a valid array"), and it takes what
    only ``json.loads`` takes (a BOM or UTF-16 is served, a lone surrogate gets the scan's 400).
    """
    excess = excess_token_ids(body)
    if excess is not None:
        raise RequestValidationError([_error_of(excess)])
    try:
        return schema.model_validate_json(body)
    except ValidationError as exc:
        if exc.errors()[0]["type"] == "body_limit":  # the scan's own words, whichever parser: not parsed twice
            raise RequestValidationError(under_body(exc)) from None
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:  # FastAPI's own error for it (fastapi.routing)
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": exc.msg}}]) from None
    except Exception:  # noqa: BLE001 - not UTF-8, nested past the recursion limit: FastAPI's plain 400
        raise OpenAIError(400, "There was an error parsing the body") from None
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(under_body(exc)) from None


def under_body(exc: ValidationError) -> list[dict[str, object]]:
    """pydantic's errors as FastAPI reports a body's: each location starts with ``body``."""
    return [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]


def _error_of(refusal: PydanticCustomError) -> dict[str, object]:
    """A refusal raised before validation, as the error the schema's own validator would report."""
    return {"type": refusal.type, "loc": ("body",), "msg": refusal.message(), "input": None,
            "ctx": refusal.context}


class CompletionRoutes:
    """ASGI middleware: authenticates the costly POST paths before their body is read, serves the
    completion routes itself, validates and serves every door's large body off the event loop, hands
    everything else to ``app``."""

    def __init__(self, app: ASGIApp, state: State, overrides: Mapping[Callable[..., object], object]) -> None:
        self.app = app
        self.state = state
        self.overrides = overrides  # the FastAPI app's dependency_overrides (a live dict)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tenancy: TenancyPort | None = self.state.tenancy
        if (scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in AUTH_FIRST_PATHS
                or self.overrides or tenancy is None):  # no tenancy: FastAPI answers its 503
            await self.app(scope, receive, send)
            return
        headers = _Headers.of(scope)
        try:
            ctx = await self._authenticate(scope, tenancy, headers)
        except OpenAIError as err:  # the door's own error shape (Anthropic's on /v1/messages)
            await render(Request(scope), err)(scope, receive, send)
            return
        except TenancyError as exc:
            await render(Request(scope), tenancy_error(exc))(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:  # the client went away before its body arrived
            return
        door = _DOORS[scope["path"]]
        request = Request(scope, receive)
        request.state.tenant = ctx  # as the FastAPI dependency leaves it: a refused body is counted for it
        is_json = _is_json(headers.content_type)
        if is_json and len(body) > OFF_LOOP_BYTES:
            await self._serve_large(door, body, request, ctx, tenancy, send)
            return
        parsed = _validated(door.schema, body) if is_json and door.every_size else None
        if parsed is None:  # FastAPI answers it: a small body of another door, or a small refused one
            await self.app(scope, replaying(body, receive), send)
            return
        await self._serve(door, parsed, request, ctx, tenancy, send)

    async def _authenticate(self, scope: Scope, tenancy: TenancyPort, headers: _Headers) -> TenantCtx:
        """The caller's tenant, from its headers alone. Raises ``OpenAIError`` (401)."""
        if scope["path"].startswith("/v1/messages"):  # Anthropic's SDK sends x-api-key
            return await anthropic_tenant(Request(scope), tenancy, headers.x_api_key, headers.authorization)
        return authenticate_bearer(tenancy, headers.authorization, self.state.metrics)

    async def _serve_large(self, door: _Door, body: bytes, request: Request, ctx: TenantCtx,
                           tenancy: TenancyPort, send: Send) -> None:
        """A body over OFF_LOOP_BYTES: validated in the tenant's worker thread, then served or refused here."""
        try:
            parsed = await self.state.tenant_threads.run(ctx.tenant_id, validated_or_refused, door.schema, body)
        except RequestValidationError as exc:  # its 400, counted as FastAPI's handler counts it
            await refused_body(request, exc, self.state.on_invalid_body)(request.scope, request.receive, send)
            return
        except OpenAIError as err:  # FastAPI's plain 400, or the pool's 429 (too many of the tenant's waiting)
            hook = self.state.on_invalid_body
            if hook is not None:  # a refused request after authentication: its ledger row and counts
                hook(request, err)
            await render(request, err)(request.scope, request.receive, send)
            return
        await self._serve(door, parsed, request, ctx, tenancy, send)

    async def _serve(self, door: _Door, parsed: BaseModel, request: Request, ctx: TenantCtx, tenancy: TenancyPort,
                     send: Send) -> None:
        """The door's handler on a validated body; its errors rendered as FastAPI's handlers render them."""
        try:
            result = await door.serve(parsed, request, ctx, Parts.of(self.state, tenancy, self.state.engine))
            response = result if isinstance(result, Response) else JSONResponse(jsonable_encoder(result))
        except OpenAIError as err:
            response = render(request, err)
        except TenancyError as exc:
            response = render(request, tenancy_error(exc))
        except EngineError as exc:
            response = render(request, from_engine_error(exc))
        await response(request.scope, request.receive, send)


@dataclass(slots=True)
class _Headers:
    """The request headers this path reads: the first of each, as Starlette's ``Headers.get``."""

    authorization: str | None = None
    x_api_key: str | None = None
    content_type: bytes | None = None

    @classmethod
    def of(cls, scope: Scope) -> _Headers:
        found = cls()
        for name, value in scope["headers"]:
            if name == b"authorization" and found.authorization is None:
                found.authorization = value.decode("latin-1")
            elif name == b"x-api-key" and found.x_api_key is None:
                found.x_api_key = value.decode("latin-1")
            elif name == b"content-type" and found.content_type is None:
                found.content_type = value
        return found
