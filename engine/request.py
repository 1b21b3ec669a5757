"""``Request``: one generation's state inside the engine (the scheduler's and the step loop's unit).

Token layout of a request (``all_token_ids = prompt_token_ids + output_token_ids``)::

    |<------------------ prompt ------------------>|<---- output ---->|
    |<- cached (hit) ->|<- computed by prefill -->|   decoded         |
    [ block 0 ][ block 1 ][ block 2 ][ block 3 ][ blk 4 ...             block_table
     h_0        h_1        h_2        h_3        (partial: no hash)    block_hashes (full blocks)

``num_computed_tokens`` counts tokens whose K/V is in the request's blocks; the next chunk starts
there. ``block_hashes`` grows as blocks fill (each block hashed once); ``num_registered_blocks``
counts how many leading blocks are already in the prefix index.

No torch here.
"""

from __future__ import annotations

import enum
import time
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING

from engine.kv_types import BlockHash, QueueReason
from engine.prefix_index import block_hashes, packed_block_hashes
from engine.protocol import FinishReason, OutputFailure, Retention, SamplingParams, TenantScope

if TYPE_CHECKING:
    from engine.protocol import TokenLogprob


# The not-yet-known newest token of an overlapped step (never a vocabulary id: a runner fed it
# without the device-side token would fail on the embedding lookup instead of computing garbage).
PLACEHOLDER_TOKEN = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class DetokenizerState:
    """Incremental detokenization: decode a short window so each step costs O(window), not O(n).

    ``tokens`` = a few trailing prompt tokens (context for leading-space rules) + output tokens.
    Text of tokens ``[prefix_offset, read_offset)`` was already emitted; decoding from
    ``prefix_offset`` and diffing keeps merges across token boundaries right.
    """

    tokens: list[int]
    prefix_offset: int
    read_offset: int


