"""Paged ragged prefill attention (Triton, interpreter on CPU) against prefixgate_kernels.reference."""

from __future__ import annotations

import math

import pytest
import torch

from prefixgate_kernels import prefill_attention, triton_ops
from prefixgate_kernels import reference as ref
from prefixgate_kernels.launch_layout import CacheLayout
from tests.kernels.kernel_cases import INTERPRET, make_block_tables, make_kv_cache, rel_err

pytestmark = pytest.mark.skipif(not INTERPRET, reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")

TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, ref.FP8_DTYPE: 5e-3, torch.int8: 5e-3}


def run_case(head_dim, group, block_size, cached, new, kv_dtype=None, q_dtype=torch.float16, kv_heads=2,
             seed=0, device="cpu", prefill=None, **launch):
    """cached[i] tokens already in the cache + new[i] new tokens (also in the cache) per sequence.
    ``prefill``: another kernel of ``paged_prefill``'s arguments (q .. scale) to check instead."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(cached, new)]
    num_blocks = sum((n + block_size - 1) // block_size for n in seq_lens) + 2
    k_cache, v_cache, ks, vs = make_kv_cache(num_blocks, block_size, kv_heads, head_dim, kv_dtype or q_dtype,
                                             device, gen)
    tables = make_block_tables(seq_lens, block_size, num_blocks, gen, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = torch.randn(sum(new), kv_heads * group, head_dim, generator=gen).to(device=device, dtype=q_dtype)
    scale = 1 / math.sqrt(head_dim)
    want = ref.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale, ks, vs)
    if prefill is not None:
        got = prefill(q, k_cache, v_cache, tables, cu, lens, scale)
    elif launch:
        got = prefill_attention.paged_prefill(q, k_cache, v_cache, tables, cu, lens, scale, ks, vs, **launch)
    else:
        got = triton_ops.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale, ks, vs)
    assert got.shape == q.shape and got.dtype == q.dtype
    err = rel_err(got, want)
    assert err < TOL[kv_dtype or q_dtype], f"relative error {err:.2e}"
    return err


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_matches_reference_fp16(head_dim, group, block_size):
    # A fresh prompt, a cached prefix not aligned to blocks, a one-token chunk and an empty sequence.
    run_case(head_dim, group, block_size, cached=[0, 21, 40, 5], new=[19, 7, 1, 0], seed=head_dim * group + block_size)


def test_prefill_tiles_cross_the_diagonal():
    # Small tiles so one sequence spans several query tiles and the masked loop starts mid-context.
    run_case(64, 4, 16, cached=[35, 0], new=[37, 50], block_m=16, block_n=16, seed=5)


def test_prefill_bf16_queries_upcast_in_interpreter():
    run_case(64, 4, 16, cached=[17], new=[9], q_dtype=torch.bfloat16, seed=9)


@pytest.mark.parametrize("kv_dtype", [ref.FP8_DTYPE, torch.int8])
def test_prefill_quantized_kv(kv_dtype):
    run_case(64, 4, 16, cached=[20, 0], new=[6, 11], kv_dtype=kv_dtype, seed=13)


def test_prefill_checks_inputs():
    gen = torch.Generator().manual_seed(0)
    k, v, _, _ = make_kv_cache(4, 16, 2, 64, torch.float16, "cpu", gen)
    q = torch.randn(5, 4, 64, dtype=torch.float16)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(AssertionError, match="cu_seqlens_q must have 2 entries"):
        triton_ops.paged_prefill_attention(q, k, v, tables, torch.tensor([0, 5, 5], dtype=torch.int32),
                                           torch.tensor([5], dtype=torch.int32), 0.1)
    with pytest.raises(AssertionError, match="q head_dim"):
        triton_ops.paged_prefill_attention(q[..., :32], k, v, tables, torch.tensor([0, 5], dtype=torch.int32),
                                           torch.tensor([5], dtype=torch.int32), 0.1)


@pytest.mark.parametrize("kv_dtype", [None, ref.FP8_DTYPE, torch.int8])
@pytest.mark.parametrize("head_dim,group,block_size", [(64, 1, 16), (128, 4, 32), (64, 8, 16)])
@pytest.mark.parametrize("num_splits", [2, 5])
def test_prefill_split_kv_matches_reference(kv_dtype, head_dim, group, block_size, num_splits):
    # Key tiles narrower than query tiles, so the splits cut through cached keys, through the causal
    # diagonal (rows that see no key of a split: the NaN guard) and past the end (empty splits): a fresh
    # prompt, a long prefix, a one-token chunk, an empty sequence.
    run_case(head_dim, group, block_size, cached=[0, 150, 40, 5], new=[37, 9, 1, 0], kv_dtype=kv_dtype,
             block_m=32, block_n=16, num_splits=num_splits, seed=num_splits * 100 + head_dim + group + block_size)


def test_prefill_length_hint_splits_a_grid_that_leaves_the_gpu_idle():
    # One query tile of one head against 4,100 keys: the interpreter's 4 fake SMs would run 1 program.
    assert prefill_attention.choose_prefill_splits(1, 1, 4100, 4) == 4
    run_case(64, 1, 16, cached=[4090], new=[10], kv_heads=1, block_m=16, block_n=16, seed=31,
             context_lens=[4100])


def test_prefill_split_choice():
    h200 = 132
    # the prefix hit, 1 x (7,680 + 512): 4 tiles x 32 heads = 128 programs fill 132 SMs
    assert prefill_attention.choose_prefill_splits(4, 32, 8192, h200) == 1
    # a full grid (4 x (8,192 + 512)) and a short context never split
    assert prefill_attention.choose_prefill_splits(16, 32, 8704, h200) == 1
    assert prefill_attention.choose_prefill_splits(1, 32, 1500, h200) == 1
    # a 64-token suffix over 8K cached: 32 programs -> 4 splits of ~2K keys (128 programs)
    assert prefill_attention.choose_prefill_splits(1, 32, 8192, h200) == 4
    # 8 kv-head-sized grids over 64K: as many splits as fill the wave, capped at 16
    assert prefill_attention.choose_prefill_splits(1, 8, 65536, h200) == 16
    # 64-row tiles (two programs per SM) for a step of at most 64 tokens: 8 splits of 1K keys
    assert prefill_attention.choose_prefill_splits(1, 32, 8192, h200, programs_per_sm=2) == 8


def test_prefill_plan_sends_split_launches_to_the_specialised_kernel(monkeypatch):
    """plan_prefill on an H200 (132 SMs, the Gluon kernels runnable): a launch Triton would split goes to
    the warp-specialised kernel at the split count its own 128-row tiles ask for, where it fits (16-bit,
    head dim 64 / 128, blocks dividing 128, at least 64 rows); the unsplit rule stays as it was."""
    pa = prefill_attention
    monkeypatch.setattr(pa, "gluon_runs_on", lambda device: device.type == "cuda")
    monkeypatch.setattr(pa, "num_sms", lambda device: 132 if device.type == "cuda" else 4)
    gpu = torch.device("cuda")  # a description only: nothing is allocated on it
    bf, fp = torch.bfloat16, torch.float16
    spec, triton_kernel = pa.PrefillKernel.SPECIALIZED, pa.PrefillKernel.TRITON

    def plan(tokens, heads, context, layout, seqs=1):
        return pa.plan_prefill(tokens, seqs, heads, context, gpu, layout)

    hd64, hd128 = CacheLayout(64, 16, bf, bf), CacheLayout(128, 16, bf, bf)
    # the 9 / 3-head hit (Llama-3.2-1B-like at head dim 64): 4 tiles x 9 heads, Triton splits 8 ways; the
    # specialised tiles are the same 128 rows, so the same count
    assert plan(512, 9, 8192, hd64) == pa.PrefillPlan(spec, 8)
    # a 64-token suffix over 8,128 cached: Triton's 64-row tiles (two an SM) split 8 ways, the specialised
    # kernel's 128-row tiles (one an SM) 4
    assert plan(64, 32, 8192, hd128) == pa.PrefillPlan(spec, 4)
    assert pa.launch_splits(64, 1, 32, 8192, gpu) == 8  # no layout: Triton's count, as before
    assert pa.launch_splits(64, 1, 32, 8192, gpu, hd128) == 4
    # two sequences: 2 + 1 tiles a head
    assert plan(170, 6, 8200, CacheLayout(64, 32, fp, fp), seqs=2) == pa.PrefillPlan(spec, 4)
    # unsplit launches: the 32-head hit fills the GPU; no hint, no split
    assert plan(512, 32, 8192, hd128) == pa.PrefillPlan(spec, 1)
    assert plan(512, 9, None, hd64) == pa.PrefillPlan(spec, 1)
    assert plan(100, 9, None, hd64) == pa.PrefillPlan(triton_kernel, 1)  # unsplit needs 128 rows
    # split launches the specialised kernel does not fit: Triton at its own count
    for layout, tokens in ((CacheLayout(128, 16, bf, ref.FP8_DTYPE), 64), (CacheLayout(96, 16, bf, bf), 64),
                           (CacheLayout(128, 256, bf, bf), 64), (hd128, 48), (None, 64)):
        assert plan(tokens, 32, 8192, layout) == pa.PrefillPlan(triton_kernel, 8), (layout, tokens)
    # Triton's 64-row tiles split (100 programs in a 264-program wave) where the specialised ones would not
    # (a 132-program wave): Triton keeps the launch
    assert plan(64, 100, 2048, hd128) == pa.PrefillPlan(triton_kernel, 2)
    # the overlapped kernel has no split form
    monkeypatch.setattr(pa, "PREFILL_KERNEL", pa.PrefillKernel.OVERLAP)
    assert plan(64, 32, 8192, hd128) == pa.PrefillPlan(triton_kernel, 8)
    # off the GPU nothing changes
    assert pa.plan_prefill(64, 1, 32, 8192, torch.device("cpu"), hd128).kernel is triton_kernel


def test_prefill_tiles():
    tiles = prefill_attention.choose_prefill_tiles
    assert (tiles(512, True).block_m, tiles(512, True).programs_per_sm) == (128, 1)
    assert (tiles(65, True).block_m, tiles(64, True).block_m, tiles(64, True).programs_per_sm) == (128, 64, 2)
    assert tiles(4096, False).block_m == 16


def test_gluon_kernels_only_where_written():
    """The Gluon prefills run on an sm_90 GPU under Triton 3.6 only (prefill_attention.gluon_supported): the
    Gluon API moves between releases, and their wgmma exists on Hopper alone. Elsewhere the Triton kernel
    takes their launches, so a fresh install on another GPU or Triton still prefills."""
    ok = prefill_attention.gluon_supported
    assert ok((9, 0), "3.6.0") and ok((9, 0), "3.6.1+git1234")
    assert not ok((9, 0), "3.9.0")  # async_copy_global_to_shared removed
    assert not ok((9, 0), "3.5.1")
    assert not ok((8, 0), "3.6.0")  # A100: no wgmma
    assert not ok((8, 9), "3.6.0")
    assert not ok((10, 0), "3.6.0")  # Blackwell: tcgen05, not wgmma
    assert not prefill_attention.gluon_runs_on(torch.device("cpu"))


def test_prefill_gluon_dispatch_rule(monkeypatch):
    """Which launches a Gluon kernel takes (prefill_attention.gluon_kernel): 16-bit, one dtype, head dim 64
    or 128, at least GLUON_MIN_TOKENS rows, cache blocks that divide the kernel's key tiles; the benchmarks'
    switch picks the kernel or turns both off."""
    pa = prefill_attention
    n = pa.GLUON_MIN_TOKENS
    bf, fp, f32 = torch.bfloat16, torch.float16, torch.float32
    assert pa.PREFILL_KERNEL is pa.PrefillKernel.SPECIALIZED  # the measured default
    assert pa.gluon_kernel(n, 128, 16, bf, bf, bf) is pa.PrefillKernel.SPECIALIZED
    assert pa.gluon_kernel(4 * n, 64, 32, fp, fp, fp) is pa.PrefillKernel.SPECIALIZED
    assert pa.gluon_kernel(n, 128, 128, bf, bf, bf) is pa.PrefillKernel.SPECIALIZED  # one block a key tile
    triton_cases = [
        (n - 1, 64, 16, bf, bf, bf),  # a short chunk: 64-row tiles, splits
        (n, 96, 16, bf, bf, bf),  # a head dim no Gluon kernel was measured at
        (n, 128, 256, bf, bf, bf),  # a block wider than a key tile
        (n, 64, 16, f32, f32, f32),
        (n, 64, 16, bf, ref.FP8_DTYPE, ref.FP8_DTYPE),
        (n, 64, 16, bf, fp, fp),
    ]
    for case in triton_cases:
        assert pa.gluon_kernel(*case) is pa.PrefillKernel.TRITON, case
    monkeypatch.setattr(pa, "PREFILL_KERNEL", pa.PrefillKernel.OVERLAP)
    assert pa.gluon_kernel(n, 64, 16, bf, bf, bf) is pa.PrefillKernel.OVERLAP
    assert pa.gluon_kernel(n, 64, 128, bf, bf, bf) is pa.PrefillKernel.TRITON  # its key tiles are 64 wide
    monkeypatch.setattr(pa, "PREFILL_KERNEL", pa.PrefillKernel.TRITON)
    assert pa.gluon_kernel(n, 64, 16, bf, bf, bf) is pa.PrefillKernel.TRITON


def test_the_warm_up_compiles_the_merge_for_every_split_count_the_planner_picks():
    """``compile_merges`` (the GPU runner's warm-up) launches the merge at ``split_counts()``: every count
    ``choose_prefill_splits`` returns above one must be among them, whatever the grid and context."""
    from prefixgate_kernels.prefill_attention import choose_prefill_splits, split_counts

    picked = {choose_prefill_splits(tiles, heads, context, sms, per_sm)
              for tiles in (1, 2, 3, 5, 8, 40) for heads in (1, 8, 32, 64)
              for context in (100, 1024, 2049, 8193, 65536, 131072, 1 << 20)
              for sms in (1, 78, 114, 132) for per_sm in (1, 2)}
    assert picked - {1} <= set(split_counts()), picked
    assert max(picked) == max(split_counts())  # the largest count is reached, not only bounded
