"""Pick the next token of each sampled sequence from its last-position logits.

Per row, in order: ``logit_bias`` added, the repetition / presence / frequency penalties applied,
EOS and stop tokens banned while fewer than ``min_tokens`` are generated, the grammar mask applied
(guided rows: disallowed tokens -> -inf, engine.guided), then greedy (argmax) when
``temperature == 0`` or ``top_k == 1``; otherwise temperature, min-p, top-k, top-p (nucleus) filtering and a draw from the
renormalised distribution. Rows without any of these skip those steps (no copy, no mask).

Log-probabilities (the sampled token's, and the top-k alternatives when a request asks) are of
the model's raw distribution, before bias, mask and temperature, as vLLM reports them.

Penalties read the counts of each penalised request's generated tokens, which live on the device
(``engine.penalties``: overlapped steps launch step n+1 before the host has step n's pick), so a
penalised row never makes the engine wait for its tokens, as a grammar row must.

Reproducibility: a request with ``seed`` draws from its own ``torch.Generator``, re-seeded at
every step from ``(seed, step)`` where step = tokens generated so far. A draw is then a pure
function of (seed, step, logits): batching, the other requests, or a preemption that recomputes
the prompt cannot change it. Requests without a seed share the sampler's generator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.guided import GrammarCompiler, GuidedRow, apply_bitmask, bitmask_words
from engine.host_to_device import to_device
from engine.penalties import OutputCounts, PenalisedRows
from engine.protocol import SamplingParams

# Greedy rows on a CUDA device take the one-launch argmax (prefixgate_kernels/argmax.py), which splits each
# row over many SMs where ``torch.argmax`` reduces it in one block; False: torch's (the engine
# benchmark's same-run baseline). The kernel's module is imported on the first GPU step, not with
# this one, so importing the engine does not import triton.language: that import decorates Triton's
# own helpers (tl.max, tl.sum, ...) in the mode TRITON_INTERPRET names at that moment, and the CPU
# tests set it (for the interpreter) after the engine is imported.
GPU_ARGMAX = True

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


def filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """logits [V] float32 -> logits with tokens less likely than ``min_p`` x the most likely one set
    to -inf (vLLM's min-p; 0 keeps all). In log space: logit < max + log(min_p)."""
    if min_p <= 0.0:
        return logits
    return logits.masked_fill(logits < logits.max() + math.log(min_p), float("-inf"))


@dataclass(frozen=True)
class SampledRow:
    """One row's pick: the token, its raw log-probability and, when asked, the top alternatives
    as (token id, logprob) pairs, most likely first."""

    token_id: int
    logprob: float | None  # None where the request asked for no logprobs (sample_rows)
    top: tuple[tuple[int, float], ...] | None = None
    grammar_dead_end: str | None = None  # the row's grammar could not continue (why); its token is EOS


class Sampler:
    def __init__(self, device: torch.device | str, seed: int | None = None,
                 grammars: GrammarCompiler | None = None, eos_token_ids: Sequence[int] = ()):
        """``grammars`` compiles guided requests' grammars; without it a guided request fails.
        ``eos_token_ids``: the model's end tokens, which ``min_tokens`` holds back."""
        self.device = torch.device(device)
        self.grammars = grammars
        self.eos_token_ids = tuple(eos_token_ids)
        self._guided: dict[str, GuidedRow] = {}
        self._shared = torch.Generator(device=self.device)
        if seed is None:
            self._shared.seed()
        else:
            self._shared.manual_seed(seed)
        self._per_request: dict[str, torch.Generator] = {}
        self._output_counts = OutputCounts(self.device)  # penalised requests' generated-token counts
        # the GPU argmax's per-row counters: zero between launches, which all run on this sampler's stream
        self._argmax_counters = torch.zeros(0, dtype=torch.int32, device=self.device)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [N, V] -> [N] int64, the first index of each row's maximum."""
        if not (GPU_ARGMAX and logits.is_cuda and logits.stride(-1) == 1):
            return logits.argmax(dim=-1)
        from prefixgate_kernels.argmax import argmax_rows

        if self._argmax_counters.numel() < logits.shape[0] or self._argmax_counters.device != logits.device:
            self._argmax_counters = torch.zeros(max(256, logits.shape[0]), dtype=torch.int32, device=logits.device)
        return argmax_rows(logits, self._argmax_counters)

    def release(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)
        self._guided.pop(request_id, None)
        self._output_counts.release(request_id)

    def _guided_row(self, request_id: str, params: SamplingParams) -> GuidedRow:
        row = self._guided.get(request_id)
        if row is None:
            if self.grammars is None:
                raise RuntimeError("this sampler has no grammar compiler; guided decoding is unavailable")
            assert params.guided is not None
            row = self._guided[request_id] = self.grammars.matcher(params.guided)
        return row

    def _constrain(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        request_ids: Sequence[str],
        steps: Sequence[int],
        outputs: Sequence[Sequence[int]],
        prompts: Sequence[Sequence[int]],
    ) -> tuple[torch.Tensor, dict[int, str], PenalisedRows | None]:
        """Logits with each row's logit_bias added, its penalties applied, its end tokens banned
        under ``min_tokens`` and its grammar mask applied (a copy only when some row has one of them;
        rows without them are untouched), and the rows whose grammar is at a dead end (row -> why),
        and the penalised rows, for ``OutputCounts.count`` once the picks are made."""
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        penalised = [i for i, p in enumerate(params) if p.penalised]
        # steps counts a placeholder (the pick still on the device) as generated, which it is
        held_back = [i for i, p in enumerate(params) if p.min_tokens > steps[i]]
        guided = [i for i, p in enumerate(params) if p.guided is not None]
        dead_ends: dict[int, str] = {}
        counted: PenalisedRows | None = None
        if not biased and not penalised and not held_back and not guided:
            return logits, dead_ends, counted
        logits = logits.clone()
        if biased:
            # every biased row's (row, token, bias) in one scatter: two copies and one op a step, not
            # three a row (a batch of biased rows would otherwise hold the device between graphs)
            pairs = [(i, t, b) for i in biased for t, b in params[i].logit_bias]
            where = to_device([i for i, _, _ in pairs] + [t for _, t, _ in pairs], torch.long, logits.device)
            where = where.view(2, len(pairs))
            logits.index_put_((where[0], where[1]), to_device([b for _, _, b in pairs], logits.dtype, logits.device),
                              accumulate=True)
        if penalised:
            counted = self._output_counts.penalise(logits, penalised, params, request_ids, outputs, prompts)
        if held_back:
            vocab = logits.shape[-1]
            ends = [(i, t) for i in held_back
                    for t in {*params[i].stop_token_ids, *(() if params[i].ignore_eos else self.eos_token_ids)}
                    if 0 <= t < vocab]
            if ends:
                logits[to_device([i for i, _ in ends], torch.long, logits.device),
                       to_device([t for _, t in ends], torch.long, logits.device)] = float("-inf")
        if guided:
            vocab = logits.shape[-1]
            bitmask = torch.empty((len(guided), bitmask_words(vocab)), dtype=torch.int32)
            for r, i in enumerate(guided):
                row = self._guided_row(request_ids[i], params[i])
                row.sync(outputs[i])
                row.fill(bitmask[r])
                why = row.dead_end()
                if why is not None:
                    dead_ends[i] = why
            idx = to_device(guided, torch.long, logits.device)
            rows = logits[idx]
            apply_bitmask(rows, bitmask)
            logits[idx] = rows
        return logits, dead_ends, counted

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
        """-> (token id per row, its log-probability under the unfiltered distribution).

        For rows without a grammar (the grammar needs the output tokens: ``sample_rows``)."""
        assert all(p.guided is None for p in params), "guided rows need their output tokens: use sample_rows"
        rows = self._sample(logits, params, request_ids, steps, [()] * len(params), [()] * len(params),
                            all_logprobs=True).rows()
        return [r.token_id for r in rows], [float(r.logprob) for r in rows]  # type: ignore[arg-type]

    def sample_rows(
        self,
        logits: torch.Tensor,  # [N, V] float32
        params: Sequence[SamplingParams],
        request_ids: Sequence[str],
        outputs: Sequence[Sequence[int]],  # tokens generated so far, per row
        prompts: Sequence[Sequence[int]] | None = None,  # per row, for a repetition penalty (else ())
    ) -> list[SampledRow]:
        """-> one ``SampledRow`` per logits row (grammar, bias and top logprobs included); the
        sampled token's logprob only for rows whose params set ``logprobs`` (else None)."""
        return self.sample_rows_async(logits, params, request_ids, outputs, prompts).rows()

    def sample_rows_async(
        self,
        logits: torch.Tensor,  # [N, V] float32
        params: Sequence[SamplingParams],
        request_ids: Sequence[str],
        outputs: Sequence[Sequence[int]],  # tokens generated so far, per row
        prompts: Sequence[Sequence[int]] | None = None,  # per row, for a repetition penalty (else ())
    ) -> PendingRows:
        """``sample_rows`` without the host sync: the picks stay on the device (``tokens``, which a
        next step may read as its input) and travel to the host behind the step; ``rows()`` waits
        for them. Everything that reads ``logits`` is queued here, so the caller may overwrite them
        (the next graph replay) right after."""
        return self._sample(logits, params, request_ids, [len(o) for o in outputs], outputs,
                            prompts if prompts is not None else [()] * len(params))

    def _sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        request_ids: Sequence[str],
        steps: Sequence[int],
        outputs: Sequence[Sequence[int]],
        prompts: Sequence[Sequence[int]],
        all_logprobs: bool = False,
    ) -> PendingRows:
        """``all_logprobs``: the sampled token's logprob for every row; else only for rows whose
        params ask for logprobs (the others get None)."""
        n = logits.shape[0]
        assert len(params) == len(request_ids) == len(steps) == len(outputs) == len(prompts) == n, \
            "one SamplingParams per row"
        raw = logits
        logits, dead_ends, counted = self._constrain(logits, params, request_ids, steps, outputs, prompts)
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        if len(greedy_rows) == n:
            # the common case: one argmax, no index tensors (each is a pageable H2D copy and two
            # kernels of host time per step)
            tokens = self._argmax(logits)
        else:
            tokens = torch.empty(n, dtype=torch.long, device=logits.device)
            if greedy_rows:
                idx = to_device(greedy_rows, torch.long, logits.device)
                tokens[idx] = logits[idx].argmax(dim=-1)
            for i, p in enumerate(params):
                if p.greedy:
                    continue
                row = filter_top_k_top_p(filter_min_p(logits[i] / p.temperature, p.min_p), p.top_k, p.top_p)
                probs = torch.softmax(row, dim=-1)
                gen = self._generator(request_ids[i], p, steps[i])
                tokens[i] = torch.multinomial(probs, 1, generator=gen)[0]
        # The log-softmax over the vocabulary costs as much as the sampling itself (a 256 x 100k
        # decode step: ~20 ms): only for the rows whose caller reads it.
        scored = list(range(n)) if all_logprobs else [i for i, p in enumerate(params) if p.logprobs is not None]
        picked = top_values = top_ids = None
        wants: list[int] = []
        if scored:
            idx = to_device(scored, torch.long, raw.device)
            log_probs = torch.log_softmax(raw[idx], dim=-1)  # [len(scored), V]
            picked = log_probs.gather(1, tokens[idx][:, None])[:, 0]
            wants = [params[i].logprobs or 0 for i in scored]
            k = max(wants, default=0)
            if k:
                top_values, top_ids = torch.topk(log_probs, k, dim=-1)
        if counted is not None:
            self._output_counts.count(counted, tokens)
        return PendingRows(tokens, scored, wants, picked, top_values, top_ids, dead_ends)


