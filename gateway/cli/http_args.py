"""Checks of the arguments that point a command at a running gateway: ``--url`` and an API key.

A bad one is one line on stderr and exit 2 (``CLIError``) before any request, never a traceback
from inside httpx: an unparsable URL raises ``httpx.InvalidURL``, which is not an ``HTTPError``,
and a key with non-ASCII characters fails while the request's headers are encoded.
"""

from __future__ import annotations

from gateway.cli.main import CLIError


def gateway_url(value: str, flag: str = "--url") -> str:
    """``value`` if it is an http(s) URL with a host; else CLIError naming ``flag``."""
    import httpx

    try:
        url = httpx.URL(value)
    except httpx.InvalidURL as exc:
        raise CLIError(f"{flag} {value!r} is not a valid URL: {exc}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise CLIError(f"{flag} {value!r}: give the gateway as http://HOST:PORT (or https://)")
    return value


def api_key(value: str, source: str) -> str:
    """``value`` if it can travel in an ``Authorization`` header (printable ASCII, as every
    ``pg-...`` key is); else CLIError naming where it came from (``--key``, ``$PREFIXGATE_API_KEY``)."""
    if not (value.isascii() and value.isprintable()):
        raise CLIError(f"{source}: an API key is printable ASCII (pg-...); this one is not")
    return value
