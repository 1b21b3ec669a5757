"""Run in a fresh process by test_kernel_warmup.py: build a small bf16 runner on the GPU, with or without
the kernel warm-up, then record which Triton kernels the first uses of request features compile
(penalised steps of 1, 3 and 16 rows, a copy-on-write, a KV export and import of blocks that are not
consecutive, an export to the host). Prints one JSON line: the runner's warm-up figures and the
compiled kernels' names.

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
from tests.gpu_engine.helpers import SHAPE, IdTokenizer


def _runner(model_dir: Path, warm: bool) -> ModelRunner:
    (model_dir / "config.json").write_text(json.dumps(llama_config_dict(**SHAPE)), encoding="utf-8")
    arch = parse_checkpoint_config(model_dir)
    model = build_random_model(arch, "cuda", torch.bfloat16, seed=0, std=0.05)
    cfg = EngineConfig(model_dir=model_dir, device="cuda", dtype="bfloat16", num_kv_blocks=128, block_size=16,
                       max_num_seqs=16, warm_up_kernels=warm)
    return ModelRunner(cfg, arch=arch, tokenizer=IdTokenizer(), model=model)


def _penalised_decode(runner: ModelRunner, rows: int) -> None:
    """``rows`` sequences decode one token each with every penalty on, then leave."""
    chunks = [SequenceChunk(f"penalised-{rows}-{i}", [5 + i], 20, [4 + 2 * i, 5 + 2 * i], True, PENALISED_SAMPLING,
                            prompt_token_ids=(3, 4, 5)) for i in range(rows)]
    runner.execute(ScheduledBatch(chunks))
    for c in chunks:
        runner.release(c.request_id)


def first_uses(runner: ModelRunner) -> None:
    for rows in (1, 3, 16):  # the row count's classes: one, neither, a multiple of 16
        _penalised_decode(runner, rows)
    runner.copy_blocks([BlockCopy(40, 41)])
    runner.import_blocks([50, 52, 55], runner.export_blocks_device([40, 42, 45]))
    runner.import_blocks([60, 61, 63], runner.export_blocks([40, 42, 45]))


def main(argv: list[str] | None = None) -> int:
    from prefixgate_kernels.jit_watch import CompileRecorder

    parser = argparse.ArgumentParser()
    arm = parser.add_mutually_exclusive_group(required=True)
    arm.add_argument("--warm", action="store_true")
    arm.add_argument("--cold", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        runner = _runner(Path(tmp), warm=args.warm)
        with CompileRecorder() as compiled:
            first_uses(runner)
            torch.cuda.synchronize()
    print(json.dumps({"kernel_warmup_steps": runner.kernel_warmup_steps,
                      "kernel_warmup_seconds": runner.kernel_warmup_seconds,
                      "compiled": [k.split("[", 1)[0] for k in compiled.kernels]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
