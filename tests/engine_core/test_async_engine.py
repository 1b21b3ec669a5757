"""AsyncEngine over the fake runner: streaming, cancellation, abort, errors, stats, shutdown."""

import asyncio
import threading

import pytest
from engine_core_fakes import FakeRunner, reference_generate, scope

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.protocol import (
    EngineClient,
    EngineOverloadedError,
    GenerateRequest,
    PromptTooLongError,
    SamplingParams,
)

BS = 8


class SlowRunner(FakeRunner):
    """Blocks each step until the test lets it go, so a test can act mid-generation."""

    def __post_init__(self):
        super().__post_init__()
        self.gate = threading.Semaphore(0)
        self.steps = 0

    def execute(self, batch):
        self.gate.acquire(timeout=5)
        self.steps += 1
        return super().execute(batch)


def make(runner=None, **cfg) -> AsyncEngine:
    runner = runner or FakeRunner(num_kv_blocks=64, block_size=BS)
    config = EngineConfig(model_dir="/models/fake", block_size=BS, **cfg)
    return AsyncEngine(LLMEngine(config, runner))


def req(rid, prompt, max_tokens=6, **sp):
    return GenerateRequest(rid, scope(), SamplingParams(max_tokens=max_tokens, temperature=0.0, **sp),
                           prompt_token_ids=prompt)


P = [97 + i % 26 for i in range(20)]


def test_streams_concurrent_requests_and_implements_the_protocol():
    eng = make()
    assert isinstance(eng, EngineClient)

    async def collect(rid, prompt):
        ids = []
        async for out in eng.generate(req(rid, prompt)):
            ids += out.new_token_ids
            last = out
        return ids, last

    async def main():
        return await asyncio.gather(*(collect(f"r{i}", P[i:]) for i in range(4)))

    try:
        results = asyncio.run(main())
        for i, (ids, last) in enumerate(results):
            assert ids == reference_generate(P[i:], 6) and last.finished
        stats = asyncio.run(eng.stats())
        assert stats["healthy"] and stats["kv_blocks_used"] == 0
        assert asyncio.run(eng.health())
        assert eng.models()[0].id == "fake"
        assert eng.count_prompt_tokens(GenerateRequest("c", scope(), prompt="héllo")) == 6
    finally:
        eng.shutdown()
    assert not asyncio.run(eng.health())


def test_cancelling_the_stream_aborts_and_frees_blocks():
    runner = SlowRunner(num_kv_blocks=64, block_size=BS)
    eng = make(runner)

    async def main():
        gen = eng.generate(req("c", P, max_tokens=100))
        runner.gate.release()
        first = await gen.__anext__()
        assert first.new_token_ids
        await gen.aclose()  # the client went away
        for _ in range(50):  # let the engine thread process the abort
            runner.gate.release()
            if eng.engine.cache.num_used == 0 and not eng.engine.requests:
                break
            await asyncio.sleep(0.02)

    try:
        asyncio.run(main())
        assert eng.engine.cache.num_used == 0 and "c" in runner.released
    finally:
        runner.gate.release(100)
        eng.shutdown()


def test_abort_ends_the_stream_with_abort():
    runner = SlowRunner(num_kv_blocks=64, block_size=BS)
    eng = make(runner)

    async def main():
        outs = []
        async for out in eng.generate(req("a", P, max_tokens=100)):
            outs.append(out)
            if len(outs) == 1:
                await eng.abort("a")
            runner.gate.release()
        return outs

    try:
        runner.gate.release()
        outs = asyncio.run(main())
        assert outs[-1].finish_reason == "abort" and outs[-1].finished
        assert eng.engine.cache.num_used == 0
    finally:
        runner.gate.release(100)
        eng.shutdown()


def test_errors_before_start_raise_and_failures_stream_as_error():
    runner = FakeRunner(num_kv_blocks=64, block_size=BS, max_model_len=64)
    runner.fail_request_ids.add("bad")
    eng = make(runner)

    async def main():
        with pytest.raises(PromptTooLongError):
            async for _ in eng.generate(req("long", P * 3)):
                pass
        outs = [o async for o in eng.generate(req("bad", P))]
        good = [o async for o in eng.generate(req("good", P))]
        return outs, good

    try:
        outs, good = asyncio.run(main())
        assert outs[-1].finish_reason == "error" and "injected" in outs[-1].error
        assert good[-1].finish_reason == "length"
        assert asyncio.run(eng.health())
    finally:
        eng.shutdown()


def test_overload_is_refused():
    runner = SlowRunner(num_kv_blocks=64, block_size=BS)
    eng = make(runner, max_waiting=1, max_num_seqs=1)

    async def main():
        first = eng.generate(req("a", P, max_tokens=50))
        task = asyncio.ensure_future(first.__anext__())
        await asyncio.sleep(0.05)
        second = eng.generate(req("b", P, max_tokens=50))
        task2 = asyncio.ensure_future(second.__anext__())
        await asyncio.sleep(0.1)
        with pytest.raises(EngineOverloadedError):
            await eng.generate(req("c", P)).__anext__()
        task.cancel()
        task2.cancel()

    try:
        asyncio.run(main())
    finally:
        runner.gate.release(1000)
        eng.shutdown()


def test_idle_engine_thread_sleeps():
    runner = SlowRunner(num_kv_blocks=64, block_size=BS)
    eng = make(runner)
    try:
        import time

        before = eng.engine.num_steps
        time.sleep(0.2)
        assert eng.engine.num_steps == before == 0 and runner.steps == 0
        assert eng._thread.is_alive()
    finally:
        eng.shutdown()


class SnapshotLog(LLMEngine):
    """Records, at each ``stats()`` (the snapshot AsyncEngine takes before delivering a step's
    outputs), the blocks in use and whether any request is left."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.snapshots: list[tuple[int, bool]] = []

    def stats(self):
        self.snapshots.append((self.cache.num_used, bool(self.requests)))
        return super().stats()


def test_the_snapshot_before_a_last_output_has_the_blocks_back():
    """A finished request's blocks are freed after the step (LLMEngine.step), but AsyncEngine
    frees them before its snapshot: a consumer that got its last output never reads a snapshot
    that still counts them (deterministic: no snapshot with nobody left holds blocks)."""
    engine = SnapshotLog(EngineConfig(model_dir="/models/fake", block_size=BS), FakeRunner(num_kv_blocks=64, block_size=BS))
    eng = AsyncEngine(engine)

    async def main():
        async for out in eng.generate(req("a", P, max_tokens=3)):
            last = out
        return last, await eng.stats()

    try:
        last, stats = asyncio.run(main())
        assert last.finished and stats["kv_blocks_used"] == 0
    finally:
        eng.shutdown()
    assert not [used for used, left in engine.snapshots if used and not left]
