"""Spills sealed in device memory (``DeviceSealer`` + ``DeviceKV``): the blob is what
``TenantCipher.encrypt_for_device`` would make, so `cryptography` opens it (the oracle), and the
tier path stores it without a host copy of the plaintext.

On a CPU machine the kernels run in Triton's interpreter on CPU tensors; on a CUDA host the same
tests run compiled, with the side stream, events and pinned memory.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels.* is imported

from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305  # noqa: E402

from engine.protocol import StaticTenantScope  # noqa: E402
from engine.tiers.device_aead import DEVICE_BLOB_VERSION, device_blob_parts  # noqa: E402
from engine.tiers.device_kv import DeviceKV  # noqa: E402
from engine.tiers.dram import PinnedBlob  # noqa: E402
from engine.tiers.gpu_opener import DeviceAeadOpener  # noqa: E402
from engine.tiers.gpu_sealer import DeviceSealer  # noqa: E402
from prefixgate_kernels.jit_watch import CompileRecorder  # noqa: E402
from tenancy.crypto import TenantCipher, new_data_key  # noqa: E402
from tests.tiers.conftest import BLOCK_BYTES, AesGcmCipher, acme, chain, kv_bytes  # noqa: E402
from tests.tiers.test_manager import restore_all, spill  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_device(data: bytes, block_bytes: int = BLOCK_BYTES) -> DeviceKV:
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(-1, block_bytes).to(DEVICE)
    ready = None
    if DEVICE == "cuda":
        ready = torch.cuda.Event()
        ready.record()
    return DeviceKV(t, ready)


def host(data) -> bytes:
    return data.cpu().numpy().tobytes() if isinstance(data, torch.Tensor) else bytes(data)


def test_device_sealed_blob_opens_with_cryptography_and_tenancy():
    c = TenantCipher(new_data_key(), owner="t")
    key = c.device_key()
    assert key is not None
    sealer = DeviceSealer(DEVICE)
    plain, aad = random.Random(1).randbytes(3 * 256), b"segment-aad"
    blob = sealer.seal(key, on_device(plain, 256), aad)
    assert isinstance(blob, PinnedBlob)
    raw = bytes(blob.view())
    parts = device_blob_parts(raw)
    assert raw[0] == DEVICE_BLOB_VERSION and parts is not None and parts.ct_len == len(plain)
    # the oracle: `cryptography` with the same key and nonce produces exactly these bytes
    assert raw[16:] == ChaCha20Poly1305(key).encrypt(parts.nonce, plain, aad)
    assert c.decrypt(raw, aad) == plain  # tenancy's CPU open (the restore fallback)
    assert c.decrypt(raw, aad + b"!") is None
    bad = bytearray(raw)
    bad[100] ^= 4
    assert c.decrypt(bytes(bad), aad) is None
    again = bytes(sealer.seal(key, on_device(plain, 256), aad).view())
    assert again[4:16] != raw[4:16] and again[16:] != raw[16:]  # a fresh nonce per seal
    # part of a run (rows of the same device tensor) seals on its own
    part = on_device(plain, 256).rows(1, 3)
    assert c.decrypt(bytes(sealer.seal(key, part, aad).view()), aad) == plain[256:]
    with pytest.raises(TypeError):
        sealer.seal(key, memoryview(plain), aad)  # type: ignore[arg-type]


@pytest.mark.parametrize("where", ["dram", "nvme"])
def test_device_plaintext_demoted_sealed_on_device_and_restored(make_manager, where):
    sealer, opener = DeviceSealer(DEVICE), DeviceAeadOpener(DEVICE)
    sizes = {"dram_bytes": 1 << 20} if where == "dram" else {"nvme_bytes": 1 << 20}
    m = make_manager(opener=opener, device_seal=True, sealer=sealer, max_segment_blocks=4, **sizes)
    a = acme()
    hs, data = chain(a.namespace, 10, seed=4), kv_bytes(10, seed=4)
    assert spill(m, a, hs, on_device(data)).stored == {where: 10}  # segments of 4, 4, 2
    assert sealer.sealed == 3
    if where == "dram":
        assert all(isinstance(b, PinnedBlob) for b in m.dram._blobs.values())  # kept as sealed, no copy
    _, res = restore_all(m, a, hs[2:])
    assert res.num_blocks == 8 and host(res.data) == data[2 * BLOCK_BYTES:]
    assert opener.opened_on_device == 3 and opener.opened_on_host == 0


def test_device_plaintext_with_a_quota_split_and_a_cascade(make_manager):
    """A block quota splits the run (rows of the device tensor), and DRAM's eviction moves sealed
    blobs on to NVMe as they are."""
    m = make_manager(opener=DeviceAeadOpener(DEVICE), device_seal=True, sealer=DeviceSealer(DEVICE),
                     max_segment_blocks=8, dram_bytes=1 << 20, nvme_bytes=1 << 20)
    a = acme()
    from engine.tiers.manager import TenantTierPolicy

    m.set_tenant_policy(a.namespace, TenantTierPolicy(dram_blocks=3))
    hs, data = chain(a.namespace, 8, seed=5), kv_bytes(8, seed=5)
    assert spill(m, a, hs, on_device(data)).stored == {"dram": 3, "nvme": 5}
    _, res = restore_all(m, a, hs)
    assert res.num_blocks == 8 and host(res.data) == data


def test_device_plaintext_of_a_cipher_without_a_device_key_is_sealed_on_the_cpu(make_manager):
    sealer = DeviceSealer(DEVICE)
    m = make_manager(opener=DeviceAeadOpener(DEVICE), device_seal=True, sealer=sealer, dram_bytes=1 << 20)
    a = StaticTenantScope(namespace=b"ns-a", metrics_label="a", cipher=AesGcmCipher())
    hs, data = chain(a.namespace, 4, seed=6), kv_bytes(4, seed=6)
    assert spill(m, a, hs, on_device(data)).stored == {"dram": 4}
    assert sealer.sealed == 0
    _, res = restore_all(m, a, hs)
    assert host(res.data) == data
    # a destroyed tenant key: sealed under a one-time key on the CPU, never opened
    gone = TenantCipher(new_data_key(), owner="g")
    gone.destroy()
    b = acme(gone)
    hs2 = chain(b.namespace, 2, seed=7)
    spill(m, b, hs2, on_device(kv_bytes(2, seed=7)))
    assert sealer.sealed == 0
    _, res = restore_all(m, b, hs2)
    assert res.num_blocks == 0


def test_tiny_engine_spills_through_the_device_sealer(tiny_model_dir, registry):
    """The real runner and engine: evicted blocks are gathered on the device without a host copy,
    sealed by the kernels, stored in DRAM; the prefix comes back through the open kernels and
    decodes like the cold run."""
    from engine.config import EngineConfig
    from engine.launch import build_llm_engine_for
    from engine.metrics import EngineMetrics
    from engine.model_runner import ModelRunner
    from engine.tiers import build_tier_hook
    from tests.tiers.test_tiny_model import generate

    cfg = EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=24, max_model_len=1024, dram_bytes=64 << 20,
                       device=DEVICE, dtype="fp32")
    runner = ModelRunner(cfg)
    opener, sealer = DeviceAeadOpener(DEVICE), DeviceSealer(DEVICE)
    workers = {"max_workers": 1} if DEVICE == "cpu" else {}  # Triton's interpreter is not thread-safe
    hook = build_tier_hook(cfg, runner, registry, opener=opener, device_seal=True, sealer=sealer, **workers)
    assert hook is not None and hook.device_spill
    engine = build_llm_engine_for(cfg, runner, EngineMetrics(registry), lower_tier=hook)
    a = acme()
    rng = random.Random(7)
    p = [rng.randrange(1000, 90_000) for _ in range(104)]  # 6 cacheable blocks
    cold, _ = generate(engine, "p1", a, p)
    generate(engine, "q", a, [rng.randrange(1000, 90_000) for _ in range(340)], max_tokens=4)  # evicts p
    hook.flush_spills()
    hook.manager.drain()
    assert sealer.sealed >= 1
    warm, cached = generate(engine, "p2", a, p)
    assert cached == 96 and opener.opened_on_device >= 1 and opener.opened_on_host == 0
    assert warm[:4] == cold[:4]
    hook.close()


def test_step_loop_with_device_spills_and_a_zero_backlog(tmp_path, registry):
    """The real block pool, scheduler and step loop (the token-id runner double): every flush of a
    device-resident run waits for the one before it (backlog cap 0), and the evicted prefix comes
    back sealed-on-device and opened-on-device with the same output."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.tiers import TierHook, TierManager
    from tests.tiers.kv_runner_double import TokenKVRunner, reference_generate
    from tests.tiers.test_engine_hook import run

    cfg = EngineConfig(model_dir=tmp_path / "double", block_size=16, num_kv_blocks=12, dram_bytes=1 << 20,
                       eviction_policy="lru")
    runner = TokenKVRunner(12, 16, spill_device=DEVICE)  # its spills in device memory (compiled kernels on CUDA)
    sealer, opener = DeviceSealer(DEVICE), DeviceAeadOpener(DEVICE)
    # one worker: Triton's interpreter is not thread-safe, and a seal may overlap a restore here
    manager = TierManager.from_config(cfg, runner.kv_bytes_per_block, registry=registry, pin_memory=False,
                                      opener=opener, device_seal=True, sealer=sealer, max_workers=1)
    backlog: list[tuple[int, int]] = []

    class WatchedHook(TierHook):
        def flush_spills(self, *, due_only: bool = False) -> None:
            super().flush_spills(due_only=due_only)
            backlog.append(self.device_backlog)

    hook = WatchedHook(manager, runner, pin_memory=False, device_spill=True, device_backlog_bytes=0)
    engine = LLMEngine(cfg, runner, lower_tier=hook)
    a = acme()
    rng = random.Random(0)
    p = [rng.randrange(1000, 40_000) for _ in range(100)]  # 6 cacheable full blocks
    cold, _, _ = run(engine, "p1", a, p)
    run(engine, "q", a, [rng.randrange(1000, 40_000) for _ in range(170)])  # pushes p's tail out of HBM
    hook.flush_spills()  # no request waits, so the run may still be lingering for more of its chain
    hook.manager.drain()
    assert runner.gathered >= 5 and runner.exported == 0 and sealer.sealed >= 1
    # the cap: never more in flight than the run just handed over
    assert max(runs for runs, _ in backlog) == 1 and max(b for _, b in backlog) <= 6 * runner.kv_bytes_per_block
    warm, cached, _ = run(engine, "p2", a, p)
    assert warm == cold == reference_generate(p, 4) and cached == 96
    assert opener.opened_on_device >= 1 and opener.opened_on_host == 0
    # every run was staged in the one buffer a zero backlog allows, reused after each seal
    assert len(backlog) >= 2 and hook.staging_buffers == 1
    hook.close()


