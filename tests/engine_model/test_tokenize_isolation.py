"""One tenant's long chat render does not hold up another tenant's request (audit: DoS 3).

The engine once held one tokenizer lock for the whole chat-template render and encode of a
prompt, and for the engine thread's detokenizing: tenant A's 4,095-message prompt (~1 s to
render) delayed tenant B's 3-word request by seconds. Now every thread borrows its own
tokenizer copy (``engine.tokenizer_pool``), and a prompt whose size alone rules it out is refused
before any render (``engine.prompt_bounds``).

A's render is held mid-way by a content part whose ``get("text")`` waits for the test when the
renderer reads it: the test knows A is inside its render, and B must
finish its whole request (tokenize, prefill, decode, detokenize) before A is let go. An ordering
check, not a timing threshold: with the old lock B could not finish until A was released.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.config import EngineConfig
from engine.protocol import GenerateRequest, PromptTooLongError, SamplingParams, StaticTenantScope

ALICE = StaticTenantScope(namespace=b"ns-alice", tenant_key=b"alice")
BOB = StaticTenantScope(namespace=b"ns-bob", tenant_key=b"bob")
WAIT_S = 60.0  # a liveness bound for a hung thread, never reached when the code is right


class RenderGate(dict):
    """A content part (no text) that counts the renderer's reads of its ``text``: the size bound
    reads it once (``engine.prompt_bounds``), the chat renderer once more when it protects client
    text (``engine.models.chat_render``, inside the render, with the tokenizer in hand). At that
    second read it reports that the render is under way and holds it there until released."""

    def __init__(self) -> None:
        super().__init__(type="gate")
        self.reads = 0
        self.inside = threading.Event()
        self.release = threading.Event()

    def get(self, key, default=None):
        if key == "text":
            self.reads += 1
            if self.reads == 2:
                self.inside.set()
                self.release.wait(WAIT_S)
        return super().get(key, default)


@pytest.fixture(scope="module")
def smol_engine(smol_model_dir):
    from engine.launch import build_engine

    engine = build_engine(EngineConfig(model_dir=smol_model_dir, num_kv_blocks=128, max_num_batched_tokens=64,
                                       max_model_len=1024))
    yield engine
    engine.shutdown()


def _chat(rid: str, tenant: StaticTenantScope, content: object, max_tokens: int = 3) -> GenerateRequest:
    return GenerateRequest(request_id=rid, tenant=tenant, messages=[{"role": "user", "content": content}],
                           sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0))


def _generate(engine, request: GenerateRequest) -> list[int]:
    async def main() -> list[int]:
        ids: list[int] = []
        async for out in engine.generate(request):
            ids += out.new_token_ids
        return ids

    return asyncio.run(main())


def test_bobs_whole_request_completes_while_alices_render_is_in_flight(smol_engine):
    gate = RenderGate()
    alice = _chat("alice-long", ALICE, [{"type": "text", "text": "many messages' worth"}, gate])
    alice_result: list[object] = []
    a = threading.Thread(target=lambda: alice_result.append(smol_engine.tokenize(alice)), daemon=True)
    a.start()
    try:
        assert gate.inside.wait(WAIT_S), "alice's render never reached the gate"
        bob_ids: list[int] = []
        b = threading.Thread(target=lambda: bob_ids.extend(_generate(smol_engine, _chat("bob", BOB, "Say hi."))),
                             daemon=True)
        b.start()
        b.join(WAIT_S)
        assert not b.is_alive() and len(bob_ids) == 3, "bob's request waited for alice's render"
        assert a.is_alive() and not alice_result, "alice's render was still in flight"
    finally:
        gate.release.set()
    a.join(WAIT_S)
    assert alice_result and len(alice_result[0]) > 0  # type: ignore[arg-type]


def test_a_prompt_over_the_character_bound_is_refused_without_rendering(smol_engine):
    llm = smol_engine.engine
    bounds = llm.prompt_bounds
    assert bounds.max_token_chars >= 16  # the vocabulary's longest token (80 '#' for SmolLM2)
    gate = RenderGate()
    over = "x" * (bounds.max_chars + 1)
    with pytest.raises(PromptTooLongError, match="characters") as info:
        smol_engine.tokenize(_chat("too-long", ALICE, [{"type": "text", "text": over}, gate]))
    assert info.value.code == "context_length_exceeded"
    assert gate.reads == 1 and not gate.inside.is_set(), "the renderer ran for a prompt the bound rules out"
    with pytest.raises(PromptTooLongError, match="characters"):  # a completion's text prompt too
        smol_engine.tokenize(GenerateRequest(request_id="t", tenant=ALICE, prompt=over,
                                             sampling=SamplingParams(max_tokens=1)))


def test_too_many_messages_are_refused_without_rendering(smol_engine):
    bounds = smol_engine.engine.prompt_bounds
    gate = RenderGate()
    messages = [{"role": "user", "content": "hi"}] * bounds.max_messages
    messages.append({"role": "user", "content": [gate]})
    request = GenerateRequest(request_id="many", tenant=ALICE, messages=messages, sampling=SamplingParams(max_tokens=1))
    with pytest.raises(PromptTooLongError, match="messages"):
        smol_engine.tokenize(request)
    assert gate.reads == 0, "the renderer ran for a prompt the bound rules out"  # the count alone refused it


def test_a_prompt_within_the_bounds_but_over_the_context_gets_the_exact_check(smol_engine):
    """The bounds only refuse what cannot fit: 1,000 words fit the character bound and are then
    measured exactly (a different message: the token counts)."""
    with pytest.raises(PromptTooLongError, match="in the prompt, 3 in the completion"):
        asyncio.run(_drain(smol_engine, _chat("exact", ALICE, "word " * 1000)))


async def _drain(engine, request: GenerateRequest) -> None:
    async for _ in engine.generate(request):
        pass
