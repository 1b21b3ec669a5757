"""``TierManager``: the engine's one handle on the tiers below HBM.

What the engine calls, and from where::

    step loop, when the block pool evicts indexed blocks:
        data = runner.export_blocks(ids)            # uint8 [N, block_bytes], a CPU copy
        tiers.demote(tenant, hashes, data)          # returns at once; encrypt + put on the pool
    scheduler, admitting a request whose HBM match stopped at block k:
        match = tiers.lookup(namespace, hashes[k:]) # in-memory maps only: no I/O, no crypto
        fut = tiers.restore(tenant, match)          # read + decrypt on the pool
        ... request waits with reason "restoring"; other requests keep stepping ...
        res = fut.result()                          # res.data: res.num_blocks leading blocks
        runner.import_blocks(new_ids, res.data)     # then prefill continues after them

Demotion path of one run of blocks (HBM eviction)::

    encrypt(run) ──► DRAM ──(DRAM evicts it to make room)──► NVMe ──(evicted)──► dropped
         │              └─ refused (quota / too large) ──► NVMe
         └─ tenant has no cipher ──► dropped (never written in clear)

At each step the cost model may say recomputing is cheaper than restoring from the next tier: the
run is then dropped instead. Blobs move between tiers as they are (the AAD names no tier), so a
block is encrypted once when it leaves HBM and decrypted once when it returns.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from engine.kv_types import BlockHash, TierName
from engine.protocol import TenantScope
from engine.tiers.base import BlockLocation, SegmentMeta, SkipReason, TenantCap, TierWriteError
from engine.tiers.codec import FORMAT_VERSION, segment_aad
from engine.tiers.cost import CostModel, TierRates
from engine.tiers.device_aead import DevicePlaintext, DeviceSealingCipher, SegmentSealer
from engine.tiers.dram import DramTier, PinnedBlob
from engine.tiers.metrics import TierMetrics
from engine.tiers.nvme import NvmeTier
from engine.tiers.opener import HostOpener, SealedRun, SegmentOpener

if TYPE_CHECKING:
    from typing import TypeAlias

    import torch

    # a run's plaintext on the host: bytes, or the runner's CPU export ``[N, block_bytes]`` uint8
    HostKV: TypeAlias = bytes | bytearray | memoryview | torch.Tensor

log = logging.getLogger(__name__)

PENDING = "pending"  # a TierMatch tier for blocks whose demotion is still in flight
_NOWHERE = BlockLocation("", -1)


@dataclass(frozen=True)
class TenantTierPolicy:
    """Per-tenant limits below HBM. ``None`` = the manager's default.

    ttl_s: spilled blocks are deleted this long after they left HBM (retention limit).
    dram_bytes / nvme_bytes: most bytes this tenant may hold in each tier (a hard cap, on top of
        the fair-share floor that protects every tenant from the others).
    dram_blocks / nvme_blocks: most KV blocks it may hold in each tier (``TenantScope``'s
        ``kv_block_quota_dram`` / ``kv_block_quota_nvme``); over it, its own oldest go first.
    """

    ttl_s: float | None = None
    dram_bytes: int | None = None
    nvme_bytes: int | None = None
    dram_blocks: int | None = None
    nvme_blocks: int | None = None

    def __post_init__(self) -> None:
        for name in ("ttl_s", "dram_bytes", "nvme_bytes", "dram_blocks", "nvme_blocks"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"{name} must be >= 0")


_DEFAULT_POLICY = TenantTierPolicy()


@dataclass(frozen=True)
class TierMatch:
    """The leading blocks of a hash chain found below HBM, and where each one is.

    ``tiers[i]`` is "dram", "nvme", or "pending" (its demotion is still being encrypted and
    stored: ``restore`` waits for it).
    """

    namespace: bytes
    hashes: tuple[BlockHash, ...] = ()
    tiers: tuple[str, ...] = ()
    locations: tuple[BlockLocation, ...] = field(default=(), repr=False)

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    def blocks_in(self, tier: str) -> int:
        return sum(t == tier for t in self.tiers)


@dataclass(frozen=True)
class RestoreResult:
    """``data`` holds the plaintext of the first ``num_blocks`` blocks of the match, in chain order
    (``num_blocks * block_bytes`` bytes): ``bytes`` from the CPU opener, a uint8 device tensor
    ``[num_blocks, block_bytes]`` from the GPU ones. Fewer than asked when a segment failed
    authentication or vanished meanwhile: the caller recomputes the rest."""

    num_blocks: int
    data: bytes | torch.Tensor
    hashes: tuple[BlockHash, ...]
    blocks_by_tier: dict[str, int]
    seconds: float


@dataclass(frozen=True)
class DemoteReport:
    """What happened to one ``demote`` call's blocks (for tests and logs)."""

    stored: dict[str, int] = field(default_factory=dict)  # tier -> blocks written
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> blocks not written


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)[:80] or "model"


