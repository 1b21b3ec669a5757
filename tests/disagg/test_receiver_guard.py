"""The KV receiver's port against peers without the node token: idle or junk connections take no
transfer slot and make the receiver allocate nothing they declare; a connection that stalls before
it authenticates, or mid-frame after, is closed at its deadline (a real receiver on loopback, the
importer a recording double)."""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from concurrent.futures import Future

from prometheus_client import CollectorRegistry

from engine.disagg.api import TransferStatus, derive_transfer_key
from engine.disagg.metrics import TransferMetrics
from engine.disagg.receiver import ImportOutcome, KVReceiver
from engine.disagg.transport import OutgoingTransfer, SocketTransport, connect_receiver, parse_address
from engine.disagg.wire import HELLO_BYTES, EngineLayout, FrameKind, encode_frame
from engine.prefix_index import block_hashes

BS = 4
LAYOUT = EngineLayout("tiny", "float32", BS, 2, 64)
KEY = derive_transfer_key("tok")
HASHES = tuple(block_hashes(b"t", list(range(8 * BS)), BS))


def receiver(registry: CollectorRegistry, **limits) -> tuple[KVReceiver, list]:
    got: list = []

    def importer(chunk, chain) -> Future:
        got.append(chunk.num_blocks)
        f: Future = Future()
        f.set_result(ImportOutcome(chunk.num_blocks, chunk.num_blocks))
        return f

    return KVReceiver("127.0.0.1", 0, KEY, LAYOUT, importer, TransferMetrics(registry), **limits), got


def transfer(n: int) -> OutgoingTransfer:
    tokens = tuple(tuple(range(i * BS, (i + 1) * BS)) for i in range(n))
    return OutgoingTransfer("x", b"t", HASHES[:n], tokens, memoryview(bytes(range(64)) * n))


def unauthenticated(address: str) -> socket.socket:
    """What the audit's script sent: a frame prefix without the key that claims a full-size chunk."""
    s = socket.create_connection(parse_address(address))
    s.sendall(struct.pack(">4sBBIQ", b"PGKV", 1, int(FrameKind.CHUNK), 2, 256 * LAYOUT.block_bytes) + b"{}")
    return s


def closed_by_peer(s: socket.socket, within_s: float) -> bool:
    """True when the receiver closes ``s`` within ``within_s`` (its hello is read away first)."""
    s.settimeout(within_s)
    try:
        while s.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:
        return True
    return True


def failures(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value("prefixgate_kv_transfer_failures_total",
                                     {"side": "receive", "reason": reason}) or 0.0


def test_idle_unauthenticated_connections_do_not_take_the_transfer_slots():
    registry = CollectorRegistry()
    rx, got = receiver(registry, max_connections=2)
    idle = [unauthenticated(rx.address) for _ in range(6)]  # three times the slots
    try:
        time.sleep(0.2)  # every one accepted and waiting
        report = SocketTransport(rx.address, KEY, LAYOUT, blocks_per_chunk=2).send(transfer(5))
    finally:
        for s in idle:
            s.close()
        rx.close()
    assert report.status is TransferStatus.IMPORTED and got == [2, 2, 1]
    assert failures(registry, "too_many_connections") == 0


def test_beyond_max_pending_the_oldest_unauthenticated_connection_is_closed():
    registry = CollectorRegistry()
    rx, _ = receiver(registry, max_pending=2, auth_timeout_s=30)
    try:
        first = unauthenticated(rx.address)
        time.sleep(0.1)
        rest = [unauthenticated(rx.address) for _ in range(2)]
        assert closed_by_peer(first, within_s=5)  # long before its 30 s authentication deadline
        report = SocketTransport(rx.address, KEY, LAYOUT).send(transfer(2))  # evicts one more, gets in
    finally:
        for s in [first, *rest]:
            s.close()
        rx.close()
    assert report.status is TransferStatus.IMPORTED
    assert failures(registry, "evicted_unauthenticated") >= 2


def test_a_connection_that_never_authenticates_is_closed_at_its_deadline():
    registry = CollectorRegistry()
    rx, _ = receiver(registry, auth_timeout_s=0.3)
    try:
        with socket.create_connection(parse_address(rx.address)) as s:
            s.sendall(b"PGKV")  # then nothing: the slowloris way
            t0 = time.monotonic()
            assert closed_by_peer(s, within_s=5)
            assert time.monotonic() - t0 < 3
    finally:
        rx.close()
    assert failures(registry, "auth_timeout") == 1


def test_a_sender_trickling_a_frame_is_cut_at_the_frame_deadline():
    """Per-recv timeouts let one byte a minute hold a slot for ever: the deadline is for the frame."""
    registry = CollectorRegistry()
    rx, got = receiver(registry, frame_timeout_s=0.6)
    try:
        s, nonce = connect_receiver(*parse_address(rx.address), timeout_s=5)
        with s:
            first, payload, _ = encode_frame(KEY, nonce, FrameKind.CHUNK, {}, bytes(4 * 64))
            s.sendall(first)  # an authenticated prefix and header; then the payload, one byte every 0.1 s
            t0 = time.monotonic()
            with contextlib.suppress(OSError):
                for b in bytes(payload):
                    s.sendall(bytes([b]))
                    time.sleep(0.1)
                    if time.monotonic() - t0 > 10:
                        break
            elapsed = time.monotonic() - t0
    finally:
        rx.close()
    assert elapsed < 5  # the receiver closed the connection; the sender's writes failed
    assert failures(registry, "timeout") == 1 and got == []


def test_the_hello_is_all_an_unauthenticated_peer_reads():
    rx, _ = receiver(CollectorRegistry(), auth_timeout_s=0.5)
    try:
        with socket.create_connection(parse_address(rx.address)) as s:
            s.settimeout(5)
            data = b""
            with contextlib.suppress(OSError):
                while chunk := s.recv(4096):
                    data += chunk
    finally:
        rx.close()
    assert len(data) == HELLO_BYTES and data[:4] == b"PGKV"
