"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``) with the real tiny model, against a
plain torch reference: ``transformers``' forward over the whole prompt at once, ``log_softmax``.

Covered: a prompt split over several prefill chunks (the last row of one chunk scores the first
token of the next), in plain and overlapped steps; a request whose prefix an earlier request left
in the cache (still scored in full, ``cached_tokens`` 0, and its blocks cached for the next);
``max_tokens`` 0 (the prompt alone); a scoring request batched with a plain one; the row slicing
that bounds the logits' memory. Tolerances, never float equality: the engine's batch shapes differ
from the reference's.
"""

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine.config import EngineConfig  # noqa: E402
from engine.launch import build_llm_engine, build_tiny_checkpoint  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.prompt_scoring import score_prompt_rows  # noqa: E402
from engine.protocol import (  # noqa: E402
    GenerateRequest,
    PromptLogprobs,
    RequestOutput,
    SamplingParams,
    StaticTenantScope,
)

TOL = 1e-4  # fp32 engine vs fp32 transformers: observed differences are ~1e-6


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def base_engine(tiny_dir):
    return build_llm_engine(EngineConfig(model_dir=tiny_dir, block_size=16, num_kv_blocks=128))


@pytest.fixture(scope="module")
def prompt(base_engine):
    text = "The refund policy says that items may be returned within thirty days of purchase. " * 5
    ids = base_engine.runner.tokenizer.encode(text)
    assert len(ids) > 60, "the prompt must span several 32-token chunks"
    return ids


def engine_like(base: LLMEngine, **cfg) -> LLMEngine:
    config = EngineConfig(model_dir=base.config.model_dir, block_size=16, **cfg)
    return LLMEngine(config, base.runner)


def reference(hf_model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the logits at every position of one full-sequence forward: [T, V]."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_matches(got: PromptLogprobs, ids: list[int], ref: torch.Tensor, k: int) -> None:
    """Token i's logprob = ref[i - 1][ids[i]]; the top-k values are the reference's top-k values, and
    each named alternative has the reference's logprob (ties may order equal values either way)."""
    assert got.first_token_id == ids[0]
    assert [lp.token_id for lp in got.scored] == ids[1:]
    for i, lp in enumerate(got.scored, start=1):
        assert abs(lp.logprob - float(ref[i - 1, ids[i]])) < TOL, (i, lp.logprob, float(ref[i - 1, ids[i]]))
        assert len(lp.top) == k
        want = torch.topk(ref[i - 1], k).values.tolist() if k else []
        for (text, raw, value), ref_value in zip(lp.top, want):
            assert abs(value - ref_value) < TOL
            assert bytes(raw).decode("utf-8", errors="replace") == text
    # the first token has no predecessor: nothing scores it
    assert len(got.scored) == len(ids) - 1


def run_all(engine: LLMEngine, requests: list[GenerateRequest]) -> dict[str, list[RequestOutput]]:
    for r in requests:
        engine.add_request(r)
    outs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    engine.check_integrity()
    return outs


def scoring(rid: str, ids: list[int], k: int = 2, max_tokens: int = 1) -> GenerateRequest:
    return GenerateRequest(rid, StaticTenantScope(), SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=k), prompt_token_ids=ids)


def only_prompt_logprobs(outs: list[RequestOutput]) -> PromptLogprobs:
    """Exactly one output carries the prompt's scores: the first."""
    carrying = [o for o in outs if o.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0] is outs[0]
    return carrying[0].prompt_logprobs


@pytest.mark.parametrize("overlap", [False, True])
def test_chunked_prompt_is_scored_like_one_forward(base_engine, hf_model, prompt, overlap):
    engine = engine_like(base_engine, max_num_batched_tokens=32, overlap_steps=overlap)
    outs = run_all(engine, [scoring("a", prompt, k=2, max_tokens=3)])["a"]
    assert sum(len(o.new_token_ids) for o in outs) == 3
    assert outs[-1].cached_tokens == 0
    assert_matches(only_prompt_logprobs(outs), prompt, reference(hf_model, prompt), k=2)


