"""Sampling features on the real tiny model: grammar-constrained decoding (llguidance), logit_bias,
logprobs / top logprobs, and their validation. Greedy and seeded, so every run is identical.

The random-weight tiny model emits noise on its own: whatever it produces under a grammar must
still parse and validate, which is what these tests check.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import jsonschema
import pytest
import torch
from prometheus_client import CollectorRegistry

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.disagg.api import DisaggConfig, Role
from engine.disagg.metrics import TransferMetrics
from engine.disagg.node import DisaggEngine
from engine.guided import (
    COMPILES_QUEUED_PER_TENANT,
    CompileQueueFullError,
    GrammarCompiler,
    apply_bitmask,
    bitmask_words,
)
from engine.launch import build_engine, build_llm_engine
from engine.llm_engine import LLMEngine
from engine.protocol import (
    GenerateRequest,
    GrammarOwner,
    GrammarQueueFullError,
    GuidedSpec,
    InvalidRequestError,
    OutputFailure,
    SamplingParams,
    StaticTenantScope,
    UnenforceableSchemaError,
)
from engine.sampling import Sampler

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "rain": {"type": "boolean"},
        "temp": {"type": "integer", "minimum": -50, "maximum": 50},
    },
    "required": ["city", "rain", "temp"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return build_llm_engine(EngineConfig(model_dir=tiny_model_dir, block_size=16, num_kv_blocks=128))


def run(engine: LLMEngine, *requests: GenerateRequest) -> dict[str, dict]:
    """Run to completion: per request id the text, token ids, finish reason and logprob entries."""
    for r in requests:
        engine.add_request(r)
    done: dict[str, dict] = {r.request_id: {"text": "", "ids": [], "logprobs": [], "finish": None} for r in requests}
    while engine.has_unfinished():
        for out in engine.step():
            d = done[out.request_id]
            d["text"] += out.new_text
            d["ids"] += out.new_token_ids
            d["logprobs"] += out.logprobs
            if out.finished:
                d["finish"] = out.finish_reason
    engine.check_integrity()
    return done


def req(rid: str, prompt: str = "Give me the weather:", tenant: StaticTenantScope | None = None,
        **sampling) -> GenerateRequest:
    sampling.setdefault("temperature", 0.0)
    return GenerateRequest(request_id=rid, tenant=tenant or StaticTenantScope(), prompt=prompt,
                           sampling=SamplingParams(**sampling))


def test_json_schema_output_parses_and_validates_batched_with_free_requests(engine):
    spec = GuidedSpec(json_schema=json.dumps(SCHEMA))
    free_alone = run(engine, req("free0", max_tokens=8))["free0"]
    out = run(engine,
              req("g0", guided=spec, max_tokens=96),
              req("free1", max_tokens=8),
              req("g1", "Another prompt, seeded", guided=spec, max_tokens=96, temperature=1.0, seed=7))
    for rid in ("g0", "g1"):
        assert out[rid]["finish"] == "stop", out[rid]
        jsonschema.validate(json.loads(out[rid]["text"]), SCHEMA)
    # the unguided request in the same batch is unaffected by its neighbours' masks
    assert out["free1"]["ids"] == free_alone["ids"]


def test_json_object_and_wrapped_value(engine):
    spec = GuidedSpec(json_schema=json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                              "required": ["ok"], "additionalProperties": False}),
                      prefix="<tool_call>\n", suffix="\n</tool_call>")
    text = run(engine, req("w", guided=spec, max_tokens=64))["w"]["text"]
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    assert json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")) in ({"ok": True}, {"ok": False})


def test_invalid_or_oversized_schema_is_refused_at_admission(engine):
    bad = GuidedSpec(json_schema=json.dumps({"type": "object", "properties": {"a": {"type": "no-such-type"}}}))
    with pytest.raises(InvalidRequestError, match="schema"):
        engine.add_request(req("bad", guided=bad))
    huge = GuidedSpec(json_schema=json.dumps({"enum": ["x" * 1000] * 100}))
    with pytest.raises(InvalidRequestError, match="larger than"):
        engine.add_request(req("huge", guided=huge))
    assert not engine.has_unfinished()


def test_logit_bias_plus_100_makes_greedy_emit_the_token(engine):
    target = engine.runner.tokenizer.encode(" banana")[0]
    out = run(engine, req("b", max_tokens=4, logit_bias=((target, 100.0),)))["b"]
    assert out["ids"] == [target] * 4
    plain = run(engine, req("p", max_tokens=4))["p"]
    assert plain["ids"] != out["ids"]
    # -100 on the unbiased greedy token removes it from the first step
    banned = run(engine, req("n", max_tokens=1, logit_bias=((plain["ids"][0], -100.0),)))["n"]
    assert banned["ids"][0] != plain["ids"][0]


def test_logit_bias_of_several_rows_lands_on_each_rows_own_tokens():
    """The biases of a step's rows go out in one scatter: each row gets its own, an unbiased row none."""
    sampler = Sampler("cpu", seed=0)
    logits = torch.zeros(3, 6)
    params = [SamplingParams(temperature=0.0, logit_bias=((4, 5.0), (1, 2.0))), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logit_bias=((2, 3.0), (4, -1.0)), logprobs=0)]
    rows = sampler.sample_rows(logits, params, ["a", "b", "c"], [[], [], []])
    assert [r.token_id for r in rows] == [4, 0, 2]
    assert rows[2].logprob == pytest.approx(-math.log(6))  # logprobs stay those of the raw logits
    assert torch.equal(logits, torch.zeros(3, 6))  # the caller's logits are not written


