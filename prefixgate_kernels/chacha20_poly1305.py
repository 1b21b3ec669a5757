"""ChaCha20-Poly1305 (RFC 8439) on the GPU: keystream XOR and tag sum as Triton kernels.

A sealed KV segment crosses the host link as ciphertext and is opened in HBM; a spilled one is
sealed in HBM and crosses the link as ciphertext. The keystream XOR is its own inverse, and the
tag is always over the ciphertext, so both directions use the same two kernels:

    open:  Poly1305(ciphertext), ChaCha20 XOR ciphertext -> plaintext      (``open_sealed``)
    seal:  ChaCha20 XOR plaintext -> ciphertext, then Poly1305(ciphertext) (``launch_seal``)

Two kernels read the ciphertext once each; the host adds the few small parts of the tag::

    ciphertext words (int32, 4-aligned)  ──► _chacha20_xor_kernel  ──► plaintext words
          one lane = one 64-byte block: counter = 1 + lane, 20 rounds, XOR a [lanes, 16] word tile
    ciphertext words                     ──► _poly1305_kernel       ──► 5 limb sums (int64)
          one lane = every N-th 16-byte block (N = lanes in the grid), Horner with R = r^N,
          then times r^(N - j) for lane j: sum over lanes = Poly(ciphertext) (see below)
    host: Poly(aad) * r^(c+1) + (Poly(ct) + lengths) * r + s  == tag ?  (prefixgate_kernels.chacha20_poly1305_ref)

Why the lanes' sums add up. Poly1305 over ``c`` padded blocks is ``sum_i m_i r^(c-i)`` (0-based
``i``, each block with the 2^128 bit). Pad the front with ``N*K - c`` empty blocks (no 2^128 bit,
so they add nothing) so that block ``i`` sits at virtual index ``v = i + pad``; lane ``j`` takes
``v = j, j + N, ...`` (consecutive lanes read consecutive 16-byte blocks: coalesced), and
``r^(c-i) = r^(NK - v) = (r^N)^(K-1-k) * r^(N-j)`` for ``v = j + kN``. So lane j runs Horner with
``R = r^N`` over its K blocks and multiplies by ``r^(N-j)`` (square-and-multiply in the kernel).

Arithmetic mod ``p = 2^130 - 5`` is on five 26-bit limbs in uint64 (poly1305-donna's scheme): a
limb product is < 2^56 and a sum of five < 2^59, and ``2^130 = 5 (mod p)`` folds the high limbs.
Lane results are only partly reduced (limbs < 2^27); their limb sums fit int64 for up to 2^30
lanes and the host reduces them exactly with Python integers.

A tag that does not match means the caller must treat the whole segment as absent: the plaintext
buffer it got is garbage and must never be imported (``open_sealed`` returns False for it).
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from prefixgate_kernels import chacha20_poly1305_ref as ref
from prefixgate_kernels._common import cdiv
from prefixgate_kernels.chacha20_poly1305_ref import P1305, R_CLAMP, aad_term, finish_tag

try:  # a compiled ChaCha20 for the one-time key; the project depends on it, a bare device host may not
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
    _HAVE_CRYPTOGRAPHY = True
except ImportError:  # pragma: no cover - exercised where cryptography is absent
    _HAVE_CRYPTOGRAPHY = False

CHACHA_LANES = 128  # 64-byte blocks per program
POLY_LANES = 128  # lanes per program of the tag kernel
_MAX_POLY_LANES = 1 << 16
_POLY_BLOCKS_PER_LANE = 128  # target K: enough work per lane that the r^(N-j) powers stay cheap


def poly1305_key(key: bytes, nonce: bytes) -> tuple[int, int]:
    """(r clamped, s) of the one-time Poly1305 key: the first 32 bytes of ChaCha20 block 0 (RFC 8439
    2.6). Every seal and every opened span needs one, on the host, on a tier worker that holds the
    GIL: the reference's pure-Python block costs ~100 us, `cryptography`'s ChaCha20 ~8 us (its
    16-byte nonce is the 32-bit little-endian block counter, here 0, then the 96-bit nonce)."""
    if not _HAVE_CRYPTOGRAPHY:
        return ref.poly1305_key(key, nonce)
    if len(key) != 32 or len(nonce) != 12:
        raise ValueError("ChaCha20 needs a 32-byte key and a 12-byte nonce")
    block = Cipher(algorithms.ChaCha20(key, bytes(4) + nonce), mode=None).encryptor().update(bytes(32))
    return int.from_bytes(block[:16], "little") & R_CLAMP, int.from_bytes(block[16:], "little")


@triton.jit
def _rotl(x, n: tl.constexpr):
    return (x << n) | (x >> (32 - n))


@triton.jit
def _qr(a, b, c, d):
    a = a + b
    d = _rotl(d ^ a, 16)
    c = c + d
    b = _rotl(b ^ c, 12)
    a = a + b
    d = _rotl(d ^ a, 8)
    c = c + d
    b = _rotl(b ^ c, 7)
    return a, b, c, d


@triton.jit
def _word_mask(widx, nbytes):
    """uint32 mask of the bytes of word ``widx`` that lie inside ``nbytes`` (0 past the end)."""
    valid = tl.minimum(tl.maximum(nbytes - widx * 4, 0), 4).to(tl.uint64)
    return ((tl.full(widx.shape, 1, tl.uint64) << (valid * 8)) - 1).to(tl.uint32)


# The key and nonce words (and the Poly1305 limbs below) are scalar arguments, not a device tensor:
# a tensor per launch cost a pinned host allocation and an upload on the tier worker, which holds the
# GIL the step loop needs. They change on every launch, so they must not be specialised (a word
# equal to 1 or divisible by 16 would compile another variant); as signed 32-bit values their type
# never changes either. The block counter likewise (an opened span starts at 1 + its first block).
# What stays specialised is what lets the loads vectorise: the word offsets (alignment) and
# ``nbytes`` (a length divisible by 16 keeps the tail mask constant over 4 words), two classes a
# seal can fall in, both compiled by ``DeviceSealer.self_test`` before the first spill.
_KEY_WORDS = ("key0", "key1", "key2", "key3", "key4", "key5", "key6", "key7", "nonce0", "nonce1", "nonce2")


@triton.jit(do_not_specialize=(*_KEY_WORDS, "counter0"))
def _chacha20_xor_kernel(
    src_ptr,  # int32 words; the ciphertext starts at word src_off
    dst_ptr,  # int32 words; plaintext written from word dst_off
    key0, key1, key2, key3, key4, key5, key6, key7,  # key words (int32, little-endian)
    nonce0, nonce1, nonce2,  # nonce words
    src_off,
    dst_off,
    nbytes,
    counter0,
    LANES: tl.constexpr,
):
    pid = tl.program_id(0)
    blk = pid.to(tl.int64) * LANES + tl.arange(0, LANES)  # [LANES] 64-byte block index
    zero = tl.zeros([LANES], dtype=tl.uint32)
    k0 = key0.to(tl.uint32, bitcast=True) + zero
    k1 = key1.to(tl.uint32, bitcast=True) + zero
    k2 = key2.to(tl.uint32, bitcast=True) + zero
    k3 = key3.to(tl.uint32, bitcast=True) + zero
    k4 = key4.to(tl.uint32, bitcast=True) + zero
    k5 = key5.to(tl.uint32, bitcast=True) + zero
    k6 = key6.to(tl.uint32, bitcast=True) + zero
    k7 = key7.to(tl.uint32, bitcast=True) + zero
    n0 = nonce0.to(tl.uint32, bitcast=True) + zero
    n1 = nonce1.to(tl.uint32, bitcast=True) + zero
    n2 = nonce2.to(tl.uint32, bitcast=True) + zero
    ctr = (blk + counter0).to(tl.uint32)
    i0 = zero + 0x61707865
    i1 = zero + 0x3320646E
    i2 = zero + 0x79622D32
    i3 = zero + 0x6B206574
    x0, x1, x2, x3 = i0, i1, i2, i3
    x4, x5, x6, x7 = k0, k1, k2, k3
    x8, x9, x10, x11 = k4, k5, k6, k7
    x12, x13, x14, x15 = ctr, n0, n1, n2
    for _ in range(10):
        x0, x4, x8, x12 = _qr(x0, x4, x8, x12)
        x1, x5, x9, x13 = _qr(x1, x5, x9, x13)
        x2, x6, x10, x14 = _qr(x2, x6, x10, x14)
        x3, x7, x11, x15 = _qr(x3, x7, x11, x15)
        x0, x5, x10, x15 = _qr(x0, x5, x10, x15)
        x1, x6, x11, x12 = _qr(x1, x6, x11, x12)
        x2, x7, x8, x13 = _qr(x2, x7, x8, x13)
        x3, x4, x9, x14 = _qr(x3, x4, x9, x14)
    # Stack the 16 keystream words into a [LANES, 16] tile, word w at column w: each tl.join adds
    # a last axis of 2, so joining (w, w + 8), then (.., +4), (.., +2), (.., +1) builds the axes
    # (bit 3, bit 2, bit 1, bit 0) of the word index, and a row-major reshape is [LANES, 16].
    j0 = tl.join(x0 + i0, x8 + k4)
    j1 = tl.join(x1 + i1, x9 + k5)
    j2 = tl.join(x2 + i2, x10 + k6)
    j3 = tl.join(x3 + i3, x11 + k7)
    j4 = tl.join(x4 + k0, x12 + ctr)
    j5 = tl.join(x5 + k1, x13 + n0)
    j6 = tl.join(x6 + k2, x14 + n1)
    j7 = tl.join(x7 + k3, x15 + n2)
    j0 = tl.join(j0, j4)
    j1 = tl.join(j1, j5)
    j2 = tl.join(j2, j6)
    j3 = tl.join(j3, j7)
    j0 = tl.join(j0, j2)
    j1 = tl.join(j1, j3)
    ks = tl.reshape(tl.join(j0, j1), [LANES, 16])  # [LANES, 16] uint32
    widx = blk[:, None] * 16 + tl.arange(0, 16)[None, :]  # [LANES, 16] word index in the message
    inside = widx * 4 < nbytes
    c = tl.load(src_ptr + src_off + widx, mask=inside, other=0).to(tl.uint32, bitcast=True)
    p = (c ^ ks) & _word_mask(widx, nbytes)
    tl.store(dst_ptr + dst_off + widx, p.to(tl.int32, bitcast=True), mask=inside)


@triton.jit
def _mulmod(a0, a1, a2, a3, a4, b0, b1, b2, b3, b4):
    """(a * b) mod 2^130 - 5 on 26-bit limbs (uint64); a limbs < 2^27, b limbs < 2^26 + 2^8."""
    M: tl.constexpr = 0x3FFFFFF
    s1 = b1 * 5
    s2 = b2 * 5
    s3 = b3 * 5
    s4 = b4 * 5
    d0 = a0 * b0 + a1 * s4 + a2 * s3 + a3 * s2 + a4 * s1
    d1 = a0 * b1 + a1 * b0 + a2 * s4 + a3 * s3 + a4 * s2
    d2 = a0 * b2 + a1 * b1 + a2 * b0 + a3 * s4 + a4 * s3
    d3 = a0 * b3 + a1 * b2 + a2 * b1 + a3 * b0 + a4 * s4
    d4 = a0 * b4 + a1 * b3 + a2 * b2 + a3 * b1 + a4 * b0
    d1 += d0 >> 26
    h0 = d0 & M
    d2 += d1 >> 26
    h1 = d1 & M
    d3 += d2 >> 26
    h2 = d2 & M
    d4 += d3 >> 26
    h3 = d3 & M
    h0 += (d4 >> 26) * 5
    h4 = d4 & M
    h1 += h0 >> 26
    h0 = h0 & M
    return h0, h1, h2, h3, h4


_LIMBS = ("r0", "r1", "r2", "r3", "r4", "q0", "q1", "q2", "q3", "q4")
# The lane layout's integers follow the segment's size (a 2 MiB spill: 1,024 lanes of 128 blocks, no
# padding; 3 x 2 MiB: 4,096 lanes of 96; past 64 x 2 MiB: 65,536 lanes of 2n), so left specialised
# (equal to 1, divisible by 16, or neither) each new segment size could compile another variant on
# the tier worker while the step loop waits for it. They bound loops and index blocks, nothing a
# vector load's alignment depends on.
_LANE_LAYOUT = ("nblocks", "pad", "blocks_per_lane", "exp_bits")


@triton.jit(do_not_specialize=(*_LIMBS, *_LANE_LAYOUT))
def _poly1305_kernel(
    src_ptr,  # int32 words; the ciphertext starts at word src_off
    r0, r1, r2, r3, r4,  # limbs of r (fully reduced, 26-bit each: int32 scalars)
    q0, q1, q2, q3, q4,  # limbs of R = r^N
    out_ptr,  # int64 [num_programs, 5]: per-program limb sums
    src_off,
    nbytes,
    nblocks,  # c = ceil(nbytes / 16)
    pad,  # N * K - c
    blocks_per_lane,  # K
    exp_bits,  # bits of N
    LANES: tl.constexpr,
):
    M: tl.constexpr = 0x3FFFFFF
    pid = tl.program_id(0)
    n_lanes = tl.num_programs(0).to(tl.int64) * LANES
    lane = pid.to(tl.int64) * LANES + tl.arange(0, LANES)  # [LANES]
    zero = tl.zeros([LANES], dtype=tl.uint64)
    r0 = r0.to(tl.uint64) + zero
    r1 = r1.to(tl.uint64) + zero
    r2 = r2.to(tl.uint64) + zero
    r3 = r3.to(tl.uint64) + zero
    r4 = r4.to(tl.uint64) + zero
    q0 = q0.to(tl.uint64) + zero
    q1 = q1.to(tl.uint64) + zero
    q2 = q2.to(tl.uint64) + zero
    q3 = q3.to(tl.uint64) + zero
    q4 = q4.to(tl.uint64) + zero
    a0, a1, a2, a3, a4 = zero, zero, zero, zero, zero
    w4 = tl.arange(0, 4)[None, :]  # [1, 4]
    for kk in range(blocks_per_lane):
        a0, a1, a2, a3, a4 = _mulmod(a0, a1, a2, a3, a4, q0, q1, q2, q3, q4)
        i = kk * n_lanes + lane - pad  # [LANES] real block index (< 0: front padding)
        live = (i >= 0) & (i < nblocks)
        widx = i[:, None] * 4 + w4  # [LANES, 4] word index
        m = live[:, None] & (widx * 4 < nbytes)
        words = tl.load(src_ptr + src_off + widx, mask=m, other=0).to(tl.uint32, bitcast=True)
        words = words & _word_mask(widx, nbytes)
        lo, hi = tl.split(tl.reshape(words, [LANES, 2, 2]))  # words (0, 2) and (1, 3)
        c0, c2 = tl.split(lo)
        c1, c3 = tl.split(hi)
        c0 = c0.to(tl.uint64)
        c1 = c1.to(tl.uint64)
        c2 = c2.to(tl.uint64)
        c3 = c3.to(tl.uint64)
        a0 += c0 & M
        a1 += ((c0 >> 26) | (c1 << 6)) & M
        a2 += ((c1 >> 20) | (c2 << 12)) & M
        a3 += ((c2 >> 14) | (c3 << 18)) & M
        a4 += (c3 >> 8) | tl.where(live, 1 << 24, 0).to(tl.uint64)
    # times r^(N - lane): square-and-multiply over the exponent's bits
    e = n_lanes - lane
    p0, p1, p2, p3, p4 = zero + 1, zero, zero, zero, zero
    b0, b1, b2, b3, b4 = r0, r1, r2, r3, r4
    for bit in range(exp_bits):
        t0, t1, t2, t3, t4 = _mulmod(p0, p1, p2, p3, p4, b0, b1, b2, b3, b4)
        take = ((e >> bit) & 1) == 1
        p0 = tl.where(take, t0, p0)
        p1 = tl.where(take, t1, p1)
        p2 = tl.where(take, t2, p2)
        p3 = tl.where(take, t3, p3)
        p4 = tl.where(take, t4, p4)
        b0, b1, b2, b3, b4 = _mulmod(b0, b1, b2, b3, b4, b0, b1, b2, b3, b4)
    a0, a1, a2, a3, a4 = _mulmod(a0, a1, a2, a3, a4, p0, p1, p2, p3, p4)
    base = out_ptr + pid * 5
    tl.store(base + 0, tl.sum(a0.to(tl.int64), axis=0))
    tl.store(base + 1, tl.sum(a1.to(tl.int64), axis=0))
    tl.store(base + 2, tl.sum(a2.to(tl.int64), axis=0))
    tl.store(base + 3, tl.sum(a3.to(tl.int64), axis=0))
    tl.store(base + 4, tl.sum(a4.to(tl.int64), axis=0))


def _limbs(x: int) -> list[int]:
    return [(x >> (26 * i)) & 0x3FFFFFF for i in range(5)]


def _check_words(t: torch.Tensor, what: str) -> None:
    if t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{what} must be a contiguous 1-D int32 tensor (a byte buffer viewed as words)")


def chacha20_xor(src: torch.Tensor, src_off: int, nbytes: int, key: bytes, nonce: bytes, counter: int,
                 dst: torch.Tensor, dst_off: int = 0) -> None:
    """dst words [dst_off, ...) = ChaCha20(key, nonce, counter) XOR src words [src_off, ...), ``nbytes``
    long. Offsets are in 4-byte words; bytes of the last word past ``nbytes`` are written as 0."""
    _check_words(src, "src")
    _check_words(dst, "dst")
    nwords = -(-nbytes // 4)
    if src_off + nwords > src.numel() or dst_off + nwords > dst.numel():
        raise ValueError("ciphertext range runs past a buffer")
    if nbytes == 0:
        return
    grid = (cdiv(-(-nbytes // 64), CHACHA_LANES),)
    _chacha20_xor_kernel[grid](src, dst, *struct.unpack("<8i", key), *struct.unpack("<3i", nonce), src_off, dst_off,
                               nbytes, counter, LANES=CHACHA_LANES)


def poly1305_lane_sums(src: torch.Tensor, src_off: int, nbytes: int, r: int, *,
                       blocks_per_lane: int = _POLY_BLOCKS_PER_LANE) -> torch.Tensor:
    """int64 [5] on src's device: limb sums whose value mod p is Poly1305(r) over the ``nbytes``
    from word ``src_off``, zero-padded to 16 (``sum_i m_i r^(c-i)``). No host sync.

    Lanes double from 128 until each has at most ``blocks_per_lane`` 16-byte blocks (or 65,536
    lanes): a 64 MiB segment gets 32,768 lanes of 128 blocks."""
    _check_words(src, "src")
    c = -(-nbytes // 16)
    if c == 0:
        return torch.zeros(5, dtype=torch.int64, device=src.device)
    lanes = POLY_LANES
    while lanes < _MAX_POLY_LANES and lanes * blocks_per_lane < c:
        lanes *= 2
    k = -(-c // lanes)
    programs = lanes // POLY_LANES
    out = torch.empty(programs, 5, dtype=torch.int64, device=src.device)
    _poly1305_kernel[(programs,)](src, *_limbs(r), *_limbs(pow(r, lanes, P1305)), out, src_off, nbytes, c,
                                  lanes * k - c, k, lanes.bit_length(), LANES=POLY_LANES)
    return out.sum(dim=0)


def limbs_value(sums: Sequence[int]) -> int:
    return sum(int(v) << (26 * i) for i, v in enumerate(sums)) % P1305


@dataclass(frozen=True)
class SealedSpan:
    """One sealed message inside a device word buffer.

    ``ct_word`` is the word offset of its ciphertext (``nbytes`` long) in the source buffer. The
    tag covers all of it; only bytes ``plain_from .. plain_from + plain_bytes`` (``plain_bytes``
    None = to the end; ``plain_from`` a multiple of 64) are decrypted, to word ``out_word`` of the
    destination. ``tag`` and ``aad`` stay on the host (the tag is read from the host copy of the
    blob, so nothing of it is read back from the device).
    """

    nonce: bytes
    ct_word: int
    nbytes: int
    tag: bytes
    aad: bytes
    out_word: int
    plain_from: int = 0
    plain_bytes: int | None = None

    def __post_init__(self) -> None:
        end = self.nbytes if self.plain_bytes is None else self.plain_from + self.plain_bytes
        if self.plain_from % 64 or not 0 <= self.plain_from <= end <= self.nbytes:
            raise ValueError("plain_from must be a multiple of 64 and the range inside the ciphertext")


@dataclass(frozen=True)
class LaunchedSpan:
    """A span whose kernels are queued: its limb sums (on the device) and the host's share of the tag."""

    sums: torch.Tensor  # int64 [5]
    r: int
    s: int
    aad_part: int  # Poly(aad) * r^(c+1) mod p, computed while the kernels run


