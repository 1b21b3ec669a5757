"""``TierHook``: the DRAM / NVMe tiers as the cache manager's ``LowerTier`` (engine.kv_types).

The cache manager (``engine.kv_cache_manager``) decides what to spill and restore and owns every
HBM block; this adapter moves the bytes (``runner.export_blocks`` / ``import_blocks``) and hands
them to the ``TierManager``::

    spill(tenant, block)      the pool is about to reuse block_id: copy its bytes out now; runs of
                              consecutive victims of one chain (tails go first, so they arrive
                              deepest first) become one segment at flush_spills(), split where
                              the retention status changes (a retained run stays retained below);
                              while no request waits, a run keeps growing across steps (up to a
                              segment's blocks or ``spill_linger_s``): fewer, larger seals
    lookup(ns, hashes)        how many leading hashes the tiers hold (in-memory maps only)
    start_restore(id, ...)    read + decrypt on the tier manager's worker pool
    finished_restores(t)      restores that are done: their plaintext is written into the HBM
                              blocks the manager allocated, and the manager indexes them

Each spill also applies the tenant's DRAM / NVMe block quotas (``TenantScope.kv_block_quota_dram``
/ ``kv_block_quota_nvme``) to the tier manager, which keeps the tenant within them.

Runs on the engine's step-loop thread only (the tier manager's pool does the slow work).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, Protocol, runtime_checkable

import torch
from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from engine.kv_types import BlockHash, EvictedBlock, FinishedRestore, TierName
from engine.protocol import TenantScope
from engine.tiers.base import SkipReason
from engine.tiers.device_kv import DeviceKV
from engine.tiers.manager import RestoreResult, TierManager

log = logging.getLogger(__name__)

# How long a run of evicted blocks may wait for more of its chain before it is sealed, when no
# request is waiting: a few decode steps of an 8B model (5-7 ms each on the H200). The blocks are
# already copied out of the pool; only lookups in that window miss them, and a waiting request
# (the only one that looks up) flushes everything first.
DEFAULT_SPILL_LINGER_S = 0.05


class KVBlockIO(Protocol):
    """What the hook needs of the model runner (``engine.model_runner.ModelRunner``)."""

    kv_bytes_per_block: int

    def export_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """uint8 CPU tensor [len(block_ids), kv_bytes_per_block], a copy of the blocks' KV."""
        ...

    def import_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Write uint8 [len(block_ids), kv_bytes_per_block] into the blocks."""
        ...


@runtime_checkable
class GathersOnDevice(Protocol):
    """A runner that can copy blocks within device memory without a host sync (``ModelRunner``)."""

    @property
    def kv_device(self) -> torch.device:
        """Where its KV cache (and so a spill's staging buffer) lives."""
        ...

    def gather_blocks_into(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy the blocks into ``out`` (uint8 [len(block_ids), kv_bytes_per_block] on ``kv_device``),
        queued on the current stream."""
        ...


# Most device staging buffers (a segment of blocks each) the hook keeps: an 8B model's 32-block
# segment is 64 MiB of HBM, so 4 bound what spills hold besides the pool. A run needing a buffer
# when all are waiting for their seal waits for the oldest (counted in ``backlog_waits``).
MAX_STAGING_BUFFERS = 4


@dataclasses.dataclass
class _Staging:
    """A device staging buffer of one segment's blocks, and the event its run is recorded with (the
    sealer's stream waits for it). Both are reused once the seal reading them is done."""

    rows: torch.Tensor  # uint8 [max_segment_blocks, block_bytes] on the runner's device
    ready: torch.cuda.Event | None  # None off CUDA


class TierHook:
    """See the module docstring. ``manager`` owns the tiers; ``runner`` moves bytes in and out of HBM."""

    def __init__(self, manager: TierManager, runner: KVBlockIO, *, pin_memory: bool | None = None,
                 device_spill: bool = False, device_backlog_bytes: int = 1 << 30,
                 spill_linger_s: float = DEFAULT_SPILL_LINGER_S, clock: Callable[[], float] = time.monotonic):
        """``device_spill``: evicted blocks stay in device memory (``runner.gather_blocks_into``
        a staging buffer: no host sync on the step loop) and the manager's ``sealer`` seals them there. At most
        ``device_backlog_bytes`` of them wait for their seal; past that a flush waits for the oldest.
        ``spill_linger_s``: how long a run may wait for more blocks of its chain at a
        ``flush_spills(due_only=True)`` (0: every flush hands it down)."""
        if runner.kv_bytes_per_block != manager.block_bytes:
            raise ValueError(f"runner has {runner.kv_bytes_per_block} bytes per block, the tier manager "
                             f"{manager.block_bytes}")
        if device_spill and (manager.sealer is None or not isinstance(runner, GathersOnDevice)):
            raise ValueError("device_spill needs a tier manager with a sealer and a runner that gathers on device")
        self.manager = manager
        self.runner = runner
        self.device_spill = device_spill
        self.device_backlog_bytes = device_backlog_bytes
        # device-resident demotions, oldest first: (future, bytes, the staging buffer it reads)
        self._backlog: deque[tuple[Future, int, _Staging]] = deque()
        # Evicted blocks are copied into the rows of a staging buffer of a segment's blocks, filled
        # from the last row up (they arrive deepest first), so a run is a view in chain order: no
        # allocation per block and no concatenation at flush, and what spills hold in HBM is bounded
        # by the buffers. A buffer is reused once the seal reading it is done. (The decode step's
        # time under eviction did not change measurably with it: docs/gpu.md, session 6 runs 6-8.)
        self._staging: _Staging | None = None  # the pending run's buffer
        self._staging_free: list[_Staging] = []
        self._staging_made = 0
        self._backlog_bytes = 0
        # the step loop's time blocked on the backlog cap: spills arriving faster than they are sealed
        self.backlog_waits = 0
        self.backlog_wait_s = 0.0
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.spill_linger_s = spill_linger_s
        seg_bytes = manager.max_segment_blocks * manager.block_bytes
        self._max_staging = max(1, min(MAX_STAGING_BUFFERS, device_backlog_bytes // seg_bytes))
        self._clock = clock
        self._run_since = 0.0  # when the pending run's first block was spilled
        # evicted blocks not yet handed down, deepest first: (tenant, block, bytes [1, B])
        # evicted blocks not yet handed down (data: a CPU copy; None when the block is in ``_staging``)
        self._run: list[tuple[TenantScope, EvictedBlock, torch.Tensor | None]] = []
        self._restoring: dict[str, tuple[list[int], Future[RestoreResult]]] = {}
        self._quotas: dict[bytes, tuple[int | None, int | None]] = {}  # last block quotas applied

    # ---- spilling ------------------------------------------------------------------------------
    def spill(self, tenant: TenantScope, block: EvictedBlock) -> None:
        if tenant.cipher is None:  # cannot be spilled: skip the copy out of HBM too
            self.manager.record_skip(SkipReason.NO_CIPHER, 1)
            return
        self._apply_quotas(tenant)
        if self._run:
            last = self._run[-1][1]
            # one segment = one chain run of one owner (the tenant charged for it) with one
            # retention status (its deadline is the run's)
            if (last.namespace != block.namespace or last.holder != block.holder or block.depth != last.depth - 1
                    or (last.retained_for_s > 0) != (block.retained_for_s > 0)
                    or len(self._run) >= self.manager.max_segment_blocks):
                self.flush_spills()
        if not self._run:
            self._run_since = self._clock()
        data: torch.Tensor | None = None
        if self.device_spill:
            assert isinstance(self.runner, GathersOnDevice)
            if self._staging is None:
                self._staging = self._take_staging()
            row = self.manager.max_segment_blocks - 1 - len(self._run)
            # in HBM, queued before the pool reuses the block
            self.runner.gather_blocks_into([block.block_id], self._staging.rows[row:row + 1])
        else:
            data = self.runner.export_blocks([block.block_id])  # [1, kv_bytes_per_block], a CPU copy
        self._run.append((tenant, block, data))

    def _take_staging(self) -> _Staging:
        """A free staging buffer: a returned one, a new one while fewer than the cap exist, else the
        oldest backlog entry's once its seal is done."""
        self._reap_backlog()
        if not self._staging_free and self._staging_made >= self._max_staging:
            self._pop_oldest()  # every buffer is being sealed: wait for the oldest
        if self._staging_free:
            return self._staging_free.pop()
        assert isinstance(self.runner, GathersOnDevice)
        self._staging_made += 1
        device = self.runner.kv_device
        rows = torch.empty(self.manager.max_segment_blocks, self.manager.block_bytes, dtype=torch.uint8, device=device)
        # blocking: a worker's host wait on it (DeviceKV.to_host) sleeps instead of polling the driver
        return _Staging(rows, torch.cuda.Event(blocking=True) if device.type == "cuda" else None)

    def _apply_quotas(self, tenant: TenantScope) -> None:
        quotas = (tenant.kv_block_quota_dram, tenant.kv_block_quota_nvme)
        key = tenant.tenant_key  # per tenant, whichever of its namespaces the block came from
        if self._quotas.get(key) == quotas:
            return
        self._quotas[key] = quotas
        policy = self.manager.tenant_policy(key)
        self.manager.set_tenant_policy(key, dataclasses.replace(
            policy, dram_blocks=quotas[0], nvme_blocks=quotas[1]))

    def flush_spills(self, *, due_only: bool = False) -> None:
        """Hand the pending run of evicted blocks to the manager (encrypt + store off-thread).

        ``due_only`` (nothing is about to look the tiers up) keeps a run that may still grow: under
        steady eviction a chain loses a block or two per step, and a seal per step costs the step
        loop a launch-and-submit and a tier worker's Python (which holds the GIL the step loop needs)
        for each; a run of a segment's blocks pays that once. Bounded by the segment size (``spill``
        hands a full run down) and by ``spill_linger_s``."""
        if not self._run:
            return
        if (due_only and len(self._run) < self.manager.max_segment_blocks
                and self._clock() - self._run_since < self.spill_linger_s):
            return
        run, self._run = self._run[::-1], []  # chain order: shallowest first
        hashes = [b.block_hash for _, b, _ in run]
        # the shortest retention left in the run, so no block is retained past its own deadline
        retain = min(b.retained_for_s for _, b, _ in run)
        if not self.device_spill:
            host = [d for _, _, d in run if d is not None]
            self.manager.demote(run[0][0], hashes, torch.cat(host) if len(host) > 1 else host[0], retain_for_s=retain)
            return
        staging, self._staging = self._staging, None
        assert staging is not None
        data = staging.rows[staging.rows.shape[0] - len(run):]  # the rows written, in chain order
        if staging.ready is not None:  # the sealer's stream waits for this point of the step loop's stream
            staging.ready.record(torch.cuda.current_stream(data.device))
        self._wait_backlog(data.numel())
        fut = self.manager.demote(run[0][0], hashes, DeviceKV(data, staging.ready), retain_for_s=retain)
        self._backlog.append((fut, data.numel(), staging))
        self._backlog_bytes += data.numel()

    @property
    def staging_buffers(self) -> int:
        """Device staging buffers made so far (at most the cap; each is reused after its seal)."""
        return self._staging_made

    @property
    def device_backlog(self) -> tuple[int, int]:
        """(runs, bytes) of device-resident spills handed to the manager, not yet known to be sealed."""
        return len(self._backlog), self._backlog_bytes

    def _reap_backlog(self) -> None:
        """Forget finished device demotions (their staging buffers are free again)."""
        while self._backlog and self._backlog[0][0].done():
            self._pop_oldest()

    def _wait_backlog(self, adding: int) -> None:
        """Forget finished device demotions; wait for the oldest while the backlog would pass its cap."""
        self._reap_backlog()
        while self._backlog and self._backlog_bytes + adding > self.device_backlog_bytes:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        """Wait for the oldest device demotion (counted when it is not done yet); free its buffer."""
        fut, n, staging = self._backlog.popleft()
        if not fut.done():
            self.backlog_waits += 1
            t0 = time.perf_counter()
            fut.exception()  # waits; a failure was logged by the manager
            self.backlog_wait_s += time.perf_counter() - t0
        self._backlog_bytes -= n
        self._staging_free.append(staging)

    # ---- restores ------------------------------------------------------------------------------
    def lookup(self, namespace: bytes, hashes: Sequence[BlockHash]) -> int:
        return self.manager.lookup(namespace, hashes).num_blocks

    def start_restore(self, request_id: str, tenant: TenantScope, hashes: Sequence[BlockHash],
                      block_ids: Sequence[int]) -> None:
        match = self.manager.lookup(tenant.namespace, hashes)  # in-memory; at most len(hashes) blocks
        self._restoring[request_id] = (list(block_ids), self.manager.restore(tenant, match))

    def cancel_restore(self, request_id: str) -> None:
        self._restoring.pop(request_id, None)  # the worker finishes; its bytes are never imported

    def finished_restores(self, timeout_s: float = 0.0) -> list[FinishedRestore]:
        futures = [f for _, f in self._restoring.values()]
        if timeout_s > 0 and futures and not any(f.done() for f in futures):
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)
        out = []
        for rid, (block_ids, fut) in list(self._restoring.items()):
            if not fut.done():
                continue
            del self._restoring[rid]
            try:
                n = self._import(block_ids, fut.result())
            except Exception:  # a tier failure is a miss: the request recomputes
                log.exception("kv tier restore failed for %s", rid)
                n = 0
            out.append(FinishedRestore(rid, n))
        return out

    def _import(self, block_ids: list[int], res: RestoreResult) -> int:
        n = res.num_blocks
        if n:
            bb = self.manager.block_bytes
            if isinstance(res.data, torch.Tensor):  # a GPU opener's output, already on the device
                data = res.data
            else:
                data = torch.frombuffer(bytearray(res.data), dtype=torch.uint8).view(n, bb)  # [n, bb]
                if self.pin_memory:
                    data = data.pin_memory()
            self.runner.import_blocks(block_ids[:n], data)
        return n

    def blocks_of(self, namespace: bytes) -> dict[str, int]:
        return self.manager.blocks_of(namespace)

    def stats(self) -> dict[str, Any]:
        return self.manager.stats()

    def blocks_by_tenant(self) -> dict[TierName, dict[str, int]]:
        return self.manager.blocks_by_tenant()

    def blocks_held(self, tenant_key: bytes) -> dict[str, int]:
        return self.manager.blocks_held(tenant_key)

    def close(self) -> None:
        self.flush_spills()
        self.manager.close()


def build_tier_hook(config: EngineConfig, runner: KVBlockIO, registry: CollectorRegistry | None = None,
                    **kwargs: Any) -> TierHook | None:
    """The composition root's one call: a ``TierHook`` sized by ``config.dram_bytes`` /
    ``nvme_dir`` / ``nvme_bytes``, or None when both tiers are off (or prefix caching is)."""
    if not config.enable_prefix_caching or (config.dram_bytes <= 0 and
                                            (config.nvme_dir is None or config.nvme_bytes <= 0)):
        return None
    if config.device.startswith("cuda") and torch.cuda.is_available() and "opener" not in kwargs:
        # KV sealed in HBM with ChaCha20-Poly1305 where the tenant's cipher can (engine.tiers.gpu_sealer),
        # opened in HBM on restore; other blobs (AES-GCM) are decrypted on CPU threads into pinned
        # memory (engine.tiers.gpu_opener)
        from engine.tiers.gpu_opener import DeviceAeadOpener
        from engine.tiers.gpu_sealer import DeviceSealer

        kwargs.update(opener=DeviceAeadOpener(config.device), device_seal=True, sealer=DeviceSealer(config.device))
    manager = TierManager.from_config(config, runner.kv_bytes_per_block, registry=registry, **kwargs)
    device_spill = manager.sealer is not None and isinstance(runner, GathersOnDevice)
    return TierHook(manager, runner, device_spill=device_spill)

