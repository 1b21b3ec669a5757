"""The small value types of tenancy: what the gateway receives and hands back.

``TenantContext`` implements the engine's ``TenantScope`` Protocol structurally (same attribute
names), so ``engine/`` never imports tenancy and tenancy never imports ``engine/``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from tenancy.crypto import TenantCipher

CanonMode = Literal["off", "safe", "reorder"]
BudgetPeriod = Literal["day", "month"]
UsageStatus = Literal["ok", "error", "aborted"]

ListOrder = Literal["asc", "desc"]

CANON_MODES: tuple[str, ...] = ("off", "safe", "reorder")
BUDGET_PERIODS: tuple[str, ...] = ("day", "month")
USAGE_STATUSES: tuple[str, ...] = ("ok", "error", "aborted")


@dataclass(frozen=True)
class Quotas:
    """A tenant's limits. ``None`` everywhere means unlimited.

    ``kv_blocks_hbm`` / ``kv_blocks_dram`` / ``kv_blocks_nvme`` cap how many KV blocks the tenant may
    hold in each tier (the engine enforces them; tenancy only stores and forwards them).
    """

    rpm: int | None = None
    tpm: int | None = None
    budget_usd: float | None = None
    budget_period: BudgetPeriod = "month"
    kv_blocks_hbm: int | None = None
    kv_blocks_dram: int | None = None
    kv_blocks_nvme: int | None = None


@dataclass(frozen=True)
class TenantContext:
    """An authenticated caller: who it is, how its prompts are cached, and its limits.

    The nine fields before the quota fields are the engine's ``TenantScope``. ``namespace`` is
    derived by the server (HMAC of tenant id and share scope); ``scope_for`` returns a copy whose
    namespace is narrowed to one end user when ``share_scope == "user"``. ``tenant_key`` (HMAC of
    the tenant id alone) never changes with the scope: the engine counts quotas and fairness by it.
    """

    tenant_id: str
    name: str
    key_id: str
    is_admin: bool
    share_scope: str  # "tenant" | "user" | "group:<name>"
    canon_mode: CanonMode
    per_user_vars: tuple[str, ...]
    # -- TenantScope --
    namespace: bytes
    tenant_key: bytes
    metrics_label: str
    cipher: TenantCipher | None = field(default=None, compare=False, repr=False)
    priority: int = 0
    kv_block_quota: int | None = None
    ttft_target_s: float | None = None
    kv_block_quota_dram: int | None = None
    kv_block_quota_nvme: int | None = None
    # -- quota numbers (admission happens in TenancyService.admit) --
    quotas: Quotas = field(default_factory=Quotas)
    cache_retention_s: float | None = None  # the tenant's default retention of its prompts' prefixes
    user: str | None = None  # the end user this context was scoped to, if any

    @property
    def rpm(self) -> int | None:
        return self.quotas.rpm

    @property
    def tpm(self) -> int | None:
        return self.quotas.tpm

    @property
    def budget_usd(self) -> float | None:
        return self.quotas.budget_usd


# Not frozen: made on every request, and a frozen dataclass sets each field through object.__setattr__
# (2-3x the construction time; issue #17). Nothing hashes it or relies on it not changing.
@dataclass
class UsageRecord:
    """One finished (or failed, or aborted) request, as the gateway saw it.

    ``created_at`` is the request's arrival time (epoch seconds). ``miss_rule`` / ``miss_position``
    are reserved for cache-miss explanations (which canonicalization rule or token position broke
    the prefix); tenancy stores them as given.
    """

    request_id: str
    tenant_id: str
    key_id: str
    model: str
    backend: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float | None
    latency_s: float | None
    status: UsageStatus
    created_at: float
    miss_rule: str | None = None
    miss_position: int | None = None
    # Cache-miss explanation details (gateway.miss_tracker): the rule's detail ("timestamp"), prompt
    # tokens re-prefilled because of the break, the prompt family, and up to 32 characters of prompt
    # text just before the break (what `promptlint check --from-usage` matches templates by).
    # ``record_usage`` stores the context and the family in clear only for a tenant that set
    # ``store_miss_context``; otherwise the context is dropped and the family's value keyed (HMAC).
    miss_detail: str | None = None
    miss_tokens: int | None = None
    miss_family: str | None = None
    miss_context: str | None = None
    # The cost-map entry to price the row at instead of ``model`` (a route's ``price``), or
    # ``UNPRICED``: tokens only, cost and saving 0 and the row marked ``priced_as = "unpriced"``.
    price_as: str | None = None
    # Prompt tokens this request wrote to a prompt cache: Anthropic's cache_creation_input_tokens
    # through a provider route, or the local engine's blocks up to a cache_control breakpoint. Part
    # of prompt_tokens and disjoint from cached_tokens; priced at the cache-write rate.
    cache_creation_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must be non-empty")
        for name in ("prompt_tokens", "cached_tokens", "completion_tokens", "cache_creation_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError(
                f"cached_tokens ({self.cached_tokens}) cannot exceed prompt_tokens ({self.prompt_tokens})"
            )
        if self.cached_tokens + self.cache_creation_tokens > self.prompt_tokens:
            raise ValueError(
                f"cached_tokens ({self.cached_tokens}) + cache_creation_tokens ({self.cache_creation_tokens}) "
                f"cannot exceed prompt_tokens ({self.prompt_tokens})"
            )
        if self.miss_tokens is not None and self.miss_tokens < 0:
            raise ValueError(f"miss_tokens must be >= 0, got {self.miss_tokens}")
        if self.status not in USAGE_STATUSES:
            raise ValueError(f"status must be one of {USAGE_STATUSES}, got {self.status!r}")


# Not frozen: made on every request, and a frozen dataclass sets each field through object.__setattr__
# (2-3x the construction time; issue #17). Nothing hashes it or relies on it not changing.
@dataclass
class Price:
    """What a request cost and what its cached tokens saved, in USD.

    ``priced_as`` names the cost-map entry used: the model itself, or the reference model when the
    model is local/unknown (so savings still mean "what this would have cost at that price").
    """

    cost_usd: float
    saved_usd: float
    priced_as: str


@dataclass(frozen=True)
class CreatedTenant:
    """Returned once by ``create_tenant``: ``api_key`` is never shown again (only its hash is kept)."""

    tenant_id: str
    name: str
    api_key: str
    key_id: str


@dataclass(frozen=True)
class CreatedKey:
    """Returned once by ``create_key``."""

    tenant_id: str
    key_id: str
    api_key: str
    prefix: str


@dataclass(frozen=True)
class KeyInfo:
    """An API key as listed: never the key itself, only its visible prefix."""

    key_id: str
    tenant_id: str
    tenant_name: str
    prefix: str
    created_at: float
    revoked_at: float | None

    @property
    def active(self) -> bool:
        return self.revoked_at is None


@dataclass(frozen=True)
class TenantInfo:
    """A tenant's stored settings (what ``tenant show`` prints)."""

    tenant_id: str
    name: str
    is_admin: bool
    share_scope: str
    canon_mode: CanonMode
    per_user_vars: tuple[str, ...]
    priority: int
    ttft_target_s: float | None
    quotas: Quotas
    created_at: float
    cache_retention_s: float | None = None  # keep every prompt's prefix this long (explicit cache control)
    # Keep the prompt text around a cache break (``miss_context``) and end-user family names in clear
    # in the ledger. Off by default: the ledger then holds no prompt text (see SECURITY.md).
    store_miss_context: bool = False


