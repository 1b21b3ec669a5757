"""TTFT of a long shared prefix held in HBM, in DRAM, on NVMe, and cold (recomputed).

Runs the real engine (block pool, scheduler, ``ModelRunner``) with the tiny offline model on the
CPU. For each prefix length, each trial uses a fresh random prefix and measures four requests
that share it, each with its own 16-token suffix and ``max_tokens=1``:

    cold   first request: the whole prompt is prefilled
    hbm    second request: the prefix is still in HBM (the block pool)
    tier   HBM is emptied (every cached block evicted -> encrypted -> DRAM or NVMe), then a
           third request restores the prefix from the tier and prefills only the suffix

``tier`` is measured twice per trial: for a tenant with a real AES-256-GCM key and for one with
the ``InsecureNullCipher`` (no encryption), to show what encryption costs. For NVMe the segment
files are dropped from the page cache (``posix_fadvise(DONTNEED)``) before the restore, so the
read goes to the device. TTFT = wall time from ``add_request`` to the first token.

    python benchmarks/tiers.py [--lengths 1024 4096 8064] [--trials 3]

The tiny model's context is 8192 positions, so 16K-token prefixes do not fit: 8064 tokens
(504 blocks) is the largest measured. Writes ``benchmarks/results/tiers_cpu.json``.

Prediction, written before the first run (2-core CPU, fp32 KV = 64 KiB per 16-token block,
AES-GCM ~1-2 GB/s): cold 1K ~50 ms, 4K ~0.4 s, 8K ~1.5 s (attention grows quadratically in the
reference path); hbm ~10 ms at any length (16 suffix tokens + the LM head); DRAM restore of
4 MiB (1K) ~10 ms, of 32 MiB (8K) ~50 ms; NVMe a few ms more than DRAM per 4 MiB; the null cipher
saves ~2-4 ms per 4 MiB. (Measured fact, not prediction: a block is 32 KiB, so 1K tokens = 2 MiB.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from cryptography.exceptions import InvalidTag  # noqa: E402
from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # noqa: E402

from benchmarks.provenance import git_commit  # noqa: E402 - after the path insert
from engine.config import EngineConfig  # noqa: E402
from engine.launch import build_llm_engine  # noqa: E402
from engine.models.tiny import ensure_tiny_checkpoint  # noqa: E402
from engine.protocol import GenerateRequest, SamplingParams, StaticTenantScope  # noqa: E402
from engine.tiers import InsecureNullCipher, TierManager  # noqa: E402

SUFFIX = 16
RESULTS = Path(__file__).resolve().parent / "results" / "tiers_cpu.json"


class AesGcm:
    """The shape of tenancy's cipher: 12-byte random nonce || ciphertext || 16-byte tag."""

    def __init__(self) -> None:
        self._aead = AESGCM(AESGCM.generate_key(bit_length=256))

    def encrypt(self, plaintext, aad: bytes) -> bytes:
        nonce = os.urandom(12)
        return nonce + self._aead.encrypt(nonce, bytes(plaintext), aad)

    def decrypt(self, blob, aad: bytes) -> bytes | None:
        blob = bytes(blob)
        try:
            return self._aead.decrypt(blob[:12], blob[12:], aad)
        except (InvalidTag, ValueError):
            return None


