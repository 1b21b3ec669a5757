"""The step loop with the deterministic fake runner: outputs, stopping, abort, errors, accounting."""

from array import array

import pytest
from engine_core_fakes import EOS, FakeRunner, reference_generate, scope
from prometheus_client import CollectorRegistry, generate_latest

from engine.config import EngineConfig
from engine.kv_types import CacheObserver, LowerTier
from engine.llm_engine import LLMEngine
from engine.metrics import CacheTimer, EngineMetrics
from engine.protocol import (
    GenerateRequest,
    InvalidRequestError,
    PromptTooLongError,
    SamplingParams,
    StaticTenantScope,
)

BS = 8


def make_engine(num_blocks=64, budget=64, max_num_seqs=8, caching=True, runner=None, registry=None, **kw):
    runner = runner or FakeRunner(num_kv_blocks=num_blocks, block_size=BS, **kw)
    config = EngineConfig(
        model_dir="fake", block_size=BS, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
        enable_prefix_caching=caching,
    )
    return LLMEngine(config, runner, EngineMetrics(registry)), runner


def greq(rid, prompt, max_tokens=8, tenant=None, **sp):
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sp)
    if isinstance(prompt, str):
        return GenerateRequest(rid, tenant or scope(), sampling, prompt=prompt)
    return GenerateRequest(rid, tenant or scope(), sampling, prompt_token_ids=list(prompt))


def run_all(engine, max_steps=1000):
    results: dict[str, dict] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            r = results.setdefault(out.request_id, {"ids": [], "text": "", "outs": []})
            r["ids"] += out.new_token_ids
            r["text"] += out.new_text
            r["outs"].append(out)
        engine.check_integrity()
    assert not engine.has_unfinished()
    return results


def prompt(seed: int, n: int) -> list[int]:
    return [97 + (seed * 7 + i * 3) % 26 for i in range(n)]


def test_batched_chunked_outputs_equal_the_reference():
    engine, runner = make_engine(budget=16)
    prompts = {f"r{i}": prompt(i, 10 + 9 * i) for i in range(5)}
    for rid, p in prompts.items():
        engine.add_request(greq(rid, p, max_tokens=12))
    res = run_all(engine)
    for rid, p in prompts.items():
        assert res[rid]["ids"] == reference_generate(p, 12)
        assert res[rid]["outs"][-1].finish_reason == "length"
    assert any(len(b.chunks) > 1 for b in runner.batches)  # really batched
    assert max(b.num_tokens for b in runner.batches) <= 16  # chunked under the budget
    assert engine.cache.num_used == 0 and sorted(runner.released) == sorted(prompts)


def test_prefix_hit_serves_the_same_tokens_and_reports_cached_tokens():
    engine, _ = make_engine()
    system = prompt(1, 40)
    cold = run_all_single(engine, "cold", system + [100, 101])
    warm = run_all_single(engine, "warm", system + [100, 101])
    other = run_all_single(engine, "other", system + [100, 101], tenant=scope("other-tenant"))
    expected = reference_generate(system + [100, 101], 8)
    assert cold["ids"] == warm["ids"] == other["ids"] == expected
    assert cold["outs"][-1].cached_tokens == 0
    assert warm["outs"][-1].cached_tokens == 40  # 5 full blocks of the 42-token prompt
    assert other["outs"][-1].cached_tokens == 0  # another namespace never hits
    stats = engine.stats()
    assert stats["prompt_tokens_hit"] == 40 and stats["prompt_tokens_queried"] == 126


def run_all_single(engine, rid, p, tenant=None, **kw):
    engine.add_request(greq(rid, p, tenant=tenant, **kw))
    return run_all(engine)[rid]


def test_prefix_caching_disabled_never_matches():
    engine, _ = make_engine(caching=False)
    p = prompt(2, 40)
    run_all_single(engine, "a", p)
    b = run_all_single(engine, "b", p)
    assert b["outs"][-1].cached_tokens == 0 and engine.cache.num_indexed == 0


