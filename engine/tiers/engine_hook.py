"""``TierHook``: joins the tiers to the engine's block pool, scheduler and model runner.

It implements the block pool's ``KVTierHook`` seam (``on_evict``, ``lookup``) and drives restores
from the step loop with one call, ``before_schedule(scheduler)``, made at the top of every step::

    step k    before_schedule: waiting request R matches 3 blocks in HBM, 5 more below HBM
                -> hold R's 3 HBM blocks, allocate 5 fresh ones, restore(...) on the tier pool,
                   scheduler.held[R] = "restoring"; R stays waiting, everybody else runs
    step k+j  before_schedule: the restore's future is done
                -> runner.import_blocks(5 fresh ids, plaintext); pool.register each under its hash
                   (the chain continues from R's HBM blocks); R is released
              schedule(): R's prefix match now finds 8 blocks in HBM: it is admitted with
                   8 * block_size cached tokens, and the hook drops its own hold afterwards.

Eviction: ``on_evict`` copies the victim's bytes out at once (the pool reuses the block right
after), and groups consecutive victims of one chain (tails are evicted before parents, so they
arrive deepest first) into one run, handed to ``TierManager.demote`` at the next flush point.

Runs on the engine's step-loop thread only (the manager's pool does the slow work).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.config import EngineConfig
from engine.prefix_index import max_cacheable_blocks
from engine.protocol import TenantScope
from engine.tiers.base import BlockHash
from engine.tiers.manager import RestoreResult, TierManager, TierMatch

log = logging.getLogger(__name__)

RESTORING = "restoring"  # the queue reason a held request shows (engine.request.QueueReason.RESTORING)


class KVBlockIO(Protocol):
    """What the hook needs of the model runner (``engine.model_runner.ModelRunner``)."""

    kv_bytes_per_block: int

    def export_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """uint8 CPU tensor [len(block_ids), kv_bytes_per_block], a copy of the blocks' KV."""
        ...

    def import_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Write uint8 [len(block_ids), kv_bytes_per_block] into the blocks."""
        ...


@dataclass
class _Restore:
    request: Any  # engine.request.Request
    hbm_ids: list[int]  # the request's HBM prefix, held so the allocation cannot evict it
    new_ids: list[int]  # fresh blocks the restored KV goes into
    match: TierMatch
    future: Any  # Future[RestoreResult]


class TierHook:
    """See the module docstring. ``manager`` owns the tiers; ``runner`` moves bytes in and out of HBM."""

    def __init__(self, manager: TierManager, runner: KVBlockIO, *, pin_memory: bool | None = None):
        if runner.kv_bytes_per_block != manager.block_bytes:
            raise ValueError(f"runner has {runner.kv_bytes_per_block} bytes per block, the tier manager "
                             f"{manager.block_bytes}")
        self.manager = manager
        self.runner = runner
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._tenants: dict[bytes, TenantScope] = {}
        self._run: list[tuple[Any, torch.Tensor]] = []  # evicted (EvictedBlock, bytes [1, B]), deepest first
        self._restoring: dict[str, _Restore] = {}
        self._holding: dict[str, tuple[Any, list[int]]] = {}  # request id -> (request, block ids held)
        self._checked: set[tuple[str, int]] = set()  # (request id, preemptions) already looked up
        self.restored_blocks = 0
        self.idle_wait_s = 0.05  # longest a step with nothing else to run blocks on a restore

    # ---- KVTierHook ----------------------------------------------------------------------------
    def on_evict(self, block: Any) -> None:
        """``block``: ``engine.block_pool.EvictedBlock`` (block_hash, namespace, depth, block_id)."""
        tenant = self._tenants.get(block.namespace)
        if tenant is None or tenant.cipher is None:  # cannot be spilled: skip the copy out of HBM too
            self.manager.record_skip("unknown_tenant" if tenant is None else "no_cipher", 1)
            return
        data = self.runner.export_blocks([block.block_id])  # [1, kv_bytes_per_block], a CPU copy
        if self._run:
            last = self._run[-1][0]
            if (last.namespace != block.namespace or block.depth != last.depth - 1
                    or len(self._run) >= self.manager.max_segment_blocks):
                self.flush_evictions()
        self._run.append((block, data))

    def lookup(self, namespace: bytes, block_hashes: Sequence[BlockHash]) -> int:
        return self.manager.lookup(namespace, block_hashes).num_blocks

    def flush_evictions(self) -> None:
        """Hand the pending run of evicted blocks to the manager (encrypt + store off-thread)."""
        if not self._run:
            return
        run, self._run = self._run[::-1], []  # chain order: shallowest first
        ns = run[0][0].namespace
        tenant = self._tenants[ns]  # on_evict only queues blocks of known tenants
        hashes = [bytes(b.block_hash) for b, _ in run]
        data = torch.cat([d for _, d in run]) if len(run) > 1 else run[0][1]
        self.manager.demote(tenant, hashes, data)

    # ---- restores, driven by the step loop -----------------------------------------------------
    def before_schedule(self, scheduler: Any) -> None:
        """Call at the top of every step, before ``scheduler.schedule()``."""
        self.flush_evictions()
        for req in scheduler.running:
            self._tenants[req.namespace] = req.tenant
        waiting: set[str] = set()
        for queue in scheduler.waiting.values():
            for req in queue:
                self._tenants[req.namespace] = req.tenant
                waiting.add(req.request_id)
        self._checked = {k for k in self._checked if k[0] in waiting}  # forget admitted / finished ones
        self._release_holds(scheduler, waiting)
        self._finish_restores(scheduler)
        if self.manager.enabled and scheduler.pool.enable_caching:
            self._start_restores(scheduler)
        self.flush_evictions()  # allocations for restores may have evicted blocks
        if self._restoring and not scheduler.running and self._all_waiting_held(scheduler):
            # Nothing else could run this step: wait for a restore instead of spinning empty steps
            # (which would also compete with the decrypting worker for the GIL).
            wait([r.future for r in self._restoring.values()], timeout=self.idle_wait_s,
                 return_when=FIRST_COMPLETED)
            self._finish_restores(scheduler)

    @staticmethod
    def _all_waiting_held(scheduler: Any) -> bool:
        return all(r.request_id in scheduler.held for q in scheduler.waiting.values() for r in q)

    def held_block_tables(self) -> list[list[int]]:
        """Block references the hook holds (add them to ``BlockPool.check_integrity``'s tables)."""
        tables = [r.hbm_ids + r.new_ids for r in self._restoring.values()]
        return tables + [ids for _, ids in self._holding.values()]

    def _start_restores(self, scheduler: Any) -> None:
        pool = scheduler.pool
        for queue in list(scheduler.waiting.values()):
            for req in list(queue):
                key = (req.request_id, req.num_preemptions)
                if req.request_id in self._restoring or req.request_id in self._holding or key in self._checked:
                    continue
                self._checked.add(key)
                hbm = pool.index.match_hashes(req.block_hashes, req.num_tokens)
                limit = max_cacheable_blocks(req.num_tokens, pool.block_size)
                match = self.manager.lookup(req.namespace, req.block_hashes[hbm.num_blocks:limit])
                if match.num_blocks == 0:
                    continue
                revived = sum(1 for b in hbm.block_ids if pool.blocks[b].ref_cnt == 0)
                quota = req.tenant.kv_block_quota
                if quota is not None and pool.used_by(req.namespace) + revived + match.num_blocks > quota:
                    continue
                if revived + match.num_blocks > pool.num_free:
                    self._checked.discard(key)  # no room now; try again next step
                    continue
                hbm_ids = list(hbm.block_ids)
                pool.touch(hbm_ids, req.namespace)
                new_ids = pool.allocate(match.num_blocks, req.namespace)
                assert new_ids is not None  # num_free was checked and touch only took evictable ones
                fut = self.manager.restore(req.tenant, match)
                self._restoring[req.request_id] = _Restore(req, hbm_ids, new_ids, match, fut)
                scheduler.held[req.request_id] = RESTORING

    def _finish_restores(self, scheduler: Any) -> None:
        pool = scheduler.pool
        for rid, r in list(self._restoring.items()):
            if r.request.is_finished:  # aborted while restoring: the bytes are not needed
                del self._restoring[rid]
                scheduler.held.pop(rid, None)
                pool.free(r.hbm_ids + r.new_ids)
                continue
            if not r.future.done():
                continue
            del self._restoring[rid]
            scheduler.held.pop(rid, None)
            try:
                res: RestoreResult = r.future.result()
            except Exception:  # a tier failure is a miss: the request recomputes
                log.exception("kv tier restore failed for %s", rid)
                res = RestoreResult(0, b"", (), {}, 0.0)
            n = res.num_blocks
            kept = list(r.hbm_ids)
            if n:
                bb = self.manager.block_bytes
                data = torch.frombuffer(bytearray(res.data), dtype=torch.uint8).view(n, bb)  # [n, bb]
                if self.pin_memory:
                    data = data.pin_memory()
                self.runner.import_blocks(r.new_ids[:n], data)
                parent = r.hbm_ids[-1] if r.hbm_ids else None
                depth0 = len(r.hbm_ids)
                for i in range(n):
                    bid = pool.register(r.new_ids[i], res.hashes[i], depth0 + i, parent)
                    kept.append(bid)  # bid != new id when the hash reappeared meanwhile: our ref moved
                    parent = bid
                self.restored_blocks += n
            if r.new_ids[n:]:
                pool.free(r.new_ids[n:])  # blocks whose restore failed: recomputed instead
            if kept:
                self._holding[rid] = (r.request, kept)

    def _release_holds(self, scheduler: Any, waiting: set[str]) -> None:
        """Drop the hook's references once the request has taken its own (admitted) or ended.
        ``waiting``: ids of the requests now waiting."""
        for rid, (req, ids) in list(self._holding.items()):
            if req.is_finished or req.block_table or rid not in waiting:
                del self._holding[rid]
                scheduler.pool.free(ids)

    def blocks_of(self, namespace: bytes) -> dict[str, int]:
        return self.manager.blocks_of(namespace)

    def stats(self) -> dict[str, Any]:
        out = self.manager.stats()
        out["restoring"] = len(self._restoring)
        out["restored_blocks"] = self.restored_blocks
        return out

    def close(self) -> None:
        self.flush_evictions()
        self.manager.close()


def build_tier_hook(config: EngineConfig, runner: KVBlockIO, registry: Any = None, **kwargs: Any) -> TierHook | None:
    """The composition root's one call: a ``TierHook`` sized by ``config.dram_bytes`` /
    ``nvme_dir`` / ``nvme_bytes``, or None when both tiers are off (or prefix caching is)."""
    if not config.enable_prefix_caching or (config.dram_bytes <= 0 and
                                            (config.nvme_dir is None or config.nvme_bytes <= 0)):
        return None
    manager = TierManager.from_config(config, runner.kv_bytes_per_block, registry=registry, **kwargs)
    return TierHook(manager, runner)

