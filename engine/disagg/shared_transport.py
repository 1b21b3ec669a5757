"""Transfers whose bytes never go through the socket: the sender shares its staging buffer.

    prefill process                                    decode process
    ---------------                                    --------------
    staging = gather(blocks)   [n, block_bytes] uint8
    share(staging) -> handle   CUDA IPC handle of the device tensor (cuda_ipc), or a file
                               under /dev/shm (host_shm, CPU engines on one host)
    per chunk: digest(key, staging[range])
    frame {hashes, tokens, layers, dtype,   ── TCP ──►  MAC + header + hash chain checked (wire)
           shared: {kind, handle, offset,              open(handle) once per transfer
                    nbytes, digest}} + MAC             local = copy of staging[range] onto this
                                                       engine's device (a peer copy GPU 0 -> GPU 1)
                                                       digest(key, local) == header's, else a miss
                                                       engine thread: import_blocks(local)
    free staging after the ack  ◄── ack ────────────   synchronize, drop the mapping, ack

The frame (and so the handle, range and digest) is under the transfer MAC like every chunk; the
bytes themselves never cross the socket, so instead of a MAC over them the header carries a keyed
checksum (``keyed_digest``) that the receiver recomputes on its own copy: a flipped byte, a
wrong range or a reused buffer is a mismatch (a miss, recomputed), never data. It is a keyed
linear checksum, not a cryptographic MAC: it guards against corruption and mix-ups between
processes of one host, whose GPU memory is inside the same trust boundary anyway.

Device indices differ between processes with different ``CUDA_VISIBLE_DEVICES``: the handle
names the GPU by UUID and the receiver maps it to its own index, so the same code runs with both
engines on one GPU or on two GPUs of one host (the copy is then a peer copy over NVLink/PCIe).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import mmap
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from engine.disagg.api import TransferReport, TransferStatus
from engine.disagg.transport import (
    DEFAULT_BLOCKS_PER_CHUNK,
    OutgoingTransfer,
    SocketSource,
    connect_receiver,
    parse_address,
    report_from_ack,
    send_all,
)
from engine.disagg.wire import (
    Chunk,
    EngineLayout,
    SharedRef,
    WireError,
    encode_chunk,
    read_frame,
    split_blocks,
)

CUDA_IPC = "cuda_ipc"
HOST_SHM = "host_shm"
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "prefixgate-kv-"

_DIGEST_COLUMNS = 512
_ROW_BYTES = 8 * _DIGEST_COLUMNS
# Shared chunks cost a frame round trip and an engine-thread hop each but move no bytes through
# the socket: fewer, larger ones (the socket's 16-block chunks bound its receive buffer instead).
SHARED_MIN_BLOCKS_PER_CHUNK = 64
_mults: dict[tuple[bytes, str], torch.Tensor] = {}


def _column_mults(key: bytes, device: torch.device) -> torch.Tensor:
    cache_key = (key, str(device))
    if cache_key not in _mults:
        seed = int.from_bytes(hmac.new(key, b"prefixgate kv digest v1", hashlib.sha256).digest()[:8], "big") >> 1
        g = torch.Generator().manual_seed(seed)
        # odd multipliers: a change d != 0 of one 64-bit word changes the sum by d * odd * odd != 0 mod 2^64
        m = torch.randint(-(2**62), 2**62, (_DIGEST_COLUMNS,), generator=g, dtype=torch.int64) | 1
        _mults[cache_key] = m.to(device)
    return _mults[cache_key]


def keyed_digests(key: bytes, data: torch.Tensor, nbytes: int) -> list[str]:
    """Keyed checksums of the consecutive ``nbytes`` pieces of uint8 ``data`` (any device; the last
    piece may be shorter), computed where the data is, with one device-to-host sync for all.

    Words w_ij (64-bit, rows of 512) -> sum_i r_i * sum_j m_j * w_ij mod 2^64 with odd key-derived
    m_j and odd row weights r_i: every change of a single word is caught, and integer sums are exact
    in any order, so the sender's GPU and the receiver's agree bit for bit."""
    flat = data.reshape(-1)
    if flat.dtype != torch.uint8:
        raise ValueError(f"keyed digests take uint8 bytes, got {flat.dtype}")
    n = flat.numel()
    if nbytes % _ROW_BYTES or n == 0:  # odd sizes: one piece at a time, zero padded
        pieces = [flat[i:i + nbytes] for i in range(0, n, nbytes)] or [flat]
        return [_one_digest(key, p) for p in pieces]
    rows_per_piece = nbytes // _ROW_BYTES
    full = n // nbytes
    sums = []
    if full:
        words = flat[: full * nbytes].view(torch.int64).view(full, rows_per_piece, _DIGEST_COLUMNS)
        row = (words * _column_mults(key, flat.device)).sum(dim=2)  # [pieces, rows]
        weights = torch.arange(rows_per_piece, dtype=torch.int64, device=flat.device) * 2 + 1
        sums.append((row * weights).sum(dim=1))
    out = [_finish(int(v), nbytes) for v in (torch.cat(sums).tolist() if sums else [])]
    if n % nbytes:
        out.append(_one_digest(key, flat[full * nbytes:]))
    return out


def keyed_digest(key: bytes, data: torch.Tensor) -> str:
    """``keyed_digests`` of ``data`` as one piece."""
    return _one_digest(key, data.reshape(-1))


def _one_digest(key: bytes, flat: torch.Tensor) -> str:
    if flat.dtype != torch.uint8:
        raise ValueError(f"keyed digests take uint8 bytes, got {flat.dtype}")
    n = flat.numel()
    pad = (-n) % _ROW_BYTES
    if pad or flat.storage_offset() % 8:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    words = flat.view(torch.int64).view(-1, _DIGEST_COLUMNS)
    row = (words * _column_mults(key, flat.device)).sum(dim=1)
    weights = torch.arange(row.numel(), dtype=torch.int64, device=flat.device) * 2 + 1
    return _finish(int((row * weights).sum().item()), n)


def _finish(total: int, n: int) -> str:
    return f"{(total + n) & 0xFFFF_FFFF_FFFF_FFFF:016x}"  # the length too: zero padding is not data


# ----------------------------------------------------------------------------- sender side


class SharedStaging(Protocol):
    """A staging buffer another process of this host can open while the sender keeps it alive."""

    kind: str

    @property
    def data(self) -> torch.Tensor:
        """Flat uint8 view of the shared bytes (the sender's digests read it)."""
        ...

    def handle(self) -> dict[str, Any]:
        """JSON the receiver's ``open_shared`` turns back into the same bytes."""
        ...

    def close(self) -> None:
        """After the ack: the receiver has dropped its mapping."""
        ...


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


class CudaIpcStaging:
    """A device tensor shared through a CUDA IPC memory handle (torch's own reduction, whose
    reference counting keeps the allocation alive while the receiver holds it)."""

    kind = CUDA_IPC

    def __init__(self, staging: torch.Tensor) -> None:
        if staging.device.type != "cuda":
            raise ValueError("CUDA IPC shares a CUDA tensor")
        from torch.multiprocessing.reductions import reduce_tensor

        self._tensor = staging.reshape(-1)
        _rebuild, args = reduce_tensor(self._tensor)
        # (cls, size, stride, offset, storage_cls, dtype, device, handle, storage bytes, storage offset,
        #  requires_grad, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required)
        self._handle = {
            "gpu": gpu_uuid(int(args[6])), "numel": self._tensor.numel(), "tensor_offset": int(args[3]),
            "handle": _hex(args[7]), "storage_bytes": int(args[8]), "storage_offset": int(args[9]),
            "ref_counter": _hex(args[11]), "ref_counter_offset": int(args[12]),
            "event": _hex(args[13]), "event_sync": bool(args[14]),
        }

    @property
    def data(self) -> torch.Tensor:
        return self._tensor

    def handle(self) -> dict[str, Any]:
        return self._handle

    def close(self) -> None:
        del self._tensor  # torch frees it once the receiver's reference count reached zero


class HostShmStaging:
    """CPU engines on one host: the staging bytes in a file under /dev/shm (one copy in, none out
    through the socket). The file is unlinked after the ack."""

    kind = HOST_SHM

    def __init__(self, staging: torch.Tensor) -> None:
        n = staging.numel() * staging.element_size()
        fd, path = tempfile.mkstemp(prefix=SHM_PREFIX, dir=SHM_DIR)
        self.path = Path(path)
        try:
            os.ftruncate(fd, max(n, 1))
            self._map = mmap.mmap(fd, max(n, 1))
        finally:
            os.close(fd)
        self._tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=n)
        self._tensor.copy_(staging.reshape(-1).view(torch.uint8))

    @property
    def data(self) -> torch.Tensor:
        return self._tensor

    def handle(self) -> dict[str, Any]:
        return {"path": self.path.name, "nbytes": self._tensor.numel()}

    def close(self) -> None:
        del self._tensor
        with contextlib.suppress(BufferError):
            self._map.close()
        self.path.unlink(missing_ok=True)


