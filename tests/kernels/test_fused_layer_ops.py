"""The fused layer kernels (add + RMSNorm, RoPE + KV write, SiLU x up) against prefixgate_kernels.reference.

Fresh random inputs per case; the interpreter runs fp16/fp32 (its fp32 -> bf16 cast rounds unlike
torch's), tests/kernels/test_gpu.py runs the same cases in bf16 on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from prefixgate_kernels import reference as ref
from prefixgate_kernels import triton_ops
from tests.kernels.kernel_cases import INTERPRET, make_kv_cache

pytestmark = pytest.mark.skipif(not INTERPRET, reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all(), "non-finite output"
    return float((got - want).norm() / want.norm().clamp(min=1e-12))


def tol(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]


def run_norm_case(tokens, hidden, dtype, with_residual, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hidden, generator=gen) * 2).to(device=device, dtype=dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device=device, dtype=dtype)
    if not with_residual:
        got = triton_ops.rms_norm(x, weight, 1e-5)
        want = ref.rms_norm(x, weight, 1e-5)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert rel_err(got, want) < tol(dtype)
        return
    residual = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)
    res_want = residual.clone()
    got = triton_ops.add_rms_norm(x, residual, weight, 1e-5)
    want = ref.add_rms_norm(x, res_want, weight, 1e-5)
    # the sum is one rounding of the same two values in both: equal up to the cast's tie rule
    assert rel_err(residual, res_want) < tol(dtype) / 4
    assert rel_err(got, want) < tol(dtype)


@pytest.mark.parametrize("tokens,hidden", [(5, 512), (3, 200)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(tokens, hidden, dtype, with_residual):
    run_norm_case(tokens, hidden, dtype, with_residual, seed=tokens * hidden + with_residual)


def run_rotary_case(q_heads, kv_heads, head_dim, block_size, kv_dtype, dtype, seed, device="cpu", tokens=7,
                    with_bias=False):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 6
    k_cache, v_cache, ks, vs = make_kv_cache(num_blocks, block_size, kv_heads, head_dim, kv_dtype, device, gen)
    qkv = (torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen) * 2).to(device=device, dtype=dtype)
    pos = torch.randint(0, 5000, (tokens,), generator=gen).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(device), emb.sin().to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(torch.int64)
    slots[1] = -1
    slots = slots.to(device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_s = [s.clone() if s is not None else None for s in (ks, vs)]
    # a key bias as large as the keys (real models' channel means are, engine/kv_calibration.py): a
    # kernel that ignored it would be off by ~100%
    bias = (torch.randn(kv_heads, head_dim, generator=gen) * 2).to(device=device, dtype=dtype) if with_bias else None
    q_want = ref.rotary_write_kv(qkv, cos, sin, want_k, want_v, slots, q_heads, want_s[0], want_s[1], bias)
    q_got = triton_ops.rotary_write_kv(qkv, cos, sin, k_cache, v_cache, slots, q_heads, ks, vs, bias)
    assert q_got.shape == (tokens, q_heads, head_dim) and q_got.is_contiguous()
    assert rel_err(q_got, q_want) < tol(dtype)
    # The rotated k may differ from torch's by one ulp of the compute dtype (bf16 on the GPU), which
    # can move its quantized value by a step (two for int8, whose per-head scale can move too).
    for got, want, s_got, s_want in ((k_cache, want_k, ks, want_s[0]), (v_cache, want_v, vs, want_s[1])):
        if kv_dtype == torch.int8:
            assert (got.int() - want.int()).abs().max() <= 2
            assert (got != want).float().mean() < 0.05
            torch.testing.assert_close(s_got, s_want, rtol=tol(dtype), atol=0)
        elif kv_dtype == ref.FP8_DTYPE:
            # x*cos + rot(x)*sin cancels for some elements: there one bf16 ulp of the products is many
            # e4m3 steps of the small result, so the check is on the whole tensor and on the share of
            # differing bytes, not per element
            assert rel_err(got.float(), want.float()) < 2e-2
            assert (got.view(torch.uint8) != want.view(torch.uint8)).float().mean() < 0.05
        else:
            assert rel_err(got, want) < tol(dtype)
        untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
        untouched[slots[slots >= 0].cpu()] = False
        flat_got = got.reshape(num_blocks * block_size, -1)[untouched.to(device)]
        flat_want = want.reshape(num_blocks * block_size, -1)[untouched.to(device)]
        assert torch.equal(flat_got.view(torch.uint8), flat_want.view(torch.uint8)), "a slot outside the mapping changed"


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size", [(8, 2, 64, 16), (7, 1, 32, 32), (6, 3, 16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_write_kv_matches_reference(q_heads, kv_heads, head_dim, block_size, dtype):
    run_rotary_case(q_heads, kv_heads, head_dim, block_size, dtype, dtype, seed=q_heads * head_dim)


@pytest.mark.parametrize("kv_dtype", [ref.FP8_DTYPE, torch.int8])
def test_rotary_write_kv_quantized_cache(kv_dtype):
    run_rotary_case(8, 2, 64, 16, kv_dtype, torch.float16, seed=5)


@pytest.mark.parametrize("kv_dtype,dtype", [(ref.FP8_DTYPE, torch.float16), (torch.float32, torch.float32),
                                            (torch.float16, torch.float16)])
@pytest.mark.parametrize("seed", [21, 22])
def test_rotary_write_kv_subtracts_the_key_bias(kv_dtype, dtype, seed):
    """The fp8 calibration's key bias, subtracted after RoPE as the plain path does (fresh inputs per seed)."""
    run_rotary_case(8, 2, 64, 16, kv_dtype, dtype, seed=seed, with_bias=True)
    run_rotary_case(6, 3, 32, 32, kv_dtype, dtype, seed=seed + 100, with_bias=True)


