"""Shared-buffer transfers: the bytes stay in the sender's buffer (a /dev/shm file on CPU, a CUDA
IPC handle on GPU), the MAC'd frames name them, the receiver copies them and checks their keyed
digest. A real ``KVReceiver`` on loopback with the real landing; the importer records what it got
(or, in the last test, writes real model runner blocks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from engine.batch import ScheduledBatch, SequenceChunk
from engine.config import EngineConfig
from engine.disagg.api import TransferStatus, derive_transfer_key
from engine.disagg.metrics import TransferMetrics
from engine.disagg.receiver import ImportOutcome, KVReceiver
from engine.disagg.shared_transport import (
    SHARED_MIN_BLOCKS_PER_CHUNK,
    SHM_DIR,
    SHM_PREFIX,
    HostShmStaging,
    HostShmTransport,
    SharedBufferTransport,
    keyed_digest,
    keyed_digests,
    landing_for,
    open_shared,
)
from engine.disagg.transport import OutgoingTransfer
from engine.disagg.wire import ChainChecker, EngineLayout, WireError
from engine.model_runner import ModelRunner
from engine.prefix_index import block_hashes
from engine.protocol import SamplingParams

REPO = Path(__file__).resolve().parents[2]
BS, BB = 4, 4096
LAYOUT = EngineLayout("m", "bfloat16", BS, 2, BB)
KEY = derive_transfer_key("shared")


def blocks(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, BB), generator=g, dtype=torch.int32).to(torch.uint8)


def transfer(staging: torch.Tensor, ns: bytes = b"t") -> OutgoingTransfer:
    n = staging.shape[0]
    tokens = list(range(n * BS))
    return OutgoingTransfer("x", ns, tuple(block_hashes(ns, tokens, BS)),
                            tuple(tuple(tokens[i * BS:(i + 1) * BS]) for i in range(n)), staging)


def receiver(device: str = "cpu", landing: bool = True) -> tuple[KVReceiver, list[torch.Tensor]]:
    got: list[torch.Tensor] = []

    def importer(chunk, chain) -> Future:
        got.append(chunk.payload.cpu().clone())
        f: Future = Future()
        f.set_result(ImportOutcome(chunk.num_blocks, chunk.num_blocks))
        return f

    rx = KVReceiver("127.0.0.1", 0, KEY, LAYOUT, importer, TransferMetrics(CollectorRegistry()),
                    landing=landing_for(KEY, device) if landing else None)
    return rx, got


def staging_files() -> set[str]:
    return {p.name for p in SHM_DIR.glob(SHM_PREFIX + "*")}


def test_keyed_digest_catches_any_flipped_byte_and_depends_on_the_key():
    data = blocks(3).reshape(-1)
    d = keyed_digest(KEY, data)
    assert d == keyed_digest(KEY, data.clone()) and len(d) == 16
    assert d != keyed_digest(derive_transfer_key("other"), data)
    for i in (0, 1, 4095, 4096, data.numel() - 1):
        flipped = data.clone()
        flipped[i] ^= 0x10
        assert keyed_digest(KEY, flipped) != d, i
    assert keyed_digest(KEY, data[:-4]) != keyed_digest(KEY, torch.cat([data[:-4], data.new_zeros(4)]))


@pytest.mark.parametrize("piece", [BB, 2 * BB, 1000])
def test_batched_digests_equal_one_digest_per_piece(piece):
    data = blocks(5).reshape(-1)
    pieces = [data[i:i + piece] for i in range(0, data.numel(), piece)]
    assert keyed_digests(KEY, data, piece) == [keyed_digest(KEY, p.clone()) for p in pieces]


def test_host_shm_transfer_delivers_the_bytes_and_removes_its_file():
    before = staging_files()
    staging = blocks(70)
    rx, got = receiver()
    try:
        report = HostShmTransport(rx.address, KEY, LAYOUT).send(transfer(staging))
    finally:
        rx.close()
    assert report.status is TransferStatus.IMPORTED and report.blocks_sent == 70, report
    assert report.bytes_sent == 70 * BB
    assert [g.numel() for g in got] == [SHARED_MIN_BLOCKS_PER_CHUNK * BB, (70 - SHARED_MIN_BLOCKS_PER_CHUNK) * BB]
    assert torch.equal(torch.cat(got).view(70, BB), staging)
    assert staging_files() == before


class FlippedAfterDigest(HostShmStaging):
    """The shared file has one byte flipped; the digests are taken over the intact bytes."""

    def __init__(self, staging: torch.Tensor) -> None:
        super().__init__(staging)
        self.intact = staging.reshape(-1).clone()
        self._map[5 * BB + 3] ^= 0x01  # inside block 5: the first chunk

    @property
    def data(self) -> torch.Tensor:
        return self.intact


def test_a_corrupted_shared_buffer_is_rejected_and_nothing_imported():
    rx, got = receiver()
    try:
        t = SharedBufferTransport(rx.address, KEY, LAYOUT, FlippedAfterDigest, device="cpu")
        report = t.send(transfer(blocks(20)))
    finally:
        rx.close()
    assert report.status is TransferStatus.REJECTED and report.reason == "bad_digest"
    assert got == []


def test_a_receiver_without_landing_rejects_shared_chunks():
    rx, got = receiver(landing=False)
    try:
        report = HostShmTransport(rx.address, KEY, LAYOUT).send(transfer(blocks(2)))
    finally:
        rx.close()
    assert report.status is TransferStatus.REJECTED and report.reason == "shared_unsupported" and got == []


def test_shared_handles_name_only_staging_files_and_unknown_kinds_are_refused():
    for name in ("../etc/passwd", "passwd", SHM_PREFIX + "x/../../y"):
        with pytest.raises(WireError) as e:
            open_shared("host_shm", {"path": name, "nbytes": 4})
        assert e.value.reason == "shared_open"
    with pytest.raises(WireError) as e:
        open_shared("rdma", {})
    assert e.value.reason == "shared_kind"


def test_checker_holds_shared_chunks_to_the_same_sizes():
    hashes = block_hashes(b"t", list(range(2 * BS)), BS)
    head = {"transfer_id": "x", "seq": 0, "last": True, "model": "m", "namespace": b"t".hex(), "first_block": 0,
            "hashes": [h.hex() for h in hashes], "tokens": [list(range(BS)), list(range(BS, 2 * BS))],
            "layers": [0, 2], "dtype": "bfloat16", "block_bytes": BB, "prefix_hashes": []}
    ok = {"kind": "host_shm", "handle": {}, "offset": 0, "nbytes": 2 * BB, "digest": "0"}
    assert ChainChecker(LAYOUT).check({**head, "shared": ok}, b"").shared.nbytes == 2 * BB
    for bad, payload in (({**ok, "nbytes": BB}, b""), (ok, b"x" * 2 * BB), ({**ok, "offset": -1}, b"")):
        with pytest.raises(WireError) as e:
            ChainChecker(LAYOUT).check({**head, "shared": bad}, payload)
        assert e.value.reason == "size"
    with pytest.raises(WireError) as e:
        ChainChecker(LAYOUT).check({**head, "shared": {"kind": "host_shm"}}, b"")
    assert e.value.reason == "bad_header"


# ----------------------------------------------------------------------------- CUDA IPC (GPU hosts)

SENDER = r"""
import json, sys, torch
from engine.disagg.api import derive_transfer_key
from engine.disagg.shared_transport import CudaIpcStaging, SharedBufferTransport
from engine.disagg.wire import EngineLayout
from tests.disagg.test_shared_transport import BB, LAYOUT, blocks, transfer
address, device, corrupt = sys.argv[1], sys.argv[2], sys.argv[3] == "1"

