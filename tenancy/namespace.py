"""Cache namespaces: derived by the server, never taken from the client.

``namespace = HMAC-SHA256(namespace key, frame("prefixgate/ns/v1", kind, id...))`` where the
namespace key combines the server secret with a root key kept wrapped by the KEK
(``TenancyService._load_namespace_key``: without the KEK no namespace can be derived), and ``frame``
prefixes every part with its 4-byte big-endian length, so no two different part lists produce the
same bytes (``("ab", "c")`` vs ``("a", "bc")``). The namespace seeds the engine's prefix hash chain,
so two namespaces never share a cache entry in any tier.

============  ==========================================  =====================================
share scope   parts                                       who shares a cache
============  ==========================================  =====================================
tenant        ("tenant", tenant_id)                       every request of the tenant
user          ("user", tenant_id, user)                   one end user of one tenant
group:NAME    ("group", NAME)                             every tenant configured with group NAME
============  ==========================================  =====================================

Under ``user`` scope a request without a ``user`` field is isolated per API key
(``("user-key", tenant_id, key_id)``): it shares with nothing it was not meant to.
"""

from __future__ import annotations

import hashlib
import hmac
import re

_LABEL = b"prefixgate/ns/v1"
GROUP_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def frame(*parts: str | bytes) -> bytes:
    out = bytearray()
    for part in parts:
        data = part.encode("utf-8", "surrogatepass") if isinstance(part, str) else part
        out += len(data).to_bytes(4, "big") + data
    return bytes(out)


def derive(secret: bytes, *parts: str) -> bytes:
    return hmac.new(secret, frame(_LABEL, *parts), hashlib.sha256).digest()


def parse_share_scope(value: str) -> tuple[str, str | None]:
    """``"tenant"`` / ``"user"`` / ``"group:NAME"`` -> (kind, group name). Raises ValueError if invalid."""
    if value in ("tenant", "user"):
        return value, None
    if value.startswith("group:"):
        group = value[len("group:") :]
        if GROUP_NAME_RE.match(group):
            return "group", group
        raise ValueError(
            f"share group name {group!r} must be 1-64 chars of letters, digits, '.', '_', '-'"
        )
    raise ValueError(f"share scope must be 'tenant', 'user' or 'group:NAME', got {value!r}")


def namespace_for(secret: bytes, *, tenant_id: str, share_scope: str, key_id: str, user: str | None) -> bytes:
    kind, group = parse_share_scope(share_scope)
    if kind == "tenant":
        return derive(secret, "tenant", tenant_id)
    if kind == "group":
        assert group is not None
        return derive(secret, "group", group)
    if user:
        return derive(secret, "user", tenant_id, user)
    return derive(secret, "user-key", tenant_id, key_id)


def tenant_key_for(secret: bytes, tenant_id: str) -> bytes:
    """The engine's per-tenant key (quotas, fairness, tier caps): one per tenant, whatever its share
    scope. Derived under its own label, so it never equals a namespace (it is not a chain seed, and
    the NVMe tier may keep it on disk where no namespace is written in clear)."""
    return derive(secret, "tenant-key", tenant_id)


_LABEL_BAD = re.compile(r"[^A-Za-z0-9_.-]")


def metrics_label(tenant_name: str) -> str:
    """A Prometheus-safe label of bounded cardinality: the tenant name, sanitised, at most 32 chars.

    Never includes the end user, so the number of label values is the number of tenants.
    """
    return _LABEL_BAD.sub("_", tenant_name)[:32] or "_"
