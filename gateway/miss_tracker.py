"""Which recent request a new one should have shared its prefix with, and why it did not.

Per tenant and per prompt family the tracker keeps the last few requests: their rendered prompt
and their canonical body. A new request is compared with the family's request that shares the most
leading blocks of ``BLOCK_CHARS`` characters (the near-hit); ``promptlint.explain`` then classifies
the first divergence into a rule code. Memory is bounded::

    OrderedDict (tenant, family) -> deque[Entry] (<= requests_per_family), least recently used first
    a tenant holds <= families_per_tenant families; all entries together hold <= max_chars characters
    of rendered prompt (each entry keeps its body and its rendered text: ~2x that in memory)

and the least recently used family goes first when either bound is hit. Tenants are isolated by
construction: every lookup is keyed by tenant id, so a request is only ever compared with its own
tenant's requests, and ``recent_breaks(tenant)`` returns only that tenant's records.

Family = the request's ``prompt_cache_key``, else its ``user``, else the model with the tool names
and the system prompt's first 200 characters, dynamic values masked (so a timestamp on line 1 does
not make every request a family of its own). A request whose family has no history is compared with
the tenant's latest request for the same model, and only a classified break (not ``other``) is kept
from that comparison: an unrelated prompt is no near-hit.

Thread-safe (one lock); the work per request is one render, a C-speed common-prefix compare with each of
the (at most ``requests_per_family``) candidates and, when there is one, one ``explain`` call.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from promptlint.canon import find_dynamic_spans
from promptlint.explain import UNEXPLAINED, Break, Segment, content_text, explain, first_divergence, render

BLOCK_CHARS = 256  # granularity of the engine cache: a near-hit is measured in blocks of this many characters
_FAMILY_LEAD = 200


def shared_blocks(a: str, b: str, block_chars: int = BLOCK_CHARS) -> int:
    """How many leading full blocks of ``block_chars`` characters two rendered prompts share.

    What chained block hashes (the engine's prefix index) would say, without hashing: equal i-th
    hashes mean equal text up to the end of block i, i.e. a common prefix of at least (i+1) blocks.
    """
    return first_divergence(a, b) // block_chars


def family_key(body: dict[str, Any]) -> str:
    """The prompt family a request belongs to (see the module docstring)."""
    for key in ("prompt_cache_key", "user"):
        if isinstance(body.get(key), str) and body[key]:
            return f"{key}:{body[key]}"
    system = ""
    for msg in body.get("messages") or []:
        if isinstance(msg, dict) and msg.get("role") in ("system", "developer"):
            system = content_text(msg.get("content"))
            break
    lead = system[:_FAMILY_LEAD]
    for span in reversed(find_dynamic_spans(lead)):
        lead = lead[: span.start] + f"<{span.kind}>" + lead[span.end :]
    tools = sorted(str((t.get("function") or t).get("name")) for t in body.get("tools") or [] if isinstance(t, dict))
    digest = hashlib.sha256(json.dumps([lead, tools], ensure_ascii=False).encode()).hexdigest()[:16]
    return f"prefix:{body.get('model', '')}:{digest}"


@dataclass
class _Entry:
    body: dict[str, Any]
    text: str  # rendered (promptlint.explain.render) text
    model: str
    reachable: int  # characters before its own input (see _reachable)


@dataclass(frozen=True)
class Observation:
    """What the tracker learned of one request before it ran. ``brk`` is None when nothing broke.

    ``reachable_chars``: how much of the rendered prompt the near-hit could have served had nothing
    broken (the near-hit's prompt up to its own input); ``text_chars``: this prompt's rendered length.
    """

    tenant: str
    family: str
    brk: Break | None
    reachable_chars: int = 0
    text_chars: int = 0

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
    position: int  # token position of the break (estimated from characters when no tokenizer)
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
        block_chars: int = BLOCK_CHARS,
        count_tokens: Callable[[str], int] | None = None,
    ) -> None:
        if min(families_per_tenant, requests_per_family, max_chars, records_per_tenant, block_chars) < 1:
            raise ValueError("MissTracker bounds must be >= 1")
        self.families_per_tenant = families_per_tenant
        self.requests_per_family = requests_per_family
        self.max_chars = max_chars
        self.block_chars = block_chars
        self.records_per_tenant = records_per_tenant
        self._count = count_tokens
        self._lock = threading.Lock()
        self._families: OrderedDict[tuple[str, str], deque[_Entry]] = OrderedDict()
        self._per_tenant: dict[str, int] = {}
        self._latest: dict[tuple[str, str], _Entry] = {}  # (tenant, model) -> latest entry
        self._records: dict[str, deque[MissRecord]] = {}
        self._chars = 0

    # -- the request path -----------------------------------------------------------------------------

    def observe(self, tenant: str, body: dict[str, Any], *, per_user_vars: tuple[str, ...] = ()) -> Observation:
        """Compare ``body`` (the canonical request as sent to the backend) with its family, then remember it."""
        family = family_key(body)
        rendered = render(body)
        entry = _Entry(body, rendered.text, str(body.get("model", "")), _reachable(rendered.segments, len(rendered.text)))
        with self._lock:
            history = list(self._families.get((tenant, family), ()))
            fallback = self._latest.get((tenant, entry.model)) if not history else None
            self._remember(tenant, family, entry)
        candidates = history or ([fallback] if fallback is not None else [])
        if not candidates:
            return Observation(tenant, family, None, 0, len(rendered.text))
        near = max(candidates, key=lambda e: (shared_blocks(e.text, entry.text, self.block_chars), -len(e.text)))
        brk = explain(near.body, body, per_user_vars=per_user_vars, count_tokens=self._count)
        if brk is not None and not history and brk.rule == UNEXPLAINED:
            brk = None  # another family's request that merely came last: no near-hit to explain against
        return Observation(tenant, family, brk, near.reachable, len(rendered.text))

    def settle(self, obs: Observation, *, request_id: str, prompt_tokens: int, cached_tokens: int) -> MissRecord | None:
        """After the request ran: a record when a break cost tokens the near-hit had cached, else None.

        ``tokens_lost`` = the near-hit's reachable prefix (in this prompt's tokens) minus what was served
        from cache. A break that cost nothing (another request had already cached the new prefix) is
        not recorded.
        """
        if obs.brk is None:
            return None
        reachable = obs.tokens(obs.reachable_chars, prompt_tokens)
        lost = max(0, reachable - cached_tokens)
        if lost == 0:
            return None
        brk = obs.brk
        position = brk.token_position if brk.token_position is not None else obs.tokens(brk.position, prompt_tokens)
        rec = MissRecord(
            request_id=request_id, tenant=obs.tenant, family=obs.family, rule=brk.rule, name=brk.name,
            detail=brk.detail, message=brk.message, where=brk.where, position=position,
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
        return self._chars

    @property
    def family_count(self) -> int:
        return len(self._families)

    def families_of(self, tenant: str) -> int:
        return self._per_tenant.get(tenant, 0)

    def _remember(self, tenant: str, family: str, entry: _Entry) -> None:
        key = (tenant, family)
        q = self._families.get(key)
        if q is None:
            q = self._families[key] = deque()
            self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
            if self._per_tenant[tenant] > self.families_per_tenant:
                self._evict(next(k for k in self._families if k[0] == tenant))
        self._families.move_to_end(key)
        q.append(entry)
        self._chars += len(entry.text)
        if len(q) > self.requests_per_family:
            self._chars -= len(q.popleft().text)
        self._latest[(tenant, entry.model)] = entry
        while self._chars > self.max_chars and len(self._families) > 1:
            self._evict(next(iter(self._families)))
        if self._chars > self.max_chars:  # one request bigger than the whole budget: keep nothing of it
            self._evict(key)

    def _evict(self, key: tuple[str, str]) -> None:
        q = self._families.pop(key)
        self._chars -= sum(len(e.text) for e in q)
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


def _reachable(segments: tuple[Segment, ...], length: int) -> int:
    """Characters of a prompt before its own input (its last user/tool message): what the next request
    of the family can reuse."""
    if segments and segments[-1].role in ("user", "tool", "function"):
        return segments[-1].start
    return length


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


def break_counter(registry: Any) -> Any:
    """``prefixgate_cache_breaks_total{tenant,rule}`` in ``registry`` (tenant = the bounded metrics label)."""
    from prometheus_client import Counter

    return Counter(
        "prefixgate_cache_breaks_total",
        "Requests that lost cached prefix tokens to a prompt change, by the promptlint rule that explains it",
        ("tenant", "rule"),
        registry=registry,
    )


def usage_fields(record: MissRecord | None) -> dict[str, Any]:
    """The ``UsageRecord`` miss fields for ``record`` (all None when the request broke nothing).

    The context (prompt text before the break) goes to the ledger in clear, so it is kept only where it
    is template text: a history edit (PC012) would store the end user's conversation instead.
    """
    if record is None:
        return {}
    context = None if record.rule == "PC012" else record.context
    return {"miss_rule": record.rule, "miss_position": record.position, "miss_detail": record.detail,
            "miss_tokens": record.tokens_lost, "miss_family": record.family, "miss_context": context}
