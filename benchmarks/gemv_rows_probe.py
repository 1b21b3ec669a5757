"""The decode step's o, q|k|v and down projections at 1 to 32 rows: ``gemv_pdl`` against cuBLAS, launched
plainly (issue #19 item 1, sessions 31 and 37).

``gemv_pdl.partials_gemv`` streams a projection's weights through a ring of TMA-filled shared-memory slots,
one program an SM; one row runs on CUDA cores, 2 to 32 rows on the tensor cores (a warpgroup MMA of each
64-row weight slot by the rows, padded to a power of two from 8). Launched with PDL after a kernel that lets it start early, its
first weight tiles stream under that kernel (what ``benchmarks/engine_gpu.py --sections decode_rows_pdl``
measures in the engine). Here, without PDL, the question is only whether it streams as fast as what it
replaces at each row count: the engine's K-quarter partials through cuBLAS (``partial_gemm``, one batched
GEMM) for o and down, and cuBLAS's q|k|v GEMM (``triton_ops.linear``). Down's quarters are 14 steps of 256
(K = 14,336); past 8 rows its x quarter does not fit beside the ring, and those rows are left out.

Each of ``--layers`` layers has its own weights (nothing served from L2 for the next), all in one CUDA graph;
the result is microseconds a layer, with each kernel's partials checked against the float64 product.

    python benchmarks/gemv_rows_probe.py --out benchmarks/results/gemv_rows_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN = 4096
SHAPES = {"o": (HIDDEN, HIDDEN), "q|k|v": (6144, HIDDEN), "down": (HIDDEN, 14336)}  # Llama-8B: [out, in]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/gemv_rows_probe.json")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    args = ap.parse_args()
    from benchmarks.pdl_o_probe import start_gpu_run

    run = start_gpu_run("benchmarks/gemv_rows_probe.py")
    if run is None:
        return 2
    from benchmarks.kernels import bench_graph, rel_err
    from prefixgate_kernels import gemv_pdl, partial_gemm, triton_ops

    dev, gen, layers = run.dev, run.gen, args.layers
    gemv_pdl.MAX_ROWS = max(int(r) for r in args.rows.split(","))  # every row count asked for, as the engine's cap
    probe = torch.empty(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    if not gemv_pdl.supports(probe, torch.empty(HIDDEN, HIDDEN, device=dev, dtype=torch.bfloat16), None):
        print(f"skipped: gemv_pdl runs on an sm_90 GPU under Triton 3.6 ({torch.cuda.get_device_name(0)}, "
              f"compute capability {torch.cuda.get_device_capability(0)})")
        return 0
    result: dict = {**run.header(layers), "us_per_layer": {}, "rel_err": {}, "weights_TBps": {}}
    print(f"{result['gpu']}: copy {run.copy_TBps:.2f} TB/s, {run.sms} SMs", flush=True)
    lines = []
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) * k ** -0.5
                   for _ in range(layers)]
        cublas = ((lambda x, w: partial_gemm.linear_partials(x, w, None, triton_ops.linear)) if name != "q|k|v"
                  else triton_ops.linear)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
            if not gemv_pdl.supports(x, weights[0], None):
                print(f"{name} {m}: not gemv_pdl's shape (x's quarter and the ring over shared memory)", flush=True)
                continue
            want = x.double() @ weights[0].double().T
            got = gemv_pdl.partials_gemv(x, weights[0], pdl=False).sum(0)
            err = rel_err(got, want)
            key = f"{name} {m}"
            result["rel_err"][key] = err
            times = {}
            for label, fn in (("cuBLAS", lambda x=x, f=cublas, ws=weights: [f(x, w) for w in ws]),
                              ("gemv_pdl", lambda x=x, ws=weights: [gemv_pdl.partials_gemv(x, w, pdl=False)
                                                                    for w in ws])):
                ms = bench_graph(fn)
                times[label] = None if ms is None else 1000 * ms / layers
            result["us_per_layer"][key] = times
            if times["gemv_pdl"]:
                result["weights_TBps"][key] = n * k * 2 / (times["gemv_pdl"] * 1e-6) / 1e12
            ratio = (times["gemv_pdl"] / times["cuBLAS"]) if times["gemv_pdl"] and times["cuBLAS"] else float("nan")
            lines.append(f"{key:<10} cuBLAS {times['cuBLAS'] or float('nan'):7.2f}  gemv_pdl "
                         f"{times['gemv_pdl'] or float('nan'):7.2f} us a layer  (x{ratio:.3f}; "
                         f"{result['weights_TBps'].get(key, float('nan')):.2f} TB/s)  rel. error {err:.1e}")
            print(lines[-1], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1), encoding="utf-8")
    print("\n".join(["", "projection  us a layer, launched plainly (no PDL)", *lines]))
    return 0 if all(e < 1e-4 for e in result["rel_err"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