@dataclass(eq=False)
class Request:
    request_id: str
    tenant: TenantScope
    prompt_token_ids: list[int]
    sampling: SamplingParams
    block_size: int
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    retention: tuple[Retention, ...] = ()  # prompt prefixes to keep cached (GenerateRequest.retention)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prompt tokens served from cache at first admission
    # the furthest its prompt's K/V ever got (a preemption resets num_computed_tokens, not this):
    # what an abort before the first token bills (engine.async_engine.prefill_report)
    num_prompt_tokens_reached: int = 0
    queue_reason: QueueReason | None = None
    num_preemptions: int = 0
    num_bypassed: int = 0  # times a later request with a longer cached prefix was admitted first
    admit_seq: int = 0  # order of (re)admission: the latest admitted is preempted first

    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # monotonic time of each output token

    output_text: str = ""
    sent_text_len: int = 0
    sent_token_count: int = 0
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # text tokens, when sampling.logprobs is set
    sent_logprob_count: int = 0
    # sampling.prompt_logprobs: prompt tokens 1, 2, ... scored so far, in order (token 0 has no
    # predecessor), and whether they went out (once, complete, with the first output)
    prompt_scores: list[TokenLogprob] = field(default_factory=list)
    sent_prompt_logprobs: bool = False
    detok: DetokenizerState | None = None
    finish_reason: FinishReason | None = None
    stop_sequence: str | None = None  # the stop string that ended the output (finish_reason "stop")
    error: str | None = None
    failure: OutputFailure | None = None  # with finish_reason "error": a cause the caller can act on
    # A guided request's grammar compile, held for the request's life: the compiler finds it by spec
    # while any request holds it, so the engine thread never rebuilds a grammar the compile cache
    # evicted between admission and the request's first step. Only held, never read back: typed as
    # any object, so this torch-free module needs nothing of engine.guided (torch, llguidance).
    grammar: object | None = None

    # the prompt as native int64 bytes when the caller has them (LLMEngine.prepare packs a prompt
    # while validating it): its block hashes are then taken from them instead of packing it again
    packed_prompt: InitVar[bytes | None] = None

    def __post_init__(self, packed_prompt: bytes | None) -> None:
        if not self.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        if packed_prompt is not None:
            if len(packed_prompt) != 8 * len(self.prompt_token_ids):
                raise ValueError(f"packed_prompt holds {len(packed_prompt)} bytes for "
                                 f"{len(self.prompt_token_ids)} prompt tokens (8 bytes each)")
            self.block_hashes = packed_block_hashes(self.namespace, packed_prompt, self.block_size)
        self.update_block_hashes()

    # ------------------------------------------------------------------ tokens

    @property
    def namespace(self) -> bytes:
        """The cache scope: seeds the block hash chain (what the request may share a cache with)."""
        return self.tenant.namespace

    @property
    def tenant_key(self) -> bytes:
        """Whose request this is: what quotas, fairness and preemption count by (never the namespace)."""
        return self.tenant.tenant_key

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prompt_scoring_left(self) -> bool:
        """The request scores its prompt (``sampling.prompt_logprobs``) and some token is not scored yet."""
        return self.sampling.prompt_logprobs is not None and len(self.prompt_scores) < self.num_prompt_tokens - 1

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether cached blocks may stand in for computing its prompt: not while prompt tokens are
        left to score, as a cached position has K/V but no logits (vLLM skips the lookup for such
        requests too). Its computed blocks are still indexed for later requests."""
        return not self.prompt_scoring_left

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_slice(self, start: int, n: int) -> tuple[int, ...]:
        """``all_token_ids[start : start + n]`` without building the whole list: a decode step of
        256 requests with 1,600-token prompts would otherwise copy 400,000 ids to send 256."""
        prompt, output = self.prompt_token_ids, self.output_token_ids
        p = len(prompt)
        if start >= p:
            return tuple(output[start - p : start - p + n])
        if start + n <= p:
            return tuple(prompt[start : start + n])
        return (*prompt[start:], *output[: start + n - p])

    def update_block_hashes(self) -> None:
        """Hash every block that became full since the last call (once per block)."""
        have, full = len(self.block_hashes), self.num_tokens // self.block_size
        if full > have:
            # only the new blocks' tokens, chained on the last hash (or the namespace)
            parent = self.block_hashes[-1] if have else self.namespace
            span = self.token_slice(have * self.block_size, (full - have) * self.block_size)
            self.block_hashes.extend(block_hashes(parent, span, self.block_size))

    def append_output_token(self, token_id: int, now: float) -> None:
        if self.has_placeholder:
            self.output_token_ids[-1] = token_id  # the token the device sampled for the placeholder
        else:
            self.output_token_ids.append(token_id)
        self.token_times.append(now)
        if self.first_token_time is None:
            self.first_token_time = now
        self.update_block_hashes()

    # ------------------------------------------------------------------ overlapped steps
    # With overlapped steps (engine/llm_engine.py) the next step is scheduled while the device still
    # computes this step's token: the request then holds a placeholder for it, its newest output
    # token, which the step's sampled token replaces (append_output_token) before anything reads
    # the outputs. The placeholder is never hashed (update_block_hashes runs only on real tokens).

    @property
    def has_placeholder(self) -> bool:
        return bool(self.output_token_ids) and self.output_token_ids[-1] == PLACEHOLDER_TOKEN

    def add_placeholder(self) -> None:
        if self.has_placeholder:
            raise RuntimeError(f"{self.request_id} already waits for a token")
        self.output_token_ids.append(PLACEHOLDER_TOKEN)

    def drop_placeholder(self) -> None:
        """Forget a token that will not be read (the request finished before its step was collected)."""
        if self.has_placeholder:
            self.output_token_ids.pop()

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks the table must hold for ``num_tokens`` tokens of context."""
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ timing

    @property
    def queue_time_s(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def ttft_deadline(self) -> float:
        """Arrival + the tenant's TTFT target (inf without a target): orders admission."""
        target = self.tenant.ttft_target_s
        return self.arrival_time + target if target is not None else float("inf")
