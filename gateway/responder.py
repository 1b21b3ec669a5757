"""Turn a prepared request into an HTTP response: SSE stream or one JSON body.

Cleanup contract: whatever happens — normal end, engine error, client disconnect — the engine
requests are aborted if unfinished (``run_choices``) and exactly one ledger row is written with
status ok / error / aborted (``Accounting.record``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.protocol import EngineError
from gateway.formats import ChatFormat, ChoiceText, CompletionFormat
from gateway.pipeline import Accounting, Prepared, engine_failure, run_choices
from gateway.routing import Router


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class OutputError(EngineError):
    """A request the engine finished with ``finish_reason="error"``."""


def _check(out: Any) -> None:
    if out.finish_reason == "error" or out.error:
        raise OutputError(out.error or "the engine failed while generating")
    if out.finish_reason == "abort":  # only the engine aborts on its own (e.g. shutting down)
        exc = OutputError("the engine stopped this request (it is shutting down); retry")
        exc.status, exc.code = 503, "engine_unavailable"
        raise exc


async def respond(prep: Prepared, router: Router, acct: Accounting, request: Request) -> Any:
    fmt = ChatFormat(prep) if prep.kind == "chat" else CompletionFormat(prep)
    if prep.stream:
        return StreamingResponse(
            _stream(prep, router, acct, fmt), media_type="text/event-stream",
            headers={**prep.headers, "cache-control": "no-cache", "x-accel-buffering": "no"},
        )
    return await _whole(prep, router, acct, fmt, request)


async def _stream(prep: Prepared, router: Router, acct: Accounting, fmt: Any) -> AsyncIterator[bytes]:
    status = "aborted"  # if the client leaves, the generator is cancelled before status changes
    try:
        # aclosing: leaving early (disconnect, error) must close run_choices now, which aborts the
        # engine requests, before the ledger row is written below.
        async with aclosing(run_choices(prep, router)) as outputs:
            async for i, out in outputs:
                _check(out)
                acct.observe(i, out)
                for chunk in fmt.chunks(i, out):
                    yield _sse(chunk)
        if prep.include_usage:
            yield _sse(fmt.usage_chunk(acct.usage_dict()))
        status = "ok"
        yield b"data: [DONE]\n\n"
    except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band, as OpenAI does
        status = "error"
        yield _sse(engine_failure(exc).body())
        yield b"data: [DONE]\n\n"
    finally:
        acct.record(status)


async def _wait_disconnect(request: Request) -> None:
    """Return when the client goes away (the body is already read, so only disconnect is left)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _whole(prep: Prepared, router: Router, acct: Accounting, fmt: Any, request: Request) -> JSONResponse:
    acc = ChoiceText(prep)

    async def collect() -> None:
        async with aclosing(run_choices(prep, router)) as outputs:
            async for i, out in outputs:
                _check(out)
                acct.observe(i, out)
                acc.add(i, out)

    work = asyncio.create_task(collect())
    gone = asyncio.create_task(_wait_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # client disconnected: cancelling the work aborts the engine requests
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            acct.record("aborted")
            return JSONResponse({"error": {"message": "client disconnected", "type": "server_error",
                                           "param": None, "code": "client_closed_request"}}, status_code=499)
        exc = work.exception()
        if exc is not None:
            acct.record("error")
            raise engine_failure(exc)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
    acct.record("ok")
    return JSONResponse(fmt.whole(acc, acct.usage_dict()), headers=prep.headers)
