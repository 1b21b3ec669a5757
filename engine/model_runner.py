"""ModelRunner: turns a ``ScheduledBatch`` into sampled tokens on one device.

It owns the weights, the tokenizer, the paged KV cache and the sampler, and holds no scheduling
state: which blocks a sequence owns is decided by the scheduler / block pool (engine/batch.py).

KV cache (block-major, one block = one contiguous run of bytes)::

    kv_cache  : [num_blocks, num_layers, 2 (k|v), block_size, num_kv_heads, head_dim]
    kv_scales : [num_blocks, num_layers, 2, block_size, num_kv_heads] float32   (int8 only)

``kv_cache`` is a view of the pool ``kv_pages``, whose blocks are laid out in ``kv_layout``
(engine/kv_layout.py: each page token by token, or head by head on a GPU). An exported block is its
``kv_cache[b]`` values in token order (``kv_cache[b].contiguous()``'s bytes, whatever the pool's
layout) followed by ``kv_scales[b]``'s bytes (int8).
fp8 uses one scale per (layer, k|v) and stores keys minus a per-(layer, head, channel) bias, both
calibrated once at load from a fixed text (engine/kv_calibration.py, the same on every node), so
its blocks carry no scale bytes.

On CUDA (docs/gpu.md): the Triton kernels, decode-only steps replayed from CUDA graphs
(``engine.cuda_graphs``, when ``config.use_cuda_graphs``), one-sequence prefill steps of up to
``config.prefill_graph_tokens`` tokens likewise (``engine.prefill_graphs``), and block exports/imports on a side
stream so that tier transfers overlap the compute stream. CPU behaviour is unchanged.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.batch import BlockCopy, ScheduledBatch, SequenceChunk, StepResult
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs, TokenFeed, graph_batch_sizes
from engine.gpu_memory import kv_blocks_for_budget, kv_budget_from_free
from engine.guided import GrammarCompile, GrammarCompiler
from engine.host_to_device import host_tensor, tensor_to_device, to_device
from engine.kernel_warmup import (
    COPIED_BLOCK,
    MOVED_BLOCKS,
    WarmupStep,
    candidates,
    distinct_steps,
    feature_batch,
    row_class,
    warmup_batch,
)
from engine.kv_layout import KVPageLayout
from engine.models.attention import AttentionMetadata, LayerCache, select_ops
from engine.models.chat_render import render_chat_ids
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import build_model
from engine.models.spec import ArchConfig, ModelSpec, parse_checkpoint_config, read_special_ids
from engine.prefill_graphs import PrefillGraphs, prefill_graph_sizes
from engine.prompt_bounds import longest_token_chars
from engine.prompt_scoring import PendingScores, score_prompt_rows
from engine.protocol import GuidedSpec, SamplingParams
from engine.sampling import PendingRows, Sampler
from engine.step_inputs import positions_and_slots
from engine.tokenizer_pool import TokenizerPool
from prefixgate_kernels.launch_layout import CacheLayout

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPES = {**_DTYPES, "fp8": torch.float8_e4m3fn, "int8": torch.int8}
# Device memory kept free for activations and logits when sizing the CUDA cache.
_CUDA_HEADROOM_BYTES = 2 * 1024**3


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto/float32/bfloat16/float16, got {dtype!r}")
    return _DTYPES[dtype]


@dataclass(frozen=True)
class LaunchedStep:
    """A step queued on the device (``ModelRunner.launch``): its chunks, its picks on their way to
    the host, and which pick row each sampled chunk has (chunk index -> row)."""

    chunks: Sequence[SequenceChunk]
    pending: PendingRows | None
    sampled_row: Mapping[int, int]
    prompt_scores: Mapping[int, PendingScores] = field(default_factory=dict)  # chunk index -> its scores


def _last_rows(batch: ScheduledBatch) -> list[int]:
    """Each sampled chunk's last row in the packed batch, from host-side token counts: indexing
    meta.cu_seqlens_q (a device tensor) would cost one host sync per sampled chunk."""
    last, end = [], 0
    for c in batch.chunks:
        end += c.num_tokens
        if c.sample:
            last.append(end - 1)
    return last


def _row_view(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """uint8 rows [n, bytes of one of ``like``'s blocks] (each row contiguous) as [n, *like.shape[1:]] of
    ``like``'s dtype, in token order: a view, so a gather writes the rows' bytes."""
    return rows.view(like.dtype).view(rows.shape[0], *like.shape[1:])


class StepRoute(enum.Enum):
    """How ``ModelRunner.forward`` runs a batch."""

    DECODE_GRAPH = "decode_graph"  # a captured decode step (engine/cuda_graphs.py)
    PREFILL_GRAPH = "prefill_graph"  # a captured one-sequence prefill step (engine/prefill_graphs.py)
    EAGER = "eager"


class ModelRunner:
    """See the contract in engine/batch.py and the module docstring. Not thread-safe: one caller."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        arch: ArchConfig | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        model: LlamaForCausalLM | None = None,
    ) -> None:
        """Load ``config.model_dir`` (config.json, tokenizer, safetensors) onto ``config.device``.

        ``arch``, ``tokenizer`` and ``model`` replace what would be read from the checkpoint: a
        benchmark passes an in-memory random-weight model (engine.models.random_init), or shares
        one loaded model between runners with different KV dtypes. ``model`` must be on the
        device in the compute dtype, built for ``arch``."""
        self.config = config
        self.device = config.device
        self.block_size = config.block_size
        torch_device = torch.device(config.device)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)  # process-wide: the engine owns the CPU it runs on
        self.dtype = resolve_dtype(config.dtype, torch_device.type)
        self.kv_dtype = self.dtype if config.kv_dtype == "auto" else _KV_DTYPES[config.kv_dtype]

        if arch is None:
            arch = parse_checkpoint_config(config.model_dir, config.max_model_len)
        self.arch = arch
        self.tokenizer: PreTrainedTokenizerBase = (
            tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(config.model_dir)
        )
        # Tokenizing threads each borrow a copy (engine.tokenizer_pool), never one shared object.
        self.tokenizers = TokenizerPool(self.tokenizer)
        self.max_token_chars = longest_token_chars(self.tokenizer.get_vocab())  # engine.prompt_bounds
        eos, bos = read_special_ids(config.model_dir)
        if not eos and self.tokenizer.eos_token_id is not None:
            eos = (self.tokenizer.eos_token_id,)
        self.spec = ModelSpec(
            model_type=arch.model_type,
            num_layers=arch.num_layers,
            hidden_size=arch.hidden_size,
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            vocab_size=arch.vocab_size,
            max_model_len=arch.max_model_len,
            eos_token_ids=eos,
            bos_token_id=bos,
            dtype=str(self.dtype).removeprefix("torch."),
        )
        if model is not None:
            if model.arch != arch:
                raise ValueError("the given model was built for a different ArchConfig")
            self.model = model
        else:
            self.model = build_model(arch, config.model_dir, torch_device, self.dtype)
        self.ops = select_ops(torch_device)
        self.grammars = GrammarCompiler(self.tokenizer, arch.vocab_size, eos[0] if eos else None)
        self.sampler = Sampler(torch_device, grammars=self.grammars, eos_token_ids=eos)

        layer_shape = (arch.num_layers, 2, self.block_size, arch.num_kv_heads, arch.head_dim)
        self.kv_layout = (KVPageLayout.for_device(torch_device) if config.kv_page_layout == "auto"
                          else KVPageLayout(config.kv_page_layout))
        elems = arch.num_layers * 2 * self.block_size * arch.num_kv_heads * arch.head_dim
        self._cache_block_bytes = elems * self.kv_dtype.itemsize
        self._scale_block_bytes = elems // arch.head_dim * 4 if self.kv_dtype == torch.int8 else 0
        self.kv_bytes_per_block = self._cache_block_bytes + self._scale_block_bytes
        self.num_kv_blocks = self._count_blocks(torch_device)

        page_shape = self.kv_layout.block_shape(arch.num_layers, self.block_size, arch.num_kv_heads, arch.head_dim)
        # the pool in memory (block moves copy its raw rows) and its token-ordered view (what layers index)
        self.kv_pages = torch.zeros((self.num_kv_blocks, *page_shape), dtype=self.kv_dtype, device=torch_device)
        self.kv_cache = self.kv_layout.token_view(self.kv_pages)
        self.kv_scales = None
        if self.kv_dtype == torch.int8:
            self.kv_scales = torch.ones((self.num_kv_blocks, *layer_shape[:-1]), dtype=torch.float32, device=torch_device)
        # fp8: one scale per (layer, k|v), calibrated below (engine/kv_calibration.py); layers hold views.
        self.fp8_scales: torch.Tensor | None = None
        self.fp8_key_bias: torch.Tensor | None = None
        if self.kv_dtype == torch.float8_e4m3fn:
            self.fp8_scales = torch.ones((arch.num_layers, 2, 1), dtype=torch.float32, device=torch_device)
            # in the compute dtype: subtracting it costs no cast per step (any μ shared by all keys is exact)
            self.fp8_key_bias = torch.zeros((arch.num_layers, arch.num_kv_heads, arch.head_dim),
                                            dtype=self.dtype, device=torch_device)
        self.layer_caches = [self._layer_cache(layer) for layer in range(arch.num_layers)]
        # Calibration runs the plain path (its recording ops stand in for the KV ops), so it comes
        # before fusing. Both paths store centred keys: the fused RoPE+KV-write kernel subtracts the
        # same bias (prefixgate_kernels/rotary.py), so CPU and GPU nodes write interchangeable fp8 blocks.
        fused = torch_device.type == "cuda"
        if self.fp8_scales is not None:
            self.set_fp8_calibration(*self.calibrate_fp8())
        if fused:
            # merged q|k|v and gate|up GEMMs and the fused norm / RoPE+KV-write / SiLU kernels
            # (engine/models/llama.py); before any graph capture, which records the path.
            self.model.fuse_projections()

        self._transfer_stream = torch.cuda.Stream(torch_device) if torch_device.type == "cuda" else None
        self._eager_merge_counters: torch.Tensor | None = None
        self.decode_graphs: DecodeGraphs | None = None
        if torch_device.type == "cuda" and config.use_cuda_graphs:
            self.decode_graphs = DecodeGraphs(
                self.model, self.layer_caches, self.ops, self.block_size,
                max_blocks_per_seq=-(-arch.max_model_len // self.block_size),
                sizes=graph_batch_sizes(config.max_num_seqs), device=torch_device,
            )
            self.decode_graphs.capture()
        self.prefill_graphs: PrefillGraphs | None = None
        graph_tokens = min(config.prefill_graph_tokens, config.max_num_batched_tokens, arch.max_model_len)
        if torch_device.type == "cuda" and config.use_cuda_graphs and graph_tokens >= 2:
            self.prefill_graphs = PrefillGraphs(
                self.model, self.layer_caches, self.ops, self.block_size,
                max_blocks_per_seq=-(-arch.max_model_len // self.block_size), q_heads=arch.num_heads,
                sizes=prefill_graph_sizes(graph_tokens), device=torch_device,
                layout=CacheLayout.of(self.dtype, self.layer_caches[0].k),
            )
            self.prefill_graphs.capture()
        # after the captures: what the graphs launch is compiled by now; the eager path's launches next
        self.kernel_warmup_steps = 0
        self.kernel_warmup_seconds = 0.0  # start-up time the warm-up took (steps and feature kernels)
        if torch_device.type == "cuda" and config.warm_up_kernels:
            began = time.perf_counter()
            self.kernel_warmup_steps = self._warm_up_eager_kernels()
            self._warm_up_feature_kernels()
            torch.cuda.synchronize(torch_device)
            self.kernel_warmup_seconds = time.perf_counter() - began

    # ----------------------------------------------------------------------------------- setup
    def _count_blocks(self, device: torch.device) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            budget = kv_budget_from_free(free, self.config.kv_memory_fraction, _CUDA_HEADROOM_BYTES)
        else:
            budget = self.config.cpu_kv_bytes
        return kv_blocks_for_budget(budget, self.kv_bytes_per_block)

    def _layer_cache(self, layer: int) -> LayerCache:
        k, v = self.kv_cache[:, layer, 0], self.kv_cache[:, layer, 1]  # [NB, BS, Hkv, D] strided views
        if self.kv_scales is not None:
            return LayerCache(k, v, self.kv_scales[:, layer, 0], self.kv_scales[:, layer, 1])
        if self.fp8_scales is not None and self.fp8_key_bias is not None:  # [1] views, bias [Hkv, D]
            return LayerCache(k, v, self.fp8_scales[layer, 0], self.fp8_scales[layer, 1], self.fp8_key_bias[layer])
        return LayerCache(k, v)

    # ------------------------------------------------------------------------ fp8 KV scales
    def calibrate_fp8(self, centre_keys: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """fp8 K/V scales [L, 2, 1] and key bias [L, Hkv, D] from one unquantized forward over the
        fixed calibration text (engine/kv_calibration.py). Reads and writes no KV block."""
        from engine.kv_calibration import CALIBRATION_TEXT, AmaxRecorder, calibrate_fp8

        limit = min(self.spec.max_model_len, self.num_kv_blocks * self.block_size)
        ids = list(self.tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False))[:limit]
        chunk = SequenceChunk(request_id="kv-calibration", token_ids=ids, start_pos=0,
                              block_table=list(range(-(-len(ids) // self.block_size))), sample=False,
                              sampling=SamplingParams())

        @torch.inference_mode()
        def run(recorder: AmaxRecorder) -> None:
            input_ids, positions, meta = self._prepare([chunk])
            self.model.forward_plain(input_ids, positions, self.layer_caches, meta, recorder)

        return calibrate_fp8(run, self.arch.num_layers, centre_keys=centre_keys)

    def set_fp8_calibration(self, scales: torch.Tensor, key_bias: torch.Tensor | None = None) -> None:
        """Replace the fp8 scales [L, 2, 1] (and key bias [L, Hkv, D]; None = zero) in place: layer
        caches and captured graphs see them. Blocks written before become wrong: call before serving."""
        if self.fp8_scales is None or self.fp8_key_bias is None:
            raise ValueError("the KV cache is not fp8")
        self.fp8_scales.copy_(scales.to(self.fp8_scales.device).reshape(self.fp8_scales.shape))
        if key_bias is None:
            self.fp8_key_bias.zero_()
        else:
            self.fp8_key_bias.copy_(key_bias.to(self.fp8_key_bias.device).reshape(self.fp8_key_bias.shape))

    # --------------------------------------------------------------------------------- forward
    def _prepare(self, chunks: Sequence[SequenceChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        ids: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        max_blocks = 1
        for c in chunks:
            if c.num_tokens == 0:
                raise ValueError(f"chunk of {c.request_id} has no tokens")
            end = c.context_len
            if end > self.spec.max_model_len:
                raise ValueError(f"{c.request_id}: context {end} exceeds max_model_len {self.spec.max_model_len}")
            needed = (end + bs - 1) // bs
            if len(c.block_table) < needed:
                raise ValueError(f"{c.request_id}: block_table has {len(c.block_table)} blocks, needs {needed}")
            ids.extend(c.token_ids)
            cu.append(cu[-1] + c.num_tokens)
            seq_lens.append(end)
            max_blocks = max(max_blocks, needed)
        # one tensor from padded rows, not one small tensor and slice write per row (as in
        # DecodeGraphs.fill: each tensor op costs microseconds of host time per sequence)
        flat: list[int] = []
        for c in chunks:
            n = (c.context_len + bs - 1) // bs
            flat.extend(c.block_table[:n])
            flat.extend([0] * (max_blocks - n))
        tables = host_tensor(flat, torch.int32).reshape(len(chunks), max_blocks)  # [B, max_blocks]
        positions, slots = positions_and_slots(chunks, bs)
        dev = self.kv_cache.device
        decode_only = all(c.num_tokens == 1 for c in chunks)
        meta = AttentionMetadata(
            slot_mapping=tensor_to_device(slots, dev),
            block_tables=tensor_to_device(tables, dev),
            cu_seqlens_q=to_device(cu, torch.int32, dev),
            seq_lens=to_device(seq_lens, torch.int32, dev),
            decode_only=decode_only,
            context_lens=tuple(seq_lens),
            merge_counters=self._merge_counters(len(chunks)) if decode_only and dev.type == "cuda" else None,
        )
        input_ids = to_device(ids, torch.int64, dev)
        return input_ids, tensor_to_device(positions, dev), meta

    def _merge_counters(self, num_seqs: int) -> torch.Tensor:
        """The eager decode steps' split-merge counters (prefixgate_kernels/decode_attention.py): one zeroed
        buffer for every launch on the compute stream (the kernel leaves it zero), grown when a batch
        has more sequences than any before; the decode graphs keep their own."""
        need = num_seqs * self.arch.num_kv_heads
        if self._eager_merge_counters is None or self._eager_merge_counters.numel() < need:
            self._eager_merge_counters = torch.zeros(need, dtype=torch.int32, device=self.kv_cache.device)
        return self._eager_merge_counters

    # Not under inference mode: the steps run as the engine runs them (``forward`` is in inference mode
    # itself), so state the sampler creates here (the penalties' table) stays writable by later steps.
    def _warm_up_eager_kernels(self) -> int:
        """engine/kernel_warmup.py: one eager step of each distinct prefill launch (kernel, tiles, split or
        not, as ``plan_prefill`` picks them) and row class the eager path may make, sampled greedily;
        -> steps run. The split count itself keys no compile but the merge's, which
        ``_warm_up_feature_kernels`` compiles for every count."""
        from prefixgate_kernels.prefill_attention import choose_prefill_tiles, plan_prefill

        layout = CacheLayout.of(self.dtype, self.layer_caches[0].k)
        q_heads, device = self.arch.num_heads, self.kv_cache.device
        max_context = min(self.arch.max_model_len, self.num_kv_blocks * self.block_size)

        def eager(step: WarmupStep) -> bool:
            return self._graph_for(warmup_batch(step, self.block_size, "probe"), False, None) is StepRoute.EAGER

        def launch_key(step: WarmupStep) -> tuple[object, ...]:
            plan = plan_prefill(step.num_tokens, step.num_seqs, q_heads, step.context, device, layout)
            return (plan.kernel, choose_prefill_tiles(step.num_tokens, True).block_m, plan.splits > 1,
                    row_class(step.num_tokens))

        steps = distinct_steps(candidates(self.config.max_num_batched_tokens, self.config.max_num_seqs, max_context),
                               eager, launch_key)
        for i, step in enumerate(steps):
            batch = warmup_batch(step, self.block_size, f"kernel-warm-up-{i}")
            self.execute(batch)
            for chunk in batch.chunks:
                self.release(chunk.request_id)
        return len(steps)

    def _warm_up_feature_kernels(self) -> None:
        """engine/kernel_warmup.py: the kernels a request's features launch past the forward, once each:
        a penalised step (the penalties' launch and the pick's count; the sampler's other paths and a
        scored prompt beside them: ``feature_batch``), a copy-on-write, a KV
        export and import of blocks that are not consecutive (the gather and scatter kernels); and the
        prefill's split merge at every split count (``compile_merges``: the eager steps' grid reaches
        some counts only)."""
        from prefixgate_kernels.prefill_attention import compile_merges

        if self.kv_cache.device.type == "cuda":
            compile_merges(self.arch.num_heads, self.arch.head_dim, self.dtype, self.kv_cache.device)
        batch = feature_batch("kernel-warm-up-features")
        self.execute(batch)
        for chunk in batch.chunks:
            self.release(chunk.request_id)
        if self.num_kv_blocks <= max(*MOVED_BLOCKS, *COPIED_BLOCK):
            return  # a pool this small (tests) has no room for the moves
        self.copy_blocks([BlockCopy(*COPIED_BLOCK)])
        self.import_blocks(MOVED_BLOCKS, self.export_blocks_device(MOVED_BLOCKS))

    def _graph_for(self, batch: ScheduledBatch, all_logits: bool, feed: TokenFeed | None) -> StepRoute:
        """Which captured graph runs ``batch``, if any."""
        graphs = self.decode_graphs
        if graphs is not None and not all_logits and batch.is_decode_only and len(batch.chunks) <= graphs.sizes[-1]:
            return StepRoute.DECODE_GRAPH
        prefill = self.prefill_graphs
        if prefill is not None and not all_logits and feed is None and len(batch.chunks) == 1 \
                and prefill.accepts(batch.chunks[0]):
            return StepRoute.PREFILL_GRAPH
        return StepRoute.EAGER

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, all_logits: bool = False, feed: TokenFeed | None = None) -> torch.Tensor:
        """Run one packed forward (writing K/V) and return logits float32:
        [num sampled chunks, V] (last position of each chunk with sample=True), or [T, V] with all_logits.

        A decode-only batch on CUDA, or one sequence's prefill chunk of up to
        ``config.prefill_graph_tokens`` tokens, returns a view of a CUDA graph's output, valid until
        the next forward: copy it to keep it. ``all_logits=True`` always runs eagerly. ``feed``: one-token
        chunks whose token is a previous step's pick still on the device (engine.cuda_graphs.TokenFeed)."""
        self.copy_blocks(batch.block_copies)
        route = self._graph_for(batch, all_logits, feed)
        if route is StepRoute.DECODE_GRAPH and self.decode_graphs is not None:
            logits = self.decode_graphs.run(batch.chunks, feed)  # [B, V], a view of the graph's output
            rows = [i for i, c in enumerate(batch.chunks) if c.sample]
            return logits if len(rows) == len(batch.chunks) else logits[to_device(rows, torch.long, logits.device)]
        if route is StepRoute.PREFILL_GRAPH and self.prefill_graphs is not None:
            logits = self.prefill_graphs.run(batch.chunks[0])  # [1, V], a view of the graph's output
            return logits if batch.chunks[0].sample else logits[:0]
        hidden = self._eager_hidden(batch, feed)  # [T, hidden]
        if not all_logits:
            hidden = hidden[to_device(_last_rows(batch), torch.long, hidden.device)]
        return self.model.compute_logits(hidden)

    def _eager_hidden(self, batch: ScheduledBatch, feed: TokenFeed | None) -> torch.Tensor:
        """The eager forward (K/V written) -> hidden states [T, hidden] of every position."""
        input_ids, positions, meta = self._prepare(batch.chunks)
        if feed is not None:
            starts, at = [], 0
            for c in batch.chunks:
                starts.append(at)
                at += c.num_tokens
            dst = to_device([starts[i] for i in feed.dst_rows], torch.long, input_ids.device)
            src = to_device(list(feed.src_rows), torch.long, input_ids.device)
            input_ids[dst] = feed.tokens[src]
        return self.model(input_ids, positions, self.layer_caches, meta, self.ops)  # [T, hidden]

    @torch.inference_mode()
    def forward_scoring(self, batch: ScheduledBatch, feed: TokenFeed | None = None
                        ) -> tuple[torch.Tensor, dict[int, PendingScores]]:
        """``forward(batch)`` for a batch where some chunk has ``prompt_targets``: the sampled rows'
        logits [S, V] float32, and per such chunk (by index) its targets' scores on the device.

        Always eager, as ``all_logits`` is (a graph returns only last-position logits), but never
        the whole [T, V]: the scored rows go through the vocabulary a slice at a time
        (``engine.prompt_scoring``)."""
        self.copy_blocks(batch.block_copies)
        hidden = self._eager_hidden(batch, feed)  # [T, hidden]
        scores: dict[int, PendingScores] = {}
        start = 0
        for i, c in enumerate(batch.chunks):
            if c.prompt_targets:
                rows = hidden[start : start + len(c.prompt_targets)]  # [R, hidden]: row j before target j
                scores[i] = score_prompt_rows(rows, c.prompt_targets, c.sampling.prompt_logprobs or 0,
                                              self.model.compute_logits)
            start += c.num_tokens
        sampled = hidden[to_device(_last_rows(batch), torch.long, hidden.device)]  # [S, hidden]
        return self.model.compute_logits(sampled), scores

    def execute(self, batch: ScheduledBatch) -> StepResult:
        return self.collect(self.launch(batch))

    def launch(self, batch: ScheduledBatch, feed: Sequence[tuple[int, int]] = (),
               after: LaunchedStep | None = None) -> LaunchedStep:
        """Queue one step (forward and sampling) on the device without waiting for its tokens.

        ``feed``: (chunk index in ``batch``, chunk index in ``after``) pairs: that chunk's one token
        is what ``after`` sampled for the other chunk (the engine's placeholder): it is read on the
        device, so the host can launch this step before ``after``'s tokens reach it. On a CPU the
        work runs here; ``collect`` only converts."""
        if not batch.chunks:
            self.copy_blocks(batch.block_copies)
            return LaunchedStep(batch.chunks, None, {})
        token_feed = None
        if feed:
            if after is None or after.pending is None:
                raise ValueError("a token feed needs the launched step it reads from")
            token_feed = TokenFeed(after.pending.tokens, [i for i, _ in feed], [after.sampled_row[j] for _, j in feed])
        scores: dict[int, PendingScores] = {}
        if any(c.prompt_targets for c in batch.chunks):
            logits, scores = self.forward_scoring(batch, token_feed)  # [S, V]
        else:
            logits = self.forward(batch, feed=token_feed)  # [S, V]
        sampled = [c for c in batch.chunks if c.sample]
        pending = self.sampler.sample_rows_async(
            logits, [c.sampling for c in sampled], [c.request_id for c in sampled],
            [c.output_token_ids for c in sampled], [c.prompt_token_ids for c in sampled],
        ) if sampled else None
        rows = [i for i, c in enumerate(batch.chunks) if c.sample]
        return LaunchedStep(batch.chunks, pending, {chunk: row for row, chunk in enumerate(rows)}, scores)

    def collect(self, step: LaunchedStep) -> StepResult:
        """Wait for a launched step's picks -> its StepResult (what ``execute`` returns)."""
        if not step.chunks:
            return StepResult(sampled_token_ids=[], logprobs=[])
        rows = iter(step.pending.rows() if step.pending is not None else ())
        picks = [next(rows) if c.sample else None for c in step.chunks]
        scores = step.prompt_scores
        return StepResult(
            sampled_token_ids=[p.token_id if p else None for p in picks],
            logprobs=[p.logprob if p else None for p in picks],
            top_logprobs=[p.top if p else None for p in picks],
            grammar_dead_ends=[p.grammar_dead_end if p else None for p in picks],
            prompt_scores=[scores[i].to_host() if i in scores else None
                           for i in range(len(step.chunks))] if scores else (),
        )

    # ------------------------------------------------------------------------------ prompts
    def render_prompt(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        """Token ids of the chat template applied to ``messages`` (+ ``tools``), ending in the
        assistant generation prompt. Client text is tokenized as text: a special-token string in
        a message never becomes a control token (engine/models/chat_render.py). Raises ValueError
        for messages the template cannot render."""
        if not self.tokenizer.chat_template:
            raise ValueError(f"the checkpoint at {self.config.model_dir} has no chat template")
        with self.tokenizers.borrow() as tok:
            return render_chat_ids(tok, messages, tools)

    # ------------------------------------------------------------------------- block moves
    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        if not copies:
            return
        src = to_device([c.src for c in copies], torch.int64, self.kv_cache.device)
        dst = to_device([c.dst for c in copies], torch.int64, self.kv_cache.device)
        self.ops.copy_blocks(self.kv_pages, src, dst)  # raw rows: a block is one run of bytes in either layout
        if self.kv_scales is not None:
            self.ops.copy_blocks(self.kv_scales, src, dst)

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor(list(block_ids), dtype=torch.int64)
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.num_kv_blocks):
            raise IndexError(f"block ids must be in [0, {self.num_kv_blocks}), got {list(block_ids)}")
        return ids.to(self.kv_cache.device)

    def export_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """-> CPU contiguous uint8 [len(block_ids), kv_bytes_per_block]."""
        ids = self._ids(block_ids)
        n = len(ids)
        stream = self._transfer_stream
        if stream is None:
            return self._gather_packed(ids, n).cpu()
        # Side stream: after the compute work queued so far (it may still be writing these blocks),
        # concurrent with what is queued later; only this stream is waited on.
        stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
        with torch.cuda.stream(stream):
            packed = self._gather_packed(ids, n)
            host = torch.empty(packed.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(packed, non_blocking=True)
        stream.synchronize()
        return host

    def export_blocks_device(self, block_ids: Sequence[int]) -> torch.Tensor:
        """-> contiguous uint8 [len(block_ids), kv_bytes_per_block] on this runner's device, complete
        on return: a copy another process can map (CUDA IPC) while the next steps reuse the blocks."""
        ids = self._ids(block_ids)
        n = len(ids)
        stream = self._transfer_stream
        if stream is None:
            return self._gather_packed(ids, n)  # a new tensor: the blocks' later steps do not touch it
        stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
        with torch.cuda.stream(stream):
            packed = self._gather_packed(ids, n)
        stream.synchronize()
        return packed

    @property
    def kv_device(self) -> torch.device:
        return self.kv_cache.device

    def gather_blocks_async(self, block_ids: Sequence[int]) -> torch.Tensor:
        """-> contiguous uint8 [len(block_ids), kv_bytes_per_block] on this runner's device, queued on
        the current stream with no host sync: complete before anything queued on that stream after
        it (the next step may reuse the blocks); a reader on another stream waits for an event
        recorded after this call."""
        out = torch.empty(len(block_ids), self.kv_bytes_per_block, dtype=torch.uint8, device=self.kv_cache.device)
        self.gather_blocks_into(block_ids, out)
        return out

    def gather_blocks_into(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """``gather_blocks_async`` into ``out`` (uint8 [len(block_ids), kv_bytes_per_block] on this
        runner's device, e.g. rows of a reused staging buffer): the spill path that seals KV on the
        GPU (engine.tiers.gpu_sealer) writes evicted blocks there without allocating."""
        wanted = list(block_ids)
        n = len(wanted)
        if wanted and (min(wanted) < 0 or max(wanted) >= self.num_kv_blocks):
            raise IndexError(f"block ids must be in [0, {self.num_kv_blocks}), got {wanted}")
        if out.dtype != torch.uint8 or tuple(out.shape) != (n, self.kv_bytes_per_block) \
                or out.device != self.kv_cache.device:
            raise ValueError(f"out must be uint8 [{n}, {self.kv_bytes_per_block}] on {self.kv_cache.device}")
        if n == 0:
            return
        first = wanted[0]
        if wanted == list(range(first, first + n)):
            # consecutive ids (every spill of one evicted block): slice copies, one device memcpy
            # each queued from the host, instead of an index tensor's pinned upload plus a kernel
            # launch (the step loop pays this per evicted block: issue 19, session 5)
            rows = slice(first, first + n)
            kv = self._cache_block_bytes
            out[:, :kv].view(n, *self.kv_cache.shape[1:-1], -1).copy_(self.kv_cache[rows].view(torch.uint8))
            if self.kv_scales is not None:
                out[:, kv:].copy_(self.kv_scales[rows].view(torch.uint8).reshape(n, -1))
            return
        ids = torch.tensor(wanted, dtype=torch.int64)
        if self.kv_cache.device.type == "cuda":  # a pageable H2D copy would wait for the stream to drain
            ids = ids.pin_memory().to(self.kv_cache.device, non_blocking=True)
        self._gather_rows_into(ids, out)

    def _gather_packed(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        """-> a new uint8 [n, kv_bytes_per_block] on this runner's device holding the blocks ``ids``."""
        out = torch.empty(n, self.kv_bytes_per_block, dtype=torch.uint8, device=self.kv_cache.device)
        self._gather_rows_into(ids, out)
        return out

    def _gather_rows_into(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """The blocks ``ids`` (a device index tensor) into ``out``'s rows, in the transfer format: each row
        its block's KV bytes in token order, then its scales' bytes. Each part is gathered straight into
        its slice of the rows through the pool's token view: one pass whatever the pool's layout (a
        head-major pool's tiles are transposed on the way), no staging tensor copied or concatenated."""
        kv = self._cache_block_bytes
        self.ops.gather_blocks(self.kv_cache, ids, out=_row_view(out[:, :kv], self.kv_cache))
        if self.kv_scales is not None:
            self.ops.gather_blocks(self.kv_scales, ids, out=_row_view(out[:, kv:], self.kv_scales))

    def import_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Inverse of ``export_blocks``: data uint8 [len(block_ids), kv_bytes_per_block] (any device)."""
        ids = self._ids(block_ids)
        n = len(ids)
        if data.dtype != torch.uint8 or tuple(data.shape) != (n, self.kv_bytes_per_block):
            raise ValueError(
                f"expected uint8 [{n}, {self.kv_bytes_per_block}], got {data.dtype} {tuple(data.shape)}"
            )
        stream = self._transfer_stream
        if stream is None:
            self._scatter_packed(ids, n, data.to(self.kv_cache.device).contiguous())
            return
        # H2D + scatter on the side stream; the compute stream waits for it on the device (no host
        # sync), so the next step that reads these blocks sees them.
        compute = torch.cuda.current_stream(self.kv_cache.device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            if data.device.type == "cpu" and not data.is_pinned():
                data = data.contiguous().pin_memory()
            staged = data.to(self.kv_cache.device, non_blocking=True).contiguous()
            self._scatter_packed(ids, n, staged)
        compute.wait_stream(stream)
        for t in (ids, staged):  # allocated on the side stream, used until it finishes
            t.record_stream(stream)

    def _scatter_packed(self, ids: torch.Tensor, n: int, data: torch.Tensor) -> None:
        kv = data[:, : self._cache_block_bytes].contiguous().view(self.kv_dtype)  # token order (the transfer format)
        # written through the pool's token view: one pass into either layout (no transpose to the pool's
        # order first: on a head-major pool that was a second read and write of every restored byte)
        self.ops.scatter_blocks(self.kv_cache, ids, kv.reshape(n, *self.kv_cache.shape[1:]))
        if self.kv_scales is not None:
            sc = data[:, self._cache_block_bytes :].contiguous().view(torch.float32)
            self.ops.scatter_blocks(self.kv_scales, ids, sc.reshape(n, *self.kv_scales.shape[1:]))

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)

    def admit_grammar(self, spec: GuidedSpec) -> GrammarCompile:
        """``spec``'s compile, not waited for (``engine.guided.GrammarCompiler.admit``)."""
        return self.grammars.admit(spec)

    def token_bytes(self, token_ids: Sequence[int]) -> list[bytes]:
        return self.grammars.token_bytes(token_ids)
