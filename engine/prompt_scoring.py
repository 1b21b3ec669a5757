"""Score a chunk's prompt tokens from its hidden states, a bounded slice of rows at a time.

A request with ``SamplingParams.prompt_logprobs`` needs, at every prompt position, the logprob of
the next prompt token under ``log_softmax(logits)`` and the top-k there. The logits of a whole
chunk would be [T, V] float32: 2,048 rows of a 128k vocabulary are 1 GiB, and the log-softmax
another. So the vocabulary projection runs on ``SCORE_ROWS`` rows at a time, and of each slice
only the chosen token's logprob and the top-k survive::

    hidden [R, H] ──slice of ≤ SCORE_ROWS rows──► logits [r, V] ─► log_softmax [r, V]
                                                   └─ gather(target) [r], topk [r, k] ─► kept
                                                   (the [r, V] tensors are freed before the next slice)

Peak extra memory: two [SCORE_ROWS, V] float32 tensors (256 x 128k: 256 MiB), whatever the chunk.
The results stay on the device until the step is collected (``PendingScores.to_host``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.batch import PromptScores
from engine.host_to_device import to_device

# Rows projected to the vocabulary at once (see the module docstring for the memory it bounds).
SCORE_ROWS = 256


@dataclass(frozen=True)
class PendingScores:
    """One chunk's prompt scores on the device: ``picked`` [R] float32, ``top_values`` / ``top_ids``
    [R, k] (None for k = 0)."""

    picked: torch.Tensor
    top_values: torch.Tensor | None
    top_ids: torch.Tensor | None

    def to_host(self) -> PromptScores:
        picked = self.picked.tolist()
        if self.top_values is None or self.top_ids is None:
            return PromptScores(tuple(picked), tuple(() for _ in picked))
        values, ids = self.top_values.tolist(), self.top_ids.tolist()
        return PromptScores(tuple(picked), tuple(tuple(zip(i, v)) for i, v in zip(ids, values)))


def score_prompt_rows(hidden: torch.Tensor, targets: Sequence[int], k: int,
                      project: Callable[[torch.Tensor], torch.Tensor], rows: int = SCORE_ROWS) -> PendingScores:
    """hidden [R, H] (row j: the position before ``targets[j]``) -> the targets' logprobs and the
    top ``k`` per row. ``project``: hidden [r, H] -> logits [r, V] float32 (the model's head)."""
    n = len(targets)
    if hidden.shape[0] != n or n == 0:
        raise ValueError(f"need one hidden row per target, got {hidden.shape[0]} rows for {n} targets")
    # targets: [R] int64 on the device; results [R] and [R, k] filled slice by slice
    target_ids = to_device(list(targets), torch.long, hidden.device)
    picked = torch.empty(n, dtype=torch.float32, device=hidden.device)
    top_values = torch.empty((n, k), dtype=torch.float32, device=hidden.device) if k else None
    top_ids = torch.empty((n, k), dtype=torch.long, device=hidden.device) if k else None
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        log_probs = torch.log_softmax(project(hidden[lo:hi]), dim=-1)  # [r, V] float32
        picked[lo:hi] = log_probs.gather(1, target_ids[lo:hi, None])[:, 0]
        if top_values is not None and top_ids is not None:
            # from the same log_probs row as the target: a target that is the argmax scores exactly
            # its top entry (lm-eval's greedy check compares them with ==)
            values, ids = torch.topk(log_probs, k, dim=-1)
            top_values[lo:hi], top_ids[lo:hi] = values, ids
        del log_probs
    return PendingScores(picked, top_values, top_ids)