class FleetEvent(enum.Enum):
    """What another gateway (or the CLI) changed about a tenant."""

    REVOKED = "revoked"
    DELETED = "deleted"
    UPDATED = "updated"


@dataclass(frozen=True)
class SharedLimitsStatus:
    """``connected``: the last Redis call worked. ``fallbacks``: admissions decided by local limits
    because Redis did not answer. ``last_error``: the latest Redis error, or None."""

    url: str
    connected: bool
    fallbacks: int
    last_error: str | None


@dataclass(frozen=True)
class StoredChatCompletion:
    """A chat completion created with ``store: true``: the ``chat.completion`` object as the client
    got it (whole or assembled from its stream), with its ``metadata``, and the request's input
    messages in OpenAI's stored-message shape (each with its id). ``model`` is the completion's."""

    completion_id: str
    model: str
    completion: dict[str, Any]
    messages: list[dict[str, Any]]


@dataclass(frozen=True)
class ChatCompletionQuery:
    """One page of a tenant's stored chat completions, as ``GET /v1/chat/completions`` asks for it:
    oldest first (``asc``) or newest first, after the completion ``after``, only those of ``model``
    and carrying every pair of ``metadata``."""

    after: str | None = None
    limit: int = 20
    order: ListOrder = "asc"
    model: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")
        if self.order not in ("asc", "desc"):
            raise ValueError(f"order must be 'asc' or 'desc', got {self.order!r}")


@dataclass(frozen=True)
class ChatCompletionPage:
    """The stored ``chat.completion`` objects of one page, in the query's order; ``has_more``: a
    later page has at least one."""

    completions: list[dict[str, Any]]
    has_more: bool
