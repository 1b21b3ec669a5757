"""A finished request's blocks go back to the pool after its output is handed out (Scheduler.finish,
released at the start of the next step's scheduling), in synchronous and overlapped steps.

What must hold: the step that returns a request's last output has not freed its blocks yet; the
next step frees them before it admits anyone (a request waiting for them is admitted exactly when
it was before the change); the prefix index keeps the finished request's full blocks; pool counts
and refcounts stay consistent throughout (``check_integrity`` counts the held blocks); aborts and
``fail_all`` free at once; and a request id reused before the release is not confused with the old
one. ``FakeOverlapRunner`` runs launched steps lazily in launch order, so K/V of a step still "on
the device" is written after the host has moved on, as on a GPU stream.
"""

from __future__ import annotations

import pytest
from engine_core_fakes import FakeOverlapRunner, FakeRunner, reference_generate, scope
from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.metrics import EngineMetrics
from engine.protocol import GenerateRequest, RequestOutput, SamplingParams

BS = 8
MODES = ["sync", "overlap"]


def make_engine(mode: str, num_blocks: int = 64, budget: int = 64, registry: CollectorRegistry | None = None,
                metrics: EngineMetrics | None = None) -> tuple[LLMEngine, FakeRunner]:
    runner_cls = FakeOverlapRunner if mode == "overlap" else FakeRunner
    runner = runner_cls(num_kv_blocks=num_blocks, block_size=BS)
    config = EngineConfig(model_dir="fake", block_size=BS, max_num_batched_tokens=budget, max_num_seqs=8,
                          overlap_steps=mode == "overlap")
    engine = LLMEngine(config, runner, metrics or EngineMetrics(registry or CollectorRegistry()))
    assert engine.overlap_steps is (mode == "overlap")
    return engine, runner


def greq(rid: str, prompt: list[int], max_tokens: int, **sp) -> GenerateRequest:
    return GenerateRequest(rid, scope(), SamplingParams(max_tokens=max_tokens, temperature=0.0, **sp),
                           prompt_token_ids=prompt)


def prompt(seed: int, n: int) -> list[int]:
    return [97 + (seed * 11 + i * 5) % 26 for i in range(n)]


