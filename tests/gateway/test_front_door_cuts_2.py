"""Issue #17, session 6 round 2: per-request work the front door no longer does, pinned to what it did.

As in ``test_front_door_cuts.py``: each test compares the cheaper path with the code it replaced
(kept here as the oracle where it fits), so a cut that changed a value fails here, not only in the
benchmark.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import pickle
import re
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import pytest
from gateway_fakes import FakeTenancy
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from starlette.datastructures import State

from engine.protocol import GenerateRequest, RequestOutput, SamplingParams
from gateway import metrics, miss_tracker, pipeline
from gateway.anthropic_api import MessagesRequest
from gateway.app import create_app
from gateway.ingress import BodyShape, scan
from gateway.pipeline import Prepared, new_request_id
from gateway.remote import NodeFailure, NodeFault, NodeUnavailableError
from gateway.responses_api import ResponsesRequest
from gateway.routes.completions import Parts
from gateway.routing import Backend, BackendKind, Router
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.settings import GatewaySettings
from gateway.upstream import NormalizedUsage
from promptlint.canon import CanonResult
from promptlint.explain import Rendered, Segment
from promptlint.miss import PromptFacts
from tenancy.types import Price, UsageRecord

# -- request ids: cut from one os.urandom read instead of one read (a GIL release) per request ---------

_ID = {"chat": re.compile(r"chatcmpl-[0-9a-f]{32}"), "completion": re.compile(r"cmpl-[0-9a-f]{32}")}


def _old_request_id(kind: str) -> str:
    """The previous ``new_request_id``: one ``os.urandom(16)`` per id."""
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + os.urandom(16).hex()


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_request_id_has_the_old_shape(kind: str) -> None:
    assert _ID[kind].fullmatch(_old_request_id(kind))
    for _ in range(3 * pipeline._IDS_PER_READ):  # across refills
        assert _ID[kind].fullmatch(new_request_id(kind))


def test_request_ids_are_unique_across_batches_and_threads() -> None:
    ids: list[list[str]] = [[] for _ in range(8)]

    def draw(out: list[str]) -> None:
        out.extend(new_request_id("chat") for _ in range(5 * pipeline._IDS_PER_READ))

    threads = [threading.Thread(target=draw, args=(out,)) for out in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [i for out in ids for i in out]
    assert len(set(every)) == len(every) == 8 * 5 * pipeline._IDS_PER_READ


def test_request_ids_look_random() -> None:
    """Each hex digit about equally often (a slicing error would repeat or skip digits)."""
    digits = "".join(new_request_id("chat")[len("chatcmpl-"):] for _ in range(4 * pipeline._IDS_PER_READ))
    counts = [digits.count(d) for d in "0123456789abcdef"]
    expected = len(digits) / 16
    assert all(abs(c - expected) < 0.1 * expected for c in counts), counts


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_repeat_the_parents_ids() -> None:
    new_request_id("chat")  # the parent holds a batch with unread ids
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        try:
            os.write(write, "\n".join(new_request_id("chat") for _ in range(50)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = set(pipe.read().split("\n"))
    os.waitpid(pid, 0)
    parent = {new_request_id("chat") for _ in range(50)}
    assert len(child) == 50
    assert not child & parent


# -- Prometheus: the request's counters and histograms through their values' own inc -------------------

def _samples(registry: CollectorRegistry) -> list[tuple[str, dict[str, str], float]]:
    """Every sample but the creation times, NaN as a string (NaN != NaN)."""
    return [(s.name, s.labels, repr(s.value)) for m in registry.collect() for s in m.samples
            if not s.name.endswith("_created")]


def _old_series_add(series: metrics.RequestSeries, prompt: int, cached: int, completion: int, cost: float,
                    saved: float, latency: float, ttft: float | None) -> None:
    """What ``Accounting._record`` did with a request's series before ``RequestSeries.add``."""
    if prompt:
        series.prompt_tokens.inc(prompt)
    if cached:
        series.cached_tokens.inc(cached)
    if completion:
        series.completion_tokens.inc(completion)
    if cost:
        series.cost_usd.inc(cost)
    if saved:
        series.saved_usd.inc(saved)
    series.latency.observe(latency)
    if ttft is not None:
        series.ttft.observe(ttft)


_MONEY = st.one_of(st.floats(allow_nan=True, allow_infinity=False), st.just(0.0))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6), _MONEY, _MONEY,
                          st.floats(0, 100), st.one_of(st.none(), st.floats(0, 100))), max_size=8))
