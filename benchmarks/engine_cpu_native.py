"""The native CPU kernels (prefixgate_kernels/cpu_native) against the torch paths they replace, in one run.

    python benchmarks/engine_cpu_native.py [--threads 1] [--repeats 20] [--out benchmarks/results/engine_cpu_native.json]

  * paged causal prefill attention, bf16 cache: the native kernel vs ``prefixgate_kernels.cpu_attention``'s
    SDPA path (the same call with the kernel switched off) for the tiny model's shape (8/2 heads,
    head dim 32) and SmolLM2's (9/3, head dim 64): a whole 1,600-token prompt and a 100-token
    chunk over a 1,500-token cached prefix;
  * decode-sized bf16 projections: the native GEMV vs ``torch.nn.functional.linear`` (oneDNN) for
    the tiny model's LM head (100,352 x 256) and a 256 x 256 projection at 1 and 4 rows.

Each figure is the best of ``--repeats`` calls (the shared machine's load only ever adds time);
alternating the two sides per repeat. Prints a table and writes JSON with the command, machine,
load, threads and commit. Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import git_commit  # noqa: E402 - after the path insert

# Written before the first run.
PREDICTION = {
    "prefill_attention_native_over_sdpa": "3-5x faster at head dim 32, 2-3x at head dim 64",
    "lm_head_gemv_1_row": "2-3x faster than oneDNN",
    "projection_gemv_4_rows": "1.5-2.5x faster",
}



def best_pair(a, b, repeats: int) -> tuple[float, float]:
    """Best seconds of a() and b(), called alternately."""
    a(), b()
    ta, tb = [], []
    for _ in range(repeats):
        for f, acc in ((a, ta), (b, tb)):
            t = time.perf_counter()
            f()
            acc.append(time.perf_counter() - t)
    return min(ta), min(tb)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "engine_cpu_native.json"))
    args = parser.parse_args()
    commit, load_before = git_commit(), os.getloadavg()

    import torch
    import torch.nn.functional as F

    from prefixgate_kernels import cpu_attention, cpu_native

    torch.set_num_threads(args.threads)
    kernel = cpu_native.load()
    if kernel is None:
        print("the native kernel is not available here (see the log); nothing to compare", file=sys.stderr)
        return 2

    def sdpa_path(*call):
        # the same call with the kernel switched off for it alone (clearing load()'s cache instead
        # would time a rebuild check in every native call after it)
        chooser = cpu_attention._native_kernel
        cpu_attention._native_kernel = lambda *_: None
        try:
            return cpu_attention.paged_prefill_attention(*call)
        finally:
            cpu_attention._native_kernel = chooser

    rows = []
    gen = torch.Generator().manual_seed(0)
    bs = 16
    for name, hq, hkv, d in (("tiny 8/2 x 32", 8, 2, 32), ("SmolLM2 9/3 x 64", 9, 3, 64)):
        for cached, new in ((0, 1600), (1500, 100)):
            n = cached + new
            nb = -(-n // bs) + 2
            k = torch.randn(nb, bs, hkv, d, generator=gen).to(torch.bfloat16)
            v = torch.randn(nb, bs, hkv, d, generator=gen).to(torch.bfloat16)
            table = torch.randperm(nb, generator=gen)[: -(-n // bs)].to(torch.int32).unsqueeze(0)
            q = torch.randn(new, hq, d, generator=gen).to(torch.bfloat16)
            call = (q, k, v, table, torch.tensor([0, new], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                    d**-0.5)
            t_native, t_sdpa = best_pair(lambda c=call: cpu_attention.paged_prefill_attention(*c),
                                         lambda c=call: sdpa_path(*c), args.repeats)
            flops = 4 * d * hq * sum(cached + i + 1 for i in range(new))
            rows.append({"op": f"prefill attention {name}, {cached} cached + {new} new", "baseline": "SDPA path",
                         "native_ms": t_native * 1e3, "baseline_ms": t_sdpa * 1e3, "speedup": t_sdpa / t_native,
                         "native_gflops": flops / t_native / 1e9, "baseline_gflops": flops / t_sdpa / 1e9})
    for name, out_f, in_f in (("LM head", 100352, 256), ("projection", 256, 256)):
        w = (torch.randn(out_f, in_f, generator=gen) / in_f**0.5).to(torch.bfloat16)
        for m in (1, 4):
            x = torch.randn(m, in_f, generator=gen).to(torch.bfloat16)
            t_native, t_torch = best_pair(lambda x=x, w=w: kernel.linear(x, w), lambda x=x, w=w: F.linear(x, w),
                                          args.repeats)
            rows.append({"op": f"{name} {out_f} x {in_f}, {m} row(s)", "baseline": "F.linear (oneDNN)",
                         "native_ms": t_native * 1e3, "baseline_ms": t_torch * 1e3, "speedup": t_torch / t_native,
                         "native_weight_gb_s": out_f * in_f * 2 / t_native / 1e9})

    width = max(len(r["op"]) for r in rows)
    print(f"{'op'.ljust(width)}  {'native ms':>10}  {'baseline ms':>11}  speedup")
    for r in rows:
        print(f"{r['op'].ljust(width)}  {r['native_ms']:10.3f}  {r['baseline_ms']:11.3f}  {r['speedup']:.2f}x")
    load_after = os.getloadavg()
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min; {os.cpu_count()} cores)")
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "git_commit": commit,
        "machine": {"processor": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "platform": platform.platform(), "load_avg_before": load_before, "load_avg_after": load_after},
        "torch": torch.__version__, "threads": args.threads, "repeats": args.repeats,
        "prediction": PREDICTION, "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
