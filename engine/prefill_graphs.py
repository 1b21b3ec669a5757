"""One-sequence prefill steps replayed from CUDA graphs: a prefix hit's suffix, a chat turn, a short prompt.

Why: a prefill step of at most a few hundred new tokens is short on the device (an 8B-shaped model:
512 tokens over 7,680 cached: 17.1 ms of kernels) but ~340 kernel launches long on the host, and
launched eagerly from Python the host can be the slower of the two: the H200 suite measured the
512-token hit's runner at 18.5 ms on one device host and 23-27 ms on another, and a 64-token chat
turn over an 8K prefix reached its token in 20-31 ms eagerly against 8.6-10.3 ms replayed from a
graph (docs/gpu.md, session 9).
A replayed graph launches them all at once, so the step costs what the device needs.

What makes one capture valid for many steps (as for decode, engine/cuda_graphs.py):

* the step's ``T`` new tokens are padded to the smallest captured size ``>= T``; padded rows write
  their K/V nowhere (slot -1), sit outside the sequence's query range (``cu_seqlens_q = [0, T]``,
  so the attention kernel's tiles past ``T`` exit), and only row ``T - 1``'s logits are computed;
* every input lives in a static device buffer overwritten before each replay, the block table is
  as wide as the longest context (``max_blocks_per_seq``), and no kernel's grid depends on a value;
* the attention launch's split count (keys divided among programs when the query tiles alone
  leave most SMs idle) is fixed at capture, but the kernel divides each sequence's keys among the
  splits at run time, so any split count is correct for any context and only speed depends on it.
  Each size is captured once per split count the eager launcher would pick for some context up to
  the longest (``ops.prefill_splits``, told the cache's layout: a split launch the warp-specialised
  kernel takes splits over its own tiles), and a step replays the graph of its own context's choice.

Graphs of different sizes share one memory pool (captured largest first); each keeps its own
[1, V] logits output, which the next replay of that graph overwrites: sample it before the next
step (the runner's sampler queues its work right after the replay, as for decode graphs).

On a CPU device (tests) the same padded static-buffer path runs eagerly, so the padding logic is
checked without a GPU.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from engine.batch import SequenceChunk
from engine.cuda_graphs import PADDING_SLOT, padded_batch_size
from engine.graph_inputs import StaticInputs, capture_graph
from engine.models.attention import AttentionMetadata, LayerCache
from engine.models.kernel_ops import KernelOps
from engine.step_inputs import position_and_slot_arrays
from prefixgate_kernels.launch_layout import CacheLayout

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM


def prefill_graph_sizes(max_tokens: int) -> tuple[int, ...]:
    """Token counts to capture for steps of up to ``max_tokens`` new tokens: 64, then every
    multiple of 128 up to ``max_tokens`` (which ends the list). Below 64 rows a step's GEMMs stream
    the weights in the same time whatever its row count, and the attention kernel's small tile is 64
    rows; above, a step pads at most 127 rows onto at least 128."""
    if max_tokens < 2:
        raise ValueError(f"prefill graphs need max_tokens >= 2, got {max_tokens}")
    sizes = [s for s in (64,) if s < max_tokens]
    s = 128
    while s < max_tokens:
        sizes.append(s)
        s += 128
    sizes.append(max_tokens)
    return tuple(sizes)


@dataclass(frozen=True)
class PrefillGraphKey:
    """One captured graph: ``tokens`` rows, attention launched with ``splits`` KV splits."""

    tokens: int
    splits: int


@dataclass(frozen=True)
class ReplayRecord:
    """One replay, as a benchmark splits it: the CUDA events recorded right before and after the
    graph on the stream, and the host's seconds in ``fill`` and in the launch call itself."""

    start: torch.cuda.Event
    end: torch.cuda.Event
    fill_s: float
    launch_s: float

    def device_ms(self) -> float:
        """The device's run of the graph (waits for it)."""
        self.end.synchronize()
        return float(self.start.elapsed_time(self.end))


