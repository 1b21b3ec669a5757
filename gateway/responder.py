"""Turn a prepared request into an HTTP response: SSE stream or one JSON body.

Cleanup contract: whatever happens — normal end, engine error, client disconnect — the engine
requests are aborted if unfinished (``run_choices``) and exactly one ledger row is written with
status ok / error / aborted (``Accounting.record``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from engine.protocol import EngineError, RequestOutput
from gateway.formats import ChatFormat, ChoiceText, CompletionFormat, WireFormat
from gateway.pipeline import Accounting, Prepared, engine_failure, run_choices
from gateway.routing import Router


class OutputError(EngineError):
    """A request the engine finished with ``finish_reason="error"``."""


def _check(out: RequestOutput) -> None:
    if out.finish_reason == "error" or out.error:
        raise OutputError(out.error or "the engine failed while generating")
    if out.finish_reason == "abort":  # only the engine aborts on its own (e.g. shutting down)
        exc = OutputError("the engine stopped this request (it is shutting down); retry")
        exc.status, exc.code = 503, "engine_unavailable"
        raise exc


async def respond(prep: Prepared, router: Router, acct: Accounting, receive: Receive,
                  fmt: WireFormat | None = None) -> Response:
    """``receive`` is the request's ASGI receive (its body already read: only a disconnect is left
    to come). ``fmt`` shapes the body (default: the chat or completions format of ``prep.kind``);
    the Responses and Messages doors pass their own."""
    if fmt is None:
        fmt = ChatFormat(prep) if prep.kind == "chat" else CompletionFormat(prep)
    if prep.stream:
        return await _stream_response(prep, router, acct, fmt, receive)
    return await _whole(prep, router, acct, fmt, receive)


class _Disconnected(Exception):
    """The client went away before the first output."""


Indexed = tuple[int, RequestOutput]  # (choice index, one engine increment of it)


async def _first_or_disconnect(outputs: AsyncIterator[Indexed], receive: Receive) -> Indexed | None:
    """The first output (None if the stream is empty), raising ``_Disconnected`` if the client leaves first."""
    first = asyncio.ensure_future(anext(outputs, None))
    gone = asyncio.create_task(_wait_disconnect(receive))
    try:
        await asyncio.wait({first, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not first.done():
            raise _Disconnected
        return first.result()
    finally:
        gone.cancel()
        if not first.done():
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)


async def _stream_response(prep: Prepared, router: Router, acct: Accounting, fmt: WireFormat,
                           receive: Receive) -> Response:
    """An SSE response whose status line waits for the first output or the error (issue 17).

    A backend that fails before its first token (rate-limited upstream, engine overloaded,
    prompt too long for a node) answers with its real HTTP status, so SDK retries work; only an
    error after the first token goes in-band, as OpenAI does.
    """
    outputs = run_choices(prep, router)
    try:
        first = await _first_or_disconnect(outputs, receive)
        if first is not None:
            _check(first[1])
    except _Disconnected:
        await outputs.aclose()
        acct.record("aborted")
        return _client_gone()
    except BaseException as exc:
        await outputs.aclose()
        acct.record("error")
        if isinstance(exc, asyncio.CancelledError):
            raise
        raise engine_failure(exc) from None
    try:
        headers = {**prep.headers, "cache-control": "no-cache", "x-accel-buffering": "no"}
        return EventStream(_stream(prep, acct, fmt, outputs, first), headers=headers)
    except BaseException:
        await outputs.aclose()
        acct.record("error")
        raise


class EventStream(Response):
    """A server-sent-events body, sent by one task while a second one waits for a disconnect.

    Starlette's ``StreamingResponse`` does the same with an anyio task group under ASGI 2.3 (what
    uvicorn speaks), ~60 more Python calls per stream; plain asyncio does here. A client that goes
    away cancels the sender, whose generator then closes ``run_choices`` (aborting the engine
    requests) and writes the ledger row as aborted."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes], headers: dict[str, str]) -> None:
        self.chunks = chunks
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_all() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        work = asyncio.create_task(send_all())
        gone = asyncio.create_task(_wait_disconnect(receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        if not work.cancelled():
            work.result()  # a failure while sending is the server's, as it was under Starlette


async def _stream(prep: Prepared, acct: Accounting, fmt: WireFormat, outputs: AsyncIterator[Indexed],
                  first: Indexed | None) -> AsyncIterator[bytes]:
    status = "aborted"  # if the client leaves, the generator is cancelled before status changes
    try:
        # aclosing: leaving early (disconnect, error) must close run_choices now, which aborts the
        # engine requests, before the ledger row is written below.
        async with aclosing(outputs):
            if first is not None:
                acct.observe(*first)
                for chunk in fmt.chunks(*first):
                    yield fmt.frame(chunk)
            async for i, out in outputs:
                _check(out)
                acct.observe(i, out)
                for chunk in fmt.chunks(i, out):
                    yield fmt.frame(chunk)
        tail = fmt.tail(acct.usage_dict())
        status = "ok"
        for frame in tail:
            yield frame
    except Exception as exc:  # noqa: BLE001 - the status line is sent: report in-band, as OpenAI does
        status = "error"
        for frame in fmt.error_frames(engine_failure(exc)):
            yield frame
    finally:
        acct.record(status)


async def _wait_disconnect(receive: Receive) -> None:
    """Return when the client goes away (the body is already read, so only disconnect is left)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _client_gone() -> JSONResponse:
    return JSONResponse({"error": {"message": "client disconnected", "type": "server_error",
                                   "param": None, "code": "client_closed_request"}}, status_code=499)


async def _whole(prep: Prepared, router: Router, acct: Accounting, fmt: WireFormat, receive: Receive) -> JSONResponse:
    acc = ChoiceText(prep)

    async def collect() -> None:
        async with aclosing(run_choices(prep, router, one_task=True)) as outputs:  # all in this task
            async for i, out in outputs:
                _check(out)
                acct.observe(i, out)
                acc.add(i, out)

    work = asyncio.create_task(collect())
    gone = asyncio.create_task(_wait_disconnect(receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # client disconnected: cancelling the work aborts the engine requests
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            acct.record("aborted")
            return _client_gone()
        exc = work.exception()
        if exc is not None:
            acct.record("error")
            raise engine_failure(exc)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
    # Build the whole response before the row says "ok": a response that cannot be rendered is an error.
    try:
        usage = acct.usage_dict()
        acct.settle()  # cached tokens and the settled break feed the headers
        response = JSONResponse(fmt.whole(acc, usage), headers=prep.headers)
    except BaseException:
        acct.record("error")
        raise
    acct.record("ok")
    return response
