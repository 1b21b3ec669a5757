"""Small host lists -> device tensors without a stream sync.

``torch.tensor(values, device="cuda")`` copies from pageable memory with ``non_blocking=False``,
and torch then synchronises the stream: the host waits for every step already queued. With
overlapped steps (engine/llm_engine.py) that wait would be for the step the device is running,
which is exactly what overlap is there to avoid. Staging through pinned memory with a
non-blocking copy does not wait (torch's pinned allocator keeps the staging buffer alive until
the copy has run).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

# array typecodes of the integer dtypes whose host tensors are packed by ``array`` (asserted sizes)
_INT_CODES = {torch.int64: "q", torch.int32: "i"}
assert all(array(code).itemsize == dtype.itemsize for dtype, code in _INT_CODES.items())


def host_tensor(values: Sequence[int] | Sequence[float], dtype: torch.dtype) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on the host. Ints go through ``array`` and
    ``torch.frombuffer`` (which shares the array's memory): 512 ids in 9 us instead of 31 us, one in
    0.7 instead of 2.6 (2-core Xeon); values ``array`` refuses (floats) take ``torch.tensor``."""
    code = _INT_CODES.get(dtype)
    if code is not None and len(values):
        try:
            return torch.frombuffer(array(code, values), dtype=dtype)
        except (TypeError, OverflowError):  # torch.tensor converts floats, or raises its own error
            pass
    return torch.tensor(values, dtype=dtype)


def to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return tensor_to_device(host_tensor(values, dtype), device)


def tensor_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on ``device``, by the same pinned non-blocking route."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
