"""What the CUDA-graph runners (engine/cuda_graphs.py, engine/prefill_graphs.py) share: static input
buffers staged in pinned host memory, and the capture of one graph.

A graph reads its inputs from fixed device addresses, so every step writes its inputs into the host
side of a ``StaticInputs`` and copies them with ``non_blocking=True`` into the device side; the only
wait is before the next host rewrite, for the previous copy (long done by then in practice). On a
CPU device the same buffers exist without pinning or events, so the padding logic runs in tests.

Both sides are one contiguous byte buffer each, the named buffers views into it at 64-byte aligned
offsets, so that a runner whose buffers are small (one sequence's prefill step: ~15 KB at 512
tokens) moves them in one copy (``copy_all``) instead of one per buffer, and can write its host
side through ``words``: flat ``memoryview``s that take an ``array`` of the same type in one C-level
copy. A prefill step's inputs are on its time to first token: written through torch (a tensor
per list, a slice assignment per buffer, seven copies), they took 0.7-0.9 ms of host time in place
on the H200's host (session 11), before the device could start.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Mapping
from typing import Literal

import torch

_ALIGN = 64  # bytes: each named buffer starts on a cache line
# memoryview formats of the dtypes the runners' inputs use (int64 ids/positions/slots, int32 tables)
_WORD_FORMATS: dict[torch.dtype, Literal["q", "i"]] = {torch.int64: "q", torch.int32: "i"}


class StaticInputs:
    """Named host buffers (pinned on CUDA) and same-shaped device buffers a captured graph reads."""

    def __init__(self, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> None:
        self.on_cuda = device.type == "cuda"  # pinned host memory and events need a CUDA runtime
        spans: dict[str, tuple[int, int]] = {}  # name -> (byte offset, bytes)
        total = 0
        for k, (shape, dtype) in shapes.items():
            nbytes = math.prod(shape) * dtype.itemsize
            spans[k] = (total, nbytes)
            total += -(-nbytes // _ALIGN) * _ALIGN
        self._spans = spans
        self._row_bytes = {k: math.prod(shape[1:]) * dtype.itemsize for k, (shape, dtype) in shapes.items()}
        self._last = next(reversed(spans)) if spans else None  # spans: shapes' names, in order
        self._host_bytes = torch.zeros(max(total, _ALIGN), dtype=torch.uint8, pin_memory=self.on_cuda)
        self._dev_bytes = torch.zeros_like(self._host_bytes, device=device)

        def views(buf: torch.Tensor) -> dict[str, torch.Tensor]:
            return {k: buf[o : o + n].view(dtype).view(shape)
                    for (k, (shape, dtype)), (o, n) in zip(shapes.items(), spans.values())}

        self.host = views(self._host_bytes)
        self.dev = views(self._dev_bytes)
        self._words: dict[str, memoryview[int]] = {}
        for k, (_shape, dtype) in shapes.items():
            fmt = _WORD_FORMATS.get(dtype)
            if fmt is None:
                continue
            offset, nbytes = spans[k]
            # a ctypes array over the host buffer's memory: memoryview slice assignment from an
            # array('q' / 'i') is then one memcpy. The tensor owns the memory and lives as long as self.
            raw = (ctypes.c_ubyte * nbytes).from_address(self._host_bytes.data_ptr() + offset)
            self._words[k] = memoryview(raw).cast("B").cast(fmt)
        self._copied: torch.cuda.Event | None = None

    def words(self, name: str) -> memoryview[int]:
        """The host buffer ``name`` as a flat, writable memoryview of its elements (format ``q`` for
        int64, ``i`` for int32): ``words(n)[a:b] = array("q", values)`` writes b - a elements."""
        return self._words[name]

    def wait_copied(self) -> None:
        """Block until the last ``copy`` left the host buffers: call before rewriting them."""
        if self._copied is not None:
            self._copied.synchronize()

    def copy(self, leading_rows: Mapping[str, int]) -> None:
        """Queue host -> device copies of every buffer: the first ``leading_rows[name]`` rows of the
        named ones, the whole of the others."""
        for k, v in self.host.items():
            n = leading_rows.get(k)
            if n is None:
                self.dev[k].copy_(v, non_blocking=True)
            else:
                self.dev[k][:n].copy_(v[:n], non_blocking=True)
        self._record_copy()

    def copy_all(self) -> None:
        """Queue one host -> device copy of every buffer, whole (for runners whose buffers are small:
        one copy's fixed cost is more than its bytes)."""
        self._dev_bytes.copy_(self._host_bytes, non_blocking=True)
        self._record_copy()

    def copy_through(self, name: str, rows: int) -> None:
        """Queue one host -> device copy of everything before the last buffer, ``name``, and of its
        first ``rows`` rows: where the other buffers are small and the last one (a block table) is
        not, one copy in place of one per buffer (each a DMA of a few microseconds on the device's
        stream, between one graph replay and the next)."""
        if name != self._last:
            raise ValueError(f"copy_through copies up to the last buffer ({self._last}), not {name}")
        offset, nbytes = self._spans[name]
        end = offset + min(nbytes, max(0, rows) * self._row_bytes[name])
        self._dev_bytes[:end].copy_(self._host_bytes[:end], non_blocking=True)
        self._record_copy()

    def _record_copy(self) -> None:
        if self.on_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()


def capture_graph(forward: Callable[[], torch.Tensor], stream: torch.cuda.Stream, device: torch.device,
                  pool: torch.cuda._POOL_HANDLE | None = None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture ``forward`` (run twice first on ``stream``: the Triton kernels compile and the
    allocator settles outside the capture) into a graph in ``pool`` -> (graph, its output)."""
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = forward()
    return graph, out
