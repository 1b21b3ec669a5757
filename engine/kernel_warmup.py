"""Eager steps a GPU runner runs once at start, so that Triton compiles what the eager path may launch
before a request has to wait for it.

Why: Triton compiles a kernel once per set of constexprs, at the first launch that asks for it, on the
thread that launches: the engine's. The eager prefill picks its kernel, tiles and KV split count per
step (``prefill_attention.plan_prefill``), and the split merge is compiled per split count, so a shape
the engine has not run yet can stop it for a compile of 0.5-2 s while every request on it waits. Session
40's prefill/decode runs on an H100 (docs/gpu.md) caught it: the decode node compiled the split prefill at
its first short suffix over an imported prefix, during serving, and that round's long prompts reached
their first token in 1.25 s against 0.70 in the rounds after. CUDA-graph capture compiles what the graphs
launch; these steps cover the eager path: steps of several sequences, prefills longer than the prefill
graphs, and greedy sampling outside a graph.

Past the forward, kernels run only when a request asks for a feature: the sampling penalties' two
kernels, and the block moves (a copy-on-write's row copy; a KV export's or import's gather and scatter
through the pool's page layout). Without a warm-up the first tenant to ask for one stops every tenant's
steps for its compile; ``feature_batch`` and ``MOVED_BLOCKS`` run each once at start. The feature step
also takes the sampler's other paths once (temperature with top-k, top-p and min-p, a seed, logit bias,
logprobs, a scored prompt): torch ops, no Triton, but each one's first launch loads its CUDA module.

Which steps: every combination of a few token counts, sequences per step and contexts (``candidates``)
that the runner would run eagerly, keeping the first step of each distinct launch the planner would make
(kernel, tiles, split or not), crossed with the row counts the step's other kernels compile for
(``row_class``; ``distinct_steps``). The split merge compiles once per split count, and which counts a
server's steps reach depends on their sequence counts and contexts in ways this grid can miss (session
41: three sequences just past 8,192 tokens split eight ways on an H100, and no step of the grid did), so
the runner compiles it for every count the planner may pick (``prefill_attention.compile_merges``).
Steps share their blocks and write garbage K/V into them: at start no block holds anything a request
could read.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, replace

from engine.batch import ScheduledBatch, SequenceChunk
from engine.protocol import SamplingParams

# Token counts around the planner's thresholds: one and two rows, one and two 16-row groups, the 64-row
# tile and just past it, a graph size and beyond; sequences per step; contexts from the chunk itself to
# the model's longest (a split count changes with the context a step's longest sequence reaches).
TOKEN_COUNTS = (1, 2, 16, 17, 32, 33, 64, 65, 128, 512, 1024, 2048, 4096, 8192)
SEQS_PER_STEP = (1, 2, 4, 8, 16, 32, 64)
CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
WARMUP_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)
# every penalty at once: the Triton path applies all three in one launch, then counts the pick
PENALISED_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0, repetition_penalty=1.1,
                                    frequency_penalty=0.1, presence_penalty=0.1)
# the penalties again, with a scored prompt (``forward_scoring``) and greedy logprobs
SCORED_SAMPLING = replace(PENALISED_SAMPLING, logprobs=2, prompt_logprobs=2)
# every filter of a sampled pick, a seeded generator, a logit bias and logprobs
SAMPLED_SAMPLING = replace(PENALISED_SAMPLING, temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=0,
                           logit_bias=((0, 1.0),), logprobs=2)
# blocks an export and an import move at start: not consecutive, so that the gather and scatter take
# their index kernels (a run of consecutive blocks is copied by slices, compiling nothing), and the
# copy-on-write's source and destination (distinct: a copy within one block races)
MOVED_BLOCKS = (0, 2)
COPIED_BLOCK = (1, 3)  # (src, dst)


def row_class(num_tokens: int) -> tuple[bool, bool, int]:
    """What the step's other kernels compile per row count: Triton specialises an integer argument on
    being 1 and on dividing by 16 (where the kernel does not opt out), and the decode-sized kernels take
    at most 32 rows, picking a row tile from the count (``gate_up_silu``: 16 up to 16 rows, 32 up to 32)."""
    bucket = 16 if num_tokens <= 16 else 32 if num_tokens <= 32 else 64 if num_tokens <= 64 else 0
    return num_tokens == 1, num_tokens % 16 == 0, bucket


@dataclass(frozen=True)
class WarmupStep:
    """A step of ``num_seqs`` sequences whose new tokens sum to ``num_tokens`` (the first sequence takes
    all but one token for each other sequence), every sequence at ``context`` tokens after the step."""

    num_tokens: int
    num_seqs: int
    context: int

    @property
    def first_chunk_tokens(self) -> int:
        return self.num_tokens - (self.num_seqs - 1)


def candidates(token_budget: int, max_seqs: int, max_context: int) -> Iterator[WarmupStep]:
    """Step shapes within the runner's limits: at most ``token_budget`` new tokens and ``max_seqs``
    sequences a step, contexts up to ``max_context`` (the model's, or what the KV pool holds)."""
    for tokens in sorted({t for t in TOKEN_COUNTS if t <= token_budget} | {token_budget}):
        for seqs in sorted({s for s in SEQS_PER_STEP if s <= min(max_seqs, tokens)} | {min(max_seqs, tokens)}):
            first = tokens - (seqs - 1)
            for context in sorted({first, *(c for c in CONTEXTS if first <= c <= max_context)}):
                if context <= max_context:
                    yield WarmupStep(tokens, seqs, context)


def distinct_steps(steps: Iterator[WarmupStep], eager: Callable[[WarmupStep], bool],
                   launch_key: Callable[[WarmupStep], Hashable]) -> list[WarmupStep]:
    """The first step of each distinct ``launch_key`` among those the runner runs ``eager``ly."""
    kept: dict[Hashable, WarmupStep] = {}
    for step in steps:
        if eager(step):
            kept.setdefault(launch_key(step), step)
    return list(kept.values())


def warmup_batch(step: WarmupStep, block_size: int, tag: str) -> ScheduledBatch:
    """``step`` as a batch: token id 0 everywhere, every sequence on blocks 0 .. context / block_size."""
    table = list(range(-(-step.context // block_size)))
    chunks = []
    for i in range(step.num_seqs):
        n = step.first_chunk_tokens if i == 0 else 1
        chunks.append(SequenceChunk(f"{tag}-{i}", [0] * n, step.context - n, table, True, WARMUP_SAMPLING))
    return ScheduledBatch(chunks)


def feature_batch(tag: str) -> ScheduledBatch:
    """A step with every sampling penalty on: what the first penalised request's steps launch past the
    forward; one sequence prefills a two-token prompt it scores (``SCORED_SAMPLING``: one target), the
    other decodes a token with every filter of a sampled pick (``SAMPLED_SAMPLING``). Two sequences, one
    of them prefilling, so that the step runs eagerly: a decode graph's replay would count as a served
    step in its statistics (``DecodeGraphs.num_runs``), and the kernels after it are the same."""
    return ScheduledBatch([SequenceChunk(f"{tag}-0", [0, 0], 0, [0], True, SCORED_SAMPLING, prompt_targets=(0,),
                                         prompt_token_ids=(0, 0)),
                           SequenceChunk(f"{tag}-1", [0], 1, [0], True, SAMPLED_SAMPLING, prompt_token_ids=(0,))])
