"""``AsyncEngine``: an ``EngineClient`` that runs ``LLMEngine``'s step loop in a background thread.

    event loop (gateway)                         engine thread
    ---------------------                        -------------
    generate(req): prepare (tokenize, validate:
                   in its tenant's prepare lane for
                   text; a grammar's compile awaited
                   here)
                   queue "add" + wake  ───────►  drain adds/aborts
                                                 step() while requests are unfinished
    await per-request asyncio.Queue  ◄─────────  loop.call_soon_threadsafe(queue.put_nowait, out)
    iterator cancelled (client gone)
                   queue "abort" + wake ───────► engine.abort(id): blocks freed; how far its
                                                 prompt got kept for ``abort``'s caller
    await abort(id)  ◄─────────────────────────  its AbortReport (between two steps)
                                                 idle: sleeps on an Event (never busy-spins)

Only the engine thread touches the ``LLMEngine`` after construction, but for ``prepare_nowait``
(thread-safe: tokenization in the prepare lanes and ``count_prompt_tokens`` borrows its own
tokenizer copy, ``engine.tokenizer_pool``; the grammar compiler and the cache timer lock). ``stats`` reads a
snapshot the thread publishes after every step, so it never waits for a step to end.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from engine.guided import await_compiled
from engine.llm_engine import LLMEngine, PreparedRequest, grammar_refusals
from engine.protocol import (
    AbortReport,
    EngineError,
    EngineOverloadedError,
    GenerateRequest,
    InvalidRequestError,
    ModelCard,
    PrepareQueueFullError,
    RequestOutput,
    TenantScope,
)
from engine.request import Request
from engine.tenant_lanes import LaneFullError, LanesClosedError, TenantLanes

log = logging.getLogger(__name__)
T = TypeVar("T")

# Reports of requests stopped while nobody read their stream (the consumer had closed it): kept for
# the ``abort`` call that follows; past this many the oldest go (a caller that never asked).
_KEPT_REPORTS = 4096
# How long ``abort`` waits for the engine thread (one step, normally) before answering "unknown".
_ABORT_REPORT_WAIT_S = 10.0


class EngineShutDownError(EngineError):
    status = 503
    code = "engine_shut_down"


class AsyncEngine:
    """Implements ``engine.protocol.EngineClient``. Build it with ``engine.launch.build_engine``."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        engine.warm_up()  # serving starts with the grammar/logprob vocabulary built (engine.guided)
        self._lock = threading.Lock()  # guards the three fields below
        self._adds: list[Request] = []
        self._aborts: list[str] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]] = {}
        self._calls: list[tuple[Callable[[LLMEngine], Any], Future[Any]]] = []  # run between steps
        self._reports: OrderedDict[str, AbortReport] = OrderedDict()  # engine thread only
        self._wake = threading.Event()
        self._stopping = False
        self._snapshot: dict[str, Any] = engine.stats()
        # Threads that prepare the requests that need it (text prompts, grammars, logprobs), one
        # at a time per tenant (engine.tenant_lanes): a gateway tokenizes in its own per-tenant
        # threads and hands ids, but a node's, the CLI's and a library caller's text comes here.
        # A grammar's compile is waited for on the event loop, never in a lane (``prepare``).
        self._lanes = TenantLanes(workers=engine.config.prepare_workers,
                                  queued_per_tenant=engine.config.prepare_queued_per_tenant,
                                  name="prefixgate-prepare")
        self._thread = threading.Thread(target=self._run, name="prefixgate-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ EngineClient

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        if self._stopping:
            raise EngineShutDownError("the engine is shutting down")
        req = await self.prepare(request)  # raises PromptTooLongError & co before anything is queued
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        with self._lock:
            if request.request_id in self._streams:
                raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
            if self._snapshot["waiting"] + len(self._adds) >= self.engine.config.max_waiting:
                raise EngineOverloadedError(
                    f"the engine has {self.engine.config.max_waiting} requests waiting; retry later"
                )
            self._streams[request.request_id] = (loop, queue)
            self._adds.append(req)
        self._wake.set()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            with self._lock:
                self._streams.pop(request.request_id, None)
                if not finished:  # cancelled or closed early: free its blocks
                    self._aborts.append(request.request_id)
            if not finished:
                self._wake.set()

    async def prepare(self, request: GenerateRequest) -> Request:
        """Tokenize and validate in the request's tenant's prepare lane, then wait for a guided
        request's grammar here, on the event loop. Raises what ``LLMEngine.prepare`` raises, and
        ``PrepareQueueFullError`` (429) when its tenant has too many requests waiting there.

        Text can take seconds to tokenize: off the event loop, so it keeps serving (issue 16.2),
        and in the tenant's own lane, so one tenant's 1 s chat render never queues another's
        request behind it; token ids alone only need a bounds check, cheaper than the thread hop.
        The lane only starts a grammar's compile (per-tenant compile workers, engine.guided): a
        compile may take up to ``grammar_timeout_s`` (5 s), and waited for in the lane, it would
        hold a prepare thread that other tenants need."""
        if (request.prompt_token_ids is None or request.sampling.guided is not None
                or request.sampling.logprobs is not None or request.sampling.prompt_logprobs is not None):
            prepared = await self._in_lane(request)
        else:
            prepared = self.engine.prepare_nowait(request)
        return await grammar_compiled(self.engine, prepared)

    async def _in_lane(self, request: GenerateRequest) -> PreparedRequest:
        """``prepare_nowait(request)`` in its tenant's lane; a caller that goes away while it waits
        there takes it out of the queue (cancelling the awaited future cancels the lane's job)."""
        try:
            job = self._lanes.submit(request.tenant.tenant_key, self.engine.prepare_nowait, request)
        except LaneFullError:
            raise PrepareQueueFullError(
                f"too many of your requests are waiting to be prepared ({self.engine.config.prepare_queued_per_tenant} "
                "queued behind the one being tokenized); retry when they are done") from None
        except LanesClosedError:
            raise EngineShutDownError("the engine is shutting down") from None
        try:
            return await asyncio.wrap_future(job)
        except LanesClosedError:
            raise EngineShutDownError("the engine is shutting down") from None

    def preparing(self, tenant: TenantScope) -> tuple[int, int]:
        """(being prepared, waiting for that) requests of ``tenant`` in its prepare lane."""
        return self._lanes.load(tenant.tenant_key)

    async def abort(self, request_id: str) -> AbortReport | None:
        """Stop the request and return how far its prompt got, once the engine thread has taken the
        abort (between two steps). None when that takes over ``_ABORT_REPORT_WAIT_S`` or the engine
        is shutting down; the abort itself goes ahead either way."""
        with self._lock:
            self._aborts.append(request_id)  # after any add still queued: the request never starts
        future = self.call_in_engine_thread(lambda engine: self._report_abort(engine, request_id))
        self._wake.set()
        try:  # shielded: a timeout must not cancel the call before the engine thread runs it
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), _ABORT_REPORT_WAIT_S)
        except (TimeoutError, EngineShutDownError):
            return None

    async def health(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    async def stats(self) -> dict[str, Any]:
        return dict(self._snapshot, healthy=self._thread.is_alive() and not self._stopping)

    def models(self) -> list[ModelCard]:
        return [ModelCard(id=self.engine.config.resolved_model_id, max_model_len=self.engine.max_model_len)]

    def count_prompt_tokens(self, request: GenerateRequest) -> int:
        return len(self.engine.tokenize(request))

    def tokenize(self, request: GenerateRequest) -> list[int]:
        return self.engine.tokenize(request)

    def decode_prompt(self, token_ids: Sequence[int]) -> str:
        return self.engine.decode_prompt(token_ids)

    def cache_usage(self, tenant: TenantScope) -> dict[str, int]:
        bs = self.engine.block_size
        return {tier: n * bs for tier, n in self.engine.cached_blocks(tenant.namespace).items()}

    def tenant_blocks(self, tenant: TenantScope) -> dict[str, int]:
        return self.engine.blocks_held(tenant.tenant_key)

    def call_in_engine_thread(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run ``fn(engine)`` on the engine thread between two steps (KV imports and exports of the
        prefill/decode split: the only thread that may touch the cache manager and the runner)."""
        future: Future[T] = Future()
        with self._lock:
            if self._stopping:
                future.set_exception(EngineShutDownError("the engine is shutting down"))
                return future
            self._calls.append((fn, future))
        self._wake.set()
        return future

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread; requests still running end with finish_reason "abort"."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        self._lanes.close()

    # ------------------------------------------------------------------ engine thread

    def _deliver(self, out: RequestOutput) -> bool:
        """Hand ``out`` to its stream; False when nobody reads it any more."""
        with self._lock:
            target = self._streams.get(out.request_id)
        if target is None:
            return False  # the consumer went away; its abort is queued
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, out)
        except RuntimeError:  # the consumer's loop is closed
            return False
        return True

    def _keep_report(self, request_id: str, report: AbortReport) -> None:
        self._reports[request_id] = report
        if len(self._reports) > _KEPT_REPORTS:
            self._reports.popitem(last=False)

    def _stop(self, engine: LLMEngine, request_id: str) -> AbortReport | None:
        """Abort ``request_id`` if the engine holds it; its report, kept when no stream takes the
        final output (the consumer closed it, so only ``abort``'s caller can still ask)."""
        req = engine.requests.get(request_id)
        if req is None:
            return None
        report = prefill_report(req)
        out = engine.abort(request_id)
        if out is None or not self._deliver(out):
            self._keep_report(request_id, report)
        return report

    def _report_abort(self, engine: LLMEngine, request_id: str) -> AbortReport:
        """``abort``'s work on the engine thread: stop the request, or find what its earlier stop
        (the stream's own abort) or its unread last output left; nothing known = nothing done."""
        report = self._stop(engine, request_id)
        kept = self._reports.pop(request_id, None)
        return report or kept or AbortReport(prefilled_tokens=0, cached_tokens=0)

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._lock:
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
                calls, self._calls = self._calls, []
            for fn, future in calls:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(engine))
                    except Exception as exc:  # noqa: BLE001 - the caller gets it; the loop keeps serving
                        future.set_exception(exc)
            for req in adds:
                try:
                    engine.add_request(req)
                except EngineError as exc:
                    self._deliver(_failed(req, str(exc)))
            for request_id in aborts:
                self._stop(engine, request_id)
            if self._stopping:
                for request_id in list(engine.requests):
                    out = engine.abort(request_id)
                    if out is not None:
                        self._deliver(out)
                self._snapshot = engine.stats()
                return
            if engine.has_unfinished():
                try:
                    outputs = engine.step()
                except Exception as exc:  # a bug outside any one request: fail them all, keep serving
                    log.exception("engine step failed")
                    outputs = engine.fail_all(f"{type(exc).__name__}: {exc}")
                # Finished requests' blocks back first: a consumer that got its last output reads a
                # snapshot without them. (Freeing after delivery would not get the token to the
                # event loop much sooner: this thread keeps the GIL until it next blocks.)
                engine.release_finished()
                self._snapshot = engine.stats()  # before delivery: a consumer sees state at least this new
                for out in outputs:
                    if not self._deliver(out) and out.finished:  # finished as its consumer left
                        self._keep_report(out.request_id, AbortReport(out.prompt_tokens, out.cached_tokens))
            else:
                self._snapshot = engine.stats()
                self._wake.wait()
                self._wake.clear()


async def grammar_compiled(engine: LLMEngine, prepared: PreparedRequest) -> Request:
    """``prepared``'s request once its grammar (if any) has compiled, waited for on the event loop:
    a thread waiting there would be one that another tenant's request may need. Refusals as
    ``LLMEngine.prepare`` raises them (400 ``unenforceable_schema``, 429 ``grammar_queue_full``)."""
    if prepared.grammar is not None:
        with grammar_refusals():
            await await_compiled(prepared.grammar, engine.grammar_timeout_s)
    return prepared.request


def prefill_report(req: Request) -> AbortReport:
    """How far ``req`` got with its prompt: tokens whose K/V it holds or held before a preemption
    (committed by a step that ran, or read from the cache at admission), of which read from the cache."""
    prefilled = max(min(req.num_computed_tokens, req.num_prompt_tokens), req.num_prompt_tokens_reached)
    return AbortReport(prefilled_tokens=prefilled, cached_tokens=min(req.num_cached_tokens or 0, prefilled))


def _failed(req: Request, error: str) -> RequestOutput:
    return RequestOutput(
        request_id=req.request_id, new_token_ids=(), new_text="", finished=True,
        prompt_tokens=req.num_prompt_tokens, cached_tokens=0, completion_tokens=0,
        finish_reason="error", error=error,
    )