class Flipped(CudaIpcStaging):  # one shared byte flipped after the digests' source was copied
    def __init__(self, staging):
        self.intact = staging.reshape(-1).clone()
        super().__init__(staging)
        self._tensor[5 * BB + 3] ^= 1
        torch.cuda.synchronize()

    @property
    def data(self):
        return self.intact

share = Flipped if corrupt else CudaIpcStaging
t = SharedBufferTransport(address, derive_transfer_key("shared"), LAYOUT, share, device=device)
r = t.send(transfer(blocks(20).to(device)))
print(json.dumps({"status": r.status.value, "reason": r.reason, "blocks": r.blocks_sent}))
"""


def send_from_another_process(address: str, device: str, corrupt: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", SENDER, address, device, "1" if corrupt else "0"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


GPU_PAIRS = [("cuda:0", "cuda:0"), ("cuda:0", "cuda:1")]


@pytest.mark.gpu
@pytest.mark.parametrize(("send_dev", "recv_dev"), GPU_PAIRS, ids=["one-gpu", "gpu0-to-gpu1"])
def test_cuda_ipc_moves_device_bytes_between_processes_and_catches_corruption(send_dev, recv_dev):
    if not torch.cuda.is_available() or torch.cuda.device_count() <= int(recv_dev[-1]):
        pytest.skip(f"needs {recv_dev}")
    rx, got = receiver(recv_dev)
    try:
        good = send_from_another_process(rx.address, send_dev, corrupt=False)
        n_good = len(got)
        bad = send_from_another_process(rx.address, send_dev, corrupt=True)
    finally:
        rx.close()
    assert good == {"status": "imported", "reason": "", "blocks": 20}
    assert torch.equal(torch.cat(got[:n_good]).view(20, BB), blocks(20))
    assert bad["status"] == "rejected" and bad["reason"] == "bad_digest" and len(got) == n_good


def test_runner_blocks_round_trip_through_a_shared_buffer_into_another_runner(tiny_model_dir):
    """Real KV: runner A computes a prompt's blocks, ships them (device staging, /dev/shm), runner B
    imports them; B's blocks then hold A's bytes exactly."""
    a, b = (ModelRunner(EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=16, block_size=8)) for _ in range(2))
    a.forward(ScheduledBatch([SequenceChunk("p", list(range(3000, 3040)), 0, [0, 1, 2, 3, 4], True,
                                            SamplingParams(max_tokens=1, temperature=0))]))
    staging = a.export_blocks_device([1, 2, 3])
    assert torch.equal(staging, a.export_blocks([1, 2, 3]))
    layout = EngineLayout("tiny", str(a.kv_dtype), 8, a.spec.num_layers, a.kv_bytes_per_block)
    landed: list[int] = []

    def importer(chunk, chain) -> Future:
        dst = [9, 10, 11][:chunk.num_blocks]
        b.import_blocks(dst, chunk.payload.view(chunk.num_blocks, layout.block_bytes))
        landed.extend(dst)
        f: Future = Future()
        f.set_result(ImportOutcome(chunk.num_blocks, chunk.num_blocks))
        return f

    rx = KVReceiver("127.0.0.1", 0, KEY, layout, importer, TransferMetrics(CollectorRegistry()),
                    landing=landing_for(KEY, "cpu"))
    tokens = list(range(3 * 8))
    t = OutgoingTransfer("r", b"t", tuple(block_hashes(b"t", tokens, 8)),
                         tuple(tuple(tokens[i * 8:(i + 1) * 8]) for i in range(3)), staging)
    try:
        report = HostShmTransport(rx.address, KEY, layout).send(t)
    finally:
        rx.close()
    assert report.status is TransferStatus.IMPORTED and landed == [9, 10, 11]
    assert torch.equal(b.export_blocks([9, 10, 11]), a.export_blocks([1, 2, 3]))
    assert not torch.equal(b.export_blocks([9]), b.export_blocks([5]))  # the import wrote real KV


def test_an_import_is_held_for_the_tenant_key_the_transfer_carries():
    """Over the shared buffer (the chunk is rebuilt around its landed bytes): the tenant key stays,
    and the import's scope is that tenant's, without a quota (node calls carry none)."""
    import dataclasses

    from engine.disagg.node import import_scope

    chunks: list = []

    def importer(chunk, chain) -> Future:
        chunks.append(chunk)
        f: Future = Future()
        f.set_result(ImportOutcome(chunk.num_blocks, chunk.num_blocks))
        return f

    rx = KVReceiver("127.0.0.1", 0, KEY, LAYOUT, importer, TransferMetrics(CollectorRegistry()),
                    landing=landing_for(KEY, "cpu"))
    try:
        t = dataclasses.replace(transfer(blocks(3)), tenant_key=b"tenant-key-a")
        assert HostShmTransport(rx.address, KEY, LAYOUT).send(t).status is TransferStatus.IMPORTED
    finally:
        rx.close()
    scope = import_scope(chunks[0])
    assert chunks[0].tenant_key == b"tenant-key-a" and chunks[0].shared is not None
    assert (scope.namespace, scope.tenant_key, scope.kv_block_quota) == (b"t", b"tenant-key-a", None)
