"""The KV chunk format and its checks. Torch-free: bytes in, typed chunks or a rejection reason out.

One transfer = one connection: the receiver's hello, a stream of chunk frames, one ack frame back::

    hello  = MAGIC "PGKV" | version u8 | nonce (16 random bytes)           receiver -> sender, first
    frame  = prefix: MAGIC "PGKV" | version u8 | kind u8 | header_len u32 | payload_len u64  (18 bytes, big-endian)
             | prefix_mac (32 bytes) | header (JSON, UTF-8) | payload | mac (32 bytes)
    prefix_mac = HMAC-SHA256(transfer key, "prefix" | nonce | prefix)
    mac        = HMAC-SHA256(transfer key, nonce | prefix | header | payload)

The prefix MAC lets the receiver authenticate the sizes a frame declares before it reads or
allocates anything of them: a peer without the key gets 50 bytes read and nothing allocated. The
connection's nonce is in every MAC, so no frame (nor its prefix) can be replayed on another
connection, and the ack cannot be either.

    chunk header = {"transfer_id", "seq", "last", "model", "namespace" (hex), "first_block",
                    "hashes" [hex], "tokens" [[ids of block i]...], "layers" [lo, hi],
                    "dtype", "block_bytes", "prefix_hashes" [hex] (seq 0 only),
                    "tenant_key" (hex; absent = the namespace is the tenant)}
    chunk payload = the chunk's blocks back to back, one block = ``block_bytes`` bytes
                    (the model runner's export layout: all layers' K and V of the block)
    shared chunk  = the same header plus "shared": {"kind", "handle", "offset", "nbytes", "digest"}
                    and an empty payload: the bytes stay in a buffer the sender shares (a CUDA IPC
                    handle, a host shared-memory file); "digest" is a keyed checksum of them that
                    the receiver recomputes on what it copied (engine.disagg.shared_transport)
    ack header   = {"transfer_id", "status", "blocks_imported", "reason"}

The receiver checks, in this order: magic and version, the prefix MAC, sizes against its limits,
the frame's MAC (both in constant time), then the header against its own engine (model, dtype,
block bytes, layer range) and the transfer so far (seq and first_block contiguous, one namespace),
and recomputes the chained block hashes from the namespace and the tokens. A transfer may start after blocks the
receiver already holds (``first_block > 0``): its first chunk names their hashes
(``prefix_hashes``), which cannot be recomputed without their tokens and are therefore only ever
*looked up* in the receiver's own index (an import whose prefix is not resident there is a miss). Any failure is a ``WireError`` whose
``reason`` is a short stable label (a metric label): the chunk is never used as data.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine.kv_types import BlockHash
from engine.prefix_index import hash_block

MAGIC = b"PGKV"
VERSION = 2  # 2: the receiver's hello (a nonce in every MAC) and the prefix MAC
_PREFIX = struct.Struct(">4sBBIQ")
PREFIX_BYTES = _PREFIX.size
MAC_BYTES = 32
NONCE_BYTES = 16
HELLO_BYTES = len(MAGIC) + 1 + NONCE_BYTES
MAX_HEADER_BYTES = 4 * 1024 * 1024
_PREFIX_LABEL = b"prefix"


class FrameKind(enum.IntEnum):
    CHUNK = 1
    ACK = 2


class WireError(Exception):
    """A frame failed a check; ``reason`` is a stable short label (``bad_mac``, ``dtype`` ...)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class EngineLayout:
    """What a receiving engine's KV blocks look like; a chunk must match it exactly."""

    model: str
    dtype: str
    block_size: int
    num_layers: int
    block_bytes: int


class SizedBuffer(Protocol):
    """Bytes a chunk carries that are not a Python buffer (a device tensor landed by the receiver)."""

    @property
    def nbytes(self) -> int: ...


@dataclass(frozen=True)
class SharedRef:
    """Where a shared chunk's bytes are: ``nbytes`` at ``offset`` of the buffer ``handle`` names
    (``kind`` says how to open it); ``digest``: the sender's keyed checksum of those bytes."""

    kind: str
    handle: dict[str, Any]
    offset: int
    nbytes: int
    digest: str

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "handle": self.handle, "offset": self.offset, "nbytes": self.nbytes,
                "digest": self.digest}


@dataclass(frozen=True)
class Chunk:
    """Consecutive full blocks ``first_block ..`` of one request's prompt chain."""

    transfer_id: str
    seq: int
    last: bool
    namespace: bytes
    first_block: int
    hashes: tuple[BlockHash, ...]
    tokens: tuple[tuple[int, ...], ...]
    layers: tuple[int, int]
    payload: bytes | bytearray | memoryview | SizedBuffer
    prefix: tuple[BlockHash, ...] = ()  # seq 0 only: hashes of blocks 0..first_block-1 (held by the receiver)
    shared: SharedRef | None = None  # the bytes stay in the sender's shared buffer (payload empty until landed)
    tenant_key: bytes = b""  # the tenant the blocks are held and charged for on import ("" = the namespace)

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)


