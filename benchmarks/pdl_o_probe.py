"""The o projection's weights streamed while the attention runs (issue #19 item 1, session 30).

At batch 1 a decode layer's attention launch takes ~10-11 us for ~8 MB of K/V (latency-bound: one wave
of short programs, a merge at the end) and the HBM is mostly idle under it; the o projection after it
(33.5 MB of weights) takes ~11-13 us more. Session 16 tried to fill that idle time with an L2 prefetch
on a side stream and lost (a resident prefetch kernel slowed the attention and the o GEMM did not get
faster from L2); session 8 and 12 tried programmatic dependent launch (PDL) between GEMMs and lost (a
grid launched early takes SM slots the running GEMM's later waves need). Untried: PDL between the
attention and the o projection, whose attention is one wave that leaves room on every SM, with an o
projection of our own that puts its weight tiles in flight in shared memory *before* it waits for the
attention's output::

    attention  (paged_decode, LAUNCH_DEPENDENTS: each program lets the next grid launch at its start)
    o          (this file's Gluon kernel, launched with PDL; one program an SM, a ring of NUM_BUF
               [64, 256] bf16 slots the TMA fills): PREFETCH slots issued -> griddepcontrol.wait (the
               attention has finished and its output is visible) -> x's quarter of K -> the ring's
               steps (items: 64 output rows x a quarter of K, round robin), fp32 partials [4, M, N]
    add_rms_norm over the partials (as the engine's next norm sums cuBLAS's K slices)

Against the engine's chain (the same attention, ``linear_partials``'s batched cuBLAS GEMM over 4 K slices,
the same norm), 32 layers in one CUDA graph, each with its own K/V cache and o weights. Batch 1, bf16,
Llama-8B's 32 / 8 heads of 128, 2,048 tokens of context. Compiled only (Gluon).

    python benchmarks/pdl_o_probe.py --out benchmarks/results/pdl_o_probe.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefixgate_kernels.decode_attention import paged_decode  # noqa: E402

HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM = 4096, 32, 8, 128
CONTEXT, BLOCK_SIZE = 2048, 16
# a slot: 64 output rows x 256 of K; K in quarters (the engine's partials); the kernels read the constexprs
SLOT_ROWS, SLOT_COLS, QUARTERS = 64, 256, 4
BLOCK_N, BLOCK_K, SLICES = gl.constexpr(SLOT_ROWS), gl.constexpr(SLOT_COLS), gl.constexpr(QUARTERS)


@gluon.jit
def _grid_wait(after):
    """``griddepcontrol.wait`` once ``after`` (a scalar) is known: blocks until the grid this one depends on
    (launched before it, with PDL) has finished and its writes are visible; no-op without PDL."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0 $1", "=r,r", [after], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _stamp(stamps_ptr, slot, after):
    """The GPU's nanosecond timer at ``stamps_ptr + slot``, read once ``after`` (a scalar) is known."""
    now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [after], dtype=gl.int64, is_pure=False,
                                    pack=1)
    gl.store(stamps_ptr + slot, now)


