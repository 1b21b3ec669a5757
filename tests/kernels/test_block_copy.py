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