class TierManager:
    """Owns the DRAM and NVMe tiers, the worker pool, the cost model and the tier metrics.

    Thread-safety: every public method may be called from any thread. ``demote`` and ``restore``
    return futures; ``lookup`` and ``stats`` are synchronous and do no I/O.
    """

    def __init__(
        self,
        *,
        model_id: str,
        block_size: int,
        block_bytes: int,
        dram_bytes: int = 0,
        nvme_dir: Path | None = None,
        nvme_bytes: int = 0,
        rates: TierRates | None = None,
        max_segment_blocks: int = 32,
        floor_fraction: float = 1.0,
        max_tenant_fraction: float = 1.0,
        default_ttl_s: float | None = None,
        registry: CollectorRegistry | None = None,
        max_workers: int = 2,
        pin_memory: bool | None = None,
        clock: Callable[[], float] = time.time,
        sweep_interval_s: float = 1.0,
        opener: SegmentOpener | None = None,
        device_seal: bool = False,
        sealer: SegmentSealer | None = None,
    ):
        """``opener`` turns a restore's sealed segments into plaintext (default ``HostOpener``: CPU,
        ``bytes``); ``device_seal`` seals with ChaCha20-Poly1305 (``encrypt_for_device``) where the
        tenant's cipher can, so that a ``DeviceAeadOpener`` opens them on the GPU; ``sealer`` seals
        plaintext that ``demote`` gets still in device memory (``DevicePlaintext``) on the device,
        with the same AEAD and blob layout (``engine.tiers.gpu_sealer.DeviceSealer``)."""
        if block_bytes <= 0 or block_size <= 0 or max_segment_blocks <= 0:
            raise ValueError("block_size, block_bytes and max_segment_blocks must be > 0")
        if not 0.0 < max_tenant_fraction <= 1.0:
            raise ValueError("max_tenant_fraction must be in (0, 1]")
        if nvme_bytes > 0 and nvme_dir is None:
            raise ValueError("nvme_bytes > 0 needs nvme_dir")
        self.model_id = model_id
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.max_segment_blocks = max_segment_blocks
        self.default_ttl_s = default_ttl_s
        self.max_tenant_fraction = max_tenant_fraction
        self.cost = CostModel(rates or TierRates(), block_size)
        self.metrics = TierMetrics(registry if registry is not None else CollectorRegistry())
        self._clock = clock
        self._policies: dict[bytes, TenantTierPolicy] = {}
        self.dram: DramTier | None = None
        self.nvme: NvmeTier | None = None
        if dram_bytes > 0:
            # page-locked room for the segments in flight: one per worker sealing, one being stored
            in_flight = (max_workers + 1) * max_segment_blocks * block_bytes
            self.dram = DramTier(dram_bytes, pin_memory=pin_memory, score=self.cost.score_fn("dram"),
                                 tenant_cap=self._cap_fn(TierName.DRAM, dram_bytes), floor_fraction=floor_fraction,
                                 clock=clock, arena_slack_bytes=max(in_flight, dram_bytes // 16))
        if nvme_bytes > 0:
            assert nvme_dir is not None  # refused above
            root = Path(nvme_dir) / f"kv-v{FORMAT_VERSION}" / _slug(model_id)
            self.nvme = NvmeTier(root, nvme_bytes, score=self.cost.score_fn("nvme"),
                                 tenant_cap=self._cap_fn(TierName.NVME, nvme_bytes), floor_fraction=floor_fraction,
                                 clock=clock)
        if self.nvme is not None:  # start-up's findings: a counted miss each, never a failed start
            d = self.nvme.damage
            for kind, n in (("index_reset", d.index_reset), ("bad_rows", d.bad_rows), ("junk_entries", d.junk_entries)):
                self.metrics.nvme_damage.labels(kind).inc(n)
        segment_bytes = max_segment_blocks * block_bytes
        for tier in self.tiers:
            if tier.capacity_bytes < segment_bytes:
                # spills go in runs of up to max_segment_blocks: a tier smaller than one refuses
                # most of them ("too_large"), which would otherwise show only as skipped spills
                log.warning("the %s KV tier (%d MiB) is smaller than one spill segment (%d blocks, %d MiB): "
                            "most spills will be refused as too large; give it at least a few segments",
                            tier.name, tier.capacity_bytes >> 20, max_segment_blocks, -(-segment_bytes >> 20))
            self.metrics.capacity.labels(tier.name).set(tier.capacity_bytes)
            self.metrics.bytes_used.labels(tier.name).set(tier.used_bytes)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kv-tier")
        self._pending: set[Future] = set()
        # (namespace, hash) -> the demotion carrying it: a lookup right after an eviction finds the
        # block "pending" and the restore waits for that demotion instead of missing.
        self._inflight: dict[tuple[bytes, BlockHash], Future] = {}
        self._pending_lock = threading.Lock()
        self._sweep_interval_s = sweep_interval_s
        self._last_sweep_s = 0.0
        self.opener: SegmentOpener = opener if opener is not None else HostOpener()
        self.device_seal = device_seal
        self.sealer = sealer

    @classmethod
    def from_config(cls, config: EngineConfig, block_bytes: int, **kwargs: Any) -> TierManager:
        """Sizes from ``EngineConfig.dram_bytes`` / ``nvme_dir`` / ``nvme_bytes``."""
        return cls(model_id=config.resolved_model_id, block_size=config.block_size, block_bytes=block_bytes,
                   dram_bytes=config.dram_bytes, nvme_dir=config.nvme_dir,
                   nvme_bytes=config.nvme_bytes if config.nvme_dir is not None else 0, **kwargs)

    @property
    def tiers(self) -> list[DramTier | NvmeTier]:
        return [t for t in (self.dram, self.nvme) if t is not None]

    def blocks_of(self, namespace: bytes) -> dict[str, int]:
        """Blocks held for ``namespace``, per lower tier (``{"dram": n, "nvme": m}`` for the enabled ones)."""
        return {t.name: t.blocks_of(namespace) for t in self.tiers}

    @property
    def enabled(self) -> bool:
        return bool(self.tiers)

    def set_tenant_policy(self, tenant_key: bytes, policy: TenantTierPolicy) -> None:
        """``policy`` for the tenant ``tenant_key`` (``TenantScope.tenant_key``): its caps hold
        across all its namespaces."""
        self._policies[tenant_key] = policy

    def tenant_policy(self, tenant_key: bytes) -> TenantTierPolicy:
        return self._policies.get(tenant_key, _DEFAULT_POLICY)

    def _cap_fn(self, tier: TierName, capacity: int) -> Callable[[bytes], TenantCap]:
        share = int(capacity * self.max_tenant_fraction)

        def cap(owner: bytes) -> TenantCap:
            p = self.tenant_policy(owner)
            explicit = p.dram_bytes if tier is TierName.DRAM else p.nvme_bytes
            return TenantCap(share if explicit is None else min(share, explicit), self._block_cap(tier, owner))

        return cap

    def _block_cap(self, tier: TierName, tenant_key: bytes) -> int | None:
        p = self.tenant_policy(tenant_key)
        return p.dram_blocks if tier is TierName.DRAM else p.nvme_blocks

    def _ttl(self, tenant_key: bytes) -> float | None:
        p = self._policies.get(tenant_key)
        return self.default_ttl_s if p is None or p.ttl_s is None else p.ttl_s

    # ---- demotion ------------------------------------------------------------------------------
    def demote(self, tenant: TenantScope, hashes: Sequence[BlockHash], data: HostKV | DevicePlaintext,
               retain_for_s: float = 0.0) -> Future[DemoteReport]:
        """Spill a run of consecutive blocks of one hash chain; returns at once.

        Args:
            tenant: the blocks' owner; its ``cipher`` encrypts them (``None``: they are dropped),
                its ``namespace`` keys them, its ``tenant_key`` is charged for them (caps, quotas).
            hashes: the run's block hashes, in chain order.
            data: the run's plaintext KV, ``len(hashes) * block_bytes`` bytes: ``bytes``, a
                ``memoryview``, a CPU uint8 tensor ``[N, block_bytes]`` (the runner's export), or
                ``DevicePlaintext`` (still in HBM: sealed there by ``sealer``, or copied to the
                host on the worker for a cipher the device cannot seal with).
                It must not be written to afterwards: the worker reads it later.
            retain_for_s: seconds left of the run's explicit retention in HBM (0 = none). The
                tiers then evict it only after unretained segments until that time, it is kept
                even where the cost model would drop it, and copies of these blocks already in a
                tier are retained as long.
        """
        view: _Plain
        if isinstance(data, DevicePlaintext):
            view = data
            if data.num_blocks != len(hashes):
                raise ValueError(f"data has {data.num_blocks} blocks, expected {len(hashes)}")
        else:
            view = _as_bytes_view(data)
            if len(view) != len(hashes) * self.block_bytes:
                raise ValueError(f"data has {len(view)} bytes, expected {len(hashes)} x {self.block_bytes}")
        hashes = tuple(hashes)
        with self._pending_lock:  # held across submit so _done cannot run before registration
            until = self._clock() + retain_for_s if retain_for_s > 0 else None
            fut = self._pool.submit(self._demote, tenant, hashes, view, data, until)
            self._pending.add(fut)
            for h in hashes:
                self._inflight[(tenant.namespace, h)] = fut
        fut.add_done_callback(lambda f: self._done(f, tenant.namespace, hashes))
        return fut

    def _done(self, fut: Future, namespace: bytes, hashes: tuple[BlockHash, ...]) -> None:
        with self._pending_lock:
            self._pending.discard(fut)
            for h in hashes:
                if self._inflight.get((namespace, h)) is fut:
                    del self._inflight[(namespace, h)]
        if not fut.cancelled() and fut.exception() is not None:
            log.error("tier demotion failed", exc_info=fut.exception())

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every demotion submitted so far has finished (tests, shutdown)."""
        with self._pending_lock:
            pending = list(self._pending)
        for fut in pending:
            fut.exception(timeout=timeout)

    def _demote(self, tenant: TenantScope, hashes: tuple[BlockHash, ...], view: _Plain,
                keepalive: HostKV | DevicePlaintext, retain_until_s: float | None = None) -> DemoteReport:
        del keepalive  # held by the closure only so the exporter's buffer outlives the view
        self._maybe_sweep()
        report = DemoteReport()
        try:
            self._demote_runs(tenant, hashes, view, retain_until_s, report)
        finally:
            if retain_until_s is not None and tenant.cipher is not None:
                # copies stored by an earlier spill (skipped as present, or cascaded) keep them too
                for tier in self.tiers:
                    tier.retain(tenant.namespace, hashes, retain_until_s)
        return report

    def _demote_runs(self, tenant: TenantScope, hashes: tuple[BlockHash, ...], view: _Plain,
                     retain_until_s: float | None, report: DemoteReport) -> None:
        first = self.tiers[0].name if self.tiers else None
        if first is None:
            return
        cipher = tenant.cipher
        if cipher is None:
            self._skip(report, first, SkipReason.NO_CIPHER, len(hashes))
            return
        ns = tenant.namespace
        # Blocks already in the first tier need no second copy; store the runs in between.
        i, n = 0, len(hashes)
        while i < n:
            if self.tiers[0].contains(ns, hashes[i]) is not None:
                self._skip(report, first, SkipReason.PRESENT, 1)
                i += 1
                continue
            j = i
            while j < n and j - i < self.max_segment_blocks and self.tiers[0].contains(ns, hashes[j]) is None:
                j += 1
            self._demote_run(tenant, hashes[i:j], self._rows(view, i, j), retain_until_s, report)
            i = j

    def _rows(self, plain: _Plain, first: int, stop: int) -> _Plain:
        """Blocks ``first .. stop - 1`` of a run's plaintext (a view)."""
        if isinstance(plain, memoryview):
            return plain[first * self.block_bytes:stop * self.block_bytes]
        return plain.rows(first, stop)

    def _demote_run(self, tenant: TenantScope, hashes: tuple[BlockHash, ...], plain: _Plain,
                     retain_until_s: float | None, report: DemoteReport) -> None:
        approx = len(hashes) * self.block_bytes + 28  # nonce + tag of AES-GCM; only used for the cost estimate
        # A retained run is kept wherever it fits: the client asked for these blocks to stay cached.
        targets = [t for t in self.tiers
                   if retain_until_s is not None or self.cost.worth_keeping(t.name, len(hashes), approx)]
        if not targets:
            self._skip(report, self.tiers[0].name, SkipReason.COST, len(hashes))
            return
        for tier in targets:
            cap = self._block_cap(tier.name, tenant.tenant_key)
            if cap is not None and cap < len(hashes):
                # More blocks than the tenant may keep here: its leading ones (a match needs them
                # first) stay in this tier, the rest go on to the next one.
                if cap > 0:
                    self._put(tier, self._seal(tenant, hashes[:cap], self._rows(plain, 0, cap), retain_until_s),
                              report)
                hashes, plain = hashes[cap:], self._rows(plain, cap, len(hashes))
                if tier is targets[-1]:  # no tier left for the rest
                    self._skip(report, tier.name, SkipReason.QUOTA, len(hashes))
                continue
            if self._put(tier, self._seal(tenant, hashes, plain, retain_until_s), report):
                return

    def _seal(self, tenant: TenantScope, hashes: tuple[BlockHash, ...], plain: _Plain,
              retain_until_s: float | None = None) -> tuple[SegmentMeta, bytes | PinnedBlob]:
        """Encrypt a run of blocks as one segment."""
        ns = tenant.namespace
        cipher = tenant.cipher
        assert cipher is not None
        aad = segment_aad(ns, self.model_id, hashes, self.block_bytes)
        blob: bytes | PinnedBlob
        device_key = cipher.device_key() if self.device_seal and isinstance(cipher, DeviceSealingCipher) else None
        if isinstance(plain, DevicePlaintext) and device_key is not None and self.sealer is not None:
            # sealed in HBM; the ciphertext crosses the link into the DRAM tier's page-locked arena
            blob = self.sealer.seal(device_key, plain, aad, self.dram.host_buffer if self.dram is not None else None)
        else:
            # host plaintext, or device plaintext under a cipher the GPU cannot seal with (AES-GCM
            # only, or a destroyed key: encrypt_for_device then seals under a one-time key)
            host = plain.to_host() if isinstance(plain, DevicePlaintext) else plain
            if self.device_seal and isinstance(cipher, DeviceSealingCipher):
                blob = cipher.encrypt_for_device(host, aad)  # opened in HBM on restore
            else:
                blob = cipher.encrypt(host, aad)
        now = self._clock()
        ttl = self._ttl(tenant.tenant_key)
        meta = SegmentMeta(uuid.uuid4().hex, ns, tenant.metrics_label, hashes, self.block_bytes, len(blob),
                           now, now, None if ttl is None else now + ttl, retain_until_s=retain_until_s,
                           owner=tenant.tenant_key)
        return meta, blob

    def _put(self, tier: DramTier | NvmeTier, sealed: tuple[SegmentMeta, bytes | memoryview | PinnedBlob],
             report: DemoteReport) -> bool:
        """Store one segment in ``tier``, cascading what it evicts downwards. True if stored."""
        meta, blob = sealed
        try:
            # DRAM keeps a device sealer's pinned buffer as it is; NVMe writes its bytes
            if isinstance(tier, DramTier):
                res = tier.put(meta, blob)
            else:
                res = tier.put(meta, blob.view() if isinstance(blob, PinnedBlob) else blob)
        except TierWriteError as exc:
            log.warning("kv tier %s: demotion skipped: %s", tier.name, exc)
            self._skip(report, tier.name, SkipReason.IO_ERROR, meta.num_blocks)
            return False
        if not res.stored:
            self._skip(report, tier.name, SkipReason(res.reason or SkipReason.FULL), meta.num_blocks)
            return False
        report.stored[tier.name] = report.stored.get(tier.name, 0) + meta.num_blocks
        self.metrics.demotions.labels(tier.name, meta.tenant_label).inc(meta.num_blocks)
        self.metrics.demoted_bytes.labels(tier.name).inc(meta.nbytes)
        for old, old_blob in res.evicted:
            if not self._cascade(tier, old, old_blob, report):
                self.metrics.drops.labels(tier.name, "evicted").inc(old.num_blocks)
        self.metrics.bytes_used.labels(tier.name).set(tier.used_bytes)
        return True

    def _cascade(self, src: DramTier | NvmeTier, meta: SegmentMeta, blob: bytes | memoryview | None,
                 report: DemoteReport) -> bool:
        """Move a segment DRAM evicted down to NVMe, if worth it. True if it now lives there."""
        if src is not self.dram or blob is None or self.nvme is None or meta.expired(self._clock()):
            return False
        if all(self.nvme.contains(meta.namespace, h) is not None for h in meta.hashes):
            return True  # already there from an earlier spill
        if not meta.retained(self._clock()) and not self.cost.worth_keeping(TierName.NVME, meta.num_blocks, meta.nbytes):
            self._skip(report, TierName.NVME, SkipReason.COST, meta.num_blocks)
            return False
        moved = dataclasses.replace(meta, segment_id=uuid.uuid4().hex)
        return self._put(self.nvme, (moved, blob), report)

    def record_skip(self, reason: SkipReason, blocks: int) -> None:
        """Count blocks the caller dropped before reaching ``demote`` (e.g. no known tenant)."""
        if self.tiers:
            self.metrics.skipped.labels(self.tiers[0].name, reason).inc(blocks)

    def _skip(self, report: DemoteReport, tier: str, reason: SkipReason, blocks: int) -> None:
        report.skipped[reason] = report.skipped.get(reason, 0) + blocks
        self.metrics.skipped.labels(tier, reason).inc(blocks)

    # ---- lookup and restore --------------------------------------------------------------------
    def lookup(self, namespace: bytes, hashes: Sequence[BlockHash]) -> TierMatch:
        """How many leading ``hashes`` are held below HBM, and in which tier each one is.

        Pass the chain from the first block HBM did not have. No I/O, no crypto: in-memory maps
        only, so the scheduler may call it on every admission attempt.
        """
        self._maybe_sweep()
        found_h: list[BlockHash] = []
        found_t: list[str] = []  # TierMatch.tiers: a TierName or PENDING
        found_l: list[BlockLocation] = []
        for h in hashes:
            for tier in self.tiers:
                loc = tier.contains(namespace, h)
                if loc is not None:
                    found_h.append(h)
                    found_t.append(tier.name)
                    found_l.append(loc)
                    break
            else:
                with self._pending_lock:
                    pending = (namespace, h) in self._inflight
                if not pending:
                    break
                found_h.append(h)
                found_t.append(PENDING)
                found_l.append(_NOWHERE)
        return TierMatch(namespace, tuple(found_h), tuple(found_t), tuple(found_l))

    def restore(self, tenant: TenantScope, match: TierMatch) -> Future[RestoreResult]:
        """Read and decrypt the blocks of ``match`` on the worker pool.

        The result holds the longest leading part that authenticated; a segment whose tag fails
        is counted (``auth_failures``), deleted from its tier, and ends the restore there.
        """
        if match.namespace != tenant.namespace:
            raise ValueError("the match belongs to another namespace than the tenant")
        for t in (TierName.DRAM, TierName.NVME):
            if match.blocks_in(t):
                self.metrics.hits.labels(t, tenant.metrics_label).inc(match.blocks_in(t))
        return self._pool.submit(self._restore, tenant, match)

    def _restore(self, tenant: TenantScope, match: TierMatch) -> RestoreResult:
        t0 = time.perf_counter()
        if match.blocks_in(PENDING):
            # Wait for the demotions that carry them (queued before this task, so no deadlock),
            # then look again: they may have been stored, or dropped by the cost/quota rules.
            with self._pending_lock:
                futs = {self._inflight.get((match.namespace, h)) for h in match.hashes}
            for fut in futs:
                if fut is not None:
                    fut.exception()
            match = self.lookup(match.namespace, match.hashes)
        # Read every segment the match touches first, then open them in one call (the GPU opener
        # batches and pipelines them); a segment gone since the lookup ends the restore there.
        bb, i, n = self.block_bytes, 0, match.num_blocks
        cipher = tenant.cipher
        s0 = time.perf_counter()
        runs: list[SealedRun] = []
        sources: list[tuple[DramTier | NvmeTier, SegmentMeta, int]] = []  # (tier, meta, blob bytes) per run
        while i < n and cipher is not None and match.tiers[i] != PENDING:
            tier = self.dram if match.tiers[i] == TierName.DRAM else self.nvme
            sid, pos = match.locations[i].segment_id, match.locations[i].position
            j = i + 1  # the run of blocks this segment serves, positions consecutive
            while (j < n and match.tiers[j] == match.tiers[i] and match.locations[j].segment_id == sid
                   and match.locations[j].position == pos + (j - i)):
                j += 1
            got = tier.get(sid) if tier is not None else None
            if tier is None or got is None or got[0].namespace != tenant.namespace:
                break  # evicted or expired since the lookup: recompute from here
            meta, blob = got
            runs.append(SealedRun(blob, segment_aad(meta.namespace, self.model_id, meta.hashes, meta.block_bytes),
                                  meta.num_blocks, pos, j - i))
            sources.append((tier, meta, len(blob)))
            i = j
        if not runs:
            return RestoreResult(0, b"", (), {}, time.perf_counter() - t0)
        assert cipher is not None
        opened = self.opener.open_runs(cipher, runs, bb)
        per_run_s = (time.perf_counter() - s0) / len(runs)  # read + open, spread over the segments
        by_tier: dict[str, int] = {}
        restored = 0
        for (tier, _, nbytes), run in zip(sources[:opened.ok], runs, strict=False):
            self.metrics.restore_seconds.labels(tier.name).observe(per_run_s)
            self.metrics.restores.labels(tier.name, tenant.metrics_label).inc(run.count)
            self.metrics.restore_bytes.labels(tier.name, tenant.metrics_label).inc(nbytes)
            by_tier[tier.name] = by_tier.get(tier.name, 0) + run.count
            restored += run.count
        if opened.ok < len(runs):
            tier, meta, _ = sources[opened.ok]
            self.metrics.auth_failures.labels(tier.name, tenant.metrics_label).inc()
            if tier.evict(meta.segment_id) is not None:
                self.metrics.drops.labels(tier.name, "auth_failure").inc(meta.num_blocks)
                self.metrics.bytes_used.labels(tier.name).set(tier.used_bytes)
            log.warning("kv tier %s: segment %s failed authentication; dropped", tier.name, meta.segment_id)
        return RestoreResult(restored, opened.data, match.hashes[:restored], by_tier, time.perf_counter() - t0)

    # ---- retention -----------------------------------------------------------------------------
    def _maybe_sweep(self) -> None:
        now = self._clock()
        if now - self._last_sweep_s >= self._sweep_interval_s:
            self._last_sweep_s = now
            self.sweep_expired()

    def sweep_expired(self) -> int:
        """Delete every segment past its tenant's TTL. Returns the number of blocks deleted.
        (Lookups never return an expired block even before the sweep has run.)"""
        now, dropped = self._clock(), 0
        for tier in self.tiers:
            for sid in tier.expired_segments(now):
                gone = tier.evict(sid)
                if gone is not None:
                    dropped += gone[0].num_blocks
                    self.metrics.drops.labels(tier.name, "ttl").inc(gone[0].num_blocks)
            self.metrics.bytes_used.labels(tier.name).set(tier.used_bytes)
        return dropped

    def delete_tenant(self, namespace: bytes) -> int:
        """Delete every block of ``namespace`` in every tier. Returns the blocks deleted."""
        dropped = 0
        for tier in self.tiers:
            for sid in tier.segments_of(namespace):
                gone = tier.evict(sid)
                if gone is not None:
                    dropped += gone[0].num_blocks
                    self.metrics.drops.labels(tier.name, "tenant_deleted").inc(gone[0].num_blocks)
            self.metrics.bytes_used.labels(tier.name).set(tier.used_bytes)
        return dropped

    # ---- introspection -------------------------------------------------------------------------
    def blocks_held(self, tenant_key: bytes) -> dict[str, int]:
        """Blocks the tenant ``tenant_key`` holds per lower tier (``{"dram": n, "nvme": m}`` for the
        enabled ones): one tenant's, never summed with another's that shares its metrics label."""
        return {t.name: t.blocks_owned(tenant_key) for t in self.tiers}

    def blocks_by_tenant(self) -> dict[TierName, dict[str, int]]:
        """Blocks each tenant (metrics label) holds in each tier: what its DRAM / NVMe block quota counts."""
        return {TierName(tier.name): tier.stats().blocks_by_tenant for tier in self.tiers}

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for tier in self.tiers:
            s = tier.stats()
            out[tier.name] = {"capacity_bytes": s.capacity_bytes, "used_bytes": s.used_bytes,
                              "segments": s.num_segments, "blocks": s.num_blocks,
                              "bytes_by_tenant": s.bytes_by_tenant}
        with self._pending_lock:
            out["pending_demotions"] = len(self._pending)
        return out

    def close(self) -> None:
        """Finish in-flight work, then release the pool and the NVMe index."""
        self._pool.shutdown(wait=True)
        self.opener.close()
        if self.nvme is not None:
            self.nvme.close()


def _as_bytes_view(data: HostKV) -> memoryview:
    """bytes / bytearray / memoryview / CPU tensor -> flat read-only byte view (no copy but a
    non-contiguous tensor's)."""
    if isinstance(data, bytes | bytearray | memoryview):
        return memoryview(data).cast("B").toreadonly()
    if data.device.type != "cpu":
        raise ValueError("demote() needs a CPU buffer; export the blocks to host memory first")
    # .data is memoryview(array): numpy's stubs give ndarray the buffer protocol for Python 3.12+ only
    return data.contiguous().numpy().data.cast("B").toreadonly()


_Plain = memoryview | DevicePlaintext  # a run's plaintext on its way down: host bytes, or still in HBM
