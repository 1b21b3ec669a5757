"""What a tier blob is bound to: the associated data (AAD) of a segment's encryption.

The cipher (the tenant's data key, implemented in tenancy: AES-256-GCM, or ChaCha20-Poly1305 for
blobs the GPU opens, ``engine.tiers.device_aead``) makes a blob holding a fresh 96-bit nonce, the
ciphertext and the tag. The AAD is not stored; the
reader rebuilds it from what it expects, so a blob moved under another tenant's namespace, another
model, other block hashes, another block geometry or another format version fails its tag and is
a miss, never served::

    aad = b"PGKV" | u16 FORMAT_VERSION | u32 len | namespace | u32 len | model id (utf-8)
          | u32 block_bytes | u32 num_blocks | (u32 len | hash) * num_blocks

Every variable field is length-framed, so no two different tuples give the same bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from engine.kv_types import BlockHash

FORMAT_VERSION = 1
_MAGIC = b"PGKV"


def _framed(b: bytes) -> bytes:
    return struct.pack(">I", len(b)) + b


def segment_aad(namespace: bytes, model_id: str, hashes: Sequence[BlockHash], block_bytes: int,
                format_version: int = FORMAT_VERSION) -> bytes:
    parts = [_MAGIC, struct.pack(">H", format_version), _framed(namespace), _framed(model_id.encode()),
             struct.pack(">II", block_bytes, len(hashes))]
    parts += [_framed(h) for h in hashes]
    return b"".join(parts)