def test_device_spill_needs_a_sealer(make_manager):
    from engine.tiers.engine_hook import TierHook

    m = make_manager(dram_bytes=1 << 20)  # no sealer
    with pytest.raises(ValueError):
        TierHook(m, _Runner(), device_spill=True)


class _Runner:
    kv_bytes_per_block = BLOCK_BYTES

    def export_blocks(self, block_ids):
        raise AssertionError

    def import_blocks(self, block_ids, data):
        raise AssertionError

    kv_device = torch.device("cpu")

    def gather_blocks_into(self, block_ids, out):
        raise AssertionError


def test_runner_gathers_on_device_what_it_exports(tiny_model_dir):
    """``gather_blocks_async`` (no host sync) holds the same bytes as ``export_blocks`` (host copy),
    and stays a copy when the blocks are overwritten afterwards."""
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=8, max_model_len=128, device=DEVICE,
                                      dtype="fp32"))
    rng = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (3, runner.kv_bytes_per_block), dtype=torch.uint8, generator=rng)
    runner.import_blocks([5, 1, 6], data)
    got = runner.gather_blocks_async([6, 5])
    assert got.device.type == torch.device(DEVICE).type and got.dtype == torch.uint8 and got.is_contiguous()
    runner.import_blocks([5, 6], torch.zeros(2, runner.kv_bytes_per_block, dtype=torch.uint8))  # reuse the blocks
    assert torch.equal(got.cpu(), data[[2, 0]]) and torch.equal(runner.export_blocks([1]), data[[1]])
    runner.import_blocks([2, 3, 4], data)
    run = runner.gather_blocks_async([2, 3, 4])  # consecutive: the slice copy, laid out as the gather
    one = runner.gather_blocks_async([3])
    runner.import_blocks([2, 3, 4], torch.zeros(3, runner.kv_bytes_per_block, dtype=torch.uint8))
    assert torch.equal(run.cpu(), data) and torch.equal(one.cpu(), data[[1]]) and one.is_contiguous()
    with pytest.raises(IndexError):
        runner.gather_blocks_async([8])
    with pytest.raises(IndexError):
        runner.gather_blocks_async([7, 8])
    rows = torch.full((4, runner.kv_bytes_per_block), 7, dtype=torch.uint8, device=DEVICE)
    runner.import_blocks([2, 3, 4], data)
    runner.gather_blocks_into([3, 4], rows[2:])  # into the last rows of a staging buffer
    runner.gather_blocks_into([6], rows[1:2])  # a single block, not adjacent to the others
    assert torch.equal(rows[2:].cpu(), data[1:]) and torch.equal(rows[1].cpu(), data[2].new_zeros(data.shape[1]))
    assert set(rows[0].cpu().tolist()) == {7}  # rows not asked for are left alone
    with pytest.raises(ValueError):
        runner.gather_blocks_into([3], rows[:2])