def test_rotary_write_kv_rejects_a_bad_key_bias():
    kc, vc, _, _ = make_kv_cache(2, 16, 2, 16, torch.float32, "cpu", torch.Generator().manual_seed(0))
    with pytest.raises(AssertionError, match="k_bias must be"):
        triton_ops.rotary_write_kv(torch.randn(3, 6 * 16), torch.randn(3, 16), torch.randn(3, 16), kc, vc,
                                   torch.zeros(3, dtype=torch.int64), 2, k_bias=torch.zeros(16))


def run_silu_case(tokens, inter, dtype, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(tokens, 2 * inter, generator=gen) * 3).to(device=device, dtype=dtype)
    got = triton_ops.silu_mul(gate_up)
    want = ref.silu_mul(gate_up)
    assert got.shape == (tokens, inter) and got.dtype == dtype
    assert rel_err(got, want) < tol(dtype)


@pytest.mark.parametrize("tokens,inter", [(3, 1024), (2, 1500)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_matches_reference(tokens, inter, dtype):
    run_silu_case(tokens, inter, dtype, seed=tokens + inter)


def test_fused_ops_reject_bad_shapes():
    x = torch.randn(4, 64)
    with pytest.raises(AssertionError, match="weight must be"):
        triton_ops.rms_norm(x, torch.ones(32), 1e-5)
    with pytest.raises(AssertionError, match="residual"):
        triton_ops.add_rms_norm(x, torch.randn(4, 64, dtype=torch.float16), torch.ones(64), 1e-5)
    with pytest.raises(AssertionError, match="even number"):
        triton_ops.silu_mul(torch.randn(2, 7))
    kc, vc, _, _ = make_kv_cache(2, 16, 2, 16, torch.float32, "cpu", torch.Generator().manual_seed(0))
    with pytest.raises(AssertionError, match="qkv must have"):
        triton_ops.rotary_write_kv(torch.randn(3, 10), torch.randn(3, 16), torch.randn(3, 16), kc, vc,
                                   torch.zeros(3, dtype=torch.int64), 4)


def run_skinny_case(m, n, k, dtype, split_k, bias, seed, device="cpu", block_k=64):
    from prefixgate_kernels import skinny_gemm

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(device=device, dtype=dtype)
    b = torch.randn(n, generator=gen).to(device=device, dtype=dtype) if bias else None
    cfg = skinny_gemm.SkinnyConfig(block_n=32, block_k=block_k, split_k=split_k, num_stages=2)
    got = skinny_gemm.skinny_linear(x, w, b, cfg)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double() if b is not None else None)
    assert got.shape == (m, n) and got.dtype == dtype
    assert rel_err(got, want) < tol(dtype)


@pytest.mark.parametrize("m,n,k", [(1, 96, 256), (5, 70, 128), (32, 64, 512)])
@pytest.mark.parametrize("split_k", [1, 2])
def test_skinny_gemm_matches_linear(m, n, k, split_k):
    run_skinny_case(m, n, k, torch.float32, split_k, bias=(m == 5), seed=m * n + split_k)


def test_skinny_gemm_config_rules():
    from prefixgate_kernels import skinny_gemm

    with pytest.raises(AssertionError, match="programmatic dependent launch needs compiled kernels"):
        skinny_gemm.skinny_linear(torch.randn(2, 256), torch.randn(16, 256), None,
                                  skinny_gemm.SkinnyConfig(block_n=16, block_k=256, split_k=1, pdl=True))

    assert skinny_gemm.choose_config(64, 4096, 4096, 132) is None  # too many rows: cuBLAS
    assert skinny_gemm.choose_config(8, 4096, 4000, 132) is None  # K not a multiple of the K tile
    c = skinny_gemm.choose_config(32, 4096, 14336, 132)
    assert c is not None and (14336 // c.block_k) % c.split_k == 0
    assert triton_ops.linear(torch.randn(3, 40), torch.randn(8, 40)).shape == (3, 8)  # CPU: F.linear
    # the engine's tiles: whole K, the widest columns still giving two programs an SM (q|k|v of an 8B layer: 16)
    assert skinny_gemm.chain_config(1, 6144, 4096, 132) == skinny_gemm.SkinnyConfig(16, 256, 1, num_stages=4)
    assert skinny_gemm.chain_config(8, 28672, 4096, 132) == skinny_gemm.SkinnyConfig(64, 256, 1, num_stages=3)
    assert skinny_gemm.chain_config(17, 6144, 4096, 132, max_rows=16) is None
    assert skinny_gemm.chain_config(1, 6144, 4000, 132) is None


def run_gate_up_silu_case(m, inter, k, dtype, seed, device="cpu", block_n=32, block_k=64):
    """The gate|up projection with SiLU x up in its epilogue against silu_mul of the unfused product
    (gate|up rounded to the dtype as the GEMM would store it)."""
    from prefixgate_kernels import gate_up_silu

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(2 * inter, k, generator=gen) * 2 * k ** -0.5).to(device=device, dtype=dtype)
    cfg = gate_up_silu.GateUpConfig(block_n=block_n, block_k=block_k, num_stages=2)
    got = gate_up_silu.gate_up_silu(x, w, cfg)
    want = ref.silu_mul((x.double() @ w.double().T).to(dtype))
    assert got.shape == (m, inter) and got.dtype == dtype
    assert rel_err(got, want) < tol(dtype)
    return got


@pytest.mark.parametrize("m,inter,k", [(1, 96, 256), (3, 72, 128), (16, 64, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gate_up_silu_matches_reference(m, inter, k, dtype):
    run_gate_up_silu_case(m, inter, k, dtype, seed=m * inter + k)


def test_gate_up_silu_rules():
    from prefixgate_kernels import gate_up_silu

    assert gate_up_silu.choose_config(0, 14336, 4096, 132) is None
    assert gate_up_silu.choose_config(gate_up_silu.MAX_ROWS + 1, 14336, 4096, 132) is None
    assert gate_up_silu.choose_config(8, 14336, 4000, 132) is None  # K not a multiple of the K tile
    assert gate_up_silu.choose_config(8, 14336, 4096, 132) == gate_up_silu.GateUpConfig(32, 256, num_stages=3)
    with pytest.raises(AssertionError, match="multiple of"):
        gate_up_silu.gate_up_silu(torch.randn(2, 96), torch.randn(16, 96), gate_up_silu.GateUpConfig(16, 64))


def test_mlp_partials_off_the_gpu_is_the_reference():
    """Off the GPU the op is gate|up, silu_mul, linear_partials."""
    gen = torch.Generator().manual_seed(5)
    x, w_gu, w_down = torch.randn(3, 32, generator=gen), torch.randn(96, 32, generator=gen), torch.randn(16, 48, generator=gen)
    got = triton_ops.mlp_partials(x, w_gu, None, w_down)
    assert got.shape == (3, 16) and rel_err(got, ref.mlp_partials(x, w_gu, None, w_down)) < 1e-6
    with pytest.raises(AssertionError, match="gate_up_weight must be"):
        triton_ops.mlp_partials(x, torch.randn(95, 32), None, w_down)
    with pytest.raises(AssertionError, match="down_weight must be"):
        triton_ops.mlp_partials(x, w_gu, None, torch.randn(16, 47))


def run_partials_norm_case(slices, tokens, hidden, dtype, seed, device="cpu"):
    """add_rms_norm over split-K partials (fp32 [S, T, H]) against the reference given the same
    partials, and against add_rms_norm of their sum rounded to the compute dtype: the same row."""
    gen = torch.Generator().manual_seed(seed)
    parts = (torch.randn(slices, tokens, hidden, generator=gen)).to(device=device)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device=device, dtype=dtype)
    residual = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)
    res_ref, res_sum = residual.clone(), residual.clone()
    got = triton_ops.add_rms_norm(parts, residual, weight, 1e-5)
    want = ref.add_rms_norm(parts, res_ref, weight, 1e-5)
    as_sum = triton_ops.add_rms_norm(parts.sum(0).to(dtype), res_sum, weight, 1e-5)
    assert got.shape == (tokens, hidden) and got.dtype == dtype and residual.dtype == dtype
    assert rel_err(residual, res_ref) < tol(dtype) / 4
    assert rel_err(got, want) < tol(dtype)
    assert rel_err(got, as_sum) < tol(dtype) / 4


@pytest.mark.parametrize("slices,tokens,hidden", [(4, 3, 512), (2, 5, 200), (1, 4, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_rms_norm_sums_partials(slices, tokens, hidden, dtype):
    run_partials_norm_case(slices, tokens, hidden, dtype, seed=slices * tokens + hidden)


def test_add_rms_norm_rejects_bad_partials():
    residual = torch.randn(4, 64, dtype=torch.float16)
    with pytest.raises(AssertionError, match="partials must be contiguous float32"):
        triton_ops.add_rms_norm(torch.randn(2, 4, 64, dtype=torch.float16), residual, torch.ones(64), 1e-5)
    with pytest.raises(AssertionError, match="must be \\[S"):
        triton_ops.add_rms_norm(torch.randn(2, 4, 32), residual, torch.ones(64), 1e-5)


def test_add_rms_norm_launch_hints_leave_the_result_alone():
    """``pdl`` and ``launch_dependents`` are scheduling hints (the norm link, ``triton_ops.NORM_PDL``): the
    interpreter ignores them, so the norm over partials is the same bytes with or without."""
    from prefixgate_kernels import rmsnorm

    gen = torch.Generator().manual_seed(17)
    parts = torch.randn(4, 3, 512, generator=gen)
    weight = (1 + 0.1 * torch.randn(512, generator=gen)).to(torch.float16)
    residual = torch.randn(3, 512, generator=gen).to(torch.float16)
    res_plain, res_hinted = residual.clone(), residual.clone()
    plain = rmsnorm.add_rms_norm(parts, res_plain, weight, 1e-5)
    hinted = rmsnorm.add_rms_norm(parts, res_hinted, weight, 1e-5, launch_dependents=True, pdl=True)
    assert torch.equal(plain, hinted) and torch.equal(res_plain, res_hinted)


def test_norm_link_is_taken_only_by_the_output_it_names():
    """The norm after a projection is launched with PDL only when its x is the output the launch just before it
    named (``_linked_to_next``): not another tensor, and not twice (a second reader did not follow that launch)."""
    out, other = torch.zeros(4, 1, 8), torch.zeros(4, 1, 8)
    assert not triton_ops._takes_link(out)  # nothing named yet
    assert triton_ops._linked_to_next(out) is out
    assert not triton_ops._takes_link(other)  # asked with another tensor: forgotten, not taken
    assert not triton_ops._takes_link(out)
    triton_ops._linked_to_next(out)
    assert triton_ops._takes_link(out) and not triton_ops._takes_link(out)
    triton_ops._linked_to_next(torch.zeros(1))  # its output gone: nothing to match
    assert not triton_ops._takes_link(out)
