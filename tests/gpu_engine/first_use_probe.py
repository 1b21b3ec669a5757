"""Run in a fresh process by test_kernel_warmup.py: build a small bf16 runner on the GPU, with or without
the kernel warm-up, then record which Triton kernels the first uses of request features compile
(penalised steps of 1, 3 and 16 rows, a copy-on-write, a KV export and import of blocks that are not
consecutive, an export to the host), and a mixed step of a few sequences just past 8,192 tokens of
context, whose prefill takes the most KV splits such a step reaches on this GPU (session 41: eight on
an H100, a split merge the warm-up's grid of steps had not compiled). Prints one JSON line: the
runner's warm-up figures, that step's split count and the compiled kernels' names.

A process of its own because Triton keeps compiled kernels per process: in the test process another
test may already have compiled what this one asks about, and the control (no warm-up) could not show
a compile.

    python -m tests.gpu_engine.first_use_probe --warm | --cold
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from engine.batch import BlockCopy, ScheduledBatch, SequenceChunk
from engine.config import EngineConfig
from engine.kernel_warmup import PENALISED_SAMPLING
from engine.model_runner import ModelRunner
from engine.models.random_init import build_random_model, llama_config_dict
from engine.models.spec import parse_checkpoint_config
from tests.gpu_engine.helpers import GREEDY, SHAPE, IdTokenizer

# 32 query heads of 64 over 8 KV heads (the 8B shape's head counts, in two small layers) and 8,448 tokens of
# context: enough for the prefill to split eight ways on a 132-SM card
DIMS = {**SHAPE, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "hidden_size": 2048,
        "intermediate_size": 512, "max_position_embeddings": 8448}
LONG_CONTEXT = 8193
TABLE = list(range(64, 64 + -(-LONG_CONTEXT // 16)))  # blocks of the long step (every sequence shares them)


def _runner(model_dir: Path, warm: bool) -> ModelRunner:
    (model_dir / "config.json").write_text(json.dumps(llama_config_dict(**DIMS)), encoding="utf-8")
    arch = parse_checkpoint_config(model_dir)
    model = build_random_model(arch, "cuda", torch.bfloat16, seed=0, std=0.05)
    cfg = EngineConfig(model_dir=model_dir, device="cuda", dtype="bfloat16", num_kv_blocks=TABLE[-1] + 1,
                       block_size=16, max_num_seqs=16, warm_up_kernels=warm)
    return ModelRunner(cfg, arch=arch, tokenizer=IdTokenizer(), model=model)


def _most_split_step(runner: ModelRunner) -> tuple[ScheduledBatch, int]:
    """A step of one 2-token chunk beside 1-token rows, every sequence at ``LONG_CONTEXT``: the sequence
    count (2-8) whose prefill plan takes the most KV splits, and that count."""
    from prefixgate_kernels.launch_layout import CacheLayout
    from prefixgate_kernels.prefill_attention import plan_prefill

    layout = CacheLayout.of(runner.dtype, runner.layer_caches[0].k)
    seqs = max(range(2, 9), key=lambda n: plan_prefill(n + 1, n, DIMS["num_attention_heads"], LONG_CONTEXT,
                                                      runner.kv_device, layout).splits)
    splits = plan_prefill(seqs + 1, seqs, DIMS["num_attention_heads"], LONG_CONTEXT, runner.kv_device, layout).splits
    chunks = [SequenceChunk(f"long-{i}", [1, 2] if i == 0 else [3], LONG_CONTEXT - (2 if i == 0 else 1), TABLE, True,
                            GREEDY) for i in range(seqs)]
    return ScheduledBatch(chunks), splits


def _penalised_decode(runner: ModelRunner, rows: int) -> None:
    """``rows`` sequences decode one token each with every penalty on, then leave."""
    chunks = [SequenceChunk(f"penalised-{rows}-{i}", [5 + i], 20, [4 + 2 * i, 5 + 2 * i], True, PENALISED_SAMPLING,
                            prompt_token_ids=(3, 4, 5)) for i in range(rows)]
    runner.execute(ScheduledBatch(chunks))
    for c in chunks:
        runner.release(c.request_id)


def first_uses(runner: ModelRunner, long_step: ScheduledBatch) -> None:
    for rows in (1, 3, 16):  # the row count's classes: one, neither, a multiple of 16
        _penalised_decode(runner, rows)
    runner.copy_blocks([BlockCopy(40, 41)])
    runner.import_blocks([50, 52, 55], runner.export_blocks_device([40, 42, 45]))
    runner.import_blocks([60, 61, 63], runner.export_blocks([40, 42, 45]))
    runner.execute(long_step)
    for c in long_step.chunks:
        runner.release(c.request_id)


def main(argv: list[str] | None = None) -> int:
    from prefixgate_kernels.jit_watch import CompileRecorder

    parser = argparse.ArgumentParser()
    arm = parser.add_mutually_exclusive_group(required=True)
    arm.add_argument("--warm", action="store_true")
    arm.add_argument("--cold", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        runner = _runner(Path(tmp), warm=args.warm)
        long_step, splits = _most_split_step(runner)
        with CompileRecorder() as compiled:
            first_uses(runner, long_step)
            torch.cuda.synchronize()
    print(json.dumps({"kernel_warmup_steps": runner.kernel_warmup_steps,
                      "kernel_warmup_seconds": runner.kernel_warmup_seconds, "long_step_splits": splits,
                      "compiled": [k.split("[", 1)[0] for k in compiled.kernels]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
