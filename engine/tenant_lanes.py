"""Per-tenant lanes over a few threads: one tenant's slow jobs never hold up another's.

``AsyncEngine`` prepares a request (chat render, tokenization, validation) off the event loop.
Done on one thread, a tenant's ~1 s chat render (4,000 messages) or 0.4 s encode (1 M characters)
put every other tenant's request behind it. Here each tenant has a lane: at most one of its jobs
runs at a time, the rest wait in its own bounded queue, and ``workers`` threads take the next job
from the tenants that have one, in turn::

    submit(tenant, fn, arg) ─► tenant's lane ──(its turn)──► one of ``workers`` threads: fn(arg)
                               one running, up to            tenants in the order they became
                               ``queued_per_tenant`` waiting ready; a tenant whose job ends
                               (more: ``LaneFullError``)     goes to the back of the line

So while fewer than ``workers`` tenants are busy, a tenant's job starts at once, whatever the
others have queued; with more, it waits for at most one job of each tenant ahead of it. Unlike
the gateway's ``TenantThreads`` (asyncio semaphores, bound to one event loop) the lanes are plain
threads and locks: ``AsyncEngine`` serves callers on any event loop or thread. A tenant's lane
exists only while it has a job running or waiting, so the table never outgrows the busy tenants.
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, Protocol, TypeVar

A = TypeVar("A")
T = TypeVar("T")


class LaneFullError(Exception):
    """The tenant already has ``1 + queued_per_tenant`` jobs in its lane (running or waiting)."""


class LanesClosedError(Exception):
    """``close`` was called: the job was never run."""


class _Waiting(Protocol):
    """A job in a lane, whatever its result type."""

    def cancelled(self) -> bool: ...

    def run(self) -> None: ...

    def refuse(self, exc: BaseException) -> None: ...


class _Job(Generic[T]):
    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn = fn
        self.future: Future[T] = Future()

    def cancelled(self) -> bool:
        return self.future.cancelled()

    def run(self) -> None:
        """``fn()`` into the future, unless its caller cancelled it while it waited."""
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - the caller gets it; the worker keeps serving
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)

    def refuse(self, exc: BaseException) -> None:
        """End a job that never started with ``exc`` (unless its caller already cancelled it)."""
        if self.future.set_running_or_notify_cancel():
            self.future.set_exception(exc)


class TenantLanes:
    def __init__(self, *, workers: int, queued_per_tenant: int, name: str) -> None:
        if workers < 1 or queued_per_tenant < 0:
            raise ValueError("need workers >= 1 and queued_per_tenant >= 0")
        self._queued_per_tenant = queued_per_tenant
        self._cond = threading.Condition()  # guards the four fields below
        self._waiting: dict[bytes, deque[_Waiting]] = {}  # a tenant with a job running or waiting
        self._running: set[bytes] = set()
        # Tenants with a job waiting and none running, in the order they became so (a dict as an
        # ordered set: adding one already there keeps its place).
        self._ready: dict[bytes, None] = {}
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, tenant: bytes, fn: Callable[[A], T], arg: A) -> Future[T]:
        """``fn(arg)`` on a worker once it is ``tenant``'s turn. Raises ``LaneFullError`` at once,
        queuing nothing, when the tenant has ``1 + queued_per_tenant`` jobs in its lane already (one
        to run, the rest to wait behind it); cancelling the future before the job starts takes it
        out of the lane."""
        job = _Job(functools.partial(fn, arg))
        with self._cond:
            if self._closed:
                raise LanesClosedError("the lanes are closed")
            waiting = self._waiting.setdefault(tenant, deque())
            _drop_cancelled(waiting)  # callers gone: their places are free
            in_lane = int(tenant in self._running) + len(waiting)  # whether or not a worker took one yet
            if in_lane > self._queued_per_tenant:
                raise LaneFullError(f"{in_lane} jobs of this tenant are in its lane already")
            waiting.append(job)
            if tenant not in self._running:
                self._ready.setdefault(tenant)
                self._cond.notify()
        return job.future

    def load(self, tenant: bytes) -> tuple[int, int]:
        """(running, waiting) jobs of ``tenant``, not counting waiting ones their callers cancelled."""
        with self._cond:
            waiting = self._waiting.get(tenant, ())
            return int(tenant in self._running), sum(not job.cancelled() for job in waiting)

    def close(self) -> None:
        """Stop taking jobs: those waiting end with ``LanesClosedError``; running ones finish."""
        with self._cond:
            self._closed = True
            refused = [job for waiting in self._waiting.values() for job in waiting]
            self._waiting.clear()
            self._ready.clear()
            self._cond.notify_all()
        for job in refused:
            job.refuse(LanesClosedError("the lanes closed before the job started"))

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._ready and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                tenant = next(iter(self._ready))
                del self._ready[tenant]
                job = self._waiting[tenant].popleft()
                self._running.add(tenant)
            job.run()
            self._done(tenant)

    def _done(self, tenant: bytes) -> None:
        """``tenant``'s job ended: its next one goes to the back of the line, or its lane goes."""
        with self._cond:
            self._running.discard(tenant)
            if self._closed:
                return
            waiting = self._waiting[tenant]
            _drop_cancelled(waiting)
            if waiting:
                self._ready[tenant] = None
                self._cond.notify()
            else:
                del self._waiting[tenant]


def _drop_cancelled(waiting: deque[_Waiting]) -> None:
    live = [job for job in waiting if not job.cancelled()]
    if len(live) != len(waiting):
        waiting.clear()
        waiting.extend(live)
