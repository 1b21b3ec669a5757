"""ModelRunner: turns a ``ScheduledBatch`` into sampled tokens on one device.

It owns the weights, the tokenizer, the paged KV cache and the sampler, and holds no scheduling
state: which blocks a sequence owns is decided by the scheduler / block pool (engine/batch.py).

KV cache (block-major, one block = one contiguous run of bytes)::

    kv_cache  : [num_blocks, num_layers, 2 (k|v), block_size, num_kv_heads, head_dim]
    kv_scales : [num_blocks, num_layers, 2, block_size, num_kv_heads] float32   (int8 only)

An exported block is ``kv_cache[b]``'s bytes followed by ``kv_scales[b]``'s bytes (int8).
fp8 uses one fixed per-tensor scale (1.0), so its blocks carry no scale bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.batch import BlockCopy, ScheduledBatch, SequenceChunk, StepResult
from engine.config import EngineConfig
from engine.models.attention import AttentionMetadata, LayerCache, select_ops
from engine.models.loader import build_model
from engine.models.spec import ModelSpec, parse_checkpoint_config, read_special_ids
from engine.sampling import Sampler

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


class ModelRunner:
    """See the contract in engine/batch.py and the module docstring. Not thread-safe: one caller."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device
        self.block_size = config.block_size
        torch_device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, torch_device.type)
        self.kv_dtype = self.dtype if config.kv_dtype == "auto" else _KV_DTYPES[config.kv_dtype]

        arch = parse_checkpoint_config(config.model_dir, config.max_model_len)
        self.arch = arch
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(config.model_dir)
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
        self.model = build_model(arch, config.model_dir, torch_device, self.dtype)
        self.ops = select_ops(torch_device)
        self.sampler = Sampler(torch_device)

        layer_shape = (arch.num_layers, 2, self.block_size, arch.num_kv_heads, arch.head_dim)
        elems = arch.num_layers * 2 * self.block_size * arch.num_kv_heads * arch.head_dim
        self._cache_block_bytes = elems * self.kv_dtype.itemsize
        self._scale_block_bytes = elems // arch.head_dim * 4 if self.kv_dtype == torch.int8 else 0
        self.kv_bytes_per_block = self._cache_block_bytes + self._scale_block_bytes
        self.num_kv_blocks = self._count_blocks(torch_device)

        self.kv_cache = torch.zeros((self.num_kv_blocks, *layer_shape), dtype=self.kv_dtype, device=torch_device)
        self.kv_scales = None
        if self.kv_dtype == torch.int8:
            self.kv_scales = torch.ones((self.num_kv_blocks, *layer_shape[:-1]), dtype=torch.float32, device=torch_device)
        fp8_scale = torch.ones(1, dtype=torch.float32, device=torch_device) if self.kv_dtype == torch.float8_e4m3fn else None
        self.layer_caches = [self._layer_cache(layer, fp8_scale) for layer in range(arch.num_layers)]

    # ----------------------------------------------------------------------------------- setup
    def _count_blocks(self, device: torch.device) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            budget = int(free * self.config.kv_memory_fraction) - _CUDA_HEADROOM_BYTES
        else:
            budget = self.config.cpu_kv_bytes
        blocks = budget // self.kv_bytes_per_block
        if blocks < 2:
            raise ValueError(
                f"KV budget of {budget} bytes holds {blocks} blocks of {self.kv_bytes_per_block} bytes; "
                "raise cpu_kv_bytes / kv_memory_fraction or set num_kv_blocks"
            )
        return int(blocks)

    def _layer_cache(self, layer: int, fp8_scale: torch.Tensor | None) -> LayerCache:
        k, v = self.kv_cache[:, layer, 0], self.kv_cache[:, layer, 1]  # [NB, BS, Hkv, D] strided views
        if self.kv_scales is not None:
            return LayerCache(k, v, self.kv_scales[:, layer, 0], self.kv_scales[:, layer, 1])
        return LayerCache(k, v, fp8_scale, fp8_scale)

    # --------------------------------------------------------------------------------- forward
    def _prepare(self, chunks: Sequence[SequenceChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
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
            table = c.block_table
            ids.extend(c.token_ids)
            for p in range(c.start_pos, end):
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            cu.append(cu[-1] + c.num_tokens)
            seq_lens.append(end)
            max_blocks = max(max_blocks, needed)
        tables = torch.zeros((len(chunks), max_blocks), dtype=torch.int32)
        for i, c in enumerate(chunks):
            n = (c.context_len + bs - 1) // bs
            tables[i, :n] = torch.tensor(list(c.block_table[:n]), dtype=torch.int32)
        dev = self.kv_cache.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=tables.to(dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            decode_only=all(c.num_tokens == 1 for c in chunks),
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        return input_ids, torch.tensor(positions, dtype=torch.int64, device=dev), meta

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, all_logits: bool = False) -> torch.Tensor:
        """Run one packed forward (writing K/V) and return logits float32:
        [num sampled chunks, V] (last position of each chunk with sample=True), or [T, V] with all_logits."""
        self.copy_blocks(batch.block_copies)
        input_ids, positions, meta = self._prepare(batch.chunks)
        hidden = self.model(input_ids, positions, self.layer_caches, meta, self.ops)  # [T, hidden]
        if not all_logits:
            last = [int(meta.cu_seqlens_q[i + 1]) - 1 for i, c in enumerate(batch.chunks) if c.sample]
            hidden = hidden[torch.tensor(last, dtype=torch.long, device=hidden.device)]
        return self.model.compute_logits(hidden)

    def execute(self, batch: ScheduledBatch) -> StepResult:
        if not batch.chunks:
            self.copy_blocks(batch.block_copies)
            return StepResult(sampled_token_ids=[], logprobs=[])
        logits = self.forward(batch)  # [S, V]
        sampled = [c for c in batch.chunks if c.sample]
        tokens: list[int] = []
        logprobs: list[float] = []
        if sampled:
            tokens, logprobs = self.sampler.sample(
                logits,
                [c.sampling for c in sampled],
                [c.request_id for c in sampled],
                [len(c.output_token_ids) for c in sampled],
            )
        tok_iter, lp_iter = iter(tokens), iter(logprobs)
        out_tokens = [next(tok_iter) if c.sample else None for c in batch.chunks]
        out_lps = [next(lp_iter) if c.sample else None for c in batch.chunks]
        return StepResult(sampled_token_ids=out_tokens, logprobs=out_lps)

    # ------------------------------------------------------------------------------ prompts
    def render_prompt(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        """Token ids of the chat template applied to ``messages`` (+ ``tools``), ending in the
        assistant generation prompt. Raises ValueError for messages the template cannot render."""
        if not self.tokenizer.chat_template:
            raise ValueError(f"the checkpoint at {self.config.model_dir} has no chat template")
        try:
            text = self.tokenizer.apply_chat_template(
                [dict(m) for m in messages],
                tools=[dict(t) for t in tools] if tools else None,
                add_generation_prompt=True,
                tokenize=False,
            )
        except Exception as exc:  # jinja2 TemplateError, or the template's own raise_exception
            raise ValueError(f"cannot render these messages with the chat template: {exc}") from exc
        # The template already contains any BOS it wants; don't let the tokenizer add another.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # ------------------------------------------------------------------------- block moves
    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        if not copies:
            return
        src = torch.tensor([c.src for c in copies], dtype=torch.int64, device=self.kv_cache.device)
        dst = torch.tensor([c.dst for c in copies], dtype=torch.int64, device=self.kv_cache.device)
        self.ops.copy_blocks(self.kv_cache, src, dst)
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
        data = self.ops.gather_blocks(self.kv_cache, ids).view(torch.uint8).reshape(n, -1)
        if self.kv_scales is not None:
            scales = self.ops.gather_blocks(self.kv_scales, ids).view(torch.uint8).reshape(n, -1)
            data = torch.cat([data, scales], dim=1)
        return data.cpu().contiguous()

    def import_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Inverse of ``export_blocks``: data uint8 [len(block_ids), kv_bytes_per_block] (any device)."""
        ids = self._ids(block_ids)
        n = len(ids)
        if data.dtype != torch.uint8 or tuple(data.shape) != (n, self.kv_bytes_per_block):
            raise ValueError(
                f"expected uint8 [{n}, {self.kv_bytes_per_block}], got {data.dtype} {tuple(data.shape)}"
            )
        data = data.to(self.kv_cache.device).contiguous()
        kv = data[:, : self._cache_block_bytes].contiguous().view(self.kv_dtype)
        self.ops.scatter_blocks(self.kv_cache, ids, kv.reshape(n, *self.kv_cache.shape[1:]))
        if self.kv_scales is not None:
            sc = data[:, self._cache_block_bytes :].contiguous().view(torch.float32)
            self.ops.scatter_blocks(self.kv_scales, ids, sc.reshape(n, *self.kv_scales.shape[1:]))

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)
