"""KV sealed with ChaCha20-Poly1305 and opened by the Triton kernels (``DeviceAeadOpener``).

On a CPU machine the kernels run in Triton's interpreter on CPU tensors, so this whole path (seal
in tenancy, store, read, open with the kernels, import into the runner) runs in CI; on a CUDA host
the same tests run compiled (``-m gpu``) with real streams and pinned memory.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels.* is imported

from engine.protocol import StaticTenantScope  # noqa: E402
from engine.tiers.device_aead import DEVICE_BLOB_VERSION, DeviceSealingCipher, device_blob_parts  # noqa: E402
from engine.tiers.gpu_opener import DeviceAeadOpener, PinnedHostOpener  # noqa: E402
from tenancy.crypto import TenantCipher, new_data_key  # noqa: E402
from tests.tiers.conftest import AesGcmCipher, acme, chain, kv_bytes, metric  # noqa: E402
from tests.tiers.test_manager import restore_all, spill  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def host(data) -> bytes:
    return data.cpu().numpy().tobytes() if isinstance(data, torch.Tensor) else bytes(data)


def test_tenancy_device_blobs_open_on_the_cpu_too_and_reject_tampering():
    c = TenantCipher(new_data_key(), owner="t")
    assert isinstance(c, DeviceSealingCipher)
    blob = c.encrypt_for_device(b"kv" * 100, b"aad")
    parts = device_blob_parts(blob)
    assert blob[0] == DEVICE_BLOB_VERSION and parts is not None and parts.ct_len == 200
    assert c.decrypt(blob, b"aad") == b"kv" * 100  # the CPU fallback and oracle
    assert c.decrypt(c.encrypt(b"x", b"aad"), b"aad") == b"x"  # AES-GCM blobs unchanged
    for i in range(len(blob)):  # every byte counts, the 3 zero bytes of the header included
        bad = bytearray(blob)
        bad[i] ^= 0x01
        assert c.decrypt(bytes(bad), b"aad") is None, i
    assert c.decrypt(blob, b"aad!") is None
    c.destroy()
    assert c.device_key() is None and c.decrypt(blob, b"aad") is None
    assert c.decrypt(c.encrypt_for_device(b"kv", b"aad"), b"aad") is None  # still seals, never opens
    assert "key" not in repr(c).replace("destroyed", "")


@pytest.mark.parametrize("where", ["dram", "nvme"])
def test_round_trip_through_the_kernels(make_manager, registry, where):
    opener = DeviceAeadOpener(DEVICE)
    sizes = {"dram_bytes": 1 << 20} if where == "dram" else {"nvme_bytes": 1 << 20}
    m = make_manager(opener=opener, device_seal=True, max_segment_blocks=4, **sizes)
    a = acme()
    hs, data = chain(a.namespace, 10, seed=1), kv_bytes(10, seed=1)
    assert spill(m, a, hs, data).stored == {where: 10}  # segments of 4, 4, 2
    blobs = [m.dram._blobs[s] for s in m.dram._blobs] if where == "dram" else []
    assert all(bytes(b.view() if hasattr(b, "view") else b)[0] == DEVICE_BLOB_VERSION for b in blobs)
    match, res = restore_all(m, a, hs[3:])  # starts inside the first segment
    assert res.num_blocks == 7 and isinstance(res.data, torch.Tensor) and res.data.shape == (7, 512)
    assert host(res.data) == data[3 * 512:]
    assert opener.opened_on_device == 3 and opener.opened_on_host == 0
    assert metric(registry, "prefixgate_tier_restores_total", tier=where, tenant="acme") == 7


def test_a_tampered_segment_ends_the_restore_never_data(make_manager, registry):
    m = make_manager(opener=DeviceAeadOpener(DEVICE), device_seal=True, max_segment_blocks=4, dram_bytes=1 << 20,
                     pin_memory=False)
    a = acme()
    hs, data = chain(a.namespace, 12, seed=2), kv_bytes(12, seed=2)
    spill(m, a, hs, data)
    second = m.lookup(a.namespace, hs).locations[4].segment_id
    blob = bytearray(m.dram._blobs[second])
    blob[len(blob) // 2] ^= 0x40
    m.dram._blobs[second] = bytes(blob)
    _, res = restore_all(m, a, hs)
    assert res.num_blocks == 4 and host(res.data) == data[:4 * 512]
    assert metric(registry, "prefixgate_tier_auth_failures_total", tier="dram", tenant="acme") == 1
    assert m.lookup(a.namespace, hs).num_blocks == 4  # the bad segment is gone


def test_aes_gcm_blobs_and_plain_ciphers_fall_back_to_pinned_cpu_decryption(make_manager):
    opener = DeviceAeadOpener(DEVICE)
    m = make_manager(opener=opener, device_seal=True, max_segment_blocks=4, dram_bytes=1 << 20)
    a = StaticTenantScope(namespace=b"ns-a", metrics_label="a", cipher=AesGcmCipher())  # no device key
    hs, data = chain(a.namespace, 6, seed=3), kv_bytes(6, seed=3)
    spill(m, a, hs, data)
    _, res = restore_all(m, a, hs)
    assert host(res.data) == data and opener.opened_on_host == 2 and opener.opened_on_device == 0


def test_pinned_host_opener_stops_at_the_first_bad_segment():
    c = TenantCipher(new_data_key(), owner="t")
    rng = random.Random(4)
    plains = [rng.randbytes(3 * 256) for _ in range(3)]
    from engine.tiers.opener import SealedRun

    runs = [SealedRun(c.encrypt(p, b"a%d" % i), b"a%d" % i, 3, 1, 2) for i, p in enumerate(plains)]
    runs[2] = SealedRun(runs[2].blob, b"wrong aad", 3, 0, 3)
    opener = PinnedHostOpener(DEVICE, threads=3)
    got = opener.open_runs(c, runs, 256)
    assert got.ok == 2 and host(got.data) == plains[0][256:] + plains[1][256:]
    opener.close()


def test_tiny_engine_restores_through_the_kernels(tiny_model_dir, registry):
    """The real runner, a tenancy cipher, the kernels: an evicted prefix comes back from DRAM as
    ChaCha20-Poly1305 ciphertext opened by the kernels, and decodes like the cold run."""
    from engine.config import EngineConfig
    from engine.launch import build_llm_engine_for
    from engine.metrics import EngineMetrics
    from engine.model_runner import ModelRunner
    from engine.tiers import build_tier_hook
    from tests.tiers.test_tiny_model import generate

    cfg = EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=24, max_model_len=1024, dram_bytes=64 << 20,
                       device=DEVICE, dtype="fp32")
    runner = ModelRunner(cfg)
    opener = DeviceAeadOpener(DEVICE)
    hook = build_tier_hook(cfg, runner, registry, opener=opener, device_seal=True)
    engine = build_llm_engine_for(cfg, runner, EngineMetrics(registry), lower_tier=hook)
    a = acme()
    rng = random.Random(7)
    p = [rng.randrange(1000, 90_000) for _ in range(104)]  # 6 cacheable blocks
    cold, cached = generate(engine, "p1", a, p)
    generate(engine, "q", a, [rng.randrange(1000, 90_000) for _ in range(340)], max_tokens=4)  # evicts p
    hook.flush_spills()
    hook.manager.drain()
    warm, cached = generate(engine, "p2", a, p)
    assert cached == 96 and opener.opened_on_device >= 1 and opener.opened_on_host == 0
    assert warm[:4] == cold[:4]  # same prefix KV bytes; later tokens may differ only at an fp32 near-tie
    hook.close()


@pytest.mark.parametrize("device_blob", [False, True])
def test_pinned_host_opener_decrypts_whole_segments_in_place(device_blob):
    """Whole segments go through ``decrypt_into`` (no plaintext allocated), into the reused staging
    buffer; a bad one stops the result there, and the buffer serves the next restore."""
    from engine.tiers.opener import DecryptsInto, SealedRun

    c = TenantCipher(new_data_key(), owner="t")
    assert isinstance(c, DecryptsInto)
    seal = c.encrypt_for_device if device_blob else c.encrypt
    rng = random.Random(5)
    plains = [rng.randbytes(2 * 256) for _ in range(4)]
    runs = [SealedRun(seal(p, b"s%d" % i), b"s%d" % i, 2, 0, 2) for i, p in enumerate(plains)]
    opener = PinnedHostOpener(DEVICE, threads=4)
    assert host(opener.open_runs(c, runs, 256).data) == b"".join(plains)
    bad = bytearray(runs[1].blob)
    bad[-1] ^= 1
    got = opener.open_runs(c, [runs[0], SealedRun(bytes(bad), b"s1", 2, 0, 2), runs[2]], 256)
    assert got.ok == 1 and host(got.data) == plains[0]
    assert host(opener.open_runs(c, runs[2:], 256).data) == b"".join(plains[2:])
    out = bytearray(512)
    assert c.decrypt_into(runs[3].blob, b"s3", memoryview(out)) and bytes(out) == plains[3]
    assert not c.decrypt_into(runs[3].blob, b"other aad", memoryview(out))
    opener.close()


def test_read_only_blob_warning_is_silenced_only_in_the_opener():
    """PyTorch warns once per process when ``torch.frombuffer`` gets a read-only buffer, which is
    what the opener hands it (a view of the tier's page-locked memory, only copied from). The
    opener's module silences that one warning for itself; elsewhere it still shows."""
    import subprocess
    import sys

    # the call compiled as if it were a line of the opener's module (its file, its __name__)
    in_opener = ("import torch, engine.tiers.gpu_opener as g\n"
                 "code = compile('torch.frombuffer(memoryview(bytes(8)), dtype=torch.uint8)', g.__file__, 'exec')\n"
                 "exec(code, {'torch': torch, '__name__': g.__name__})\n")
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    opener_only = subprocess.run([sys.executable, "-c", in_opener], capture_output=True, text=True, env=env,
                                 timeout=120, check=True)
    assert "buffer is not writable" not in opener_only.stderr
    elsewhere = subprocess.run([sys.executable, "-c", "import engine.tiers.gpu_opener, torch\n"
                                "torch.frombuffer(memoryview(bytes(8)), dtype=torch.uint8)"],
                               capture_output=True, text=True, env=env, timeout=120, check=True)
    assert "buffer is not writable" in elsewhere.stderr


def test_opener_self_test_agrees_with_the_reference_and_refuses_a_disagreeing_device(monkeypatch):
    """``DeviceAeadOpener.self_test`` (run at construction on CUDA; here called directly, in Triton's
    interpreter on a CPU) opens what the RFC 8439 reference sealed, and refuses the device when the
    two disagree."""
    opener = DeviceAeadOpener(DEVICE)
    opener.self_test()
    assert opener.opened_on_device == 0  # not counted as restored segments
    from engine.tiers import gpu_opener

    real = gpu_opener.ref_aead.seal
    # a reference that seals other bytes than the kernels open: the tags still match (they cover the
    # ciphertext as stored), the plaintext does not
    monkeypatch.setattr(gpu_opener.ref_aead, "seal", lambda key, nonce, plain, aad: real(
        key, nonce, bytes(b ^ 1 for b in plain[:1]) + plain[1:], aad))
    with pytest.raises(RuntimeError, match="disagrees with the RFC 8439 reference"):
        opener.self_test()


# Run in a fresh process by the test below (Triton keeps compiled kernels per process: in the test
# process an earlier test may have compiled what the self-test should): the opener's construction, then
# restores of assorted shapes, each step's compiles recorded.
_RESTORE_SHAPES_PROBE = """
import json, random
import torch
from engine.tiers.gpu_opener import DeviceAeadOpener
from engine.tiers.opener import SealedRun
from prefixgate_kernels.jit_watch import CompileRecorder
from tenancy.crypto import TenantCipher, new_data_key

with CompileRecorder() as at_start:
    opener = DeviceAeadOpener("cuda")
    torch.cuda.synchronize()
cipher, rng, checked = TenantCipher(new_data_key(), owner="t"), random.Random(3), []
with CompileRecorder() as restoring:
    for block_bytes, shapes in ((2 << 20, ((1, 0, 1), (3, 1, 2), (5, 0, 5))), (1 << 20, ((7, 2, 3),)),
                                (48 << 10, ((1, 0, 1), (2, 1, 1), (9, 0, 9))), (64, ((4, 3, 1), (2, 0, 2)))):
        runs, wanted = [], []
        for i, (blocks, first, count) in enumerate(shapes):
            plain, aad = rng.randbytes(blocks * block_bytes), f"seg-{i}".encode()
            runs.append(SealedRun(cipher.encrypt_for_device(plain, aad), aad, blocks, first, count))
            wanted.append(plain[first * block_bytes:(first + count) * block_bytes])
        opened = opener.open_runs(cipher, runs, block_bytes)
        checked.append(opened.ok == len(runs) and opened.data.cpu().numpy().tobytes() == b"".join(wanted))
    torch.cuda.synchronize()
print(json.dumps({"at_start": [k.split("[", 1)[0] for k in at_start.kernels],
                  "restoring": [k.split("[", 1)[0] for k in restoring.kernels],
                  "checked": checked, "opened_on_device": opener.opened_on_device}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA: Triton's interpreter compiles nothing")
def test_restores_of_any_shape_compile_nothing_after_the_self_test():
    """A restore that compiles a kernel variant does so while the request that asked for the prefix
    waits: in a fresh process, the opener's self-test compiles both kernels at construction, and then
    restores of whole segments and runs from inside one, one to several blobs a restore, block sizes of
    64 bytes to 2 MiB, compile nothing."""
    import json
    import subprocess
    import sys

    from tests.serverutil import REPO

    # `python -c` puts its working directory first on sys.path: the repository's packages import
    done = subprocess.run([sys.executable, "-c", _RESTORE_SHAPES_PROBE], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(probe["at_start"]) == {"_chacha20_xor_kernel", "_poly1305_kernel"}, probe
    assert probe["restoring"] == [], probe
    assert probe["checked"] == [True] * 4 and probe["opened_on_device"] == 9, probe
