"""Weights pulled into L2 on a side stream while the decode step runs kernels that leave HBM idle.

A decode step at small batch is a chain of weight-streaming GEMMs with short latency-bound kernels
between them. After the q|k|v GEMM come RoPE + KV write and the attention, which at batch 1 x 2K
move ~8 MB in ~13 us, time in which the HBM could have delivered the next GEMM's 32 MiB (the o
projection). The o weights depend on nothing the step computes, so ``SideStreamPrefetch.ahead``
forks a side stream from the current one right after the q|k|v GEMM is queued and issues an L2
prefetch of them there (``kernels/l2_prefetch.py``); the o GEMM, queued on the main stream, does
not wait for it and finds its weights in L2. ``join`` (once per forward) makes the main stream wait
for the side stream, which a CUDA graph capture requires before it ends (the fork and join become
graph edges, so a replay overlaps them the same way).

The prefetch only pays while the HBM idles: at large batches the attention streams hundreds of MB
of K/V a layer itself, and the prefetch would compete with it. ``max_rows`` bounds the steps it is
issued for (measured per batch size by ``benchmarks/engine_gpu.py --sections decode_prefetch``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from kernels.l2_prefetch import PrefetchMode


class WeightPrefetch(Protocol):
    """What the fused forward asks of a prefetcher."""

    def ahead(self, weight: torch.Tensor, rows: int) -> None:
        """Start moving ``weight`` into L2 for a step of ``rows`` tokens, without blocking the stream."""

    def join(self) -> None:
        """Make the current stream wait for every prefetch issued since the last join."""


class NoPrefetch:
    """The default, and every CPU step: nothing to prefetch into."""

    def ahead(self, weight: torch.Tensor, rows: int) -> None:
        return None

    def join(self) -> None:
        return None


class SideStreamPrefetch:
    """L2 prefetches on one side stream of ``device``, for steps of at most ``max_rows`` tokens."""

    def __init__(self, device: torch.device, max_rows: int, mode: PrefetchMode | None = None) -> None:
        # imported here: the kernel module pulls in Triton, which a CPU engine never needs
        from kernels.l2_prefetch import PrefetchMode, prefetch_l2

        if device.type != "cuda":
            raise ValueError(f"L2 prefetch needs a CUDA device, got {device}")
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.device, self.max_rows = device, max_rows
        self.mode = mode if mode is not None else PrefetchMode.BULK
        self._prefetch = prefetch_l2
        self._stream = torch.cuda.Stream(device)
        self._forked = False

    def ahead(self, weight: torch.Tensor, rows: int) -> None:
        if rows > self.max_rows:
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._prefetch(weight, self.mode)
        self._forked = True

    def join(self) -> None:
        if self._forked:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            self._forked = False
