"""Decode steps replayed from CUDA graphs: one graph per captured batch size, static input buffers.

A decode step of a Llama-8B-shaped model is ~32 layers x ~15 kernel launches; launched eagerly from
Python the host needs longer than the GPU for small batches. A captured graph replays all of them
with one launch. What makes that legal here:

* every input lives in a static device buffer that is overwritten in place before each replay;
* the Triton kernels launch with a grid that depends on tensor *shapes* only (the decode split count
  comes from the block table's width, not the live lengths; see docs/kernels.md), so one capture is
  valid for any context length up to ``max_blocks_per_seq * block_size``;
* a batch of ``n`` sequences runs the graph of the smallest captured size ``>= n``; the padded rows
  write their K/V nowhere (slot -1) and attend over one token of block 0, so they cannot disturb a
  real sequence, and their logits are dropped.

Static buffers (``N`` = the largest captured size, ``W`` = max blocks per sequence)::

    tokens       [2N] int64       [0, N): the previous step's sampled tokens, copied on the device
                                  (overlapped steps); [N, 2N): the host's input tokens, row i at N + i
    token_src    [N] int64        row i's input token is tokens[token_src[i]]: N + i, or a fed row < N
    positions    [N] int64        slot_mapping [N] int64 (-1 = padding)     seq_lens [N] int32
    block_tables [N, W] int32     cu_seqlens_q [N + 1] int32 (= arange)
    logits       [n, V] float32 per captured size (graph outputs share one memory pool)

Overlapped steps (engine/llm_engine.py) schedule step n+1 before step n's tokens reach the host:
those rows' inputs are picked on the device inside the graph (one gather over ``token_src``), so the
host never waits for a token to launch the next step.

Inputs are staged in pinned host memory and copied with ``non_blocking=True``; the only host
synchronisation of a step is the caller reading the sampled tokens. On a CPU device (tests) the same
padded static-buffer path runs eagerly, so the padding logic is checked without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from engine.batch import SequenceChunk
from engine.graph_inputs import StaticInputs, capture_graph
from engine.host_to_device import to_device
from engine.models.attention import AttentionMetadata, LayerCache
from engine.models.kernel_ops import FusedOps

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM

PADDING_SLOT = -1  # write_kv skips slot -1: padded rows never touch the cache
# A step's static inputs go to the device in one copy (True) or one per buffer (False: six DMAs on the
# stream between two replays; the engine benchmark's same-run baseline, section decode_input_copy).
SINGLE_INPUT_COPY = True


@dataclass(frozen=True)
class TokenFeed:
    """Inputs that come from the previous step's sampled tokens, still on the device.

    Row ``dst_rows[k]`` of this step takes ``tokens[src_rows[k]]`` as its input token."""

    tokens: torch.Tensor  # [S] int64, the previous step's picks (device)
    dst_rows: Sequence[int]
    src_rows: Sequence[int]


def graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 8 up to 64, then of 32, ending at
    ``max_num_seqs`` itself. Padding waste stays under ~25% above 8 while the capture count (time
    and graph memory) stays small."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    s = 8
    while s < max_num_seqs:
        sizes.append(s)
        s += 8 if s < 64 else 32
    sizes.append(max_num_seqs)
    return tuple(sizes)


def padded_batch_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds ``num_seqs`` sequences, or None (run eagerly)."""
    if num_seqs < 1:
        raise ValueError(f"num_seqs must be >= 1, got {num_seqs}")
    fitting = [s for s in sizes if s >= num_seqs]
    return min(fitting) if fitting else None


