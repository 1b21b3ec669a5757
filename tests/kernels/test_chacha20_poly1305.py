"""ChaCha20-Poly1305 decryption kernels against `cryptography` (RFC 8439 vectors and random inputs).

The interpreter runs small sizes on the CPU; ``test_gpu_*`` runs large ones compiled on CUDA. The
pure-Python implementation in ``prefixgate_kernels.chacha20_poly1305_ref`` is the second oracle.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.poly1305 import Poly1305

from prefixgate_kernels import chacha20_poly1305 as gpu_aead
from prefixgate_kernels import chacha20_poly1305_ref as ref
from tests.kernels.kernel_cases import INTERPRET, gpu_ready

SUNSCREEN = (b"Ladies and Gentlemen of the class of '99: If I could offer you only one tip for the future, "
             b"sunscreen would be it.")
interp_only = pytest.mark.skipif(not INTERPRET, reason="interpreter case (the GPU runs test_gpu_*)")
needs_gpu = pytest.mark.skipif(not gpu_ready(), reason="needs CUDA and compiled Triton")


def as_words(data: bytes, device: str, front: int = 16) -> torch.Tensor:
    """``front`` zero bytes, then ``data``, padded to 64 bytes, as int32 words (the tier's blob layout)."""
    raw = b"\0" * front + data
    raw += b"\0" * (-len(raw) % 64 + 64)
    return torch.frombuffer(bytearray(raw), dtype=torch.int32).clone().to(device)


def open_with_kernels(key: bytes, nonce: bytes, sealed: bytes, aad: bytes, device: str,
                      blocks_per_lane: int = 128) -> bytes | None:
    ct, tag = sealed[:-16], sealed[-16:]
    src = as_words(ct, device)
    dst = torch.full_like(src, -1)
    [ok] = gpu_aead.open_sealed(key, src, [gpu_aead.SealedSpan(nonce, 4, len(ct), tag, aad, 0)], dst,
                                blocks_per_lane=blocks_per_lane)
    return dst.cpu().numpy().tobytes()[:len(ct)] if ok else None


# ---- the oracles agree with RFC 8439 ---------------------------------------------------------------
def test_reference_block_function_rfc8439_2_3_2():
    block = ref.chacha20_block(bytes(range(32)), 1, bytes.fromhex("000000090000004a00000000"))
    assert block.hex() == ("10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c068030422aa9ac3d46c4e"
                           "d2826446079faa0914c2d705d98b02a2b5129cd1de164eb9cbd083e8a2503c4e")


def test_reference_poly1305_rfc8439_2_5_2():
    key = bytes.fromhex("85d6be7857556d337f4452fe42d506a80103808afb0db2fd4abff6af4149f51b")
    msg = b"Cryptographic Forum Research Group"
    expect = "a8061dc1305136c6c22b8baf0c0127a9"
    assert Poly1305.generate_tag(key, msg).hex() == expect
    r = int.from_bytes(key[:16], "little") & ref.R_CLAMP
    acc = ref.poly1305_blocks(r, msg[:32])  # 2 full blocks, then the short one by hand
    acc = (acc + int.from_bytes(msg[32:] + b"\x01", "little")) * r % ref.P1305
    assert ((acc + int.from_bytes(key[16:], "little")) % (1 << 128)).to_bytes(16, "little").hex() == expect


def test_one_time_key_rfc8439_2_6_2_and_random():
    """The host's one-time Poly1305 key (compiled ChaCha20) equals RFC 8439's 2.6.2 vector and the
    pure-Python block on random keys and nonces; a wrong counter or nonce layout differs at once."""
    key = bytes(range(0x80, 0xA0))
    r, s = gpu_aead.poly1305_key(key, bytes.fromhex("000000000001020304050607"))
    otk = "8ad5a08b905f81cc815040274ab29471a833b637e3fd0da508dbb8e2fdd1a646"
    assert (r, s) == (int.from_bytes(bytes.fromhex(otk[:32]), "little") & ref.R_CLAMP,
                      int.from_bytes(bytes.fromhex(otk[32:]), "little"))
    rng = random.Random(os.urandom(8))
    for _ in range(50):
        key, nonce = rng.randbytes(32), rng.randbytes(12)
        assert gpu_aead.poly1305_key(key, nonce) == ref.poly1305_key(key, nonce)
    with pytest.raises(ValueError):
        gpu_aead.poly1305_key(key, nonce[:8])


RFC_AEAD = dict(key=bytes(range(0x80, 0xA0)), nonce=bytes.fromhex("070000004041424344454647"),
                aad=bytes.fromhex("50515253c0c1c2c3c4c5c6c7"),
                ct_head="d31a8d34648e60db7b86afbc53ef7ec2", tag="1ae10b594f09e26a7e902ecbd0600691")


def test_reference_aead_rfc8439_2_8_2():
    v = RFC_AEAD
    sealed = ChaCha20Poly1305(v["key"]).encrypt(v["nonce"], SUNSCREEN, v["aad"])
    assert sealed[:16].hex() == v["ct_head"] and sealed[-16:].hex() == v["tag"]
    assert ref.seal(v["key"], v["nonce"], SUNSCREEN, v["aad"]) == sealed
    assert ref.open_(v["key"], v["nonce"], sealed, v["aad"]) == SUNSCREEN


# ---- the kernels -----------------------------------------------------------------------------------
def keystream_case(device: str):
    # RFC 8439 2.4.2: ChaCha20 with counter 1 (the kernel XORs, so encrypting is the same call)
    key, nonce = bytes(range(32)), bytes.fromhex("000000000000004a00000000")
    src = as_words(SUNSCREEN, device, front=0)
    dst = torch.zeros_like(src)
    gpu_aead.chacha20_xor(src, 0, len(SUNSCREEN), key, nonce, 1, dst)
    out = dst.cpu().numpy().tobytes()
    assert out[:32].hex() == "6e2e359a2568f98041ba0728dd0d6981e97e7aec1d4360c20a27afccfd9fae0b"
    assert out[:len(SUNSCREEN)] == ref.chacha20_xor(key, 1, nonce, SUNSCREEN)
    assert out[len(SUNSCREEN):] == bytes(len(out) - len(SUNSCREEN))  # nothing written past the end


def aead_vector_case(device: str):
    v = RFC_AEAD
    sealed = bytes.fromhex(v["ct_head"]) + ChaCha20Poly1305(v["key"]).encrypt(v["nonce"], SUNSCREEN, v["aad"])[16:]
    assert open_with_kernels(v["key"], v["nonce"], sealed, v["aad"], device) == SUNSCREEN


def random_cases(device: str, lengths: list[int], seed: int, blocks_per_lane: int = 128):
    rng = random.Random(seed)
    for n in lengths:
        key, nonce = rng.randbytes(32), rng.randbytes(12)
        aad, plain = rng.randbytes(rng.choice([0, 1, 12, 16, 17, 300])), rng.randbytes(n)
        sealed = ChaCha20Poly1305(key).encrypt(nonce, plain, aad)
        assert open_with_kernels(key, nonce, sealed, aad, device, blocks_per_lane) == plain, n
        # any change to ciphertext, tag, aad, nonce or key is a rejection, never data
        flip = bytearray(sealed)
        flip[rng.randrange(len(flip))] ^= 1 << rng.randrange(8)
        assert open_with_kernels(key, nonce, bytes(flip), aad, device) is None, n
        assert open_with_kernels(key, nonce, sealed, aad + b"x", device) is None, n
        assert open_with_kernels(key, bytes(12), sealed, aad, device) is None, n
        assert open_with_kernels(os.urandom(32), nonce, sealed, aad, device) is None, n


@interp_only
def test_keystream_rfc8439_2_4_2():
    keystream_case("cpu")


@interp_only
def test_aead_rfc8439_2_8_2():
    aead_vector_case("cpu")


@interp_only
def test_random_keys_nonces_lengths_aad():
    random_cases("cpu", [0, 1, 3, 15, 16, 17, 64, 65, 129, 1000], seed=7)


@interp_only
def test_many_lanes_front_padding():
    """Lengths that give several lanes (a multi-program Horner with front padding, powers r^(N-j))."""
    # 2 blocks per lane: 1,029 blocks -> 1,024 lanes (8 programs) of 2 blocks, 1,019 front padding
    random_cases("cpu", [16 * 1024 + 16 * 4 + 3], seed=3, blocks_per_lane=2)


@interp_only
def test_several_spans_in_one_buffer_one_bad():
    """``open_sealed`` over three segments laid out back to back: each checked on its own."""
    rng = random.Random(11)
    key = rng.randbytes(32)
    raw, spans, plains = bytearray(), [], []
    for i, n in enumerate([100, 4096, 333]):
        nonce, aad, plain = rng.randbytes(12), rng.randbytes(40), rng.randbytes(n)
        sealed = bytearray(ChaCha20Poly1305(key).encrypt(nonce, plain, aad))
        if i == 1:
            sealed[7] ^= 0x80
        off = len(raw) + 16
        raw += bytes(16) + sealed[:-16] + bytes(-(len(sealed) - 16) % 64)
        spans.append(gpu_aead.SealedSpan(nonce, off // 4, n, bytes(sealed[-16:]), aad, off // 4))
        plains.append(plain)
    src = torch.frombuffer(raw + bytes(64), dtype=torch.int32).clone()
    dst = torch.zeros_like(src)
    assert gpu_aead.open_sealed(key, src, spans, dst) == [True, False, True]
    out = dst.numpy().tobytes()
    for s, p in zip(spans, plains, strict=True):
        if s is not spans[1]:
            assert out[s.out_word * 4: s.out_word * 4 + s.nbytes] == p


@pytest.mark.parametrize("bad", ["key", "words"])
def test_launcher_rejects_bad_arguments(bad):
    src = torch.zeros(64, dtype=torch.int32)
    with pytest.raises(ValueError):
        if bad == "key":
            gpu_aead.open_sealed(b"short", src, [], src)
        else:
            gpu_aead.chacha20_xor(src.to(torch.int64), 0, 16, bytes(32), bytes(12), 1, src)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", ["keystream", "aead"])
def test_gpu_vectors(case):
    (keystream_case if case == "keystream" else aead_vector_case)("cuda")


@pytest.mark.gpu
@needs_gpu
def test_gpu_random_large():
    # up to 2 MiB + change: many programs, lanes at their cap, odd tails
    random_cases("cuda", [0, 1, 17, 65, 4099, 1 << 20, (2 << 20) + 4 * 16 + 5, 64 * 2 * 1024 * 16 + 1], seed=5)


@interp_only
def test_part_of_a_span_decrypted_whole_tag_checked():
    """A restore that needs blocks 2-3 of a 5-block segment: only their bytes are decrypted (counter
    from 1 + 128/64), the tag still covers everything."""
    rng = random.Random(2)
    key, nonce, aad, plain = rng.randbytes(32), rng.randbytes(12), b"aad", rng.randbytes(5 * 64)
    sealed = ChaCha20Poly1305(key).encrypt(nonce, plain, aad)
    src = as_words(sealed[:-16], "cpu")
    dst = torch.zeros(64, dtype=torch.int32)
    span = gpu_aead.SealedSpan(nonce, 4, len(plain), sealed[-16:], aad, 0, plain_from=128, plain_bytes=128)
    assert gpu_aead.open_sealed(key, src, [span], dst) == [True]
    assert dst.numpy().tobytes()[:128] == plain[128:256] and not dst[32:].any()
    with pytest.raises(ValueError):
        gpu_aead.SealedSpan(nonce, 4, len(plain), sealed[-16:], aad, 0, plain_from=100)


# ---- sealing (the spill direction): the same kernels, against `cryptography` ----------------------
def seal_with_kernels(key: bytes, nonce: bytes, plain: bytes, aad: bytes, device: str, *, in_place: bool,
                      blocks_per_lane: int = 128) -> bytes:
    """ciphertext || tag as `cryptography`'s ``encrypt`` returns it, sealed by the kernels."""
    src = as_words(plain, device)
    dst = src if in_place else torch.full_like(src, -1)
    launched = gpu_aead.launch_seal(key, nonce, src, 4, len(plain), aad, dst, 4, blocks_per_lane=blocks_per_lane)
    return dst.cpu().numpy().tobytes()[16:16 + len(plain)] + gpu_aead.seal_tag(launched)


def seal_cases(device: str, lengths: list[int], seed: int, blocks_per_lane: int = 128):
    rng = random.Random(seed)
    for i, n in enumerate(lengths):
        key, nonce = rng.randbytes(32), rng.randbytes(12)
        aad, plain = rng.randbytes(rng.choice([0, 1, 12, 16, 17, 300])), rng.randbytes(n)
        expect = ChaCha20Poly1305(key).encrypt(nonce, plain, aad)
        got = seal_with_kernels(key, nonce, plain, aad, device, in_place=bool(i % 2), blocks_per_lane=blocks_per_lane)
        assert got == expect, n
        assert ChaCha20Poly1305(key).decrypt(nonce, got, aad) == plain


def seal_vector_case(device: str):
    v = RFC_AEAD
    got = seal_with_kernels(v["key"], v["nonce"], SUNSCREEN, v["aad"], device, in_place=True)
    assert got[:16].hex() == v["ct_head"] and got[-16:].hex() == v["tag"]
    assert got == ref.seal(v["key"], v["nonce"], SUNSCREEN, v["aad"])


@interp_only
def test_seal_rfc8439_2_8_2():
    seal_vector_case("cpu")


@interp_only
def test_seal_random_against_cryptography():
    seal_cases("cpu", [0, 1, 3, 16, 17, 64, 65, 129, 1000, 4096], seed=13)
    seal_cases("cpu", [16 * 1024 + 16 * 4 + 3], seed=14, blocks_per_lane=2)  # many lanes, front padding


def test_seal_rejects_bad_arguments():
    src = torch.zeros(64, dtype=torch.int32)
    with pytest.raises(ValueError):
        gpu_aead.launch_seal(bytes(32), bytes(11), src, 0, 16, b"", src, 0)


@pytest.mark.gpu
@needs_gpu
def test_gpu_seal_vectors_and_random_large():
    seal_vector_case("cuda")
    seal_cases("cuda", [0, 1, 17, 65, 4099, 1 << 20, (2 << 20) + 4 * 16 + 5, 64 * 2 * 1024 * 16 + 1], seed=15)
