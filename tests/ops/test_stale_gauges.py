"""#16.13: after many dropped streams the engine is idle, and its gauges must say so.

Root cause: the engine published its gauges only at the end of a step; aborts that leave it idle
run no step, so ``prefixgate_kv_blocks_used`` and ``prefixgate_running_requests`` kept the values
of the last step (seen: 20 and 4 after 200 dropped streams).
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.metrics import EngineMetrics
from engine.protocol import GenerateRequest, SamplingParams
from tests.engine_core.engine_core_fakes import FakeRunner, scope

BS = 8


def _gauge(registry: CollectorRegistry, name: str) -> float:
    value = registry.get_sample_value(name)
    assert value is not None, name
    return value


class SlowRunner(FakeRunner):
    """2 ms a step: 200 tokens take far longer than a client takes to drop its stream, so (on any
    machine) the requests end by abort, the path that used to leave the gauges stale."""

    def execute(self, batch):
        time.sleep(0.002)
        return super().execute(batch)


def test_dropped_streams_leave_no_stale_gauges():
    registry = CollectorRegistry()
    config = EngineConfig(model_dir="fake", block_size=BS, max_num_seqs=4, max_num_batched_tokens=256)
    eng = AsyncEngine(LLMEngine(config, SlowRunner(num_kv_blocks=128, block_size=BS), EngineMetrics(registry)))

    async def drop(i: int) -> None:
        prompt = [97 + (i + j) % 26 for j in range(20)]
        request = GenerateRequest(f"r{i}", scope(), SamplingParams(max_tokens=200, temperature=0.0),
                                  prompt_token_ids=prompt)
        async for _ in eng.generate(request):
            return  # the client goes away after its first token

    async def main() -> None:
        for start in range(0, 200, 20):  # 200 streams, 20 at a time
            await asyncio.gather(*(drop(i) for i in range(start, start + 20)))

    try:
        asyncio.run(main())
        # A dropped stream's generator is closed later by the event loop: wait until the engine has
        # seen every abort, however loaded the machine, rather than for a fixed time.
        def ended() -> float:
            return registry.get_sample_value("prefixgate_requests_finished_total",
                                             {"tenant": scope().metrics_label, "finish_reason": "abort"}) or 0.0

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            stats = asyncio.run(eng.stats())
            idle = stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_used"] == 0
            if idle and ended() == 200:
                break
            time.sleep(0.05)
        assert stats["running"] == 0 and stats["kv_blocks_used"] == 0, stats
        time.sleep(0.1)  # the engine thread is idle now: nothing will publish again
        assert _gauge(registry, "prefixgate_running_requests") == 0
        assert _gauge(registry, "prefixgate_kv_blocks_used") == 0
        assert _gauge(registry, "prefixgate_kv_blocks_free") == stats["kv_blocks_free"]
        assert ended() == 200
    finally:
        eng.shutdown()


def test_a_failed_step_leaves_no_stale_gauges(monkeypatch):
    """The same class of bug on the other path that ends requests without finishing a step: a step
    that raises outside any one request (``fail_all``)."""
    registry = CollectorRegistry()
    config = EngineConfig(model_dir="fake", block_size=BS, max_num_seqs=4, max_num_batched_tokens=256)
    llm = LLMEngine(config, FakeRunner(num_kv_blocks=128, block_size=BS), EngineMetrics(registry))
    eng = AsyncEngine(llm)
    real_schedule = llm.scheduler.schedule
    calls = {"n": 0}

    def schedule_then_fail():
        # once, when all four requests hold blocks and have run a step: under load the fourth can
        # arrive after a fixed step count, then runs alone to its length (a CI run saw that)
        running = llm.scheduler.running
        if not calls["n"] and len(running) == 4 and all(r.num_computed_tokens for r in running):
            calls["n"] += 1
            raise RuntimeError("injected scheduler bug")
        return real_schedule()

    monkeypatch.setattr(llm.scheduler, "schedule", schedule_then_fail)

    async def run(i: int) -> str | None:
        prompt = [97 + (i + j) % 26 for j in range(20)]
        request = GenerateRequest(f"f{i}", scope(), SamplingParams(max_tokens=200, temperature=0.0),
                                  prompt_token_ids=prompt)
        last = None
        async for out in eng.generate(request):
            last = out
        return last.finish_reason if last else None

    async def main() -> list[str | None]:
        return await asyncio.gather(*(run(i) for i in range(4)))

    try:
        assert asyncio.run(main()) == ["error"] * 4
        time.sleep(0.1)
        assert _gauge(registry, "prefixgate_running_requests") == 0
        assert _gauge(registry, "prefixgate_kv_blocks_used") == 0
    finally:
        eng.shutdown()
