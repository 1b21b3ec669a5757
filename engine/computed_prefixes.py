"""Which prefixes prefill computes most often, per tenant, in bounded memory: the panel's "where the
cache does not pay", counted by block hash.

What is counted: for each request, on its first admission, the hash of the first full prompt block
it had to compute (the block right after its cache hit). A block hash chains over the whole prefix
up to and including that block (``h_i = H(h_{i-1} || tokens_i)``, seeded by the namespace), so one
value names one exact prefix *and* the point where the cache stopped serving it: the same value
counted again and again is a prefix that keeps being recomputed (evicted, below its tier's cost
threshold, or broken by something a template puts first). The hash of the first prompt block
would instead count only requests with no hit at all, and the deepest block would name each
request's own tail (distinct almost every time). Requests that computed no full prompt block (a
full hit, or a prompt shorter than a block) count nothing: they cost at most one block.

How: one space-saving counter (Metwally, Agrawal, El Abbadi 2005) per tenant, ``capacity``
entries each. Counts only grow by one, so the "stream summary" (keys grouped by count) makes
every update O(1): a tracked key moves to the next count's group; an untracked key, when the table
is full, replaces the oldest key of the smallest count and inherits that count (+1) as its
``error``. Guarantees: every key whose true count exceeds (total / capacity) is tracked, and
``count - error <= true count <= count``. Below ``capacity`` distinct keys the counts are exact.

Thread-safety: none; the engine's step thread owns it (``stats()`` snapshots run there too).
This module imports only the standard library.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class HeavyHitter(Generic[K]):
    """One tracked key: ``count`` over-estimates its true count by at most ``error``."""

    key: K
    count: int
    error: int


class SpaceSaving(Generic[K]):
    """The most frequent keys of a stream in ``capacity`` entries, O(1) per ``add``."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.total = 0  # keys added, tracked or not
        self._count: dict[K, int] = {}
        self._error: dict[K, int] = {}
        # count -> its keys, oldest first (a dict keeps insertion order; values unused)
        self._by_count: dict[int, dict[K, None]] = {}
        self._min = 0  # smallest count of a tracked key (0 while empty)

    def __len__(self) -> int:
        return len(self._count)

    def add(self, key: K) -> None:
        self.total += 1
        count = self._count.get(key)
        if count is not None:
            self._move(key, count, count + 1)
            return
        if len(self._count) < self.capacity:
            self._count[key], self._error[key] = 1, 0
            self._by_count.setdefault(1, {})[key] = None
            self._min = 1
            return
        group = self._by_count[self._min]
        victim = next(iter(group))  # the oldest key of the smallest count
        floor = self._min
        del self._count[victim], self._error[victim]
        del group[victim]
        if not group:
            del self._by_count[floor]
        self._count[key], self._error[key] = floor + 1, floor
        self._by_count.setdefault(floor + 1, {})[key] = None
        if floor not in self._by_count:
            self._min = floor + 1

    def _move(self, key: K, old: int, new: int) -> None:
        group = self._by_count[old]
        del group[key]
        if not group:
            del self._by_count[old]
            if self._min == old:
                self._min = new  # counts grow by one: nothing lies between old and new
        self._by_count.setdefault(new, {})[key] = None
        self._count[key] = new

    def top(self, n: int) -> list[HeavyHitter[K]]:
        """The ``n`` largest counts, largest first (ties: the key that reached the count first)."""
        out: list[HeavyHitter[K]] = []
        for count in sorted(self._by_count, reverse=True):
            for key in self._by_count[count]:
                out.append(HeavyHitter(key, count, self._error[key]))
                if len(out) == n:
                    return out
        return out

    def check_integrity(self) -> None:
        """Raise AssertionError if the groups disagree with the counts (tests call it)."""
        assert len(self._count) <= self.capacity
        assert sum(len(g) for g in self._by_count.values()) == len(self._count)
        for count, group in self._by_count.items():
            assert group and all(self._count[k] == count for k in group)
        assert self._min == (min(self._by_count) if self._by_count else self._min)


class ComputedPrefixes:
    """Per tenant, a ``SpaceSaving`` of the leading computed block hash (see the module doc).

    Keyed by ``TenantScope.tenant_key`` (in hex: one per tenant), not by the metrics label: labels are cut
    names, and two tenants sharing one must never see each other's counts. Keys are bounded by
    tenancy, so memory is at most tenants x ``capacity`` entries.
    """

    def __init__(self, capacity: int = 32) -> None:
        self.capacity = capacity
        self._by_tenant: dict[str, SpaceSaving[bytes]] = {}
        self._labels: dict[str, str] = {}  # tenant key -> its metrics label, for display

    def observe(self, tenant_key: str, label: str, block_hashes: Sequence[bytes], num_prompt_tokens: int,
                num_cached_tokens: int, block_size: int) -> None:
        """Count the first full prompt block computed by one request (nothing if it computed none)."""
        first = num_cached_tokens // block_size
        if first >= num_prompt_tokens // block_size or first >= len(block_hashes):
            return
        counter = self._by_tenant.get(tenant_key)
        if counter is None:
            counter = self._by_tenant[tenant_key] = SpaceSaving(self.capacity)
        self._labels[tenant_key] = label
        counter.add(block_hashes[first])

    def top(self, n: int = 10, hex_chars: int = 12) -> dict[str, dict[str, str | list[dict[str, int | str]]]]:
        """JSON-ready: tenant key -> ``{"tenant": label, "prefixes": [...]}``, its ``n`` most computed
        prefixes as ``{"hash": hex prefix, "count", "error"}`` (a short hex prefix of the hash: never
        tokens or text)."""
        return {key: {"tenant": self._labels[key],
                      "prefixes": [{"hash": h.key.hex()[:hex_chars], "count": h.count, "error": h.error}
                                   for h in counter.top(n)]}
                for key, counter in self._by_tenant.items()}
