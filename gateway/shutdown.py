"""Graceful shutdown: track the HTTP requests in flight, drain them, end the rest cleanly.

On SIGTERM (or Ctrl-C) the server stops listening at once (uvicorn closes its sockets and the idle
keep-alive connections); ``InFlight.begin_draining`` turns ``/health`` into 503 ``draining`` and
refuses any request that still arrives on an open connection. The requests in flight get
``shutdown_grace_s`` to finish. Those still running then are stopped (``InFlight.stop_all``):
their task is cancelled with a ``RequestStop`` flag set, which the responder (gateway/responder.py)
recognises, so a stream ends with an in-band error event and ``[DONE]`` (or, before its first
token, a 503), and every request writes its ledger row (status ``aborted``). The app's lifespan
waits, bounded, until no request is in flight before it closes the engine and the ledger: a row
written after the ledger closed would be lost without a trace.

The request's ``RequestStop`` reaches the responder through a context variable, set by
``InFlightMiddleware`` in the request's own task (the responder runs in that task).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import socket
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import OpenAIError

log = logging.getLogger("prefixgate.gateway")

# How long stopped requests get to send their end and write their rows before the server gives up
# on them (uvicorn then cancels what is left; the lifespan still waits this long for their rows).
STOP_WINDOW_S = 5.0

SHUTDOWN_MESSAGE = "the server is shutting down and stopped this request before it finished; retry"


def shutdown_error(headers: dict[str, str] | None = None) -> OpenAIError:
    """What a request stopped by the shutdown answers: a 503 clients and SDKs retry."""
    return OpenAIError(503, SHUTDOWN_MESSAGE, type="server_error", code="server_shutting_down", headers=headers)


@dataclass(eq=False)
class RequestStop:
    """One request in flight: its task, and whether the shutdown cancelled it."""

    task: asyncio.Task[object]
    requested: bool = False  # the shutdown cancelled the task
    claimed: bool = False  # the responder took that cancellation back and ends the request itself

    def stop(self) -> None:
        self.requested = True
        self.task.cancel(msg="prefixgate: shutdown grace period over")

    def claim(self) -> bool:
        """Inside ``except CancelledError``: whether this cancellation is the shutdown's alone.

        If so it is taken back (``uncancel``) so the request can still send its end; a cancellation
        from elsewhere too (uvicorn's last resort, a gone client) goes on."""
        if not self.requested or self.claimed or asyncio.current_task() is not self.task:
            return False
        self.claimed = True
        return self.task.uncancel() == 0


CURRENT_REQUEST: contextvars.ContextVar[RequestStop | None] = contextvars.ContextVar(
    "prefixgate_current_request", default=None)


def current_stop() -> RequestStop | None:
    """The ``RequestStop`` of the request this task answers (None outside ``InFlightMiddleware``)."""
    return CURRENT_REQUEST.get()


@dataclass
class InFlight:
    """The requests this process is answering, and whether it is draining."""

    draining: bool = False
    _requests: set[RequestStop] = field(default_factory=set, init=False)
    _changed: asyncio.Event | None = field(default=None, init=False)  # made on first wait, in the serving loop

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, request: RequestStop) -> None:
        self._requests.add(request)

    def discard(self, request: RequestStop) -> None:
        self._requests.discard(request)
        if self._changed is not None and not self._requests:
            self._changed.set()

    def begin_draining(self) -> None:
        self.draining = True

    def reopen(self) -> None:
        """The app's lifespan starts (again): serve. An app object may be started and stopped more
        than once (an embedding host, a test client per test); a past shutdown must not refuse the
        next run's requests."""
        self.draining = False

    def stop_all(self) -> int:
        """Cancel every request still in flight (the grace period is over); how many there were."""
        running = [r for r in self._requests if not r.requested]
        for request in running:
            request.stop()
        return len(running)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight, at most ``timeout_s``; whether none is left."""
        deadline = time.monotonic() + timeout_s
        while self._requests:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._changed = self._changed or asyncio.Event()
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return not self._requests
        return True

    async def stop_after(self, grace_s: float) -> None:
        """The server's drain: wait up to ``grace_s`` for the requests, then stop the rest."""
        if not await self.wait_idle(grace_s):
            self.stop_all()


class InFlightMiddleware:
    """Registers every HTTP request in ``InFlight`` for as long as the app runs it; while draining,
    answers ``/health`` with 503 ``draining`` and refuses new requests with a 503."""

    def __init__(self, app: ASGIApp, inflight: InFlight) -> None:
        self.app = app
        self.inflight = inflight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        inflight = self.inflight
        if inflight.draining:
            await _draining_answer(scope, len(inflight))(scope, receive, send)
            return
        task = asyncio.current_task()
        if task is None:  # not under asyncio (never with uvicorn): nothing to track
            await self.app(scope, receive, send)
            return
        request = RequestStop(task)
        inflight.add(request)
        token = CURRENT_REQUEST.set(request)
        try:
            await self.app(scope, receive, send)
        finally:
            CURRENT_REQUEST.reset(token)
            inflight.discard(request)


def _draining_answer(scope: Scope, inflight: int) -> ASGIApp:
    """A probe learns the process is going away; a request that still got in is told to retry."""
    if scope["path"] == "/health":
        return JSONResponse({"status": "draining", "inflight": inflight}, status_code=503)
    return shutdown_error(headers={"connection": "close", "retry-after": "1"}).response()


class DrainingServer(uvicorn.Server):
    """uvicorn, draining on SIGTERM/Ctrl-C: it stops listening (uvicorn), ``/health`` says draining,
    requests in flight get ``grace_s`` to finish and are then stopped with a proper end and an
    aborted ledger row (``InFlight.stop_after``), before the app's lifespan closes the engine and ledger.
    A second Ctrl-C still forces the exit (uvicorn), without the rows of what was running."""

    def __init__(self, config: uvicorn.Config, inflight: InFlight, grace_s: float) -> None:
        super().__init__(config)
        self.inflight = inflight
        self.grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.inflight.begin_draining()
        if self.inflight:
            log.warning(
                "shutting down: %d request(s) in flight get up to %g s to finish", len(self.inflight), self.grace_s)
        drain = asyncio.create_task(self.inflight.stop_after(self.grace_s))
        try:
            await super().shutdown(sockets)
        finally:
            drain.cancel()
