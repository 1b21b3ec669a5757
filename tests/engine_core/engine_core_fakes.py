"""Test doubles for the model: a byte tokenizer and a runner whose "KV cache" stores token ids.

``FakeRunner`` writes each computed token's id into its (block, slot) exactly where a real runner
writes K/V, and predicts the next token from the context it *reads back from the blocks* of the
chunk's block table. So a wrong block table, a reused block holding other tokens, a prefix hit on
the wrong block or a slot never written changes (or breaks) the output: comparing against
``reference_generate`` (pure function of the token sequence) checks the engine's block logic.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from engine.batch import ScheduledBatch, StepResult
from engine.protocol import StaticTenantScope
from engine.request import Request
from engine.tokenizer_pool import TokenizerPool

VOCAB = 256
EOS = 0


def next_token(context: Sequence[int]) -> int:
    """Deterministic 'model': a hash of the whole context, never EOS, printable ASCII."""
    digest = hashlib.sha256(bytes(t % 256 for t in context)).digest()
    return 97 + digest[0] % 26  # a..z


def reference_generate(prompt: Sequence[int], n: int, fn: Callable[[Sequence[int]], int] = next_token) -> list[int]:
    ctx = list(prompt)
    out = []
    for _ in range(n):
        tok = fn(ctx)
        out.append(tok)
        ctx.append(tok)
    return out


class ByteTokenizer:
    """UTF-8 bytes as token ids; id 0 is EOS (a special token)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        data = bytes(i for i in ids if not (skip_special_tokens and i == EOS))
        return data.decode("utf-8", errors="replace")


@dataclass
class FakeSpec:
    vocab_size: int = VOCAB
    max_model_len: int = 4096
    eos_token_ids: tuple[int, ...] = (EOS,)


@dataclass
class FakeRunner:
    num_kv_blocks: int = 64
    block_size: int = 4
    max_model_len: int = 4096
    fn: Callable[[Sequence[int]], int] = next_token
    fail_request_ids: set[str] = field(default_factory=set)
    kv_bytes_per_block: int = 1024

    def __post_init__(self) -> None:
        self.spec = FakeSpec(max_model_len=self.max_model_len)
        self.tokenizer = ByteTokenizer()
        self.tokenizers = TokenizerPool(self.tokenizer)
        self.max_token_chars = 1  # one byte a token: a character is at least one
        self.kv: list[list[int | None]] = [[None] * self.block_size for _ in range(self.num_kv_blocks)]
        self.batches: list[ScheduledBatch] = []
        self.released: list[str] = []

    def execute(self, batch: ScheduledBatch) -> StepResult:
        self.batches.append(batch)
        for chunk in batch.chunks:
            if chunk.request_id in self.fail_request_ids:
                raise RuntimeError(f"injected failure for {chunk.request_id}")
        out: list[int | None] = []
        bs = self.block_size
        for chunk in batch.chunks:
            assert len(chunk.block_table) * bs >= chunk.context_len, "block table too short"
            for j, tok in enumerate(chunk.token_ids):
                pos = chunk.start_pos + j
                self.kv[chunk.block_table[pos // bs]][pos % bs] = tok
        for chunk in batch.chunks:
            if not chunk.sample:
                out.append(None)
                continue
            ctx = [self.kv[chunk.block_table[p // bs]][p % bs] for p in range(chunk.context_len)]
            assert None not in ctx, "read a KV slot that was never written"
            out.append(self.fn(ctx))  # type: ignore[arg-type]
        return StepResult(out)

    def render_prompt(self, messages, tools=None) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        return self.tokenizer.encode(text)

    def release(self, request_id: str) -> None:
        self.released.append(request_id)

    def admit_grammar(self, spec):
        raise ValueError("the fake runner has no grammar support")

    def token_bytes(self, token_ids) -> list[bytes]:
        return [bytes([t]) for t in token_ids]


@dataclass(eq=False)
class FakeLaunch:
    """One step queued on ``FakeOverlapRunner``'s "device"; ``result`` is set once it ran."""

    batch: ScheduledBatch
    feed: tuple[tuple[int, int], ...]
    after: FakeLaunch | None
    result: StepResult | None = None


@dataclass
class FakeOverlapRunner(FakeRunner):
    """``FakeRunner`` with overlapped steps: ``launch`` only queues a step, ``collect`` runs every
    queued step up to the one asked for, in launch order (one device stream). So a step's K/V is
    written when the host has long moved on, and a block the host freed and gave to a later step is
    written by the earlier one first, as on the device. A fed chunk (a placeholder) takes the token
    the step it follows sampled for the named chunk."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.queued: list[FakeLaunch] = []
        self.launched: list[ScheduledBatch] = []

    def launch(self, batch: ScheduledBatch, feed: Sequence[tuple[int, int]] = (),
               after: FakeLaunch | None = None) -> FakeLaunch:
        step = FakeLaunch(batch, tuple(feed), after)
        self.queued.append(step)
        self.launched.append(batch)
        return step

    def collect(self, handle: FakeLaunch) -> StepResult:
        while handle.result is None:
            self._run(self.queued.pop(0))
        return handle.result

    def _run(self, step: FakeLaunch) -> None:
        chunks = list(step.batch.chunks)
        for i, j in step.feed:
            assert step.after is not None and step.after.result is not None, "fed from a step that never ran"
            token = step.after.result.sampled_token_ids[j]
            chunks[i] = replace(chunks[i], token_ids=(token,))
        step.result = self.execute(ScheduledBatch(tuple(chunks), step.batch.block_copies))


def scope(name: str = "t", **kw) -> StaticTenantScope:
    return StaticTenantScope(namespace=name.encode(), metrics_label=name, **kw)


def make_request(
    request_id: str,
    prompt: Sequence[int],
    tenant: StaticTenantScope | None = None,
    block_size: int = 4,
    max_tokens: int = 4,
    arrival_time: float = 0.0,
) -> Request:
    from engine.protocol import SamplingParams

    return Request(
        request_id=request_id,
        tenant=tenant or scope(),
        prompt_token_ids=list(prompt),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        block_size=block_size,
        arrival_time=arrival_time,
    )
