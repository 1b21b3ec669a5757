"""OpenAI's presence and frequency penalties and vLLM's repetition penalty, min-p and min_tokens: the
sampler's arithmetic on known logits, its device-side counts (kept current without the host's outputs,
as overlapped steps need), and the engine's greedy tokens against a by-hand ``transformers``
reference, with and without overlapped steps, batched with requests that ask for none."""

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


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    sampler = Sampler("cpu", seed=0)
    rp = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    # token 1 is seen in the prompt: 1.5 / 2 = 0.75 < 0.8
    [row] = sampler.sample_rows(torch.tensor([[0.8, 1.5, -1.0]]), [rp], ["a"], [[]], [[1]])
    assert row.token_id == 0
    # token 0 is seen in the output: -0.5 x 2 = -1.0 < -0.6
    [row] = sampler.sample_rows(torch.tensor([[-0.5, -0.6, -5.0]]), [rp], ["b"], [[0]], [[2]])
    assert row.token_id == 1
    # "a" picked 0 above, so 0 and (from the prompt, read once at first sight) 1 are seen: 0.8 / 2 and
    # 1.5 / 2 against an unseen 0.76
    [row] = sampler.sample_rows(torch.tensor([[0.8, 1.5, 0.76]]), [rp], ["a"], [[0]], [[]])
    assert row.token_id == 2


def test_repetition_penalty_comes_before_frequency_as_in_vllm():
    """3 / 2 - 1 = 0.5 < 0.75 (the other order, (3 - 1) / 2 = 1.0, would keep token 0)."""
    sampler = Sampler("cpu", seed=0)
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.0)
    [row] = sampler.sample_rows(torch.tensor([[3.0, 0.75]]), [params], ["r"], [[0]], [[]])
    assert row.token_id == 1


def test_min_tokens_holds_back_eos_and_stop_tokens():
    sampler = Sampler("cpu", seed=0, eos_token_ids=(2,))
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0]])  # EOS (2) first, stop token 3 next, then 1
    held = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=2, stop_token_ids=(3,))
    assert sampler.sample_rows(logits.clone(), [held], ["r"], [[1]])[0].token_id == 1  # 1 generated < 2
    assert sampler.sample_rows(logits.clone(), [held], ["r"], [[1, 1]])[0].token_id == 2  # 2 generated: free
    no_eos = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=2, stop_token_ids=(3,), ignore_eos=True)
    assert sampler.sample_rows(logits.clone(), [no_eos], ["s"], [[]])[0].token_id == 2  # EOS does not stop it


def test_min_p_drops_tokens_below_its_share_of_the_top():
    from engine.sampling import filter_min_p

    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = filter_min_p(logits, 0.5)  # >= 0.25: tokens 0 and 1
    assert torch.isfinite(kept).tolist() == [True, True, False, False]
    assert torch.equal(filter_min_p(logits, 0.0), logits)
    sampler = Sampler("cpu", seed=0)
    params = [SamplingParams(temperature=1.0, min_p=0.5, seed=s) for s in range(40)]
    rows = sampler.sample_rows(logits.repeat(40, 1), params, [f"r{s}" for s in range(40)], [[]] * 40)
    assert {r.token_id for r in rows} == {0, 1}


@pytest.mark.parametrize(("field", "value"), [("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
                                              ("repetition_penalty", float("nan")), ("min_p", 1.5),
                                              ("min_p", -0.1), ("min_tokens", 17), ("min_tokens", -1)])
def test_out_of_range_vllm_extras_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=16, **{field: value})


def test_min_tokens_with_a_grammar_is_refused():
    from engine.protocol import GuidedSpec

    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=8, min_tokens=2, guided=GuidedSpec(json_schema='{"type": "object"}'))


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


PENALTIES = {"plain": (0.0, 0.0, 1.0), "repeat-averse": (0.6, 1.5, 1.0), "repeat-seeking": (-2.0, -1.0, 1.0),
             "repetition": (0.0, 0.0, 2.0), "all-three": (-2.0, 0.5, 1.5)}


