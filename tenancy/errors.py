"""Errors that tenancy raises to its callers (the gateway maps them to OpenAI error JSON).

Each carries an OpenAI-style ``code`` and the HTTP ``status`` it maps to, so the gateway needs no
table of its own.
"""

from __future__ import annotations

import math
from typing import Literal

QuotaKind = Literal["rate", "tokens", "budget"]


class TenancyError(Exception):
    """Base class. ``str(exc)`` is a one-line message a user can act on."""

    status: int = 400
    code: str = "tenancy_error"

    @property
    def message(self) -> str:
        return str(self)


class AuthenticationError(TenancyError):
    """The API key is missing, malformed, unknown or revoked (HTTP 401)."""

    status = 401
    code = "invalid_api_key"


class PermissionDeniedError(TenancyError):
    """The key is valid but may not do this (HTTP 403), e.g. a non-admin asking for all usage."""

    status = 403
    code = "permission_denied"


class QuotaExceededError(TenancyError):
    """A quota refused the request (HTTP 429).

    Attributes:
        kind: ``"rate"`` (requests/min), ``"tokens"`` (tokens/min) or ``"budget"`` (USD per period).
        retry_after_s: seconds after which the same request would be admitted, or ``None`` when
            waiting cannot help (the request alone is larger than the quota).
    """

    status = 429

    def __init__(self, kind: QuotaKind, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.kind: QuotaKind = kind
        self.retry_after_s = retry_after_s
        # OpenAI uses "rate_limit_exceeded" for rpm/tpm and "insufficient_quota" for money.
        self.code = "insufficient_quota" if kind == "budget" else "rate_limit_exceeded"

    @property
    def retry_after_whole_s(self) -> int | None:
        """``retry_after_s`` rounded up to whole seconds (at least 1), as ``Retry-After`` carries it
        and the message says it: a client that waits that long is admitted (rounding to nearest
        could send it back early, into another 429)."""
        return None if self.retry_after_s is None else retry_whole_seconds(self.retry_after_s)


def retry_whole_seconds(wait_s: float) -> int:
    """A wait in whole seconds, rounded up, at least 1 (what ``Retry-After`` can say)."""
    return max(1, math.ceil(wait_s))


class NotFoundError(TenancyError):
    """No tenant / key with that name or id."""

    status = 404
    code = "not_found"


class ConflictError(TenancyError):
    """The name is taken (tenant names are unique)."""

    status = 409
    code = "conflict"


class InvalidSettingError(TenancyError, ValueError):
    """A tenant setting or quota value is out of range or unknown."""

    code = "invalid_setting"


class KeyMaterialError(TenancyError):
    """The key-encryption key (KEK) or server secret is unreadable or does not match the database."""

    status = 500
    code = "key_material_error"
