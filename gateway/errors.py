"""Every error the gateway returns, in the OpenAI envelope.

The openai SDK maps status codes to exception classes and reads ``error.message`` / ``error.code``,
so every failure path — our own checks, pydantic validation, malformed JSON, engine errors, tenancy
quota errors, unexpected exceptions — ends up here as::

    HTTP <status>
    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

FastAPI's default ``{"detail": ...}`` shape never reaches a client.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.protocol import EngineError, RequestPart

log = logging.getLogger("prefixgate.gateway")

# status -> the ``type`` OpenAI uses for it.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


class OpenAIError(Exception):
    """An error with an HTTP status, rendered as the OpenAI error envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid_request(message: str, *, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


# OpenAI's two codes for a refused parameter, so that a client can tell "drop this field" from "send
# another value": a parameter this model cannot honour at all (accepted only at a value that asks for
# nothing: presence_penalty 0, min_tokens 0), and one it honours, asked for a value it cannot
# (verbosity "low" where it writes as "medium", modalities other than ["text"]).
def unsupported_parameter(message: str, param: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="unsupported_parameter")


def unsupported_value(message: str, param: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="unsupported_value")


# The field each part of a request is in when nobody says otherwise (completions' names). A grammar
# has none: it comes from response_format or from a forced tool call, which only the caller knows.
_ENGINE_PARAMS: dict[RequestPart, str] = {RequestPart.PROMPT: "prompt", RequestPart.LOGIT_BIAS: "logit_bias"}


def from_engine_error(exc: EngineError, names: Mapping[RequestPart, str] | None = None) -> OpenAIError:
    """Map an engine error to the status it declares (400 too long, 429 too many grammar compiles
    waiting, 503 overloaded, ...), its code and its ``Retry-After`` (the error's own, else 1 s for a
    503), naming the field at fault: ``names`` says what the client's API calls each part of the
    request (chat's prompt is ``messages``); a part it leaves out keeps its default name."""
    status = exc.status or 500
    retry_after = exc.retry_after_s if exc.retry_after_s is not None else (1 if status == 503 else None)
    headers = {"retry-after": str(retry_after)} if retry_after is not None else None
    param = None
    if exc.part is not None:
        param = names.get(exc.part) if names and exc.part in names else _ENGINE_PARAMS.get(exc.part)
    return OpenAIError(status, str(exc) or exc.code, code=exc.code, param=param, headers=headers)


def field_path(parts: Iterable[str | int]) -> str:
    """A field's path as OpenAI writes it in ``param``: keys dotted, list indices in brackets
    (``messages[0].content[1].type``, ``tools[0].function.parameters``, ``input[2].call_id``).
    Every path the gateway reports is built here or written in this form."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" if i else p for i, p in enumerate(parts))


# Pydantic puts the union member it tried into an error's location, after the field: a request
# whose ``content`` is neither a string nor a list fails at ``messages.0.content.str`` and
# ``...content.list[dict[str,any]]``. The client wrote ``messages[0].content``; these tags are left out
# of ``param``. A member is a bare type name, or has brackets or a hyphen (``list[int]``,
# ``function-after[...]``, ``constrained-str``), which no request field's name has.
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "bytes", "none", "list", "dict", "tuple", "set", "any"})


def _is_union_member(part: str | int) -> bool:
    return isinstance(part, str) and (part in _TYPE_NAMES or "[" in part or "-" in part)


def client_path(loc: tuple[str | int, ...]) -> str | None:
    """A pydantic error location as the path of the field the client wrote (None: the body). FastAPI
    starts a URL parameter's location with where it came from (``query.limit``): OpenAI names the
    parameter alone (``limit``), as it names a body field without ``body``."""
    if loc and loc[0] in ("query", "path"):
        loc = loc[1:]
    return field_path(p for p in loc if p != "body" and not _is_union_member(p)) or None


def _validation_message(exc: RequestValidationError | ValidationError) -> tuple[str, str | None, str | None]:
    """First pydantic error -> (message, param, code). Malformed JSON gets its own code."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None, None
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        detail = ctx.get("error", "could not parse the body")
        return (
            f"We could not parse the JSON body of your request ({detail}). The body must be valid JSON.",
            None,
            "invalid_json",
        )
    param = client_path(tuple(first.get("loc", ())))
    if first.get("type") == "body_limit":  # gateway.ingress: depth, lone surrogates, sizes
        ctx = first.get("ctx") or {}
        named = ctx.get("param")
        if named and (param is None or named.startswith((f"{param}.", f"{param}["))):  # a validator named a field inside its own
            param = named
        return f"Invalid request: {ctx.get('message')}.", param, ctx.get("code") or "invalid_value"
    msg = first.get("msg", "invalid value")
    if param is None:  # the body as a whole: not a JSON object (or sent without a JSON content type)
        return (
            "The request body must be a JSON object sent with Content-Type: application/json.",
            None,
            "invalid_json",
        )
    if first.get("type") == "missing":
        return f"Missing required parameter: '{param}'.", param, "missing_required_parameter"
    where = f" at '{param}'" if param else ""
    return f"Invalid value{where}: {msg}.", param, "invalid_value"


def validation_error(exc: RequestValidationError | ValidationError) -> OpenAIError:
    """The 400 for a body that failed validation: FastAPI's (a route's body) or pydantic's own (a
    door's translated chat body, ``door.chat_request``), worded alike."""
    message, param, code = _validation_message(exc)
    return OpenAIError(400, message, param=param, code=code)


RejectedHook = Callable[[Request, OpenAIError], None]
# A front door whose clients expect another error shape (Anthropic's on /v1/messages): the body for an error.
ErrorShape = Callable[[OpenAIError], dict[str, Any]]


def render(request: Request, error: OpenAIError) -> JSONResponse:
    """``error`` as the response the caller's API expects: the OpenAI envelope unless the path
    belongs to a door registered in ``app.state.error_shapes`` (path prefix -> body)."""
    shapes: dict[str, ErrorShape] = getattr(request.app.state, "error_shapes", {})
    for prefix, shape in shapes.items():
        if request.url.path.startswith(prefix):
            return JSONResponse(shape(error), status_code=error.status, headers=error.headers)
    return error.response()


def refused_body(request: Request, exc: RequestValidationError, on_invalid_body: RejectedHook | None
                 ) -> JSONResponse:
    """The 400 for a body that failed validation, after telling ``on_invalid_body`` of it."""
    error = validation_error(exc)
    if on_invalid_body is not None:
        try:
            on_invalid_body(request, error)
        except Exception:  # noqa: BLE001 - counting must never change the client's answer
            log.exception("could not record a refused request")
    return render(request, error)


def install_error_handlers(app: FastAPI, on_invalid_body: RejectedHook | None = None) -> None:
    """Route every exception type the app can raise to the OpenAI envelope.

    ``on_invalid_body(request, error)`` is told of every body that failed validation: FastAPI
    validates the body after the dependencies ran, so the caller may already be authenticated and
    the refusal must be counted like any other (``gateway.app`` does that).
    """

    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError) -> JSONResponse:
        return render(request, exc)

    app.state.on_invalid_body = on_invalid_body  # the raw-ASGI doors refuse large bodies themselves

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return refused_body(request, exc, on_invalid_body)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = f"Unknown URL. {message}" if message != "Not Found" else "Unknown URL."
        return render(request, OpenAIError(exc.status_code, message, code=code, headers=dict(exc.headers or {})))

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError) -> JSONResponse:
        return render(request, from_engine_error(exc))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return render(request, OpenAIError(500, "The server had an error while processing your request.",
                                           code="internal_error"))
