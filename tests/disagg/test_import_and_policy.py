"""Torch-free pieces of the split: the cache manager's import of foreign KV, the split policy, and
the socket transport against a real receiver on loopback (the importer is a recording double)."""

from __future__ import annotations

import sys
from concurrent.futures import Future
from pathlib import Path

from prometheus_client import CollectorRegistry

from engine.disagg.api import LookupResult, TransferStatus, derive_transfer_key
from engine.disagg.metrics import TransferMetrics
from engine.disagg.receiver import ImportOutcome, KVReceiver
from engine.disagg.transport import OutgoingTransfer, SocketTransport
from engine.disagg.wire import EngineLayout
from engine.kv_cache_manager import KVCacheManager
from engine.kv_types import QueueReason
from engine.prefix_index import block_hashes
from engine.protocol import StaticTenantScope
from gateway.disagg_client import Placement, SplitPolicy, reachable_receiver

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine_core"))
import contextlib

from engine_core_fakes import make_request  # noqa: E402

BS = 4
TENANT = StaticTenantScope(namespace=b"t")
CHAIN = tuple(block_hashes(b"t", list(range(24)), BS))  # 6 blocks
LONG = tuple(block_hashes(b"t", list(range(64 * BS)), BS))  # 64 blocks


def test_import_chain_indexes_blocks_a_later_request_hits():
    cache = KVCacheManager(8, BS)
    written: list[tuple[list[int], int]] = []
    assert cache.import_chain(TENANT, CHAIN[:3], 0, lambda ids, first: written.append((ids, first))) == 3
    assert cache.import_chain(TENANT, CHAIN, 3, lambda ids, first: written.append((ids, first))) == 3
    assert [first for _, first in written] == [0, 3]
    assert cache.num_used == 0 and cache.num_evictable == 6
    cache.check_integrity([])
    req = make_request("r", list(range(24)) + [7], tenant=TENANT, block_size=BS)
    assert cache.match(req).cached_tokens == 24


def test_import_chain_skips_resident_blocks_and_needs_its_prefix():
    cache = KVCacheManager(8, BS)
    cache.import_chain(TENANT, CHAIN[:2], 0, lambda ids, first: None)
    seen: list[int] = []
    assert cache.import_chain(TENANT, CHAIN[:4], 0, lambda ids, first: seen.append(first)) == 2
    assert seen == [2]  # blocks 0-1 were resident: neither written nor re-imported
    fresh = KVCacheManager(8, BS)
    assert fresh.import_chain(TENANT, CHAIN, 4, lambda ids, first: None) == 0  # chain broken: a miss
    assert fresh.num_indexed == 0
    fresh.check_integrity([])


def test_import_chain_refuses_without_room_and_changes_nothing():
    cache = KVCacheManager(4, BS)
    assert cache.import_chain(TENANT, CHAIN, 0, lambda ids, first: None) is QueueReason.NO_KV_BLOCKS
    capped = StaticTenantScope(namespace=b"t", kv_block_quota=2)
    assert cache.import_chain(capped, CHAIN[:3], 0, lambda ids, first: None) is QueueReason.TENANT_OVER_QUOTA
    assert cache.num_used == 0 and cache.num_indexed == 0
    cache.check_integrity([])


def test_import_chain_write_failure_frees_the_fresh_blocks():
    cache = KVCacheManager(8, BS)

    def boom(ids, first):
        raise RuntimeError("device copy failed")

    with contextlib.suppress(RuntimeError):
        cache.import_chain(TENANT, CHAIN[:3], 0, boom)
    assert cache.num_used == 0 and cache.num_indexed == 0 and cache.num_free == 8
    cache.check_integrity([])


def test_split_policy():
    p = SplitPolicy(min_split_tokens=256, max_prefill_queue=2)
    assert p.decide(LookupResult(100, 0, 3, 0), 0) == (Placement.COLOCATED, "short_prompt")
    assert p.decide(LookupResult(1000, 960, 3, 0), 0) == (Placement.COLOCATED, "cached_on_decode")
    assert p.decide(LookupResult(1000, 0, 3, 0), 2) == (Placement.COLOCATED, "prefill_busy")
    assert p.decide(LookupResult(1000, 0, 3, 0), 1) == (Placement.SPLIT, "long_uncached_prompt")
    idle = SplitPolicy(split_when_decode_idle=False)
    assert idle.decide(LookupResult(1000, 0, 0, 0), 0) == (Placement.COLOCATED, "decode_idle")


