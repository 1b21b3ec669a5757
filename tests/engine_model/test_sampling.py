"""Sampler semantics on synthetic logits, and seeded sampling through the runner."""

from __future__ import annotations

import math

import pytest
import torch

from engine.protocol import SamplingParams
from engine.sampling import Sampler, filter_top_k_top_p
from tests.engine_model.driver import BlockAllocator, Seq, blocks_needed, run

PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted desc: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
LOGITS = PROBS.log()


def draws(params: SamplingParams, n: int = 400, logits: torch.Tensor = LOGITS) -> list[int]:
    sampler = Sampler("cpu", seed=0)
    batch = logits.expand(n, -1).clone()
    tokens, _ = sampler.sample(batch, [params] * n, [f"r{i}" for i in range(n)], [0] * n)
    return tokens


def test_top_p_restricts_support_to_the_nucleus():
    # 0.5 < 0.7 -> needs token 3 too (0.8 >= 0.7); tokens 2 and 0 are outside
    got = draws(SamplingParams(temperature=1.0, top_p=0.7))
    assert set(got) == {1, 3}
    kept = filter_top_k_top_p(LOGITS, 0, 0.7)
    assert torch.isinf(kept[[0, 2]]).all() and torch.isfinite(kept[[1, 3]]).all()
    # top_p below the top token's mass keeps exactly the top token
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.2), n=50)) == {1}


def test_top_k_restricts_support_and_top_k_1_is_greedy():
    assert set(draws(SamplingParams(temperature=1.0, top_k=2))) == {1, 3}
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler("cpu", seed=0)
    params = [SamplingParams(temperature=1.5, top_k=1)] * 7
    tokens, _ = sampler.sample(logits, params, [f"r{i}" for i in range(7)], [0] * 7)
    assert tokens == logits.argmax(dim=-1).tolist()
    # the filter itself (not only the greedy shortcut) keeps just the argmax
    assert torch.isfinite(filter_top_k_top_p(logits[0], 1, 1.0)).sum() == 1


def test_unfiltered_sampling_follows_the_distribution():
    got = draws(SamplingParams(temperature=1.0), n=4000)
    freq = torch.bincount(torch.tensor(got), minlength=4).float() / 4000
    assert torch.allclose(freq, PROBS, atol=0.04), freq
    # low temperature sharpens towards the mode
    cold = draws(SamplingParams(temperature=0.1), n=400)
    assert cold.count(1) > 390


def test_greedy_returns_argmax_and_logprobs():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    sampler = Sampler("cpu")
    tokens, logprobs = sampler.sample(logits, [SamplingParams(temperature=0.0)] * 3, ["a", "b", "c"], [0, 0, 0])
    assert tokens == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).max(-1).values.tolist()
    assert all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(logprobs, expected, strict=True))


def test_sample_rows_scores_only_the_rows_that_ask_for_logprobs():
    """The runner's path (sample_rows) skips the vocabulary-wide log-softmax for rows without
    ``logprobs``: their logprob is None; the asking row's equals the full log-softmax's."""
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.0)]
    rows = Sampler("cpu").sample_rows(logits, params, ["a", "b", "c"], [(), (), ()])
    assert [r.token_id for r in rows] == logits.argmax(-1).tolist()
    assert rows[0].logprob is None and rows[2].logprob is None and rows[0].top is None
    full = torch.log_softmax(logits[1], -1)
    assert math.isclose(rows[1].logprob, float(full.max()), abs_tol=1e-6)
    assert [t for t, _ in rows[1].top] == torch.topk(full, 2).indices.tolist()


def test_seed_reproducible_and_independent_of_batch_partners():
    logits = torch.randn(50, 1000, generator=torch.Generator().manual_seed(2))
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def seq_tokens(sampler, with_partner: bool) -> list[int]:
        out = []
        for step in range(50):
            rows = [logits[step]]
            params, ids, steps = [seeded], ["s"], [step]
            if with_partner:  # an unseeded request sharing the batch must not perturb "s"
                rows.append(logits[(step + 1) % 50])
                params.append(SamplingParams(temperature=1.0))
                ids.append("other")
                steps.append(step)
            tokens, _ = sampler.sample(torch.stack(rows), params, ids, steps)
            out.append(tokens[0])
        return out

    a = seq_tokens(Sampler("cpu", seed=1), with_partner=False)
    b = seq_tokens(Sampler("cpu", seed=99), with_partner=True)
    assert a == b
    other_seed = SamplingParams(temperature=1.0, seed=4321)
    sampler = Sampler("cpu")
    c = [sampler.sample(logits[s : s + 1], [other_seed], ["s"], [s])[0][0] for s in range(50)]
    assert c != a
    sampler.release("s")
    assert "s" not in sampler._per_request


@pytest.mark.parametrize("partner", [False, True])
def test_seeded_generation_through_runner_is_reproducible(partner, tiny_model_dir, runner_cache):
    runner = runner_cache(tiny_model_dir)
    alloc = BlockAllocator(runner.num_kv_blocks, seed=7)
    prompt = list(range(1000, 1013))
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=8)
    seqs = [Seq("seeded", list(prompt), alloc.take(blocks_needed(21, 8)), sampling=params)]
    if partner:
        seqs.append(Seq("partner", list(range(2000, 2030)), alloc.take(blocks_needed(38, 8)),
                        sampling=SamplingParams(temperature=1.0)))
    out = run(runner, seqs, 8)[0]
    runner.release("seeded")
    # reference: the same request alone, again
    alone = Seq("seeded", list(prompt), alloc.take(blocks_needed(21, 8)), sampling=params)
    assert run(runner, [alone], 8)[0] == out
    runner.release("seeded")
