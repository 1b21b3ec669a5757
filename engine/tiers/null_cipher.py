"""``InsecureNullCipher``: NO encryption, for benchmarks that show what encryption costs.

It satisfies ``BlockCipher`` but returns the plaintext as the blob and never authenticates:
anything on disk is readable and a tampered blob is served as is. Nothing in the engine or the
gateway constructs it; only ``benchmarks/tiers.py`` does, side by side with a real AES-GCM cipher.
Never give it to a tenant.
"""

from __future__ import annotations


class InsecureNullCipher:
    """A pass-through ``BlockCipher`` (benchmarks only; see the module docstring)."""

    insecure = True

    def encrypt(self, plaintext: bytes | memoryview, aad: bytes) -> bytes:
        return bytes(plaintext)

    def decrypt(self, blob: bytes | memoryview, aad: bytes) -> bytes | None:
        return bytes(blob)


NullCipher = InsecureNullCipher  # the name the issue uses
