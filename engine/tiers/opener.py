"""How a restore turns sealed segments back into plaintext KV: the ``SegmentOpener`` seam.

The tier manager reads the segments a restore needs and hands them to its opener in one call, so
an opener can batch and pipeline them::

    HostOpener            decrypt on the CPU, one segment after the other; plaintext ``bytes``
                          (the CPU engine; no torch)
    PinnedHostOpener      decrypt on a CPU thread pool into pinned buffers, each segment's H2D
                          copy queued as soon as it is ready; a device tensor (engine.tiers.gpu_opener)
    DeviceAeadOpener      ChaCha20-Poly1305 blobs cross the link as ciphertext and are opened in HBM
                          by Triton kernels; anything else goes to PinnedHostOpener (same module)

Every opener stops at the first segment whose tag fails: what follows it is not returned, and the
caller recomputes from there. Bad ciphertext is never returned as data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from engine.protocol import BlockCipher

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SealedRun:
    """The wanted blocks ``first .. first + count - 1`` of one stored segment blob."""

    blob: bytes | memoryview
    aad: bytes
    num_blocks: int  # blocks in the whole segment
    first: int
    count: int


@dataclass(frozen=True)
class OpenedRuns:
    """``ok`` leading runs authenticated; ``data`` holds their wanted blocks packed in order
    (``sum(count) * block_bytes`` bytes): ``bytes``, or a uint8 device tensor ``[blocks, block_bytes]``."""

    ok: int
    data: bytes | torch.Tensor


@runtime_checkable
class DecryptsInto(Protocol):
    """A ``BlockCipher`` that can also decrypt straight into a caller's buffer (tenancy's
    ``TenantCipher``): the pinned-memory path then allocates no plaintext per segment.

    ``decrypt_into(blob, aad, out)`` writes the whole plaintext into ``out`` (exactly its length)
    and returns True, or returns False for any bad blob, leaving garbage in ``out``."""

    def decrypt_into(self, blob: bytes | memoryview, aad: bytes, out: memoryview) -> bool: ...


class SegmentOpener(Protocol):
    """Decrypts and authenticates sealed runs. Called from the tier manager's worker threads.

    Args:
        cipher: the tenant's cipher (a ``DeviceSealingCipher`` where the opener can use its key).
        runs: in chain order.
        block_bytes: plaintext bytes of one block.
    Returns:
        ``OpenedRuns``: the leading runs that authenticated, up to the first that did not.
    """

    def open_runs(self, cipher: BlockCipher, runs: Sequence[SealedRun], block_bytes: int) -> OpenedRuns: ...

    def close(self) -> None:
        """Release threads and streams (the tier manager's ``close`` calls it)."""
        ...


class HostOpener:
    """``SegmentOpener`` on the CPU: ``cipher.decrypt`` per segment, plaintext as ``bytes``."""

    def open_runs(self, cipher: BlockCipher, runs: Sequence[SealedRun], block_bytes: int) -> OpenedRuns:
        pieces: list[bytes] = []
        for ok, run in enumerate(runs):
            plain = cipher.decrypt(run.blob, run.aad)
            if plain is None or len(plain) != run.num_blocks * block_bytes:
                return OpenedRuns(ok, b"".join(pieces))
            pieces.append(plain[run.first * block_bytes:(run.first + run.count) * block_bytes])
        return OpenedRuns(len(runs), b"".join(pieces))

    def close(self) -> None:
        pass
