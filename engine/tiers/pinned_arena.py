"""Page-locked host memory taken once for the DRAM tier, and carved into blobs.

Why not a pinned tensor per blob (``torch.empty(n, pin_memory=True)``): a new page-locked
allocation pins its pages in the driver (cudaHostAlloc), which serialises with the CUDA calls of
every other thread of the process. A tier worker sealing a spill then stalls the step loop's graph
replays: on the H200 (stepload, CUDA graphs, ~2.6 blocks of 2.5 MB spilled per step) decode steps
went from 1.3 ms to 3.2-9.8 ms p50 with spills sealed on the GPU. The caching host allocator
also rounds each request up to a power of two (a 64 MiB + 32 B blob held 128 MiB). One mapping
sized to the tier, pinned once at start-up (``cudaHostRegister``), costs neither in the step loop.

An extent goes back to the arena when the last view of its array is gone (``weakref.finalize``
on the array: memoryviews, ``torch.from_numpy`` and ``torch.frombuffer`` all keep it alive), so a
blob that a restore or a cascade to NVMe is still reading is never handed out again. When no free
extent is large enough (fragmentation, or views still alive) ``allocate`` falls back to a plain
allocation and counts it: slower, never wrong.
"""

from __future__ import annotations

import bisect
import collections
import logging
import mmap
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

# DMA-friendly offsets; also keeps every blob's int32 / int64 views aligned
ALIGN = 256

Fallback = Callable[[int], np.ndarray]


@dataclass(frozen=True)
class ArenaStats:
    capacity_bytes: int
    used_bytes: int  # extents handed out and not yet returned (aligned sizes)
    pinned: bool
    allocations: int
    fallbacks: int  # requests no free extent could hold


class PinnedArena:
    """One host mapping of ``capacity_bytes`` (page-locked when ``pin`` and CUDA is there); first-fit
    extents, coalesced on return. Thread-safe."""

    def __init__(self, capacity_bytes: int, *, pin: bool, fallback: Fallback | None = None):
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be > 0")
        self.capacity_bytes = -(-capacity_bytes // ALIGN) * ALIGN
        self._map = mmap.mmap(-1, self.capacity_bytes)
        self._buf = np.frombuffer(self._map, dtype=np.uint8)
        self.pinned = pin and _register(self._buf)
        if self.pinned:  # unpinned when the mapping's last view is gone, before it is unmapped
            weakref.finalize(self._buf, _unregister, self._buf.ctypes.data, self._map)
        self._fallback = fallback or _plain
        self._lock = threading.Lock()
        # extents whose arrays died, merged in by the next call: a finalizer may run on any thread,
        # even inside this object's locked section (a collection), so it only appends (atomic)
        self._returned: collections.deque[tuple[int, int]] = collections.deque()
        self._starts: list[int] = [0]  # free extents, sorted by start; lengths in _free
        self._free: dict[int, int] = {0: self.capacity_bytes}
        self._used = 0
        self._allocations = 0
        self._fallbacks = 0

    def allocate(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of ``nbytes`` (its extent returns when the array is unreachable)."""
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        with self._lock:
            self._merge_returned()
            self._allocations += 1
            start = next((s for s in self._starts if self._free[s] >= size), None)
            if start is None:
                self._fallbacks += 1
            else:
                self._take(start, size)
        if start is None:
            return self._fallback(nbytes)
        arr = self._buf[start:start + nbytes]
        weakref.finalize(arr, self._returned.append, (start, size))
        return arr

    def stats(self) -> ArenaStats:
        with self._lock:
            self._merge_returned()
            return ArenaStats(self.capacity_bytes, self._used, self.pinned, self._allocations, self._fallbacks)

    def _take(self, start: int, size: int) -> None:
        length = self._free.pop(start)
        i = bisect.bisect_left(self._starts, start)
        if length == size:
            del self._starts[i]
        else:  # the rest of the extent stays free, at the same place in the order
            self._starts[i] = start + size
            self._free[start + size] = length - size
        self._used += size

    def _merge_returned(self) -> None:
        while self._returned:
            start, size = self._returned.popleft()
            self._used -= size
            i = bisect.bisect_left(self._starts, start)
            end = start + size
            if i < len(self._starts) and self._starts[i] == end:  # merge with the next free extent
                size += self._free.pop(end)
                del self._starts[i]
            if i > 0 and self._starts[i - 1] + self._free[self._starts[i - 1]] == start:  # and the previous
                self._free[self._starts[i - 1]] += size
                continue
            self._starts.insert(i, start)
            self._free[start] = size


def _plain(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


def _register(buf: np.ndarray) -> bool:
    """Page-lock ``buf`` for the CUDA driver; False (logged) where there is no CUDA or it refuses."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency of the engine
        return False
    if not torch.cuda.is_available():
        return False
    err = torch.cuda.cudart().cudaHostRegister(buf.ctypes.data, buf.nbytes, 0)
    if int(err) != 0:
        log.warning("kv tier: could not page-lock %d bytes of host memory (CUDA error %s); "
                    "DRAM-tier copies will go through pageable memory", buf.nbytes, int(err))
        return False
    return True


def _unregister(ptr: int, _mapping: mmap.mmap) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(ptr)