def _hex(b: bytes | None) -> str | None:
    return None if b is None else bytes(b).hex()


class SharedBufferTransport:
    """``KVTransport`` whose chunks name byte ranges of a shared staging buffer (the control frames
    and the ack still go over TCP to the receiver, MAC'd as ever)."""

    def __init__(self, address: str, key: bytes, layout: EngineLayout, share: Callable[[torch.Tensor], SharedStaging],
                 *, device: str, blocks_per_chunk: int = DEFAULT_BLOCKS_PER_CHUNK, timeout_s: float = 60.0) -> None:
        self.host, self.port = parse_address(address)
        self.key, self.layout, self.share = key, layout, share
        self.staging_device = device
        self.blocks_per_chunk = max(blocks_per_chunk, SHARED_MIN_BLOCKS_PER_CHUNK)
        self.timeout_s = timeout_s

    def send(self, transfer: OutgoingTransfer) -> TransferReport:
        staging = transfer.staging
        if not isinstance(staging, torch.Tensor):
            raise TypeError("a shared-buffer transfer stages a torch tensor [n, block_bytes]")
        bb, t0 = self.layout.block_bytes, time.perf_counter()
        sent_blocks = sent_bytes = 0
        shared: SharedStaging | None = None
        try:
            shared = self.share(staging)
            ranges = split_blocks(transfer.num_blocks, self.blocks_per_chunk)
            digests = keyed_digests(self.key, shared.data, self.blocks_per_chunk * bb)  # one sync for all chunks
            sock, nonce = connect_receiver(self.host, self.port, self.timeout_s)
            with sock:
                skip = len(transfer.prefix)
                for seq, r in enumerate(ranges):
                    lo, n = r.start * bb, len(r) * bb
                    ref = SharedRef(shared.kind, shared.handle(), lo, n, digests[seq])
                    chunk = Chunk(transfer.transfer_id, seq, seq == len(ranges) - 1, transfer.namespace,
                                  skip + r.start, transfer.hashes[r.start:r.stop], transfer.tokens[r.start:r.stop],
                                  (0, self.layout.num_layers), b"", transfer.prefix if seq == 0 else (), ref,
                                  transfer.tenant_key)
                    send_all(sock, encode_chunk(self.key, nonce, self.layout, chunk))
                    sent_blocks, sent_bytes = sent_blocks + len(r), sent_bytes + n
                _kind, ack, _ = read_frame(SocketSource(sock), self.key, nonce, max_payload=0)
        except (OSError, EOFError, WireError, RuntimeError) as exc:
            return TransferReport(TransferStatus.FAILED, sent_blocks, 0, sent_bytes, time.perf_counter() - t0,
                                  f"{type(exc).__name__}: {exc}")
        finally:
            if shared is not None:
                shared.close()
        return report_from_ack(ack, sent_blocks, sent_bytes, time.perf_counter() - t0)


