"""Run a request's CPU-heavy steps off the event loop, with a per-tenant bound on the threads.

Tokenizing a long prompt (seconds for megabytes of text), or canonicalizing one in ``reorder``
mode (0.7 s for 1.3 M characters), on the event loop froze ``/health`` and every other tenant's
stream (issue 16.2). These steps run in a small thread pool instead; each tenant may hold at most
``per_tenant`` of its ``workers`` at a time, so one tenant sending many large prompts queues
behind itself, not in front of everyone else::

    request ─► tenant semaphore (per_tenant) ─► shared limiter (workers) ─► thread: fn(*args)
               (waits here without holding a                               (bounded by the
                worker while its tenant is busy)                            ingress char limit)

A tenant's steps waiting at its semaphore are bounded too (``queued_per_tenant``): each holds its
request's body (up to the 4 MiB body limit), so an unbounded queue let one tenant pile up memory
and work that runs long after its clients gave up. Beyond the bound a step is refused at once
with a 429 (``too_many_pending_requests``, ``Retry-After: 1``), nothing queued.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import anyio

from gateway.errors import OpenAIError

T = TypeVar("T")


class TenantThreads:
    def __init__(self, *, workers: int = 2, per_tenant: int = 1, queued_per_tenant: int = 64) -> None:
        if not 1 <= per_tenant <= workers:
            raise ValueError("need 1 <= per_tenant <= workers")
        if queued_per_tenant < 0:
            raise ValueError("need queued_per_tenant >= 0")
        self._limiter = anyio.CapacityLimiter(workers)
        self._per_tenant = per_tenant
        self._queued_per_tenant = queued_per_tenant
        # One semaphore per authenticated tenant id: as many entries as tenants, never per request.
        self._tenants: dict[str, asyncio.Semaphore] = {}
        # Steps of a tenant running or waiting for its semaphore (only tenants with one: touched on
        # the event loop alone, so no lock).
        self._pending: dict[str, int] = {}

    async def run(self, tenant_id: str, fn: Callable[..., T], *args: object, refusable: bool = True) -> T:
        """``fn(*args)`` in a worker thread, once ``tenant_id`` has a free slot and the pool a free
        worker. Raises ``OpenAIError`` (429) at once when the tenant already has ``per_tenant``
        steps running and ``queued_per_tenant`` waiting, unless ``refusable`` is False: a step that
        finishes work already done (storing a generated response) waits its turn but is never
        refused, so the bound on new work cannot throw an answer away. Such a step holds no body
        that was not already held, so it adds nothing the bound exists to cap."""
        pending = self._pending.get(tenant_id, 0)
        if refusable and pending >= self._per_tenant + self._queued_per_tenant:
            raise OpenAIError(429, f"too many of your requests are waiting to be prepared ({pending}); retry shortly",
                              code="too_many_pending_requests", headers={"retry-after": "1"})
        self._pending[tenant_id] = pending + 1
        gate = self._tenants.setdefault(tenant_id, asyncio.Semaphore(self._per_tenant))
        try:
            async with gate:
                return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        finally:
            left = self._pending[tenant_id] - 1
            if left:
                self._pending[tenant_id] = left
            else:
                del self._pending[tenant_id]

    def pending(self, tenant_id: str) -> int:
        """Steps of ``tenant_id`` running or waiting."""
        return self._pending.get(tenant_id, 0)