def test_series_add_is_the_old_accounting(requests: list[tuple]) -> None:
    """The same samples in /metrics, and the same error (ValueError) at the same point for a negative amount."""
    old, new = CollectorRegistry(), CollectorRegistry()
    s_old, s_new = metrics.GatewayMetrics(old).series("t", "b"), metrics.GatewayMetrics(new).series("t", "b")
    for r in requests:
        raised = []
        for fn, s in ((_old_series_add, s_old), (metrics.RequestSeries.add, s_new)):
            try:
                fn(s, *r)
                raised.append(None)
            except ValueError as exc:
                raised.append(str(exc))
        assert raised[0] == raised[1]
    assert _samples(old) == _samples(new)


def test_count_counts_as_before() -> None:
    registry = CollectorRegistry()
    m = metrics.GatewayMetrics(registry)
    for _ in range(3):
        m.count("acme", "local", "ok", metrics.Outcome.OK)
    m.count("acme", "local", "error", metrics.Outcome.SERVER_ERROR)
    got = {(s.labels["status"], s.labels["outcome"]): s.value for s in _samples_of(registry, "prefixgate_gateway_requests_total")}
    assert got == {("ok", "ok"): 3.0, ("error", "5xx"): 1.0}


def _samples_of(registry: CollectorRegistry, name: str) -> list:
    return [s for m in registry.collect() for s in m.samples if s.name == name]


# -- Parts.of reads what the State holds -------------------------------------------------------------


def _old_parts_of(state: State, tenancy: object, engine: object) -> tuple:
    """The previous ``Parts.of``: attribute reads of the State."""
    return (tenancy, engine, state.router, state.settings, state.metrics, state.live_stats, state.tenant_threads,
            state.miss_tracker)


def test_parts_of_reads_what_the_state_reads(tmp_path: Path) -> None:
    app = create_app(GatewaySettings(home=tmp_path, model=None, model_dir=None))
    tenancy, engine = object(), object()
    parts = Parts.of(app.state, tenancy, engine)  # type: ignore[arg-type]
    got = tuple(getattr(parts, f.name) for f in dataclasses.fields(Parts))
    assert all(a is b for a, b in zip(got, _old_parts_of(app.state, tenancy, engine), strict=True))


# -- per-request dataclasses built without object.__setattr__ (not frozen) ----------------------------

_UNFROZEN = [metrics.RequestSample, metrics.Observation, miss_tracker.Observation, NormalizedUsage, BodyShape,
             UsageRecord, Price, PromptFacts, Segment, Rendered, CanonResult, Parts]


