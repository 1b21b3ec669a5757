"""The contract between the scheduler side (pure Python) and the model runner (torch).

One engine step = one ``ScheduledBatch``: for each running sequence, the slice of its tokens to
compute now (a prefill chunk, or the single newest token when decoding) plus its block table.
The runner writes those tokens' K/V into the paged cache, attends over the whole context held in
the sequence's blocks (cached prefix + earlier chunks + this chunk, causally), and samples one
token for each chunk with ``sample=True``.

KV cache layout (block-major: one block is one contiguous run of bytes, so a tier transfer or
a copy-on-write is one memcpy per block)::

    kv_cache: [num_blocks, num_layers, 2 (k|v), block_size, num_kv_heads, head_dim]
    layer l's keys   = kv_cache[:, l, 0]  -> [num_blocks, block_size, num_kv_heads, head_dim]
    layer l's values = kv_cache[:, l, 1]  (strided views; kernels take every stride as given)

``kv_cache`` is indexed in that order whatever the order of a block's bytes in memory
(engine/kv_layout.py: a page token by token, or head by head on a GPU).

Token ``p`` of a sequence lives in block ``block_table[p // block_size]`` at slot
``p % block_size``.

No torch here: the scheduler imports this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.protocol import SamplingParams


@dataclass(frozen=True)
class SequenceChunk:
    """One sequence's work in one step.

    Attributes:
        request_id: stable id; the runner keys per-request sampling state (seeded RNG) on it.
        token_ids: tokens to compute now; their positions are start_pos .. start_pos+len-1.
        start_pos: tokens already in the KV cache for this sequence (cached prefix included).
        block_table: every block of the sequence in order; covers start_pos + len(token_ids).
        sample: sample a next token after this chunk (last prefill chunk, or a decode step).
        sampling: the request's sampling parameters.
        output_token_ids: tokens generated so far (for seeded, reproducible sampling offsets).
        prompt_targets: the prompt tokens this chunk's positions predict, for a request that scores
            its prompt (``SamplingParams.prompt_logprobs``): row j (position start_pos + j) scores
            ``prompt_targets[j]``, the prompt token at start_pos + j + 1. Shorter than the chunk
            where it reaches the prompt's end; empty = score nothing.
        prompt_token_ids: the request's whole prompt, on a sampled chunk of a request with a
            ``repetition_penalty`` (its prompt's tokens are penalised too); empty otherwise.

    Which prompt tokens a chunk scores (P prompt tokens, chunk of n tokens at start_pos s)::

        positions   s      s+1     ...   s+n-1          | next chunk starts at s+n
        scores      tok s+1  tok s+2 ...  tok s+n       (the last row scores the next chunk's first)
        up to       tok P-1  (the first prompt token, tok 0, has no predecessor: never scored)
    """

    request_id: str
    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    sample: bool
    sampling: SamplingParams
    output_token_ids: Sequence[int] = ()
    prompt_targets: Sequence[int] = ()
    prompt_token_ids: Sequence[int] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class BlockCopy:
    """Copy block ``src`` to ``dst`` before the step runs (copy-on-write of a shared tail)."""

    src: int
    dst: int


@dataclass(frozen=True)
class ScheduledBatch:
    chunks: Sequence[SequenceChunk]
    block_copies: Sequence[BlockCopy] = field(default_factory=tuple)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_decode_only(self) -> bool:
        return all(c.num_tokens == 1 and c.start_pos > 0 for c in self.chunks)


@dataclass(frozen=True)
class PromptScores:
    """One chunk's prompt scores: per row of ``SequenceChunk.prompt_targets``, the target's raw
    logprob and the ``sampling.prompt_logprobs`` most likely (token id, logprob) pairs there."""

    logprobs: tuple[float, ...]
    top: tuple[tuple[tuple[int, float], ...], ...]


@dataclass(frozen=True)
class StepResult:
    """What the runner returns for one batch: a token per chunk (None where sample=False).

    ``logprobs``: the sampled token's raw log-probability per chunk; ``top_logprobs``: per chunk,
    (token id, logprob) of the most likely tokens when its request asked for them, else None;
    ``grammar_dead_ends``: per chunk, why its grammar could not continue (engine.guided), else None
    (empty: none did); ``prompt_scores``: per chunk, the scores of its ``prompt_targets``, else None
    (empty: no chunk had targets)."""

    sampled_token_ids: Sequence[int | None]
    logprobs: Sequence[float | None] = ()
    top_logprobs: Sequence[tuple[tuple[int, float], ...] | None] = ()
    grammar_dead_ends: Sequence[str | None] = ()
    prompt_scores: Sequence[PromptScores | None] = ()
