"""Small host lists -> device tensors without a stream sync.

``torch.tensor(values, device="cuda")`` copies from pageable memory with ``non_blocking=False``,
and torch then synchronises the stream: the host waits for every step already queued. With
overlapped steps (engine/llm_engine.py) that wait would be for the step the device is running,
which is exactly what overlap is there to avoid. Staging through pinned memory with a
non-blocking copy does not wait (torch's pinned allocator keeps the staging buffer alive until
the copy has run).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


def tensor_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on ``device``, by the same pinned non-blocking route."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
