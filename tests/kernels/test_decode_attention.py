"""Paged decode attention (Triton, interpreter on CPU) against prefixgate_kernels.reference on fresh random inputs."""

from __future__ import annotations

import math

import pytest
import torch

from prefixgate_kernels import decode_attention, triton_ops
from prefixgate_kernels import reference as ref
from tests.kernels.kernel_cases import INTERPRET, make_block_tables, make_kv_cache, rel_err

pytestmark = pytest.mark.skipif(not INTERPRET, reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")

# Relative L2 error bounds against the fp32-accumulating reference (whose K/V are rounded to q's dtype).
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-4, ref.FP8_DTYPE: 5e-3, torch.int8: 5e-3}


def run_case(head_dim, group, block_size, seq_lens, kv_dtype, q_dtype=torch.float16, num_splits=None,
             kv_heads=2, seed=0, device="cpu", length_hint=False, table_width=None, split_by_length=None,
             fused_merge=None, merge_counters=None, **tiles):
    gen = torch.Generator().manual_seed(seed)
    q_heads = kv_heads * group
    num_blocks = sum((n + block_size - 1) // block_size for n in seq_lens) + 3
    k_cache, v_cache, ks, vs = make_kv_cache(num_blocks, block_size, kv_heads, head_dim,
                                             kv_dtype if kv_dtype is not None else q_dtype, device, gen)
    tables = make_block_tables(seq_lens, block_size, num_blocks, gen, device)
    if table_width is not None:  # a CUDA graph's table: as wide as the longest context it may meet
        assert table_width >= tables.shape[1]
        pad = torch.zeros(tables.shape[0], table_width - tables.shape[1], dtype=tables.dtype, device=device)
        tables = torch.cat([tables, pad], dim=1)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(len(seq_lens), q_heads, head_dim, generator=gen).to(device=device, dtype=q_dtype)
    scale = 1 / math.sqrt(head_dim)
    want = ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, ks, vs)
    if tiles or split_by_length is not None or fused_merge is not None:  # launch options: straight to the launcher
        got = decode_attention.paged_decode(q, k_cache, v_cache, tables, lens, scale, ks, vs, num_splits=num_splits,
                                            split_by_length=split_by_length, fused_merge=fused_merge is not False,
                                            merge_counters=merge_counters, **tiles)
    elif num_splits is None:
        got = triton_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, ks, vs,
                                                context_lens=list(seq_lens) if length_hint else None)
    else:
        got = decode_attention.paged_decode(q, k_cache, v_cache, tables, lens, scale, ks, vs, num_splits=num_splits)
    assert got.shape == q.shape and got.dtype == q.dtype
    err = rel_err(got, want)
    assert err < TOL[kv_dtype if kv_dtype is not None else q_dtype], f"relative error {err:.2e}"
    return err


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_reference_fp16(head_dim, group, block_size):
    # Ragged lengths: 1 token, under one block, not a multiple of the block size, several blocks.
    # Odd parametrizations force 3 splits (split-KV + reduce); the rest go through the launcher's choice.
    forced = 3 if (head_dim + group + block_size) % 2 else None
    run_case(head_dim, group, block_size, [1, 13, 70, 33], None, num_splits=forced, seed=head_dim + group + block_size)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_decode_split_counts_agree(num_splits):
    # A context of 150 tokens cut into 1, 2 or 5 slices: splits past a short sequence's end must be ignored.
    run_case(64, 4, 16, [150, 9, 64], None, num_splits=num_splits, seed=7)


@pytest.mark.parametrize("fused_merge", [True, False])
@pytest.mark.parametrize("split_by_length", [False, True])
@pytest.mark.parametrize("num_splits", [2, 5, 16])
def test_decode_split_placements_agree(num_splits, split_by_length, fused_merge):
    """Splits at fixed offsets of the table's capacity, or each sequence's own context cut into
    ``num_splits`` (a CUDA graph's launch): the same attention, over a table much wider than the
    contexts (lengths from 1 token to several tiles; 16 splits leave short sequences empty splits),
    merged by the last split to finish or by the second kernel."""
    run_case(64, 4, 16, [150, 1, 9, 64, 333], None, num_splits=num_splits, table_width=64,
             split_by_length=split_by_length, fused_merge=fused_merge, seed=5 + num_splits)


