"""Fixtures for the tier tests: a real AES-256-GCM cipher, tenants, hash chains, a fake clock."""

from __future__ import annotations

import hashlib
import os
import random

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from prometheus_client import CollectorRegistry

from engine.protocol import StaticTenantScope
from engine.tiers import TierManager

BLOCK_SIZE = 16
BLOCK_BYTES = 512


class AesGcmCipher:
    """What tenancy implements: blob = 12-byte random nonce || ciphertext || 16-byte tag."""

    def __init__(self, key: bytes | None = None):
        self._aead = AESGCM(key or AESGCM.generate_key(bit_length=256))

    def encrypt(self, plaintext, aad: bytes) -> bytes:
        nonce = os.urandom(12)
        return nonce + self._aead.encrypt(nonce, bytes(plaintext), aad)

    def decrypt(self, blob, aad: bytes) -> bytes | None:
        blob = bytes(blob)
        if len(blob) < 28:
            return None
        try:
            return self._aead.decrypt(blob[:12], blob[12:], aad)
        except InvalidTag:
            return None


def tenant(name: str, cipher=...) -> StaticTenantScope:
    return StaticTenantScope(namespace=f"ns-{name}".encode(), metrics_label=name,
                             cipher=AesGcmCipher() if cipher is ... else cipher)


def acme(cipher=None) -> StaticTenantScope:
    """Tenant "acme" with tenancy's real ``TenantCipher`` (it also seals for the GPU) unless given one."""
    from tenancy.crypto import TenantCipher, new_data_key

    return StaticTenantScope(namespace=b"ns-acme", metrics_label="acme",
                             cipher=cipher or TenantCipher(new_data_key(), owner="acme"))


def chain(namespace: bytes, num_blocks: int, seed: int = 0) -> list[bytes]:
    """h_i = SHA-256(h_{i-1} || tokens of block i), h_{-1} = namespace (the engine's rule)."""
    rng = random.Random(seed)
    h, out = namespace, []
    for _ in range(num_blocks):
        tokens = b"".join(rng.randrange(50_000).to_bytes(4, "little") for _ in range(BLOCK_SIZE))
        h = hashlib.sha256(h + tokens).digest()
        out.append(h)
    return out


def kv_bytes(num_blocks: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(num_blocks * BLOCK_BYTES)


class FakeClock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def registry():
    return CollectorRegistry()


@pytest.fixture
def make_manager(tmp_path, registry):
    made = []

    def make(**kw) -> TierManager:
        kw.setdefault("model_id", "tiny-test")
        kw.setdefault("block_size", BLOCK_SIZE)
        kw.setdefault("block_bytes", BLOCK_BYTES)
        kw.setdefault("registry", registry if not made else CollectorRegistry())  # restarts: fresh
        kw.setdefault("pin_memory", False)
        if kw.get("nvme_bytes"):
            kw.setdefault("nvme_dir", tmp_path / "nvme")
        m = TierManager(**kw)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def metric(registry: CollectorRegistry, name: str, **labels) -> float:
    return registry.get_sample_value(name, labels) or 0.0