def test_outputs_survive_forced_preemption_with_few_blocks():
    engine, _ = make_engine(num_blocks=8, budget=64)
    prompts = {f"r{i}": prompt(i, 20) for i in range(4)}  # 3 blocks each + decode growth
    for rid, p in prompts.items():
        engine.add_request(greq(rid, p, max_tokens=20))
    res = run_all(engine)
    assert engine.scheduler.num_preemptions > 0
    for rid, p in prompts.items():
        assert res[rid]["ids"] == reference_generate(p, 20)


def test_stop_string_text_is_cut_and_never_streamed():
    p = prompt(3, 12)
    full = bytes(reference_generate(p, 30)).decode()
    stop = full[10:13]
    engine, _ = make_engine()
    res = run_all_single(engine, "s", p, max_tokens=30, stop=(stop,))
    cut = full.index(stop)
    assert res["text"] == full[:cut]
    assert res["outs"][-1].finish_reason == "stop"
    assert all(stop not in o.new_text for o in res["outs"])


def test_the_stop_string_that_ended_the_output_is_reported():
    p = prompt(3, 12)
    full = bytes(reference_generate(p, 30)).decode()
    first, later = full[10:13], full[20:23]
    assert full.index(first) < full.index(later)
    engine, _ = make_engine()
    res = run_all_single(engine, "which", p, max_tokens=30, stop=(later, first))
    assert res["text"] == full[:full.index(first)]
    assert res["outs"][-1].stop_sequence == first  # the earliest hit, not the first listed
    assert all(o.stop_sequence is None for o in res["outs"][:-1])
    plain = run_all_single(engine, "len", p, max_tokens=4)
    assert plain["outs"][-1].finish_reason == "length" and plain["outs"][-1].stop_sequence is None


def test_an_empty_stop_string_is_refused_by_the_sampling_params():
    with pytest.raises(ValueError, match="must not be empty"):
        SamplingParams(stop=("",))


def test_stop_token_ids_eos_and_ignore_eos():
    eos_after = {5}

    def fn(ctx):  # emits EOS as the 6th generated token
        return EOS if len(ctx) - 12 in eos_after else 98

    p = prompt(4, 12)
    engine, _ = make_engine(fn=fn)
    r = run_all_single(engine, "eos", p, max_tokens=20)
    assert r["ids"] == [98] * 5 + [EOS] and r["text"] == "b" * 5
    assert r["outs"][-1].finish_reason == "stop"
    r = run_all_single(engine, "ign", p, max_tokens=8, ignore_eos=True)
    assert r["ids"] == [98] * 5 + [EOS, 98, 98] and r["outs"][-1].finish_reason == "length"
    r = run_all_single(engine, "stopid", p, max_tokens=8, stop_token_ids=(98,))
    assert r["ids"] == [98] and r["text"] == "" and r["outs"][-1].finish_reason == "stop"


def test_incremental_detokenization_waits_for_multibyte_characters():
    text = "héllo wörld ✓"
    data = list(text.encode())
    engine, _ = make_engine(fn=lambda ctx: data[len(ctx) - 9] if len(ctx) - 9 < len(data) else 33)
    r = run_all_single(engine, "utf8", prompt(5, 9), max_tokens=len(data))
    assert r["text"] == text
    assert all("\ufffd" not in o.new_text for o in r["outs"])


def test_abort_frees_blocks_and_returns_a_final_output():
    engine, runner = make_engine()
    engine.add_request(greq("a", prompt(6, 30), max_tokens=50))
    engine.step()
    engine.step()
    assert engine.cache.num_used > 0
    out = engine.abort("a")
    assert out.finished and out.finish_reason == "abort" and out.completion_tokens == 2
    assert engine.cache.num_used == 0 and "a" in runner.released
    assert engine.cache.num_evictable == 3  # its full prompt blocks stay indexed for reuse
    assert engine.abort("a") is None and engine.abort("nope") is None
    engine.check_integrity()


