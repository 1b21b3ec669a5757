"""Where a decode step and a prefill step of the 8B-shaped model spend their time (one GPU call).

    python benchmarks/engine_gpu_profile.py [--out benchmarks/results/engine_gpu_profile_h200.json]

Splits one graph decode step (batch 32, ~2K context) into host fill, graph replay (device time by
CUDA events) and sampling; then profiles one eager decode step and one 16,384-token prefill step
with torch.profiler and lists the kernels that take the most device time. Random bf16 weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.engine_gpu import SMOKE_8B, IdTokenizer, arch_for, greedy  # noqa: E402
from engine.batch import ScheduledBatch, SequenceChunk  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.models.random_init import LLAMA31_8B_SHAPE, build_random_model  # noqa: E402


def top_kernels(prof, n: int = 12) -> list[dict]:
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0) or 0
        if dev_us > 0 and not e.key.startswith(("aten::", "cuda")):  # device kernels and copies only
            rows.append({"kernel": e.key[:90], "calls": e.count, "device_ms": dev_us / 1e3})
    rows.sort(key=lambda r: -r["device_ms"])
    return rows[:n]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "engine_gpu_profile_h200.json"))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: check the script runs")
    args = ap.parse_args()
    dev = "cpu" if args.smoke else "cuda"
    b, plen, bs = (32, 64, 16) if args.smoke else (32, 2048, 16)
    cfg, arch = arch_for(SMOKE_8B if args.smoke else LLAMA31_8B_SHAPE, 2048 if args.smoke else 8448)
    model = build_random_model(arch, dev, torch.bfloat16 if dev == "cuda" else torch.float32, seed=0)
    config = EngineConfig(model_dir=Path("random-8b"), device=dev, num_kv_blocks=8192, max_num_seqs=32,
                          max_num_batched_tokens=16384, max_model_len=arch.max_model_len)
    runner = ModelRunner(config, arch=arch, tokenizer=IdTokenizer(), model=model)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, arch.vocab_size, (b, plen), generator=g).tolist()
    per = (plen + 64) // bs + 1
    tables = [list(range(i * per, (i + 1) * per)) for i in range(b)]
    sp = greedy(8)
    res: dict = {"commit": os.environ.get("PREFIXGATE_COMMIT", "unknown"),
                 "gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu"}
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def prefill_batch(rows):
        return ScheduledBatch([SequenceChunk(f"s{i}", prompts[i], 0, tables[i], True, sp) for i in rows])

    runner.execute(prefill_batch(range(0, 8)))  # warm-up + compile at this shape
    sync()
    t0 = time.perf_counter()
    for k in range(1, 4):
        runner.execute(prefill_batch(range(8 * k, 8 * k + 8)))
    sync()
    res["prefill_step_ms_16384_tokens"] = 1e3 * (time.perf_counter() - t0) / 3
    runner.execute(prefill_batch(range(0, 8)))

    def decode_batch(step):
        return ScheduledBatch([SequenceChunk(f"s{i}", [5 + step], plen + step, tables[i], True, sp) for i in range(b)])

    graphs = runner.decode_graphs
    if graphs is None:  # --smoke on CPU: no graphs to time
        from engine.cuda_graphs import DecodeGraphs
        graphs = DecodeGraphs(model, runner.layer_caches, runner.ops, bs, 128, (32,), torch.device(dev))
        graphs._graphs = {32: type("Eager", (), {"replay": staticmethod(lambda: graphs._forward(32))})()}
        graphs._logits = {32: graphs._forward(32)}
    for s in range(3):
        runner.execute(decode_batch(s))
    sync()
    n = 20
    t_exec = time.perf_counter()
    for s in range(3, 3 + n):
        runner.execute(decode_batch(s))
    exec_ms = 1e3 * (time.perf_counter() - t_exec) / n
    t0 = time.perf_counter()
    for s in range(n):
        graphs.fill(decode_batch(s).chunks)
    sync()
    fill_ms = 1e3 * (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n):
        graphs._graphs[32].replay()
    sync()
    replay_ms = 1e3 * (time.perf_counter() - t0) / n  # back-to-back replays: device time per step
    logits = graphs._logits[32]
    t0 = time.perf_counter()
    for _ in range(n):
        runner.sampler.sample(logits, [sp] * b, [f"s{i}" for i in range(b)], [0] * b)
    sample_ms = 1e3 * (time.perf_counter() - t0) / n
    res["decode"] = {"execute_ms": exec_ms, "fill_ms": fill_ms, "graph_replay_device_ms": replay_ms,
                     "sample_ms": sample_ms}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.forward(decode_batch(30), all_logits=True)  # eager (all_logits bypasses the graphs)
        sync()
    res["decode_eager_top"] = top_kernels(prof)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.forward(prefill_batch(range(8, 16)))
        sync()
    res["prefill_top"] = top_kernels(prof)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in res.items() if not k.endswith("_top")}, indent=1))
    for key in ("decode_eager_top", "prefill_top"):
        print(f"\n{key}:")
        for r in res[key]:
            print(f"  {r['device_ms']:9.3f} ms  {r['calls']:5d}x  {r['kernel']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
