"""copy_blocks / gather_blocks / scatter_blocks in Triton against prefixgate_kernels.reference: bit-exact."""

from __future__ import annotations

import pytest
import torch

from prefixgate_kernels import reference as ref
from prefixgate_kernels import triton_ops
from tests.kernels.kernel_cases import INTERPRET

pytestmark = pytest.mark.skipif(not INTERPRET, reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")


def random_cache(dtype, shape, gen):
    x = torch.randn(shape, generator=gen)
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)
    return (x * 10).to(dtype)


DTYPES = [torch.bfloat16, ref.FP8_DTYPE, torch.int8, torch.float32]
ENGINE_SHAPE = (7, 2, 2, 16, 2, 8)  # [num_blocks, layers, 2, block_size, kv_heads, head_dim]


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_bit_exact(dtype):
    gen = torch.Generator().manual_seed(0)
    cache = random_cache(dtype, ENGINE_SHAPE, gen)
    want = cache.clone()
    src, dst = torch.tensor([0, 3, 5]), torch.tensor([6, 1, 2])
    ref.copy_blocks(want, src, dst)
    triton_ops.copy_blocks(cache, src.to(torch.int32), dst.to(torch.int32))
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_then_scatter_round_trips(dtype):
    gen = torch.Generator().manual_seed(1)
    cache = random_cache(dtype, ENGINE_SHAPE, gen)
    ids = torch.tensor([4, 0, 6])
    packed = triton_ops.gather_blocks(cache, ids)
    assert packed.is_contiguous() and packed.shape == (3, *ENGINE_SHAPE[1:])
    assert torch.equal(packed.view(torch.uint8), ref.gather_blocks(cache, ids).view(torch.uint8))
    other = random_cache(dtype, ENGINE_SHAPE, gen)
    want = other.clone()
    ref.scatter_blocks(want, torch.tensor([1, 2, 5]), packed)
    triton_ops.scatter_blocks(other, torch.tensor([1, 2, 5]), packed)
    assert torch.equal(other.view(torch.uint8), want.view(torch.uint8))


def test_blocks_of_a_strided_layer_view():
    # kv[:, l, 0] has a block stride of L*2*BS*H*D elements but each block is contiguous; 6-byte rows force
    # the narrowest word (int16 for bf16 of 3 elements).
    gen = torch.Generator().manual_seed(2)
    kv = random_cache(torch.bfloat16, (5, 3, 2, 1, 1, 3), gen)
    view = kv[:, 1, 0]
    out = torch.empty(2, 1, 1, 3, dtype=torch.bfloat16)
    triton_ops.gather_blocks(view, torch.tensor([3, 1]), out=out)
    assert torch.equal(out, view[[3, 1]])
    before = kv.clone()
    triton_ops.copy_blocks(view, torch.tensor([0]), torch.tensor([4]))
    before[4, 1, 0] = before[0, 1, 0]
    assert torch.equal(kv, before), "copy touched bytes outside the view's blocks"


def test_scatter_converts_dtype_and_checks_shapes():
    cache = torch.zeros(4, 2, 8, dtype=torch.float16)
    staging = torch.randn(2, 2, 8)
    triton_ops.scatter_blocks(cache, torch.tensor([3, 0]), staging)
    assert torch.equal(cache[3], staging[0].half()) and torch.equal(cache[0], staging[1].half())
    with pytest.raises(AssertionError, match="staging must be"):
        triton_ops.scatter_blocks(cache, torch.tensor([1]), staging)
    with pytest.raises(AssertionError, match="must be contiguous"):
        triton_ops.gather_blocks(cache.transpose(1, 2), torch.tensor([1]))


