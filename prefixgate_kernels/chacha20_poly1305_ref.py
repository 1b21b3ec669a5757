"""ChaCha20-Poly1305 (RFC 8439) in plain Python: the second oracle of the Triton kernels, and the
small host-side parts of a GPU open (the one-time Poly1305 key, the AAD and length blocks).

Nothing here is fast or meant to be: a 64-byte ChaCha20 block costs ~50 us in CPython. The GPU
path calls ``chacha20_block`` once per sealed segment (block 0 gives the Poly1305 key) and
``poly1305_blocks`` over the AAD (a few hundred bytes); the bulk runs in ``prefixgate_kernels.chacha20_poly1305``.

Poly1305 over a message of ``n`` 16-byte blocks ``m_1 .. m_n`` (each with the 2^128 bit set) is
``acc = sum_i m_i * r^(n - i + 1) mod p``, ``p = 2^130 - 5``; the tag is ``(acc + s) mod 2^128``.
That sum is linear in the blocks, which is what lets the kernel split the ciphertext over lanes.
"""

from __future__ import annotations

import struct

P1305 = (1 << 130) - 5
_MASK32 = 0xFFFFFFFF
_CONSTANTS = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)  # "expand 32-byte k"
R_CLAMP = 0x0FFFFFFC0FFFFFFC0FFFFFFC0FFFFFFF


def _rotl(x: int, n: int) -> int:
    return ((x << n) & _MASK32) | (x >> (32 - n))


def _quarter(s: list[int], a: int, b: int, c: int, d: int) -> None:
    s[a] = (s[a] + s[b]) & _MASK32
    s[d] = _rotl(s[d] ^ s[a], 16)
    s[c] = (s[c] + s[d]) & _MASK32
    s[b] = _rotl(s[b] ^ s[c], 12)
    s[a] = (s[a] + s[b]) & _MASK32
    s[d] = _rotl(s[d] ^ s[a], 8)
    s[c] = (s[c] + s[d]) & _MASK32
    s[b] = _rotl(s[b] ^ s[c], 7)


def initial_state(key: bytes, counter: int, nonce: bytes) -> list[int]:
    """The 16-word ChaCha20 state (RFC 8439 2.3): constants, key, 32-bit counter, 96-bit nonce."""
    if len(key) != 32 or len(nonce) != 12:
        raise ValueError("ChaCha20 needs a 32-byte key and a 12-byte nonce")
    return [*_CONSTANTS, *struct.unpack("<8I", key), counter & _MASK32, *struct.unpack("<3I", nonce)]


def chacha20_block(key: bytes, counter: int, nonce: bytes) -> bytes:
    """One 64-byte keystream block (RFC 8439 2.3)."""
    init = initial_state(key, counter, nonce)
    s = list(init)
    for _ in range(10):
        _quarter(s, 0, 4, 8, 12)
        _quarter(s, 1, 5, 9, 13)
        _quarter(s, 2, 6, 10, 14)
        _quarter(s, 3, 7, 11, 15)
        _quarter(s, 0, 5, 10, 15)
        _quarter(s, 1, 6, 11, 12)
        _quarter(s, 2, 7, 8, 13)
        _quarter(s, 3, 4, 9, 14)
    return struct.pack("<16I", *((a + b) & _MASK32 for a, b in zip(s, init, strict=True)))


def chacha20_xor(key: bytes, counter: int, nonce: bytes, data: bytes) -> bytes:
    out = bytearray(len(data))
    for off in range(0, len(data), 64):
        ks = chacha20_block(key, counter + off // 64, nonce)
        chunk = data[off:off + 64]
        out[off:off + len(chunk)] = bytes(a ^ b for a, b in zip(chunk, ks, strict=False))
    return bytes(out)


def poly1305_key(key: bytes, nonce: bytes) -> tuple[int, int]:
    """(r clamped, s) of the one-time Poly1305 key: the first 32 bytes of keystream block 0."""
    block = chacha20_block(key, 0, nonce)
    return int.from_bytes(block[:16], "little") & R_CLAMP, int.from_bytes(block[16:32], "little")


def poly1305_blocks(r: int, data: bytes) -> int:
    """``sum_i m_i r^(n-i+1) mod p`` over ``data`` zero-padded to 16 bytes, every block full (the
    AEAD's padding makes each one full, so each gets the 2^128 bit)."""
    acc = 0
    for off in range(0, len(data), 16):
        m = int.from_bytes(data[off:off + 16].ljust(16, b"\0"), "little") | (1 << 128)
        acc = (acc + m) * r % P1305
    return acc


def lengths_block(aad_len: int, ct_len: int) -> int:
    return int.from_bytes(struct.pack("<QQ", aad_len, ct_len), "little") | (1 << 128)


def aad_term(r: int, aad: bytes, ct_len: int) -> int:
    """``Poly(aad) * r^(c+1) mod p``: the AAD's share of the accumulator, known before the
    ciphertext's sum (the GPU path computes it while the kernels run)."""
    return poly1305_blocks(r, aad) * pow(r, -(-ct_len // 16) + 1, P1305) % P1305


def finish_tag(r: int, s: int, aad_len: int, ct_len: int, aad_part: int, ct_poly: int) -> bytes:
    """The AEAD tag from ``aad_term`` and the ciphertext's own Poly1305 sum ``ct_poly``
    (``sum_i c_i r^(c-i)``, 0-based ``i`` over its ``c`` padded blocks: what the kernel reduces)::

        acc = Poly(aad) * r^(c+1) + ct_poly * r + lengths * r      (mod p)
    """
    acc = (aad_part + (ct_poly + lengths_block(aad_len, ct_len)) * r) % P1305
    return ((acc + s) & ((1 << 128) - 1)).to_bytes(16, "little")


def combine_tag(r: int, s: int, aad: bytes, ct_len: int, ct_poly: int) -> bytes:
    """``finish_tag`` with the AAD's share computed here."""
    return finish_tag(r, s, len(aad), ct_len, aad_term(r, aad, ct_len), ct_poly)


def _pad16(n: int) -> bytes:
    return b"\0" * (-n % 16)


def tag(key: bytes, nonce: bytes, aad: bytes, ciphertext: bytes) -> bytes:
    r, s = poly1305_key(key, nonce)
    mac = aad + _pad16(len(aad)) + ciphertext + _pad16(len(ciphertext)) + struct.pack("<QQ", len(aad), len(ciphertext))
    acc = 0
    for off in range(0, len(mac), 16):
        acc = (acc + (int.from_bytes(mac[off:off + 16], "little") | (1 << 128))) * r % P1305
    return ((acc + s) & ((1 << 128) - 1)).to_bytes(16, "little")


def seal(key: bytes, nonce: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """ciphertext || tag (RFC 8439 2.8)."""
    ct = chacha20_xor(key, 1, nonce, plaintext)
    return ct + tag(key, nonce, aad, ct)


def open_(key: bytes, nonce: bytes, sealed: bytes, aad: bytes) -> bytes | None:
    """The plaintext, or None when the tag does not match."""
    if len(sealed) < 16:
        return None
    ct, got = sealed[:-16], sealed[-16:]
    if not _equal(tag(key, nonce, aad, ct), got):
        return None
    return chacha20_xor(key, 1, nonce, ct)


def _equal(a: bytes, b: bytes) -> bool:
    import hmac

    return hmac.compare_digest(a, b)