def test_a_failing_request_does_not_take_the_others_down():
    engine, runner = make_engine()
    runner.fail_request_ids.add("bad")
    engine.add_request(greq("good", prompt(7, 10)))
    engine.add_request(greq("bad", prompt(8, 10)))
    res = run_all(engine)
    assert res["bad"]["outs"][-1].finish_reason == "error"
    assert "injected failure" in res["bad"]["outs"][-1].error
    assert res["good"]["ids"] == reference_generate(prompt(7, 10), 8)
    assert engine.cache.num_used == 0


def test_rejects_prompts_that_do_not_fit():
    engine, _ = make_engine(num_blocks=64, max_model_len=100)
    with pytest.raises(PromptTooLongError, match="maximum context length is 100"):
        engine.add_request(greq("long", prompt(1, 95), max_tokens=10))
    small, _ = make_engine(num_blocks=4)  # 4 blocks x 8 tokens: the advertised context shrinks to fit
    assert small.max_model_len == 32
    with pytest.raises(PromptTooLongError, match="maximum context length is 32"):
        small.add_request(greq("big", prompt(1, 40)))
    with pytest.raises(PromptTooLongError, match="quota"):
        engine.add_request(greq("q", prompt(1, 40), tenant=scope("q", kv_block_quota=2)))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request(greq("v", [5, 300]))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request(greq("e", ""))
    assert not engine.has_unfinished()


def test_chat_messages_use_the_runners_template_and_text_prompts_the_tokenizer():
    engine, runner = make_engine()
    msgs = [{"role": "user", "content": "hi"}]
    r = engine.add_request(GenerateRequest("m", scope(), SamplingParams(max_tokens=2), messages=msgs))
    assert r.prompt_token_ids == runner.render_prompt(msgs)
    r = engine.add_request(greq("p", "abc"))
    assert r.prompt_token_ids == [97, 98, 99]


def test_timings_and_metrics_exposition():
    registry = CollectorRegistry()
    engine, _ = make_engine(registry=registry)
    res = run_all_single(engine, "t", prompt(9, 20), max_tokens=5)
    outs = res["outs"]
    assert outs[0].ttft_s is not None and outs[0].ttft_s >= 0
    assert outs[-1].queue_time_s is not None and outs[-1].queue_time_s <= outs[-1].ttft_s
    times = [t for o in outs for t in o.token_times_s]
    assert len(times) == 5 and times == sorted(times)
    text = generate_latest(registry).decode()
    assert 'prefixgate_prompt_tokens_queried_total{tenant="t"} 20.0' in text
    assert 'prefixgate_ttft_seconds_count{tenant="t"} 1.0' in text
    assert "prefixgate_kv_bytes_per_token 128.0" in text
    assert 'prefixgate_requests_finished_total{finish_reason="length",tenant="t"} 1.0' in text
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_total"] == 64 and stats["waiting"] == 0


def test_fragmentation_counts_unused_slots_of_allocated_blocks():
    engine, _ = make_engine(budget=64)
    engine.add_request(greq("f", prompt(1, 10), max_tokens=30))
    engine.step()  # 10 prompt tokens + 1 sampled = 11 tokens in 2 blocks (16 slots)
    assert engine.fragmentation() == pytest.approx(5 / 16)


class RecordingLowerTier:
    """A ``LowerTier`` that keeps nothing: it records what the cache manager spills."""

    def __init__(self) -> None:
        self.spilled: list = []
        self.flushes = 0

    def spill(self, tenant, block) -> None:
        self.spilled.append((tenant.namespace, block))

    def flush_spills(self, *, due_only: bool = False) -> None:
        self.flushes += 1

    def lookup(self, namespace, hashes) -> int:
        return 0

    def start_restore(self, request_id, tenant, hashes, block_ids) -> None:
        raise AssertionError("lookup found nothing, so nothing is restored")

    def finished_restores(self, timeout_s=0.0) -> list:
        return []

    def cancel_restore(self, request_id) -> None:
        raise AssertionError("no restore was started")

    def blocks_of(self, namespace) -> dict:
        return {}

    def stats(self) -> dict:
        return {"spilled": len(self.spilled)}

    def blocks_by_tenant(self) -> dict:
        return {}

    def blocks_held(self, tenant_key) -> dict:
        return {}

    def close(self) -> None:
        pass


