"""A model-runner double whose KV cache holds token ids as bytes, for engine-level tier tests.

It writes each computed token's id where a real runner writes K/V and predicts the next token
from the context it *reads back from the blocks*, so a restored block with the wrong bytes, a
block restored into the wrong place or a slot never written changes the output or raises. Its
``export_blocks`` / ``gather_blocks_async`` / ``import_blocks`` move raw bytes exactly like the real
runner's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.batch import ScheduledBatch, StepResult
from engine.tokenizer_pool import TokenizerPool

EMPTY = -1


def next_token(context: Sequence[int]) -> int:
    digest = hashlib.sha256(b"".join(int(t).to_bytes(4, "little") for t in context)).digest()
    return 97 + digest[0] % 26


def reference_generate(prompt: Sequence[int], n: int) -> list[int]:
    ctx, out = list(prompt), []
    for _ in range(n):
        out.append(next_token(ctx))
        ctx.append(out[-1])
    return out


class ByteTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return bytes(i % 256 for i in ids).decode(errors="replace")


@dataclass
class Spec:
    vocab_size: int = 50_000
    max_model_len: int = 4096
    eos_token_ids: tuple[int, ...] = ()


class TokenKVRunner:
    def __init__(self, num_kv_blocks: int, block_size: int, spill_device: str = "cpu"):
        """``spill_device``: where ``gather_blocks_async`` puts its copy (the device sealer's input);
        "cuda" on a GPU host, where the compiled kernels cannot read CPU tensors."""
        self.num_kv_blocks = num_kv_blocks
        self.spill_device = spill_device
        self.block_size = block_size
        self.kv_bytes_per_block = block_size * 4
        self.spec = Spec()
        self.tokenizer = ByteTokenizer()
        self.tokenizers = TokenizerPool(self.tokenizer)
        self.max_token_chars = 1  # one byte a token: a character is at least one
        self.kv = torch.full((num_kv_blocks, block_size), EMPTY, dtype=torch.int32)  # [blocks, slots]
        self.exported = self.imported = self.gathered = 0

    def execute(self, batch: ScheduledBatch) -> StepResult:
        bs, out = self.block_size, []
        for chunk in batch.chunks:
            for j, tok in enumerate(chunk.token_ids):
                p = chunk.start_pos + j
                self.kv[chunk.block_table[p // bs], p % bs] = tok
        for chunk in batch.chunks:
            if not chunk.sample:
                out.append(None)
                continue
            ctx = [int(self.kv[chunk.block_table[p // bs], p % bs]) for p in range(chunk.context_len)]
            if EMPTY in ctx:
                raise RuntimeError("read a KV slot that was never written")
            out.append(next_token(ctx))
        return StepResult(out)

    def export_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        self.exported += len(block_ids)
        # [N, block_size] int32 -> [N, kv_bytes_per_block] uint8, a copy
        return self.kv[list(block_ids)].contiguous().view(torch.uint8).clone()

    def gather_blocks_async(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The device-spill export (``engine.tiers.engine_hook.GathersOnDevice``): a copy on ``spill_device``."""
        self.gathered += len(block_ids)
        return self.kv[list(block_ids)].contiguous().view(torch.uint8).to(self.spill_device, copy=True)

    @property
    def kv_device(self) -> torch.device:
        return torch.device(self.spill_device)

    def gather_blocks_into(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """``gather_blocks_async`` into the rows of ``out`` (a staging buffer on ``spill_device``)."""
        assert out.dtype == torch.uint8 and out.shape == (len(block_ids), self.kv_bytes_per_block)
        out.copy_(self.gather_blocks_async(block_ids))

    def import_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        assert data.dtype == torch.uint8 and data.shape == (len(block_ids), self.kv_bytes_per_block)
        self.imported += len(block_ids)
        self.kv[list(block_ids)] = data.to("cpu").contiguous().view(torch.int32)

    def render_prompt(self, messages, tools=None) -> list[int]:
        return self.tokenizer.encode("".join(m["content"] for m in messages))

    def release(self, request_id: str) -> None:
        pass
