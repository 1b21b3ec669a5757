"""Decode attention over whole token rows (prefixgate_kernels.decode_rows; interpreter on CPU) against
prefixgate_kernels.reference on fresh random inputs."""

from __future__ import annotations

import math

import pytest
import torch

from prefixgate_kernels import decode_rows
from prefixgate_kernels import reference as ref
from tests.kernels.kernel_cases import INTERPRET, make_block_tables, make_kv_cache, rel_err

pytestmark = pytest.mark.skipif(not INTERPRET, reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")

TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, ref.FP8_DTYPE: 5e-3}


def run_rows_case(head_dim, group, kv_heads, seq_lens, kv_dtype, q_dtype=torch.float16, seed=0, device="cpu",
                  table_width=None, block_size=16, **launch):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum((n + block_size - 1) // block_size for n in seq_lens) + 3
    k_cache, v_cache, ks, vs = make_kv_cache(num_blocks, block_size, kv_heads, head_dim,
                                             kv_dtype if kv_dtype is not None else q_dtype, device, gen)
    tables = make_block_tables(seq_lens, block_size, num_blocks, gen, device)
    if table_width is not None:  # a CUDA graph's table: wider than the live contexts
        pad = torch.zeros(tables.shape[0], table_width - tables.shape[1], dtype=tables.dtype, device=device)
        tables = torch.cat([tables, pad], dim=1)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=gen).to(device=device, dtype=q_dtype)
    scale = 1 / math.sqrt(head_dim)
    want = ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, ks, vs)
    got = decode_rows.paged_decode_rows(q, k_cache, v_cache, tables, lens, scale, ks, vs, **launch)
    assert got.shape == q.shape and got.dtype == q.dtype
    err = rel_err(got, want)
    assert err < TOL[kv_dtype if kv_dtype is not None else q_dtype], f"relative error {err:.2e}"
    return err


@pytest.mark.parametrize("kv_dtype", [None, ref.FP8_DTYPE])
@pytest.mark.parametrize("group,kv_heads", [(3, 3), (1, 5), (4, 2), (8, 1)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_rows_match_reference(kv_dtype, group, kv_heads, num_splits):
    """Head counts padded to a power of two (3 -> 4, 5 -> 8) and not (2, 1); lengths of one token, under a
    tile, across tiles and pages; one split or three (the short sequences' later splits empty), merged by the
    last split of each sequence."""
    run_rows_case(64, group, kv_heads, [1, 13, 70, 300], kv_dtype, num_splits=num_splits, block_n=32,
                  seed=7 * group + kv_heads + num_splits)


def test_rows_launchers_own_choices_over_a_graph_shaped_table():
    """The default tile (``tile_tokens``) and split count from a table much wider than the contexts: each
    sequence's own context is cut into the splits, as a CUDA graph's launch needs."""
    assert decode_rows.tile_tokens(3, 64, ref.FP8_DTYPE) == 16  # 4 KB of whole rows (heads padded to 4)
    assert decode_rows.tile_tokens(1, 64, ref.FP8_DTYPE) == 64
    assert decode_rows.tile_tokens(8, 128, torch.bfloat16) == 16  # never under an MMA's K
    run_rows_case(64, 3, 3, [1, 150, 9, 333], ref.FP8_DTYPE, table_width=64, seed=3)


def test_rows_leave_merge_counters_zero():
    counters = torch.zeros(4, dtype=torch.int32)
    for seed in (1, 2):  # the second launch finds them zero again
        run_rows_case(64, 3, 3, [200, 40], ref.FP8_DTYPE, num_splits=4, block_n=32, merge_counters=counters,
                      seed=seed)
        assert int(counters.abs().sum()) == 0


def test_rows_bf16_queries_head_dim_128():
    run_rows_case(128, 4, 3, [77, 5, 260], None, q_dtype=torch.bfloat16, num_splits=2, block_n=16, seed=9)


def test_rows_refuse_what_they_cannot_read():
    gen = torch.Generator().manual_seed(0)
    k8, v8, ks, vs = make_kv_cache(4, 16, 3, 64, torch.int8, "cpu", gen)
    tables = make_block_tables([20], 16, 4, gen, "cpu")
    lens = torch.tensor([20], dtype=torch.int32)
    q = torch.randn(1, 9, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="int8"):
        decode_rows.paged_decode_rows(q, k8, v8, tables, lens, 0.125, ks, vs)
    k, v, ks, vs = make_kv_cache(4, 16, 3, 64, ref.FP8_DTYPE, "cpu", gen)
    with pytest.raises(ValueError, match="evenly"):
        decode_rows.paged_decode_rows(q[:, :8], k, v, tables, lens, 0.125, ks, vs)
    wide = torch.zeros(*k.shape[:3], 128, dtype=torch.float32).to(k.dtype)
    apart = wide[..., :64]  # each head's row 128 values from the next
    apart.copy_(k)
    with pytest.raises(ValueError, match="heads adjacent"):
        decode_rows.paged_decode_rows(q, apart, v, tables, lens, 0.125, ks, vs)
    with pytest.raises(ValueError, match="block_n"):
        decode_rows.paged_decode_rows(q, k, v, tables, lens, 0.125, ks, vs, block_n=24)
    with pytest.raises(ValueError, match="heads of q's 32"):
        decode_rows.paged_decode_rows(q[..., :32], k, v, tables, lens, 0.125, ks, vs)
    assert decode_rows.paged_decode_rows(q[:0], k, v, tables[:0], lens[:0], 0.125, ks, vs).shape == (0, 9, 64)