class DecodeGraphs:
    """Runs decode-only batches of up to ``max(sizes)`` sequences through captured graphs.

    Not thread-safe (one caller, the runner). ``run`` returns a view into a graph-owned output that
    the next ``run`` overwrites: consume it (sample) before calling again.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        layer_caches: list[LayerCache],
        ops: FusedOps,
        block_size: int,
        max_blocks_per_seq: int,
        sizes: Sequence[int],
        device: torch.device,
    ) -> None:
        self.model, self.layer_caches, self.ops = model, layer_caches, ops
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.sizes = tuple(sorted(set(sizes)))
        self.device = device
        self.captured = device.type == "cuda"
        n, w = self.sizes[-1], max_blocks_per_seq
        i64, i32 = torch.int64, torch.int32
        # the block tables last: a step copies the small buffers whole and the table's first rows, in
        # one copy (StaticInputs.copy_through)
        self._inputs = StaticInputs({
            "tokens": ((2 * n,), i64), "token_src": ((n,), i64), "positions": ((n,), i64),
            "slot_mapping": ((n,), i64), "seq_lens": ((n,), i32), "block_tables": ((n, w), i32),
        }, device)
        self._host, self._dev = self._inputs.host, self._inputs.dev
        self._cu = torch.arange(n + 1, dtype=torch.int32, device=device)  # one new token per sequence
        self._fed_tokens = self._dev["tokens"][:n]  # written on the device, after each step's input copy
        self._own_rows = torch.arange(n, 2 * n, dtype=torch.int64)  # token_src of rows that read the host's token
        # the decode kernel's split-merge counters (prefixgate_kernels/decode_attention.py): one zeroed buffer that
        # every graph's launches share (replays are serial on one stream; the kernel leaves it zero)
        kv_heads = layer_caches[0].k.shape[2] if layer_caches else 1
        self._merge_counters = torch.zeros(n * kv_heads, dtype=torch.int32, device=device)
        # What each host block-table row holds: (request id, blocks written, its last block id), or None.
        # A decode step usually changes no row (a sequence gains a block every block_size steps), so
        # fill rewrites only rows whose owner or length changed: converting the whole [B, blocks] table
        # from Python lists cost more host time than anything else in the fill (~25 us per sequence).
        self._row_owner: list[tuple[str, int, int] | None] = [None] * n
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self.num_runs = 0  # decode steps served (tests and benchmarks check the graph path was taken)
        # device-side bracket of the last replay: how long the GPU itself ran the step (benchmarks)
        self._replay_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        # when a list: every replay appends its own (start, end) event pair (a pipelined benchmark
        # reads them after the run; last_replay_ms would only see the newest)
        self.replay_log: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None
        self._reset_padding(n)

    # ----------------------------------------------------------------------------- capture
    def _forward(self, n: int) -> torch.Tensor:
        d = self._dev
        meta = AttentionMetadata(
            slot_mapping=d["slot_mapping"][:n],
            block_tables=d["block_tables"][:n],
            cu_seqlens_q=self._cu[: n + 1],
            seq_lens=d["seq_lens"][:n],
            decode_only=True,
            merge_counters=self._merge_counters,
        )
        ids = d["tokens"].gather(0, d["token_src"][:n])  # the host's token or a fed one, per row
        hidden = self.model(ids, d["positions"][:n], self.layer_caches, meta, self.ops)  # [n, H]
        return self.model.compute_logits(hidden)  # [n, V] float32

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size, largest first so the smaller ones fit in its memory pool.

        The static inputs hold padding (slot -1, seq_len 1, block 0) while capturing: the warm-up
        runs write nothing into the cache."""
        if not self.captured:
            return
        self._reset_padding(self.sizes[-1])
        self._dev_copy(self.sizes[-1])
        torch.cuda.synchronize(self.device)
        pool: torch.cuda._POOL_HANDLE | None = None
        stream = torch.cuda.Stream(self.device)
        for n in reversed(self.sizes):
            graph, self._logits[n] = capture_graph(partial(self._forward, n), stream, self.device, pool)
            pool = graph.pool()
            self._graphs[n] = graph
        torch.cuda.synchronize(self.device)

    # --------------------------------------------------------------------------------- run
    def _reset_padding_rows(self, lo: int, hi: int) -> None:
        h, n = self._host, self.sizes[-1]
        h["tokens"][n + lo:n + hi] = 0
        h["token_src"][lo:hi] = self._own_rows[lo:hi]
        h["positions"][lo:hi] = 0
        h["slot_mapping"][lo:hi] = PADDING_SLOT
        h["block_tables"][lo:hi, 0] = 0
        h["seq_lens"][lo:hi] = 1
        self._row_owner[lo:hi] = [None] * (hi - lo)

    def _reset_padding(self, n: int) -> None:
        # Only column 0 is read for a padded row (seq_len 1). Entries past a sequence's last block
        # are never read (kernels mask by seq_len), so stale ids there are harmless: the table is
        # not cleared per step (clearing and rebuilding [N, W] cost ~1 ms of host time per step).
        self._reset_padding_rows(0, n)

    def _dev_copy(self, n: int) -> None:
        if SINGLE_INPUT_COPY:
            self._inputs.copy_through("block_tables", n)
        else:  # the tokens whole (the host's half starts at N); the others' first n rows
            self._inputs.copy({k: n for k in self._host if k != "tokens"})

    def fill(self, chunks: Sequence[SequenceChunk], feed: TokenFeed | None = None) -> int:
        """Write a decode batch into the static inputs; -> the padded size it runs at. ``feed``: rows
        whose input token is the previous step's sampled token on the device (their token_ids hold
        a placeholder).

        Raises ValueError when the batch is not decode-only, too large, or too long for the tables."""
        b = len(chunks)
        size = padded_batch_size(b, self.sizes)
        if size is None:
            raise ValueError(f"batch of {b} exceeds the largest captured size {self.sizes[-1]}")
        self._inputs.wait_copied()  # the last step's H2D copy must be done before the host rewrite
        bs, h, w = self.block_size, self._host, self.max_blocks_per_seq
        # Padded rows only (rows past the batch); rows below b are rewritten below or kept.
        if size > b:
            self._reset_padding_rows(b, size)
        # Build Python lists and write each buffer once: one tensor op per buffer instead of ~5 per
        # row (each costs microseconds of host time, and the GPU waits for the host here).
        ids, pos, slots, lens = [], [], [], []
        table = h["block_tables"]
        owner = self._row_owner
        for i, c in enumerate(chunks):
            if c.num_tokens != 1:
                raise ValueError(f"{c.request_id}: a decode chunk has one token, got {c.num_tokens}")
            p = c.start_pos
            n_blocks = p // bs + 1
            if n_blocks > w or len(c.block_table) < n_blocks:
                raise ValueError(f"{c.request_id}: position {p} does not fit the captured block tables")
            ids.append(int(c.token_ids[0]))
            pos.append(p)
            slots.append(c.block_table[p // bs] * bs + p % bs)
            lens.append(p + 1)
            self._write_row(table, owner, i, c.request_id, c.block_table, n_blocks)
        n = self.sizes[-1]
        h["tokens"][n:n + b] = torch.tensor(ids, dtype=torch.int64)
        h["positions"][:b] = torch.tensor(pos, dtype=torch.int64)
        h["slot_mapping"][:b] = torch.tensor(slots, dtype=torch.int64)
        h["seq_lens"][:b] = torch.tensor(lens, dtype=torch.int32)
        src = list(range(n, n + b))
        fed: torch.Tensor | None = None
        if feed is not None:
            fed = feed.tokens
            picks = feed.src_rows
            if fed.shape[0] > n:  # a larger eager step before: keep the fed rows only
                fed = fed[to_device(picks, torch.long, fed.device)]
                picks = list(range(len(picks)))
            for dst, s in zip(feed.dst_rows, picks):
                src[dst] = s
        h["token_src"][:b] = torch.tensor(src, dtype=torch.int64)
        self._dev_copy(size)
        if fed is not None:  # device to device, after the input copy (which rewrites the whole tokens buffer)
            self._fed_tokens[: fed.shape[0]].copy_(fed)
        return size

    @staticmethod
    def _write_row(table: torch.Tensor, owner: list, i: int, request_id: str, blocks: Sequence[int],
                   n_blocks: int) -> None:
        """Bring host row ``i`` to ``blocks[:n_blocks]``, writing only what changed.

        Relies on a running sequence's blocks before its last one never changing (full blocks are
        immutable; copy-on-write only replaces the block being written): a row of the same sequence
        that has grown gets its new columns; a row whose last block changed, or that another
        sequence held, is rewritten whole."""
        last = blocks[n_blocks - 1]
        held = owner[i]
        if held is not None and held[0] == request_id:
            _, have, held_last = held
            if have == n_blocks and held_last == last:
                return
            if have < n_blocks and blocks[have - 1] == held_last:
                table[i, have:n_blocks] = torch.tensor(list(blocks[have:n_blocks]), dtype=torch.int32)
                owner[i] = (request_id, n_blocks, last)
                return
        table[i, :n_blocks] = torch.tensor(list(blocks[:n_blocks]), dtype=torch.int32)
        owner[i] = (request_id, n_blocks, last)

    @torch.inference_mode()
    def run(self, chunks: Sequence[SequenceChunk], feed: TokenFeed | None = None) -> torch.Tensor:
        """One decode step for ``chunks`` (K/V written) -> logits [len(chunks), V] float32."""
        size = self.fill(chunks, feed)
        self.num_runs += 1
        if self.captured:
            if self.replay_log is not None:
                self._replay_events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                self.replay_log.append(self._replay_events)
            elif self._replay_events is None:
                self._replay_events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            start, end = self._replay_events
            start.record()
            self._graphs[size].replay()
            end.record()
            logits = self._logits[size]
        else:
            logits = self._forward(size)
        return logits[: len(chunks)]

    def last_replay_ms(self) -> float | None:
        """GPU time of the last graph replay (waits for it), or None before any (or on CPU).

        Step wall time minus this is the time the GPU sat idle waiting for the host (fill, sampling)."""
        if self._replay_events is None:
            return None
        start, end = self._replay_events
        end.synchronize()
        return float(start.elapsed_time(end))