def test_cached_prefix_is_still_scored_and_reported_uncached(base_engine, hf_model, prompt):
    engine = engine_like(base_engine, max_num_batched_tokens=64)
    plain = GenerateRequest("warm", StaticTenantScope(), SamplingParams(max_tokens=1, temperature=0.0),
                            prompt_token_ids=prompt)
    assert run_all(engine, [plain])["warm"][-1].cached_tokens == 0
    hit = GenerateRequest("hit", StaticTenantScope(), SamplingParams(max_tokens=1, temperature=0.0),
                          prompt_token_ids=prompt)
    assert run_all(engine, [hit])["hit"][-1].cached_tokens > 0, "the prompt's blocks must be cached by now"

    outs = run_all(engine, [scoring("scored", prompt, k=1)])["scored"]
    assert outs[-1].cached_tokens == 0  # every position computed: none was served from the cache
    assert_matches(only_prompt_logprobs(outs), prompt, reference(hf_model, prompt), k=1)

    # a scored request still leaves its blocks cached: a later plain request of the namespace hits
    again = GenerateRequest("again", StaticTenantScope(), SamplingParams(max_tokens=1, temperature=0.0),
                            prompt_token_ids=prompt)
    assert run_all(engine, [again])["again"][-1].cached_tokens >= 16 * (len(prompt) // 16 - 1)


def test_scored_blocks_are_cached_for_the_next_request(base_engine, prompt):
    engine = engine_like(base_engine)
    run_all(engine, [scoring("first", prompt, k=0)])
    after = GenerateRequest("after", StaticTenantScope(), SamplingParams(max_tokens=1, temperature=0.0),
                            prompt_token_ids=prompt)
    assert run_all(engine, [after])["after"][-1].cached_tokens > 0
    # another namespace never sees them (the tenant-salted index is untouched by scoring)
    other = GenerateRequest("other", StaticTenantScope(namespace=b"other"), SamplingParams(max_tokens=1),
                            prompt_token_ids=prompt)
    assert run_all(engine, [other])["other"][-1].cached_tokens == 0


def test_max_tokens_zero_returns_the_prompt_scores_alone(base_engine, hf_model, prompt):
    engine = engine_like(base_engine, max_num_batched_tokens=32)
    outs = run_all(engine, [scoring("z", prompt, k=0, max_tokens=0)])["z"]
    assert len(outs) == 1 and outs[0].finished
    out = outs[0]
    assert out.finish_reason == "length" and out.new_token_ids == () and out.completion_tokens == 0
    assert out.prompt_tokens == len(prompt)
    assert_matches(out.prompt_logprobs, prompt, reference(hf_model, prompt), k=0)


def test_scoring_beside_a_plain_request(base_engine, hf_model, prompt):
    """Batched with a plain request: each gets its own; the plain one has no prompt scores and the
    same greedy tokens as alone."""
    short = prompt[:20]
    alone = run_all(engine_like(base_engine), [GenerateRequest(
        "p", StaticTenantScope(), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        prompt_token_ids=short)])["p"]
    engine = engine_like(base_engine, max_num_batched_tokens=48)
    outs = run_all(engine, [
        scoring("s", prompt, k=3, max_tokens=2),
        GenerateRequest("p", StaticTenantScope(namespace=b"t2"),
                        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), prompt_token_ids=short),
    ])
    assert all(o.prompt_logprobs is None for o in outs["p"])
    assert [t for o in outs["p"] for t in o.new_token_ids] == [t for o in alone for t in o.new_token_ids]
    assert_matches(only_prompt_logprobs(outs["s"]), prompt, reference(hf_model, prompt), k=3)


@pytest.mark.parametrize("overlap", [False, True])
def test_scoring_survives_preemption(base_engine, hf_model, prompt, overlap):
    """Two scoring requests whose prompts and outputs cannot both fit the pool: the scheduler preempts
    one mid-flight, and when it runs again its prompt is recomputed without a prefix hit for the
    positions still to score; each ends with every prompt token scored once, as one forward scores it."""
    other = prompt[5:] + prompt[:5]
    config = EngineConfig(model_dir=base_engine.config.model_dir, block_size=16, max_num_batched_tokens=32,
                          overlap_steps=overlap)
    blocks = -(-(len(prompt) + 24) // 16)  # one request's whole life
    engine = LLMEngine(config, base_engine.runner, num_blocks=blocks + 3)
    outs = run_all(engine, [scoring("a", prompt, k=1, max_tokens=24), scoring("b", other, k=1, max_tokens=24)])
    assert engine.scheduler.num_preemptions > 0, "the pool must be too small for both"
    assert_matches(only_prompt_logprobs(outs["a"]), prompt, reference(hf_model, prompt), k=1)
    assert_matches(only_prompt_logprobs(outs["b"]), other, reference(hf_model, other), k=1)
    assert sum(len(o.new_token_ids) for o in outs["a"]) == sum(len(o.new_token_ids) for o in outs["b"]) == 24


def test_a_scored_request_lists_its_stop_token(base_engine, prompt):
    """With prompt scores, every output token has an entry, EOS included (one per token, prompt and
    output, is what a loglikelihood caller slices); a plain logprobs request's EOS has none."""
    eos = base_engine.eos_token_ids[0]
    forced = SamplingParams(max_tokens=2, temperature=0.0, logprobs=1, logit_bias=((eos, 100.0),))
    scored = GenerateRequest("s", StaticTenantScope(), replace(forced, prompt_logprobs=1),
                             prompt_token_ids=prompt)
    plain = GenerateRequest("p", StaticTenantScope(namespace=b"p"), forced, prompt_token_ids=prompt)
    outs = run_all(engine_like(base_engine), [scored, plain])
    for rid, listed in (("s", 1), ("p", 0)):
        assert [t for o in outs[rid] for t in o.new_token_ids] == [eos]
        assert outs[rid][-1].finish_reason == "stop"
        entries = [lp for o in outs[rid] for lp in o.logprobs]
        assert len(entries) == listed and all(lp.token_id == eos for lp in entries)


def test_a_one_token_prompt_has_nothing_to_score(base_engine, prompt):
    outs = run_all(engine_like(base_engine), [scoring("one", prompt[:1], k=1)])["one"]
    got = only_prompt_logprobs(outs)
    assert got.first_token_id == prompt[0] and got.scored == ()


def test_row_slices_bound_memory_without_changing_scores():
    """Projecting 3 rows at a time gives what one projection of every row gives."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 8, generator=gen)
    head = torch.randn(8, 50, generator=gen)
    targets = torch.randint(0, 50, (10,), generator=gen).tolist()
    whole = score_prompt_rows(hidden, targets, 4, lambda h: h @ head, rows=256).to_host()
    sliced = score_prompt_rows(hidden, targets, 4, lambda h: h @ head, rows=3).to_host()
    ref = torch.log_softmax(hidden @ head, dim=-1)
    for j, t in enumerate(targets):
        assert abs(sliced.logprobs[j] - float(ref[j, t])) < 1e-5
        assert abs(sliced.logprobs[j] - whole.logprobs[j]) < 1e-5
        assert [i for i, _ in sliced.top[j]] == torch.topk(ref[j], 4).indices.tolist()
    with pytest.raises(ValueError, match="one hidden row per target"):
        score_prompt_rows(hidden, targets[:4], 1, lambda h: h @ head)