def hello(nonce: bytes) -> bytes:
    """The receiver's first bytes on a connection: who it is and the nonce every MAC of it covers."""
    return MAGIC + bytes([VERSION]) + nonce


def read_hello(source: ByteSource) -> bytes:
    """The sender's side: the receiver's nonce. Raises ``WireError`` (not a receiver of this version)."""
    data = source.read_exactly(HELLO_BYTES)
    if data[:4] != MAGIC or data[4] != VERSION:
        raise WireError("bad_hello", f"magic {data[:4]!r} version {data[4]}")
    return data[5:]


def encode_frame(
    key: bytes, nonce: bytes, kind: FrameKind, header: dict[str, Any],
    payload: bytes | bytearray | memoryview = b"",
) -> list[bytes | memoryview]:
    """The frame as buffers to send in order (``socket.sendmsg``): the payload is not copied."""
    head = json.dumps(header, separators=(",", ":")).encode()
    payload = memoryview(payload).cast("B")
    prefix = _PREFIX.pack(MAGIC, VERSION, int(kind), len(head), payload.nbytes)
    tag = hmac.new(key, nonce + prefix + head, hashlib.sha256)
    tag.update(payload)
    return [prefix + _prefix_mac(key, nonce, prefix) + head, payload, tag.digest()]


def _prefix_mac(key: bytes, nonce: bytes, prefix: bytes) -> bytes:
    return hmac.digest(key, _PREFIX_LABEL + nonce + prefix, "sha256")


def encode_chunk(key: bytes, nonce: bytes, layout: EngineLayout, chunk: Chunk) -> list[bytes | memoryview]:
    header = {
        "transfer_id": chunk.transfer_id, "seq": chunk.seq, "last": chunk.last, "model": layout.model,
        "namespace": chunk.namespace.hex(), "first_block": chunk.first_block,
        "hashes": [h.hex() for h in chunk.hashes], "tokens": [list(t) for t in chunk.tokens],
        "layers": list(chunk.layers), "dtype": layout.dtype, "block_bytes": layout.block_bytes,
        "prefix_hashes": [h.hex() for h in chunk.prefix],
    }
    if chunk.tenant_key and chunk.tenant_key != chunk.namespace:
        header["tenant_key"] = chunk.tenant_key.hex()
    if chunk.shared is not None:
        header["shared"] = chunk.shared.to_json()
        return encode_frame(key, nonce, FrameKind.CHUNK, header)
    assert isinstance(chunk.payload, (bytes, bytearray, memoryview))
    return encode_frame(key, nonce, FrameKind.CHUNK, header, chunk.payload)


class ByteSource(Protocol):
    def read_exactly(self, n: int) -> bytes:
        """``n`` bytes, or raise ``EOFError`` if the peer closed first."""
        ...

    def read_into(self, buf: bytearray) -> None:
        """Fill ``buf`` completely, or raise ``EOFError`` (large payloads: no extra copy)."""
        ...


@dataclass(frozen=True)
class FramePrefix:
    """A frame's first bytes, authenticated: its kind and the sizes it declares can be trusted."""

    raw: bytes
    kind: FrameKind
    header_len: int
    payload_len: int


def read_prefix(source: ByteSource, key: bytes, nonce: bytes, max_payload: int) -> FramePrefix:
    """Read and authenticate a frame's fixed-size prefix (50 bytes), before anything it declares is
    read or allocated. Raises ``WireError`` (bad or unauthenticated prefix) or ``EOFError``."""
    raw = source.read_exactly(PREFIX_BYTES)
    tag = source.read_exactly(MAC_BYTES)
    magic, version, kind, head_len, payload_len = _PREFIX.unpack(raw)
    if magic != MAGIC or version != VERSION:
        raise WireError("bad_frame", f"magic {magic!r} version {version}")
    if not hmac.compare_digest(tag, _prefix_mac(key, nonce, raw)):
        raise WireError("bad_mac", "frame prefix")
    if kind not in (FrameKind.CHUNK, FrameKind.ACK):
        raise WireError("bad_frame", f"kind {kind}")
    if head_len > MAX_HEADER_BYTES or payload_len > max_payload:
        raise WireError("too_large", f"header {head_len} / payload {payload_len} bytes")
    return FramePrefix(raw, FrameKind(kind), head_len, payload_len)


def read_body(source: ByteSource, key: bytes, nonce: bytes,
              prefix: FramePrefix) -> tuple[FrameKind, dict[str, Any], bytearray]:
    """The rest of a frame whose prefix ``read_prefix`` authenticated: header, payload, MAC."""
    head = source.read_exactly(prefix.header_len)
    payload = bytearray(prefix.payload_len)
    source.read_into(payload)
    tag = source.read_exactly(MAC_BYTES)
    expected = hmac.new(key, nonce + prefix.raw + head, hashlib.sha256)
    expected.update(payload)
    if not hmac.compare_digest(tag, expected.digest()):
        raise WireError("bad_mac")
    try:
        header = json.loads(head)
    except ValueError:
        raise WireError("bad_header", "not JSON") from None
    if not isinstance(header, dict):
        raise WireError("bad_header", "not an object")
    return prefix.kind, header, payload


