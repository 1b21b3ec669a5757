"""``POST /v1/chat/completions`` and ``POST /v1/completions`` as raw ASGI, in front of FastAPI.

The two routes that carry the traffic skip FastAPI's routing and dependency solving (~400 Python
calls a request, a third of what the gateway itself added in front of a loopback upstream;
benchmarks/gateway.py profile). They run the very same ``completions.handle`` as the FastAPI
routes, so auth, quotas, admission, canonicalization, routing, the status line held until the
first token or the error, usage, ledger and miss tracking are one implementation::

    BodySizeLimit -> NodeApiMiddleware -> CompletionRoutes -+-> handle()        (a valid body)
                                                            +-> FastAPI app     (everything else)

What this path does not answer goes to the FastAPI app unchanged, the body replayed: another
method or path, a body that is not JSON (or not sent as JSON), a body the schema refuses (so that
its 400, and the refused-request accounting that follows authentication, stay FastAPI's), and apps
whose tests override dependencies (``app.dependency_overrides``).

Authentication comes first, before the body is read, here and for every path that does costly
work (``AUTH_FIRST_PATHS``: the Responses and Messages doors and cache warming too, which FastAPI
serves): the key is in the headers, so a client without a valid key gets its 401 without the
server parsing a byte of its body (a 4 MB token-id body used to cost 0.4 s of event loop before
its 401). A body over ``OFF_LOOP_BYTES`` is then validated in the tenant's worker thread
(``TenantThreads``), not on the event loop: only an authenticated tenant gets there, and it holds
at most its share of the pool.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pydantic import ValidationError
from starlette.datastructures import State
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.protocol import EngineError
from gateway.deps import authenticate_bearer
from gateway.errors import OpenAIError, from_engine_error, render
from gateway.ports import TenancyError, TenancyPort, TenantCtx, tenancy_error
from gateway.routes.completions import KIND_OF_PATH, Parts, handle
from gateway.routes.messages import anthropic_tenant
from gateway.schemas import ChatCompletionRequest, CompletionRequest

_ROUTES: dict[str, tuple[str, type[ChatCompletionRequest] | type[CompletionRequest]]] = {
    "/v1/chat/completions": ("chat", ChatCompletionRequest),
    "/v1/completions": ("completion", CompletionRequest),
}

# Every POST path whose body costs work to parse: authenticated before its body is read.
AUTH_FIRST_PATHS = frozenset(KIND_OF_PATH) | {"/v1/messages/count_tokens"}
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


def _validated(schema: type[ChatCompletionRequest] | type[CompletionRequest], body: bytes
               ) -> ChatCompletionRequest | CompletionRequest | None:
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


class CompletionRoutes:
    """ASGI middleware: authenticates the costly POST paths before their body is read, serves the
    completion routes itself, hands everything else to ``app``."""

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
        route = _ROUTES.get(scope["path"])
        if route is None:  # a door FastAPI serves (it authenticates again, from its cache)
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:  # the client went away before its body arrived
            return
        kind, schema = route
        request = await self._parse(schema, body, ctx) if _is_json(headers.content_type) else None
        if request is None:  # FastAPI answers it: its 400, and the refused-request accounting
            await self.app(scope, replaying(body, receive), send)
            return
        response = None
        try:
            response = await handle(kind, request, ctx, Parts.of(self.state, tenancy, self.state.engine), receive)
        except OpenAIError as err:
            response = err.response()
        except TenancyError as exc:
            response = tenancy_error(exc).response()
        except EngineError as exc:
            response = from_engine_error(exc).response()
        await response(scope, receive, send)

    async def _authenticate(self, scope: Scope, tenancy: TenancyPort, headers: _Headers) -> TenantCtx:
        """The caller's tenant, from its headers alone. Raises ``OpenAIError`` (401)."""
        if scope["path"].startswith("/v1/messages"):  # Anthropic's SDK sends x-api-key
            return await anthropic_tenant(Request(scope), tenancy, headers.x_api_key, headers.authorization)
        return authenticate_bearer(tenancy, headers.authorization, self.state.metrics)

    async def _parse(self, schema: type[ChatCompletionRequest] | type[CompletionRequest], body: bytes,
                     ctx: TenantCtx) -> ChatCompletionRequest | CompletionRequest | None:
        if len(body) <= OFF_LOOP_BYTES:
            return _validated(schema, body)
        return await self.state.tenant_threads.run(ctx.tenant_id, _validated, schema, body)


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