def test_self_test_agrees_with_the_reference_and_refuses_a_disagreeing_device(monkeypatch):
    sealer = DeviceSealer(DEVICE)  # on CUDA the constructor has run it once already
    before = sealer.sealed
    sealer.self_test()
    assert sealer.sealed == before  # not counted as a segment
    from engine.tiers import gpu_sealer

    real = gpu_sealer.ref_aead.seal
    monkeypatch.setattr(gpu_sealer.ref_aead, "seal", lambda *a: bytes(reversed(real(*a))))
    with pytest.raises(RuntimeError, match="disagrees with the RFC 8439 reference"):
        sealer.self_test()


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA: Triton's interpreter compiles nothing")
def test_spills_of_any_size_compile_nothing_after_the_self_test():
    """A spill that compiles a kernel variant does so on the tier worker while the step loop waits
    on the backlog (0.11-0.56 s on the H200): the self-test must have compiled every variant that
    whole-block segments of any length launch. Triton calls ``jit_cache_hook`` before compiling a
    launch it has no kernel for (``prefixgate_kernels.jit_watch``)."""
    sealer = DeviceSealer(DEVICE)
    key = TenantCipher(new_data_key(), owner="t").device_key()
    assert key is not None
    with CompileRecorder() as compiled:
        # segments of 1-70 blocks of a 2 MiB block (the 8B shape), 1 MiB (fp8) and 48 KiB (a small
        # model): lane layouts with and without padding, K of 1, 2n and 96, lane counts capped
        for block_bytes, counts in ((2 << 20, (1, 3, 5, 17, 64, 70)), (1 << 20, (1, 7)), (48 << 10, (1, 2, 9))):
            for n in counts:
                data = torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8, device=DEVICE)
                sealer.seal(key, DeviceKV(data), b"aad")
    assert compiled.kernels == []