def launch_span(key: bytes, src: torch.Tensor, span: SealedSpan, dst: torch.Tensor, *,
                blocks_per_lane: int = _POLY_BLOCKS_PER_LANE) -> LaunchedSpan:
    """Queue one span's two kernels on the current stream (no host sync), then compute the AAD's
    share of the tag on the host while they run. ``key`` is the 32-byte ChaCha20-Poly1305 key: it
    goes into a small device tensor per launch and is never logged."""
    if len(key) != 32:
        raise ValueError("ChaCha20-Poly1305 needs a 32-byte key")
    r, s = poly1305_key(key, span.nonce)
    sums = poly1305_lane_sums(src, span.ct_word, span.nbytes, r, blocks_per_lane=blocks_per_lane)
    n = span.nbytes - span.plain_from if span.plain_bytes is None else span.plain_bytes
    chacha20_xor(src, span.ct_word + span.plain_from // 4, n, key, span.nonce, 1 + span.plain_from // 64,
                 dst, span.out_word)
    return LaunchedSpan(sums, r, s, aad_term(r, span.aad, span.nbytes))


def check_tags(spans: Sequence[SealedSpan], launched: Sequence[LaunchedSpan]) -> list[bool]:
    """One device-to-host read of every span's limb sums; True where the tag matches. A False span's
    plaintext in the destination is garbage the caller must drop."""
    if not spans:
        return []
    host = torch.stack([x.sums for x in launched]).cpu().tolist()
    return [hmac.compare_digest(finish_tag(x.r, x.s, len(span.aad), span.nbytes, x.aad_part, limbs_value(limb)),
                                span.tag)
            for span, x, limb in zip(spans, launched, host, strict=True)]


