"""The seam for KV that the engine's GPU decrypts: a cipher that also seals with ChaCha20-Poly1305.

Tenancy's ``TenantCipher`` implements ``DeviceSealingCipher`` structurally (the engine never
imports tenancy). Its device blobs have this layout, which ``engine.tiers.gpu_opener`` parses::

    byte 0       0x02 (DEVICE_BLOB_VERSION)
    bytes 1-3    zero (rejected otherwise): the ciphertext starts at byte 16, a word boundary
    bytes 4-15   96-bit nonce, fresh per segment
    16 .. -16    ChaCha20 ciphertext (counter from 1, RFC 8439)
    last 16      Poly1305 tag over (aad, ciphertext)

Why ChaCha20-Poly1305 here and AES-256-GCM elsewhere: both are standard AEADs; AES-GCM is what the
CPU does fastest (AES-NI + carry-less multiply), ChaCha20 is add/rotate/xor and Poly1305 integer
multiply-add, which a GPU runs at memory speed with no special instructions, so the ciphertext can
cross the host link and be opened in HBM.

This module imports only the standard library (and the DRAM tier's blob type, for type checks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from engine.tiers.dram import PinnedBlob

DEVICE_BLOB_VERSION = 0x02
DEVICE_HEADER_BYTES = 16
TAG_BYTES = 16
KEY_BYTES = 32


@runtime_checkable
class DeviceSealingCipher(Protocol):
    """A ``BlockCipher`` (``engine.protocol``) that can also seal for decryption on the GPU.

    Contract:
        - ``encrypt_for_device`` returns a blob in the layout above, fresh nonce per call.
        - ``decrypt`` (the ``BlockCipher`` method) opens those blobs too: the CPU fallback.
        - ``device_key`` is the 32-byte ChaCha20-Poly1305 key of those blobs, or None once the
          tenant's key is destroyed. It may only go to this engine's own device; never log it.
    """

    def encrypt(self, plaintext: bytes | memoryview, aad: bytes) -> bytes: ...

    def decrypt(self, blob: bytes | memoryview, aad: bytes) -> bytes | None: ...

    def encrypt_for_device(self, plaintext: bytes | memoryview, aad: bytes) -> bytes: ...

    def device_key(self) -> bytes | None: ...


@dataclass(frozen=True)
class DeviceBlobParts:
    nonce: bytes
    ct_len: int
    tag: bytes


def device_blob_parts(blob: bytes | memoryview) -> DeviceBlobParts | None:
    """Nonce, ciphertext length and tag of a device blob; None if it is not one (or is malformed)."""
    if len(blob) < DEVICE_HEADER_BYTES + TAG_BYTES or blob[0] != DEVICE_BLOB_VERSION or bytes(blob[1:4]) != b"\0\0\0":
        return None
    return DeviceBlobParts(bytes(blob[4:DEVICE_HEADER_BYTES]), len(blob) - DEVICE_HEADER_BYTES - TAG_BYTES,
                           bytes(blob[len(blob) - TAG_BYTES:]))


@runtime_checkable
class DevicePlaintext(Protocol):
    """A run's plaintext KV that still lives in device memory (a spill that never went through the
    host in clear): ``num_blocks`` rows of the tier's block bytes (``engine.tiers.gpu_sealer.DeviceKV``)."""

    @property
    def num_blocks(self) -> int: ...

    def rows(self, first: int, stop: int) -> DevicePlaintext:
        """Blocks ``first .. stop - 1`` (a view; no copy)."""
        ...

    def to_host(self) -> memoryview:
        """The plaintext in host memory (waits for the device): for a cipher the GPU cannot seal with."""
        ...


class SegmentSealer(Protocol):
    """Seals ``DevicePlaintext`` on its device with ChaCha20-Poly1305 under ``key`` (a
    ``DeviceSealingCipher``'s ``device_key``) into a blob of the layout above, in host memory.
    Called from the tier manager's worker threads; the nonce is fresh (CSPRNG) per call."""

    def seal(self, key: bytes, plain: DevicePlaintext, aad: bytes,
             host_buffer: Callable[[int], np.ndarray] | None = None) -> PinnedBlob:
        """``host_buffer(n)``: where the blob lands (the DRAM tier's page-locked arena); a fresh
        page-locked allocation when None."""
        ...
