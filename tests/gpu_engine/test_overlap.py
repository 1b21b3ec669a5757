"""CPU: overlapped steps (the host schedules step n+1 before reading step n's tokens) emit exactly
what synchronous steps emit, and the device-side token feed of the graph path picks the right inputs.

The runner here is the real ModelRunner on the CPU (reference ops); with overlap on, every decode
chunk after the first step of a request carries the placeholder and is fed the previous step's
pick on the device (checked through the launches' feed lists)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.batch import ScheduledBatch, SequenceChunk
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs, TokenFeed
from engine.llm_engine import LLMEngine
from engine.protocol import GenerateRequest, SamplingParams, StaticTenantScope
from engine.request import PLACEHOLDER_TOKEN
from tests.gpu_engine.helpers import GREEDY, prefill_then_decode_batch, small_runner


def _engine(runner, overlap: bool) -> LLMEngine:
    cfg = EngineConfig(model_dir=runner.config.model_dir, device=runner.config.device, dtype="float32", num_kv_blocks=64,
                       block_size=16, max_num_seqs=8, max_num_batched_tokens=64, overlap_steps=overlap)
    return LLMEngine(cfg, runner)


def _prompt(seed: int, n: int) -> list[int]:
    return [(13 * i + 29 * seed + 5) % 500 for i in range(n)]


def _drive(engine: LLMEngine, batches: list[list[GenerateRequest]]) -> dict[str, tuple]:
    """Add one list of requests per step (later lists arrive mid-flight), step to the end; ->
    per request (token ids, text, finish reason), as streamed."""
    got: dict[str, list] = {}
    pending = list(batches)
    while pending or engine.has_unfinished():
        if pending:
            for r in pending.pop(0):
                engine.add_request(r)
        for out in engine.step():
            ids, text, reason = got.setdefault(out.request_id, [[], "", None])
            assert PLACEHOLDER_TOKEN not in out.new_token_ids
            got[out.request_id] = [ids + list(out.new_token_ids), text + out.new_text, out.finish_reason]
            if out.finished:
                assert out.completion_tokens == len(got[out.request_id][0])
    engine.check_integrity()
    return {k: tuple(v) for k, v in got.items()}


def _requests(stop_token: int | None = None, stop_text: str | None = None) -> list[list[GenerateRequest]]:
    t = StaticTenantScope()
    g = SamplingParams(max_tokens=9, temperature=0.0)
    first = [GenerateRequest(f"a{i}", t, replace(g, max_tokens=6 + i), prompt_token_ids=_prompt(i, 20 + 7 * i))
             for i in range(3)]
    shared = _prompt(0, 20) + [7, 8, 9]  # a prefix hit on a0's first block
    second = [GenerateRequest("b0", t, replace(g, max_tokens=1), prompt_token_ids=shared),
              GenerateRequest("b1", t, SamplingParams(max_tokens=7, temperature=0.8, seed=11),
                              prompt_token_ids=_prompt(5, 33)),
              # penalties count the outputs on the device: fed steps must count the fed token
              GenerateRequest("b2", t, replace(g, max_tokens=10, presence_penalty=-2.0, frequency_penalty=1.5),
                              prompt_token_ids=_prompt(6, 25))]
    third = [GenerateRequest("c0", t, replace(g, max_tokens=12, stop_token_ids=(stop_token,) if stop_token else ()),
                             prompt_token_ids=_prompt(2, 34)),  # a2's prompt: a full prefix hit
             GenerateRequest("c1", t, replace(g, max_tokens=12, stop=(stop_text,) if stop_text else ()),
                             prompt_token_ids=_prompt(0, 20))]  # a0's
    return [first, [], second, [], [], third]


def test_overlapped_steps_emit_what_synchronous_steps_emit(tmp_path):
    check_overlap_equals_sync(small_runner(tmp_path, "cpu"))


def check_overlap_equals_sync(runner) -> None:
    """(Also run on the GPU by tests/gpu_engine/test_gpu.py: graphs, device-side feed.)"""
    sync = _drive(_engine(runner, overlap=False), _requests())
    # stop c0 on a token and c1 on a token's text, each first seen mid-stream: the lag must not
    # let the next token out
    def first_new(ids):
        return next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])

    i0, i1 = first_new(sync["c0"][0]), first_new(sync["c1"][0])
    stop_token = sync["c0"][0][i0]
    stop_text = runner.tokenizer.decode([sync["c1"][0][i1]])
    sync = _drive(_engine(runner, overlap=False), _requests(stop_token, stop_text))
    assert len(sync["c0"][0]) == i0 + 1 and sync["c0"][2] == "stop"
    assert sync["c1"][2] == "stop" and len(sync["c1"][0]) == i1 + 1

    engine = _engine(runner, overlap=True)
    feeds: list[int] = []
    launch = runner.launch

    def spy(batch, feed=(), after=None):
        feeds.append(len(feed))
        return launch(batch, feed, after)

    runner.launch = spy  # type: ignore[method-assign]
    try:
        overlapped = _drive(engine, _requests(stop_token, stop_text))
    finally:
        del runner.launch
    assert overlapped == sync
    assert engine.overlap_steps and sum(feeds) > 20  # most decode chunks were fed on the device
    assert not engine.has_unfinished()


def test_abort_with_a_step_in_flight_leaves_it_harmless(tmp_path):
    runner = small_runner(tmp_path, "cpu")
    engine = _engine(runner, overlap=True)
    engine.add_request(GenerateRequest("x", StaticTenantScope(), SamplingParams(max_tokens=20, temperature=0.0),
                                       prompt_token_ids=_prompt(3, 30)))
    seen: list[int] = []
    for _ in range(4):
        for out in engine.step():
            seen.extend(out.new_token_ids)
    final = engine.abort("x")
    assert final is not None and final.finished and final.finish_reason == "abort"
    assert PLACEHOLDER_TOKEN not in final.new_token_ids
    assert final.completion_tokens == len(seen) + len(final.new_token_ids) >= 2
    assert not engine.has_unfinished()
    engine.step()  # collects the orphaned step; nothing comes out
    engine.check_integrity()
    assert engine.cache.num_used == 0


def test_overlap_needs_a_launching_runner(tmp_path):
    from tests.engine_core.engine_core_fakes import FakeRunner

    cfg = EngineConfig(model_dir=tmp_path, num_kv_blocks=64, block_size=16, overlap_steps=True)
    with pytest.raises(ValueError, match="launch"):
        LLMEngine(cfg, FakeRunner(block_size=16))
    assert not LLMEngine(replace(cfg, overlap_steps=None), FakeRunner(block_size=16)).overlap_steps


def test_graph_inputs_fed_on_the_device_equal_host_tokens(tmp_path):
    """The static-buffer path (the captured graph's code, run eagerly on the CPU) with two of
    three rows fed from a 'previous step' tensor gives the logits of the same tokens given on the host."""
    runner = small_runner(tmp_path, "cpu")
    batch = prefill_then_decode_batch(runner)
    snapshot = runner.kv_cache.clone()
    graphs = DecodeGraphs(runner.model, runner.layer_caches, runner.ops, runner.block_size,
                          max_blocks_per_seq=16, sizes=(1, 2, 4), device=torch.device("cpu"))
    want = graphs.run(batch.chunks).clone()
    runner.kv_cache.copy_(snapshot)
    chunks = list(batch.chunks)
    prev = torch.tensor([99, chunks[2].token_ids[0], 5, chunks[0].token_ids[0]])  # picks of some earlier step
    fed = [replace(chunks[0], token_ids=(PLACEHOLDER_TOKEN,)), chunks[1],
           replace(chunks[2], token_ids=(PLACEHOLDER_TOKEN,))]
    got = graphs.run(fed, TokenFeed(prev, dst_rows=(0, 2), src_rows=(3, 1)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the next step without a feed reads the host tokens again (token_src back to the host rows)
    runner.kv_cache.copy_(snapshot)
    again = graphs.run(batch.chunks)
    torch.testing.assert_close(again, want, rtol=1e-5, atol=1e-5)


def test_runner_launch_feeds_eager_steps(tmp_path):
    """The eager path (mixed or large steps): a fed chunk computes the token the previous step picked."""
    runner = small_runner(tmp_path, "cpu")
    prompts = [_prompt(1, 21), _prompt(2, 9)]
    first = ScheduledBatch([SequenceChunk(f"s{i}", p, 0, [4 * i, 4 * i + 1, 4 * i + 2], True, GREEDY)
                            for i, p in enumerate(prompts)])
    launched = runner.launch(first)
    picks = runner.collect(launched).sampled_token_ids
    snapshot = runner.kv_cache.clone()
    known = ScheduledBatch([SequenceChunk(f"s{i}", [picks[i]], len(p), [4 * i, 4 * i + 1, 4 * i + 2], True, GREEDY)
                            for i, p in enumerate(prompts)])
    want = runner.forward(known, all_logits=True)
    runner.kv_cache.copy_(snapshot)
    fed = ScheduledBatch([replace(c, token_ids=(PLACEHOLDER_TOKEN,)) for c in known.chunks]
                         + [SequenceChunk("new", _prompt(3, 5), 0, [20], True, GREEDY)])  # mixed: eager
    nxt = runner.launch(fed, feed=[(1, 1), (0, 0)], after=launched)
    got = runner.collect(nxt).sampled_token_ids
    assert got[:2] == [int(t) for t in want.argmax(-1)]
