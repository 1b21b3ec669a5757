"""How a transfer's chunks travel: one ``KVTransport`` Protocol, an implementation per topology.

    topology                         transport              data path
    ------------------------------   --------------------   --------------------------------------
    across hosts, or CPU engines     SocketTransport        blocks gathered into one contiguous
                                                            staging buffer, sent in MAC'd chunks
    one host, GPU engines            CudaIpcTransport       the staging buffer stays in device
    (one GPU, or two: GPU 0 -> 1)                           memory; chunks carry its CUDA IPC handle
                                                            and the receiver copies device to device
    one host, CPU engines (opt-in)   HostShmTransport       staging in a /dev/shm file, same frames

``choose_transport`` picks by where the two engines are (the receiver's advertised address says
what it can open and on which host it runs). All speak the frame format of ``engine.disagg.wire``
over a TCP control connection, so the receiver checks the same header, hashes and MAC whichever
way the bytes came. The two shared-buffer transports live in ``engine.disagg.shared_transport``
(torch); CI runs the socket and /dev/shm ones, the CUDA IPC one runs on GPU machines.
"""

from __future__ import annotations

import hashlib
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from engine.disagg.api import TransferReport, TransferStatus
from engine.disagg.wire import (
    Chunk,
    EngineLayout,
    SizedBuffer,
    WireError,
    encode_chunk,
    read_frame,
    read_hello,
    split_blocks,
)
from engine.kv_types import BlockHash

DEFAULT_BLOCKS_PER_CHUNK = 16


@dataclass(frozen=True)
class OutgoingTransfer:
    """One request's full prompt blocks ``len(prefix) ..``, ready to send.

    ``staging`` holds the blocks back to back (``len(hashes) * layout.block_bytes`` bytes, the
    model runner's export layout: a CPU memoryview for the socket, a torch tensor
    [n, block_bytes] on ``KVTransport.staging_device`` for a shared-buffer transport); ``tokens[i]`` are block i's token ids (the receiver recomputes
    the hash chain from them). ``prefix``: hashes of the leading blocks the receiver already holds
    (not sent)."""

    transfer_id: str
    namespace: bytes
    hashes: tuple[BlockHash, ...]
    tokens: tuple[tuple[int, ...], ...]
    staging: memoryview | SizedBuffer
    prefix: tuple[BlockHash, ...] = ()
    tenant_key: bytes = b""  # who the receiver holds the blocks for ("" = the namespace)

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)


class KVTransport(Protocol):
    """Moves one transfer to a receiver.

    Contract: ``send`` sends every chunk in chain order, then waits for the receiver's ack and
    returns what the receiver did. It never raises for a network or peer failure: those are a
    ``TransferReport`` with ``TransferStatus.FAILED`` (the decode engine then recomputes).
    ``staging_device``: where the exporter must put the staging bytes ("cpu": host memory)."""

    staging_device: str

    def send(self, transfer: OutgoingTransfer) -> TransferReport: ...


class SocketSource:
    """``wire.ByteSource`` over a connected socket. With a ``deadline`` (``time.monotonic()``),
    every read must be done by then, however the peer paces its bytes (a peer that sends one byte
    a minute cannot hold the connection past it): ``TimeoutError`` after."""

    def __init__(self, sock: socket.socket, deadline: float | None = None) -> None:
        self.sock = sock
        self.deadline = deadline

    def read_exactly(self, n: int) -> bytes:
        buf = bytearray(n)
        self.read_into(buf)
        return bytes(buf)

    def read_into(self, buf: bytearray) -> None:
        view, got = memoryview(buf), 0
        while got < len(buf):
            if self.deadline is not None:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"deadline passed after {got} of {len(buf)} bytes")
                self.sock.settimeout(left)
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise EOFError(f"peer closed after {got} of {len(buf)} bytes")
            got += k


def connect_receiver(host: str, port: int, timeout_s: float) -> tuple[socket.socket, bytes]:
    """A connection to a KV receiver and the nonce of its hello (every frame's MAC covers it)."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock, read_hello(SocketSource(sock))
    except BaseException:
        sock.close()
        raise


CUDA_IPC = "cuda_ipc"


@dataclass(frozen=True)
class ReceiverAddress:
    """A decode engine's advertised receiver: ``host:port[;shared=kind,..;host=id]``. The optional
    part says which shared-buffer transfers it can open and on which host it runs, so a sender on
    the same host (same ``host_identity``) may skip the socket for the bytes."""

    host: str
    port: int
    shared: tuple[str, ...] = ()
    host_id: str = ""


def host_identity() -> str:
    """Equal for every process of one running host (boot id and host name), different elsewhere."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return hashlib.sha256(f"{boot}|{socket.gethostname()}".encode()).hexdigest()[:16]