@pytest.mark.parametrize("cls", _UNFROZEN, ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_per_request_dataclasses_are_not_frozen(cls: type) -> None:
    """Made on every request: frozen, each costs 2-3x as much to build (each field through
    ``object.__setattr__``). Values, equality and ``replace`` are a dataclass's as before."""
    assert dataclasses.is_dataclass(cls) and not cls.__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_usage_record_still_validates_and_compares() -> None:
    row = dict(request_id="r", tenant_id="t", key_id="k", model="m", backend="b", prompt_tokens=10, cached_tokens=4,
               completion_tokens=2, ttft_s=None, latency_s=0.1, status="ok", created_at=1.0)
    assert UsageRecord(**row) == UsageRecord(**row)
    assert dataclasses.replace(UsageRecord(**row), cached_tokens=5).cached_tokens == 5
    with pytest.raises(ValueError, match="cannot exceed"):
        UsageRecord(**{**row, "cached_tokens": 11})


# -- the scanned body's character count: an entry of the model's __dict__, not a PrivateAttr ------------

_BODIES = st.fixed_dictionaries(
    {"model": st.text(min_size=1, max_size=8),
     "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                 "content": st.text(max_size=40)}), min_size=1, max_size=4)},
    optional={"user": st.text(max_size=10), "temperature": st.floats(0, 2), "n": st.integers(1, 3),
              "metadata": st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3)})


@settings(max_examples=100, deadline=None)
@given(_BODIES)
def test_text_chars_is_the_scans_count_and_stays_out_of_the_model(body: dict) -> None:
    chars = scan(body).chars
    for req in (ChatCompletionRequest.model_validate(body), ChatCompletionRequest.model_validate_json(json.dumps(body))):
        assert req.text_chars == chars
        assert "_text_chars" not in req.model_dump() and "_text_chars" not in json.loads(req.model_dump_json())
        assert req.model_dump(exclude_unset=True) == ChatCompletionRequest.model_validate(body).model_dump(
            exclude_unset=True)
        assert "_text_chars" not in dict(req) and "_text_chars" not in repr(req)
        assert req.model_copy(update={"n": 2}).text_chars == chars  # _with_canonical_fields' copy
        assert pickle.loads(pickle.dumps(req)).text_chars == chars
        assert req == ChatCompletionRequest.model_validate(body)


def test_text_chars_of_a_model_not_built_from_a_dict_is_zero() -> None:
    assert ChatCompletionRequest.model_construct(model="m", messages=[]).text_chars == 0


def test_request_models_have_no_private_attributes() -> None:
    """None left: one would bring back pydantic's per-construction init_private_attributes."""
    for model in (ChatCompletionRequest, CompletionRequest, MessagesRequest, ResponsesRequest):
        assert not model.__private_attributes__, model


# -- _run_one: Router.track and aclosing written out as try/finally -----------------------------------


async def _old_run_one(prep: Prepared, router: Router) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The previous ``pipeline._run_one``, with its context managers (the in-flight count follows a
    failover: ``pipeline._move``)."""
    gr = prep.requests[0]
    backend = prep.backend
    finished = False
    with contextlib.ExitStack() as tracked:
        prep.backend.inflight += 1
        tracked.callback(lambda: setattr(prep.backend, "inflight", prep.backend.inflight - 1))
        try:
            while True:
                started = False
                try:
                    async with contextlib.aclosing(backend.client.generate(gr)) as outputs:
                        async for out in outputs:
                            started = True
                            finished = finished or out.finished
                            yield 0, out
                    router.record_success(backend)
                    return
                except NodeFailure as exc:
                    router.record_failure(prep.model, backend, exc.fault, str(exc))
                    alternative = None if started else router.failover(prep.model, backend, exc.fault)
                    if alternative is None:
                        raise exc.for_tenant(backend.name) from exc
                    pipeline._move(prep, alternative)
                    backend = alternative
        finally:
            if not finished:
                with anyio.CancelScope(shield=True):
                    await backend.client.abort(gr.request_id)


class _Node:
    """An engine client that logs what happens to it (with the routed backend's in-flight count)."""

    def __init__(self, name: str, log: list[str], behaviour: str) -> None:
        self.name, self.log, self.behaviour = name, log, behaviour
        self.routed: Backend | None = None

    def _note(self, what: str) -> None:
        self.log.append(f"{self.name}:{what}:inflight={self.routed.inflight if self.routed else '-'}")

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self._note("start")
        try:
            if self.behaviour == "down":
                raise NodeUnavailableError("down")
            yield RequestOutput(request.request_id, (1,), "a", False, 3, 0, 1)
            if self.behaviour == "down-after-output":
                raise NodeUnavailableError("down")
            if self.behaviour == "fails":
                raise RuntimeError("boom")
            yield RequestOutput(request.request_id, (2,), "b", True, 3, 0, 2, finish_reason="stop")
        finally:
            self._note("closed")

    async def abort(self, request_id: str) -> None:
        self._note(f"abort {request_id}")


class _LoggedRouter(Router):
    def __init__(self, log: list[str], alternative: Backend | None) -> None:
        super().__init__([])
        self.log, self.alternative = log, alternative

    def failover(self, model: str, failed: Backend, fault: NodeFault = NodeFault.UNREACHABLE) -> Backend | None:
        self.log.append(f"failover from {failed.label} ({fault})")
        alternative, self.alternative = self.alternative, None  # one other node
        return alternative


@pytest.mark.parametrize("first,second,leave_after", [
    ("ok", None, None), ("ok", None, 1), ("fails", None, None), ("down", "ok", None), ("down", "down", None),
    ("down", "fails", None), ("down-after-output", "ok", None), ("down", "ok", 1),
])
def test_run_one_does_what_it_did_with_its_context_managers(first: str, second: str | None,
                                                            leave_after: int | None) -> None:
    def run(worker: Callable[..., AsyncIterator[tuple[int, RequestOutput]]]) -> list[str]:
        log: list[str] = []
        tenancy = FakeTenancy()
        ctx = tenancy.keys[tenancy.add("acme")]
        gr = GenerateRequest(request_id="r-0-0", tenant=ctx, sampling=SamplingParams(max_tokens=2), messages=({},))
        a = _Node("a", log, first)
        routed = a.routed = Backend("node:a", BackendKind.NODE, a, "m")
        other = None
        if second is not None:
            b = _Node("b", log, second)
            other = b.routed = Backend("node:b", BackendKind.NODE, b, "m")
        prep = Prepared(kind="chat", request_id="r", created=0, model="m", requests=[gr], n=1, stream=False,
                        include_usage=False, canon_applied=(), tenant=ctx, backend=routed)

        async def consume() -> None:
            outputs = worker(prep, _LoggedRouter(log, other))
            try:
                async for _, out in outputs:
                    log.append(f"got {out.new_text} inflight={routed.inflight}/{other.inflight if other else '-'}")
                    if leave_after is not None:
                        await outputs.aclose()
                        break
            except Exception as exc:  # noqa: BLE001 - logged and compared
                log.append(f"raised {type(exc).__name__}")
            log.append(f"after inflight={routed.inflight}/{other.inflight if other else '-'} "
                       f"backend={prep.backend.label}")

        asyncio.run(consume())
        return log

    assert run(pipeline._run_one) == run(_old_run_one)