def read_frame(source: ByteSource, key: bytes, nonce: bytes,
               max_payload: int) -> tuple[FrameKind, dict[str, Any], bytearray]:
    """Read and authenticate one frame. Raises ``WireError`` (bad frame) or ``EOFError`` (peer gone)."""
    return read_body(source, key, nonce, read_prefix(source, key, nonce, max_payload))


class ChainChecker:
    """Checks the chunks of one transfer against the receiving engine and against each other.

    The hashes are recomputed from the namespace and the tokens, so a chunk can only ever be
    indexed under the hash its tokens give in the tenant's own chain."""

    def __init__(self, layout: EngineLayout) -> None:
        self.layout = layout
        self.transfer_id: str | None = None
        self.namespace: bytes | None = None
        self.tenant_key: bytes | None = None
        self.next_seq = 0
        self.next_block = 0
        self.chain: list[BlockHash] = []  # every verified hash so far, from block 0

    def check(self, header: dict[str, Any], payload: bytes | bytearray | memoryview) -> Chunk:
        lay = self.layout
        try:
            transfer_id = str(header["transfer_id"])
            seq, first = int(header["seq"]), int(header["first_block"])
            namespace = bytes.fromhex(header["namespace"])
            tenant_key = bytes.fromhex(header.get("tenant_key") or "") or namespace  # none sent: the namespace's own
            hashes = tuple(BlockHash(bytes.fromhex(h)) for h in header["hashes"])
            tokens = tuple(tuple(int(t) for t in block) for block in header["tokens"])
            lo, hi = (int(x) for x in header["layers"])
            model, dtype, block_bytes = str(header["model"]), str(header["dtype"]), int(header["block_bytes"])
            last = bool(header["last"])
            prefix = tuple(BlockHash(bytes.fromhex(h)) for h in header.get("prefix_hashes") or ())
            shared = _shared_ref(header["shared"]) if "shared" in header else None
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError("bad_header", repr(exc)) from None
        if model != lay.model:
            raise WireError("model", f"{model!r} != {lay.model!r}")
        if dtype != lay.dtype:
            raise WireError("dtype", f"{dtype} != {lay.dtype}")
        if block_bytes != lay.block_bytes:
            raise WireError("block_bytes", f"{block_bytes} != {lay.block_bytes}")
        if (lo, hi) != (0, lay.num_layers):
            raise WireError("layers", f"[{lo}, {hi}) but this engine needs all {lay.num_layers} layers per block")
        if self.transfer_id is None:
            self.transfer_id, self.namespace, self.tenant_key = transfer_id, namespace, tenant_key
            if len(prefix) != first or any(len(h) != 32 for h in prefix):
                raise WireError("bad_header", f"{len(prefix)} prefix hashes for a transfer starting at block {first}")
            self.chain, self.next_block = list(prefix), first
        elif prefix:
            raise WireError("bad_header", "prefix_hashes after the first chunk")
        if transfer_id != self.transfer_id or namespace != self.namespace or tenant_key != self.tenant_key:
            raise WireError("mixed_transfer")
        if seq != self.next_seq or first != self.next_block:
            raise WireError("out_of_order", f"seq {seq} block {first}, expected {self.next_seq} / {self.next_block}")
        nbytes = len(payload) if shared is None else shared.nbytes
        if shared is not None and (len(payload) or shared.offset < 0):
            raise WireError("size", f"a shared chunk with {len(payload)} payload bytes at offset {shared.offset}")
        if not hashes or len(tokens) != len(hashes) or nbytes != len(hashes) * block_bytes:
            raise WireError("size", f"{len(hashes)} hashes, {len(tokens)} token blocks, {nbytes} bytes")
        parent = self.chain[-1] if self.chain else namespace
        for h, toks in zip(hashes, tokens):
            if len(toks) != lay.block_size:
                raise WireError("size", f"a block of {len(toks)} tokens, block size is {lay.block_size}")
            parent = hash_block(parent, toks)
            if parent != h:
                raise WireError("hash_chain")
        self.chain.extend(hashes)
        self.next_seq += 1
        self.next_block += len(hashes)
        return Chunk(transfer_id, seq, last, namespace, first, hashes, tokens, (lo, hi), payload, prefix, shared,
                     tenant_key)


def _shared_ref(d: dict[str, Any]) -> SharedRef:
    if not isinstance(d, dict) or not isinstance(d["handle"], dict):
        raise TypeError("shared must be an object with a handle object")
    return SharedRef(str(d["kind"]), d["handle"], int(d["offset"]), int(d["nbytes"]), str(d["digest"]))


def split_blocks(n: int, blocks_per_chunk: int) -> Sequence[range]:
    """Block index ranges of the chunks of an ``n``-block transfer."""
    if blocks_per_chunk < 1:
        raise ValueError("blocks_per_chunk must be >= 1")
    return [range(i, min(i + blocks_per_chunk, n)) for i in range(0, n, blocks_per_chunk)]