class CudaIpcTransport(SharedBufferTransport):
    """GPU engines of one host (one GPU or two): device staging shared through CUDA IPC."""

    def __init__(self, address: str, key: bytes, layout: EngineLayout, device: str, *,
                 blocks_per_chunk: int = DEFAULT_BLOCKS_PER_CHUNK) -> None:
        if not torch.cuda.is_available() or not device.startswith("cuda"):
            raise RuntimeError("CudaIpcTransport needs a CUDA engine; use SocketTransport on CPU")
        super().__init__(address, key, layout, CudaIpcStaging, device=device, blocks_per_chunk=blocks_per_chunk)


class HostShmTransport(SharedBufferTransport):
    """CPU engines of one host: staging in /dev/shm."""

    def __init__(self, address: str, key: bytes, layout: EngineLayout, *,
                 blocks_per_chunk: int = DEFAULT_BLOCKS_PER_CHUNK) -> None:
        super().__init__(address, key, layout, HostShmStaging, device="cpu", blocks_per_chunk=blocks_per_chunk)


# ----------------------------------------------------------------------------- receiver side


def open_shared(kind: str, handle: dict[str, Any]) -> torch.Tensor:
    """The sender's shared bytes, flat uint8, mapped into this process. Raises ``WireError``."""
    try:
        if kind == CUDA_IPC:
            return _open_cuda_ipc(handle)
        if kind == HOST_SHM:
            return _open_host_shm(handle)
    except WireError:
        raise
    except (KeyError, TypeError, ValueError, OSError, RuntimeError) as exc:
        raise WireError("shared_open", f"{kind}: {type(exc).__name__}: {exc}") from None
    raise WireError("shared_kind", f"unknown shared buffer kind {kind!r}")