@pytest.mark.parametrize("kv_dtype", [None, ref.FP8_DTYPE, torch.int8])
def test_decode_merge_in_chunks_of_splits(kv_dtype):
    """Eight q heads a KV head at head dim 128 leave the merging program four splits per chunk
    (``_MERGE_TILE_ELEMENTS``): 16 splits, of which the longest sequence fills 11 and the shortest one."""
    chunk = decode_attention._MERGE_TILE_ELEMENTS // (8 * 128)
    assert chunk == 4
    run_case(128, 8, 16, [700, 1, 200, 65], kv_dtype, num_splits=16, table_width=64, split_by_length=True,
             fused_merge=True, seed=61)


@pytest.mark.parametrize("merge_chunk", [2, 8, 16])
def test_decode_merge_chunk_override(merge_chunk):
    """``merge_chunk`` (tuning) sets how many splits' partials the merging program reads at once:
    2 (many chunks), 8, and 16 (every split of the longest sequence's 11 in one chunk) give the
    reference's attention; a count that is not a power of two is refused."""
    run_case(128, 8, 16, [700, 1, 200, 65], ref.FP8_DTYPE, num_splits=16, table_width=64, split_by_length=True,
             fused_merge=True, merge_chunk=merge_chunk, seed=63 + merge_chunk)


def tiny_launch(**options) -> torch.Tensor:
    """One sequence of 20 tokens, one KV head of 64, two splits: for the launcher's option checks."""
    q = torch.zeros(1, 4, 64, dtype=torch.float16)
    k = torch.zeros(2, 16, 1, 64, dtype=torch.float16)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    lens = torch.tensor([20], dtype=torch.int32)
    return decode_attention.paged_decode(q, k, k, tables, lens, 0.125, None, None, num_splits=2, **options)


def test_decode_merge_chunk_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="merge_chunk"):
        tiny_launch(merge_chunk=3)


def test_decode_stamps_need_a_compiled_kernel():
    """The GPU-timer stamps are inline PTX: the interpreter refuses them with a clear error."""
    with pytest.raises(ValueError, match="stamps"):
        tiny_launch(stamps=torch.full((64,), -1, dtype=torch.int64))


def test_decode_merge_counters_are_left_zero_for_the_next_launch():
    """One counter buffer serves launch after launch (as the engine's decode graphs share theirs):
    every launch finds it zero and leaves it zero, and each result is the reference's."""
    counters = torch.zeros(4 * 2, dtype=torch.int32)
    for seed, lens in enumerate(([300, 5, 129], [64, 700, 1], [1000, 999, 998])):
        run_case(64, 4, 16, lens, None, num_splits=8, table_width=64, split_by_length=True, fused_merge=True,
                 merge_counters=counters, seed=70 + seed)
        assert int(counters.abs().sum()) == 0


