"""AsyncEngine's per-tenant prepare lanes on the real tiny model: one tenant's long chat render
never delays another tenant's request, and one tenant holds at most one prepare thread and a
bounded queue. Renders are held at a gate, so which request is where is the test's to say, never
the clock's."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client import CollectorRegistry

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.disagg.api import DisaggConfig, Role
from engine.disagg.metrics import TransferMetrics
from engine.disagg.node import DisaggEngine
from engine.launch import build_engine
from engine.protocol import GenerateRequest, PrepareQueueFullError, SamplingParams, StaticTenantScope

ALICE = StaticTenantScope(namespace=b"ns-alice", tenant_key=b"alice")
BOB = StaticTenantScope(namespace=b"ns-bob", tenant_key=b"bob")
HELD = "a chat whose render waits at the gate"  # stands for a 4,000-message chat (~1 s of Jinja)
QUEUED_PER_TENANT = 2
WAIT_S = 20.0  # far above any step of the tiny model; reached only when a request is stuck


class HeldRenders:
    """The runner's real chat render, but a chat whose first message is ``HELD`` waits for
    ``gate`` first; counts the renders waiting there (now and at most at once)."""

    def __init__(self, render: Callable[[Sequence[dict], Sequence[dict] | None], list[int]]) -> None:
        self._render = render
        self.gate = threading.Event()
        self._lock = threading.Lock()
        self.inside = 0
        self.peak = 0

    def __call__(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        if messages[0]["content"] == HELD:
            with self._lock:
                self.inside += 1
                self.peak = max(self.peak, self.inside)
            try:
                assert self.gate.wait(timeout=60), "the test never opened the gate"
            finally:
                with self._lock:
                    self.inside -= 1
        return self._render(messages, tools)


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Iterator[AsyncEngine]:
    eng = build_engine(EngineConfig(model_dir=tiny_model_dir, block_size=16, num_kv_blocks=64,
                                    prepare_workers=4, prepare_queued_per_tenant=QUEUED_PER_TENANT))
    yield eng
    eng.shutdown()


@pytest.fixture
def renders(engine, monkeypatch) -> Iterator[HeldRenders]:
    held = HeldRenders(engine.engine.runner.render_prompt)
    monkeypatch.setattr(engine.engine.runner, "render_prompt", held)
    try:
        yield held
    finally:
        held.gate.set()  # a failed test leaves no prepare thread waiting


def chat(rid: str, tenant: StaticTenantScope, content: str = "hi") -> GenerateRequest:
    return GenerateRequest(rid, tenant, SamplingParams(max_tokens=3, temperature=0.0),
                           messages=[{"role": "user", "content": content}])


def text(rid: str, tenant: StaticTenantScope) -> GenerateRequest:
    return GenerateRequest(rid, tenant, SamplingParams(max_tokens=3, temperature=0.0), prompt="Hello there")


async def collect(eng: AsyncEngine, request: GenerateRequest) -> list[int]:
    ids: list[int] = []
    async for out in eng.generate(request):
        ids += out.new_token_ids
    return ids


async def until(condition: Callable[[], bool]) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.005)
    await asyncio.wait_for(poll(), WAIT_S)


def test_a_tenants_held_chat_render_never_delays_another_tenants_request(engine, renders):
    """Audit (isolation): ``AsyncEngine`` prepared every text prompt (and guided or logprobs
    request) on one thread, so on a node, in the CLI or in library use, bob's 3-word prompt
    waited behind alice's chat render (~1 s for 4,000 messages) and every other tenant's behind
    that. Now each tenant has its own lane: while alice's render is held, bob's text, chat and
    token-id-with-logprobs requests finish, and alice's once her render ends."""
    bob_ids = GenerateRequest("bob-ids", BOB, SamplingParams(max_tokens=3, temperature=0.0, logprobs=1),
                              prompt_token_ids=[5, 6, 7, 8])

    async def main() -> tuple[list[list[int]], bool, list[int]]:
        alice = asyncio.create_task(collect(engine, chat("alice", ALICE, HELD)))
        await until(lambda: renders.inside == 1)
        bobs = await asyncio.wait_for(asyncio.gather(
            collect(engine, text("bob-text", BOB)), collect(engine, chat("bob-chat", BOB)),
            collect(engine, bob_ids)), WAIT_S)
        alice_waited = not alice.done() and renders.inside == 1
        renders.gate.set()
        return bobs, alice_waited, await asyncio.wait_for(alice, WAIT_S)

    bobs, alice_waited, alice_ids = asyncio.run(main())
    assert [len(ids) for ids in bobs] == [3, 3, 3]
    assert alice_waited, "alice's render was not held while bob's requests ran"
    assert len(alice_ids) == 3


