"""Which recent request a new one should have shared its prefix with, and why it did not.

The gateway only records; the prompt analysis is ``promptlint.miss``'s. Per tenant and per prompt
family (``promptlint.miss.family_key``) the tracker keeps the last few requests as
``PromptFacts``: the canonical body, the prompt's token ids when the gateway tokenized it for the
local engine, and when it was seen. A new request's near-hit is the family member that shares the
most leading full cache blocks of ``block_size`` tokens -- the engine's own block size, so "shared"
means what the prefix index would serve -- and ``promptlint.miss.explain_miss`` says why they part
(a rule code, the block where the cache stops, cache_control breakpoints). Memory is bounded::

    OrderedDict (tenant, family) -> deque[PromptFacts] (<= requests_per_family), least recently used first
    a tenant holds <= families_per_tenant families; all entries together hold <= max_chars units
    (one per character of rendered prompt and one per token id)

and the least recently used family goes first when either bound is hit. Tenants are isolated by
construction: every lookup is keyed by tenant id, so a request is only ever compared with its own
tenant's requests, and ``recent_breaks(tenant)`` returns only that tenant's records.

A request whose family has no history is compared with the tenant's latest request for the same
model, and only a classified break (not ``other``) is kept from that comparison.

Thread-safe (one lock); the work per request is one render, a C-speed common-prefix compare with
each of the (at most ``requests_per_family``) candidates and one ``explain_miss`` call.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypedDict

from prometheus_client import CollectorRegistry, Counter

from promptlint.explain import Break
from promptlint.miss import JsonBody, PromptFacts, explain_miss, family_key, near_hit

DEFAULT_BLOCK_SIZE = 16  # the engine's default (EngineConfig.block_size); the app passes its own


# Not frozen: made on every request, and a frozen dataclass sets each field through object.__setattr__
# (2-3x the construction time; issue #17). Nothing hashes it or relies on it not changing.
@dataclass
class Observation:
    """What the tracker learned of one request before it ran. ``brk`` is None when nothing broke.

    ``reachable_tokens``: how much of the prompt the near-hit could have served had nothing broken
    (its full blocks before its own input); ``prompt_tokens``: this prompt's length as recorded.
    """

    tenant: str
    family: str
    brk: Break | None
    reachable_tokens: int = 0
    prompt_tokens: int = 0
    text_chars: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE

    def tokens(self, chars: int, prompt_tokens: int) -> int:
        """Characters of this prompt -> tokens, in proportion to its real token count."""
        return 0 if not self.text_chars else round(prompt_tokens * min(chars, self.text_chars) / self.text_chars)


@dataclass(frozen=True)
class MissRecord:
    """One explained cache break, as stored in the ledger and exported under the report's ``misses``."""

    request_id: str
    tenant: str
    family: str
    rule: str
    name: str
    detail: str
    message: str
    where: str
    position: int  # token position where the cache stops serving: a block boundary
    char_position: int
    context: str
    cached_tokens: int
    prompt_tokens: int
    tokens_lost: int
    created_at: float = field(default_factory=time.time)