def _open_cuda_ipc(h: dict[str, Any]) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not torch.cuda.is_available():
        raise WireError("shared_kind", "a CUDA IPC chunk sent to an engine without CUDA")
    index = next((i for i in range(torch.cuda.device_count()) if gpu_uuid(i) == h["gpu"]), None)
    if index is None:
        raise WireError("shared_open", f"GPU {h['gpu']} is not visible to this process")
    event = bytes.fromhex(h["event"]) if h["event"] is not None else None
    numel = int(h["numel"])
    return rebuild_cuda_tensor(torch.Tensor, torch.Size([numel]), (1,), int(h["tensor_offset"]),
                               torch.storage.TypedStorage, torch.uint8, index, bytes.fromhex(h["handle"]),
                               int(h["storage_bytes"]), int(h["storage_offset"]), False,
                               bytes.fromhex(h["ref_counter"]), int(h["ref_counter_offset"]), event,
                               bool(h["event_sync"]))


def _open_host_shm(h: dict[str, Any]) -> torch.Tensor:
    name, n = str(h["path"]), int(h["nbytes"])
    if not name.startswith(SHM_PREFIX) or "/" in name or name in (".", ".."):
        raise WireError("shared_open", f"not a PrefixGate staging file: {name!r}")
    with open(SHM_DIR / name, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: this side never writes back
    if len(m) < n:
        raise WireError("size", f"{name} holds {len(m)} bytes, the handle says {n}")
    return torch.frombuffer(m, dtype=torch.uint8, count=n)


class TensorLanding:
    """``receiver.SharedLanding`` for one connection: opens each shared buffer once, copies each
    chunk's range onto this engine's ``device`` and checks its digest there."""

    def __init__(self, key: bytes, device: str) -> None:
        self.key, self.device = key, torch.device(device)
        self._open: dict[str, torch.Tensor] = {}

    def land(self, chunk: Chunk) -> Chunk:
        ref = chunk.shared
        assert ref is not None
        name = f"{ref.kind}:{sorted(ref.handle.items())}"
        if name not in self._open:
            self._open[name] = open_shared(ref.kind, ref.handle)
        src = self._open[name]
        if ref.offset + ref.nbytes > src.numel():
            raise WireError("size", f"range [{ref.offset}, +{ref.nbytes}) outside a {src.numel()}-byte buffer")
        # a copy the engine owns: the sender frees its buffer after the ack (a peer copy across GPUs)
        try:
            local = src[ref.offset:ref.offset + ref.nbytes].to(self.device, copy=True)
            same = keyed_digest(self.key, local) == ref.digest  # .item() inside: the copy has completed
        except RuntimeError as exc:  # a CUDA error copying from the mapping: a miss like any other
            raise WireError("shared_copy", f"{type(exc).__name__}: {exc}") from None
        if not same:
            raise WireError("bad_digest")
        return dataclasses.replace(chunk, payload=local)

    def close(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the imports' copies ran before the mapping goes
        self._open.clear()


def landing_for(key: bytes, device: str) -> Callable[[], TensorLanding]:
    return lambda: TensorLanding(key, device)
