"""Turn a prepared request into an HTTP response: SSE stream or one JSON body.

Cleanup contract: whatever happens — normal end, engine error, client disconnect, shutdown — the engine
requests are aborted if unfinished (``run_choices``) and exactly one ledger row is written with
status ok / error / aborted (``Accounting.record``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from types import TracebackType

from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from engine.protocol import (
    EngineError,
    GrammarQueueFullError,
    OutputFailure,
    RequestOutput,
    UnenforceableSchemaError,
)
from gateway.errors import OpenAIError
from gateway.formats import ChatFormat, ChoiceText, CompletionFormat, WireFormat
from gateway.pipeline import Accounting, Prepared, engine_failure, run_choices
from gateway.ports import UsageStatus
from gateway.routing import Router
from gateway.shutdown import current_stop, shutdown_error
from gateway.wire_json import utf8_json


class OutputError(EngineError):
    """A request the engine finished with ``finish_reason="error"``."""


def _check(out: RequestOutput) -> None:
    if out.failure is OutputFailure.GRAMMAR_DEAD_END:  # the schema's fault, not the server's: a 400
        raise UnenforceableSchemaError(out.error or "the JSON schema's grammar could not continue the output")
    if out.finish_reason == "error" or out.error:
        raise OutputError(out.error or "the engine failed while generating")
    if out.finish_reason == "abort":  # only the engine aborts on its own (e.g. shutting down)
        exc = OutputError("the engine stopped this request (it is shutting down); retry")
        exc.status, exc.code = 503, "engine_unavailable"
        raise exc


def _client_error(prep: Prepared, exc: BaseException) -> OpenAIError:
    """``exc`` as the error the client sees. A schema the engine cannot enforce (or cannot compile
    yet: too many of the tenant's waiting) names the field it came from: the forced tool call's
    ``tools`` when tool calls are parsed (a JSON ``response_format`` turns parsing off), else the
    door's response format field; the engine's other errors name the door's own fields
    (``engine_failure``)."""
    error = engine_failure(exc, prep.fields)
    if isinstance(exc, (UnenforceableSchemaError, GrammarQueueFullError)) and error.param is None:
        error.param = "tools" if prep.tool_parsing else prep.fields.response_format
    return error


async def respond(prep: Prepared, router: Router, acct: Accounting, receive: Receive,
                  fmt: WireFormat | None = None, render_error: ErrorRenderer = OpenAIError.response) -> Response:
    """``receive`` is the request's ASGI receive (its body already read: only a disconnect is left
    to come). ``fmt`` shapes the body (default: the chat or completions format of ``prep.kind``);
    the Responses and Messages doors pass their own, and ``render_error`` (a stream's error before
    its first token is answered by the response itself, in the shape the door's clients read)."""
    if fmt is None:
        fmt = ChatFormat(prep) if prep.kind == "chat" else CompletionFormat(prep)
    if prep.stream:
        return EventStream(prep, router, acct, fmt, render_error)
    return await _whole(prep, router, acct, fmt, receive)


Indexed = tuple[int, RequestOutput]  # (choice index, one engine increment of it)
ErrorRenderer = Callable[[OpenAIError], Response]


class EventStream(Response):
    """A server-sent-events answer whose status line waits for the first output or the error (issue 17).

    A backend that fails before its first token (rate-limited upstream, engine overloaded, prompt
    too long for a node) answers with its real HTTP status, so SDK retries work; only an error
    after the first token goes in-band, as OpenAI does.

    The request's own task runs the choices and sends (so one choice needs no pump task:
    ``run_choices``' ``one_task``); a ``ClientWatch`` cancels it when the client goes away, which
    closes ``run_choices`` (aborting the engine requests) before the ledger row says aborted.
    Starlette's ``StreamingResponse`` would add an anyio task group, ~60 Python calls a stream.
    """

    media_type = "text/event-stream"

    def __init__(self, prep: Prepared, router: Router, acct: Accounting, fmt: WireFormat,
                 render_error: ErrorRenderer) -> None:
        self.prep, self.router, self.acct, self.fmt, self.render_error = prep, router, acct, fmt, render_error
        self.status_code = 200
        self.background = None
        self.started = False  # the status line is out
        self.init_headers({})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with ClientWatch(receive) as watch:
            await self._run(scope, receive, send)
        # A failure while sending is the server's, as it was under Starlette: ClientWatch lets it
        # through; a client that left before the status line gets its 499 (the row says aborted).
        if watch.left and not self.started:
            await _client_gone()(scope, receive, send)

    async def _run(self, scope: Scope, receive: Receive, send: Send) -> None:
        prep, acct = self.prep, self.acct
        status: UsageStatus = "aborted"  # if the client leaves, this task is cancelled before status changes
        refusal: OpenAIError | None = None
        stop = current_stop()
        try:
            # aclosing: leaving early (disconnect, error, shutdown) must close run_choices now, which
            # aborts the engine requests, before the stream's end and the ledger row below.
            async with aclosing(run_choices(prep, self.router, one_task=True, on_abort=acct.aborted)) as outputs:
                try:
                    first = await anext(outputs, None)
                    if first is not None:
                        _check(first[1])
                except Exception as exc:  # noqa: BLE001 - nothing sent yet: a real status line
                    refusal, status = _client_error(prep, exc), "error"
                if refusal is None:
                    status = await self._events(send, outputs, first)
        except asyncio.CancelledError:
            # The shutdown's grace period is over (gateway/shutdown.py): end the stream properly,
            # the row stays "aborted". Any other cancellation (client gone, hard stop) goes on.
            if stop is None or not stop.claim():
                raise
            if self.started:
                await send({"type": "http.response.body", "body": b"".join(self.fmt.error_frames(shutdown_error())),
                            "more_body": False})
            else:
                refusal = shutdown_error()
        finally:
            acct.record(status)
        if refusal is not None:
            await self.render_error(refusal)(scope, receive, send)

    async def _events(self, send: Send, outputs: AsyncIterator[Indexed], first: Indexed | None) -> UsageStatus:
        """Send the status line and every event; the ledger status the stream ended with."""
        prep, acct, fmt = self.prep, self.acct, self.fmt
        self.init_headers({**prep.headers, "cache-control": "no-cache", "x-accel-buffering": "no"})
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        self.started = True
        status: UsageStatus = "ok"
        try:
            if first is not None:
                acct.observe(*first)
                await _send_events(send, fmt, *first)
            async for i, out in outputs:
                _check(out)
                acct.observe(i, out)
                await _send_events(send, fmt, i, out)
            tail = fmt.tail(acct.usage_dict())
            await fmt.finalize()
        except Exception as exc:  # noqa: BLE001 - the status line is sent: report in-band, as OpenAI does
            status, tail = "error", fmt.error_frames(_client_error(prep, exc))
        # The tail (usage, [DONE]) ends the body in the same message: one write, not one per frame.
        await send({"type": "http.response.body", "body": b"".join(tail), "more_body": False})
        return status


async def _send_events(send: Send, fmt: WireFormat, i: int, out: RequestOutput) -> None:
    """The events of one engine increment of choice ``i`` (a chat stream's first has two: the role,
    then the text) in one body message: each message is a write to the socket. Nothing is held
    back for a later increment, so no event goes out later than it did one message apiece."""
    chunks = fmt.chunks(i, out)
    if chunks:
        await send({"type": "http.response.body", "body": b"".join(map(fmt.frame, chunks)), "more_body": True})


async def _wait_disconnect(receive: Receive) -> None:
    """Return when the client goes away (the body is already read, so only disconnect is left)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClientWatch:
    """Cancels the current task if the client disconnects while the ``with`` block runs.

    The work stays in the request's own task and one watcher task waits on ``receive``: running
    the work in a task of its own as well cost a second task and an ``asyncio.wait`` per request
    (issue 17). The cancellation is the watch's own: ``__exit__`` takes it back (``uncancel``) and
    swallows the ``CancelledError`` it caused, unless the task was also cancelled from elsewhere
    (server shutdown), which goes on. ``gone``: the client left during the block; ``left``: and
    the block ended by that cancellation.
    """

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._active = False
        self.gone = False
        self.left = False

    def __enter__(self) -> ClientWatch:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("ClientWatch needs a running task")
        self._task = task
        self._watcher = asyncio.create_task(_wait_disconnect(self._receive))
        self._watcher.add_done_callback(self._on_watcher_done)
        self._active = True
        return self

    def _on_watcher_done(self, watcher: asyncio.Task[None]) -> None:
        # The flag, not remove_done_callback: a watcher that finished just before the block ended
        # may already have this call scheduled, and a late cancel would hit the response's send.
        if self._active and not watcher.cancelled():
            self.gone = True
            self._task.cancel()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        self._active = False
        self._watcher.cancel()
        if not self.gone or self._task.uncancel() > 0:
            return False
        self.left = exc_type is not None and issubclass(exc_type, asyncio.CancelledError)
        return self.left


def _client_gone() -> JSONResponse:
    return JSONResponse({"error": {"message": "client disconnected", "type": "server_error",
                                   "param": None, "code": "client_closed_request"}}, status_code=499)


class WholeResponse(JSONResponse):
    """A whole JSON response: Starlette's ``JSONResponse`` with the same body bytes, written by
    ``wire_json.utf8_json`` (Rust for plain JSON values, the stdlib for the rest)."""

    def render(self, content: object) -> bytes:
        return utf8_json(content)


async def _whole(prep: Prepared, router: Router, acct: Accounting, fmt: WireFormat, receive: Receive) -> JSONResponse:
    acc = ChoiceText(prep)
    failure: Exception | None = None
    with ClientWatch(receive) as watch:
        try:
            async with aclosing(run_choices(prep, router, one_task=True, on_abort=acct.aborted)) as outputs:
                async for i, out in outputs:
                    _check(out)
                    acct.observe(i, out)
                    acc.add(i, out)
        except Exception as exc:  # noqa: BLE001 - answered below, unless the client has left
            failure = exc
        except asyncio.CancelledError:
            acct.record("aborted")  # before the lifespan closes the ledger, however the cancel ends
            stop = current_stop()
            if not watch.gone and stop is not None and stop.claim():  # the shutdown's grace is over
                raise shutdown_error() from None
            raise
    if watch.gone:  # the client disconnected: leaving run_choices aborted the engine requests
        acct.record("aborted")
        return _client_gone()
    if failure is not None:
        acct.record("error")
        raise _client_error(prep, failure)
    # Build the whole response before the row says "ok": a response that cannot be rendered is an error.
    try:
        usage = acct.usage_dict()
        acct.settle()  # cached tokens and the settled break feed the headers
        response = WholeResponse(fmt.whole(acc, usage), headers=prep.headers)
        await fmt.finalize()
    except BaseException:
        acct.record("error")
        raise
    acct.record("ok")
    return response
