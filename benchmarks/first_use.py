"""What a request's first use of an engine feature costs the engine's thread, with and without the kernel
warm-up (``EngineConfig.warm_up_kernels``; engine/kernel_warmup.py). CUDA only.

    python benchmarks/first_use.py [--out benchmarks/results/first_use.json]   # both arms, a table
    python benchmarks/first_use.py --probe warm|cold                            # one arm: one JSON line

Each arm runs in a fresh process (Triton keeps compiled kernels per process, so a second arm in the same
process would find the first's): it builds a small bf16 runner on the GPU, with or without the warm-up,
then times each first use below (the engine's thread is busy for all of it: every request on the engine
waits) and records the Triton kernels each one compiled (``jit_watch.CompileRecorder``):

  penalised 1 / 3 / 16 rows  a decode step whose rows carry every sampling penalty (the row count's
                             classes: one, neither, a multiple of 16)
  copy-on-write              one block copied in the pool
  export / import (device)   three blocks that are not consecutive, gathered and scattered
  export / import (host)     the same through pinned host memory
  most-split step            a mixed step of a few sequences just past 8,192 tokens of context, whose
                             prefill takes the most KV splits such a step reaches on this GPU

``tests/gpu_engine/test_kernel_warmup.py`` runs the two probes and checks the compiles (warmed: none;
cold: the penalties', row copy's and merge's kernels); the timings are this script's.

The model: the 8B shape's head counts (32 query heads of 64 over 8 KV heads) in two small layers, 8,448
tokens of context: enough for the prefill to split eight ways on a 132-SM card.

Prediction (written before the first run; session 41): cold, each first use that compiles takes the
compile's time, 0.2-1.5 s (the penalties' two kernels together 0.4-2 s), the rest 1-20 ms; warmed, every
first use 1-20 ms, none compiling.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# 32 query heads of 64 over 8 KV heads and 8,448 tokens of context (see the module docstring)
DIMS = {"hidden_size": 2048, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 8448}
LONG_CONTEXT = 8193
BLOCK_SIZE = 16
FIRST_LONG_BLOCK = 64
NUM_BLOCKS = FIRST_LONG_BLOCK + -(-LONG_CONTEXT // BLOCK_SIZE)


def probe(warm: bool) -> dict:
    """One arm in this process: the runner's warm-up figures, the most-split step's split count, and
    for each first use its wall time (device work included) and the kernels it compiled."""
    import torch

    from benchmarks.engine_gpu import IdTokenizer
    from engine.batch import BlockCopy, ScheduledBatch, SequenceChunk
    from engine.config import EngineConfig
    from engine.kernel_warmup import PENALISED_SAMPLING
    from engine.model_runner import ModelRunner
    from engine.models.random_init import build_random_model, llama_config_dict
    from engine.models.spec import parse_checkpoint_config
    from engine.protocol import SamplingParams
    from prefixgate_kernels.jit_watch import CompileRecorder
    from prefixgate_kernels.launch_layout import CacheLayout
    from prefixgate_kernels.prefill_attention import plan_prefill

    dims = DIMS
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(llama_config_dict(**dims)), encoding="utf-8")
        arch = parse_checkpoint_config(Path(tmp))
        model = build_random_model(arch, "cuda", torch.bfloat16, seed=0, std=0.05)
        cfg = EngineConfig(model_dir=Path(tmp), device="cuda", dtype="bfloat16", num_kv_blocks=NUM_BLOCKS,
                           block_size=BLOCK_SIZE, max_num_seqs=16, warm_up_kernels=warm)
        runner = ModelRunner(cfg, arch=arch, tokenizer=IdTokenizer(), model=model)

    def penalised(rows: int) -> None:
        chunks = [SequenceChunk(f"penalised-{rows}-{i}", [5 + i], 20, [4 + 2 * i, 5 + 2 * i], True,
                                PENALISED_SAMPLING, prompt_token_ids=(3, 4, 5)) for i in range(rows)]
        runner.execute(ScheduledBatch(chunks))
        for c in chunks:
            runner.release(c.request_id)

    # the most-split step: one 2-token chunk beside 1-token rows, every sequence at LONG_CONTEXT, the
    # sequence count (2-8) whose plan takes the most splits
    layout = CacheLayout.of(runner.dtype, runner.layer_caches[0].k)
    heads = dims["num_attention_heads"]

    def splits(n: int) -> int:
        return plan_prefill(n + 1, n, heads, LONG_CONTEXT, runner.kv_device, layout).splits

    seqs = max(range(2, 9), key=splits)
    table = list(range(FIRST_LONG_BLOCK, NUM_BLOCKS))
    greedy = SamplingParams(max_tokens=8, temperature=0.0)

    def most_split() -> None:
        chunks = [SequenceChunk(f"long-{i}", [1, 2] if i == 0 else [3], LONG_CONTEXT - (2 if i == 0 else 1), table,
                                True, greedy) for i in range(seqs)]
        runner.execute(ScheduledBatch(chunks))
        for c in chunks:
            runner.release(c.request_id)

    uses: list[tuple[str, Callable[[], object]]] = [
        ("penalised 1 row", lambda: penalised(1)),
        ("penalised 3 rows", lambda: penalised(3)),
        ("penalised 16 rows", lambda: penalised(16)),
        ("copy-on-write", lambda: runner.copy_blocks([BlockCopy(40, 41)])),
        ("export / import (device)", lambda: runner.import_blocks([50, 52, 55], runner.export_blocks_device([40, 42, 45]))),
        ("export / import (host)", lambda: runner.import_blocks([60, 61, 63], runner.export_blocks([40, 42, 45]))),
        ("most-split step", most_split),
    ]
    timed = []
    torch.cuda.synchronize()
    with CompileRecorder() as compiled:
        for name, use in uses:
            began = time.perf_counter()
            use()
            torch.cuda.synchronize()
            seconds = time.perf_counter() - began
            timed.append({"use": name, "s": seconds, "compiled": [k.split("[", 1)[0] for k, _ in compiled.drain()]})
    return {"warm": warm, "kernel_warmup_steps": runner.kernel_warmup_steps,
            "kernel_warmup_seconds": runner.kernel_warmup_seconds, "long_step_seqs": seqs,
            "long_step_splits": splits(seqs), "uses": timed,
            "compiled": [k for use in timed for k in use["compiled"]]}


def run_probe(warm: bool) -> dict:
    """``probe(warm)`` in a fresh process -> its JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--probe", "warm" if warm else "cold"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the {'warm' if warm else 'cold'} probe failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probe", choices=("warm", "cold"), help="run one arm in this process and print its JSON")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "first_use.json"))
    args = ap.parse_args(argv)
    if args.probe:
        print(json.dumps(probe(args.probe == "warm")))
        return 0
    import torch

    from benchmarks.provenance import git_commit

    if not torch.cuda.is_available():
        print("first_use: needs a CUDA device (the warm-up runs on CUDA only)", file=sys.stderr)
        return 2
    cold, warm = run_probe(False), run_probe(True)
    print(f"{'first use':<28}{'cold s':>10}{'warmed s':>10}   compiled cold / warmed")
    for c, w in zip(cold["uses"], warm["uses"], strict=True):
        print(f"{c['use']:<28}{c['s']:>10.4f}{w['s']:>10.4f}   {', '.join(c['compiled']) or '-'} / "
              f"{', '.join(w['compiled']) or '-'}")
    print(f"warm-up: {warm['kernel_warmup_steps']} eager steps and the feature kernels, "
          f"{warm['kernel_warmup_seconds']:.2f} s; most-split step: {warm['long_step_seqs']} sequences, "
          f"{warm['long_step_splits']} splits")
    result = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
              "gpu": torch.cuda.get_device_name(0), "host": platform.node(), "git_commit": git_commit(),
              "cold": cold, "warm": warm}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
