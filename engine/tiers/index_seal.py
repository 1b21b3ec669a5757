"""What the NVMe index may keep on disk about a segment's tenant and blocks: nothing that tests a guess.

A block hash is a public function of the namespace and the tokens (``h_i = SHA-256(h_{i-1} ‖ tokens)``),
and the tokenizer is public, so a raw namespace or a raw hash on disk lets whoever holds the disk
confirm a guessed prompt. The index therefore stores, per segment::

    ns_tag        HMAC(k_ns, "tag")                       which rows belong to one namespace
    sealed        hashes XOR HMAC(k_ns, "mask" ‖ id ‖ j)  the chain, readable only with k_ns
    where  k_ns = HMAC(index key ‖ namespace, "prefixgate/nvme-index/v1")

``k_ns`` needs both the tier's index key (given by whoever builds the engine: the gateway derives it
from a key wrapped by the KEK) and the namespace (derived by the server from its secret, never
stored). Without them a row is random bytes. The mask is a PRF in counter mode, keyed per namespace
and unique per segment id (random, never reused); integrity comes from the blob's AEAD, whose AAD
binds the real namespace and hashes, so a tampered row is an authentication failure, never a wrong hit.

Standard library only (``hmac``/``hashlib``): the engine imports no crypto package.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from engine.kv_types import BlockHash

_LABEL = b"prefixgate/nvme-index/v1"


class IndexSealer:
    """Keyed identifiers and sealed hash lists for one tier (thread-safe: no mutable state)."""

    def __init__(self, index_key: bytes = b"") -> None:
        self._key = bytes(index_key)

    def _k_ns(self, namespace: bytes) -> bytes:
        return hmac.new(self._key + namespace, _LABEL, hashlib.sha256).digest()

    def tag(self, namespace: bytes) -> bytes:
        """The stored stand-in for ``namespace``: equal namespaces, equal tags; nothing else learnable."""
        return hmac.new(self._k_ns(namespace), b"tag", hashlib.sha256).digest()

    def _mask(self, k_ns: bytes, segment_id: str, nbytes: int) -> bytes:
        sid = segment_id.encode("ascii")
        out = bytearray()
        j = 0
        while len(out) < nbytes:
            out += hmac.new(k_ns, b"mask" + sid + j.to_bytes(4, "big"), hashlib.sha256).digest()
            j += 1
        return bytes(out[:nbytes])

    def seal(self, namespace: bytes, segment_id: str, hashes: Sequence[bytes]) -> bytes:
        plain = b"".join(hashes)
        return _xor(plain, self._mask(self._k_ns(namespace), segment_id, len(plain)))

    def unseal(self, namespace: bytes, segment_id: str, sealed: bytes,
               hash_len: int) -> tuple[BlockHash, ...]:
        """The hashes ``seal`` hid, given the same namespace (a wrong one gives random bytes)."""
        plain = _xor(sealed, self._mask(self._k_ns(namespace), segment_id, len(sealed)))
        # typed once, as prefix_index does: BlockHash(...) per hash is a Python call (NewType)
        hashes = tuple(plain[i:i + hash_len] for i in range(0, len(plain), hash_len))
        return cast("tuple[BlockHash, ...]", hashes)


def _xor(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "big") ^ int.from_bytes(b, "big")).to_bytes(len(a), "big")
