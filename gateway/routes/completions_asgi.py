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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pydantic import ValidationError
from starlette.datastructures import State
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.protocol import EngineError
from gateway.deps import authenticate_bearer
from gateway.errors import OpenAIError, from_engine_error
from gateway.ports import TenancyError, tenancy_error
from gateway.routes.completions import Parts, handle
from gateway.schemas import ChatCompletionRequest, CompletionRequest

_ROUTES: dict[str, tuple[str, type[ChatCompletionRequest] | type[CompletionRequest]]] = {
    "/v1/chat/completions": ("chat", ChatCompletionRequest),
    "/v1/completions": ("completion", CompletionRequest),
}


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
    """ASGI middleware: serves the completion routes itself, hands everything else to ``app``."""

    def __init__(self, app: ASGIApp, state: State, overrides: Mapping[Callable[..., object], object]) -> None:
        self.app = app
        self.state = state
        self.overrides = overrides  # the FastAPI app's dependency_overrides (a live dict)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = _ROUTES.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None or self.overrides:
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:  # the client went away before its body arrived
            return
        authorization = content_type = None
        for name, value in scope["headers"]:  # the first of each, as Starlette's Headers.get
            if name == b"authorization" and authorization is None:
                authorization = value.decode("latin-1")
            elif name == b"content-type" and content_type is None:
                content_type = value
        kind, schema = route
        request = _validated(schema, body) if _is_json(content_type) else None
        if request is None:  # FastAPI answers it: its 400, and the refused-request accounting
            await self.app(scope, replaying(body, receive), send)
            return
        response = None
        try:
            tenancy = self.state.tenancy
            if tenancy is None:
                raise OpenAIError(503, "tenancy is not configured on this server (start it with --home)",
                                  code="no_tenancy")
            ctx = authenticate_bearer(tenancy, authorization, self.state.metrics)
            response = await handle(kind, request, ctx, Parts.of(self.state, tenancy, self.state.engine), receive)
        except OpenAIError as err:
            response = err.response()
        except TenancyError as exc:
            response = tenancy_error(exc).response()
        except EngineError as exc:
            response = from_engine_error(exc).response()
        await response(scope, receive, send)