def test_logit_bias_validation():
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias=((5, 101.0),))
    with pytest.raises(ValueError, match=">= 0"):
        SamplingParams(logit_bias=((-1, 1.0),))


def test_logit_bias_token_outside_vocabulary_is_refused(engine):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_request(req("v", logit_bias=((engine.vocab_size, 1.0),)))


def test_logprobs_and_top_logprobs(engine):
    out = run(engine, req("l", max_tokens=5, logprobs=3))["l"]
    entries = out["logprobs"]
    assert len(entries) == len(out["ids"]) == 5
    assert "".join(e.token for e in entries) == out["text"]
    for e, tid in zip(entries, out["ids"]):
        assert e.token_id == tid and e.logprob <= 0.0 and len(e.top) == 3
        values = [lp for _, _, lp in e.top]
        assert values == sorted(values, reverse=True)
        # greedy: the chosen token is the most likely one
        assert math.isclose(e.logprob, values[0], abs_tol=1e-4)
        assert bytes(e.token_bytes).decode("utf-8", "replace") == e.token
    none = run(engine, req("n0", max_tokens=2))["n0"]
    assert none["logprobs"] == []


def test_apply_bitmask_masks_exactly_the_cleared_bits():
    vocab = 70
    logits = torch.zeros(2, vocab)
    mask = torch.full((2, bitmask_words(vocab)), -1, dtype=torch.int32)
    mask[0, 0] = 0b101  # row 0, word 0: only tokens 0 and 2 allowed of the first 32
    mask[1, 2] = 0  # row 1: tokens 64..69 disallowed
    apply_bitmask(logits, mask)
    allowed0 = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert allowed0 == [0, 2, *range(32, vocab)]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == list(range(64))


def test_sampler_without_grammar_pays_nothing_and_keeps_the_old_contract():
    sampler = Sampler("cpu", seed=0)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    tokens, lps = sampler.sample(logits, [SamplingParams(temperature=0.0)] * 3, ["a", "b", "c"], [0, 0, 0])
    assert tokens == logits.argmax(-1).tolist()
    assert lps == pytest.approx(torch.log_softmax(logits, -1).max(-1).values.tolist(), abs=1e-6)
    with pytest.raises(RuntimeError, match="no grammar compiler"):
        sampler.sample_rows(logits[:1], [SamplingParams(guided=GuidedSpec(json_schema="{}"))], ["g"], [()])


def _many_alternatives(n: int) -> dict:
    """A schema whose matcher takes ~0.1-0.5 s to build on this CPU (thousands of alternatives)."""
    obj = {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": f"[a-z]{{1,{i + 1}}}"}
                                            for i in range(60)}, "required": [f"k{i}" for i in range(60)]}
    return {"anyOf": [obj] * n}


