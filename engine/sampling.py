"""Pick the next token of each sampled sequence from its last-position logits.

Per row: greedy (argmax) when ``temperature == 0`` or ``top_k == 1``; otherwise temperature,
then top-k, then top-p (nucleus) filtering, then a draw from the renormalised distribution.

Reproducibility: a request with ``seed`` draws from its own ``torch.Generator``, re-seeded at
every step from ``(seed, step)`` where step = tokens generated so far. A draw is then a pure
function of (seed, step, logits): batching, the other requests, or a preemption that recomputes
the prompt cannot change it. Requests without a seed share the sampler's generator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.protocol import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, step) over the 63-bit seed space


def step_seed(seed: int, step: int) -> int:
    return (seed * _MIX + step * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] float32 -> logits with tokens outside top-k / the top-p nucleus set to -inf.

    top-p keeps the smallest prefix of tokens (by descending probability) whose mass reaches
    ``top_p``; the most likely token is always kept.
    """
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class Sampler:
    def __init__(self, device: torch.device | str, seed: int | None = None):
        self.device = torch.device(device)
        self._shared = torch.Generator(device=self.device)
        if seed is None:
            self._shared.seed()
        else:
            self._shared.manual_seed(seed)
        self._per_request: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams, step: int) -> torch.Generator:
        if params.seed is None:
            return self._shared
        gen = self._per_request.get(request_id)
        if gen is None:
            gen = self._per_request[request_id] = torch.Generator(device=self.device)
        gen.manual_seed(step_seed(params.seed, step))
        return gen

    def sample(
        self,
        logits: torch.Tensor,  # [N, V] float32, last-position logits of the sampled chunks
        params: Sequence[SamplingParams],
        request_ids: Sequence[str],
        steps: Sequence[int],  # tokens generated so far, per row
    ) -> tuple[list[int], list[float]]:
        """-> (token id per row, its log-probability under the unfiltered distribution)."""
        n = logits.shape[0]
        assert len(params) == len(request_ids) == len(steps) == n, "one SamplingParams per logits row"
        tokens = torch.empty(n, dtype=torch.long, device=logits.device)
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        if greedy_rows:
            idx = torch.tensor(greedy_rows, device=logits.device)
            tokens[idx] = logits[idx].argmax(dim=-1)
        for i, p in enumerate(params):
            if p.greedy:
                continue
            row = filter_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(row, dim=-1)
            gen = self._generator(request_ids[i], p, steps[i])
            tokens[i] = torch.multinomial(probs, 1, generator=gen)[0]
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
        return tokens.tolist(), logprobs.tolist()
