"""OpenAI's presence and frequency penalties: the sampler's arithmetic on known logits, its device-side
counts (kept current without the host's outputs, as overlapped steps need), and the engine's greedy
tokens against a by-hand ``transformers`` reference, with and without overlapped steps, batched with
requests that ask for none."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine.config import EngineConfig
from engine.launch import build_llm_engine
from engine.llm_engine import LLMEngine
from engine.protocol import GenerateRequest, SamplingParams, StaticTenantScope
from engine.sampling import Sampler
from tests.greedy_reference import assert_greedy_agrees, first_near_tie, hf_penalised_greedy

N_NEW = 12


def test_penalties_follow_openais_formula_and_logprobs_stay_raw():
    sampler = Sampler("cpu", seed=0)
    raw = torch.tensor([[0.0, 2.7, 2.5, 1.0, -1.0, 0.5]])
    params = SamplingParams(temperature=0.0, presence_penalty=0.4, frequency_penalty=0.3, logprobs=0)
    [row] = sampler.sample_rows(raw.clone(), [params], ["r"], [[1, 1, 2, 5]])
    counts = torch.tensor([0.0, 2.0, 1.0, 0.0, 0.0, 1.0])
    penalised = raw[0] - counts * 0.3 - (counts > 0).float() * 0.4
    assert int(raw.argmax()) == 1
    assert row.token_id == int(penalised.argmax()) == 2  # token 1: 2.7 - 2 x 0.3 - 0.4 = 1.7; token 2: 1.8
    assert row.logprob == pytest.approx(float(torch.log_softmax(raw[0], -1)[2]))  # of the raw distribution


def test_negative_penalties_reward_repeats():
    sampler = Sampler("cpu", seed=0)
    raw = torch.tensor([[1.0, 1.2, 0.0]])
    [row] = sampler.sample_rows(raw.clone(), [SamplingParams(temperature=0.0, presence_penalty=-0.5)], ["r"], [[0]])
    assert row.token_id == 0  # 1.0 + 0.5 beats 1.2


def test_counts_follow_the_samplers_own_picks_without_the_hosts_outputs():
    """With overlapped steps the host launches step n+1 before it has step n's token: the counts must
    include it anyway. Token 0 leads by 1.5; a frequency penalty of 2 moves the pick off it each time
    it is picked, so greedy alternates 0, 1, 0, 1 even though the host never passes its outputs."""
    sampler = Sampler("cpu", seed=0)
    raw = torch.tensor([[2.5, 1.0, -5.0]])
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    picks = [sampler.sample_rows(raw.clone(), [params], ["r"], [[]])[0].token_id for _ in range(4)]
    assert picks == [0, 1, 0, 1]
    sampler.release("r")  # a finished request's counts go with it; the id starts afresh
    assert sampler.sample_rows(raw.clone(), [params], ["r"], [[]])[0].token_id == 0


def test_counts_start_from_the_known_outputs_on_first_sight():
    """A decode node continues a request whose first token another node sampled."""
    sampler = Sampler("cpu", seed=0)
    raw = torch.tensor([[2.5, 1.0, -5.0]])
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    assert sampler.sample_rows(raw.clone(), [params], ["r"], [[0]])[0].token_id == 1


@pytest.mark.parametrize("penalty", [3.0, float("nan"), -2.5])
def test_out_of_range_penalties_are_refused(penalty):
    with pytest.raises(ValueError, match="penalty must be in"):
        SamplingParams(presence_penalty=penalty)
    with pytest.raises(ValueError, match="penalty must be in"):
        SamplingParams(frequency_penalty=penalty)


@pytest.fixture(scope="module")
def base_engine(tiny_model_dir):
    return build_llm_engine(EngineConfig(model_dir=tiny_model_dir, block_size=16, num_kv_blocks=128))


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


PENALTIES = {"plain": (0.0, 0.0), "repeat-averse": (0.6, 1.5), "repeat-seeking": (-2.0, -1.0)}


@pytest.fixture(scope="module")
def prompts(base_engine):
    tok = base_engine.runner.tokenizer
    return {name: tok.encode(f"Tell me about the refund policy, version {i}.") for i, name in enumerate(PENALTIES)}


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_engine_greedy_with_penalties_matches_the_reference(base_engine, hf_model, prompts, overlap):
    engine = LLMEngine(EngineConfig(model_dir=base_engine.config.model_dir, block_size=16, overlap_steps=overlap),
                       base_engine.runner, num_blocks=128)
    assert engine.overlap_steps is overlap
    for name, (presence, frequency) in PENALTIES.items():
        engine.add_request(GenerateRequest(
            name, StaticTenantScope(), prompt_token_ids=prompts[name],
            sampling=SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True,
                                    presence_penalty=presence, frequency_penalty=frequency)))
    got: dict[str, list[int]] = {name: [] for name in PENALTIES}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    for name, (presence, frequency) in PENALTIES.items():
        reference = hf_penalised_greedy(hf_model, prompts[name], N_NEW, presence, frequency)
        assert_greedy_agrees(got[name], reference)
        if name != "plain":  # the penalty changed the choice within the compared span: not vacuous
            plain = hf_penalised_greedy(hf_model, prompts[name], N_NEW, 0.0, 0.0)
            upto = min(first_near_tie(reference), first_near_tie(plain)) + 1
            assert reference[:upto] != plain[:upto], name


def test_output_counts_grow_reuse_slots_and_keep_every_requests_counts():
    """Twenty requests (the table starts at 8 slots and doubles), each with its own known outputs;
    released slots are reused zeroed; the picks land in their own rows only."""
    from engine.penalties import OutputCounts

    counts = OutputCounts(torch.device("cpu"))
    vocab = 7
    params = [SamplingParams(frequency_penalty=1.0)] * 20
    ids = [f"r{i}" for i in range(20)]
    outputs = [[i % vocab] * (i % 3) for i in range(20)]
    logits = torch.zeros((20, vocab))
    slots = counts.penalise(logits, list(range(20)), params, ids, outputs)
    assert counts.tracked == 20
    for i in range(20):  # each row lost its own outputs' counts, nothing else
        want = torch.zeros(vocab)
        want[i % vocab] -= i % 3
        assert torch.equal(logits[i], want), i
    picks = torch.tensor([(i + 1) % vocab for i in range(20)])
    counts.count(slots, picks)
    again = torch.zeros((20, vocab))
    counts.penalise(again, list(range(20)), params, ids, [[]] * 20)  # known now: outputs are not re-read
    for i in range(20):
        want = torch.zeros(vocab)
        want[i % vocab] -= i % 3
        want[(i + 1) % vocab] -= 1
        assert torch.equal(again[i], want), i
    counts.release("r3")
    fresh = torch.zeros((1, vocab))
    counts.penalise(fresh, [0], params[:1], ["new"], [[]])
    assert counts.tracked == 20 and torch.equal(fresh, torch.zeros((1, vocab)))  # r3's slot, zeroed