def advertise(address: str, shared: tuple[str, ...]) -> str:
    """``host:port`` plus what this receiver can open (nothing added when ``shared`` is empty)."""
    return f"{address};shared={','.join(shared)};host={host_identity()}" if shared else address


def parse_receiver(address: str) -> ReceiverAddress:
    base, *extras = address.split(";")
    host, port = parse_address(base)
    fields = dict(e.partition("=")[::2] for e in extras)
    shared = tuple(k for k in fields.get("shared", "").split(",") if k)
    return ReceiverAddress(host, port, shared, fields.get("host", ""))


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` (an advertised address's extra fields are ignored)."""
    address = address.split(";", 1)[0]
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"KV receiver address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def chunks_of(transfer: OutgoingTransfer, layout: EngineLayout, blocks_per_chunk: int) -> list[Chunk]:
    """The transfer cut into chunks of at most ``blocks_per_chunk`` blocks (views, no copy)."""
    bb = layout.block_bytes
    assert isinstance(transfer.staging, memoryview), "the socket sends host bytes"
    if transfer.staging.nbytes != transfer.num_blocks * bb:
        raise ValueError(f"staging holds {transfer.staging.nbytes} bytes, expected {transfer.num_blocks} x {bb}")
    ranges = split_blocks(transfer.num_blocks, blocks_per_chunk)
    skip = len(transfer.prefix)
    return [
        Chunk(transfer.transfer_id, seq, seq == len(ranges) - 1, transfer.namespace, skip + r.start,
              transfer.hashes[r.start:r.stop], transfer.tokens[r.start:r.stop], (0, layout.num_layers),
              transfer.staging[r.start * bb : r.stop * bb], transfer.prefix if seq == 0 else (),
              tenant_key=transfer.tenant_key)
        for seq, r in enumerate(ranges)
    ]


class SocketTransport:
    """TCP to a decode engine's receiver (loopback or remote). One connection per transfer."""

    def __init__(self, address: str, key: bytes, layout: EngineLayout, *,
                 blocks_per_chunk: int = DEFAULT_BLOCKS_PER_CHUNK, timeout_s: float = 60.0) -> None:
        self.host, self.port = parse_address(address)
        self.key, self.layout = key, layout
        self.blocks_per_chunk = blocks_per_chunk
        self.timeout_s = timeout_s
        self.staging_device = "cpu"

    def send(self, transfer: OutgoingTransfer) -> TransferReport:
        t0 = time.perf_counter()
        sent_blocks = sent_bytes = 0
        try:
            sock, nonce = connect_receiver(self.host, self.port, self.timeout_s)
            with sock:
                for chunk in chunks_of(transfer, self.layout, self.blocks_per_chunk):
                    parts = encode_chunk(self.key, nonce, self.layout, chunk)
                    send_all(sock, parts)
                    sent_blocks += chunk.num_blocks
                    sent_bytes += sum(memoryview(p).nbytes for p in parts)
                _kind, ack, _ = read_frame(SocketSource(sock), self.key, nonce, max_payload=0)
        except (OSError, EOFError, WireError) as exc:
            return TransferReport(TransferStatus.FAILED, sent_blocks, 0, sent_bytes, time.perf_counter() - t0,
                                  f"{type(exc).__name__}: {exc}")
        return report_from_ack(ack, sent_blocks, sent_bytes, time.perf_counter() - t0)


def send_all(sock: socket.socket, parts: Sequence[bytes | memoryview]) -> None:
    """``sendmsg`` until every buffer is out (it may send less than asked)."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = sock.sendmsg(views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def report_from_ack(ack: dict[str, Any], blocks: int, nbytes: int, seconds: float) -> TransferReport:
    try:
        status = TransferStatus(ack["status"])
        imported = int(ack.get("blocks_imported", 0))
    except (KeyError, ValueError, TypeError):
        return TransferReport(TransferStatus.FAILED, blocks, 0, nbytes, seconds, "malformed ack")
    return TransferReport(status, blocks, imported, nbytes, seconds, str(ack.get("reason", "")))


def choose_transport(address: str, key: bytes, layout: EngineLayout, *, device: str,
                     blocks_per_chunk: int = DEFAULT_BLOCKS_PER_CHUNK) -> KVTransport:
    """CUDA IPC when this engine is a GPU engine and the receiver advertises CUDA IPC from this same
    host (``advertise``); else the socket."""
    target = parse_receiver(address)
    if device.startswith("cuda") and CUDA_IPC in target.shared and target.host_id == host_identity():
        from engine.disagg.shared_transport import CudaIpcTransport

        return CudaIpcTransport(address, key, layout, device, blocks_per_chunk=blocks_per_chunk)
    return SocketTransport(address, key, layout, blocks_per_chunk=blocks_per_chunk)
