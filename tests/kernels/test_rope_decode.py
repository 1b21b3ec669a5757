"""RoPE and the K/V write inside the decode attention launch (``decode_attention.RopeWrite``)
against the two kernels it replaces (``rotary_write_kv`` then the attention) and the torch reference.

Fresh random inputs per case. The fused launch stores the same bytes and computes the same
operands as the two kernels, so caches must be byte-equal and outputs equal; the reference is
checked within the dtype's tolerance. tests/kernels/test_gpu.py runs compiled cases.
"""

from __future__ import annotations

import pytest
import torch

from prefixgate_kernels import decode_attention, triton_ops
from prefixgate_kernels import reference as ref
from tests.kernels.kernel_cases import INTERPRET, make_block_tables, make_kv_cache, rel_err


def rope_decode_inputs(q_heads, kv_heads, head_dim, block_size, kv_dtype, dtype, seq_lens, seed, device="cpu",
                       with_bias=False, padded_row=True):
    """A decode step's inputs: q|k|v rows, cos / sin at each sequence's new position, caches holding
    the earlier tokens, block tables, and each token's slot (the last row padding: slot -1)."""
    gen = torch.Generator().manual_seed(seed)
    lens = list(seq_lens) + ([1] if padded_row else [])
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    k_cache, v_cache, ks, vs = make_kv_cache(num_blocks, block_size, kv_heads, head_dim, kv_dtype, device, gen)
    tables = make_block_tables(lens, block_size, num_blocks, gen, device)
    b = len(lens)
    qkv = (torch.randn(b, (q_heads + 2 * kv_heads) * head_dim, generator=gen) * 2).to(device=device, dtype=dtype)
    pos = torch.tensor([n - 1 for n in lens], dtype=torch.float32)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat((pos[:, None] * inv_freq, pos[:, None] * inv_freq), dim=-1)
    cos, sin = emb.cos().to(device), emb.sin().to(device)
    slots = []
    for i, n in enumerate(lens):
        p = n - 1
        slots.append(int(tables[i, p // block_size]) * block_size + p % block_size)
    if padded_row:  # a graph's padding row: nothing written, one harmless token read
        slots[-1] = -1
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    seq_lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    bias = (torch.randn(kv_heads, head_dim, generator=gen) * 2).to(device=device, dtype=dtype) if with_bias else None
    return dict(qkv=qkv, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache, k_scale=ks, v_scale=vs,
                block_tables=tables, seq_lens=seq_lens_t, slot_mapping=slot_mapping, k_bias=bias, q_heads=q_heads)


def _copy_caches(case):
    """The case with its own copy of the caches (and int8 scales), so that two paths write apart."""
    out = dict(case)
    for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
        if out[name] is not None:
            out[name] = out[name].clone()
    return out


def run_two_kernels(c, **launch):
    q = triton_ops.rotary_write_kv(c["qkv"], c["cos"], c["sin"], c["k_cache"], c["v_cache"], c["slot_mapping"],
                                   c["q_heads"], c["k_scale"], c["v_scale"], c["k_bias"])
    return decode_attention.paged_decode(q, c["k_cache"], c["v_cache"], c["block_tables"], c["seq_lens"], 0.125,
                                         c["k_scale"], c["v_scale"], **launch)


def run_fused(c, **launch):
    head_dim = c["k_cache"].shape[3]
    b = c["qkv"].shape[0]
    q = c["qkv"][:, : c["q_heads"] * head_dim].view(b, c["q_heads"], head_dim)
    rope = decode_attention.RopeWrite(c["cos"], c["sin"], c["slot_mapping"], c["k_bias"])
    return decode_attention.paged_decode(q, c["k_cache"], c["v_cache"], c["block_tables"], c["seq_lens"], 0.125,
                                         c["k_scale"], c["v_scale"], rope=rope, **launch)


def run_reference(c):
    return ref.rotary_decode_attention(c["qkv"], c["cos"], c["sin"], c["k_cache"], c["v_cache"], c["slot_mapping"],
                                       c["q_heads"], c["block_tables"], c["seq_lens"], 0.125, c["k_scale"],
                                       c["v_scale"], c["k_bias"])


def _same_bytes(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None:
        return b is None
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def check_fused_case(case, tol, exact=True, **launch):
    """Fused launch == two kernels (caches byte for byte, output exactly), and ~ the reference.
    ``exact=False`` (compiled kernels: two different programs, which a compiler may schedule into
    other instruction forms) asks the outputs to agree within 1e-3 instead."""
    two, fused, want = _copy_caches(case), _copy_caches(case), _copy_caches(case)
    out_two = run_two_kernels(two, **launch)
    out_fused = run_fused(fused, **launch)
    out_want = run_reference(want)
    for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
        assert _same_bytes(fused[name], two[name]), f"{name}: the fused launch wrote other bytes than rotary_write_kv"
    real = case["slot_mapping"] >= 0  # a padding row's output is whatever its one harmless token gives
    if exact:
        assert torch.equal(out_fused[real], out_two[real]), (
            f"fused output differs from the two kernels' by {(out_fused[real].float() - out_two[real].float()).abs().max()}")
    else:
        assert rel_err(out_fused[real], out_two[real]) < 1e-3
    assert rel_err(out_fused[real], out_want[real]) < tol


needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")


@needs_interpreter
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size", [(8, 2, 64, 16), (6, 3, 32, 32), (4, 4, 16, 16)])
@pytest.mark.parametrize("num_splits,by_length", [(1, True), (3, True), (3, False)])
def test_fused_rope_decode_equals_two_kernels_fp16(q_heads, kv_heads, head_dim, block_size, num_splits, by_length):
    case = rope_decode_inputs(q_heads, kv_heads, head_dim, block_size, torch.float16, torch.float16,
                              [37, 130, 16, 65], seed=q_heads * 100 + head_dim + num_splits + by_length)
    lens = case["seq_lens"].tolist()
    hint = {} if by_length else {"context_lens": lens}
    check_fused_case(case, 2e-3, num_splits=num_splits, **hint)


@needs_interpreter
@pytest.mark.parametrize("kv_dtype", [ref.FP8_DTYPE, torch.int8])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_fused_rope_decode_quantized_cache(kv_dtype, num_splits):
    """The writer quantizes as kv_write does (fp8: per-tensor scale; int8: the token's per-head scale
    written beside it, which its own split then reads); the fp8 case subtracts a key bias."""
    case = rope_decode_inputs(8, 2, 32, 16, kv_dtype, torch.float16, [50, 17, 129], seed=7 + num_splits,
                              with_bias=kv_dtype == ref.FP8_DTYPE)
    check_fused_case(case, 3e-2, num_splits=num_splits)


@needs_interpreter
def test_fused_rope_decode_with_empty_splits():
    """Splits past short contexts (1 and 2 tokens over 4 splits) load their query rows before they
    find their split empty, and exit without a store: the cache bytes and outputs are the two kernels'."""
    case = rope_decode_inputs(4, 2, 32, 16, torch.float16, torch.float16, [1, 70, 2, 33], seed=21)
    check_fused_case(case, 2e-3, num_splits=4)


@needs_interpreter
def test_fused_rope_decode_without_padding_and_one_token_contexts():
    """Sequences whose new token is their first (context 1) or starts a block; no padding row."""
    case = rope_decode_inputs(4, 2, 32, 16, torch.float32, torch.float32, [1, 17, 33, 2], seed=11, padded_row=False)
    check_fused_case(case, 1e-5, num_splits=2)


@needs_interpreter
@pytest.mark.parametrize("kv_dtype,head_dim,kv_heads", [(torch.float16, 32, 2), (ref.FP8_DTYPE, 32, 2)])
def test_rotary_decode_attention_op_matches_reference(kv_dtype, head_dim, kv_heads):
    """The op as the engine calls it: one launch for fp16, the two kernels for fp8 at head dim <= 64
    with an even head count (heads read in pairs, which the fused launch does not do)."""
    case = rope_decode_inputs(8, kv_heads, head_dim, 16, kv_dtype, torch.float16, [40, 90, 3], seed=3)
    got, want = _copy_caches(case), _copy_caches(case)
    out = triton_ops.rotary_decode_attention(
        got["qkv"], got["cos"], got["sin"], got["k_cache"], got["v_cache"], got["slot_mapping"], got["q_heads"],
        got["block_tables"], got["seq_lens"], 0.125, got["k_scale"], got["v_scale"], got["k_bias"])
    out_want = run_reference(want)
    real = case["slot_mapping"] >= 0
    assert rel_err(out[real], out_want[real]) < (3e-2 if kv_dtype == ref.FP8_DTYPE else 2e-3)
    untouched = torch.ones(case["k_cache"].shape[0] * case["k_cache"].shape[1], dtype=torch.bool)
    untouched[case["slot_mapping"][real]] = False
    for name in ("k_cache", "v_cache"):
        flat_got = got[name].reshape(untouched.shape[0], -1)[untouched]
        flat_before = case[name].reshape(untouched.shape[0], -1)[untouched]
        assert _same_bytes(flat_got, flat_before), f"{name}: a slot outside the mapping changed"


@needs_interpreter
def test_rotary_decode_attention_is_one_launch_on_head_major_pages(monkeypatch):
    """fp8 at head dim <= 64 with an even head count: on pages laid head by head (the engine's CUDA pool) no heads
    can be read in pairs, so the op takes the one launch (no separate rotary_write_kv) and matches the reference."""
    case = rope_decode_inputs(8, 2, 32, 16, ref.FP8_DTYPE, torch.float16, [40, 90, 3], seed=5)
    for name in ("k_cache", "v_cache"):  # the same values, each page head by head
        case[name] = case[name].transpose(1, 2).contiguous().transpose(1, 2)
    assert not decode_attention.heads_adjacent(case["k_cache"], case["v_cache"])
    assert decode_attention.launcher_joined_heads(case["k_cache"], case["v_cache"]) == 1
    got, want, two = _copy_caches(case), _copy_caches(case), _copy_caches(case)
    run_two_kernels(two)  # rotary_write_kv, then the attention

    def two_kernels(*a, **k):
        raise AssertionError("rotary_write_kv ran: the op kept two kernels")
    monkeypatch.setattr(triton_ops.rotary, "rotary_write_kv", two_kernels)
    out = triton_ops.rotary_decode_attention(
        got["qkv"], got["cos"], got["sin"], got["k_cache"], got["v_cache"], got["slot_mapping"], got["q_heads"],
        got["block_tables"], got["seq_lens"], 0.125, got["k_scale"], got["v_scale"], got["k_bias"])
    out_want = run_reference(want)
    real = case["slot_mapping"] >= 0
    assert rel_err(out[real], out_want[real]) < 3e-2
    for name in ("k_cache", "v_cache"):  # the new tokens written as rotary_write_kv writes them
        assert _same_bytes(got[name], two[name]), name


def test_fused_launch_reads_heads_one_by_one():
    case = rope_decode_inputs(8, 2, 32, 16, torch.float16, torch.float16, [20], seed=1)
    with pytest.raises(ValueError, match="one by one"):
        run_fused(case, joined_heads=2)


def test_fused_launch_needs_q_columns_of_qkv_rows():
    case = rope_decode_inputs(8, 2, 32, 16, torch.float16, torch.float16, [20], seed=1)
    q = case["qkv"][:, : 8 * 32].reshape(-1, 32, 8).transpose(1, 2)  # head_dim not contiguous
    rope = decode_attention.RopeWrite(case["cos"], case["sin"], case["slot_mapping"])
    with pytest.raises(ValueError, match="q columns"):
        decode_attention.paged_decode(q, case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"],
                                      0.125, None, None, rope=rope)


def _as_partials(case, slices=4, seed=0):
    """The case's q|k|v rows as ``slices`` fp32 partials whose in-order sum, rounded, is exactly those rows
    (the last partial makes up the difference, so the rounding is tested on values a GEMM could give)."""
    gen = torch.Generator().manual_seed(seed)
    rows = case["qkv"].float()
    parts = torch.randn(slices, *rows.shape, generator=gen) * 0.5
    parts[-1] = 0.0
    head = parts[0].clone()
    for s in range(1, slices - 1):
        head += parts[s]
    parts[-1] = rows - head
    from prefixgate_kernels import partial_gemm

    summed = partial_gemm.summed(parts, case["qkv"].dtype)
    return parts.contiguous(), summed


@needs_interpreter
@pytest.mark.parametrize("kv_dtype", [torch.float16, ref.FP8_DTYPE])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_fused_rope_decode_reads_qkv_partials(kv_dtype, num_splits):
    """q|k|v given as fp32 K-slice partials (``qkv_projection``'s under ``QKV_PDL``): the one launch sums them
    in order and rounds to the projection's dtype, so it writes the same cache bytes and returns exactly
    what it returns for their rounded sum; the op and the reference take the partials too."""
    case = rope_decode_inputs(8, 2, 32, 16, kv_dtype, torch.float16, [37, 130, 16], seed=40 + num_splits,
                              with_bias=kv_dtype == ref.FP8_DTYPE)
    parts, summed = _as_partials(case, seed=num_splits)
    plain, sliced = _copy_caches(dict(case, qkv=summed)), _copy_caches(dict(case, qkv=summed))
    out_plain = run_fused(plain, num_splits=num_splits)
    b, head_dim = summed.shape[0], case["k_cache"].shape[3]
    q = parts[0, :, : 8 * head_dim].view(b, 8, head_dim)
    rope = decode_attention.RopeWrite(case["cos"], case["sin"], case["slot_mapping"], case["k_bias"], slices=4,
                                      slice_stride=parts.stride(0), dtype=torch.float16)
    out_sliced = decode_attention.paged_decode(q, sliced["k_cache"], sliced["v_cache"], sliced["block_tables"],
                                               sliced["seq_lens"], 0.125, sliced["k_scale"], sliced["v_scale"],
                                               rope=rope, num_splits=num_splits)
    assert out_sliced.dtype == torch.float16
    for name in ("k_cache", "v_cache"):
        assert _same_bytes(sliced[name], plain[name]), f"{name}: other bytes from the partials"
    real = case["slot_mapping"] >= 0
    assert torch.equal(out_sliced[real], out_plain[real])
    op, want = _copy_caches(case), _copy_caches(dict(case, qkv=summed))
    out_op = triton_ops.rotary_decode_attention(
        parts, op["cos"], op["sin"], op["k_cache"], op["v_cache"], op["slot_mapping"], 8, op["block_tables"],
        op["seq_lens"], 0.125, op["k_scale"], op["v_scale"], op["k_bias"], qkv_dtype=torch.float16)
    out_ref = ref.rotary_decode_attention(
        parts, want["cos"], want["sin"], want["k_cache"], want["v_cache"], want["slot_mapping"], 8,
        want["block_tables"], want["seq_lens"], 0.125, want["k_scale"], want["v_scale"], want["k_bias"],
        qkv_dtype=torch.float16)
    assert rel_err(out_op[real], out_ref[real]) < (3e-2 if kv_dtype == ref.FP8_DTYPE else 2e-3)


def test_qkv_partials_need_a_16_bit_dtype_and_a_stride():
    case = rope_decode_inputs(8, 2, 32, 16, torch.float16, torch.float16, [20], seed=1)
    with pytest.raises(ValueError, match="16-bit dtype"):
        decode_attention.RopeWrite(case["cos"], case["sin"], case["slot_mapping"], slices=4, slice_stride=0,
                                   dtype=torch.float16)
    with pytest.raises(ValueError, match="16-bit dtype"):
        decode_attention.RopeWrite(case["cos"], case["sin"], case["slot_mapping"], slices=4, slice_stride=10,
                                   dtype=torch.float32)
