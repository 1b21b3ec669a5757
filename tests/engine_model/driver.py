"""A minimal hand-driven "scheduler" for runner tests: block tables, chunked prefill, decode.

It plays the engine-core's role just enough to exercise the runner contract: each step, every
unfinished sequence contributes its next prompt chunk (or its newest token when decoding), all
in ONE ScheduledBatch, so prefill chunks and decodes are mixed in one packed forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.batch import ScheduledBatch, SequenceChunk
from engine.protocol import SamplingParams
from tests.greedy_reference import hf_greedy  # noqa: F401  (re-exported: the tests import it from here)

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


@dataclass
class Seq:
    request_id: str
    tokens: list[int]  # prompt, then generated tokens appended
    block_table: list[int]
    computed: int = 0  # tokens whose K/V are in the cache (a cached prefix starts here)
    sampling: SamplingParams = GREEDY
    output: list[int] = field(default_factory=list)
    prompt_len: int = 0

    def __post_init__(self) -> None:
        self.prompt_len = len(self.tokens)


class BlockAllocator:
    """Hands out block ids in a scrambled order so block tables are never contiguous ranges."""

    def __init__(self, num_blocks: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()

    def take(self, n: int) -> list[int]:
        assert len(self.free) >= n, "test ran out of KV blocks"
        out, self.free = self.free[:n], self.free[n:]
        return out


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def run(runner, seqs: list[Seq], max_new: int, chunk: int | None = None) -> list[list[int]]:
    """Step until every sequence has ``max_new`` generated tokens; returns each one's outputs."""
    while any(len(s.output) < max_new for s in seqs):
        chunks = []
        active = [s for s in seqs if len(s.output) < max_new]
        for s in active:
            todo = len(s.tokens) - s.computed
            n = todo if chunk is None else min(chunk, todo)
            chunks.append(SequenceChunk(
                request_id=s.request_id,
                token_ids=s.tokens[s.computed:s.computed + n],
                start_pos=s.computed,
                block_table=s.block_table,
                sample=s.computed + n == len(s.tokens),
                sampling=s.sampling,
                output_token_ids=tuple(s.output),
            ))
        result = runner.execute(ScheduledBatch(chunks))
        for s, c, tok in zip(active, chunks, result.sampled_token_ids, strict=True):
            s.computed += c.num_tokens
            if c.sample:
                assert tok is not None
                s.output.append(tok)
                s.tokens.append(tok)
            else:
                assert tok is None
    return [s.output for s in seqs]
