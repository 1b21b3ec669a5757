"""The one-launch argmax of greedy decoding (prefixgate_kernels/argmax.py) against ``torch.argmax``:
fresh random rows, ties (the first index wins), NaN (counts as the maximum, the first wins), rows of
-inf, ragged last chunks, and the counters left zero for the next launch."""

from __future__ import annotations

import pytest
import torch

from prefixgate_kernels import argmax
from tests.kernels.kernel_cases import INTERPRET

needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")


def check_rows(logits: torch.Tensor, counters: torch.Tensor | None = None) -> None:
    got = argmax.argmax_rows(logits, counters)
    assert got.dtype == torch.int64
    assert torch.equal(got.cpu(), logits.float().cpu().argmax(dim=-1))
    if counters is not None:
        assert int(counters.abs().sum()) == 0, "the kernel must leave its counters zero"


@needs_interpreter
@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 100), (2, argmax.CHUNK), (2, argmax.CHUNK + 1), (4, 3 * argmax.CHUNK + 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_random_rows(rows, cols, dtype):
    gen = torch.Generator().manual_seed(rows * 1000 + cols)
    check_rows((torch.randn(rows, cols, generator=gen) * 5).to(dtype))


@needs_interpreter
def test_argmax_ties_nan_and_minus_inf():
    cols = 2 * argmax.CHUNK + 300
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, cols, generator=gen)
    x[0, [5, argmax.CHUNK + 2, cols - 1]] = 50.0  # a tie across chunks: the first index
    x[1, [argmax.CHUNK + 9, argmax.CHUNK + 3]] = 50.0  # a tie inside a chunk
    x[2, [argmax.CHUNK + 40, cols - 2]] = float("nan")  # NaN is the maximum, the first one wins
    x[2, 0] = float("inf")
    x[3] = float("-inf")  # all -inf: index 0
    x[4, :] = float("-inf")
    x[4, cols - 1] = -1e30  # the only finite value, in the ragged last chunk
    x[5, argmax.CHUNK - 1] = float("inf")
    x[5, argmax.CHUNK] = float("inf")
    counters = torch.zeros(8, dtype=torch.int32)
    check_rows(x, counters)
    check_rows(x[:, :-300].contiguous(), counters)  # the same buffer again: zero after each launch


def test_argmax_rejects_bad_input():
    with pytest.raises(ValueError, match="contiguous rows"):
        argmax.argmax_rows(torch.zeros(4, 3).t())
    with pytest.raises(ValueError, match="fp32, fp16 or bf16"):
        argmax.argmax_rows(torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="counters"):
        argmax.argmax_rows(torch.zeros(4, 3), torch.zeros(2, dtype=torch.int32))
    assert argmax.argmax_rows(torch.zeros(0, 3)).shape == (0,)