class PrefillGraphs:
    """Runs one sequence's prefill chunk of 2 to ``max(sizes)`` tokens through captured graphs.

    Not thread-safe (one caller, the runner). ``run`` returns a view into a graph-owned output that
    the next ``run`` of the same graph overwrites.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        layer_caches: list[LayerCache],
        ops: KernelOps,
        block_size: int,
        max_blocks_per_seq: int,
        q_heads: int,
        sizes: tuple[int, ...],
        device: torch.device,
        layout: CacheLayout | None = None,
    ) -> None:
        if not sizes or min(sizes) < 2:
            raise ValueError(f"prefill graph sizes must be >= 2 tokens, got {sizes}")
        self.model, self.layer_caches, self.ops = model, layer_caches, ops
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_context = max_blocks_per_seq * block_size
        self.q_heads = q_heads
        # the cache the attention reads: which kernel takes a split launch, and so its split count
        self.layout = layout
        self.sizes = tuple(sorted(set(sizes)))
        self.device = device
        self.captured = device.type == "cuda"
        n, w = self.sizes[-1], max_blocks_per_seq
        i64, i32 = torch.int64, torch.int32
        self._inputs = StaticInputs({
            "input_ids": ((n,), i64), "positions": ((n,), i64), "slot_mapping": ((n,), i64),
            "block_tables": ((1, w), i32), "cu_seqlens_q": ((2,), i32), "seq_lens": ((1,), i32),
            "last_row": ((1,), i64),
        }, device)
        self._dev = self._inputs.dev
        # every host write goes through these flat views (array -> memoryview: one memcpy each)
        self._w = {k: self._inputs.words(k) for k in self._inputs.host}
        self._pad_ids = memoryview(array("q", bytes(8 * n)))  # n zeros: padding rows' token and position
        self._pad_slots = memoryview(array("q", [PADDING_SLOT]) * n)
        self._graphs: dict[PrefillGraphKey, torch.cuda.CUDAGraph] = {}
        self._logits: dict[PrefillGraphKey, torch.Tensor] = {}
        # per size: split count -> the context hint that makes the launcher pick it (at capture)
        self._hints: dict[int, dict[int, int]] = {t: self._split_hints(t) for t in self.sizes}
        self.num_runs = 0  # steps served (tests and benchmarks check the graph path was taken)
        # when a list: every replay appends a ReplayRecord, so that a benchmark can split a step's
        # wall time into the device's run of the graph and the host work around it (read after the
        # run; no sync here)
        self.replay_log: list[ReplayRecord] | None = None

    # ------------------------------------------------------------------------------ policy
    def _splits_for(self, tokens: int, context: int) -> int:
        return self.ops.prefill_splits(tokens, 1, self.q_heads, max(1, context), self.device, self.layout)

    def _split_hints(self, tokens: int) -> dict[int, int]:
        """Every split count the launcher picks for ``tokens`` rows at some context up to the
        longest, with the shortest context (on a doubling ladder) that picks it."""
        hints: dict[int, int] = {}
        context = tokens
        while True:
            context = min(context, self.max_context)
            hints.setdefault(self._splits_for(tokens, context), context)
            if context >= self.max_context:
                return hints
            context *= 2

    def accepts(self, chunk: SequenceChunk) -> bool:
        """A chunk this runs: 2+ new tokens (one is a decode step), within the largest size and the
        block table's width."""
        return 2 <= chunk.num_tokens <= self.sizes[-1] and chunk.context_len <= self.max_context

    def key_for(self, chunk: SequenceChunk) -> PrefillGraphKey:
        """The graph a chunk replays: its padded size and the split count its context asks for
        (the nearest captured one should a context between the ladder's rungs pick another)."""
        size = padded_batch_size(chunk.num_tokens, self.sizes)  # the smallest size holding its rows
        if size is None:
            raise ValueError(f"{chunk.request_id}: {chunk.num_tokens} tokens exceed the largest prefill graph "
                             f"({self.sizes[-1]})")
        want = self._splits_for(size, chunk.context_len)
        have = self._hints[size]
        splits = want if want in have else min(have, key=lambda s: (abs(s.bit_length() - want.bit_length()), s))
        return PrefillGraphKey(size, splits)

    # ----------------------------------------------------------------------------- capture
    def _forward(self, key: PrefillGraphKey) -> torch.Tensor:
        d, t = self._dev, key.tokens
        meta = AttentionMetadata(
            slot_mapping=d["slot_mapping"][:t],
            block_tables=d["block_tables"],
            cu_seqlens_q=d["cu_seqlens_q"],
            seq_lens=d["seq_lens"],
            decode_only=False,
            # not this step's context: the hint that makes the launcher pick key.splits (module doc)
            context_lens=(self._hints[t][key.splits],),
        )
        hidden = self.model(d["input_ids"][:t], d["positions"][:t], self.layer_caches, meta, self.ops)  # [t, H]
        return self.model.compute_logits(hidden.index_select(0, d["last_row"]))  # [1, V] float32

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (size, split count), largest size first so the smaller ones fit in its
        memory pool. The static inputs hold padding while capturing (every slot -1, a context of
        the step's own rows over block 0): the warm-up runs write nothing into the cache."""
        if not self.captured:
            return
        pool: torch.cuda._POOL_HANDLE | None = None
        stream = torch.cuda.Stream(self.device)
        for t in reversed(self.sizes):
            self._write_padding(t)
            self._dev_copy(t)
            torch.cuda.synchronize(self.device)
            for splits in sorted(self._hints[t]):
                key = PrefillGraphKey(t, splits)
                graph, self._logits[key] = capture_graph(partial(self._forward, key), stream, self.device, pool)
                pool = graph.pool()
                self._graphs[key] = graph
        torch.cuda.synchronize(self.device)

    @property
    def num_graphs(self) -> int:
        return sum(len(h) for h in self._hints.values())

    # --------------------------------------------------------------------------------- run
    def _pad_rows(self, lo: int, hi: int) -> None:
        """Host rows ``lo .. hi-1`` become padding: token 0 at position 0, written nowhere."""
        w, k = self._w, hi - lo
        w["input_ids"][lo:hi] = self._pad_ids[:k]
        w["positions"][lo:hi] = self._pad_ids[:k]
        w["slot_mapping"][lo:hi] = self._pad_slots[:k]

    def _write_step(self, t: int, context_len: int) -> None:
        """The one-sequence step's scalars: ``t`` new rows, ``context_len`` tokens of context."""
        w = self._w
        w["cu_seqlens_q"][0], w["cu_seqlens_q"][1] = 0, t
        w["seq_lens"][0] = context_len
        w["last_row"][0] = t - 1

    def _write_padding(self, t: int) -> None:
        self._pad_rows(0, t)
        n_blocks = -(-t // self.block_size)
        self._w["block_tables"][:n_blocks] = array("i", bytes(4 * n_blocks))  # the capture's context: block 0
        self._write_step(t, t)

    def _dev_copy(self, t: int) -> None:
        # all buffers whole, in one copy: ~15 KB at 512 rows, less than one copy's fixed cost
        self._inputs.copy_all()

    def fill(self, chunk: SequenceChunk) -> PrefillGraphKey:
        """Write one sequence's chunk into the static inputs (its rows, then padding) -> its graph.

        Raises ValueError for a chunk ``accepts`` refuses or whose block table is short."""
        if not self.accepts(chunk):
            raise ValueError(f"{chunk.request_id}: a chunk of {chunk.num_tokens} tokens at context "
                             f"{chunk.context_len} does not fit the prefill graphs")
        bs = self.block_size
        n_blocks = -(-chunk.context_len // bs)
        if len(chunk.block_table) < n_blocks:
            raise ValueError(f"{chunk.request_id}: block_table has {len(chunk.block_table)} blocks, needs {n_blocks}")
        key = self.key_for(chunk)
        self._inputs.wait_copied()  # the last step's H2D copy must be done before the host rewrite
        t, w = chunk.num_tokens, self._w
        positions, slots = position_and_slot_arrays([chunk], bs)
        w["input_ids"][:t] = array("q", chunk.token_ids)
        w["positions"][:t] = positions
        w["slot_mapping"][:t] = slots
        self._pad_rows(t, key.tokens)
        w["block_tables"][:n_blocks] = array("i", chunk.block_table[:n_blocks])
        self._write_step(t, chunk.context_len)
        self._dev_copy(key.tokens)
        return key

    @torch.inference_mode()
    def run(self, chunk: SequenceChunk) -> torch.Tensor:
        """One prefill step for ``chunk`` (its K/V written) -> the last row's logits [1, V] float32."""
        t0 = time.perf_counter() if self.replay_log is not None else 0.0
        key = self.fill(chunk)
        self.num_runs += 1
        if self.captured:
            if self.replay_log is None:
                self._graphs[key].replay()
            else:
                t1 = time.perf_counter()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                self._graphs[key].replay()
                end.record()
                self.replay_log.append(ReplayRecord(start, end, t1 - t0, time.perf_counter() - t1))
            return self._logits[key]
        return self._forward(key)

