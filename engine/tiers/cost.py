"""Is a run of blocks worth keeping in a tier, and which segment goes first?

Both questions compare two times for the same tokens:

    recompute_s(tokens)      = tokens / prefill_tokens_per_s
    restore_s(tier, bytes)   = latency_s[tier] + bytes / read_bytes_per_s[tier] + bytes / decrypt_bytes_per_s

A segment is kept in a tier only if restoring it beats recomputing it by ``min_gain`` (a ratio):
a short run on NVMe pays a file open and a read latency that a fast prefill can beat, so it is
dropped rather than demoted. Among kept segments, the eviction score is the time a byte of the
segment saves, weighted by reuse and discounted by idleness:

    score = (recompute_s - restore_s) / nbytes * (1 + hits) / (1 + idle_s / idle_halving_s)

(lower is evicted first). The rates are configurable; ``TierRates.measure`` times this host's
copy, disk and cipher so a deployment can use its own figures. The defaults describe a
typical GPU server (prefill of a 7-8B model, DDR5, one PCIe 4 NVMe drive).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from engine.protocol import BlockCipher
from engine.tiers.base import SegmentMeta
from engine.tiers.placement import ScoreFn


@dataclass(frozen=True)
class TierRates:
    """Throughputs in bytes (or tokens) per second, latencies in seconds per segment read."""

    prefill_tokens_per_s: float = 10_000.0
    dram_read_bytes_per_s: float = 10e9
    nvme_read_bytes_per_s: float = 2e9
    dram_latency_s: float = 20e-6
    nvme_latency_s: float = 200e-6
    decrypt_bytes_per_s: float = 2e9
    min_gain: float = 1.0  # keep only if recompute_s >= min_gain * restore_s
    idle_halving_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "dram_read_bytes_per_s", "nvme_read_bytes_per_s",
                     "decrypt_bytes_per_s", "idle_halving_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.dram_latency_s < 0 or self.nvme_latency_s < 0 or self.min_gain < 0:
            raise ValueError("latencies and min_gain must be >= 0")

    @classmethod
    def measure(cls, cipher: BlockCipher, directory: Path | None = None, *, nbytes: int = 8 << 20,
                prefill_tokens_per_s: float | None = None) -> TierRates:
        """Time this host: a DRAM copy, an NVMe write+read of ``nbytes`` under ``directory``
        (the read may come from the page cache: an optimistic figure) and ``cipher.decrypt``.
        The prefill rate comes from the caller (the engine knows its model); default kept."""
        data = os.urandom(nbytes)
        t = time.perf_counter()
        bytes(bytearray(data))
        dram = nbytes / max(time.perf_counter() - t, 1e-9)
        blob = cipher.encrypt(data, b"measure")
        t = time.perf_counter()
        cipher.decrypt(blob, b"measure")
        dec = nbytes / max(time.perf_counter() - t, 1e-9)
        with tempfile.TemporaryDirectory(dir=directory) as d:
            p = Path(d) / "probe"
            p.write_bytes(data)
            t = time.perf_counter()
            with open(p, "rb") as f:
                f.read()
            nvme = nbytes / max(time.perf_counter() - t, 1e-9)
        rates = cls(dram_read_bytes_per_s=dram, nvme_read_bytes_per_s=nvme, decrypt_bytes_per_s=dec)
        if prefill_tokens_per_s is not None:
            rates = replace(rates, prefill_tokens_per_s=prefill_tokens_per_s)
        return rates


class CostModel:
    """Recompute-vs-restore arithmetic for one engine (fixed block size)."""

    def __init__(self, rates: TierRates, block_size: int):
        self.rates = rates
        self.block_size = block_size

    def recompute_s(self, num_blocks: int) -> float:
        return num_blocks * self.block_size / self.rates.prefill_tokens_per_s

    def restore_s(self, tier: str, nbytes: int) -> float:
        r = self.rates
        if tier == "dram":
            return r.dram_latency_s + nbytes / r.dram_read_bytes_per_s + nbytes / r.decrypt_bytes_per_s
        if tier == "nvme":
            return r.nvme_latency_s + nbytes / r.nvme_read_bytes_per_s + nbytes / r.decrypt_bytes_per_s
        raise ValueError(f"unknown tier {tier!r}")

    def worth_keeping(self, tier: str, num_blocks: int, nbytes: int) -> bool:
        return self.recompute_s(num_blocks) >= self.rates.min_gain * self.restore_s(tier, nbytes)

    def score_fn(self, tier: str) -> ScoreFn:
        """The eviction score of ``engine.tiers.placement`` for segments of ``tier``."""

        def score(meta: SegmentMeta, now_s: float) -> float:
            saved = self.recompute_s(meta.num_blocks) - self.restore_s(tier, meta.nbytes)
            idle = max(0.0, now_s - meta.last_access_s)
            return saved / max(meta.nbytes, 1) * (1 + meta.hits) / (1 + idle / self.rates.idle_halving_s)

        return score