@pytest.mark.parametrize("kv_dtype", [None, ref.FP8_DTYPE, torch.int8])
def test_decode_graph_shaped_launch_cuts_live_contexts(kv_dtype):
    """The launcher without a length hint (how the decode CUDA graphs call it) over a table sized for
    4,096 tokens holding contexts of 1-700: its split count comes from the table, the splits from each
    live context."""
    lens = [700, 1, 45, 300]
    assert decode_attention.choose_num_splits(len(lens), 2, 4096, 4, 64) > 1
    run_case(128, 4, 16, lens, kv_dtype, table_width=4096 // 16, seed=41)


def test_decode_bf16_queries_upcast_in_interpreter():
    run_case(64, 4, 16, [40, 5], None, q_dtype=torch.bfloat16, num_splits=2, seed=3)


@pytest.mark.parametrize("kv_dtype", [ref.FP8_DTYPE, torch.int8])
@pytest.mark.parametrize("head_dim,group,block_size", [(64, 4, 16), (128, 8, 32)])
def test_decode_quantized_kv(kv_dtype, head_dim, group, block_size):
    run_case(head_dim, group, block_size, [45, 17, 1], kv_dtype, num_splits=2 if block_size == 16 else None,
             seed=11 + head_dim)


@pytest.mark.parametrize("kv_dtype", [None, ref.FP8_DTYPE, torch.int8])
def test_decode_with_a_register_cap_and_eight_warps(kv_dtype):
    # the launch options of the 8-bit tile candidates (a register cap for more programs per SM, more
    # warps per program) reach the kernel; the interpreter ignores the cap, the GPU suite compiles it
    run_case(128, 4, 16, [45, 130, 1], kv_dtype, num_splits=2, block_n=32, num_warps=8, num_stages=2,
             max_registers=128, seed=23)


@pytest.mark.parametrize("kv_dtype", [None, ref.FP8_DTYPE])
def test_decode_with_a_length_hint(kv_dtype):
    """The host-side lengths pick the split count (several here: one long sequence among short ones,
    on the interpreter's 4-SM machine); the result is the reference's."""
    lens = [1100, 3, 40, 17, 900]
    assert decode_attention.choose_num_splits(len(lens), 2, 1104, 4, 64, context_lens=lens) > 1
    run_case(64, 4, 16, lens, kv_dtype, length_hint=True, seed=31)


def test_decode_joins_kv_heads_only_where_they_share_a_scale():
    assert decode_attention.joined_kv_heads(64, 8, ref.FP8_DTYPE) == 2
    assert decode_attention.joined_kv_heads(32, 2, ref.FP8_DTYPE) == 2
    # an odd head count is read per head: threes measured no faster (session 17), see joined_kv_heads
    assert decode_attention.joined_kv_heads(64, 3, ref.FP8_DTYPE) == 1
    assert decode_attention.joined_kv_heads(64, 5, ref.FP8_DTYPE) == 1
    assert decode_attention.joined_kv_heads(128, 8, ref.FP8_DTYPE) == 1  # its rows are whole lines already
    assert decode_attention.joined_kv_heads(64, 8, torch.int8) == 1  # one scale per token and head
    assert decode_attention.joined_kv_heads(64, 8, torch.bfloat16) == 1


@pytest.mark.parametrize("joined", [2, 1])
@pytest.mark.parametrize("head_dim,group,kv_heads", [(64, 4, 2), (64, 1, 4), (32, 3, 4), (64, 7, 2)])
def test_decode_fp8_with_kv_heads_in_pairs(head_dim, group, kv_heads, joined):
    """fp8 at head dim <= 64 reads two KV heads as one of twice the width: every query head's output
    is still its own head's attention, with one split, several, and cut by the live lengths (the
    graph-shaped launch), over the engine's strided layer views."""
    lens = [150, 1, 45, 64]
    for seed, options in enumerate(({"num_splits": 1}, {"num_splits": 3},
                                    {"num_splits": 4, "split_by_length": True})):
        run_case(head_dim, group, 16, lens, ref.FP8_DTYPE, kv_heads=kv_heads, table_width=16,
                 joined_heads=joined, seed=90 + seed + head_dim + group, **options)


@pytest.mark.parametrize("kv_dtype", [ref.FP8_DTYPE, None])
@pytest.mark.parametrize("head_dim,group,kv_heads", [(64, 3, 3), (32, 1, 3), (64, 2, 6)])
def test_decode_with_kv_heads_in_threes(kv_dtype, head_dim, group, kv_heads):
    """Three KV heads read as one row of 3 x head dim, padded to a power of two (192 of 256 columns at
    head dim 64, masked): each query head's output is its own head's, in fp8 and in fp16, with one
    split, several, and cut by the live lengths; 6 heads are two such rows."""
    lens = [150, 1, 45, 64, 200]
    for seed, options in enumerate(({"num_splits": 1}, {"num_splits": 3},
                                    {"num_splits": 4, "split_by_length": True})):
        run_case(head_dim, group, 16, lens, kv_dtype, kv_heads=kv_heads, table_width=16,
                 joined_heads=3, seed=70 + seed + head_dim + group, **options)


def test_decode_pairs_kv_heads_only_with_the_merge_in_the_kernel():
    gen = torch.Generator().manual_seed(0)
    k, v, ks, vs = make_kv_cache(4, 16, 2, 64, ref.FP8_DTYPE, "cpu", gen)
    q, tables, lens = torch.randn(1, 8, 64), torch.zeros(1, 4, dtype=torch.int32), torch.tensor([40], dtype=torch.int32)
    with pytest.raises(ValueError, match="read 2 together"):
        decode_attention.paged_decode(q, k, v, tables, lens, 0.125, ks, vs, num_splits=2, fused_merge=False,
                                      joined_heads=2)
    with pytest.raises(ValueError, match="at least 1"):
        decode_attention.paged_decode(q, k, v, tables, lens, 0.125, ks, vs, num_splits=2, joined_heads=0)
    k_apart = torch.empty(4, 16, 2, 2 * 64, dtype=k.dtype)[..., :64]
    with pytest.raises(ValueError, match="adjacent"):  # no view of such a cache joins its heads
        decode_attention.paged_decode(q, k_apart, v, tables, lens, 0.125, ks, vs, num_splits=2, joined_heads=2)
    # the second kernel's baseline reads heads one by one unless told otherwise
    want = ref.paged_decode_attention(q, k, v, tables, lens, 0.125, ks, vs)
    out = decode_attention.paged_decode(q, k, v, tables, lens, 0.125, ks, vs, num_splits=2, fused_merge=False)
    assert rel_err(out, want) < TOL[ref.FP8_DTYPE]
    # and so does a cache whose heads are not adjacent in memory (no pair view of it exists)
    k_apart = torch.empty(4, 16, 2, 2 * 64, dtype=k.dtype)[..., :64]
    k_apart.copy_(k)
    out = decode_attention.paged_decode(q, k_apart, v, tables, lens, 0.125, ks, vs, num_splits=2)
    assert rel_err(out, want) < TOL[ref.FP8_DTYPE]


def test_decode_checks_inputs():
    gen = torch.Generator().manual_seed(0)
    k, v, _, _ = make_kv_cache(4, 16, 2, 64, torch.float16, "cpu", gen)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    lens = torch.tensor([5], dtype=torch.int32)
    q = torch.randn(1, 3, 64, dtype=torch.float16)
    with pytest.raises(AssertionError, match="multiple of kv_heads"):
        triton_ops.paged_decode_attention(q, k, v, tables, lens, 0.1)
    q = torch.randn(1, 4, 64, dtype=torch.float16)
    with pytest.raises(AssertionError, match="block_tables must be int32"):
        triton_ops.paged_decode_attention(q, k, v, tables.long(), lens, 0.1)
    with pytest.raises(AssertionError, match="head_dim must be contiguous"):
        triton_ops.paged_decode_attention(q, k.transpose(2, 3), v.transpose(2, 3), tables, lens, 0.1)
    with pytest.raises(AssertionError, match="merge_counters must be int32"):
        triton_ops.paged_decode_attention(q, k, v, tables, lens, 0.1, merge_counters=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(AssertionError, match="the launch needs 2"):
        triton_ops.paged_decode_attention(q, k, v, tables, lens, 0.1, merge_counters=torch.zeros(1, dtype=torch.int32))
    k8, v8, _, _ = make_kv_cache(4, 16, 2, 64, ref.FP8_DTYPE, "cpu", gen)
    with pytest.raises(AssertionError, match="needs k_scale and v_scale"):
        triton_ops.paged_decode_attention(q, k8, v8, tables, lens, 0.1)


