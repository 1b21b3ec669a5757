"""Greedy tokens from ``transformers`` with the margin of each choice, and the comparison that means
"the engine decodes greedily like the oracle" on any CPU.

Two fp32 implementations agree on logits only within rounding (another summation order, another GEMM
kernel for another batch shape or thread count). Where the oracle's top two logits are closer than that
rounding, either token is a correct greedy choice, and the two continuations may differ from there on.
So the comparison is exact up to and including the first near tie, and stops there.
"""

from __future__ import annotations

import torch

# fp32 logit differences between this engine and transformers are observed at ~2e-6; a tie this
# close can flip on another CPU, a wider one cannot.
NEAR_TIE = 1e-3


class GreedyReference(list):
    """The oracle's greedy tokens (a plain ``list`` for ``==``) and ``margins[i]``, the top-1 minus
    top-2 logit at step i."""

    def __init__(self, tokens: list[int], margins: list[float]):
        super().__init__(tokens)
        assert len(margins) == len(tokens)
        self.margins = margins


def hf_greedy(model, prompt: list[int], max_new: int) -> GreedyReference:
    """transformers' own greedy generation, EOS disabled so lengths match, with per-step margins."""
    out = model.generate(
        torch.tensor([prompt], device=model.device), max_new_tokens=max_new, do_sample=False,
        eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
    )
    margins = []
    for step in out.logits:  # each [1, V]
        top2 = torch.topk(step[0].float(), 2).values
        margins.append(float(top2[0] - top2[1]))
    return GreedyReference(out.sequences[0, len(prompt):].tolist(), margins)


def first_near_tie(ref: GreedyReference, tie: float = NEAR_TIE) -> int:
    """Index of the first step whose choice is a near tie (len(ref) if none)."""
    return next((i for i, m in enumerate(ref.margins) if m < tie), len(ref))


def assert_greedy_agrees(got: list[int], ref: GreedyReference, tie: float = NEAR_TIE) -> None:
    """``got`` equals ``ref`` token for token, up to and including its first near tie."""
    assert len(got) == len(ref), (len(got), len(ref))
    upto = min(first_near_tie(ref, tie) + 1, len(ref))
    assert got[:upto] == ref[:upto], (got, list(ref), ref.margins)


def hf_penalised_greedy(model, prompt: list[int], max_new: int, presence: float, frequency: float,
                        repetition: float = 1.0) -> GreedyReference:
    """Greedy decoding with vLLM's repetition penalty and OpenAI's presence / frequency penalties, by
    hand on ``transformers``' full forward at every step: first a token seen in the prompt or the
    output has its logit divided by ``repetition`` where positive, multiplied where not; then
    logit - count * frequency - [count > 0] * presence, where count is how often the token appears
    among the tokens generated so far (not the prompt's). Margins are of the penalised logits, the
    ones the choice is made on."""
    ids = list(prompt)
    counts = torch.zeros(model.config.vocab_size, dtype=torch.float32)
    in_prompt = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    in_prompt[torch.tensor(prompt)] = True
    tokens, margins = [], []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(torch.tensor([ids], device=model.device)).logits[0, -1].float().cpu()
            seen = in_prompt | (counts > 0)
            logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
            logits = logits - counts * frequency - (counts > 0).float() * presence
            top2 = torch.topk(logits, 2)
            token = int(top2.indices[0])
            margins.append(float(top2.values[0] - top2.values[1]))
            tokens.append(token)
            counts[token] += 1
            ids.append(token)
    return GreedyReference(tokens, margins)