def ttft(engine, rid: str, tenant, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first token, cached tokens reported)."""
    t0 = time.perf_counter()
    engine.add_request(GenerateRequest(request_id=rid, tenant=tenant, prompt_token_ids=prompt,
                                       sampling=SamplingParams(max_tokens=1, temperature=0.0)))
    first, cached = None, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and first is None:
                first = time.perf_counter() - t0
                cached = out.cached_tokens
    assert first is not None
    return first, cached


def spill_hbm(engine, cold_disk: bool) -> None:
    """Evict every cached block from HBM into the tier and wait until it is stored."""
    hook = engine.lower_tier
    engine.cache.evict_all_cached()
    hook.flush_spills()
    hook.manager.drain()
    if cold_disk and hook.manager.nvme is not None:
        drop_page_cache_of(hook.manager.nvme.root)


def measure(engine, rid: str, who, rng: random.Random, n: int, vocab: int) -> tuple[float, float, float]:
    """TTFT of cold, HBM-hit and tier-restored requests sharing one fresh n-token prefix."""
    prefix = [rng.randrange(1000, vocab - 1000) for _ in range(n)]

    def prompt() -> list[int]:
        return prefix + [rng.randrange(1000, vocab - 1000) for _ in range(SUFFIX)]

    cold, c0 = ttft(engine, rid + "-cold", who, prompt())
    hbm, c1 = ttft(engine, rid + "-hbm", who, prompt())
    spill_hbm(engine, cold_disk=True)
    restored, c2 = ttft(engine, rid + "-tier", who, prompt())
    # The restored prefix is reported as cached, exactly like an HBM hit.
    assert c0 == 0 and c1 == c2 == n, (c0, c1, c2, n)
    spill_hbm(engine, cold_disk=False)  # the next measurement starts with an empty HBM
    return cold, hbm, restored


def restore_only(lengths: list[int], trials: int, kv_block: int, work: Path) -> list[dict]:
    """Demote (encrypt + store) and restore (read + decrypt) of an n-token prefix through
    ``TierManager`` alone: no model, so the cost of the cipher stands out of the TTFT noise."""
    out = []
    for tier in ("dram", "nvme"):
        for cname, cipher in (("aes", AesGcm()), ("null", InsecureNullCipher())):
            sizes = {"dram_bytes": 1 << 30} if tier == "dram" else {"nvme_dir": work / f"ro-{cname}",
                                                                     "nvme_bytes": 1 << 30}
            m = TierManager(model_id="bench", block_size=16, block_bytes=kv_block, max_segment_blocks=32,
                            pin_memory=False, **sizes)
            who = StaticTenantScope(namespace=f"ro-{tier}-{cname}".encode(), metrics_label=cname, cipher=cipher)
            for n in lengths:
                dem, res = [], []
                for _ in range(trials):
                    hashes = [os.urandom(32) for _ in range(n // 16)]
                    data = os.urandom(n // 16 * kv_block)
                    t0 = time.perf_counter()
                    m.demote(who, hashes, data).result()
                    dem.append(time.perf_counter() - t0)
                    if m.nvme is not None:
                        drop_page_cache_of(m.nvme.root)
                    t0 = time.perf_counter()
                    got = m.restore(who, m.lookup(who.namespace, hashes)).result()
                    res.append(time.perf_counter() - t0)
                    assert got.data == data
                    m.delete_tenant(who.namespace)
                mib = len(data) / 2**20
                out.append({"tier": tier, "cipher": cname, "prefix_tokens": n, "mib": mib,
                            "demote_ms": statistics.median(dem) * 1e3, "restore_ms": statistics.median(res) * 1e3,
                            "restore_mib_per_s": mib / statistics.median(res)})
            m.close()
    return out


def drop_page_cache_of(root: Path) -> None:
    """Evict the tier's segment files from the page cache, so the next read goes to the device."""
    for f in root.rglob("*.seg"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8064])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()

    commit = git_commit()  # the code that runs, even if HEAD moves while it does
    work = Path(tempfile.mkdtemp(prefix="pg-tiers-bench-"))
    model = ensure_tiny_checkpoint(work / "tiny")
    blocks = max(args.lengths) // 16 + 16
    tenants = {"aes": AesGcm(), "null": InsecureNullCipher()}
    rows: dict[int, dict[str, list[float]]] = {n: {} for n in args.lengths}
    for tier in ("dram", "nvme"):
        sizes = {"dram_bytes": 4 << 30} if tier == "dram" else {"nvme_dir": work / "nvme", "nvme_bytes": 4 << 30}
        cfg = EngineConfig(model_dir=model, num_kv_blocks=blocks, max_model_len=8192, **sizes)
        engine = build_llm_engine(cfg)
        vocab = engine.vocab_size
        kv_block = engine.runner.kv_bytes_per_block
        warm = StaticTenantScope(namespace=b"warm-up", metrics_label="warm", cipher=tenants["aes"])
        measure(engine, "warm-" + tier, warm, random.Random(0), min(args.lengths), vocab)  # untimed
        for n in args.lengths:
            for trial in range(args.trials):
                order = list(tenants) if trial % 2 == 0 else list(tenants)[::-1]  # no first-run bias
                for cname in order:
                    who = StaticTenantScope(namespace=f"{tier}-{n}-{trial}-{cname}".encode(), metrics_label=cname,
                                            cipher=tenants[cname])
                    rng = random.Random(f"{tier}{n}{trial}{cname}")
                    cold, hbm, restored = measure(engine, f"{tier}-{n}-{trial}-{cname}", who, rng, n, vocab)
                    r = rows[n]
                    if cname == "aes":
                        r.setdefault("cold", []).append(cold)
                        r.setdefault("hbm", []).append(hbm)
                    r.setdefault(f"{tier}_{cname}", []).append(restored)
        engine.lower_tier.close()

    cols = ["cold", "hbm", "dram_aes", "dram_null", "nvme_aes", "nvme_null"]
    print(f"TTFT, median of {args.trials} trials, ms (tiny model, CPU, fp32 KV {kv_block // 1024} KiB/block)")
    print(f"{'prefix':>7} {'KV MiB':>7} " + " ".join(f"{c:>10}" for c in cols))
    table = []
    for n in args.lengths:
        med = {c: statistics.median(rows[n][c]) * 1e3 for c in cols}
        mib = n // 16 * kv_block / 2**20
        print(f"{n:>7} {mib:>7.1f} " + " ".join(f"{med[c]:>10.1f}" for c in cols))
        table.append({"prefix_tokens": n, "kv_mib": mib, "median_ms": med,
                      "samples_ms": {c: [x * 1e3 for x in rows[n][c]] for c in cols}})
    ro = restore_only(args.lengths, max(args.trials, 5), kv_block, work)
    print(f"\nTierManager alone (no model), median of {max(args.trials, 5)}: demote = encrypt + store, "
          "restore = read + decrypt")
    print(f"{'tier':>5} {'cipher':>6} {'prefix':>7} {'MiB':>6} {'demote ms':>10} {'restore ms':>11} {'MiB/s':>8}")
    for r in ro:
        print(f"{r['tier']:>5} {r['cipher']:>6} {r['prefix_tokens']:>7} {r['mib']:>6.1f} {r['demote_ms']:>10.1f} "
              f"{r['restore_ms']:>11.1f} {r['restore_mib_per_s']:>8.0f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": " ".join([sys.executable, *sys.argv]),
        "git_commit": commit,
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "model": "tiny (seeded random Llama, 4 layers, 2 KV heads x 32, fp32 KV, 8192 positions)",
        "note": "16K-token prefixes exceed the tiny model's 8192 positions; 8064 is the largest measured. "
                "NVMe rows read with the page cache dropped for the segment files.",
        "suffix_tokens": SUFFIX,
        "trials": args.trials,
        "results": table,
        "restore_only": ro,
        "load_average_1_5_15_min_at_end": os.getloadavg(),
    }, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
