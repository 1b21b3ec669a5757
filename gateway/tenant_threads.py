"""Run a request's CPU-heavy steps off the event loop, with a per-tenant bound on the threads.

Tokenizing a long prompt (seconds for megabytes of text), or canonicalizing one in ``reorder``
mode (0.7 s for 1.3 M characters), on the event loop froze ``/health`` and every other tenant's
stream (issue 16.2). These steps run in a small thread pool instead; each tenant may hold at most
``per_tenant`` of its ``workers`` at a time, so one tenant sending many large prompts queues
behind itself, not in front of everyone else::

    request ─► tenant semaphore (per_tenant) ─► shared limiter (workers) ─► thread: fn(*args)
               (waits here without holding a                               (bounded by the
                worker while its tenant is busy)                            ingress char limit)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import anyio

T = TypeVar("T")


class TenantThreads:
    def __init__(self, *, workers: int = 2, per_tenant: int = 1) -> None:
        if not 1 <= per_tenant <= workers:
            raise ValueError("need 1 <= per_tenant <= workers")
        self._limiter = anyio.CapacityLimiter(workers)
        self._per_tenant = per_tenant
        # One semaphore per authenticated tenant id: as many entries as tenants, never per request.
        self._tenants: dict[str, asyncio.Semaphore] = {}

    async def run(self, tenant_id: str, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in a worker thread, once ``tenant_id`` has a free slot and the pool a free worker."""
        gate = self._tenants.setdefault(tenant_id, asyncio.Semaphore(self._per_tenant))
        async with gate:
            return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)
