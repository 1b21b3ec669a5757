"""engine/kernel_warmup.py: the eager steps a GPU runner runs at start so that Triton compiles the eager
path's kernels before a request waits for them. The shapes and their selection on the CPU; on a GPU, that
a runner built with the warm-up compiles nothing at its first eager steps of several sequences (a short
suffix over a long prefix beside decoding rows), and one built without it does; likewise for the first
uses of request features (penalties, block moves, the most-split merge), each arm in a fresh process."""

from __future__ import annotations

import json

import pytest
import torch

from engine.batch import ScheduledBatch, SequenceChunk
from engine.config import EngineConfig
from engine.kernel_warmup import WarmupStep, candidates, distinct_steps, warmup_batch
from engine.model_runner import ModelRunner
from engine.models.random_init import build_random_model, llama_config_dict
from engine.models.spec import parse_checkpoint_config
from tests.gpu_engine.helpers import GREEDY, SHAPE, IdTokenizer, small_runner


def test_candidates_stay_within_the_runners_limits():
    steps = list(candidates(token_budget=512, max_seqs=8, max_context=4096))
    assert steps and len(steps) == len(set(steps))
    for s in steps:
        assert 1 <= s.num_seqs <= min(8, s.num_tokens) and s.num_tokens <= 512
        assert s.first_chunk_tokens <= s.context <= 4096
    # the budget itself, the largest sequence count and the longest context are among them
    assert {s.num_tokens for s in steps} >= {1, 64, 65, 512}
    assert max(s.num_seqs for s in steps) == 8 and max(s.context for s in steps) == 4096
    # a budget off the list is taken as it is
    assert max(s.num_tokens for s in candidates(300, 4, 2048)) == 300


def test_distinct_steps_keep_the_first_eager_step_of_each_launch():
    steps = [WarmupStep(64, 1, 64), WarmupStep(64, 2, 4096), WarmupStep(65, 2, 4096), WarmupStep(128, 2, 4096),
             WarmupStep(2, 2, 4096)]
    kept = distinct_steps(iter(steps), eager=lambda s: s.num_seqs > 1,
                          launch_key=lambda s: ("tiles", 64 if s.num_tokens <= 64 else 128))
    assert kept == [WarmupStep(64, 2, 4096), WarmupStep(65, 2, 4096)]


def test_row_classes_part_where_kernels_compile_anew():
    from engine.kernel_warmup import row_class

    assert row_class(1) == (True, False, 16)
    assert row_class(7) == row_class(15) != row_class(16)  # dividing by 16 is a specialisation of its own
    assert row_class(17) != row_class(15) and row_class(33) != row_class(31)  # the row tile grows at 16 / 32
    assert row_class(100) == row_class(1000) and row_class(128) == row_class(4096)


def test_the_feature_warm_up_step_runs_eagerly_with_every_sampling_feature():
    from engine.kernel_warmup import feature_batch

    batch = feature_batch("p")
    # several sequences, one prefilling: neither a decode graph (its replays are served-step statistics)
    # nor a one-sequence prefill graph takes it
    assert len(batch.chunks) == 2 and not batch.is_decode_only
    scored, sampled = batch.chunks
    for c in batch.chunks:
        s = c.sampling
        assert c.sample and c.prompt_token_ids and s.logprobs
        assert s.repetition_penalty != 1 and s.frequency_penalty and s.presence_penalty
    assert scored.prompt_targets and scored.sampling.prompt_logprobs and scored.sampling.temperature == 0
    s = sampled.sampling
    assert s.temperature > 0 and s.top_p < 1 and s.top_k and s.min_p and s.seed is not None and s.logit_bias


def test_warmup_batch_shapes_the_step():
    batch = warmup_batch(WarmupStep(num_tokens=20, num_seqs=3, context=100), block_size=16, tag="w")
    assert [c.num_tokens for c in batch.chunks] == [18, 1, 1]
    assert [c.start_pos for c in batch.chunks] == [82, 99, 99]
    assert all(len(c.block_table) == 7 and c.sample for c in batch.chunks)
    assert len({c.request_id for c in batch.chunks}) == 3
    assert not batch.is_decode_only  # the first chunk prefills
    assert warmup_batch(WarmupStep(4, 4, 100), 16, "d").is_decode_only  # what a decode graph runs


def test_a_cpu_runner_does_not_warm_up_but_the_steps_run_there(tmp_path):
    runner = small_runner(tmp_path, "cpu")
    assert runner.kernel_warmup_steps == 0  # nothing to compile on a CPU
    ran = runner._warm_up_eager_kernels()  # the same steps, through the CPU's eager path
    assert ran >= 2
    # a served step afterwards is unaffected: the warm-up's sequences left no sampler state behind
    out = runner.execute(ScheduledBatch([SequenceChunk("after", [1, 2, 3], 0, [5], True, GREEDY)]))
    assert out.sampled_token_ids[0] is not None