def test_one_tenant_holds_one_prepare_thread_and_a_bounded_queue(engine, renders):
    """Audit (fairness): one tenant must not take the prepare threads from the others. Alice's
    three held chats take one thread (three stay idle): one renders, two wait in her lane; a
    fourth is refused at once with a 429 (``prepare_queue_full``, retry in 1 s), nothing queued;
    bob's request meanwhile finishes. A waiting request whose client goes away frees its place;
    once the render ends alice's requests all finish, never more than one rendering at once."""

    async def main() -> tuple[PrepareQueueFullError, tuple[int, int], list[int], list[list[int]]]:
        alices = [asyncio.create_task(collect(engine, chat(f"alice-{i}", ALICE, HELD))) for i in range(3)]
        await until(lambda: engine.preparing(ALICE) == (1, QUEUED_PER_TENANT) and renders.inside == 1)
        with pytest.raises(PrepareQueueFullError, match="waiting to be prepared") as full:
            await collect(engine, chat("alice-over", ALICE, HELD))
        after_refusal = engine.preparing(ALICE)
        bob = await asyncio.wait_for(collect(engine, text("bob", BOB)), WAIT_S)
        alices[2].cancel()  # its client went away while it waited in alice's lane
        await until(lambda: engine.preparing(ALICE) == (1, QUEUED_PER_TENANT - 1))
        alices[2] = asyncio.create_task(collect(engine, chat("alice-again", ALICE, HELD)))
        await until(lambda: engine.preparing(ALICE) == (1, QUEUED_PER_TENANT))
        renders.gate.set()
        done = await asyncio.wait_for(asyncio.gather(*alices), WAIT_S)
        return full.value, after_refusal, bob, done

    full, after_refusal, bob, alices = asyncio.run(main())
    assert (full.status, full.code, full.retry_after_s) == (429, "prepare_queue_full", 1)
    assert after_refusal == (1, QUEUED_PER_TENANT), "the refused request was queued"
    assert len(bob) == 3
    assert [len(ids) for ids in alices] == [3, 3, 3]
    assert renders.peak == 1, "alice rendered on more than one prepare thread at once"
    assert engine.preparing(ALICE) == (0, 0)


def test_a_split_nodes_lookup_prepares_in_the_tenants_lane(engine, renders):
    """Audit (isolation): a prefill/decode node's KV lookup tokenized in the event loop's default
    executor, whose threads every tenant's lookups and KV sends share: alice's long renders held
    them. Now it prepares in alice's lane: with the default executor at one thread, bob's lookup
    answers while alice's render is held, and alice's once it ends."""
    node = DisaggEngine(engine, engine.engine.runner, DisaggConfig(Role.PREFILL, node_token="t"),
                        TransferMetrics(CollectorRegistry()))

    async def main() -> tuple[int, bool, int]:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(1))
        alice = asyncio.create_task(node.lookup(chat("alice", ALICE, HELD)))
        await until(lambda: renders.inside == 1)
        bob = await asyncio.wait_for(node.lookup(chat("bob", BOB)), WAIT_S)
        alice_waited = not alice.done()
        renders.gate.set()
        return bob.prompt_tokens, alice_waited, (await asyncio.wait_for(alice, WAIT_S)).prompt_tokens

    bob_tokens, alice_waited, alice_tokens = asyncio.run(main())
    assert bob_tokens > 0 and alice_tokens > 0
    assert alice_waited, "alice's render was not held while bob's lookup ran"