class PendingRows:
    """One step's picks on their way to the host: ``tokens`` [N] int64 on the device now, the
    lists after ``rows()`` (which waits only for this step's copies, not for work queued later)."""

    def __init__(self, tokens: torch.Tensor, scored: list[int], wants: list[int],
                 picked: torch.Tensor | None, top_values: torch.Tensor | None, top_ids: torch.Tensor | None,
                 dead_ends: dict[int, str] | None = None) -> None:
        self.tokens = tokens
        self._dead_ends = dead_ends or {}
        self._scored, self._wants = scored, wants
        on_gpu = tokens.device.type == "cuda"
        # non_blocking D2H lands in pinned memory; the event marks when it is there. A blocking
        # .tolist() later would wait for everything queued on the stream by then (the next step).
        self._host = [None if t is None else t.to("cpu", non_blocking=on_gpu) for t in (tokens, picked, top_values, top_ids)]
        self._ready: torch.cuda.Event | None = None
        if on_gpu:
            self._ready = torch.cuda.Event()
            self._ready.record()

    def rows(self) -> list[SampledRow]:
        if self._ready is not None:
            self._ready.synchronize()
        tokens, picked, top_values, top_ids = self._host
        assert tokens is not None
        token_list = tokens.tolist()
        n = len(token_list)
        chosen: list[float | None] = [None] * n
        tops: list[tuple[tuple[int, float], ...] | None] = [None] * n
        if picked is not None:
            for i, lp in zip(self._scored, picked.tolist()):
                chosen[i] = lp
        if top_values is not None and top_ids is not None:
            values_l, ids_l = top_values.tolist(), top_ids.tolist()
            for r, (i, want) in enumerate(zip(self._scored, self._wants)):
                if want:
                    tops[i] = tuple(zip(ids_l[r][:want], values_l[r][:want]))
        return [SampledRow(t, lp, top, self._dead_ends.get(i))
                for i, (t, lp, top) in enumerate(zip(token_list, chosen, tops))]
