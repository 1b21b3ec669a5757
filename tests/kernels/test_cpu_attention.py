"""The CPU attention path (prefixgate_kernels.cpu_attention: SDPA prefill, grouped decode) against the reference oracle.

Ragged batches over fragmented block tables: cached prefixes of every length relative to the
block size, prefill chunks with and without a prefix, decode batches of mixed lengths, and every
cache dtype (quantized ones dequantize on gather).
"""

from __future__ import annotations

import math

import pytest
import torch

from prefixgate_kernels import cpu_attention
from prefixgate_kernels import reference as ref
from tests.kernels.kernel_cases import make_block_tables, make_kv_cache, rel_err

DTYPES = [torch.float32, torch.bfloat16, ref.FP8_DTYPE, torch.int8]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, ref.FP8_DTYPE: 1e-5, torch.int8: 1e-5}


def _case(kv_dtype, seq_lens, block_size=8, kv_heads=2, group=3, head_dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum((n + block_size - 1) // block_size for n in seq_lens) + 3
    k, v, ks, vs = make_kv_cache(num_blocks, block_size, kv_heads, head_dim, kv_dtype, "cpu", gen)
    tables = make_block_tables(seq_lens, block_size, num_blocks, gen, "cpu")
    q_dtype = torch.bfloat16 if kv_dtype == torch.bfloat16 else torch.float32
    return k, v, ks, vs, tables, q_dtype, kv_heads * group, head_dim, gen


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("cached,new", [([0, 0, 0], [5, 17, 8]), ([3, 8, 21], [9, 1, 16]), ([40], [7]), ([0], [1])])
def test_prefill_matches_reference(kv_dtype, cached, new):
    seq_lens = [c + n for c, n in zip(cached, new)]
    k, v, ks, vs, tables, q_dtype, hq, d, gen = _case(kv_dtype, seq_lens)
    q = torch.randn(sum(new), hq, d, generator=gen).to(q_dtype)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = 1 / math.sqrt(d)
    want = ref.paged_prefill_attention(q, k, v, tables, cu, lens, scale, ks, vs)
    got = cpu_attention.paged_prefill_attention(q, k, v, tables, cu, lens, scale, ks, vs)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel_err(got, want) < TOL[kv_dtype]


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("seq_lens", [[1], [37], [1, 8, 9, 33, 64], [16, 16]])
def test_decode_matches_reference(kv_dtype, seq_lens):
    k, v, ks, vs, tables, q_dtype, hq, d, gen = _case(kv_dtype, seq_lens)
    q = torch.randn(len(seq_lens), hq, d, generator=gen).to(q_dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = 1 / math.sqrt(d)
    want = ref.paged_decode_attention(q, k, v, tables, lens, scale, ks, vs)
    got = cpu_attention.paged_decode_attention(q, k, v, tables, lens, scale, ks, vs)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel_err(got, want) < TOL[kv_dtype]


def test_decode_ignores_keys_past_each_sequence_end():
    """A short sequence batched with a long one must not see the padding blocks' keys."""
    k, v, ks, vs, tables, q_dtype, hq, d, gen = _case(torch.float32, [3, 40])
    q = torch.randn(2, hq, d, generator=gen)
    lens = torch.tensor([3, 40], dtype=torch.int32)
    alone = cpu_attention.paged_decode_attention(q[:1], k, v, tables[:1], lens[:1], 0.25)
    batched = cpu_attention.paged_decode_attention(q, k, v, tables, lens, 0.25)
    torch.testing.assert_close(batched[:1], alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_decode_padding_rows_of_length_zero_are_zero_and_leave_the_others_alone(kv_dtype):
    """A fixed-size batch (a captured graph's unused slots) carries rows of context length 0 whose
    block tables point at block 0 like any row: they attend to nothing, the real rows are exact."""
    k, v, ks, vs, tables, q_dtype, hq, d, gen = _case(kv_dtype, [9, 33, 5])
    pad = torch.zeros(2, tables.shape[1], dtype=tables.dtype)
    tables = torch.cat([tables[:1], pad[:1], tables[1:], pad[1:]])  # [real, pad, real, real, pad]
    lens = torch.tensor([9, 0, 33, 5, 0], dtype=torch.int32)
    q = torch.randn(5, hq, d, generator=gen).to(q_dtype)
    got = cpu_attention.paged_decode_attention(q, k, v, tables, lens, 0.25)
    real = torch.tensor([0, 2, 3])
    want = ref.paged_decode_attention(q[real], k, v, tables[real], lens[real], 0.25)
    assert rel_err(got[real], want) < TOL[kv_dtype]
    assert torch.equal(got[torch.tensor([1, 4])], torch.zeros(2, hq, d, dtype=q_dtype))


def test_decode_batch_of_many_lengths_in_several_groups_matches_reference():
    """40 sequences whose lengths span 1..300 tokens fall into several padded groups
    (prefixgate_kernels.cpu_attention._length_groups); every row still equals the reference's."""
    lens = [1 + (i * 37) % 300 for i in range(40)]
    groups = cpu_attention._length_groups(lens, 8, 2 * 16)
    assert 1 < len(groups) < len(lens) and sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:  # a group pads its members to its longest: bounded by the slack
        assert max(lens[i] for i in g) <= min(lens[i] for i in g) * cpu_attention._PAD_SLACK + 8
    for kv_dtype in (torch.float32, torch.int8):
        k, v, ks, vs, tables, q_dtype, hq, d, gen = _case(kv_dtype, lens)
        q = torch.randn(len(lens), hq, d, generator=gen).to(q_dtype)
        seq = torch.tensor(lens, dtype=torch.int32)
        want = ref.paged_decode_attention(q, k, v, tables, seq, 0.25, ks, vs)
        got = cpu_attention.paged_decode_attention(q, k, v, tables, seq, 0.25, ks, vs)
        assert rel_err(got, want) < TOL[kv_dtype]


def test_mixed_step_decode_tokens_match_reference():
    """A prefill step that also carries decode tokens (chunks of one new token) routes those
    through the batched decode path; the packed output equals the reference's row for row."""
    cached, new = [30, 0, 12, 50, 7], [1, 20, 1, 1, 9]
    seq_lens = [c + n for c, n in zip(cached, new)]
    k, v, ks, vs, tables, q_dtype, hq, d, gen = _case(torch.float32, seq_lens)
    q = torch.randn(sum(new), hq, d, generator=gen)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    want = ref.paged_prefill_attention(q, k, v, tables, cu, lens, 0.25)
    got = cpu_attention.paged_prefill_attention(q, k, v, tables, cu, lens, 0.25)
    assert rel_err(got, want) < TOL[torch.float32]


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_decode_of_sequences_sharing_prefix_blocks_matches_reference(kv_dtype):
    """Sequences whose block tables start with the same blocks (one tenant's cached prompt prefix)
    read those blocks once for all (the cascade split in prefixgate_kernels.cpu_attention._decode_group);
    each row still equals the reference's, whatever the tails' lengths."""
    lens = [53, 49, 60, 57, 51, 55]
    k, v, ks, vs, tables, q_dtype, hq, d, gen = _case(kv_dtype, lens)
    tables[1:, :6] = tables[0, :6]  # 6 shared blocks of 8 tokens = 48 positions
    assert cpu_attention._shared_blocks(tables, min(lens), 8) == 6
    q = torch.randn(len(lens), hq, d, generator=gen).to(q_dtype)
    seq = torch.tensor(lens, dtype=torch.int32)
    want = ref.paged_decode_attention(q, k, v, tables, seq, 0.25, ks, vs)
    got = cpu_attention.paged_decode_attention(q, k, v, tables, seq, 0.25, ks, vs)
    assert rel_err(got, want) < TOL[kv_dtype]