class MissTracker:
    """Bounded per-tenant, per-family memory of recent requests, and the breaks found against it."""

    def __init__(
        self,
        *,
        families_per_tenant: int = 256,
        requests_per_family: int = 4,
        max_chars: int = 32 * 1024 * 1024,
        records_per_tenant: int = 100,
        block_size: int = DEFAULT_BLOCK_SIZE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min(families_per_tenant, requests_per_family, max_chars, records_per_tenant, block_size) < 1:
            raise ValueError("MissTracker bounds must be >= 1")
        self.families_per_tenant = families_per_tenant
        self.requests_per_family = requests_per_family
        self.max_chars = max_chars
        self.block_size = block_size
        self.records_per_tenant = records_per_tenant
        self._clock = clock
        self._lock = threading.Lock()
        self._families: OrderedDict[tuple[str, str], deque[PromptFacts]] = OrderedDict()
        self._per_tenant: dict[str, int] = {}
        self._latest: dict[tuple[str, str], PromptFacts] = {}  # (tenant, model) -> latest entry
        self._records: dict[str, deque[MissRecord]] = {}
        self._chars = 0

    # -- the request path -----------------------------------------------------------------------------

    def observe(self, tenant: str, body: JsonBody, *, token_ids: Sequence[int] | None = None,
                per_user_vars: tuple[str, ...] = ()) -> Observation:
        """Compare ``body`` (the canonical request as sent to the backend; ``token_ids`` its prompt
        when tokenized here) with its family, then remember it."""
        family = family_key(body)
        now = self._clock()
        facts = PromptFacts.of(body, token_ids=token_ids, block_size=self.block_size, seen_at=now)
        model = str(body.get("model", ""))
        with self._lock:
            history = list(self._families.get((tenant, family), ()))
            fallback = self._latest.get((tenant, model)) if not history else None
            self._remember(tenant, family, model, facts)
        near = near_hit(history or ([fallback] if fallback is not None else []), facts)
        if near is None:
            return Observation(tenant, family, None, 0, facts.prompt_tokens, len(facts.text), self.block_size)
        brk = explain_miss(near, facts, per_user_vars=per_user_vars, now=now, same_family=bool(history))
        return Observation(tenant, family, brk, near.reachable_tokens, facts.prompt_tokens, len(facts.text),
                           self.block_size)

    def settle(self, obs: Observation, *, request_id: str, prompt_tokens: int, cached_tokens: int) -> MissRecord | None:
        """After the request ran: a record when a break cost tokens the near-hit had cached, else None.

        ``tokens_lost`` = the near-hit's reachable full blocks (at most this prompt's length) minus
        what was served from cache. A break that cost nothing (another request had already cached
        the new prefix) is not recorded.
        """
        if obs.brk is None:
            return None
        brk = obs.brk
        reachable = obs.reachable_tokens
        position = brk.token_position if brk.token_position is not None else obs.tokens(brk.position, prompt_tokens)
        if obs.prompt_tokens and obs.prompt_tokens != prompt_tokens:
            # Estimated from text (no token ids here): onto the real count, still on block boundaries.
            scale, bs = prompt_tokens / obs.prompt_tokens, obs.block_size
            reachable, position = int(reachable * scale) // bs * bs, int(position * scale) // bs * bs
        lost = max(0, min(reachable, prompt_tokens) - cached_tokens)
        if lost == 0:
            return None
        rec = MissRecord(
            request_id=request_id, tenant=obs.tenant, family=obs.family, rule=brk.rule, name=brk.name,
            detail=brk.detail, message=brk.message, where=brk.where, position=min(position, prompt_tokens),
            char_position=brk.position, context=brk.context, cached_tokens=cached_tokens,
            prompt_tokens=prompt_tokens, tokens_lost=lost,
        )
        with self._lock:
            records = self._records.setdefault(obs.tenant, deque(maxlen=self.records_per_tenant))
            records.append(rec)
        return rec

    def recent_breaks(self, tenant: str) -> list[MissRecord]:
        """This tenant's latest break records, oldest first (never another tenant's)."""
        with self._lock:
            return list(self._records.get(tenant, ()))

    # -- bookkeeping ----------------------------------------------------------------------------------

    @property
    def stored_chars(self) -> int:
        """Memory units held (characters of rendered prompt plus token ids), at most ``max_chars``."""
        return self._chars

    @property
    def family_count(self) -> int:
        return len(self._families)

    def families_of(self, tenant: str) -> int:
        return self._per_tenant.get(tenant, 0)

    def _remember(self, tenant: str, family: str, model: str, entry: PromptFacts) -> None:
        key = (tenant, family)
        q = self._families.get(key)
        if q is None:
            q = self._families[key] = deque()
            self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
            if self._per_tenant[tenant] > self.families_per_tenant:
                self._evict(next(k for k in self._families if k[0] == tenant))
        self._families.move_to_end(key)
        q.append(entry)
        self._chars += entry.size
        if len(q) > self.requests_per_family:
            self._chars -= q.popleft().size
        self._latest[(tenant, model)] = entry
        while self._chars > self.max_chars and len(self._families) > 1:
            self._evict(next(iter(self._families)))
        if self._chars > self.max_chars:  # one request bigger than the whole budget: keep nothing of it
            self._evict(key)

    def _evict(self, key: tuple[str, str]) -> None:
        q = self._families.pop(key)
        self._chars -= sum(e.size for e in q)
        tenant = key[0]
        self._per_tenant[tenant] -= 1
        if not self._per_tenant[tenant]:
            del self._per_tenant[tenant]
            for k in [k for k in self._latest if k[0] == tenant]:
                del self._latest[k]
            self._records.pop(tenant, None)
        else:
            for k, e in list(self._latest.items()):
                if k[0] == tenant and any(e is x for x in q):
                    del self._latest[k]


def header_value(cached_tokens: int | None, record: MissRecord | None = None, brk: Break | None = None) -> str:
    """``x-prefixgate-cache``: ``cached=N`` and, on a break, ``; break=PC002; detail=timestamp; pos=57``.

    ``pos`` is the break's token position when a record is known, else its character position
    (``char=``), e.g. in streaming headers sent before the engine reports cached tokens.
    """
    parts = [f"cached={cached_tokens}"] if cached_tokens is not None else []
    if record is not None:
        parts += [f"break={record.rule}", f"detail={record.detail}", f"pos={record.position}"]
    elif brk is not None:
        parts += [f"break={brk.rule}", f"detail={brk.detail}", f"char={brk.position}"]
    return "; ".join(parts) or "none"


def break_counter(registry: CollectorRegistry) -> Counter:
    """``prefixgate_cache_breaks_total{tenant,rule}`` in ``registry`` (tenant = the bounded metrics label)."""
    return Counter(
        "prefixgate_cache_breaks_total",
        "Requests that lost cached prefix tokens to a prompt change, by the promptlint rule that explains it",
        ("tenant", "rule"),
        registry=registry,
    )


class MissFields(TypedDict, total=False):
    """The miss columns of a ``UsageRecord`` (its keyword arguments of those names)."""

    miss_rule: str
    miss_position: int
    miss_detail: str
    miss_tokens: int
    miss_family: str
    miss_context: str | None


def usage_fields(record: MissRecord | None) -> MissFields:
    """The ``UsageRecord`` miss fields for ``record`` (all None when the request broke nothing).

    The context (prompt text before the break) goes to the ledger in clear, so it is kept only where it
    is template text: a history edit (PC012) would store the end user's conversation instead.
    """
    if record is None:
        return {}
    context = None if record.rule == "PC012" else record.context
    return {"miss_rule": record.rule, "miss_position": record.position, "miss_detail": record.detail,
            "miss_tokens": record.tokens_lost, "miss_family": record.family, "miss_context": context}