@pytest.fixture(scope="module")
def prompts(base_engine):
    tok = base_engine.runner.tokenizer
    return {name: tok.encode(f"Tell me about the refund policy, version {i}.") for i, name in enumerate(PENALTIES)}


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_engine_greedy_with_penalties_matches_the_reference(base_engine, hf_model, prompts, overlap):
    engine = LLMEngine(EngineConfig(model_dir=base_engine.config.model_dir, block_size=16, overlap_steps=overlap),
                       base_engine.runner, num_blocks=128)
    assert engine.overlap_steps is overlap
    for name, (presence, frequency, repetition) in PENALTIES.items():
        engine.add_request(GenerateRequest(
            name, StaticTenantScope(), prompt_token_ids=prompts[name],
            sampling=SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True, presence_penalty=presence,
                                    frequency_penalty=frequency, repetition_penalty=repetition)))
    got: dict[str, list[int]] = {name: [] for name in PENALTIES}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    for name, (presence, frequency, repetition) in PENALTIES.items():
        reference = hf_penalised_greedy(hf_model, prompts[name], N_NEW, presence, frequency, repetition)
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
    counted = counts.penalise(logits, list(range(20)), params, ids, outputs, [()] * 20)
    assert counts.tracked == 20
    for i in range(20):  # each row lost its own outputs' counts, nothing else
        want = torch.zeros(vocab)
        want[i % vocab] -= i % 3
        assert torch.equal(logits[i], want), i
    picks = torch.tensor([(i + 1) % vocab for i in range(20)])
    counts.count(counted, picks)  # picks by row
    again = torch.zeros((20, vocab))
    counts.penalise(again, list(range(20)), params, ids, [[]] * 20, [()] * 20)  # known now: outputs are not re-read
    for i in range(20):
        want = torch.zeros(vocab)
        want[i % vocab] -= i % 3
        want[(i + 1) % vocab] -= 1
        assert torch.equal(again[i], want), i
    counts.release("r3")
    fresh = torch.zeros((1, vocab))
    counts.penalise(fresh, [0], params[:1], ["new"], [[]], [()])
    assert counts.tracked == 20 and torch.equal(fresh, torch.zeros((1, vocab)))  # r3's slot, zeroed


def _run(engine: LLMEngine, request: GenerateRequest) -> tuple[list[int], str, str | None]:
    engine.add_request(request)
    ids, text, reason = [], "", None
    while engine.has_unfinished():
        for out in engine.step():
            ids += out.new_token_ids
            text += out.new_text
            reason = out.finish_reason
    engine.check_integrity()
    return ids, text, reason


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_min_tokens_in_the_engine_holds_back_stop_tokens_and_strings(base_engine, prompts, overlap):
    engine = LLMEngine(EngineConfig(model_dir=base_engine.config.model_dir, block_size=16, overlap_steps=overlap),
                       base_engine.runner, num_blocks=128)
    prompt = prompts["plain"]
    t = StaticTenantScope()
    ids, _, _ = _run(engine, GenerateRequest("p", t, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                                             prompt_token_ids=prompt))
    first = ids[0]
    stopped, _, reason = _run(engine, GenerateRequest("s", t, SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, stop_token_ids=(first,)), prompt_token_ids=prompt))
    assert stopped == [first] and reason == "stop"  # without min_tokens the first token stops it
    held, _, _ = _run(engine, GenerateRequest("h", t, SamplingParams(
        max_tokens=6, min_tokens=3, temperature=0.0, ignore_eos=True, stop_token_ids=(first,)), prompt_token_ids=prompt))
    assert len(held) >= 3 and first not in held[:3]

    stop_text = base_engine.runner.tokenizer.decode([first])
    assert stop_text, "the first token must have text to stop on"
    cut, text, reason = _run(engine, GenerateRequest("t", t, SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, stop=(stop_text,)), prompt_token_ids=prompt))
    assert len(cut) == 1 and text == "" and reason == "stop"
    kept, text, _ = _run(engine, GenerateRequest("k", t, SamplingParams(
        max_tokens=6, min_tokens=3, temperature=0.0, ignore_eos=True, stop=(stop_text,)), prompt_token_ids=prompt))
    assert len(kept) >= 3 and text.startswith(stop_text)  # the early stop string is text now, not an end
