"""The sampling penalties' Triton kernels (prefixgate_kernels/penalties.py) against the torch reference
they replace on the GPU (engine.penalties.penalise_reference, the CPU path): fresh random logits, count
and prompt tables, rows and slots in any order, every parameter in its range; the same arithmetic, so
the results agree bit for bit. And the picks counted as the reference's accumulating scatter counts them."""

from __future__ import annotations

import pytest
import torch

from engine.penalties import penalise_reference
from engine.protocol import SamplingParams
from prefixgate_kernels import penalties
from tests.kernels.kernel_cases import INTERPRET

needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")


def random_case(gen: torch.Generator, rows: int, vocab: int, slots: int, penalised: int, device: str = "cpu"):
    """logits [rows, V]; count table [slots, V] (mostly zero, small integers); prompt table (uint8);
    ``penalised`` distinct rows with distinct slots, shuffled; one SamplingParams per row."""
    logits = torch.randn(rows, vocab, generator=gen) * 4
    counts = torch.randint(0, 4, (slots, vocab), generator=gen).float() * (torch.rand(slots, vocab, generator=gen) < 0.05)
    in_prompt = (torch.rand(slots, vocab, generator=gen) < 0.05).to(torch.uint8)
    which = torch.randperm(rows, generator=gen)[:penalised].tolist()
    slot_of = torch.randperm(slots, generator=gen)[:penalised].tolist()
    params = [SamplingParams()] * rows
    for r in which:
        u = torch.rand(3, generator=gen).tolist()
        params[r] = SamplingParams(repetition_penalty=0.5 + 1.5 * u[0], frequency_penalty=4 * u[1] - 2,
                                   presence_penalty=4 * u[2] - 2)
    index = torch.tensor([which, slot_of], dtype=torch.int64)
    to = {"device": device}
    return logits.to(**to), counts.to(**to), in_prompt.to(**to), index.to(**to), params, which


def kernel_params(params: list[SamplingParams], which: list[int], device) -> torch.Tensor:
    return torch.tensor([[params[r].repetition_penalty, params[r].frequency_penalty, params[r].presence_penalty]
                         for r in which], dtype=torch.float32, device=device).reshape(len(which), 3)


def check_case(seed: int, rows: int, vocab: int, slots: int, penalised: int, device: str = "cpu") -> None:
    gen = torch.Generator().manual_seed(seed)
    logits, counts, in_prompt, index, params, which = random_case(gen, rows, vocab, slots, penalised, device)
    want = logits.clone()
    penalise_reference(want, counts, in_prompt, index, params, which)
    got = logits.clone()
    penalties.penalise_rows(got, counts, in_prompt, index, kernel_params(params, which, logits.device))
    assert torch.equal(got, want), float((got - want).abs().max())
    untouched = [r for r in range(rows) if r not in which]
    assert torch.equal(got[untouched], logits[untouched])


@needs_interpreter
@pytest.mark.parametrize(("rows", "vocab", "slots", "penalised"),
                         [(1, 5, 1, 1), (4, 300, 8, 2), (3, penalties.BLOCK + 17, 5, 3), (6, 2 * penalties.BLOCK, 16, 4)])
def test_penalties_kernel_equals_the_reference(rows, vocab, slots, penalised):
    check_case(rows * 100 + slots, rows, vocab, slots, penalised)


@needs_interpreter
def test_count_kernel_equals_an_accumulating_scatter():
    gen = torch.Generator().manual_seed(5)
    counts = torch.randint(0, 3, (8, 700), generator=gen).float()
    index = torch.tensor([[4, 0, 2], [7, 1, 3]], dtype=torch.int64)  # rows, then their slots
    picks = torch.randint(0, 700, (6,), generator=gen)
    picks[0] = picks[2]  # two rows picking one token: different slots, both counted
    want = counts.clone()
    want.index_put_((index[1], picks[index[0]]), torch.ones(3), accumulate=True)
    penalties.count_picks(counts, index, picks)
    assert torch.equal(counts, want)


def test_penalty_kernels_refuse_bad_input():
    logits = torch.zeros(2, 8)
    table = torch.zeros(4, 8)
    prompt = torch.zeros(4, 8, dtype=torch.uint8)
    index = torch.zeros(2, 1, dtype=torch.int64)
    params = torch.ones(1, 3)
    with pytest.raises(ValueError, match="logits"):
        penalties.penalise_rows(logits.half(), table, prompt, index, params)
    with pytest.raises(ValueError, match="uint8"):
        penalties.penalise_rows(logits, table, prompt.bool(), index, params)
    with pytest.raises(ValueError, match="index"):
        penalties.penalise_rows(logits, table, prompt, index.int(), params)
    with pytest.raises(ValueError, match="params"):
        penalties.penalise_rows(logits, table, prompt, index, torch.ones(2, 3))
    penalties.penalise_rows(logits, table, prompt, torch.zeros(2, 0, dtype=torch.int64), torch.ones(0, 3))