def test_a_compile_over_the_time_bound_is_refused_and_others_still_run(engine):
    slow = GuidedSpec(json_schema=json.dumps(_many_alternatives(15)))
    with pytest.raises(ValueError, match="did not compile within"):
        engine.runner.grammars.check(slow, timeout_s=0.001)
    # the engine keeps serving while that compile finishes in its worker thread
    out = run(engine, req("after", max_tokens=3))["after"]
    assert len(out["ids"]) == 3


def test_guided_row_follows_rollback_and_catch_up(engine):
    grammars = engine.runner.grammars
    spec = GuidedSpec(json_schema=json.dumps(SCHEMA))
    grammars.check(spec)
    row = grammars.matcher(spec)
    words = bitmask_words(engine.vocab_size)
    start = torch.empty(words, dtype=torch.int32)
    row.fill(start)
    prefix = engine.runner.tokenizer.encode('{"city":"Oslo"')
    row.sync(prefix)
    mid = torch.empty(words, dtype=torch.int32)
    row.fill(mid)
    assert not torch.equal(start, mid)
    row.sync(prefix[:0])  # a re-run from the start: back to the first state
    again = torch.empty(words, dtype=torch.int32)
    row.fill(again)
    assert torch.equal(start, again)
    row.sync(prefix)  # and forward again
    row.fill(again)
    assert torch.equal(mid, again)
    # a fresh matcher is independent of this one (a copy of the cached prototype)
    fresh = torch.empty(words, dtype=torch.int32)
    grammars.matcher(spec).fill(fresh)
    assert torch.equal(fresh, start)


def test_guided_output_validates_across_preemption_and_recompute(engine):
    small = LLMEngine(EngineConfig(model_dir=engine.config.model_dir, block_size=16), engine.runner, num_blocks=6)
    spec = GuidedSpec(json_schema=json.dumps(SCHEMA))
    # prompts of 14 tokens: all four fit at first, and their outputs then outgrow the 6 blocks
    prompts = [[1000 + 97 * i + j for j in range(14)] for i in range(4)]
    reqs = [GenerateRequest(request_id=f"p{i}", tenant=StaticTenantScope(), prompt_token_ids=p,
                            sampling=SamplingParams(temperature=0.0, guided=spec, max_tokens=64))
            for i, p in enumerate(prompts)]
    out = run(small, *reqs)
    assert small.scheduler.num_preemptions > 0, "the pool must be small enough to force preemption"
    for r in reqs:
        assert out[r.request_id]["finish"] == "stop"
        jsonschema.validate(json.loads(out[r.request_id]["text"]), SCHEMA)


UNENFORCEABLE = {  # valid JSON Schema that llguidance refuses to compile (OpenAI's strict mode refuses them too)
    "not": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
    "if/then": {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "look-around": {"type": "string", "pattern": "^(?=a)a+$"},
}


@pytest.mark.parametrize("feature", sorted(UNENFORCEABLE))
def test_an_unenforceable_schema_is_refused_at_admission_in_one_line_and_compiled_once(engine, feature):
    spec = GuidedSpec(json_schema=json.dumps(UNENFORCEABLE[feature]))
    grammars = engine.runner.grammars
    before = grammars.compiles
    for rid in ("first", "again"):  # the refusal is cached: the second request costs no compile
        with pytest.raises(InvalidRequestError, match="cannot be enforced") as info:
            engine.add_request(req(f"{feature}-{rid}", guided=spec))
        message = str(info.value)
        assert "\n" not in message and "x-guidance" not in message and "%json" not in message
    assert grammars.compiles == before + 1
    assert not engine.has_unfinished()


def test_one_schema_is_compiled_once_for_concurrent_admissions(engine):
    import concurrent.futures

    # owned as the engine owns a request's grammar: StaticTenantScope()'s namespace and tenant
    spec = _owned(GuidedSpec(json_schema=json.dumps({**SCHEMA, "title": "concurrent"})), StaticTenantScope())
    grammars = engine.runner.grammars
    before = grammars.compiles
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: grammars.check(spec), range(8)))
    assert grammars.compiles == before + 1
    out = run(engine, req("uses-it", guided=spec, max_tokens=48))["uses-it"]  # the engine copies that compile
    assert grammars.compiles == before + 1
    if out["finish"] == "stop":
        jsonschema.validate(json.loads(out["text"]), SCHEMA)


def _owned(spec: GuidedSpec, scope: StaticTenantScope) -> GuidedSpec:
    return replace(spec, owner=GrammarOwner(cache_scope=scope.namespace.hex(), tenant=scope.tenant_key.hex()))


