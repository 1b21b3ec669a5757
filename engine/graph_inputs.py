"""What the CUDA-graph runners (engine/cuda_graphs.py, engine/prefill_graphs.py) share: static input
buffers staged in pinned host memory, and the capture of one graph.

A graph reads its inputs from fixed device addresses, so every step writes its inputs into the host
side of a ``StaticInputs`` and copies them with ``non_blocking=True`` into the device side; the only
wait is before the next host rewrite, for the previous copy (long done by then in practice). On a
CPU device the same buffers exist without pinning or events, so the padding logic runs in tests.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch


class StaticInputs:
    """Named host buffers (pinned on CUDA) and same-shaped device buffers a captured graph reads."""

    def __init__(self, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> None:
        self.on_cuda = device.type == "cuda"  # pinned host memory and events need a CUDA runtime
        self.host = {k: torch.zeros(shape, dtype=dtype, pin_memory=self.on_cuda) for k, (shape, dtype) in shapes.items()}
        self.dev = {k: torch.zeros_like(v, device=device) for k, v in self.host.items()}
        self._copied: torch.cuda.Event | None = None

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
        if self.on_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()


def capture_graph(forward: Callable[[], torch.Tensor], stream: torch.cuda.Stream, device: torch.device,
                  pool: tuple[int, int] | None = None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
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