def head_major_pool(dtype, shape, gen):
    """A pool laid head by head ([N, L, 2, H, BS, D] in memory) seen as the engine's token view [N, L, 2, BS, H, D]."""
    n, layers, two, bs, heads, dim = shape
    return random_cache(dtype, (n, layers, two, heads, bs, dim), gen).transpose(3, 4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_major_pool_gathers_to_token_order_in_one_pass(dtype):
    gen = torch.Generator().manual_seed(3)
    pool = head_major_pool(dtype, ENGINE_SHAPE, gen)
    ids = torch.tensor([5, 0, 3])
    packed = triton_ops.gather_blocks(pool, ids)
    assert packed.is_contiguous() and packed.shape == (3, *ENGINE_SHAPE[1:])
    assert torch.equal(packed.view(torch.uint8), ref.gather_blocks(pool, ids).view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_ordered_rows_scatter_into_a_head_major_pool(dtype):
    gen = torch.Generator().manual_seed(4)
    pool = head_major_pool(dtype, ENGINE_SHAPE, gen)
    want = pool.clone()  # clone keeps the strides (a head-major pool too)
    staging = random_cache(dtype, (3, *ENGINE_SHAPE[1:]), gen)  # the transfer format: token order
    ids = torch.tensor([6, 1, 2])
    ref.scatter_blocks(want, ids, staging)
    triton_ops.scatter_blocks(pool, ids.to(torch.int32), staging)
    # the whole pool: the named blocks as the reference wrote them, every other block's bytes untouched
    assert torch.equal(pool.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


@pytest.mark.parametrize("layout", ["token", "head"])
def test_gather_writes_into_part_of_each_wider_staging_row(layout):
    """The runner's spill staging: a row holds a block's KV bytes, then its scales' bytes; each gather
    writes its part of every row through a view (row stride wider than the part), rows not named untouched."""
    gen = torch.Generator().manual_seed(6)
    pool = (head_major_pool if layout == "head" else random_cache)(torch.int8, ENGINE_SHAPE, gen)
    scales = torch.rand(ENGINE_SHAPE[:5], generator=gen)  # [N, layers, 2, block_size, kv_heads] fp32
    kv_bytes, scale_bytes = pool[0].numel(), scales[0].numel() * 4
    staging = torch.full((4, kv_bytes + scale_bytes), 7, dtype=torch.uint8)
    ids = torch.tensor([5, 0, 3])
    rows = staging[1:]
    triton_ops.gather_blocks(pool, ids, out=rows[:, :kv_bytes].view(torch.int8).view(3, *pool.shape[1:]))
    triton_ops.gather_blocks(scales, ids, out=rows[:, kv_bytes:].view(torch.float32).view(3, *scales.shape[1:]))
    want = torch.cat([ref.gather_blocks(pool, ids).view(torch.uint8).reshape(3, -1),
                      scales[ids].view(torch.uint8).reshape(3, -1)], dim=1)
    assert torch.equal(rows, want)
    assert set(staging[0].tolist()) == {7}


def test_page_copy_takes_rows_narrower_than_a_word_and_block_sizes_off_a_power_of_two():
    # head_dim 3 in bf16 (6-byte rows: int16 words), 5 slots and 3 heads (tiles masked past both)
    gen = torch.Generator().manual_seed(5)
    shape = (4, 1, 2, 5, 3, 3)
    pool = head_major_pool(torch.bfloat16, shape, gen)
    staging = random_cache(torch.bfloat16, (2, *shape[1:]), gen)
    want = pool.clone()
    ref.scatter_blocks(want, torch.tensor([3, 0]), staging)
    triton_ops.scatter_blocks(pool, torch.tensor([3, 0]), staging)
    assert torch.equal(pool.contiguous(), want.contiguous())
    assert torch.equal(triton_ops.gather_blocks(pool, torch.tensor([0, 3])), staging[[1, 0]])


def test_page_copy_refuses_a_layout_it_cannot_tile():
    from prefixgate_kernels import block_copy

    pool = torch.zeros(2, 1, 2, 4, 2, 8).transpose(4, 5)  # head_dim not contiguous
    with pytest.raises(AssertionError, match="head_dim must be contiguous"):
        block_copy.copy_pages(torch.zeros(1, 1, 2, 4, 8, 2), pool, None, torch.tensor([0]), 1)