def _slow_spec(title: str, scope: StaticTenantScope) -> GuidedSpec:
    """A schema whose compile takes ~0.3 s here (1,500 optional properties; the audit's slowest)."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1500)},
              "additionalProperties": False, "title": title}
    return _owned(GuidedSpec(json_schema=json.dumps(schema)), scope)


ALICE = StaticTenantScope(namespace=b"ns-alice", tenant_key=b"alice")
BOB = StaticTenantScope(namespace=b"ns-bob", tenant_key=b"bob")


def test_another_tenants_compiled_schema_is_a_cache_miss(engine):
    """Audit (security 1): the compile cache was process-wide, so bob's request with the schema
    alice had just used compiled faster (25 vs 48 ms): a timing oracle for alice's schemas. Now
    the cache is per namespace: bob's request compiles the schema anew, alice's again is a hit."""
    spec = GuidedSpec(json_schema=json.dumps({**SCHEMA, "title": "alice's secret product codes"}))
    grammars = engine.runner.grammars
    before = grammars.compiles
    engine.prepare(req("alice-1", guided=spec, tenant=ALICE))  # admission: where the grammar is checked
    assert grammars.compiles == before + 1
    hits = grammars.cache_hits
    engine.prepare(req("bob-1", guided=spec, tenant=BOB))
    assert (grammars.compiles, grammars.cache_hits) == (before + 2, hits), "bob's check must not hit alice's compile"
    engine.prepare(req("alice-2", guided=spec, tenant=ALICE))
    assert (grammars.compiles, grammars.cache_hits) == (before + 2, hits + 1)


def test_one_tenant_runs_one_compile_at_a_time_and_leaves_a_worker_to_the_others(engine):
    """Audit (security 1, related): two shared compile workers, and a compile keeps running after
    its request's 5 s timeout, so one tenant's slow schemas could occupy both and every other
    tenant's schema would time out. Now a tenant runs one compile at a time (counted until it
    ends, timed out or not) and its others queue without a worker: bob's compile, asked after
    four of alice's, ends before alice's last one (before: alice's four took both workers and
    bob's waited behind them, finishing last)."""
    grammars = engine.runner.grammars
    alices = [grammars.submit(_slow_spec(f"a{i}", ALICE)) for i in range(4)]
    assert grammars.compiling(ALICE.tenant_key.hex()) == (1, 3)
    with pytest.raises(ValueError, match="did not compile within"):  # a timed-out request: still counted
        grammars.check(_slow_spec("a4", ALICE), timeout_s=0.001)
    assert grammars.compiling(ALICE.tenant_key.hex()) == (1, 4)
    grammars.check(_slow_spec("b", BOB))
    assert not alices[-1].done(), "bob's compile must not wait for alice's queue"
    running, _ = grammars.compiling(ALICE.tenant_key.hex())
    assert running == 1
    for fut in alices:
        fut.result(timeout=120)
    assert grammars.compiling(BOB.tenant_key.hex()) == (0, 0)


# ------------------------------------------------------------------ several items; dead ends

def _allowed(row, bitmask_size: int, ids: list[int]) -> set[int]:
    """The tokens among ``ids`` that ``row``'s mask allows next."""
    mask = torch.zeros(bitmask_size, dtype=torch.int32)
    row.fill(mask)
    return {t for t in ids if (int(mask[t // 32]) >> (t % 32)) & 1}


def test_several_items_end_after_any_complete_one_and_stop_at_max_items(engine):
    """``max_items`` > 1 (tool_choice required with parallel calls): EOS is allowed after every
    complete item, so nothing forces another, the separator comes only between items, and after
    ``max_items`` items only EOS is left (the grammar once allowed ``item+`` with a trailing
    newline: a model repeated one call until max_tokens)."""
    spec = GuidedSpec(json_schema=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                              "required": ["a"], "additionalProperties": False}),
                      prefix="<c>", suffix="</c>", max_items=3, separator="\n")
    grammars = engine.runner.grammars
    grammars.check(spec)
    eos = engine.runner.spec.eos_token_ids[0]
    tok = engine.runner.tokenizer
    newline, other = tok.encode("\n")[0], tok.encode("<c>")[0]
    words = bitmask_words(engine.vocab_size)
    row = grammars.matcher(spec)
    assert eos not in _allowed(row, words, [eos])  # nothing yet: at least one item
    out: list[int] = []
    for n in range(1, 4):
        out += tok.encode(('\n' if n > 1 else '') + '<c>{"a":' + str(n) + '}</c>')
        row.sync(out)
        allowed = _allowed(row, words, [eos, newline, other])
        assert eos in allowed, f"EOS after item {n}"
        assert other not in allowed, "the next item only after the separator"
        assert (newline in allowed) == (n < 3), f"a separator after item {n}"


RECURSIVE = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
             "$ref": "#/$defs/n"}


def test_a_schema_whose_forced_start_fails_is_refused_at_admission(engine):
    """Every value of RECURSIVE is ``{"c":{"c":...`` without end: the grammar forces it from the
    start, so it would dead-end in every request (it once ended as a normal "stop" after ``{"``)."""
    with pytest.raises(UnenforceableSchemaError, match="cannot be enforced.*refers back to its own object") as info:
        engine.add_request(req("rec", guided=GuidedSpec(json_schema=json.dumps(RECURSIVE))))
    assert info.value.status == 400 and "\n" not in str(info.value)
    assert not engine.has_unfinished()


def test_a_grammar_dead_end_while_decoding_is_an_error_not_a_stop(engine):
    """A schema whose start is free (an integer, or the endless object) compiles; once the model
    picks ``{`` (here +100 logit_bias) the grammar dead-ends and its mask allows only EOS. That
    EOS must not read as a normal stop with an incomplete value: the request ends with
    finish_reason "error" and OutputFailure.GRAMMAR_DEAD_END."""
    spec = GuidedSpec(json_schema=json.dumps({"$defs": RECURSIVE["$defs"],
                                              "anyOf": [{"type": "integer"}, {"$ref": "#/$defs/n"}]}))
    brace = engine.runner.tokenizer.encode("{")[0]
    engine.add_request(req("dead", guided=spec, max_tokens=32, logit_bias=((brace, 100.0),)))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    last = outs[-1]
    assert last.finished and last.finish_reason == "error" and last.failure is OutputFailure.GRAMMAR_DEAD_END
    assert "grammar cannot continue" in (last.error or "")
    assert last.completion_tokens < 32
    engine.check_integrity()
    ok = run(engine, req("after", guided=spec, max_tokens=16))["after"]  # the next request is unaffected
    assert ok["finish"] in ("stop", "length")


# ------------------------------------------------------------------ the compile cache is fair among tenants

class GatedCompiler(GrammarCompiler):
    """The engine's real compiler (llguidance, the tiny model's tokenizer) whose compiles wait for
    ``gate`` before building: which compiles are running, queued or finished is then the test's to
    say, never the clock's."""

    def __init__(self, engine: LLMEngine, cache_size: int) -> None:
        super().__init__(engine.runner.tokenizer, engine.vocab_size, engine.runner.spec.eos_token_ids[0],
                         cache_size=cache_size)
        self.gate = threading.Event()

    def _build(self, spec: GuidedSpec):
        assert self.gate.wait(timeout=60), "the test never opened the gate"
        return super()._build(spec)


@pytest.fixture
def gated(engine):
    """Makes ``GatedCompiler``s; opens their gates at the end, so a failed test leaves no worker waiting."""
    made: list[GatedCompiler] = []

    def make(cache_size: int) -> GatedCompiler:
        made.append(GatedCompiler(engine, cache_size))
        return made[-1]

    yield make
    for compiler in made:
        compiler.gate.set()


def _small_spec(title: str, scope: StaticTenantScope) -> GuidedSpec:
    """A distinct schema that compiles in milliseconds."""
    return _owned(GuidedSpec(json_schema=json.dumps({**SCHEMA, "title": title})), scope)


def test_a_tenants_flood_of_schemas_does_not_evict_another_tenants_compile(gated):
    """Audit (fairness): one LRU of 256 compiles served every tenant, so alice sending many distinct
    schemas pushed bob's compiled schema out and bob's next request paid its compile again (up to
    the 5 s bound). Now the cache evicts from the tenant holding the most: alice's flood evicts
    alice's own, and bob's schema is still a hit."""
    grammars = gated(cache_size=4)
    grammars.gate.set()
    bobs = _small_spec("bob's", BOB)
    grammars.check(bobs)
    for i in range(12):
        grammars.check(_small_spec(f"alice {i}", ALICE))
    compiles, hits = grammars.compiles, grammars.cache_hits
    grammars.check(bobs)
    assert (grammars.compiles, grammars.cache_hits) == (compiles, hits + 1), "bob's compile must still be cached"
    assert (grammars.cached(ALICE.tenant_key.hex()), grammars.cached(BOB.tenant_key.hex())) == (3, 1)
    grammars.check(_small_spec("alice 0", ALICE))  # alice's oldest went first: compiled again
    assert grammars.compiles == compiles + 1


def test_a_compile_a_request_holds_is_never_rebuilt_after_eviction(gated):
    """Audit: a compile the fair cache evicted between a request's admission and its first step was
    built again on the engine thread (no timeout, every tenant's step waiting). A request holds its
    compile (``Request.grammar``), and the compiler finds a held compile by spec; once nothing holds
    it the entry goes (weakly held: no release to miss)."""
    grammars = gated(cache_size=1)
    grammars.gate.set()
    first = _small_spec("alice 0", ALICE)
    held = grammars.admit(first)  # what LLMEngine.prepare_nowait keeps in Request.grammar
    held.result(timeout=60)
    grammars.check(_small_spec("alice 1", ALICE))  # one place: alice 0 is evicted
    assert grammars.cached(ALICE.tenant_key.hex()) == 1
    compiles = grammars.compiles
    grammars.matcher(first)
    assert grammars.compiles == compiles, "a held compile must not be built again"
    assert grammars.admit(first) is held and grammars.compiles == compiles  # another request shares it
    del held
    gc.collect()
    grammars.matcher(first)  # nothing holds it now: built again, on the caller's thread
    assert grammars.compiles == compiles + 1


def test_a_prepared_guided_request_holds_its_compile(engine):
    prepared = engine.prepare_nowait(GenerateRequest(
        request_id="held", tenant=ALICE, prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=4, guided=GuidedSpec(json_schema=json.dumps(SCHEMA)))))
    assert prepared.grammar is not None and prepared.request.grammar is prepared.grammar


def test_another_tenants_inserts_never_cancel_a_queued_compile(gated):
    """Audit (fairness): evicting the oldest entry cancelled it when it was a compile still queued
    behind its tenant's running one, so alice's new schemas made bob's waiting request fail ("the
    grammar's compile was dropped from the cache before it started"). Now only finished compiles
    are evicted: bob's queued compile runs and his request gets its grammar."""
    grammars = gated(cache_size=2)
    bob_running = grammars.submit(_small_spec("bob 0", BOB))
    bob_queued = _small_spec("bob 1", BOB)
    waiting = grammars.submit(bob_queued)
    alices = [grammars.submit(_small_spec(f"alice {i}", ALICE)) for i in range(3)]  # 5 compiles, room for 2
    assert grammars.compiling(BOB.tenant_key.hex()) == (1, 1)
    assert not waiting.cancelled()
    grammars.gate.set()
    for fut in (bob_running, waiting, *alices):
        fut.result(timeout=60)
    grammars.check(bob_queued)  # bob's request: its compile is there, not dropped
    grammars.matcher(bob_queued)
    # finished, each holds its fair share of the two places
    assert (grammars.cached(ALICE.tenant_key.hex()), grammars.cached(BOB.tenant_key.hex())) == (1, 1)


def test_a_tenants_compile_queue_is_bounded_and_the_engine_answers_429(engine, gated, monkeypatch):
    """Audit (fairness): a tenant's compiles beyond the one running waited in an unbounded queue,
    and a compile outlives its request's timeout: a tenant could pile up compiles that ran long
    after its requests had gone. Now a tenant has at most COMPILES_QUEUED_PER_TENANT waiting; a new
    schema beyond them is refused at once (the engine: a 429 to retry), one already queued is
    still shared, and other tenants are unaffected."""
    grammars = gated(cache_size=64)
    monkeypatch.setattr(engine.runner, "grammars", grammars)  # the engine's admission checks with it
    alice = ALICE.tenant_key.hex()
    alices = [grammars.submit(_small_spec(f"alice {i}", ALICE)) for i in range(1 + COMPILES_QUEUED_PER_TENANT)]
    assert grammars.compiling(alice) == (1, COMPILES_QUEUED_PER_TENANT)
    with pytest.raises(CompileQueueFullError, match="waiting to compile"):
        grammars.check(_small_spec("one more", ALICE))
    with pytest.raises(GrammarQueueFullError, match="waiting to compile") as info:
        engine.prepare(req("alice-over", tenant=ALICE, guided=GuidedSpec(json_schema=json.dumps(SCHEMA))))
    assert (info.value.status, info.value.code, info.value.retry_after_s) == (429, "grammar_queue_full", 1)
    assert grammars.compiling(alice) == (1, COMPILES_QUEUED_PER_TENANT), "nothing queued for a refusal"
    assert grammars.submit(_small_spec("alice 3", ALICE)) is alices[3]  # already queued: shared, not refused
    bobs = grammars.submit(_small_spec("bob's", BOB))
    assert grammars.compiling(BOB.tenant_key.hex()) == (1, 0)
    grammars.gate.set()
    for fut in (*alices, bobs):
        fut.result(timeout=60)
    grammars.check(_small_spec("one more", ALICE))  # the queue drained: accepted again


# ------------------------------------------------------------------ AsyncEngine: a held compile holds up nobody else

@pytest.fixture
def async_engine(tiny_model_dir, monkeypatch):
    """A serving ``AsyncEngine`` (the real composition root) whose grammars compile behind a gate."""
    eng = build_engine(EngineConfig(model_dir=tiny_model_dir, block_size=16, num_kv_blocks=64))
    grammars = GatedCompiler(eng.engine, cache_size=64)
    monkeypatch.setattr(eng.engine.runner, "grammars", grammars)  # admission checks with it
    monkeypatch.setattr(eng.engine.runner.sampler, "grammars", grammars)  # and the sampler copies its compiles
    try:
        yield eng, grammars
    finally:
        grammars.gate.set()
        eng.shutdown()


async def _collect(eng: AsyncEngine, request: GenerateRequest) -> tuple[list[int], str | None]:
    ids: list[int] = []
    finish = None
    async for out in eng.generate(request):
        ids += out.new_token_ids
        finish = out.finish_reason
    return ids, finish


async def _until_compiling(grammars: GrammarCompiler, scope: StaticTenantScope, expected: tuple[int, int]) -> None:
    while grammars.compiling(scope.tenant_key.hex()) != expected:
        await asyncio.sleep(0.005)


def test_a_tenants_held_compile_never_delays_another_tenants_request(async_engine):
    """Audit (isolation): ``AsyncEngine`` prepared requests on one thread, and a guided request's
    prepare waited there for its grammar's compile (up to the 5 s bound): bob's requests queued
    behind each of alice's slow schemas, his TTFT growing by up to 5 s per schema. Now the compile
    is awaited on the event loop: while alice's compile is held, bob's text request and his
    token-id request with logprobs (both go through the prepare thread) finish, and alice's request
    runs once its compile ends."""
    eng, grammars = async_engine
    alice = req("alice", tenant=ALICE, max_tokens=24, guided=GuidedSpec(json_schema=json.dumps(SCHEMA)))
    bob_text = req("bob-text", tenant=BOB, max_tokens=3)
    bob_ids = GenerateRequest("bob-ids", BOB, SamplingParams(max_tokens=3, temperature=0.0, logprobs=1),
                              prompt_token_ids=[5, 6, 7, 8])

    async def main():
        alice_task = asyncio.create_task(_collect(eng, alice))
        await asyncio.wait_for(_until_compiling(grammars, ALICE, (1, 0)), 30)  # held at the gate
        bobs = await asyncio.wait_for(asyncio.gather(_collect(eng, bob_text), _collect(eng, bob_ids)), 30)
        alice_waited = not alice_task.done() and grammars.compiling(ALICE.tenant_key.hex()) == (1, 0)
        grammars.gate.set()
        (alice_out,) = await asyncio.wait_for(asyncio.gather(alice_task, return_exceptions=True), 30)
        return bobs, alice_waited, alice_out

    bobs, alice_waited, alice_out = asyncio.run(main())
    assert [len(ids) for ids, _ in bobs] == [3, 3]
    assert alice_waited, f"bob's requests waited for alice's compile; alice got {alice_out!r}"
    alice_ids, alice_finish = alice_out
    assert alice_finish in ("stop", "length") and alice_ids


def test_awaited_compiles_keep_their_errors_and_are_never_cancelled(async_engine):
    """The compile awaited on the event loop answers as the prepare thread's wait did: past the
    bound a 400 ``unenforceable_schema`` with the same message, a full tenant queue a 429, a
    refused schema its 400; neither a timeout nor a client gone cancels the compile, which other
    requests share: it finishes, and the same schema is then a cache hit."""
    eng, grammars = async_engine
    eng.engine.grammar_timeout_s = 0.2
    spec = GuidedSpec(json_schema=json.dumps(SCHEMA))

    async def main():
        with pytest.raises(UnenforceableSchemaError, match=r"did not compile within 0\.2 s; simplify the schema") as late:
            await _collect(eng, req("late", tenant=ALICE, max_tokens=4, guided=spec))
        gone = asyncio.create_task(_collect(eng, req("gone", tenant=ALICE, max_tokens=4, guided=spec)))
        await asyncio.sleep(0.05)
        gone.cancel()  # the client went away while its grammar compiled
        for i in range(COMPILES_QUEUED_PER_TENANT):
            grammars.submit(_small_spec(f"alice {i}", ALICE))
        with pytest.raises(GrammarQueueFullError, match="waiting to compile") as full:
            await _collect(eng, req("full", tenant=ALICE, max_tokens=4,
                                    guided=GuidedSpec(json_schema=json.dumps({**SCHEMA, "title": "one more"}))))
        shared = grammars.submit(_owned(spec, ALICE))  # the compile "late" and "gone" waited on
        grammars.gate.set()
        ok = await asyncio.wait_for(_collect(eng, req("ok", tenant=ALICE, max_tokens=4, guided=spec)), 30)
        with pytest.raises(UnenforceableSchemaError, match="cannot be enforced") as bad:
            await _collect(eng, req("bad", tenant=BOB, guided=GuidedSpec(json_schema='{"type": "no such type"}')))
        return late.value, full.value, bad.value, gone.cancelled(), shared, ok

    late, full, bad, gone_cancelled, shared, (ok_ids, _) = asyncio.run(main())
    assert (late.status, late.code, bad.status, bad.code) == (400, "unenforceable_schema", 400, "unenforceable_schema")
    assert (full.status, full.code, full.retry_after_s) == (429, "grammar_queue_full", 1)
    assert gone_cancelled and ok_ids
    assert not shared.cancelled() and shared.exception() is None, "a waiter giving up cancelled the shared compile"
    assert grammars.submit(_owned(spec, ALICE)) is shared  # still the one compile, now cached


def test_a_split_nodes_lookup_never_holds_a_shared_thread_through_a_compile(async_engine):
    """Audit (isolation): a prefill/decode node's KV lookup prepared the request in the event
    loop's default executor, waiting there for a guided request's compile (up to 5 s): alice's
    slow schemas held those threads, which every tenant's lookups and KV sends share. Now the
    compile is awaited on the event loop: with the executor at one thread (a full pool), bob's
    lookup answers while alice's compile is held, and alice's once it ends."""
    eng, grammars = async_engine
    node = DisaggEngine(eng, eng.engine.runner, DisaggConfig(Role.PREFILL, node_token="t"),
                        TransferMetrics(CollectorRegistry()))
    alice = req("alice", tenant=ALICE, guided=GuidedSpec(json_schema=json.dumps(SCHEMA)))

    async def main():
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(1))
        alice_lookup = asyncio.create_task(node.lookup(alice))
        await asyncio.wait_for(_until_compiling(grammars, ALICE, (1, 0)), 30)
        bob = await asyncio.wait_for(node.lookup(req("bob", tenant=BOB)), 30)
        alice_waited = not alice_lookup.done()
        grammars.gate.set()
        (alice_out,) = await asyncio.wait_for(asyncio.gather(alice_lookup, return_exceptions=True), 30)
        return bob, alice_waited, alice_out

    bob, alice_waited, alice_out = asyncio.run(main())
    assert bob.prompt_tokens > 0
    assert alice_waited, f"bob's lookup waited for alice's compile; alice got {alice_out!r}"
    assert alice_out.prompt_tokens > 0
