"""ModelRunner throughput on the tiny default model (CPU): prefill and decode tokens/s.

Drives ``ModelRunner.execute`` directly (no scheduler), so the figures are the model path's own
ceiling: one packed forward per step, greedy sampling, fp32, reference attention ops.

    python benchmarks/model_runner_cpu.py [--threads 1] [--steps 64] [--out benchmarks/results/model_runner_cpu.json]

Prediction written before the first run (2-core Xeon, 1 thread): batch-1 decode ~100 tok/s (the
100352 x 256 fp32 LM head streams ~100 MB per step and dominates), batch-16 decode ~500 tok/s,
prefill of a 512-token prompt ~2,000 tok/s.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.batch import ScheduledBatch, SequenceChunk  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.models.tiny import ensure_tiny_checkpoint  # noqa: E402
from engine.protocol import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)


def decode_rate(runner: ModelRunner, batch: int, prompt_len: int, steps: int) -> float:
    """Prefill ``batch`` prompts, then time ``steps`` decode steps of the whole batch -> tokens/s."""
    bs = runner.block_size
    per_seq = (prompt_len + steps + bs) // bs + 1
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    prompts = [[(1000 + 7 * i + j) % 100000 for j in range(prompt_len)] for i in range(batch)]
    res = runner.execute(ScheduledBatch([
        SequenceChunk(f"d{i}", p, 0, tables[i], True, GREEDY) for i, p in enumerate(prompts)
    ]))
    last = list(res.sampled_token_ids)
    start = time.perf_counter()
    for step in range(steps):
        chunks = [SequenceChunk(f"d{i}", [last[i]], prompt_len + step, tables[i], True, GREEDY) for i in range(batch)]
        last = list(runner.execute(ScheduledBatch(chunks)).sampled_token_ids)
    return batch * steps / (time.perf_counter() - start)


def prefill_rate(runner: ModelRunner, prompt_len: int, repeats: int = 3) -> float:
    bs = runner.block_size
    table = list(range((prompt_len + bs - 1) // bs))
    prompt = [(500 + j) % 100000 for j in range(prompt_len)]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        runner.execute(ScheduledBatch([SequenceChunk("p", prompt, 0, table, True, GREEDY)]))  # .tolist() syncs
        best = min(best, time.perf_counter() - start)
    return prompt_len / best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu (fp32) or cuda (bf16, reference ops unless triton_ops exist)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: a tiny model in a temp dir)")
    ap.add_argument("--out", default="benchmarks/results/model_runner_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else ensure_tiny_checkpoint(Path(tempfile.gettempdir()) / "pg-tiny")
    runner = ModelRunner(EngineConfig(model_dir=model_dir, device=args.device, num_kv_blocks=1024, block_size=16))
    decode_rate(runner, 1, 32, 8)  # warm-up

    rows = [
        ("decode, batch 1, ctx 128", decode_rate(runner, 1, 128, args.steps)),
        ("decode, batch 16, ctx 128", decode_rate(runner, 16, 128, args.steps // 2)),
        ("prefill, 512-token prompt", prefill_rate(runner, 512)),
    ]
    print(f"{'workload':<30}{'tokens/s':>12}")
    for name, rate in rows:
        print(f"{name:<30}{rate:>12.1f}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "device": args.device,
        "machine": {"processor": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch_threads": args.threads, "load_avg_1m": os.getloadavg()[0]},
        "git_commit": commit,
        "model": str(model_dir),
        "results_tokens_per_s": {name: round(rate, 1) for name, rate in rows},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