def test_preemption_eviction_and_queue_metrics_and_lower_tier():
    lower = RecordingLowerTier()
    assert isinstance(lower, LowerTier) and isinstance(CacheTimer(), CacheObserver)
    registry = CollectorRegistry()
    runner = FakeRunner(num_kv_blocks=8, block_size=BS)
    config = EngineConfig(model_dir="fake", block_size=BS, max_num_batched_tokens=64, max_num_seqs=2)
    engine = LLMEngine(config, runner, EngineMetrics(registry), lower_tier=lower)
    ps = {f"r{i}": prompt(i, 20) for i in range(4)}
    for rid, p in ps.items():
        engine.add_request(greq(rid, p, max_tokens=20))
    first = {o.request_id: list(o.new_token_ids) for o in engine.step()}
    text = generate_latest(registry).decode()
    assert 'prefixgate_waiting_requests{reason="batch_full"} 2.0' in text
    res = run_all(engine)
    for rid, p in ps.items():
        assert first.get(rid, []) + res[rid]["ids"] == reference_generate(p, 20)
    text = generate_latest(registry).decode()
    preemptions = engine.scheduler.num_preemptions
    assert preemptions > 0 and f"prefixgate_preemptions_total {float(preemptions)}" in text
    evicted = [b for _, b in lower.spilled]
    assert evicted and f'prefixgate_kv_evictions_total{{tier="hbm"}} {float(len(evicted))}' in text
    assert {b.namespace for b in evicted} == {b"t"} and all(b.depth >= 0 for b in evicted)
    assert {ns for ns, _ in lower.spilled} == {b"t"} and lower.flushes > 0  # the tenant came along
    assert engine.stats()["kv_tiers"]["spilled"] == len(evicted)


def test_int_list_converts_like_int_for_every_input_kind():
    """The C fast path (array('q')) must give exactly [int(t) for t in values], falling back for
    values it cannot take (strings, floats, ints past int64)."""
    import numpy as np

    from engine.llm_engine import _int_list_packed

    for values in ([1, 2, 3], (True, 0, 5), np.array([4, 5], dtype=np.int64), ["7", 8.0, 9],
                   [2**70, 1], [np.int32(3), 4], [], [-1, 2**63 - 1]):
        got = _int_list_packed(values)[0]
        assert got == [int(t) for t in values]
        assert all(type(t) is int for t in got)


def test_int_list_packed_gives_the_ids_bytes_or_none():
    from engine.llm_engine import _int_list_packed

    ids, packed = _int_list_packed([3, 1, 2**40])
    assert ids == [3, 1, 2**40] and packed == array("q", ids).tobytes()
    assert _int_list_packed(["7", 8])[1] is None  # int() took them: nothing packed


def test_a_request_hashes_its_packed_prompt_like_its_ids():
    """The engine hands the prompt's packed bytes to Request; the block hashes are the ones of the
    ids (the prefix cache's keys must not depend on how a prompt arrived), growth still extends them,
    and bytes that do not match the prompt's length are refused."""
    from engine.request import Request

    ids = list(range(1000, 1045))  # 2 full blocks of 16 and a partial one
    kw = {"request_id": "r", "tenant": StaticTenantScope(b"t"), "sampling": SamplingParams(max_tokens=4),
          "block_size": 16}
    plain = Request(prompt_token_ids=list(ids), **kw)
    packed = Request(prompt_token_ids=list(ids), packed_prompt=array("q", ids).tobytes(), **kw)
    assert len(plain.block_hashes) == 2 and packed.block_hashes == plain.block_hashes
    for r in (plain, packed):
        for t in (1, 2, 3):
            r.append_output_token(t, 0.0)
    assert len(plain.block_hashes) == 3 and packed.block_hashes == plain.block_hashes
    with pytest.raises(ValueError, match="packed_prompt"):
        Request(prompt_token_ids=list(ids), packed_prompt=array("q", ids[:-1]).tobytes(), **kw)
    engine, _ = make_engine()
    req = engine.prepare(GenerateRequest("g", StaticTenantScope(b"t"), SamplingParams(max_tokens=4),
                                         prompt_token_ids=[i % 256 for i in ids]))
    want = Request(prompt_token_ids=[i % 256 for i in ids], **{**kw, "block_size": BS}).block_hashes
    assert len(want) == 45 // BS and req.block_hashes == want