@gluon.jit
def _fill(w_desc, ring, ready, g, n_steps, pid, NPROG: gl.constexpr, NUM_BUF: gl.constexpr):
    """TMA the program's step ``g`` (item g // 4, its K step g % 4) into slot g % NUM_BUF; nothing past the last."""
    slot = g % NUM_BUF
    ok = g < n_steps
    item = pid + (g // 4) * NPROG
    mbarrier.expect(ready.index(slot), BLOCK_N * BLOCK_K * 2, pred=ok)
    tma.async_copy_global_to_shared(w_desc, [(item // 4) * BLOCK_N, (item % 4) * 1024 + (g % 4) * BLOCK_K],
                                    ready.index(slot), ring.index(slot), pred=ok)


@gluon.jit
def _o_partials_kernel(w_desc, x_ptr, parts_ptr, stamps_ptr, N, NPROG: gl.constexpr, NUM_BUF: gl.constexpr,
                       PREFETCH: gl.constexpr, STAMPS: gl.constexpr, num_warps: gl.constexpr):
    """parts[q, 0, n] = sum over K quarter q of x[0, k] * W[n, k], one program an SM (batch 1).

    Every item of a program (pid, pid + NPROG, ...) is in quarter pid % 4 (NPROG a multiple of 4), so the
    program reads x's quarter once, after the wait, into registers (four [256] rows)."""
    pid = gl.program_id(0)
    if STAMPS:  # three timer reads: the start, the wait passed, the end
        _stamp(stamps_ptr, pid * 3, pid)
    L: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])  # a [64, 256] slot
    XL: gl.constexpr = gl.SliceLayout(0, L)
    quarter = pid % 4
    n_items = (N // BLOCK_N * SLICES - pid + NPROG - 1) // NPROG
    n_steps = n_items * 4
    ring = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(s), count=1)
    for s in gl.static_range(PREFETCH):  # the weights depend on nothing the attention writes
        _fill(w_desc, ring, ready, s, n_steps, pid, NPROG, NUM_BUF)
    _grid_wait(pid)
    if STAMPS:
        _stamp(stamps_ptr, pid * 3 + 1, pid)
    for s in gl.static_range(PREFETCH, NUM_BUF):
        _fill(w_desc, ring, ready, s, n_steps, pid, NPROG, NUM_BUF)
    cols = gl.arange(0, BLOCK_K, layout=XL)
    x0 = gl.load(x_ptr + quarter * 1024 + cols).to(gl.float32)
    x1 = gl.load(x_ptr + quarter * 1024 + BLOCK_K + cols).to(gl.float32)
    x2 = gl.load(x_ptr + quarter * 1024 + 2 * BLOCK_K + cols).to(gl.float32)
    x3 = gl.load(x_ptr + quarter * 1024 + 3 * BLOCK_K + cols).to(gl.float32)
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L))
    for j in range(n_items):
        acc = gl.zeros([BLOCK_N], gl.float32, layout=gl.SliceLayout(1, L))
        for st in gl.static_range(4):
            g = j * 4 + st
            slot = g % NUM_BUF
            mbarrier.wait(ready.index(slot), (g // NUM_BUF) & 1)
            w = ring.index(slot).load(L).to(gl.float32)
            if st == 0:
                acc += gl.sum(w * x0[None, :], axis=1)
            elif st == 1:
                acc += gl.sum(w * x1[None, :], axis=1)
            elif st == 2:
                acc += gl.sum(w * x2[None, :], axis=1)
            else:
                acc += gl.sum(w * x3[None, :], axis=1)
            gl.thread_barrier()  # every warp has read the slot: refill it with step g + NUM_BUF
            _fill(w_desc, ring, ready, g + NUM_BUF, n_steps, pid, NPROG, NUM_BUF)
        item = pid + j * NPROG
        gl.store(parts_ptr + quarter * N + (item // 4) * BLOCK_N + rows, acc)
    if STAMPS:
        _stamp(stamps_ptr, pid * 3 + 2, pid)
    for s in gl.static_range(NUM_BUF):
        mbarrier.invalidate(ready.index(s))


class Config(NamedTuple):
    num_buf: int = 5
    prefetch: int = 0  # slots issued before griddepcontrol.wait
    pdl: bool = False  # launched with PDL after an attention that lets it launch at its start
    warps: int = 8

    @property
    def key(self) -> str:
        return f"gluon buf{self.num_buf}" + (f" pdl prefetch{self.prefetch}" if self.pdl else "")


# the GEMV alone first (no PDL: it waits for the attention as any launch does), then PDL with nothing and all
# slots in flight before the wait, at the engine's table width too (256 attention programs, 2 an SM beside the
# o's ring) and with smaller rings. Refuted and taken out (in the tree at 74ce4e5, docs/gpu.md session 30): the
# rest of the weights put in L2 before the wait (call 6), tiles issued after a sleep, and the o launched only once
# the attention's keys are read (call 7)
CONFIGS = (Config(5), Config(5, 0, True), Config(5, 5, True), Config(4, 4, True), Config(3, 3, True))


@dataclass(frozen=True)
class GpuRun:
    """What the PDL probes share at their start: the device, its SM count, one seeded generator and the copy
    ceiling (``benchmarks.kernels.ceilings``) measured in the same run."""

    sms: int
    gen: torch.Generator
    copy_TBps: float
    t0: float
    dev: str = "cuda"

    def header(self, layers: int) -> dict:
        """The results JSON's provenance: command, GPU, commit, versions, the copy ceiling."""
        from benchmarks.provenance import git_commit

        return {"command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(0),
                "commit": git_commit(), "torch": torch.__version__, "triton": triton.__version__,
                "python": platform.python_version(), "copy_TBps": self.copy_TBps, "sms": self.sms, "layers": layers,
                "context": CONTEXT}


def start_gpu_run(script: str) -> GpuRun | None:
    """A ``GpuRun``, or None (said on stderr) without a CUDA GPU."""
    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU", file=sys.stderr)
        return None
    from benchmarks.kernels import ceilings

    t0 = time.time()
    return GpuRun(torch.cuda.get_device_properties(0).multi_processor_count,
                  torch.Generator(device="cuda").manual_seed(0), ceilings()["copy_TBps"], t0)


def layer_caches(layers: int, gen: torch.Generator, dev: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's own K and V cache of ``CONTEXT`` tokens (bf16, Llama-8B's KV heads), so nothing of one
    layer's attention is served from L2 for the next."""
    blocks = CONTEXT // BLOCK_SIZE
    shape = (blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return [(torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=gen),
             torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=gen)) for _ in range(layers)]


def padded_table(width_tokens: int, live: torch.Tensor) -> torch.Tensor:
    """A one-sequence block table ``width_tokens`` wide: the live context's blocks first, the rest never read
    (the launcher sizes its split count from the width, as in the engine's decode graphs)."""
    table = torch.zeros(1, width_tokens // BLOCK_SIZE, dtype=torch.int32, device=live.device)
    table[0, :live.numel()] = live
    return table


class OPartials:
    """One layer's o projection as this probe's kernel: the descriptor and the partials made once."""

    def __init__(self, w: torch.Tensor, sms: int, config: Config) -> None:
        layout = gl.NVMMASharedLayout.get_default_for([SLOT_ROWS, SLOT_COLS], gl.bfloat16)
        self.desc = TensorDescriptor.from_tensor(w, [SLOT_ROWS, SLOT_COLS], layout)
        self.n = w.shape[0]
        self.parts = torch.empty(QUARTERS, 1, self.n, dtype=torch.float32, device=w.device)
        assert sms % 4 == 0 and w.shape[1] == 4 * 1024, "a program's items share one quarter of K"
        assert config.prefetch <= config.num_buf
        self.sms, self.config = sms, config

    def __call__(self, x: torch.Tensor, stamps: torch.Tensor | None = None) -> torch.Tensor:
        c = self.config
        _o_partials_kernel[(self.sms,)](self.desc, x, self.parts, stamps if stamps is not None else self.parts,
                                        self.n, NPROG=self.sms, NUM_BUF=c.num_buf, PREFETCH=c.prefetch,
                                        STAMPS=stamps is not None, num_warps=c.warps, launch_pdl=c.pdl)
        return self.parts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/pdl_o_probe.json")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--table-tokens", default="2048,8448",
                    help="block table widths, in tokens, to run (the launcher sizes its split count from the width "
                         "when, as in the engine's decode graphs, it has no length hint: 8 splits at 2,048, 32 at "
                         "8,448, so 64 or 256 attention programs beside the o's)")
    ap.add_argument("--rounds", type=int, default=2, help="times every chain is timed, in turn")
    args = ap.parse_args()
    run = start_gpu_run("benchmarks/pdl_o_probe.py")
    if run is None:
        return 2
    from benchmarks.kernels import bench_graph, rel_err
    from prefixgate_kernels import triton_ops

    dev, sms, gen, copy = run.dev, run.sms, run.gen, run.copy_TBps
    layers, eps = args.layers, 1e-5
    caches = layer_caches(layers, gen, dev)
    live = torch.randperm(CONTEXT // BLOCK_SIZE, device=dev, generator=gen).to(torch.int32)
    tables = {width: padded_table(width, live) for width in (int(w) for w in args.table_tokens.split(","))}
    seq_lens = torch.full((1,), CONTEXT, dtype=torch.int32, device=dev)
    counters = torch.zeros(KV_HEADS, dtype=torch.int32, device=dev)
    w_o = [torch.randn(HIDDEN, HIDDEN, device=dev, dtype=torch.bfloat16, generator=gen) * HIDDEN ** -0.5
           for _ in range(layers)]
    norm_w = [1 + 0.1 * torch.randn(HIDDEN, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(layers)]
    q = torch.randn(1, Q_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=gen)
    residual = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16, generator=gen)
    scale = HEAD_DIM ** -0.5
    o_bytes = HIDDEN * HIDDEN * 2

    def attention(i: int, trigger: bool, table: torch.Tensor) -> torch.Tensor:
        k, v = caches[i]
        return paged_decode(q, k, v, table, seq_lens, scale, None, None, merge_counters=counters,
                            launch_dependents=trigger).view(1, HIDDEN)

    result: dict = {**run.header(layers), "us_per_layer": {}, "rel_err": {}}
    print(f"{result['gpu']}: copy {copy:.2f} TB/s, {sms} SMs", flush=True)
    timed: dict[str, Callable[[], object]] = {}

    def record(key: str, fn: Callable[[], object]) -> None:
        ms = bench_graph(fn)
        if ms is None:
            result["us_per_layer"][key] = "graph capture failed"
            return
        timed[key] = fn
        result["us_per_layer"][key] = [1000 * ms / layers]
        print(f"{key}: {1000 * ms / layers:.2f} us a layer", flush=True)

    def timeline(key: str, projection: OPartials, trigger: bool, table: torch.Tensor) -> None:
        """Layer 1's attention -> o, both stamping, replayed from a CUDA graph (eagerly the host's launch of the
        o comes long after the attention has ended): us from the attention's first start."""
        att = torch.full((KV_HEADS * 256 * 5,), -1, dtype=torch.int64, device=dev)
        o_st = torch.zeros(sms, 3, dtype=torch.int64, device=dev)
        k, v = caches[1]

        def pair() -> None:
            x = paged_decode(q, k, v, table, seq_lens, scale, None, None, merge_counters=counters,
                             launch_dependents=trigger, stamps=att).view(1, HIDDEN)
            projection(x, o_st)

        pair()  # compiles the stamping forms
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            pair()
        for _ in range(2):
            att.fill_(-1)
            graph.replay()
        torch.cuda.synchronize()
        a = att.view(-1, 5)[:, :4]
        t0_ns = int(a[:, 0][a[:, 0] > 0].min())
        a_end = (a.max(dim=1).values - t0_ns).double() / 1000
        a_end = a_end[a[:, 0] > 0]
        o = (o_st - t0_ns).double() / 1000
        line = {"attention programs end": a_end, "o start": o[:, 0], "o wait passed": o[:, 1], "o end": o[:, 2]}
        result.setdefault("timeline_us", {})[key] = {
            n: {"min": float(t.min()), "max": float(t.max())} for n, t in line.items()}
        print(f"   {key} timeline (us from the attention's first start, min / max): " + "; ".join(
            f"{n} {float(t.min()):.1f}/{float(t.max()):.1f}" for n, t in line.items()), flush=True)

    for width, tbl in tables.items():
        tag = f"[{width}] "
        res_e = residual.clone()
        record(tag + "attention alone", lambda t=tbl: [attention(i, False, t) for i in range(layers)])
        x0 = attention(0, False, tbl)
        record(tag + "cuBLAS o alone", lambda x=x0: [triton_ops.linear_partials(x, w_o[i]) for i in range(layers)])
        record(tag + "engine chain (attention, cuBLAS o partials, norm)", lambda t=tbl, r=res_e: [
            triton_ops.add_rms_norm(triton_ops.linear_partials(attention(i, False, t), w_o[i]), r,
                                    norm_w[i], eps) for i in range(layers)])
        want = triton_ops.linear_partials(x0, w_o[0]).sum(0)
        for config in CONFIGS:
            key = tag + config.key
            trigger = config.pdl  # the attention lets a PDL-launched o start at once
            try:
                projections = [OPartials(w_o[i], sms, config) for i in range(layers)]
                got = projections[0](attention(0, trigger, tbl)).sum(0)
                torch.cuda.synchronize()
                result["rel_err"][key] = rel_err(got, want)
                if not result["rel_err"][key] < 1e-2:
                    result["us_per_layer"][key] = f"wrong: rel. error {result['rel_err'][key]:.3g}"
                    print(f"{key}: {result['us_per_layer'][key]}", flush=True)
                    continue
                if not config.pdl:
                    record(f"{key} o alone", lambda p=projections, x=x0: [p[i](x) for i in range(layers)])
                timeline(key, projections[1], trigger, tbl)
                res_p = residual.clone()
                record(f"{key} chain", lambda p=projections, r=res_p, trig=trigger, t=tbl: [
                    triton_ops.add_rms_norm(p[i](attention(i, trig, t)), r, norm_w[i], eps) for i in range(layers)])
            except Exception as e:  # noqa: BLE001  (a config that does not compile or fit is a finding)
                result["us_per_layer"][key] = f"{type(e).__name__}: {e}"[:300]
                print(f"{key}: {result['us_per_layer'][key]}", flush=True)
    for _ in range(1, args.rounds):  # the same graphs captured again, in the same order
        for key, fn in timed.items():
            ms = bench_graph(fn)
            if ms is not None:
                result["us_per_layer"][key].append(1000 * ms / layers)
    result["o_bytes_us_at_copy"] = o_bytes / (copy * 1e12) * 1e6
    print(f"o's weights at copy speed: {result['o_bytes_us_at_copy']:.2f} us a layer")
    print("us a layer, the rounds in turn: " + "; ".join(
        f"{k} {' / '.join(f'{r:.2f}' for r in v)}" if isinstance(v, list) else f"{k} {v}"
        for k, v in result["us_per_layer"].items()), flush=True)
    result["wall_s"] = time.time() - run.t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
