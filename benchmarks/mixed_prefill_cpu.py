"""What a shared step costs on this CPU for each ``max_mixed_prefill_tokens`` (docs/engine.md,
"Prefill cap in shared steps"). Run it as a module (``benchmarks/kernels.py`` would shadow the
kernels package transformers imports if the script directory were first on the path):

    python -m benchmarks.mixed_prefill_cpu --model DIR [--threads 1] [--caps 0 128 256 512 1024]
        [--out benchmarks/results/mixed_prefill_cpu.json]

Per cap: 4 requests decode (32-token prompts, EOS ignored) while two fresh 1,800-token prompts are
added; prints the median step time until both prompts are computed, the prompts' wall time and
tokens/s, and the decode tokens/s meanwhile; with ``--out``, the same rows as JSON with the command,
the machine and the commit. Figures are what this run measured; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.provenance import git_commit  # noqa: E402
from engine.config import EngineConfig  # noqa: E402 - after the path insert
from engine.launch import build_llm_engine  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.protocol import GenerateRequest, SamplingParams, StaticTenantScope  # noqa: E402

DECODES, DECODE_PROMPT, PROMPTS, PROMPT_LEN = 4, 32, 2, 1800


def measure(engine: LLMEngine, rng: random.Random) -> tuple[float, float, float]:
    """(median step s, prompts' wall s, decode tokens/s) for one engine."""
    def tokens(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]

    decode = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for i in range(DECODES):
        engine.add_request(GenerateRequest(f"d{i}", StaticTenantScope(), decode, prompt_token_ids=tokens(DECODE_PROMPT)))
    engine.step()  # the short prompts; they decode from now on
    start = time.perf_counter()
    for i in range(PROMPTS):
        engine.add_request(GenerateRequest(f"p{i}", StaticTenantScope(), SamplingParams(max_tokens=1, temperature=0.0),
                                           prompt_token_ids=tokens(PROMPT_LEN)))
    steps: list[float] = []
    done: set[str] = set()
    decoded = 0
    while len(done) < PROMPTS:
        t0 = time.perf_counter()
        for out in engine.step():
            if out.request_id.startswith("p") and out.finished:
                done.add(out.request_id)
            elif out.request_id.startswith("d"):
                decoded += len(out.new_token_ids)
        steps.append(time.perf_counter() - t0)
    wall = time.perf_counter() - start
    return sorted(steps)[len(steps) // 2], wall, decoded / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path, help="checkpoint directory (e.g. SmolLM2-135M)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--caps", type=int, nargs="+", default=[0, 128, 256, 512, 1024])
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    base = build_llm_engine(EngineConfig(model_dir=args.model, num_threads=args.threads))
    rng = random.Random(0)
    for cap in args.caps:
        config = EngineConfig(model_dir=args.model, num_threads=args.threads, max_mixed_prefill_tokens=cap,
                              enable_prefix_caching=False)
        step, wall, decode_rate = measure(LLMEngine(config, base.runner, num_blocks=base.cache.num_blocks), rng)
        print(f"cap={cap or 'none':>5}  shared step p50 {step * 1000:7.1f} ms  {PROMPTS * PROMPT_LEN} prompt tokens in "
              f"{wall:6.2f} s ({PROMPTS * PROMPT_LEN / wall:5.0f} tokens/s)  decode {decode_rate:5.1f} tokens/s", flush=True)
        rows.append({"cap": cap or None, "shared_step_p50_ms": step * 1000, "prompt_tokens": PROMPTS * PROMPT_LEN,
                     "prompt_wall_s": wall, "prompt_tokens_per_s": PROMPTS * PROMPT_LEN / wall,
                     "decode_tokens_per_s": decode_rate})
    if args.out is not None:
        args.out.write_text(json.dumps({
            "command": "python -m benchmarks.mixed_prefill_cpu " + " ".join(sys.argv[1:]),
            "machine": {"processor": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                        "threads": args.threads},
            "commit": git_commit(), "decodes": DECODES, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