def test_the_vocabulary_check_names_the_first_id_outside_it():
    engine, _ = make_engine()  # vocabulary [0, 256)
    for ids, bad in (([5, 300, -1], "300"), ([5, -1, 300], "-1"), ([256], "256"), ([0, 255, 2**70], str(2**70))):
        with pytest.raises(InvalidRequestError, match=rf"token id {bad} is outside the vocabulary \[0, 256\)"):
            engine.add_request(greq("v", ids))
    assert engine.add_request(greq("ok", [0, 255])).num_prompt_tokens == 2


def test_the_vocabulary_check_is_the_same_on_and_off_the_packed_path():
    """Ids packed as int64 are checked by numpy's min/max, the rest by the list walk: both name
    the same first bad id, long prompts and the int64 edges included, and pass the same prompts."""
    from engine.llm_engine import _first_outside, _int_list_packed

    engine, _ = make_engine(num_blocks=128)  # vocabulary [0, 256); room for a 600-token prompt
    long_ok = [i % 256 for i in range(600)]
    cases = (
        (long_ok[:599] + [256], "256"),  # the bad id last in a long prompt
        (long_ok[:300] + [-7] + long_ok[:299], "-7"),
        (long_ok + [300, -1], "300"),  # the first of two bad ids, either side of the range
        ([1, -(2**63)], str(-(2**63))),  # int64's edges: packed, still outside
        ([1, 2**63 - 1], str(2**63 - 1)),
        ([1, 2**63, -1], str(2**63)),  # past int64: not packed, the list walk finds it
        ([1, -(2**64)], str(-(2**64))),
        (["1", "300"], "300"),  # strings go through int(): not packed either
        ([1.0, 256.0], "256"),
    )
    for ids, bad in cases:
        with pytest.raises(InvalidRequestError, match=rf"token id {bad} is outside the vocabulary \[0, 256\)"):
            engine.add_request(greq("v", ids))
        conv, packed = _int_list_packed(ids)
        assert str(_first_outside(conv, packed, 256)) == bad == str(_first_outside(conv, None, 256))
    for ids in (long_ok, [0], [255] * 40, ["3", 4.0]):
        conv, packed = _int_list_packed(ids)
        assert _first_outside(conv, packed, 256) is None is _first_outside(conv, None, 256)
    assert engine.add_request(greq("ok-long", long_ok)).num_prompt_tokens == 600


class _BatchDecodingTokenizer:
    """Decodes to a list of strings, as ``transformers`` annotates ``decode`` for batched input."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids, skip_special_tokens: bool = False) -> list[str]:
        return [bytes(token_ids).decode("utf-8", errors="replace")]


def test_a_tokenizer_decoding_to_a_list_fails_that_request_not_the_engine():
    """The engine decodes one flat id list and holds the tokenizer to the one string that gives: a list
    fails the request with a clear error (never text built from a list's repr), and the next runs."""
    from engine.tokenizer_pool import TokenizerPool

    engine, runner = make_engine()
    runner.tokenizers = TokenizerPool(_BatchDecodingTokenizer())
    engine.add_request(greq("bad", prompt(1, 12), max_tokens=3))
    results = run_all(engine)
    last = results["bad"]["outs"][-1]
    assert last.finished and last.error is not None and "decoded one id list to list" in last.error
    assert results["bad"]["text"] == ""
    runner.tokenizers = TokenizerPool(runner.tokenizer)
    engine.add_request(greq("good", prompt(2, 12), max_tokens=3))
    assert run_all(engine)["good"]["outs"][-1].error is None
