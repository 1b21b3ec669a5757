"""The decode step's MLP half in one persistent launch (prefixgate_kernels/mlp_block.py) against the
four reference ops it replaces, one launch a phase in the interpreter; tests/kernels/test_gpu.py runs
the one-launch form compiled and checks it against the phase launches bit for bit."""

from __future__ import annotations

import pytest
import torch

from prefixgate_kernels import mlp_block
from tests.kernels.kernel_cases import INTERPRET

pytestmark = pytest.mark.skipif(not INTERPRET, reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all(), "non-finite output"
    return float((got - want).norm() / want.norm().clamp(min=1e-12))


TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make_case(m, hidden, inter, dtype, seed, device="cpu", o_slices=4):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device)

    o = rand(o_slices, m, hidden) if o_slices else rand(m, hidden).to(dtype)  # fp32 partials, or one product
    return dict(
        o=o, residual=rand(m, hidden, scale=2).to(dtype),
        w_post=(1 + 0.1 * rand(hidden)).to(dtype),
        gate_up_weight=rand(2 * inter, hidden, scale=2 * hidden ** -0.5).to(dtype),
        down_weight=rand(hidden, inter, scale=2 * inter ** -0.5).to(dtype),
        w_next=(1 + 0.1 * rand(hidden)).to(dtype),
    )


def run_case(m, hidden, inter, dtype, seed, config, device="cpu", o_slices=4, one_launch=None):
    case = make_case(m, hidden, inter, dtype, seed, device, o_slices)
    res_want = case["residual"].clone()
    want = mlp_block.reference(**{**case, "residual": res_want}, eps=1e-5, slices=config.down_slices)
    got = mlp_block.mlp_block(**case, eps=1e-5, config=config, one_launch=one_launch)
    assert got.shape == (m, hidden) and got.dtype == dtype
    assert rel_err(case["residual"], res_want) < TOL[dtype]
    assert rel_err(got, want) < TOL[dtype]
    return got, case["residual"]


SMALL = mlp_block.BlockConfig(programs=3, gate_up_cols=16, down_cols=32, down_slices=2, block_k=64, num_stages=2)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mlp_block_matches_the_four_ops(m, dtype):
    # 3 programs over 8 norm tiles, 16 gate|up tiles and 16 (column, slice) down items: uneven shares
    run_case(m, 256, 256, dtype, seed=m * 7 + (dtype == torch.float16), config=SMALL)


def test_mlp_block_takes_the_o_product_unsliced():
    run_case(2, 256, 256, torch.float32, seed=5, config=SMALL, o_slices=0)


def test_mlp_block_with_more_programs_than_tiles():
    cfg = mlp_block.BlockConfig(programs=16, gate_up_cols=16, down_cols=32, down_slices=2, block_k=64, num_stages=2)
    run_case(2, 128, 128, torch.float32, seed=9, config=cfg)


def test_one_launch_refused_in_the_interpreter():
    case = make_case(1, 256, 256, torch.float32, seed=1)
    with pytest.raises(ValueError, match="compiled kernels only"):
        mlp_block.mlp_block(**case, eps=1e-5, config=SMALL, one_launch=True)
    with pytest.raises(ValueError, match="does not fit"):  # 96-column K slices of 64-column tiles
        mlp_block.mlp_block(**make_case(1, 256, 192, torch.float32, seed=1), eps=1e-5, config=SMALL)


def test_choose_config_rules():
    assert mlp_block.choose_config(0, 4096, 14336, 132) is None
    assert mlp_block.choose_config(mlp_block.MAX_ROWS + 1, 4096, 14336, 132) is None
    assert mlp_block.choose_config(8, 4000, 14336, 132) is None  # no K tile divides the hidden size
    assert mlp_block.choose_config(8, 4096, 14000, 132) is None  # nor the down projection's K slices
    assert mlp_block.choose_config(1, 4096, 14336, 132) == mlp_block.BlockConfig(programs=132)
    assert mlp_block.choose_config(3, 128, 256, 132) == mlp_block.BlockConfig(programs=132, block_k=64)
