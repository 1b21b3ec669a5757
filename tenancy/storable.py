"""Make a usage row storable before it reaches the ledger writer: every text bounded and valid UTF-8,
every number inside what SQLite stores.

Why here and not in the writer: a row the database refuses (a lone surrogate cannot be encoded as
UTF-8, an integer past 2**63 overflows, NaN in a NOT NULL column) must never get as far as a batch,
where it would fail the rows of other tenants beside it. And a client controls most of the text
(``model``, ``user`` and ``prompt_cache_key`` inside ``miss_family``, the request id header), so
without a bound one rejected request could store megabytes.

``storable_row`` never raises for any input of the row's types: it is total, so ``submit`` cannot
fail on a client's bytes.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from typing import Any

# Characters of each text column (after cleaning). Generous for real values, tiny next to an attack.
TEXT_LIMITS: dict[str, int] = {
    "request_id": 128,
    "tenant_id": 64,
    "key_id": 64,
    "model": 256,
    "backend": 128,
    "status": 16,
    "priced_as": 256,
    "miss_rule": 32,
    "miss_detail": 256,
    "miss_family": 256,
    "miss_context": 128,
}
# Columns that must hold a number (NOT NULL in the schema): a non-finite or missing value becomes 0.
REQUIRED_NUMBERS: tuple[str, ...] = ("prompt_tokens", "cached_tokens", "completion_tokens", "created_at",
                                     "cost_usd", "saved_usd", "cache_creation_tokens")
OPTIONAL_NUMBERS: tuple[str, ...] = ("ttft_s", "latency_s", "miss_position", "miss_tokens", "miss_usd")
REQUIRED_TEXT: tuple[str, ...] = ("tenant_id", "key_id", "model", "backend", "status", "priced_as")
_INT_MAX = 2**63 - 1
# Lone surrogates (not encodable as UTF-8), NUL, and the C0/C1 controls (an ESC or CSI in a model name
# would drive the terminal of an operator reading `prefixgate report`): replaced. Only the prompt
# text of ``miss_context`` keeps tab and newline; every other column is one line of a table.
_UNSTORABLE = re.compile("[\ud800-\udfff\x00-\x1f\x7f-\x9f]")
_UNSTORABLE_MULTILINE = re.compile("[\ud800-\udfff\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_MULTILINE = frozenset({"miss_context"})
_REPLACEMENT = "\ufffd"
_TRUNCATED = "\u2026"  # marks a cut value, so a reader knows it is not whole


def storable_text(value: object, limit: int, *, multiline: bool = False) -> str | None:
    """``value`` as one line (or, ``multiline``, lines) of at most ``limit`` characters that UTF-8 and
    SQLite accept; None stays None."""
    if value is None:
        return None
    text = value if isinstance(value, str) else str(value)
    if len(text) > limit:
        text = text[: limit - 1] + _TRUNCATED
    return (_UNSTORABLE_MULTILINE if multiline else _UNSTORABLE).sub(_REPLACEMENT, text)


def storable_request_id(value: object) -> str:
    """A request id within its bound that stays unique: a long id keeps its head plus a digest of the
    whole, so two long ids that differ anywhere stay two rows (idempotence is on this column)."""
    text = value if isinstance(value, str) else str(value)
    limit = TEXT_LIMITS["request_id"]
    if len(text) <= limit and text.isprintable():  # isprintable is False for all that _UNSTORABLE replaces
        return text
    clean = _UNSTORABLE.sub(_REPLACEMENT, text)
    if len(clean) <= limit and clean == text:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{clean[: limit - 33]}~{digest}"


def storable_number(value: object, *, required: bool) -> int | float | None:
    """A finite int/float SQLite can hold; otherwise 0 (required columns) or None."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return max(-_INT_MAX, min(_INT_MAX, value))
    if isinstance(value, float) and math.isfinite(value):
        return value
    return 0 if required else None


def storable_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``row`` with every known column made storable (unknown keys are dropped).

    This runs on the event loop for every request, so the common values (a short printable str, an
    int in range, a finite float) are taken as they are without a call each: ``isprintable`` is
    False for every character ``_UNSTORABLE`` replaces (controls, surrogates), so such a text needs
    no substitution."""
    out: dict[str, Any] = {}
    for column, limit in TEXT_LIMITS.items():
        value = row.get(column)
        if column == "request_id":
            out[column] = storable_request_id("" if value is None else value)
        elif type(value) is str and len(value) <= limit and value.isprintable():
            out[column] = value
        elif value is None:  # the miss columns of most rows: no storable_text call
            out[column] = "" if column in REQUIRED_TEXT else None
        else:
            text = storable_text(value, limit, multiline=column in _MULTILINE)
            out[column] = "" if text is None and column in REQUIRED_TEXT else text
    for columns, required in ((REQUIRED_NUMBERS, True), (OPTIONAL_NUMBERS, False)):
        for column in columns:
            value = row.get(column)
            # exact types: a bool (an int subclass) goes through storable_number, which stores it as an int
            if (type(value) is int and -_INT_MAX <= value <= _INT_MAX) or (
                type(value) is float and math.isfinite(value)
            ):
                out[column] = value
            elif value is None:  # an optional number left out (ttft, the miss columns)
                out[column] = 0 if required else None
            else:
                out[column] = storable_number(value, required=required)
    return out
