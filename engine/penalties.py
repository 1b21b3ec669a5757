"""OpenAI's presence and frequency penalties and vLLM's repetition penalty, for every penalised row
of a step in a fixed handful of device ops.

A penalised request's logits depend on how often each token appears among its generated tokens.
With overlapped steps the host launches step n+1 before it knows step n's pick (the device feeds
it), so the counts cannot be rebuilt from the host's token lists: they live on the device, one
row of a shared [slots, V] float32 table per penalised request, bumped by each pick in stream order.
A request's row is built from its known outputs the first time it is seen (a decode node continuing
a prefill node's request), and freed for reuse when it finishes (``release``). The repetition penalty
also reads which tokens the prompt holds: a [slots, V] bool table beside the counts, built at the
same first sight from the prompt (``SequenceChunk.prompt_token_ids``).

The order and arithmetic are vLLM's: on the raw logits, a seen token's (prompt or output) logit is
divided by ``repetition_penalty`` where positive and multiplied where not; then OpenAI's
``logit - count x frequency_penalty - [count > 0] x presence_penalty`` on the output's counts.

Per step, whatever the number of penalised rows: on a CUDA device two Triton launches
(``prefixgate_kernels.penalties``: the penalties over the rows, then the picks counted) and two
host-to-device copies of the rows' indices and parameters; elsewhere (and as the kernels' oracle)
the same arithmetic in torch, ~30 small ops, which on an H100 held the device ~140 us between two
decode graphs with one penalised row (session 28). A per-row loop would cost that a row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.host_to_device import to_device
from engine.protocol import SamplingParams

# On a CUDA device the penalties run as Triton kernels (prefixgate_kernels/penalties.py); False: torch's
# ops (the engine benchmark's same-run baseline). The kernel module is imported on the first GPU step,
# not with this one (importing triton.language here would fix the interpreter mode too early: see
# engine.sampling.GPU_ARGMAX).
GPU_PENALTIES = True


class OutputCounts:
    """Per penalised request, its output tokens' counts on the device (the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._table = torch.zeros((0, 0), dtype=torch.float32, device=device)  # [slots, V] output counts
        self._in_prompt = torch.zeros((0, 0), dtype=torch.uint8, device=device)  # [slots, V], 1 = in the prompt
        self._slot: dict[str, int] = {}
        self._free: list[int] = []

    @property
    def tracked(self) -> int:
        return len(self._slot)

    def release(self, request_id: str) -> None:
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def _slot_for(self, request_id: str, outputs: Sequence[int], prompt: Sequence[int], vocab: int) -> int:
        slot = self._slot.get(request_id)
        if slot is not None:
            return slot
        if self._table.shape[1] != vocab:
            if self._slot:
                raise ValueError(f"a vocabulary of {vocab} tokens in a table of {self._table.shape[1]}")
            self._table = torch.zeros((0, vocab), dtype=torch.float32, device=self.device)
            self._in_prompt = torch.zeros((0, vocab), dtype=torch.uint8, device=self.device)
            self._free.clear()
        if not self._free:  # grow by doubling: a copy now and then, never one per request
            old = self._table.shape[0]
            slots = max(8, 2 * old)
            table = torch.zeros((slots, vocab), dtype=torch.float32, device=self.device)
            table[:old] = self._table
            in_prompt = torch.zeros((slots, vocab), dtype=torch.uint8, device=self.device)
            in_prompt[:old] = self._in_prompt
            self._table, self._in_prompt = table, in_prompt
            self._free.extend(range(slots - 1, old - 1, -1))
        slot = self._slot[request_id] = self._free.pop()
        row = self._table[slot]
        row.zero_()
        known = [t for t in outputs if 0 <= t < vocab]  # never a placeholder: none exists before a first pick here
        if known:
            row.index_add_(0, to_device(known, torch.long, self.device),
                           torch.ones(len(known), dtype=torch.float32, device=self.device))
        seen = self._in_prompt[slot]
        seen.zero_()
        if prompt:
            seen[to_device([t for t in prompt if 0 <= t < vocab], torch.long, self.device)] = 1
        return slot

    def penalise(self, logits: torch.Tensor, rows: Sequence[int], params: Sequence[SamplingParams],
                 request_ids: Sequence[str], outputs: Sequence[Sequence[int]],
                 prompts: Sequence[Sequence[int]]) -> PenalisedRows:
        """Apply each listed row's penalties to ``logits`` [N, V] in place (the module docstring's
        order and arithmetic) -> the rows and their slots, for ``count`` after the pick.
        ``prompts[i]``: row i's prompt where it has a repetition penalty (read at first sight only)."""
        vocab = logits.shape[-1]
        slots = [self._slot_for(request_ids[i], outputs[i], prompts[i], vocab) for i in rows]
        index = to_device([*rows, *slots], torch.long, self.device).view(2, len(rows))  # rows, then slots
        if GPU_PENALTIES and logits.is_cuda and logits.dtype == torch.float32 and logits.stride(-1) == 1:
            from prefixgate_kernels.penalties import penalise_rows

            values = [v for i in rows for v in (params[i].repetition_penalty, params[i].frequency_penalty,
                                               params[i].presence_penalty)]
            penalise_rows(logits, self._table, self._in_prompt,
                          index, to_device(values, torch.float32, self.device).view(len(rows), 3))
            return PenalisedRows(index, on_gpu=True)
        penalise_reference(logits, self._table, self._in_prompt, index, params, rows)
        return PenalisedRows(index, on_gpu=False)

    def count(self, penalised: PenalisedRows, picks: torch.Tensor) -> None:
        """Add the step's picks [N] (device int64, by row) to the penalised rows' counts, queued behind
        the pick."""
        if penalised.on_gpu:
            from prefixgate_kernels.penalties import count_picks

            count_picks(self._table, penalised.index, picks)
            return
        rows, slots = penalised.index
        ones = torch.ones(rows.shape[0], dtype=torch.float32, device=self.device)
        self._table.index_put_((slots, picks[rows]), ones, accumulate=True)


@dataclass(frozen=True)
class PenalisedRows:
    """A step's penalised rows: ``index`` [2, P] int64 on the device (the logits rows, then their
    table slots), and whether the Triton kernels applied them (the count then goes the same way)."""

    index: torch.Tensor
    on_gpu: bool


def penalise_reference(logits: torch.Tensor, table: torch.Tensor, in_prompt: torch.Tensor, index: torch.Tensor,
                       params: Sequence[SamplingParams], rows: Sequence[int]) -> None:
    """The penalties in torch (the CPU path, and the Triton kernel's oracle): ``logits[index[0]]``
    from the table rows ``index[1]``, in place; ``rows`` are index[0] on the host (for ``params``)."""
    row_ids, slot_ids = index
    counts = table[slot_ids]  # [P, V]
    picked = logits[row_ids].float()  # [P, V]
    repetition = [params[i].repetition_penalty for i in rows]
    if any(r != 1.0 for r in repetition):
        rp = to_device(repetition, torch.float32, logits.device)[:, None]
        seen = (counts > 0) | (in_prompt[slot_ids] != 0)
        picked = torch.where(seen, torch.where(picked > 0, picked / rp, picked * rp), picked)
    frequency = to_device([params[i].frequency_penalty for i in rows], torch.float32, logits.device)
    presence = to_device([params[i].presence_penalty for i in rows], torch.float32, logits.device)
    picked -= counts * frequency[:, None] + (counts > 0).to(torch.float32) * presence[:, None]
    logits.index_put_((row_ids,), picked.to(logits.dtype))