def open_sealed(key: bytes, src: torch.Tensor, spans: Sequence[SealedSpan], dst: torch.Tensor, *,
                blocks_per_lane: int = _POLY_BLOCKS_PER_LANE) -> list[bool]:
    """Decrypt every span into ``dst`` and check its tag; one host sync for all of them.
    Returns one flag per span (see ``check_tags``)."""
    if len(key) != 32:
        raise ValueError("ChaCha20-Poly1305 needs a 32-byte key")
    return check_tags(spans, [launch_span(key, src, s, dst, blocks_per_lane=blocks_per_lane) for s in spans])


@dataclass(frozen=True)
class LaunchedSeal:
    """A seal whose kernels are queued: the tag is ``seal_tag(this)`` once the stream has run them."""

    sums: torch.Tensor  # int64 [5] on the device
    r: int
    s: int
    aad_part: int
    aad_len: int
    nbytes: int


def launch_seal(key: bytes, nonce: bytes, src: torch.Tensor, src_off: int, nbytes: int, aad: bytes,
                dst: torch.Tensor, dst_off: int, *, blocks_per_lane: int = _POLY_BLOCKS_PER_LANE) -> LaunchedSeal:
    """Queue the encryption of ``nbytes`` plaintext words from ``src[src_off:]`` into ``dst[dst_off:]``
    (the same buffer and offset encrypts in place: each word is read before it is written, by the
    same lane) and the tag's kernel over that ciphertext, on the current stream; no host sync.
    ``nonce`` must be fresh for every call under ``key`` (12 random bytes from a CSPRNG)."""
    if len(key) != 32 or len(nonce) != 12:
        raise ValueError("ChaCha20-Poly1305 needs a 32-byte key and a 12-byte nonce")
    r, s = poly1305_key(key, nonce)
    chacha20_xor(src, src_off, nbytes, key, nonce, 1, dst, dst_off)
    sums = poly1305_lane_sums(dst, dst_off, nbytes, r, blocks_per_lane=blocks_per_lane)
    return LaunchedSeal(sums, r, s, aad_term(r, aad, nbytes), len(aad), nbytes)


def seal_tag(launched: LaunchedSeal, sums: Sequence[int] | None = None) -> bytes:
    """The 16-byte tag of a launched seal. Reads its limb sums from the device (a sync on their
    stream) unless the caller already read them (``sums``, e.g. several seals in one read)."""
    limb = launched.sums.cpu().tolist() if sums is None else sums
    return finish_tag(launched.r, launched.s, launched.aad_len, launched.nbytes, launched.aad_part, limbs_value(limb))
