"""How a transfer's chunks travel: one ``KVTransport`` Protocol, an implementation per topology.

    topology                         transport              data path
    ------------------------------   --------------------   --------------------------------------
    across hosts, or CPU engines     SocketTransport        blocks gathered into one contiguous
                                                            staging buffer, sent in MAC'd chunks
    one host, GPU to GPU             CudaIpcTransport       the staging buffer stays in device
                                                            memory; chunks carry its CUDA IPC handle
                                                            and the receiver copies device to device

``choose_transport`` picks by where the two engines are. Both speak the frame format of
``engine.disagg.wire`` over a TCP control connection, so the receiver checks the same header,
hashes and MAC whichever way the bytes came. CI exercises the socket transport; the CUDA IPC one
is GPU-only (its chunk layout is checked on CPU).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine.disagg.api import TransferReport, TransferStatus
from engine.disagg.wire import (
    Chunk,
    EngineLayout,
    WireError,
    encode_chunk,
    read_frame,
    split_blocks,
)
from engine.kv_types import BlockHash

DEFAULT_BLOCKS_PER_CHUNK = 16


@dataclass(frozen=True)
class OutgoingTransfer:
    """One request's full prompt blocks ``len(prefix) ..``, ready to send.

    ``staging`` holds the blocks back to back (``len(hashes) * layout.block_bytes`` bytes, the
    model runner's export layout); ``tokens[i]`` are block i's token ids (the receiver recomputes
    the hash chain from them). ``prefix``: hashes of the leading blocks the receiver already holds
    (not sent)."""

    transfer_id: str
    namespace: bytes
    hashes: tuple[BlockHash, ...]
    tokens: tuple[tuple[int, ...], ...]
    staging: memoryview
    prefix: tuple[BlockHash, ...] = ()

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)


class KVTransport(Protocol):
    """Moves one transfer to a receiver.

    Contract: ``send`` sends every chunk in chain order, then waits for the receiver's ack and
    returns what the receiver did. It never raises for a network or peer failure: those are a
    ``TransferReport`` with ``TransferStatus.FAILED`` (the decode engine then recomputes)."""

    def send(self, transfer: OutgoingTransfer) -> TransferReport: ...


class SocketSource:
    """``wire.ByteSource`` over a connected socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def read_exactly(self, n: int) -> bytes:
        buf = bytearray(n)
        self.read_into(buf)
        return bytes(buf)

    def read_into(self, buf: bytearray) -> None:
        view, got = memoryview(buf), 0
        while got < len(buf):
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise EOFError(f"peer closed after {got} of {len(buf)} bytes")
            got += k


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"KV receiver address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def chunks_of(transfer: OutgoingTransfer, layout: EngineLayout, blocks_per_chunk: int) -> list[Chunk]:
    """The transfer cut into chunks of at most ``blocks_per_chunk`` blocks (views, no copy)."""
    bb = layout.block_bytes
    if transfer.staging.nbytes != transfer.num_blocks * bb:
        raise ValueError(f"staging holds {transfer.staging.nbytes} bytes, expected {transfer.num_blocks} x {bb}")
    ranges = split_blocks(transfer.num_blocks, blocks_per_chunk)
    skip = len(transfer.prefix)
    return [
        Chunk(transfer.transfer_id, seq, seq == len(ranges) - 1, transfer.namespace, skip + r.start,
              transfer.hashes[r.start:r.stop], transfer.tokens[r.start:r.stop], (0, layout.num_layers),
              transfer.staging[r.start * bb : r.stop * bb], transfer.prefix if seq == 0 else ())
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

    def send(self, transfer: OutgoingTransfer) -> TransferReport:
        t0 = time.perf_counter()
        sent_blocks = sent_bytes = 0
        try:
            with socket.create_connection((self.host, self.port), timeout=self.timeout_s) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for chunk in chunks_of(transfer, self.layout, self.blocks_per_chunk):
                    parts = encode_chunk(self.key, self.layout, chunk)
                    send_all(sock, parts)
                    sent_blocks += chunk.num_blocks
                    sent_bytes += sum(memoryview(p).nbytes for p in parts)
                _kind, ack, _ = read_frame(SocketSource(sock), self.key, max_payload=0)
        except (OSError, EOFError, WireError) as exc:
            return TransferReport(TransferStatus.FAILED, sent_blocks, 0, sent_bytes, time.perf_counter() - t0,
                                  f"{type(exc).__name__}: {exc}")
        return _report_from_ack(ack, sent_blocks, sent_bytes, time.perf_counter() - t0)


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


def _report_from_ack(ack: dict[str, Any], blocks: int, nbytes: int, seconds: float) -> TransferReport:
    try:
        status = TransferStatus(ack["status"])
        imported = int(ack.get("blocks_imported", 0))
    except (KeyError, ValueError, TypeError):
        return TransferReport(TransferStatus.FAILED, blocks, 0, nbytes, seconds, "malformed ack")
    return TransferReport(status, blocks, imported, nbytes, seconds, str(ack.get("reason", "")))


class CudaIpcTransport:
    """One host, GPU engines in different processes: the staging buffer stays in device memory.

    Design (GPU-only; the device-side copy is not built yet, see docs/disaggregation.md): the
    sender gathers the blocks into one contiguous device staging tensor and shares it once per
    transfer through a CUDA IPC handle (``torch.multiprocessing.reductions.reduce_tensor``); each
    chunk frame carries the usual header (hashes, tokens, layers, dtype, MAC'd) plus the chunk's
    byte range of that tensor instead of the bytes; the receiver opens the handle and copies
    device to device into its blocks, then acks, after which the sender may free the staging
    tensor. Between two GPUs of a host the same frames drive ``torch.distributed`` NCCL
    ``send``/``recv`` of each range instead (NVLink multicast left off).

    What runs today: the chunk byte ranges (``chunk_ranges``, checked on CPU). ``send`` raises
    ``NotImplementedError`` rather than silently moving the bytes through the host.
    """

    def __init__(self, address: str, key: bytes, layout: EngineLayout, device: str, *,
                 blocks_per_chunk: int = DEFAULT_BLOCKS_PER_CHUNK) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("CudaIpcTransport needs CUDA; use SocketTransport on CPU")
        self.control = SocketTransport(address, key, layout, blocks_per_chunk=blocks_per_chunk)
        self.device = torch.device(device)

    @staticmethod
    def chunk_ranges(num_blocks: int, block_bytes: int, blocks_per_chunk: int) -> list[tuple[int, int]]:
        """(byte offset, byte length) of each chunk inside the device staging tensor."""
        return [(r.start * block_bytes, len(r) * block_bytes) for r in split_blocks(num_blocks, blocks_per_chunk)]

    def send(self, transfer: OutgoingTransfer) -> TransferReport:  # pragma: no cover - GPU only
        raise NotImplementedError("the CUDA IPC device-to-device copy is issue #23's; use SocketTransport")


def choose_transport(address: str, key: bytes, layout: EngineLayout, *, device: str,
                     same_host_gpu: bool, blocks_per_chunk: int = DEFAULT_BLOCKS_PER_CHUNK) -> KVTransport:
    """Socket unless both engines are GPU engines on this host (then CUDA IPC). Nothing passes
    ``same_host_gpu=True`` yet: the device path is not built (see ``CudaIpcTransport``)."""
    if same_host_gpu and device.startswith("cuda"):
        return CudaIpcTransport(address, key, layout, device, blocks_per_chunk=blocks_per_chunk)
    return SocketTransport(address, key, layout, blocks_per_chunk=blocks_per_chunk)