def _penalised_tokens(runner: ModelRunner) -> list[int]:
    from engine.kernel_warmup import PENALISED_SAMPLING

    prompt = [7, 7, 9, 7, 11, 7]
    out = runner.execute(ScheduledBatch([SequenceChunk("p", prompt, 0, [20], True, PENALISED_SAMPLING,
                                                       prompt_token_ids=prompt)])).sampled_token_ids
    first = out[0]
    nxt = runner.execute(ScheduledBatch([SequenceChunk("p", [first], len(prompt), [20], True, PENALISED_SAMPLING,
                                                       output_token_ids=[first], prompt_token_ids=prompt)]))
    return [first, nxt.sampled_token_ids[0]]


def test_the_feature_warm_up_runs_on_a_cpu_runner_and_leaves_no_state(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    warmed, fresh = small_runner(tmp_path / "a", "cpu"), small_runner(tmp_path / "b", "cpu")
    warmed._warm_up_feature_kernels()  # a penalised step, a copy-on-write, an export and import
    # a penalised request afterwards picks as on a runner that never warmed up: the warm-up's
    # penalty counts were released with its request, and it touched only its own blocks
    assert _penalised_tokens(warmed) == _penalised_tokens(fresh)


def _mixed_steps() -> list[ScheduledBatch]:
    """A short suffix over a long prefix beside decoding rows, as a decode node steps after a KV
    import: several sequences, so the eager path (and its split prefill)."""
    table = list(range(256))  # 4,096 tokens of context
    return [ScheduledBatch([SequenceChunk("suffix", [3] * n, 4096 - n, table, True, GREEDY),
                            SequenceChunk("row-a", [4], 4095, table, True, GREEDY),
                            SequenceChunk("row-b", [5], 2000, table[:126], True, GREEDY)])
            for n in (5, 40)]


def _runner(tmp_path, heads: int, kv_heads: int, warm: bool) -> ModelRunner:
    # head counts no other test uses: their kernels' constexprs (GROUP) are this test's own, so a
    # compile another test made in this process cannot stand in for the warm-up
    # head dim 64: on Hopper the prefill graphs then take the Gluon kernels, leaving the Triton split
    # prefill to the eager path, as for the 8B-shaped model (session 40's decode node)
    dims = {**SHAPE, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 64,
            "hidden_size": heads * 64, "intermediate_size": 512, "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(llama_config_dict(**dims)), encoding="utf-8")
    arch = parse_checkpoint_config(tmp_path)
    model = build_random_model(arch, "cuda", torch.bfloat16, seed=0, std=0.05)
    cfg = EngineConfig(model_dir=tmp_path, device="cuda", dtype="bfloat16", num_kv_blocks=300, block_size=16,
                       max_num_seqs=8, warm_up_kernels=warm)
    return ModelRunner(cfg, arch=arch, tokenizer=IdTokenizer(), model=model)


@pytest.mark.gpu
@pytest.mark.parametrize("warm", [True, False], ids=["warmed", "cold"])
def test_a_warmed_runner_compiles_nothing_at_its_first_mixed_steps(tmp_path, warm):
    from tests.kernels.kernel_cases import gpu_ready

    if not gpu_ready():
        pytest.skip("needs CUDA and compiled Triton")
    from prefixgate_kernels.jit_watch import CompileRecorder
    from prefixgate_kernels.prefill_attention import gluon_runs_on

    if not warm and not gluon_runs_on(torch.device("cuda")):
        pytest.skip("the control needs the Hopper prefill graphs, which leave the Triton split prefill to the "
                    "eager path (elsewhere the graph captures compile it)")
    runner = _runner(tmp_path, heads=10 if warm else 14, kv_heads=2, warm=warm)
    assert (runner.kernel_warmup_steps > 0) == warm
    with CompileRecorder() as compiled:
        for batch in _mixed_steps():
            runner.execute(batch)
        torch.cuda.synchronize()
    if warm:
        assert compiled.kernels == [], compiled.kernels
    else:  # the control: without the warm-up these steps compile (the split prefill among them)
        assert any(k.startswith("_prefill_kernel") for k in compiled.kernels), compiled.kernels


def _first_use_compiles(warm: bool) -> dict:
    from benchmarks.first_use import (
        run_probe,  # the probe in a fresh process (Triton's kernels are per process)
    )

    return run_probe(warm)


@pytest.mark.gpu
@pytest.mark.parametrize("warm", [True, False], ids=["warmed", "cold"])
def test_a_warmed_runner_compiles_nothing_at_the_first_use_of_a_feature(warm):
    """Penalised steps of 1, 3 and 16 rows, a copy-on-write, KV exports and imports (to the device and
    the host), a mixed step at the most KV splits such a step reaches here, each arm in a fresh process
    (``benchmarks/first_use.py --probe``, which also times them)."""
    from tests.kernels.kernel_cases import gpu_ready

    if not gpu_ready():
        pytest.skip("needs CUDA and compiled Triton")
    probe = _first_use_compiles(warm)
    assert probe["long_step_splits"] > 1, probe  # the long step splits (and merges)
    if warm:
        assert probe["compiled"] == [], probe
        assert probe["kernel_warmup_steps"] > 0 and probe["kernel_warmup_seconds"] > 0
    else:  # the control: the same first uses compile the penalties' and the block moves' kernels
        assert {"_penalise_kernel", "_count_kernel", "_copy_rows_kernel", "_merge_kernel"} <= set(probe["compiled"]), probe
        assert probe["kernel_warmup_steps"] == 0