class FreeLog:
    """Records the request ids whose blocks the cache manager freed (wraps ``KVCacheManager.free``)."""

    def __init__(self, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.freed: list[str] = []
        real = engine.cache.free

        def free(request_id, tenant, block_table):
            self.freed.append(request_id)
            real(request_id, tenant, block_table)

        monkeypatch.setattr(engine.cache, "free", free)


def step_until_finished(engine: LLMEngine, rid: str, outs: dict[str, list[int]], max_calls: int = 50) -> int:
    """Step until ``rid``'s final output is returned (checking integrity after every call); ->
    how many calls that took. ``outs`` collects every request's streamed token ids."""
    for call in range(1, max_calls + 1):
        finished = collect(engine.step(), outs)
        engine.check_integrity()
        if rid in finished:
            return call
    raise AssertionError(f"{rid} never finished")


def drain(engine: LLMEngine, outs: dict[str, list[int]], max_calls: int = 100) -> dict[str, int]:
    """Step while ``has_unfinished`` (at most ``max_calls``); -> cached tokens per finished request."""
    cached: dict[str, int] = {}
    for _ in range(max_calls):
        if not engine.has_unfinished():
            return cached
        outputs = engine.step()
        engine.check_integrity()
        collect(outputs, outs)
        cached.update({o.request_id: o.cached_tokens for o in outputs if o.finished})
    raise AssertionError("the engine never became idle")


def collect(step_outputs: list[RequestOutput], outs: dict[str, list[int]]) -> set[str]:
    for o in step_outputs:
        assert o.error is None, o.error
        outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    return {o.request_id for o in step_outputs if o.finished}


@pytest.mark.parametrize("mode", MODES)
def test_the_last_output_is_returned_before_the_blocks_are_freed(mode, monkeypatch):
    engine, _ = make_engine(mode)
    log = FreeLog(engine, monkeypatch)
    p = prompt(1, 30)  # 3 full blocks + 1 partial (the sampled token needs no block of its own)
    engine.add_request(greq("a", p, max_tokens=1))
    outs: dict[str, list[int]] = {}
    step_until_finished(engine, "a", outs)
    # the step that handed out a's only token has not freed a's blocks
    assert "a" not in log.freed
    assert engine.cache.num_used == 4
    assert engine.has_unfinished()  # a loop stepping while this holds gets the blocks back
    engine.step()
    engine.check_integrity()
    assert log.freed == ["a"]
    assert engine.cache.num_used == 0
    assert engine.cache.num_evictable == 3  # the full prompt blocks stay indexed: a hit for the next
    assert not engine.has_unfinished()
    assert outs["a"] == reference_generate(p, 1)


@pytest.mark.parametrize("mode", MODES)
def test_a_finished_request_is_a_prefix_hit_after_its_release(mode):
    engine, _ = make_engine(mode)
    p = prompt(2, 40)
    engine.add_request(greq("a", p, max_tokens=1))
    outs: dict[str, list[int]] = {}
    step_until_finished(engine, "a", outs)
    engine.add_request(greq("b", p + [99, 98], max_tokens=3))
    step_until_finished(engine, "b", outs)
    assert engine.stats()["prompt_tokens_hit"] == 40  # a's five full blocks, committed before its free
    assert outs["b"] == reference_generate(p + [99, 98], 3)


@pytest.mark.parametrize(("mode", "with_decode", "calls_after"), [
    # sync: a's token comes back in call k; b waits for a's blocks and is admitted in call k + 1
    ("sync", False, 1), ("sync", True, 1),
    # overlapped, c decoding: call k launched step n+1 (before a's token was read), so call k + 1 is
    # the first whose scheduling can use a's blocks
    ("overlap", True, 1),
    # overlapped, nothing else running: call k schedules again after its collect and admits b there
    ("overlap", False, 0),
])
def test_a_waiting_request_gets_the_blocks_in_the_step_it_got_them_before(mode, with_decode, calls_after):
    # a's 40 tokens (+ c's 10) fill the first step's budget; then b's 46 need 6 blocks, which the
    # pool has only once a's 5 are back (c holds 2 or 3): b takes the never-used ones and evicts a's
    engine, runner = make_engine(mode, num_blocks=12 if with_decode else 10, budget=50 if with_decode else 40)
    pa, pb, pc = prompt(3, 40), prompt(4, 46), prompt(5, 10)
    engine.add_request(greq("a", pa, max_tokens=1))
    if with_decode:
        engine.add_request(greq("c", pc, max_tokens=20))
    engine.add_request(greq("b", pb, max_tokens=1))
    outs: dict[str, list[int]] = {}
    scheduled = runner.launched if mode == "overlap" else runner.batches  # every step, in order
    a_call = b_call = 0  # the call that returned a's token; the first whose steps hold a chunk of b
    for call in range(1, 30):
        before = len(scheduled)
        if "a" in collect(engine.step(), outs):
            a_call = call
        engine.check_integrity()
        if not b_call and any(ch.request_id == "b" for batch in scheduled[before:] for ch in batch.chunks):
            b_call = call
        if not engine.has_unfinished():
            break
    assert a_call and b_call == a_call + calls_after
    a_blocks = {b for batch in scheduled for ch in batch.chunks if ch.request_id == "a" for b in ch.block_table}
    b_blocks = {b for batch in scheduled for ch in batch.chunks if ch.request_id == "b" for b in ch.block_table}
    assert b_blocks & a_blocks  # b runs in blocks a held
    assert outs["a"] == reference_generate(pa, 1) and outs["b"] == reference_generate(pb, 1)
    if with_decode:
        assert outs["c"] == reference_generate(pc, 20)
    assert engine.cache.num_used == 0


def test_overlapped_a_stopped_request_whose_extra_position_is_in_flight_frees_safely():
    """c stops at its second token (a stop id): the step already launched computes one more
    position of c (its placeholder). c's blocks are freed and handed to b while that step is still
    queued; the lazy device writes c's extra position first, then b's K/V, so b's output is right."""
    engine, runner = make_engine("overlap", num_blocks=8, budget=64)
    pc, pb = prompt(6, 44), prompt(7, 30)
    stop = reference_generate(pc, 2)[1]
    engine.add_request(greq("c", pc, max_tokens=10, stop_token_ids=[stop]))  # 6 blocks + growth
    engine.add_request(greq("b", pb, max_tokens=4))  # 4 + 1 blocks: waits for c's
    outs: dict[str, list[int]] = {}
    step_until_finished(engine, "c", outs)
    assert outs["c"] == reference_generate(pc, 2)
    assert any(ch.request_id == "c" and ch.token_ids == (-1,) for batch in runner.launched for ch in batch.chunks)
    step_until_finished(engine, "b", outs)
    drain(engine, outs)
    assert outs["b"] == reference_generate(pb, 4)
    assert engine.cache.num_used == 0


@pytest.mark.parametrize("mode", MODES)
def test_abort_frees_at_once_together_with_a_pending_release(mode, monkeypatch):
    engine, _ = make_engine(mode)
    log = FreeLog(engine, monkeypatch)
    engine.add_request(greq("a", prompt(8, 20), max_tokens=1))
    engine.add_request(greq("b", prompt(9, 20), max_tokens=50))
    outs: dict[str, list[int]] = {}
    step_until_finished(engine, "a", outs)
    assert log.freed == []  # a's release is pending
    assert engine.abort("a") is None  # finished already: no second output, no double free
    out = engine.abort("b")  # b may have a step in flight (overlap): stream order protects its blocks
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert sorted(log.freed) == ["a", "b"]
    assert engine.cache.num_used == 0 and not engine.has_unfinished()
    engine.check_integrity()
    # the next request gets the blocks; a step of b still queued on the device runs first, harmlessly
    engine.add_request(greq("c", prompt(10, 20), max_tokens=3))
    step_until_finished(engine, "c", outs)
    assert outs["c"] == reference_generate(prompt(10, 20), 3)


@pytest.mark.parametrize("mode", MODES)
def test_fail_all_frees_every_block_at_once(mode):
    engine, _ = make_engine(mode)
    engine.add_request(greq("a", prompt(11, 20), max_tokens=1))
    engine.add_request(greq("b", prompt(12, 20), max_tokens=50))
    step_until_finished(engine, "a", {})
    outs = engine.fail_all("boom")
    assert [o.request_id for o in outs] == ["b"]
    assert engine.cache.num_used == 0 and not engine.has_unfinished()
    engine.check_integrity()


@pytest.mark.parametrize("mode", MODES)
def test_a_request_id_reused_before_the_release_keeps_its_own_state(mode, monkeypatch):
    """The cache manager keys in-flight prefix marks (and restores, held prefixes) by request id:
    the old request's release must run before the new one's first cache call, or it drops the new
    request's marks and y, which shares the new x's prompt, computes it a second time instead of
    waiting for x's blocks."""
    engine, _ = make_engine(mode, budget=24)  # x's 40 tokens take two steps; y fits beside the second
    log = FreeLog(engine, monkeypatch)
    p1, p2 = prompt(13, 14), prompt(14, 40)
    engine.add_request(greq("x", p1, max_tokens=1))
    outs: dict[str, list[int]] = {}
    step_until_finished(engine, "x", outs)
    assert log.freed == []
    engine.add_request(greq("x", p2, max_tokens=2))  # the id is free again once the output is out
    engine.add_request(greq("y", p2, max_tokens=2))
    got: dict[str, list[int]] = {}
    cached = drain(engine, got)
    assert log.freed[0] == "x"
    assert got["x"] == got["y"] == reference_generate(p2, 2)
    # y waited for every block x computed that a hit may serve (4: the last prompt token is computed)
    assert cached == {"x": 0, "y": 32}
    assert engine.cache.num_used == 0


def blocks_used_gauge(registry: CollectorRegistry) -> float | None:
    return registry.get_sample_value("prefixgate_kv_blocks_used")


class RecordingMetrics(EngineMetrics):
    """Records the blocks in use at each publish of the state."""

    def __init__(self) -> None:
        super().__init__(CollectorRegistry())
        self.published_used: list[int] = []

    def observe_state(self, *, used: int, **kw) -> None:
        self.published_used.append(used)
        super().observe_state(used=used, **kw)


@pytest.mark.parametrize("mode", MODES)
def test_the_gauges_are_published_after_the_release_not_before_the_output(mode):
    metrics = RecordingMetrics()
    engine, _ = make_engine(mode, metrics=metrics)
    engine.add_request(greq("a", prompt(15, 30), max_tokens=1))
    step_until_finished(engine, "a", {})
    # the step that returned a lone request's token did not publish (its gauges would count the 4
    # blocks about to be freed); the overlapped loop's launch step before it did
    assert metrics.published_used == ([4] if mode == "overlap" else [])
    drain(engine, {})
    assert metrics.published_used[-1] == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_step_that_releases_always_publishes(mode):
    """One-token requests arriving every step: each step finishes one and frees the one before;
    the gauges must still follow (a step that released publishes even if it finished another)."""
    registry = CollectorRegistry()
    engine, _ = make_engine(mode, registry=registry)
    used = []
    for i in range(6):
        engine.add_request(greq(f"r{i}", prompt(20 + i, 30), max_tokens=1))
        engine.step()
        engine.check_integrity()
        used.append(blocks_used_gauge(registry))
    assert len({u for u in used[2:]}) == 1 and used[-1] == engine.cache.num_used  # current, not stale
    drain(engine, {})
    assert blocks_used_gauge(registry) == 0


@pytest.mark.parametrize("mode", MODES)
def test_release_finished_frees_and_publishes_between_steps(mode):
    metrics = RecordingMetrics()
    engine, _ = make_engine(mode, metrics=metrics)
    engine.add_request(greq("a", prompt(16, 30), max_tokens=1))
    step_until_finished(engine, "a", {})
    assert engine.cache.num_used == 4
    published = len(metrics.published_used)
    engine.release_finished()  # what AsyncEngine does before its snapshot
    assert engine.cache.num_used == 0 and metrics.published_used[published:] == [0]
    assert not engine.has_unfinished()
    engine.check_integrity()
