"""API keys never travel in the URL: a query parameter named like a credential is refused, and
its value is masked in uvicorn's access log.

The gateway reads keys from headers only (``Authorization: Bearer``, and ``x-api-key`` on
``/v1/messages``); no SDK it serves sends one in the query string, and the dashboard page keeps its
key in the URL fragment, which never leaves the browser. A key in the query string is a client
mistake, and a costly one: URLs are written to access logs, proxy logs and browser history. So:

- ``QueryCredentialRefusal`` answers such a request 401 (``invalid_api_key``, ``param`` = the
  parameter), saying to use the Authorization header, whatever else the request carries.
- ``install_access_log_redaction`` masks the parameter's value in uvicorn's access log line
  (``GET /v1/models?api_key=*** HTTP/1.1" 401``), which uvicorn writes for the refusal too.
"""

from __future__ import annotations

import logging
from urllib.parse import parse_qsl, unquote_plus

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import OpenAIError, render

# Lower-case names a client may use for a key; no route takes a query parameter of these names.
CREDENTIAL_PARAMS = frozenset({
    "api_key", "api-key", "apikey", "key", "x-api-key", "access_token", "token", "authorization", "bearer",
})
_MASK = "***"


def credential_param(query: str) -> str | None:
    """The first query parameter of ``query`` (the raw query string) named like a credential, or None."""
    for name, _ in parse_qsl(query, keep_blank_values=True):
        if name.lower() in CREDENTIAL_PARAMS:
            return name
    return None


def mask_credentials(path_with_query: str) -> str:
    """``path_with_query`` with the value of every credential-named parameter replaced by ``***``;
    the rest of the line is left byte for byte (only ``&``-separated fields are looked at)."""
    path, sep, query = path_with_query.partition("?")
    if not sep:
        return path_with_query
    fields = []
    for field in query.split("&"):
        name, eq, _ = field.partition("=")
        fields.append(f"{name}={_MASK}" if eq and unquote_plus(name).lower() in CREDENTIAL_PARAMS else field)
    return f"{path}?{'&'.join(fields)}"


def refusal(name: str) -> OpenAIError:
    return OpenAIError(
        401,
        f"API keys are not accepted in the URL query string (parameter '{name}'): URLs end up in access "
        "and proxy logs. Send the key in the Authorization header (Authorization: Bearer YOUR_KEY).",
        param=name, code="invalid_api_key", type="authentication_error",
    )


class QueryCredentialRefusal:
    """Refuse (401) every HTTP request whose query string has a credential-named parameter."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("query_string"):
            name = credential_param(scope["query_string"].decode("latin-1"))
            if name is not None:
                request = Request(scope)
                request.app.state.metrics.unauthenticated.inc()
                await render(request, refusal(name))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _AccessLogRedaction(logging.Filter):
    """Masks credential values in uvicorn's access record: args (client, method, path?query, http
    version, status), as ``uvicorn.protocols.http`` logs them."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], mask_credentials(args[2]), *args[3:])
        return True


def install_access_log_redaction() -> None:
    """Add the masking filter to ``uvicorn.access`` (once; call after building ``uvicorn.Config``,
    whose logging set-up would otherwise come after it)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, _AccessLogRedaction) for f in access.filters):
        access.addFilter(_AccessLogRedaction())
