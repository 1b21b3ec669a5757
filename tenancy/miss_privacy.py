"""What a cache-miss explanation may keep in the ledger: a tenant's choice, no prompt text by default.

The gateway explains a cache break with a rule code and detail, the tokens it cost, the prompt
*family* (``prompt_cache_key:<key>``, ``user:<end-user id>`` or ``prefix:<model>:<digest of the
system prompt's start>``) and a few characters of prompt text before the break (the *context*).
The last two are client data: the context is prompt text, the family names an end user or can be
checked against a guessed system prompt. So, unless the tenant set ``store_miss_context``:

    context  ─► dropped (NULL)
    family   ─► "<kind>:~" + HMAC-SHA256(server key, tenant id ‖ 0 ‖ family)[:24 hex]

A keyed family still groups a tenant's misses in reports (same family, same value), but a stolen
database cannot be used to test a guessed end-user id or prompt without the server secret, and equal
families of two tenants do not link.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

KEYED_MARK = "~"


def keyed_family(key: bytes, tenant_id: str, family: str) -> str:
    """The stored form of ``family`` when the tenant keeps no clear miss data; idempotent."""
    kind, sep, value = family.partition(":")
    if not sep:
        kind, value = "family", family
    if kind == "prefix":  # prefix:<model>:<digest>: the model is the tenant's own route, keep it
        model, _, value = value.rpartition(":")
        kind = f"prefix:{model}"
    if value.startswith(KEYED_MARK):
        return family
    mac = hmac.new(key, tenant_id.encode("utf-8", "surrogatepass") + b"\0" + value.encode("utf-8", "surrogatepass"),
                   hashlib.sha256).hexdigest()[:24]
    return f"{kind}:{KEYED_MARK}{mac}"


def apply_miss_policy(row: dict[str, Any], *, store_clear: bool, key: bytes) -> None:
    """Drop or key the client-data miss fields of ``row`` in place (see the module docstring)."""
    if store_clear:
        return
    row["miss_context"] = None
    family = row.get("miss_family")
    if isinstance(family, str) and family:
        row["miss_family"] = keyed_family(key, str(row.get("tenant_id")), family)
