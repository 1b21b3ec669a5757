"""``DeviceKV``: a spilled run's plaintext KV while it is still in HBM (``engine.tiers.device_aead.DevicePlaintext``).

The step loop's ``TierHook`` makes one per flushed run; the tier manager's worker hands it to the
GPU sealer (``engine.tiers.gpu_sealer``), or copies it to the host for a cipher the GPU cannot seal with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceKV:
    """``DevicePlaintext``: uint8 ``[blocks, block_bytes]`` on the device, complete once ``ready``
    (an event on the stream that wrote it; None on the CPU) has fired. Nobody writes it afterwards."""

    data: torch.Tensor
    ready: torch.cuda.Event | None = None

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[0])

    def rows(self, first: int, stop: int) -> DeviceKV:
        return DeviceKV(self.data[first:stop], self.ready)

    def to_host(self) -> memoryview:
        if self.ready is not None:
            self.ready.synchronize()
        # .data is memoryview(array): numpy's stubs give ndarray the buffer protocol for Python 3.12+ only
        return self.data.cpu().contiguous().numpy().data.cast("B").toreadonly()