def test_a_receiver_on_a_wildcard_host_is_reached_where_the_gateway_reaches_its_node():
    # a decode node bound to 0.0.0.0 / :: without --kv-advertise-host: that host is nowhere to connect to
    assert reachable_receiver("0.0.0.0:8202", "http://10.0.0.5:8102") == "10.0.0.5:8202"
    assert reachable_receiver("[::]:8202;shared=cuda_ipc;host=ab12", "http://[fd00::5]:8102") == \
        "[fd00::5]:8202;shared=cuda_ipc;host=ab12"
    assert reachable_receiver("0.0.0.0:8202", "http://decode-1.internal:8102") == "decode-1.internal:8202"
    # a concrete host (bound, or --kv-advertise-host) is the node's to choose: passed on as given
    assert reachable_receiver("10.1.1.1:8202", "http://10.0.0.5:8102") == "10.1.1.1:8202"


LAYOUT = EngineLayout("tiny", "float32", BS, 2, 64)
KEY = derive_transfer_key("tok")


def transfer(n: int) -> OutgoingTransfer:
    tokens = tuple(tuple(range(i * BS, (i + 1) * BS)) for i in range(n))
    return OutgoingTransfer("x", b"t", LONG[:n], tokens, memoryview(bytes(range(256)) * (n // 4 + 1))[: n * 64])


def serve(outcome, **limits) -> tuple[KVReceiver, list]:
    got: list = []

    def importer(chunk, chain) -> Future:
        got.append((chunk.first_block, chunk.num_blocks, bytes(chunk.payload), len(chain)))
        f: Future = Future()
        f.set_result(outcome(chunk))
        return f

    return KVReceiver("127.0.0.1", 0, KEY, LAYOUT, importer, TransferMetrics(CollectorRegistry()), **limits), got


def test_socket_transport_delivers_chunks_in_order_and_reads_the_ack():
    rx, got = serve(lambda c: ImportOutcome(c.num_blocks, c.num_blocks))
    try:
        t = transfer(6)
        report = SocketTransport(rx.address, KEY, LAYOUT, blocks_per_chunk=4).send(t)
    finally:
        rx.close()
    assert report.status is TransferStatus.IMPORTED and report.blocks_imported == 6 and report.blocks_sent == 6
    assert [(g[0], g[1], g[3]) for g in got] == [(0, 4, 4), (4, 2, 6)]
    assert b"".join(g[2] for g in got) == bytes(t.staging)


def test_a_refusing_receiver_answers_refused():
    rx, _ = serve(lambda c: ImportOutcome(0, 0, QueueReason.NO_KV_BLOCKS.value))
    try:
        report = SocketTransport(rx.address, KEY, LAYOUT).send(transfer(3))
    finally:
        rx.close()
    assert report.status is TransferStatus.REFUSED and report.reason == "no_kv_blocks"


def test_a_sender_with_another_key_is_rejected_and_nothing_imported():
    rx, got = serve(lambda c: ImportOutcome(c.num_blocks, c.num_blocks))
    try:
        report = SocketTransport(rx.address, derive_transfer_key("wrong"), LAYOUT).send(transfer(3))
    finally:
        rx.close()
    # the receiver's ack is MAC'd under the real key, so this sender cannot trust it either
    assert report.status is TransferStatus.FAILED and "bad_mac" in report.reason and got == []


def test_a_bad_first_chunk_of_many_still_gets_its_rejection_back():
    rx, got = serve(lambda c: ImportOutcome(c.num_blocks, c.num_blocks))
    t = transfer(64)
    bad = OutgoingTransfer(t.transfer_id, b"other-tenant", t.hashes, t.tokens, t.staging)  # hashes not its chain
    try:
        report = SocketTransport(rx.address, KEY, LAYOUT, blocks_per_chunk=1).send(bad)
    finally:
        rx.close()
    assert report.status is TransferStatus.REJECTED and report.reason == "hash_chain" and got == []


def test_unreachable_receiver_is_a_failed_report_not_an_exception():
    rx, _ = serve(lambda c: ImportOutcome(0, 0))
    address = rx.address
    rx.close()
    report = SocketTransport(address, KEY, LAYOUT, timeout_s=2).send(transfer(1))
    assert report.status is TransferStatus.FAILED


def test_an_oversized_chunk_claim_is_refused_before_its_payload_is_read():
    import struct

    from engine.disagg.transport import SocketSource, connect_receiver, parse_address
    from engine.disagg.wire import FrameKind, _prefix_mac, read_frame

    rx, got = serve(lambda c: ImportOutcome(0, 0))
    try:
        s, nonce = connect_receiver(*parse_address(rx.address), timeout_s=10)
        with s:  # a sender with the key, claiming more than one chunk may carry
            prefix = struct.pack(">4sBBIQ", b"PGKV", 2, int(FrameKind.CHUNK), 2, 1 << 40)
            s.sendall(prefix + _prefix_mac(KEY, nonce, prefix) + b"{}")
            kind, ack, _ = read_frame(SocketSource(s), KEY, nonce, max_payload=0)
    finally:
        rx.close()
    assert kind is FrameKind.ACK and ack["status"] == "rejected" and ack["reason"] == "too_large" and got == []
