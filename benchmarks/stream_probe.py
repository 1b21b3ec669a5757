"""Can one program an SM stream a decode GEMV's weights at copy speed? (issue #19 item 1, session 29)

A persistent decode layer (one launch for several of the step's GEMMs, synced by grid barriers) needs
each SM's single program to keep enough weight bytes in flight. Session 29's Triton form of the MLP half
streamed at 31-47 % of copy (docs/gpu.md): Triton's pointer loads wait for their data inside the program,
and with one program an SM nothing overlaps the waits. Here the Hopper way, in Gluon: each program owns a
ring of ``NUM_BUF`` shared-memory slots that the TMA fills asynchronously (one elected thread issues a
bulk copy of a [BLOCK_N, BLOCK_K] weight tile and an mbarrier counts its bytes), ``NUM_BUF - 1`` tiles in
flight while the warps reduce the oldest against x::

    grid = (SMs,)     program p: work items p, p + SMs, ... (an item: an output tile x a K slice);
                      for each, its K range in BLOCK_K steps
    prologue          TMA tiles 0 .. NUM_BUF - 2 of p's (tile, K slice) sequence into slots 0 .. NUM_BUF - 2
    iteration i       CTA barrier (slot (i - 1) % NUM_BUF is read) -> TMA tile i + NUM_BUF - 1 into it ->
                      wait slot i % NUM_BUF -> y[tile] += W_tile . x[K slice] (fp32) -> store at the last slice

One row (batch 1), bf16 weights, fp32 sums (per K slice where the K range is cut). Against cuBLAS (``F.linear``) and, for the
gate|up shape, ``gate_up_silu`` (the engine's own, streaming through occupancy), 32 layers of each GEMV in
one CUDA graph, each layer with its own weights so nothing is served from L2. Compiled only (Gluon has no
interpreter); each configuration's output is checked against the float64 product first.

    python benchmarks/stream_probe.py --out benchmarks/results/stream_probe.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (name, N, K) of a Llama-8B layer's decode GEMVs
SHAPES = (("gate_up", 28672, 4096), ("down", 4096, 14336), ("qkv", 6144, 4096), ("o", 4096, 4096))
# (BLOCK_N, BLOCK_K, NUM_BUF, num_warps, programs an SM, SUB boxes a slot, K slices). Calls 2-5 (docs/gpu.md,
# session 29): gate|up at 90-95 % of copy, down at 52-73 % in every form of one output tile a program
# (deeper rings, 4-box slots, x loaded ahead); call 6: the K range cut into slices as cuBLAS cuts down's
# (fp32 partials, summed after), so each program reads a shorter span of more rows
CONFIGS = ((32, 256, 8, 4, 1, 1, 1), (32, 256, 8, 4, 1, 1, 2), (32, 256, 8, 4, 1, 1, 4), (64, 256, 6, 8, 1, 1, 4),
           (32, 256, 6, 4, 2, 1, 4), (16, 256, 8, 4, 1, 1, 4))


@gluon.jit
def _item_origin(item, K, BLOCK_N: gl.constexpr, SLICES: gl.constexpr):
    """Work item -> (first output row, first K column): item = (row tile, K slice), SLICES slices of K."""
    return (item // SLICES) * BLOCK_N, (item % SLICES) * (K // SLICES)


@gluon.jit
def _fill(w_desc, ring, ready, it, n_it, k_steps, pid, K, NPROG: gl.constexpr, BLOCK_N: gl.constexpr,
          BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr, SUB: gl.constexpr, SLICES: gl.constexpr):
    """TMA this program's iteration ``it`` into its slot: SUB boxes of [BLOCK_N, BLOCK_K] side by side along K
    (SUB x 512 bytes of each weight row), one mbarrier counting all their bytes; nothing past the last."""
    slot = it % NUM_BUF
    ok = it < n_it
    mbarrier.expect(ready.index(slot), SUB * BLOCK_N * BLOCK_K * 2, pred=ok)
    n0, kbase = _item_origin(pid + (it // k_steps) * NPROG, K, BLOCK_N, SLICES)
    k0 = kbase + (it % k_steps) * (SUB * BLOCK_K)
    for j in gl.static_range(SUB):
        tma.async_copy_global_to_shared(w_desc, [n0, k0 + j * BLOCK_K], ready.index(slot), ring.index(slot * SUB + j),
                                        pred=ok)


@gluon.jit
def _stream_gemv_kernel(w_desc, x_ptr, y_ptr, N, K, NPROG: gl.constexpr, BLOCK_N: gl.constexpr,
                        BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr, SUB: gl.constexpr, SLICES: gl.constexpr,
                        num_warps: gl.constexpr):
    pid = gl.program_id(0)
    k_steps = K // SLICES // (BLOCK_K * SUB)
    n_it = (((N // BLOCK_N) * SLICES - pid + NPROG - 1) // NPROG) * k_steps
    ring = gl.allocate_shared_memory(w_desc.dtype, [NUM_BUF * SUB, BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(s), count=1)
    for s in gl.static_range(NUM_BUF - 1):
        _fill(w_desc, ring, ready, s, n_it, k_steps, pid, K, NPROG, BLOCK_N, BLOCK_K, NUM_BUF, SUB, SLICES)
    # a [BLOCK_N, BLOCK_K] tile: 8 bf16 (16 bytes) a thread along K, warps down the rows
    L: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, L))
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L))
    acc = gl.zeros([BLOCK_N], gl.float32, layout=gl.SliceLayout(1, L))
    for i in range(n_it):
        gl.thread_barrier()  # every warp has read slot (i - 1) % NUM_BUF: the TMA may refill it
        _fill(w_desc, ring, ready, i + NUM_BUF - 1, n_it, k_steps, pid, K, NPROG, BLOCK_N, BLOCK_K, NUM_BUF, SUB,
              SLICES)
        slot = i % NUM_BUF
        mbarrier.wait(ready.index(slot), (i // NUM_BUF) & 1)
        n0, kbase = _item_origin(pid + (i // k_steps) * NPROG, K, BLOCK_N, SLICES)
        k0 = kbase + (i % k_steps) * (SUB * BLOCK_K)
        for j in gl.static_range(SUB):
            x = gl.load(x_ptr + k0 + j * BLOCK_K + cols).to(gl.float32)
            w = ring.index(slot * SUB + j).load(L).to(gl.float32)
            acc += gl.sum(w * x[None, :], axis=1)
        if i % k_steps == k_steps - 1:  # y [SLICES, N] fp32: the slices' partial sums
            gl.store(y_ptr + ((pid + (i // k_steps) * NPROG) % SLICES) * N + n0 + rows, acc)
            acc = gl.zeros([BLOCK_N], gl.float32, layout=gl.SliceLayout(1, L))
    for s in gl.static_range(NUM_BUF):
        mbarrier.invalidate(ready.index(s))


def stream_gemv(x: torch.Tensor, w: torch.Tensor, cfg: tuple[int, ...], sms: int) -> torch.Tensor:
    """x [1, K] . w[N, K]^T with ``per_sm`` programs an SM (``cfg``: BLOCK_N, BLOCK_K, NUM_BUF, warps,
    per_sm, SUB boxes a slot, K slices) -> fp32 partials [slices, N] whose sum is the product (left to the
    reader, as the engine leaves its projections' slices to the next norm)."""
    block_n, block_k, num_buf, warps, per_sm, sub, slices = cfg
    sms *= per_sm
    n, k = w.shape
    assert x.shape == (1, k) and n % block_n == 0 and k % (block_k * sub * slices) == 0
    layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.bfloat16)
    desc = TensorDescriptor.from_tensor(w, [block_n, block_k], layout)
    y = torch.empty(slices, n, dtype=torch.float32, device=x.device)
    _stream_gemv_kernel[(sms,)](desc, x, y, n, k, NPROG=sms, BLOCK_N=block_n, BLOCK_K=block_k, NUM_BUF=num_buf,
                                SUB=sub, SLICES=slices, num_warps=warps)
    return y


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/stream_probe.json")
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/stream_probe.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from benchmarks.kernels import bench_graph, ceilings  # the kernel benchmark's timing and copy ceiling
    from benchmarks.provenance import git_commit
    from prefixgate_kernels import gate_up_silu

    t0 = time.time()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy = ceilings()["copy_TBps"]
    result: dict = {"command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(0),
                    "commit": git_commit(), "torch": torch.__version__, "triton": triton.__version__,
                    "python": platform.python_version(), "copy_TBps": copy, "sms": sms, "rows": []}
    print(f"{result['gpu']}: copy {copy:.2f} TB/s, {sms} SMs", flush=True)
    for name, n, k in SHAPES:
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
              for _ in range(args.layers)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        want = (x.double() @ ws[0].double().T)
        nbytes = n * k * 2 * args.layers

        def share(ms: float, nbytes=nbytes) -> float:
            return 100 * nbytes / (ms * 1e-3) / 1e12 / copy

        row: dict = {"shape": name, "n": n, "k": k, "us_per_layer": {}, "pct_copy": {}, "rel_err": {}}

        def record(key: str, ms: float | None, row=row) -> None:
            if ms is None:  # bench_graph printed why
                row["us_per_layer"][key] = "graph capture failed"
                return
            row["us_per_layer"][key] = 1000 * ms / args.layers
            row["pct_copy"][key] = share(ms)

        record("cublas", bench_graph(lambda x=x, ws=ws: [F.linear(x, w) for w in ws]))
        if name == "gate_up":
            cfg = gate_up_silu.choose_config(1, n // 2, k, sms)
            record("gate_up_silu", bench_graph(lambda x=x, ws=ws, cfg=cfg: [gate_up_silu.gate_up_silu(x, w, cfg)
                                                                            for w in ws]))
        for cfg in CONFIGS:
            key = "bn{}_bk{}_buf{}_w{}_x{}_sub{}_k{}".format(*cfg)
            try:
                got = stream_gemv(x, ws[0], cfg, sms).sum(0, keepdim=True)
                torch.cuda.synchronize()
                err = float((got.double() - want).norm() / want.norm())
                row["rel_err"][key] = err
                if not err < 1e-2:
                    row["us_per_layer"][key] = f"wrong: rel. error {err:.3g}"
                    continue
                record(key, bench_graph(lambda x=x, ws=ws, cfg=cfg: [stream_gemv(x, w, cfg, sms) for w in ws]))
            except Exception as e:  # noqa: BLE001  (a config that does not compile or fit is a finding)
                row["us_per_layer"][key] = f"{type(e).__name__}: {e}"[:300]
        result["rows"].append(row)
        print(f"{name} [{n} x {k}], us a layer (% of copy): " + ", ".join(
            f"{key} {v:.2f} ({row['pct_copy'][key]:.0f} %)" if isinstance(v, float) else f"{key} {v}"
            for key, v in row["us_per_layer"].items()), flush=True)
        del ws
        torch.cuda.empty_cache()
    result["wall_s"] = time.time() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
