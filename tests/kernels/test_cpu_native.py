"""The native CPU kernels (prefixgate_kernels/cpu_native): paged attention against the plain reference
oracle, the decode-sized GEMV against float32 torch.

Fresh random inputs per case; ragged batches over fragmented block tables of a strided
(block-major, several layers) cache; cached prefixes and chunk lengths around the kernel's
16-key blocks and 2-key pairs; every compiled head dim and several query groups. Plus the switch
and the build cache, and the SDPA fallback when the kernel is off.
"""

from __future__ import annotations

import math

import pytest
import torch

from prefixgate_kernels import cpu_attention, cpu_native
from prefixgate_kernels import reference as ref
from tests.kernels.kernel_cases import make_block_tables, make_kv_cache, rel_err

KERNEL = cpu_native.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no g++ or no AVX-512 BF16 on this CPU")
BF16_TOL = 1e-2  # bf16 probabilities and outputs; the reference computes in float32


def _inputs(seq_lens, new, head_dim, group, kv_heads=2, block_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    k, v, _, _ = make_kv_cache(num_blocks, block_size, kv_heads, head_dim, torch.bfloat16, "cpu", gen)
    tables = make_block_tables(seq_lens, block_size, num_blocks, gen, "cpu")
    q = torch.randn(sum(new), kv_heads * group, head_dim, generator=gen).to(torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, tables, cu, torch.tensor(seq_lens, dtype=torch.int32)


@needs_kernel
@pytest.mark.parametrize("head_dim,group", [(32, 4), (64, 3), (128, 1), (32, 8)])
@pytest.mark.parametrize("cached,new", [
    ([0], [1600]),  # a whole uncached prompt
    ([0, 0, 0], [2, 17, 33]),  # odd lengths: a zero-padded last key pair
    ([1500, 3, 16], [100, 9, 31]),  # chunks over cached prefixes, one block-aligned
    ([15, 47], [2, 64]),
])
def test_native_matches_reference(head_dim, group, cached, new):
    seq_lens = [c + n for c, n in zip(cached, new)]
    q, k, v, tables, cu, lens = _inputs(seq_lens, new, head_dim, group, seed=sum(new) + head_dim)
    scale = 1 / math.sqrt(head_dim)
    want = ref.paged_prefill_attention(q.float(), k.float(), v.float(), tables, cu, lens, scale)
    got = torch.full_like(q, float("nan"))
    KERNEL.attention(q, k, v, tables, cu, lens, scale, got, min_tq=2)
    assert rel_err(got.float(), want) < BF16_TOL


@needs_kernel
def test_native_leaves_single_token_rows_to_the_decode_path():
    """min_tq=2: decode tokens of a mixed step are not written (paged_prefill_attention fills them)."""
    q, k, v, tables, cu, lens = _inputs([40, 9, 70], [1, 9, 1], 32, 4)
    got = torch.full_like(q, float("nan"))
    KERNEL.attention(q, k, v, tables, cu, lens, 0.2, got, min_tq=2)
    assert torch.isnan(got[0]).all() and torch.isnan(got[-1]).all() and not torch.isnan(got[1:10]).any()


@needs_kernel
def test_mixed_step_through_cpu_attention_matches_reference():
    """paged_prefill_attention takes the native kernel for chunks and the grouped decode for
    single tokens; the whole step equals the reference."""
    seq_lens, new = [300, 37, 64, 5], [1, 37, 20, 1]
    q, k, v, tables, cu, lens = _inputs(seq_lens, new, 32, 4, seed=7)
    assert cpu_attention._native_kernel(q, k, None) is KERNEL
    want = ref.paged_prefill_attention(q.float(), k.float(), v.float(), tables, cu, lens, 0.17)
    got = cpu_attention.paged_prefill_attention(q, k, v, tables, cu, lens, 0.17)
    assert got.dtype == torch.bfloat16 and rel_err(got.float(), want) < BF16_TOL


def test_quantized_float32_and_odd_head_dims_do_not_take_the_kernel():
    q = torch.zeros(4, 8, 32, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 2, 32, dtype=torch.bfloat16)
    assert cpu_attention._native_kernel(q.float(), cache.float(), None) is None
    assert cpu_attention._native_kernel(q, cache.to(torch.int8), torch.ones(2, 16, 2)) is None
    assert cpu_attention._native_kernel(q[..., :16], cache[..., :16], None) is None  # head dim 16


def test_switch_off_falls_back_to_sdpa(monkeypatch):
    monkeypatch.setenv(cpu_native.ENV_SWITCH, "0")
    cpu_native.load.cache_clear()
    try:
        assert cpu_native.load() is None
        seq_lens, new = [130, 20], [30, 20]
        q, k, v, tables, cu, lens = _inputs(seq_lens, new, 32, 4, seed=3)
        assert cpu_attention._native_kernel(q, k, None) is None
        want = ref.paged_prefill_attention(q.float(), k.float(), v.float(), tables, cu, lens, 0.2)
        got = cpu_attention.paged_prefill_attention(q, k, v, tables, cu, lens, 0.2)
        assert rel_err(got.float(), want) < BF16_TOL
    finally:
        monkeypatch.delenv(cpu_native.ENV_SWITCH)
        cpu_native.load.cache_clear()


@needs_kernel
def test_build_is_cached_by_source_and_compiler(tmp_path):
    first = cpu_native.build(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert cpu_native.build(tmp_path) == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left


@needs_kernel
def test_bad_layouts_are_refused():
    q, k, v, tables, cu, lens = _inputs([20], [20], 32, 4)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="int32"):
        KERNEL.attention(q, k, v, tables.long(), cu, lens, 0.2, out, min_tq=2)
    with pytest.raises(ValueError, match="contiguous"):
        KERNEL.attention(q.transpose(0, 1).contiguous().transpose(0, 1), k, v, tables, cu, lens, 0.2, out, min_tq=2)
    with pytest.raises(ValueError, match="bfloat16"):
        KERNEL.attention(q.float(), k, v, tables, cu, lens, 0.2, out, min_tq=2)


@needs_kernel
@pytest.mark.parametrize("rows,inp,out", [(1, 256, 100352), (3, 768, 256), (4, 32, 17), (2, 96, 513)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_linear_matches_float32(rows, inp, out, with_bias):
    gen = torch.Generator().manual_seed(rows * inp + out)
    x = torch.randn(rows, inp, generator=gen).to(torch.bfloat16)
    w = (torch.randn(out, inp, generator=gen) / math.sqrt(inp)).to(torch.bfloat16)
    b = torch.randn(out, generator=gen).to(torch.bfloat16) if with_bias else None
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    got32 = KERNEL.linear(x, w, b, torch.float32)
    got16 = KERNEL.linear(x, w, b)
    assert got32.dtype == torch.float32 and got16.dtype == torch.bfloat16 and got32.shape == want.shape
    assert rel_err(got32, want) < 1e-5  # float32 accumulation of exact bf16 products
    assert rel_err(got16.float(), want) < 1e-2


@needs_kernel
def test_native_linear_refuses_what_it_cannot_run():
    x = torch.zeros(1, 48, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 32"):
        KERNEL.linear(x, torch.zeros(8, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        KERNEL.linear(torch.zeros(1, 32), torch.zeros(8, 32))


@needs_kernel
def test_decode_batch_native_for_lone_sequences_cascade_for_shared_prefixes():
    """paged_decode_attention: sequences holding a block no other holds run natively, sequences
    sharing prefix blocks (one tenant's cached prompt) keep the cascade; every row equals the
    reference's."""
    seq_lens = [100, 130, 97, 300, 45]
    _, k, v, tables, _, lens = _inputs(seq_lens, [1] * 5, 32, 4, seed=11)
    tables[1, :6] = tables[0, :6]  # sequences 0 and 1 share a 96-token prefix
    tables[2, :6] = tables[0, :6]
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(5, 8, 32, generator=gen).to(torch.bfloat16)
    want = ref.paged_decode_attention(q.float(), k.float(), v.float(), tables, lens, 0.2)
    got = cpu_attention.paged_decode_attention(q, k, v, tables, lens, 0.2)
    assert got.dtype == torch.bfloat16 and rel_err(got.float(), want) < BF16_TOL
    for i in range(5):  # row by row too: no row is left unwritten or mixed up
        assert rel_err(got[i].float(), want[i]) < BF16_TOL
