"""GPU benchmark of the paged-KV Triton kernels against torch baselines, with correctness checks.

Measures in one run (CUDA events through triton.testing.do_bench, median):
  * ceilings: a large device-to-device copy (bytes read + written / time) and an 8192^3 bf16 matmul;
  * decode at the issue's (batch, q heads, kv heads, head dim, context, block size) shapes: our paged
    kernel (bf16, fp8, int8 KV), torch SDPA on a contiguous cache, gather-then-SDPA over the same paged
    cache; bandwidth = KV bytes read / time, reported as a fraction of the copy bandwidth;
  * prefill (8,192 cached + 512 new tokens per sequence): our kernel vs gather-then-SDPA, TFLOP/s
    against the matmul.
Every kernel result is checked against prefixgate_kernels.reference on the GPU (a slice of the batch) first.

    python benchmarks/kernels.py [--out benchmarks/results/kernels_h200.json] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.provenance import git_commit  # noqa: E402 - after the path insert
from engine.kv_layout import KVPageLayout  # noqa: E402
from prefixgate_kernels import decode_attention, decode_rows, prefill_attention, skinny_gemm, triton_ops  # noqa: E402
from prefixgate_kernels import reference as ref  # noqa: E402
from prefixgate_kernels.launch_layout import CacheLayout  # noqa: E402

DECODE_SHAPES = [  # (batch, q_heads, kv_heads, head_dim, context, block_size)
    (64, 32, 8, 128, 4096, 16),
    (256, 32, 8, 128, 2048, 16),
    (16, 32, 8, 128, 32768, 16),
    (1, 32, 8, 128, 131072, 16),
]
# Every shape class a Llama-family model produces (issue #19 item 4), timed at the launcher's own
# choices (no sweep): head dim 64/128, GQA ratio 1/3/4/7/8, batch 1-2 at 64K-128K, block size 32.
DECODE_CLASSES = [
    (32, 32, 32, 128, 2048, 16),  # GQA 1 (MHA)
    (32, 24, 8, 128, 4096, 16),  # GQA 3
    (32, 28, 4, 128, 4096, 16),  # GQA 7 (Qwen2-7B)
    (32, 64, 8, 128, 4096, 16),  # GQA 8 (Llama-70B)
    (64, 32, 8, 64, 4096, 16),  # head dim 64, GQA 4
    (64, 9, 3, 64, 4096, 16),  # head dim 64, GQA 3 (SmolLM2-135M)
    (64, 32, 8, 128, 4096, 32),  # block size 32
    (1, 32, 8, 128, 65536, 16),
    (2, 32, 8, 128, 65536, 16),
    (2, 32, 8, 128, 131072, 16),
    (64, 9, 3, 64, 4096, 32),  # head dim 64, GQA 3, block size 32 (whole-row pages of 6 KB, K only)
]
MIXED_LENS = (32, 100, 8000)  # batch of 32, lengths uniform in [100, 8000]
DECODE_SPLITS = [1, 2, 4, 8, 16, 32, 64, 128, 256]  # swept with each DECODE_TILES entry (bf16; --full-sweeps)
DECODE_TILES = [(64, 4, 2)]  # (block_n, num_warps, num_stages); run 2 also tried (32, 4, 3): slower
# 8-bit KV (bn, warps, stages, v_pairs): the session-2 default (64, 4, 2), its 128-token tile, and the
# deeper cp.async rings of prefixgate_kernels.decode_attention.choose_tiles (stages 5-6: two tiles, 7: three).
# Session 2 also timed (64, 4, 2, False): 1.5-1.9x slower than the pairs path, dropped.
# Session 3 run 1 also timed (128, 4, 2), (64, 4, 7), (64, 8, 5): none better than (64, 4, 5) or
# (128, 4, 5) on any shape (kernels_h200_s3run1.json), dropped.
# Session 7 added two 8-bit candidates for more warps in flight per SM (the fp8 128-token ring runs 3
# programs per SM, held there by registers and shared memory alike: 141-150 registers, 75 KB): one
# buffer and a 128-register cap (41 KB, 4 per SM, no spill in the sm_90 compile of Triton 3.9), and
# 8 warps a program (98 registers, 2 per SM = 16 warps). (bn, warps, stages, v_pairs, register cap)
QUANT_TILES = [(64, 4, 2, True, None), (64, 4, 5, True, None), (128, 4, 5, True, None),
               (128, 4, 2, True, 128), (128, 8, 5, True, None)]
# Head dim 64, 8-bit (session 8, for the next device time): fp8 reads at ~52 % of copy there (1.21x
# bf16 at 64 x 4K) against 86 % for bf16. The launcher's 128-token ring (96 registers, 40 KB: 5 per SM
# by both, its splits fitted to 4), a 256-token tile with one buffer (140 registers, 43 KB: 3 per SM)
# and with the ring (178 registers, 78 KB: 2 per SM), 8 warps; none spills in the sm_90 compile here.
QUANT_TILES_HD64 = [(128, 4, 5, True, None), (256, 4, 2, True, None), (256, 4, 5, True, None),
                    (128, 8, 5, True, None)]
PREV_TILES = (64, 4, 2)  # the launcher's tiles before choose_tiles (session 2), timed beside its choice
# fp8 head dim 128 has two tile sets (session 8): choose_tiles picks one by the launch's (sequence, kv
# head) pairs against the SMs; the other is timed beside it on every shape (`fp8_other_tiles`).
FP8_TILE_SETS = {"ring": decode_attention.EIGHT_BIT_RING, "wave": decode_attention.FP8_WAVE_TILES}
# Prefix-hit launches swept over the split count (session 4): (label, block_m, block_n, warps, stages)
PREFILL_SPLIT_TILES = [("m128", 128, 128, 8, 3), ("m64", 64, 64, 4, 3)]
PREFILL_SPLITS = (1, 2, 4, 8)
PREFILL_VARIANTS = [  # (block_m, block_n, num_warps, num_stages); session 4 added the deeper rings
    (128, 128, 8, 3), (128, 128, 8, 2), (128, 128, 8, 4), (128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 8, 5),
    (128, 128, 4, 3), (64, 128, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4),
]


def bench(fn) -> float:
    """Median milliseconds of fn over ~200 ms of repeats, after warm-up."""
    return float(triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median"))


def bench_graph(fn) -> float | None:
    """Median milliseconds of one CUDA-graph replay of fn: launch overhead removed, as in the engine's
    graph-captured decode. None if capture fails (recorded, never fatal)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return bench(graph.replay)
    except Exception as e:  # noqa: BLE001
        print(f"graph capture failed: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    out, want = out.double(), want.double()
    if not torch.isfinite(out).all():
        return float("nan")
    return float((out - want).norm() / want.norm().clamp(min=1e-12))


def ceilings() -> dict:
    n = 1 << 30  # 1 GiB of bf16 per side: far past the 60 MB L2
    x = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    copy_tbs = 2 * n / (ms * 1e-3) / 1e12
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms_mm = bench(lambda: a @ b)
    return {"copy_TBps": copy_tbs, "copy_ms": ms, "matmul_bf16_TFLOPs": 2 * 8192**3 / (ms_mm * 1e-3) / 1e12}


PAGE_LAYOUTS = ("token", "head")
# what EngineConfig(kv_page_layout="auto") lays out on a GPU: the pages the suite's figures should describe
ENGINE_CUDA_LAYOUT = KVPageLayout.for_device(torch.device("cuda")).value


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` [.., BS, Hkv, D] with the same values, each page's bytes laid head by head ([.., Hkv, BS, D] in
    memory; ``engine.kv_layout.KVPageLayout.HEAD``): a (sequence, KV head) program reads BS x D contiguous bytes a
    page, not BS rows of D bytes Hkv x D apart. The kernels take the strides as given."""
    return cache.transpose(-3, -2).contiguous().transpose(-3, -2)


def random_pages(num_blocks, block_size, kv_heads, head_dim, gen, device="cuda", layout="token") -> torch.Tensor:
    """A random bf16 block-major cache [NB, 1, 2, BS, Hkv, D]; ``layout`` "head": each page laid head by head."""
    if layout not in PAGE_LAYOUTS:
        raise ValueError(f"layout must be one of {PAGE_LAYOUTS}, got {layout!r}")
    kv = torch.randn(num_blocks, 1, 2, block_size, kv_heads, head_dim, device=device, dtype=torch.bfloat16,
                     generator=gen)
    return head_major(kv) if layout == "head" else kv


def paged_setup(batch, kv_heads, head_dim, context, block_size, gen, device="cuda", layout="token"):
    """A block-major cache [NB, 1, 2, BS, Hkv, D] bf16 with shuffled block tables (fragmented pages);
    ``layout`` "head": the same shape with each page laid head by head (``head_major``)."""
    per_seq = context // block_size
    num_blocks = batch * per_seq
    kv = random_pages(num_blocks, block_size, kv_heads, head_dim, gen, device, layout)
    perm = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    tables = perm.view(batch, per_seq).contiguous()
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return kv, tables, lens


def quantize_cache(kv: torch.Tensor, dtype: torch.dtype):
    """bf16 cache -> (quantized cache, k_scale, v_scale) with the reference's scale conventions; the quantized
    cache keeps ``kv``'s strides (its page layout)."""
    if dtype == ref.FP8_DTYPE:
        amax = kv.abs().amax().float()
        s = (amax / ref.FP8_MAX).reshape(1)
        out = torch.empty_like(kv, dtype=dtype)
        out.copy_((kv.float() / s).clamp(-ref.FP8_MAX, ref.FP8_MAX))
        return out, s, s.clone()
    q = torch.empty_like(kv, dtype=torch.int8)
    scales = []
    for i in range(2):
        x = kv[:, 0, i].float()  # [NB, BS, H, D]
        s = x.abs().amax(-1).clamp(min=1e-8) / ref.INT8_MAX  # [NB, BS, H]
        q[:, 0, i] = torch.round(x / s.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        scales.append(s.contiguous())
    return q, scales[0], scales[1]


def sdpa_contiguous_ms(q4, batch, kv_heads, context, head_dim, scale, gen) -> float:
    kc = torch.randn(batch, kv_heads, context, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn_like(kc)
    return bench(lambda: F.scaled_dot_product_attention(q4, kc, vc, scale=scale))


def decode_case(shape, gen, ceil: dict, quick: bool, full_sweeps: bool = False, compare_tiles: bool = True,
                layout: str = "token") -> dict:
    """One decode shape: the launcher's choice (eager and graph replay) against SDPA, fp8 and int8;
    ``compare_tiles`` also times the tiles it did not pick (the session-2 tiles, the other fp8 set); ``layout``:
    the cache's page layout (``paged_setup``)."""
    batch, q_heads, kv_heads, head_dim, context, block_size = shape
    scale = 1 / math.sqrt(head_dim)
    kv, tables, lens = paged_setup(batch, kv_heads, head_dim, context, block_size, gen, layout=layout)
    k_cache, v_cache = kv[:, 0, 0], kv[:, 0, 1]  # strided layer views, as the engine passes them
    q = torch.randn(batch, q_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * kv.element_size()
    row: dict = {"shape": dict(zip(["batch", "q_heads", "kv_heads", "head_dim", "context", "block_size"], shape)),
                 "page_layout": layout}
    n_check = min(batch, 4)

    def check(out, kc, vc, ks=None, vs=None):
        want = ref.paged_decode_attention(q[:n_check], kc, vc, tables[:n_check], lens[:n_check], scale, ks, vs)
        return rel_err(out[:n_check], want)

    out = triton_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    # Timed before the reference check: in run 3 a timing taken right after the 131072-token reference
    # read 0.265 ms and the same call 0.141 ms later in the case.
    ms = bench(lambda: triton_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale))
    row["bf16_rel_err"] = check(out, k_cache, v_cache)
    row["bf16_ms"] = ms
    # Added after run 4, where the 1 x 131072 shape (0.14 ms of GPU work) read 0.17-0.23 ms eagerly
    # through the checked launcher: host-bound. Graph replay times the kernels alone.
    row["bf16_graph_ms"] = bench_graph(lambda: triton_ops.paged_decode_attention(
        q, k_cache, v_cache, tables, lens, scale))
    # The same call timed again at the end of the case: the spread between the two is the noise floor.
    row["bf16_TBps"] = kv_bytes / (ms * 1e-3) / 1e12
    row["bf16_pct_copy"] = row["bf16_TBps"] / ceil["copy_TBps"]
    if head_dim <= 64 and layout == "token":  # decode_rows reads whole token rows: token pages only
        rows_case(row, "bf16", q, k_cache, v_cache, tables, lens, scale, None, None, check)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = decode_attention.choose_tiles(head_dim, kv.dtype, batch * kv_heads, sms)
    row["tiles"] = {"block_n": tiles.block_n, "num_stages": tiles.num_stages, "num_warps": tiles.num_warps}
    row["num_splits"] = decode_attention.choose_num_splits(
        batch, kv_heads, tables.shape[1] * block_size, sms, tiles.block_n, programs_per_sm=tiles.programs_per_sm,
        one_wave=decode_attention.one_wave_rule_for(kv.dtype))
    if compare_tiles:
        prev_tiles_ms(row, "bf16", q, k_cache, v_cache, tables, lens, scale, None, None, tiles)
    if not quick and full_sweeps:
        variants = {}
        cap = max(1, context // 256)
        for bn, nw, ns in DECODE_TILES:
            for splits in [x for x in DECODE_SPLITS if x <= cap]:
                def run(bn=bn, nw=nw, ns=ns, splits=splits):
                    return decode_attention.paged_decode(q, k_cache, v_cache, tables, lens, scale, None, None,
                                                         num_splits=splits, block_n=bn, num_warps=nw,
                                                         num_stages=ns)
                err = check(run(), k_cache, v_cache)
                variants[f"bn{bn}_w{nw}_s{ns}_splits{splits}"] = {"ms": bench(run), "rel_err": err}
        row["bf16_variants"] = variants

    # torch SDPA over a contiguous cache [B, Hkv, ctx, D]; GQA as [B, Hkv, group, D] queries (no mask needed
    # for one decode token), the fastest form we know for SDPA.
    q4 = q.view(batch, kv_heads, q_heads // kv_heads, head_dim)
    row["sdpa_contig_ms"] = sdpa_contiguous_ms(q4, batch, kv_heads, context, head_dim, scale, gen)

    def gather_sdpa():
        ids = tables.long()
        k = k_cache[ids].reshape(batch, context, kv_heads, head_dim).transpose(1, 2)
        v = v_cache[ids].reshape(batch, context, kv_heads, head_dim).transpose(1, 2)
        return F.scaled_dot_product_attention(q4, k, v, scale=scale)

    g = gather_sdpa().reshape(batch, q_heads, head_dim)
    row["gather_sdpa_rel_err"] = rel_err(g, out)
    row["gather_sdpa_ms"] = bench(gather_sdpa)

    for name, dtype in (("fp8", ref.FP8_DTYPE), ("int8", torch.int8)):
        qkv, ks, vs = quantize_cache(kv, dtype)
        kq, vq = qkv[:, 0, 0], qkv[:, 0, 1]
        outq = triton_ops.paged_decode_attention(q, kq, vq, tables, lens, scale, ks, vs)
        row[f"{name}_rel_err"] = check(outq, kq, vq, ks, vs)
        row[f"{name}_vs_bf16_rel_err"] = rel_err(outq, out)
        row[f"{name}_ms"] = bench(lambda kq=kq, vq=vq, ks=ks, vs=vs: triton_ops.paged_decode_attention(
            q, kq, vq, tables, lens, scale, ks, vs))
        qbytes = kv_bytes // 2 + (2 * ks.numel() * 4 if dtype == torch.int8 else 0)
        row[f"{name}_TBps"] = qbytes / (row[f"{name}_ms"] * 1e-3) / 1e12
        row[f"{name}_speedup_vs_bf16"] = row["bf16_ms"] / row[f"{name}_ms"]
        row[f"{name}_graph_ms"] = bench_graph(lambda kq=kq, vq=vq, ks=ks, vs=vs: triton_ops.paged_decode_attention(
            q, kq, vq, tables, lens, scale, ks, vs))
        if name == "fp8" and head_dim <= 64 and layout == "token":
            rows_case(row, name, q, kq, vq, tables, lens, scale, ks, vs, check)
        if decode_attention.joined_kv_heads(head_dim, kv_heads, kq.dtype) > 1:
            # the launcher reads KV heads in pairs or threes here (sessions 14, 17): the per-head launch beside it
            def per_head(kq=kq, vq=vq, ks=ks, vs=vs):
                return decode_attention.paged_decode(q, kq, vq, tables, lens, scale, ks, vs, joined_heads=1)
            row[f"{name}_per_head"] = {"rel_err": rel_err(per_head()[:n_check], outq[:n_check]),
                                       "ms": bench(per_head), "graph_ms": bench_graph(per_head)}
        qtiles = decode_attention.choose_tiles(head_dim, kq.dtype, batch * kv_heads, sms)
        if compare_tiles and head_dim == 128 and name == "fp8":
            # the fp8 tile set the launcher did not pick, beside its choice; int8's tiles before
            # session 8 are timed by prev_tiles_ms below (`int8_prev_tiles_ms`)
            label, cand = next((k, t) for k, t in FP8_TILE_SETS.items() if t != qtiles)
            c_splits = decode_attention.choose_num_splits(batch, kv_heads, tables.shape[1] * block_size, sms,
                                                          cand.block_n, programs_per_sm=cand.programs_per_sm)

            def run_cand(kq=kq, vq=vq, ks=ks, vs=vs, cand=cand, c_splits=c_splits):
                return decode_attention.paged_decode(q, kq, vq, tables, lens, scale, ks, vs, num_splits=c_splits,
                                                     block_n=cand.block_n, num_warps=cand.num_warps,
                                                     num_stages=cand.num_stages, max_registers=cand.max_registers)
            want_q = ref.paged_decode_attention(q[:n_check], kq, vq, tables[:n_check], lens[:n_check], scale, ks, vs)
            row["fp8_other_tiles"] = {"tiles": label, "splits": c_splits,
                                      "rel_err": rel_err(run_cand()[:n_check], want_q),
                                      "ms": bench(run_cand), "graph_ms": bench_graph(run_cand)}
        row[f"{name}_tiles"] = {"block_n": qtiles.block_n, "num_stages": qtiles.num_stages,
                                "programs_per_sm": qtiles.programs_per_sm, "max_registers": qtiles.max_registers,
                                "num_splits": decode_attention.choose_num_splits(
                                    batch, kv_heads, tables.shape[1] * block_size, sms, qtiles.block_n,
                                    programs_per_sm=qtiles.programs_per_sm)}
        if compare_tiles:
            prev_tiles_ms(row, name, q, kq, vq, tables, lens, scale, ks, vs, qtiles)
        if not quick:
            tiles = {}
            for bn, nw, ns, vp, mr in (QUANT_TILES_HD64 if head_dim == 64 else QUANT_TILES):
                def runq(bn=bn, nw=nw, ns=ns, vp=vp, mr=mr, kq=kq, vq=vq, ks=ks, vs=vs):
                    return decode_attention.paged_decode(q, kq, vq, tables, lens, scale, ks, vs, block_n=bn,
                                                         num_warps=nw, num_stages=ns, v_pairs=vp, max_registers=mr)
                err = rel_err(runq()[:n_check], ref.paged_decode_attention(
                    q[:n_check], kq, vq, tables[:n_check], lens[:n_check], scale, ks, vs))
                # graph replays too: an eager launch of the small shapes times the host, not the kernel
                tiles[f"bn{bn}_w{nw}_s{ns}_pairs{int(vp)}" + (f"_regs{mr}" if mr else "")] = {
                    "ms": bench(runq), "graph_ms": bench_graph(runq), "rel_err": err}
            row[f"{name}_variants"] = tiles
        del qkv, kq, vq
    row["bf16_ms_repeat"] = bench(lambda: triton_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale))
    row["vs_sdpa_contig"] = row["sdpa_contig_ms"] / row["bf16_ms"]
    row["vs_gather_sdpa"] = row["gather_sdpa_ms"] / row["bf16_ms"]
    del kv
    torch.cuda.empty_cache()
    return row


def rows_case(row: dict, name: str, q, kc, vc, tables, lens, scale, ks, vs, check) -> None:
    """``decode_rows.paged_decode_rows`` (every KV head of a token read as one row; session 32) on a class's
    cache, eager and graph replays, checked against the reference: ``row[f"{name}_rows"]``."""
    def run():
        return decode_rows.paged_decode_rows(q, kc, vc, tables, lens, scale, ks, vs)

    try:
        row[f"{name}_rows"] = {"rel_err": check(run(), kc, vc, ks, vs), "ms": bench(run), "graph_ms": bench_graph(run)}
    except Exception as e:  # noqa: BLE001 - a candidate's failure is recorded, never the class row's loss
        row[f"{name}_rows_error"] = f"{type(e).__name__}: {e}"


def prev_tiles_ms(row: dict, name: str, q, kc, vc, tables, lens, scale, ks, vs, tiles) -> None:
    """Time the session-2 tiles (PREV_TILES) where choose_tiles now picks others: the evidence that
    a shape class did not lose. Split count: the launcher's for those tiles, as before."""
    bn, nw, ns = PREV_TILES
    if (tiles.block_n, tiles.num_warps, tiles.num_stages) == (bn, nw, ns):
        return
    def run():
        return decode_attention.paged_decode(q, kc, vc, tables, lens, scale, ks, vs, block_n=bn, num_warps=nw,
                                             num_stages=ns)
    run()
    row[f"{name}_prev_tiles_ms"] = bench(run)
    row[f"{name}_prev_tiles_graph_ms"] = bench_graph(run)


def graph_shaped_setup(batch, q_heads, kv_heads, head_dim, context, table_tokens, block_size, gen):
    """``paged_setup``'s cache and tables, the tables also padded to ``table_tokens`` (``wide``: as a
    decode CUDA graph's static table is), and bf16 queries -> (kv, tables, wide, lens, q)."""
    kv, tables, lens = paged_setup(batch, kv_heads, head_dim, context, block_size, gen)
    pad = table_tokens // block_size - tables.shape[1]
    wide = torch.cat([tables, torch.zeros(batch, pad, dtype=tables.dtype, device="cuda")], 1)
    q = torch.randn(batch, q_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    return kv, tables, wide, lens, q


def graph_split_case(gen, ceil: dict, batches=(1, 8, 32, 128), context=2048, table_tokens=8448, q_heads=32, kv_heads=8,
                     head_dim=128, block_size=16) -> dict:
    """The decode launch as a CUDA graph makes it: no length hint, a block table as wide as the longest
    context the graph may meet (``table_tokens``: the engine benchmark's 8,448), live contexts of
    ``context``. Graph replays, bf16 and fp8: the splits at fixed offsets of the table's capacity
    (``split_by_length=False``, the launcher before session 12) against each context cut into the
    split count (the launcher's default without a hint), and the same batch in a table exactly as
    wide as its contexts (the launcher's best case, where both placements are one)."""
    rows = []
    scale = 1 / math.sqrt(head_dim)
    for batch in batches:
        kv, tables, wide, lens, q = graph_shaped_setup(batch, q_heads, kv_heads, head_dim, context, table_tokens,
                                                       block_size, gen)
        row: dict = {"shape": {"batch": batch, "context": context, "table_tokens": table_tokens, "q_heads": q_heads,
                               "kv_heads": kv_heads, "head_dim": head_dim, "block_size": block_size}}
        for name, dtype in (("bf16", torch.bfloat16), ("fp8", ref.FP8_DTYPE)):
            cache, ks, vs = (kv, None, None) if dtype == torch.bfloat16 else quantize_cache(kv, dtype)
            k_cache, v_cache = cache[:, 0, 0], cache[:, 0, 1]
            kv_bytes = 2 * batch * context * kv_heads * head_dim * cache.element_size()
            want = ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, ks, vs)

            def run(t, by_length, q=q, lens=lens, k_cache=k_cache, v_cache=v_cache, ks=ks, vs=vs):
                return decode_attention.paged_decode(q, k_cache, v_cache, t, lens, scale, ks, vs,
                                                     split_by_length=by_length)
            for label, t, by_length in (("fixed", wide, False), ("by_length", wide, True), ("exact_table", tables, None)):
                ms = bench_graph(lambda t=t, b=by_length: run(t, b)) or float("nan")
                row[f"{name}_{label}"] = {"graph_ms": ms, "pct_copy": kv_bytes / (ms * 1e-3) / 1e12 / ceil["copy_TBps"],
                                          "rel_err": rel_err(run(t, by_length), want)}
            del cache, k_cache, v_cache
        rows.append(row)
        del kv
    return {"rows": rows}


# fp8 classes under 1.6x bf16 after session 14, all with few (sequence, kv head) pairs: GQA 7 (128 pairs),
# 1 x 64K (8), 2 x 64K (16). Indices into DECODE_CLASSES.
FEW_PAIR_CLASSES = (2, 7, 8)
# The classes the default run also times chained (few_pair_chain_case): the few-pair ones and the two
# 9 / 3 head-dim-64 classes, whose fp8 / bf16 one launch a graph stayed under 1.6 on the H100 in session
# 39 (1.58 / 1.56 on head pages) and whose chained figure on head pages had not been measured.
CHAIN_CLASSES = (*FEW_PAIR_CLASSES, 5, 10)


def fp8_split_sweep_case(gen, classes=FEW_PAIR_CLASSES, device="cuda", timer=None) -> list[dict]:
    """fp8 decode on the few-pair classes at split counts around the launcher's (a quarter, a half,
    its own, twice), with each fp8 tile set, as CUDA-graph replays, against the reference; the bf16
    launcher's replay beside them for the ratio. Where a launch streams ~32-64 us, the splits' ramp
    and the last split's merge weigh: is another count, or the other tile set, faster?
    ``timer`` (default ``bench_graph``) and ``device`` let the flow run on the CPU's interpreter."""
    return [_fp8_split_row(DECODE_CLASSES[i], gen, device, timer or bench_graph) for i in classes]


def _fp8_split_row(shape, gen, device: str, timer) -> dict:
    batch, q_heads, kv_heads, head_dim, context, block_size = shape
    sms = decode_attention.num_sms(torch.device(device))
    scale = 1 / math.sqrt(head_dim)
    kv, tables, lens = paged_setup(batch, kv_heads, head_dim, context, block_size, gen, device=device)
    q = torch.randn(batch, q_heads, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
    row: dict = {"shape": dict(zip(["batch", "q_heads", "kv_heads", "head_dim", "context", "block_size"], shape))}
    row["bf16_graph_ms"] = timer(lambda: triton_ops.paged_decode_attention(q, kv[:, 0, 0], kv[:, 0, 1], tables,
                                                                           lens, scale))
    qkv, ks, vs = quantize_cache(kv, ref.FP8_DTYPE)
    kq, vq = qkv[:, 0, 0], qkv[:, 0, 1]
    n_check = min(batch, 2)
    want = ref.paged_decode_attention(q[:n_check], kq, vq, tables[:n_check], lens[:n_check], scale, ks, vs)
    row["launcher_graph_ms"] = timer(lambda: triton_ops.paged_decode_attention(q, kq, vq, tables, lens, scale, ks, vs))
    picked = decode_attention.choose_tiles(head_dim, kq.dtype, batch * kv_heads, sms)
    row["launcher_tiles"] = next(k for k, t in FP8_TILE_SETS.items() if t == picked)
    # the launcher's launch with the merge in a second kernel: how much the last split's merge costs here
    row["second_kernel_merge_graph_ms"] = timer(lambda: decode_attention.paged_decode(
        q, kq, vq, tables, lens, scale, ks, vs, fused_merge=False))
    # as the engine launches: one merge-counter buffer for every launch (no zeroing kernel in the graph),
    # bf16 and fp8 alike; and fp8 with the merge reading 16 splits' partials at a time
    counters = torch.zeros(batch * kv_heads, dtype=torch.int32, device=device)
    row["bf16_persistent_graph_ms"] = timer(lambda: triton_ops.paged_decode_attention(
        q, kv[:, 0, 0], kv[:, 0, 1], tables, lens, scale, merge_counters=counters))
    row["launcher_persistent_graph_ms"] = timer(lambda: triton_ops.paged_decode_attention(
        q, kq, vq, tables, lens, scale, ks, vs, merge_counters=counters))
    chunk16 = decode_attention.paged_decode(q, kq, vq, tables, lens, scale, ks, vs, merge_counters=counters,
                                            merge_chunk=16)
    row["chunk16_rel_err"] = rel_err(chunk16[:n_check], want)
    row["chunk16_persistent_graph_ms"] = timer(lambda: decode_attention.paged_decode(
        q, kq, vq, tables, lens, scale, ks, vs, merge_counters=counters, merge_chunk=16))
    cap = max(1, min(256, context // 128))
    for label, tiles in FP8_TILE_SETS.items():
        own = decode_attention.choose_num_splits(batch, kv_heads, context, sms, tiles.block_n,
                                                 programs_per_sm=tiles.programs_per_sm)
        for splits in sorted({max(1, own // 4), max(1, own // 2), own, min(cap, 2 * own)}):
            def run(tiles=tiles, splits=splits):
                return decode_attention.paged_decode(q, kq, vq, tables, lens, scale, ks, vs, num_splits=splits,
                                                     block_n=tiles.block_n, num_warps=tiles.num_warps,
                                                     num_stages=tiles.num_stages, max_registers=tiles.max_registers)
            row[f"{label}_splits{splits}"] = {"own": splits == own, "rel_err": rel_err(run()[:n_check], want),
                                              "graph_ms": timer(run)}
    return row


# One sequence, 32 / 8 heads, head dim 128: the contexts launch_floor_case times the launcher at.
FLOOR_CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)


def launch_floor_case(gen, contexts=FLOOR_CONTEXTS, device="cuda", timer=None) -> dict:
    """What a decode launch costs beyond its stream. Batch 1 (32 / 8 heads, head dim 128) over
    ``contexts``, bf16 and fp8, as CUDA-graph replays of the launcher: with a fresh merge-counter
    buffer (a zeroing kernel in the graph: how the other rows of this benchmark time it) and with
    one persistent buffer (as the engine launches); fp8 also with the merge reading 16 splits at a
    time. A least-squares line through time against KV bytes gives each a stream rate (its slope)
    and a fixed cost (its intercept), and a graph of one kernel over one element gives the harness's
    own floor. Where the fixed cost is the same for bf16 and fp8, it pulls their ratio towards 1 on
    short launches: (S + F) / (S / r + F)."""
    timer = timer or bench_graph
    one = torch.zeros(1, device=device)
    null_ms = timer(lambda: one.add_(1.0))
    rows = [_floor_row(context, gen, device, timer) for context in contexts]
    fits = {}
    for name, keys in (("bf16", ("fresh_ms", "persistent_ms")), ("fp8", ("fresh_ms", "persistent_ms", "chunk16_ms"))):
        for key in keys:
            pts = [(r[name]["kv_bytes"], r[name][key]) for r in rows if r[name].get(key) is not None]
            fits[f"{name}_{key[:-3]}"] = line_fit(pts)
    return {"null_graph_ms": null_ms, "rows": rows, "fits": fits}


def _floor_row(context: int, gen, device: str, timer) -> dict:
    """One context of ``launch_floor_case``: bf16 and fp8, fresh and persistent counters (fp8: also chunk 16)."""
    kv, tables, lens = paged_setup(1, 8, 128, context, 16, gen, device=device)
    q = torch.randn(1, 32, 128, device=device, dtype=torch.bfloat16, generator=gen)
    scale = 1 / math.sqrt(128)
    counters = torch.zeros(8, dtype=torch.int32, device=device)
    sms = decode_attention.num_sms(q.device)
    row: dict = {"context": context}
    for name, dtype in (("bf16", torch.bfloat16), ("fp8", ref.FP8_DTYPE)):
        cache, ks, vs = (kv, None, None) if dtype == torch.bfloat16 else quantize_cache(kv, dtype)
        kc, vc = cache[:, 0, 0], cache[:, 0, 1]
        tiles = decode_attention.choose_tiles(128, dtype, 8, sms)

        def run(fresh: bool = False, chunk: int | None = None, kc=kc, vc=vc, ks=ks, vs=vs) -> torch.Tensor:
            return decode_attention.paged_decode(q, kc, vc, tables, lens, scale, ks, vs, merge_chunk=chunk,
                                                 merge_counters=None if fresh else counters)
        got = {"kv_bytes": 2 * context * 8 * 128 * cache.element_size(),
               "splits": decode_attention.choose_num_splits(1, 8, context, sms, tiles.block_n,
                                                            programs_per_sm=tiles.programs_per_sm),
               "rel_err": rel_err(run(), ref.paged_decode_attention(q, kc, vc, tables, lens, scale, ks, vs)),
               "fresh_ms": timer(lambda run=run: run(fresh=True)),
               "persistent_ms": timer(run)}
        if name == "fp8":
            got["chunk16_ms"] = timer(lambda run=run: run(chunk=16))
        row[name] = got
        del cache, kc, vc
    return row


# (label, batch, context, table tokens, kv dtype) for launch_stamps_case: the few-pair classes, and the
# engine's decode launch at batch 1 and 32 over 2K (a graph's table, 8,448 tokens wide)
STAMP_SHAPES = (("1x64K", 1, 65536, 65536, "bf16"), ("1x64K", 1, 65536, 65536, "fp8"),
                ("1x4K", 1, 4096, 4096, "bf16"), ("1x4K", 1, 4096, 4096, "fp8"),
                ("1x2K_graph", 1, 2048, 8448, "bf16"), ("32x2K_graph", 32, 2048, 8448, "bf16"))


def launch_stamps_case(gen, shapes=STAMP_SHAPES, replays: int = 5, device="cuda") -> list[dict]:
    """Inside one decode launch (32 / 8 heads, head dim 128, persistent merge counters, CUDA-graph
    replays): each program's GPU-timer stamps (``paged_decode``'s ``stamps``), summarised per replay
    and the median over ``replays`` taken. In microseconds from the first program's start: when the
    last program starts, each program's stream (start to its split's last key), the partial's store
    and count, the merge, and the launch's span (first start to last stamp); beside it the replay as
    ``bench_graph`` times it. Their difference is what the graph launch and the harness add."""
    rows = []
    scale = 1 / math.sqrt(128)
    for label, batch, context, table_tokens, kv_name in shapes:
        kv, tables, wide, lens, q = graph_shaped_setup(batch, 32, 8, 128, context, table_tokens, 16, gen)
        cache, ks, vs = (kv, None, None) if kv_name == "bf16" else quantize_cache(kv, ref.FP8_DTYPE)
        kc, vc = cache[:, 0, 0], cache[:, 0, 1]
        counters = torch.zeros(batch * 8, dtype=torch.int32, device=device)
        stamps = torch.full((batch * 8 * 256 * 5,), -1, dtype=torch.int64, device=device)

        def run(stamped: bool, kc=kc, vc=vc, ks=ks, vs=vs, wide=wide, lens=lens, q=q, counters=counters,
                stamps=stamps) -> torch.Tensor:
            return decode_attention.paged_decode(q, kc, vc, wide, lens, scale, ks, vs, merge_counters=counters,
                                                 stamps=stamps if stamped else None)
        want = ref.paged_decode_attention(q, kc, vc, wide, lens, scale, ks, vs)
        row: dict = {"label": label, "kv": kv_name, "batch": batch, "context": context, "table_tokens": table_tokens,
                     "rel_err": rel_err(run(True), want), "graph_ms": bench_graph(lambda run=run: run(False)),
                     "stamped_graph_ms": bench_graph(lambda run=run: run(True))}
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(True)
        per_replay = []
        for _ in range(replays):
            stamps.fill_(-1)
            torch.cuda.synchronize()
            graph.replay()
            torch.cuda.synchronize()
            per_replay.append(summarise_stamps(stamps.view(-1, 5).cpu()))
        row["replays"] = per_replay
        row.update({k: statistics.median(r[k] for r in per_replay) for k, v in per_replay[0].items()
                    if isinstance(v, float)})
        row.update({k: v for k, v in per_replay[0].items() if not isinstance(v, float)})
        rows.append(row)
        print(f"stamps {label} {kv_name}: replay {row['graph_ms'] * 1000:.1f} us (stamped {row['stamped_graph_ms'] * 1000:.1f}), "
              f"span {row['span_us']:.1f} us over {row['programs']} programs: last start {row['last_start_us']:.1f}, "
              f"stream median {row['stream_med_us']:.1f} / max {row['stream_max_us']:.1f}, stream ends "
              f"{row['first_stream_end_us']:.1f}-{row['last_stream_end_us']:.1f}, count {row['count_med_us']:.2f}, "
              f"merge median {row['merge_med_us']:.2f} / max {row['merge_max_us']:.2f}; {row['sms']} SMs, "
              f"{row['fewest_on_an_sm']}-{row['most_on_an_sm']} programs each, last stream end by programs on the SM "
              + ", ".join(f"{k}: {v:.1f}" for k, v in row["last_end_by_programs_on_sm_us"].items())
              + f"; err {row['rel_err']:.1e}", flush=True)
        del kv, cache, kc, vc
    return rows


def chained_layers_setup(batch, q_heads, kv_heads, head_dim, context, table_tokens, block_size, layers, gen):
    """A decode step's attention inputs, graph-shaped (``graph_shaped_setup``), with ``layers`` caches
    (one per layer: the first is ``graph_shaped_setup``'s, the rest random), the launcher's tiles for
    the batch and one zeroed merge-counter buffer -> (kv, wide, lens, q, caches, tiles, counters)."""
    kv, _, wide, lens, q = graph_shaped_setup(batch, q_heads, kv_heads, head_dim, context, table_tokens, block_size,
                                              gen)
    caches = [kv] + [torch.randn_like(kv) for _ in range(layers - 1)]
    tiles = decode_attention.choose_tiles(head_dim, kv.dtype, batch * kv_heads, decode_attention.num_sms(q.device))
    counters = torch.zeros(batch * kv_heads, dtype=torch.int32, device="cuda")
    return kv, wide, lens, q, caches, tiles, counters


def chain_split_sweep_case(gen, batches=(1, 8, 32), context=2048, table_tokens=8448, layers=32, q_heads=32,
                           kv_heads=8, head_dim=128, block_size=16) -> list[dict]:
    """Is the launcher's split count right for the engine's decode launches? Graph-shaped launches (no
    length hint, a table ``table_tokens`` wide, each live context cut into the count) of batch x 2K,
    bf16, ``layers`` of them back to back in one CUDA graph (each over its own cache, as a decode
    step runs them) at half, once, twice and four times the launcher's count; for each count one
    launch's stamps too (``summarise_stamps``: how far apart its streams end, the tail that more,
    shorter programs could fill)."""
    rows = []
    scale = 1 / math.sqrt(head_dim)
    for batch in batches:
        kv, wide, lens, q, caches, tiles, counters = chained_layers_setup(
            batch, q_heads, kv_heads, head_dim, context, table_tokens, block_size, layers, gen)
        own = decode_attention.choose_num_splits(batch, kv_heads, table_tokens, decode_attention.num_sms(q.device),
                                                 tiles.block_n, programs_per_sm=tiles.programs_per_sm)
        stamps = torch.full((batch * kv_heads * 256 * 5,), -1, dtype=torch.int64, device="cuda")
        want = ref.paged_decode_attention(q, kv[:, 0, 0], kv[:, 0, 1], wide, lens, scale)
        row: dict = {"batch": batch, "context": context, "table_tokens": table_tokens, "layers": layers,
                     "launcher_splits": own, "counts": {}}
        for splits in sorted({max(1, own // 2), own, 2 * own, 4 * own}):
            def launch(c, stamped=False, splits=splits, q=q, wide=wide, lens=lens, counters=counters,
                       stamps=stamps) -> torch.Tensor:
                return decode_attention.paged_decode(q, c[:, 0, 0], c[:, 0, 1], wide, lens, scale, None, None,
                                                     num_splits=splits, merge_counters=counters,
                                                     stamps=stamps if stamped else None)
            err = rel_err(launch(kv), want)
            ms = bench_graph(lambda launch=launch, caches=caches: [launch(c) for c in caches])
            stamps.fill_(-1)
            launch(kv, stamped=True)
            torch.cuda.synchronize()
            st = summarise_stamps(stamps.view(-1, 5).cpu())
            row["counts"][splits] = {"us_per_launch": None if ms is None else 1000 * ms / layers, "rel_err": err,
                                     "span_us": st["span_us"], "stream_ends_us": (st["first_stream_end_us"],
                                                                                  st["last_stream_end_us"]),
                                     "merge_med_us": st["merge_med_us"], "programs": st["programs"]}
        rows.append(row)
        print(f"chain splits {batch} x {context} (launcher {own}): " + "  ".join(
            f"{k}: {v['us_per_launch'] or float('nan'):.2f} us (ends {v['stream_ends_us'][0]:.1f}-"
            f"{v['stream_ends_us'][1]:.1f}, merge {v['merge_med_us']:.1f})" for k, v in row["counts"].items()), flush=True)
        del kv, caches
        torch.cuda.empty_cache()
    return rows


# (block_m, block_n, num_warps) for hit_tile_sweep_case; each at HIT_SWEEP_STAGES and HIT_SWEEP_SPLITS
HIT_SWEEP_TILES = ((128, 128, 8), (128, 64, 8), (128, 64, 4), (64, 128, 4), (64, 64, 4))
HIT_SWEEP_STAGES = (2, 3, 4)
HIT_SWEEP_SPLITS = (1, 2, 4)


def hit_tile_sweep_case(gen, cached=7680, new=512, q_heads=32, kv_heads=8, head_dim=128, block_size=16) -> dict:
    """The prefix hit's attention step (``new`` tokens over ``cached``) at every tile set, pipeline
    depth and KV split count of the HIT_SWEEP_* grids, as CUDA-graph replays against the reference,
    beside the launcher's own choice: is there a faster launch than the one-split 128 x 128 tiles
    (session 10: 0.191 ms, 345 TFLOP/s)? Splits and 64-row tiles put 2-8 programs on each SM, so
    one program's softmax can overlap another's MMAs; the one-split 128 x 128 launch runs one
    program per SM. A launch that does not fit (shared memory) is recorded as its error."""
    context = cached + new
    kv, tables, lens = paged_setup(1, kv_heads, head_dim, context, block_size, gen)
    k_cache, v_cache = kv[:, 0, 0], kv[:, 0, 1]
    scale = 1 / math.sqrt(head_dim)
    q = torch.randn(new, q_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu = torch.tensor([0, new], device="cuda", dtype=torch.int32)
    want = ref.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale)
    # causal FLOPs: every query sees the cached keys and the new ones up to itself
    flops = 4 * q_heads * head_dim * new * (cached + (new + 1) / 2)

    def launch(**kw) -> torch.Tensor:
        return prefill_attention.paged_prefill(q, k_cache, v_cache, tables, cu, lens, scale, None, None,
                                               context_lens=[context], **kw)
    out: dict = {"cached": cached, "new": new, "tflops_per_launch": flops / 1e12,
                 "launcher": {"ms": bench_graph(launch), "rel_err": rel_err(launch(), want)}, "variants": {}}
    for bm, bn, nw in HIT_SWEEP_TILES:
        for stages in HIT_SWEEP_STAGES:
            for splits in HIT_SWEEP_SPLITS:
                kw = {"block_m": bm, "block_n": bn, "num_warps": nw, "num_stages": stages, "num_splits": splits}
                label = f"m{bm}_n{bn}_w{nw}_s{stages}_split{splits}"
                try:
                    err = rel_err(launch(**kw), want)
                    out["variants"][label] = {"ms": bench_graph(lambda kw=kw: launch(**kw)), "rel_err": err}
                except Exception as e:  # noqa: BLE001  (a tile set past the SM's shared memory: recorded)
                    out["variants"][label] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
    timed = {k: v["ms"] for k, v in out["variants"].items() if v.get("ms")}
    best = sorted(timed, key=timed.get)[:5]
    lm = out["launcher"]["ms"] or float("nan")
    print(f"hit tiles 1 x ({cached} + {new}): launcher {lm:.4f} ms = {flops / lm / 1e9:.0f} TFLOP/s; best "
          + "  ".join(f"{k} {timed[k]:.4f}" for k in best), flush=True)
    return out


def gemm_split_probe_case(gen, ceil: dict, layers: int = 32, splits=(2, 4, 8), names=("o", "down")) -> dict:
    """Could the step's o and down GEMMs skip cuBLAS's split-K reduce kernels (64 a step)? For
    ``layers`` x (o 4096 x 4096, down 4096 x 14336; or the GEMM_SHAPES ``names``) in one CUDA graph at
    M = 1 / 8 / 32: ``F.linear``
    as the step runs it (cuBLAS picks a split-K kernel plus a reduce kernel for both) against one
    strided batched GEMM over S slices of K with fp32 outputs (``torch.bmm(..., out_dtype=float32)``),
    the [S, M, N] partials left for a consumer (the next add + RMSNorm) to sum. The partials' sum is
    checked against ``F.linear``; each variant's kernels per GEMM are counted in one profiled call."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    shapes = tuple(GEMM_SHAPES[name] for name in names)
    weights = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 for n, k in shapes]
               for _ in range(layers)]
    wbytes = sum(w.numel() * 2 for ws in weights for w in ws)
    out: dict = {"layers": layers, "shapes": list(names), "weight_GB": wbytes / 1e9}

    def sliced(x: torch.Tensor, w: torch.Tensor, s: int) -> torch.Tensor:
        m, k = x.shape
        n = w.shape[0]
        xs = x.view(m, s, k // s).transpose(0, 1)  # [S, M, K/S]
        ws = w.view(n, s, k // s).permute(1, 2, 0)  # [S, K/S, N], no copy
        return torch.bmm(xs, ws, out_dtype=torch.float32)

    def kernels_per_call(fn) -> list[str]:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return [e.name[:60] for e in prof.events() if e.device_type == DeviceType.CUDA]

    for m in (1, 8, 32):
        xs = {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen) for _, k in shapes}
        row: dict = {}

        def linear_chain(xs=xs) -> list[torch.Tensor]:
            return [F.linear(xs[w.shape[1]], w) for ws in weights for w in ws]
        ms = bench_graph(linear_chain)
        row["f_linear"] = {"ms": ms, "pct_copy": None if ms is None else wbytes / (ms * 1e-3) / 1e12 / ceil["copy_TBps"],
                           "kernels": kernels_per_call(lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in weights[0]])}
        for s in splits:
            try:
                got = sliced(xs[weights[0][-1].shape[1]], weights[0][-1], s).sum(0)
                want = F.linear(xs[weights[0][-1].shape[1]].float(), weights[0][-1].float())
                ms = bench_graph(lambda xs=xs, s=s: [sliced(xs[w.shape[1]], w, s) for ws in weights for w in ws])
                row[f"bmm_split{s}"] = {
                    "ms": ms, "pct_copy": None if ms is None else wbytes / (ms * 1e-3) / 1e12 / ceil["copy_TBps"],
                    "rel_err": rel_err(got, want),
                    "kernels": kernels_per_call(lambda xs=xs, s=s: [sliced(xs[w.shape[1]], w, s) for w in weights[0]])}
            except Exception as e:  # noqa: BLE001  (bmm's out_dtype missing from this build: recorded)
                row[f"bmm_split{s}"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        out[f"m{m}"] = row
        print(f"gemm split probe M={m}: " + "  ".join(
            f"{k} {v['ms']:.3f} ms ({len(v['kernels'])} kernels / {len(shapes)} GEMMs)" if v.get("ms") else f"{k} {v.get('error', 'n/a')}"
            for k, v in row.items()), flush=True)
    return out


def few_pair_chain_case(gen, classes=CHAIN_CLASSES, launches: int = 8, device="cuda", timer=None,
                        layout: str = "token") -> list[dict]:
    """Classes (default ``CHAIN_CLASSES``) as a decode step runs them: ``launches`` launches back to back in one
    CUDA graph, alternating between two caches (each launch reads one the previous did not, so L2
    holds nothing of it), persistent merge counters; bf16 and fp8 per launch, against one launch in
    a graph of its own (where the graph's own launch is part of every figure). ``device`` and
    ``timer`` (default ``bench_graph``) let the flow run on the CPU's interpreter; ``layout``: the caches' page
    layout (``paged_setup``)."""
    timer = timer or bench_graph
    rows = []
    for i in classes:
        batch, q_heads, kv_heads, head_dim, context, block_size = DECODE_CLASSES[i]
        scale = 1 / math.sqrt(head_dim)
        kv, tables, lens = paged_setup(batch, kv_heads, head_dim, context, block_size, gen, device=device,
                                       layout=layout)
        kv2 = torch.randn_like(kv)  # keeps kv's strides
        q = torch.randn(batch, q_heads, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
        counters = torch.zeros(batch * kv_heads, dtype=torch.int32, device=device)
        row: dict = {"shape": dict(zip(["batch", "q_heads", "kv_heads", "head_dim", "context", "block_size"],
                                       DECODE_CLASSES[i])), "launches": launches, "page_layout": layout}
        for name in ("bf16", "fp8"):
            caches = [(c, None, None) if name == "bf16" else quantize_cache(c, ref.FP8_DTYPE) for c in (kv, kv2)]

            def one(c, q=q, tables=tables, lens=lens, counters=counters, scale=scale) -> torch.Tensor:
                return triton_ops.paged_decode_attention(q, c[0][:, 0, 0], c[0][:, 0, 1], tables, lens, scale, c[1],
                                                         c[2], merge_counters=counters)

            def chain(caches=caches, one=one) -> list[torch.Tensor]:
                return [one(caches[j % 2]) for j in range(launches)]
            single = timer(lambda one=one, caches=caches: one(caches[0]))
            chained = timer(chain)
            row[name] = {"single_graph_ms": single, "chain_per_launch_ms": None if chained is None else chained / launches}
            del caches
        b, f = row["bf16"], row["fp8"]
        row["fp8_x_single"] = b["single_graph_ms"] / f["single_graph_ms"] if f["single_graph_ms"] else None
        row["fp8_x_chain"] = (b["chain_per_launch_ms"] / f["chain_per_launch_ms"]
                              if f["chain_per_launch_ms"] else None)
        print(f"chain {','.join(str(v) for v in DECODE_CLASSES[i])} {layout} pages: bf16 {1000 * b['single_graph_ms']:.1f} us alone, "
              f"{1000 * (b['chain_per_launch_ms'] or 0):.1f} a launch in a chain of {launches}; fp8 "
              f"{1000 * f['single_graph_ms']:.1f} / {1000 * (f['chain_per_launch_ms'] or 0):.1f}; fp8 / bf16 "
              f"{row['fp8_x_single'] or 0:.2f} alone, {row['fp8_x_chain'] or 0:.2f} chained", flush=True)
        rows.append(row)
        del kv, kv2
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


# (batch, q heads, kv heads, head dim, context, block size): the 9 / 3 class of DECODE_CLASSES and the
# same heads at a decode step's smaller batches, for joined_heads_case
JOINED_SHAPES = [(64, 9, 3, 64, 4096, 16), (8, 9, 3, 64, 4096, 16), (1, 9, 3, 64, 32768, 16)]
# (block_n, num_warps, num_stages) of the 256-column joined row (3 x 64, padded) timed by joined_heads_case
JOINED_TILES = [(32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 8, 2), (64, 8, 3), (128, 8, 2)]


def joined_heads_case(gen, shapes=JOINED_SHAPES, tiles=JOINED_TILES, launches: int = 8, device="cuda",
                      timer=None) -> list[dict]:
    """Three KV heads of 64 read as one 256-column row (``paged_decode(joined_heads=3)``) against the
    per-head launch, bf16 and fp8, graph replays: the per-head launch at the launcher's choices, then
    each tile set of ``tiles`` at the split counts that fill waves of 2, 3 and 4 programs per SM (the
    first shape; the others at that shape's fastest tiles only), each checked against the reference;
    then the per-head launch and the fastest joined one as a decode step runs them, ``launches`` back
    to back over two caches (``few_pair_chain_case``'s chain). ``device`` and ``timer`` (default
    ``bench_graph``) let the flow run on the CPU's interpreter."""
    timer = timer or bench_graph
    sms = decode_attention.num_sms(torch.device(device)) if device == "cuda" else 4
    rows = []
    best_tiles: dict[str, tuple] = {}
    for si, shape in enumerate(shapes):
        batch, q_heads, kv_heads, head_dim, context, block_size = shape
        kv, tables, lens, q, counters, scale = _probe_inputs(batch, q_heads, kv_heads, head_dim, context, block_size,
                                                             gen, device)
        kv2 = torch.randn_like(kv)
        row: dict = {"shape": dict(zip(["batch", "q_heads", "kv_heads", "head_dim", "context", "block_size"], shape))}
        for name in ("bf16", "fp8"):
            caches = [(c, None, None) if name == "bf16" else quantize_cache(c, ref.FP8_DTYPE) for c in (kv, kv2)]
            cand_tiles = tiles if si == 0 else [best_tiles[name]]
            row[name] = res = _joined_dtype_row(q, caches, tables, lens, counters, scale, shape, cand_tiles, sms,
                                                launches, timer, kv_bytes=2 * batch * context * kv_heads * head_dim
                                                * (1 if name == "fp8" else 2))
            if si == 0 and res["best_joined"] is not None:
                best_tiles[name] = res["joined"][res["best_joined"]]["tiles"]
            print(f"joined {','.join(str(v) for v in shape)} {name}: per head {res['per_head']['graph_ms'] or 0:.4f} ms "
                  f"(chain {res['per_head']['chain_per_launch_ms'] or 0:.4f}), joined default "
                  f"{res['joined_default']['graph_ms'] or 0:.4f}, best {res['best_joined']} (chain "
                  f"{res.get('best_chain_per_launch_ms') or 0:.4f}); whole rows "
                  f"{res['whole_rows']['graph_ms'] or 0:.4f} (chain {res['whole_rows']['chain_per_launch_ms'] or 0:.4f}); "
                  + "  ".join(f"{k} {v.get('graph_ms') or 0:.4f}" for k, v in res["joined"].items()), flush=True)
            del caches
        rows.append(row)
        del kv, kv2
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def _joined_dtype_row(q, caches, tables, lens, counters, scale, shape, tiles, sms, launches, timer, kv_bytes) -> dict:
    """One cache dtype of ``joined_heads_case``: ``caches`` two (cache, k scale, v scale) of one shape."""
    batch, _, kv_heads, _, _, block_size = shape
    n_check = min(batch, 8)
    c0, ks, vs = caches[0]
    want = ref.paged_decode_attention(q[:n_check], c0[:, 0, 0], c0[:, 0, 1], tables[:n_check], lens[:n_check], scale,
                                      ks, vs)

    def launch(c, **kw):
        return decode_attention.paged_decode(q, c[0][:, 0, 0], c[0][:, 0, 1], tables, lens, scale, c[1], c[2],
                                             merge_counters=counters, **kw)

    def entry(**kw) -> dict:
        ms = timer(lambda: launch(caches[0], **kw))
        return {"graph_ms": ms, "rel_err": rel_err(launch(caches[0], **kw)[:n_check], want),
                "TBps": None if not ms else kv_bytes / (ms * 1e-3) / 1e12}

    def chain_ms(**kw) -> float | None:
        ms = timer(lambda: [launch(caches[j % 2], **kw) for j in range(launches)])
        return None if ms is None else ms / launches

    res: dict = {"per_head": entry(joined_heads=1), "joined_default": entry(joined_heads=3), "joined": {}}
    for bn, warps, stages in tiles:
        splits = sorted({decode_attention.choose_num_splits(batch, kv_heads // 3, tables.shape[1] * block_size, sms, bn,
                                                            programs_per_sm=pps) for pps in (2, 3, 4)})
        for sp in splits:
            key = f"bn{bn}_w{warps}_s{stages}_sp{sp}"
            try:
                res["joined"][key] = {**entry(joined_heads=3, block_n=bn, num_warps=warps, num_stages=stages,
                                              num_splits=sp), "tiles": (bn, warps, stages), "splits": sp}
            except Exception as e:  # noqa: BLE001  (a tile set that does not compile is a finding)
                res["joined"][key] = {"error": f"{type(e).__name__}: {e}"[:300]}
    timed = {k: v for k, v in res["joined"].items() if v.get("graph_ms")}
    res["best_joined"] = best = min(timed, key=lambda k: timed[k]["graph_ms"]) if timed else None
    res["per_head"]["chain_per_launch_ms"] = chain_ms(joined_heads=1)

    def rows_launch(c):
        return decode_rows.paged_decode_rows(q, c[0][:, 0, 0], c[0][:, 0, 1], tables, lens, scale, c[1], c[2],
                                             merge_counters=counters)

    # every head of a token as one row in its own kernel (session 32's decode_rows), as a launch and in a chain
    ms = timer(lambda: rows_launch(caches[0]))
    chain = timer(lambda: [rows_launch(caches[j % 2]) for j in range(launches)])
    res["whole_rows"] = {"graph_ms": ms, "rel_err": rel_err(rows_launch(caches[0])[:n_check], want),
                         "TBps": None if not ms else kv_bytes / (ms * 1e-3) / 1e12,
                         "chain_per_launch_ms": None if chain is None else chain / launches}
    if best is not None:
        bn, warps, stages = timed[best]["tiles"]
        res["best_chain_per_launch_ms"] = chain_ms(joined_heads=3, block_n=bn, num_warps=warps, num_stages=stages,
                                                   num_splits=timed[best]["splits"])
    return res


# (block_n, num_warps, num_stages) per head at head dim 64, for odd_heads_sweep_case: the launcher's
# 8-bit ring (128, 4, 5) and bf16 ring (64, 4, 5), one buffer, more warps, longer tiles
ODD_HEAD_TILES = [(128, 4, 5), (64, 4, 5), (128, 4, 2), (128, 8, 5), (256, 8, 3), (64, 4, 3)]
ODD_HEAD_SPLITS = (2, 4, 6, 8, 11, 16)


def odd_heads_sweep_case(gen, shape=(64, 9, 3, 64, 4096, 16), tiles=ODD_HEAD_TILES, splits=ODD_HEAD_SPLITS,
                         device="cuda", timer=None) -> dict:
    """The 9 / 3 head-dim-64 class per head (how the launcher reads it), bf16 and fp8, over tile sets
    x split counts as CUDA-graph replays (one persistent merge-counter buffer, as the engine launches),
    each checked against the reference, with the launcher's own launch beside them: is another split
    count or tile set faster than the launcher's choice on the class that stays under fp8 / bf16 1.6?"""
    timer = timer or bench_graph
    batch, q_heads, kv_heads, head_dim, context, block_size = shape
    kv, tables, lens, q, counters, scale = _probe_inputs(batch, q_heads, kv_heads, head_dim, context, block_size, gen,
                                                         device)
    out: dict = {"shape": dict(zip(["batch", "q_heads", "kv_heads", "head_dim", "context", "block_size"], shape))}
    n_check = min(batch, 4)
    for name, k_cache, v_cache, ks, vs in _caches_by_dtype(kv):
        want = ref.paged_decode_attention(q[:n_check], k_cache, v_cache, tables[:n_check], lens[:n_check], scale, ks, vs)

        def launch(k_cache=k_cache, v_cache=v_cache, ks=ks, vs=vs, **kw):
            return decode_attention.paged_decode(q, k_cache, v_cache, tables, lens, scale, ks, vs,
                                                 merge_counters=counters, **kw)
        res: dict = {"launcher": {"graph_ms": timer(launch), "rel_err": rel_err(launch()[:n_check], want)}}
        for bn, warps, stages in tiles:
            for sp in splits:
                key = f"bn{bn}_w{warps}_s{stages}_sp{sp}"
                kw = {"block_n": bn, "num_warps": warps, "num_stages": stages, "num_splits": sp}
                try:
                    res[key] = {"rel_err": rel_err(launch(**kw)[:n_check], want),
                                "graph_ms": timer(lambda kw=kw: launch(**kw))}
                except Exception as e:  # noqa: BLE001  (a tile set that does not compile is a finding)
                    res[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
        timed = {k: v["graph_ms"] for k, v in res.items() if v.get("graph_ms")}
        best = min(timed, key=timed.get)
        res["best"] = best
        out[name] = res
        print(f"odd heads {','.join(str(v) for v in shape)} {name}: launcher {res['launcher']['graph_ms'] or 0:.4f} ms, "
              f"best {best} {timed[best]:.4f}; " + "  ".join(f"{k} {v:.4f}" for k, v in timed.items()), flush=True)
    return out


def _probe_inputs(batch, q_heads, kv_heads, head_dim, table_tokens, block_size, gen, device, context=None):
    """A decode probe's inputs: a shuffled paged bf16 cache of ``table_tokens`` a sequence (live
    ``context``, default all of it), bf16 queries, one zeroed merge-counter buffer (the engine's
    launch), the softmax scale."""
    kv, tables, lens = paged_setup(batch, kv_heads, head_dim, table_tokens, block_size, gen, device=device)
    if context is not None:
        lens.fill_(context)
    q = torch.randn(batch, q_heads, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
    counters = torch.zeros(batch * kv_heads, dtype=torch.int32, device=device)
    return kv, tables, lens, q, counters, 1 / math.sqrt(head_dim)


def _caches_by_dtype(kv):
    """(name, k cache, v cache, k scale, v scale): ``paged_setup``'s bf16 cache, then fp8 of the same values."""
    for name in ("bf16", "fp8"):
        kc, ks, vs = (kv, None, None) if name == "bf16" else quantize_cache(kv, ref.FP8_DTYPE)
        yield name, kc[:, 0, 0], kc[:, 0, 1], ks, vs


# (batch, q heads, kv heads, head dim, live context, table tokens): launches where the launcher's split
# count and the one-wave rule's differ (split_rule_case): the 9 / 3 class, the engine's decode graph sizes
# 24 / 40 / 48 / 56 over 2K in an 8,448-token table, and uniform full tables at other head counts
SPLIT_RULE_SHAPES = [(64, 9, 3, 64, 4096, 4096), (24, 32, 8, 128, 2048, 8448), (40, 32, 8, 128, 2048, 8448),
                     (48, 32, 8, 128, 2048, 8448), (56, 32, 8, 128, 2048, 8448), (5, 32, 16, 128, 32768, 32768),
                     (3, 128, 32, 128, 4096, 4096), (48, 32, 8, 128, 4096, 4096)]


def split_rule_case(gen, shapes=SPLIT_RULE_SHAPES, block_size: int = 16, device="cuda", timer=None) -> list[dict]:
    """bf16 and fp8 decode launches at the wave model's split count (``choose_num_splits`` without a
    one-wave rule) against the one-wave rule's at any split length (``OneWaveRule()``), graph replays with
    one persistent counter buffer (the engine's launch: splits cut by live length), the launcher's
    tiles, each checked against the reference: does one wave at least 70 % full beat several fuller
    ones, as the 9 / 3 class showed (session 17 call 4), wherever the two differ? (Session 17 call 5;
    the launcher now takes the rule for 16-bit caches and, for fp8, where splits are short enough:
    ``one_wave_rule_for``.)"""
    timer = timer or bench_graph
    sms = decode_attention.num_sms(torch.device(device)) if device == "cuda" else 4
    rows = []
    for shape in shapes:
        batch, q_heads, kv_heads, head_dim, context, table_tokens = shape
        kv, tables, lens, q, counters, scale = _probe_inputs(batch, q_heads, kv_heads, head_dim, table_tokens,
                                                             block_size, gen, device, context=context)
        row: dict = {"shape": dict(zip(["batch", "q_heads", "kv_heads", "head_dim", "context", "table_tokens"], shape))}
        n_check = min(batch, 4)
        for name, k_cache, v_cache, ks, vs in _caches_by_dtype(kv):
            tiles = decode_attention.choose_tiles(head_dim, k_cache.dtype, batch * kv_heads, sms)
            own, rule = (decode_attention.choose_num_splits(batch, kv_heads, table_tokens, sms, tiles.block_n,
                                                            programs_per_sm=tiles.programs_per_sm, one_wave=rule)
                         for rule in (None, decode_attention.OneWaveRule()))
            want = ref.paged_decode_attention(q[:n_check], k_cache, v_cache, tables[:n_check], lens[:n_check], scale,
                                              ks, vs)
            res: dict = {"launcher_splits": own, "rule_splits": rule}
            for label, sp in (("launcher", own), ("rule", rule)):
                def launch(sp=sp, k_cache=k_cache, v_cache=v_cache, ks=ks, vs=vs, q=q, tables=tables, lens=lens,
                           scale=scale, counters=counters):
                    return decode_attention.paged_decode(q, k_cache, v_cache, tables, lens, scale, ks, vs, num_splits=sp,
                                                         merge_counters=counters)
                res[label] = {"rel_err": rel_err(launch()[:n_check], want), "graph_ms": timer(launch)}
            lm, rm = res["launcher"]["graph_ms"], res["rule"]["graph_ms"]
            res["rule_x"] = lm / rm if lm and rm else None
            row[name] = res
            print(f"split rule {','.join(str(v) for v in shape)} {name}: wave model {own} splits {lm or 0:.4f} ms, "
                  f"one wave {rule} splits {rm or 0:.4f} ms (x{res['rule_x'] or 0:.3f})", flush=True)
        rows.append(row)
        del kv
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


@dataclass(frozen=True)
class _RopeStep:
    """One decode step's inputs for ``rope_decode_chain_case``, shared by every layer's launch."""

    qkv: torch.Tensor
    q_heads: int
    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor
    scale: float
    counters: torch.Tensor

    def two_kernels(self, kc, vc, ks, vs) -> torch.Tensor:
        q = triton_ops.rotary_write_kv(self.qkv, self.cos, self.sin, kc, vc, self.slots, self.q_heads, ks, vs)
        return decode_attention.paged_decode(q, kc, vc, self.tables, self.lens, self.scale, ks, vs,
                                             merge_counters=self.counters)

    def one_launch(self, kc, vc, ks, vs) -> torch.Tensor:
        head_dim = kc.shape[3]
        q = self.qkv[:, : self.q_heads * head_dim].view(self.qkv.shape[0], self.q_heads, head_dim)
        return decode_attention.paged_decode(q, kc, vc, self.tables, self.lens, self.scale, ks, vs,
                                             merge_counters=self.counters,
                                             rope=decode_attention.RopeWrite(self.cos, self.sin, self.slots))


def _rope_chain_row(step: _RopeStep, k0, v0, ks, vs, layers: int, timer) -> dict:
    """``rope_decode_chain_case`` for one cache dtype: both ways checked against each other on the first
    layer's cache, then timed over ``layers`` caches in one graph."""
    layer_caches = [(k0, v0)] + [(k0.clone(), v0.clone()) for _ in range(layers - 1)]
    k_two, v_two = k0.clone(), v0.clone()
    want = step.two_kernels(k_two, v_two, ks, vs)
    got = step.one_launch(k0, v0, ks, vs)
    same = bool(torch.equal(k_two.view(torch.uint8), k0.view(torch.uint8))
                and torch.equal(v_two.view(torch.uint8), v0.view(torch.uint8)))
    res: dict = {"rel_err": rel_err(got, want), "same_cache_bytes": same, "bit_equal": bool(torch.equal(got, want))}
    for label, fn in (("two_kernels", step.two_kernels), ("fused", step.one_launch)):
        ms = timer(lambda fn=fn: [fn(kc, vc, ks, vs) for kc, vc in layer_caches])
        res[f"{label}_us_per_layer"] = None if ms is None else 1000 * ms / layers
    a, b = res["two_kernels_us_per_layer"], res["fused_us_per_layer"]
    res["fused_x"] = a / b if a and b else None
    return res


def rope_decode_chain_case(gen, batches=(1, 8, 32, 128), context=2048, table_tokens=8448, layers=32, q_heads=32,
                           kv_heads=8, head_dim=128, block_size=16, device="cuda", timer=None) -> list[dict]:
    """A decode step's attention as the engine's graphs launch it, ``layers`` launches in one CUDA graph
    (each over its own cache, live contexts of ``context`` in a ``table_tokens`` table, one merge
    counter buffer): ``rotary_write_kv`` then the attention (two kernels a layer) against the one
    launch that does both (``decode_attention.RopeWrite``), bf16 and fp8 caches. Checked first: the
    same cache bytes and outputs within 1e-3 of each other. -> us a layer, both ways."""
    timer = timer or bench_graph
    rows = []
    scale = 1 / math.sqrt(head_dim)
    for batch in batches:
        # the cache holds each sequence's context, the table is as wide as a decode graph's (zeros past it)
        kv, live, lens = paged_setup(batch, kv_heads, head_dim, context, block_size, gen, device=device)
        tables = torch.cat([live, torch.zeros(batch, table_tokens // block_size - live.shape[1], dtype=live.dtype,
                                              device=device)], 1)
        counters = torch.zeros(batch * kv_heads, dtype=torch.int32, device=device)
        lens -= 1  # the cache holds context - 1 tokens; the step's token makes it context
        pos = lens.to(torch.int64)
        slots = tables[torch.arange(batch, device=device), pos // block_size].to(torch.int64) * block_size \
            + pos % block_size
        lens += 1
        qkv = torch.randn(batch, (q_heads + 2 * kv_heads) * head_dim, device=device, generator=gen).to(torch.bfloat16)
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
        freqs = pos.float()[:, None] * inv_freq[None, :]
        cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
        row: dict = {"batch": batch, "context": context, "table_tokens": table_tokens, "layers": layers}
        step = _RopeStep(qkv, q_heads, cos, sin, slots, tables, lens, scale, counters)
        for name, k0, v0, ks, vs in _caches_by_dtype(kv):
            row[name] = _rope_chain_row(step, k0, v0, ks, vs, layers, timer)
            res = row[name]
            print(f"rope in decode {batch} x {context} {name}: two kernels {res['two_kernels_us_per_layer'] or 0:.2f} us "
                  f"a layer, one launch {res['fused_us_per_layer'] or 0:.2f} (x{res['fused_x'] or 0:.3f}); err "
                  f"{res['rel_err']:.1e}, bit-equal {res['bit_equal']}, same cache bytes {res['same_cache_bytes']}",
                  flush=True)
        rows.append(row)
        del kv
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


# (block_n, num_warps, num_stages) for small_batch_tiles_case: the launcher's bf16 head-dim-128 tiles first,
# then deeper pipelines (3 stages; 5: a two-tile ring), shorter and longer tiles, 8 warps
SMALL_BATCH_TILES = [(64, 4, 2), (64, 4, 3), (64, 4, 5), (32, 4, 3), (32, 4, 5), (128, 8, 3), (64, 8, 3)]


def small_batch_tiles_case(gen, batches=(1, 8), context=2048, table_tokens=8448, layers=32, q_heads=32, kv_heads=8,
                           head_dim=128, block_size=16, tiles=SMALL_BATCH_TILES) -> list[dict]:
    """The engine's decode launches at batch 1 and 8 (graph-shaped, bf16, ``layers`` of them in one CUDA
    graph, each over its own cache) at each tile set of ``tiles`` x half, once and twice the launcher's
    split count: at these batches a program streams 2-4 tiles (session 15: batch 8's streams end
    14.6-20.5 us into a 22.9 us launch), so a deeper pipeline or other tiles may end them sooner. Each
    launch checked against the reference. -> us a layer per (tiles, splits), the launcher's first."""
    rows = []
    scale = 1 / math.sqrt(head_dim)
    for batch in batches:
        kv, wide, lens, q, caches, own_tiles, counters = chained_layers_setup(
            batch, q_heads, kv_heads, head_dim, context, table_tokens, block_size, layers, gen)
        sms = decode_attention.num_sms(q.device)
        want = ref.paged_decode_attention(q, kv[:, 0, 0], kv[:, 0, 1], wide, lens, scale)
        row: dict = {"batch": batch, "context": context, "table_tokens": table_tokens, "layers": layers,
                     "launcher_tiles": [own_tiles.block_n, own_tiles.num_warps, own_tiles.num_stages], "us": {}}
        for bn, warps, stages in tiles:
            own = decode_attention.choose_num_splits(batch, kv_heads, table_tokens, sms, bn)
            for splits in sorted({max(1, own // 2), own, 2 * own}):
                kw = {"block_n": bn, "num_warps": warps, "num_stages": stages, "num_splits": splits}

                def launch(c, kw=kw, q=q, wide=wide, lens=lens, counters=counters) -> torch.Tensor:
                    return decode_attention.paged_decode(q, c[:, 0, 0], c[:, 0, 1], wide, lens, scale, None, None,
                                                         merge_counters=counters, **kw)
                key = f"bn{bn}_w{warps}_s{stages}_sp{splits}"
                try:
                    err = rel_err(launch(kv), want)
                    ms = bench_graph(lambda launch=launch, caches=caches: [launch(c) for c in caches])
                    row["us"][key] = {"us_per_launch": None if ms is None else 1000 * ms / layers, "rel_err": err}
                except Exception as e:  # noqa: BLE001  (a tile set that does not compile is a finding)
                    row["us"][key] = {"error": f"{type(e).__name__}: {e}"[:300]}
        timed = {k: v["us_per_launch"] for k, v in row["us"].items() if v.get("us_per_launch")}
        row["best"] = min(timed, key=timed.get) if timed else None
        rows.append(row)
        print(f"small-batch tiles {batch} x {context}: best {row['best']}; " + "  ".join(
            f"{k} {v:.2f}" for k, v in timed.items()), flush=True)
        del kv, caches
        torch.cuda.empty_cache()
    return rows



# (block_n, block_k, num_warps, num_stages) for gate_up_silu_chain_case; None: the launcher's
# (gate_up_silu.choose_config: 32 columns a half at I = 14,336), timed first.
GATE_UP_TILES = [None, (16, 256, 4, 4), (16, 256, 4, 3), (32, 256, 4, 2), (32, 128, 4, 4), (64, 128, 4, 3),
                 (16, 512, 4, 3), (32, 256, 8, 3), (64, 256, 8, 2)]


def gate_up_silu_chain_case(gen, rows=(1, 8, 16, 32), layers=32, hidden=4096, inter=14336, tiles=GATE_UP_TILES,
                            device="cuda", timer=None) -> list[dict]:
    """The decode step's MLP after its norm, ``layers`` of them in one CUDA graph: as the engine ran it
    before session 19 (cuBLAS gate|up, ``silu_mul``, the down projection's split-K partials from one
    batched GEMM) against the gate|up GEMM storing silu(gate) * up itself (``gate_up_silu``) at each
    tile set; and the gate|up + SiLU half alone both ways. Every fused launch checked against the
    unfused ops first (the same roundings: equal but for the GEMM's summation order). -> us a layer
    per variant, and its weight bytes over the time as a share of copy.

    Also measured in session 19 (calls 1-2, in the tree at ccfbd94): SiLU x up in the down GEMM's
    prologue instead (``glu_down``), 2-7x slower than ``silu_mul`` plus cuBLAS at every tile set."""
    from prefixgate_kernels import gate_up_silu, partial_gemm

    timer = timer or bench_graph
    on_gpu = torch.device(device).type == "cuda"
    sms = decode_attention.num_sms(torch.device(device)) if on_gpu else 132
    w_gu = [torch.randn(2 * inter, hidden, device=device, dtype=torch.bfloat16, generator=gen) * hidden ** -0.5
            for _ in range(layers)]
    w_down = [torch.randn(hidden, inter, device=device, dtype=torch.bfloat16, generator=gen) * inter ** -0.5
              for _ in range(layers)]
    down_bytes, gate_up_bytes = hidden * inter * 2, 2 * hidden * inter * 2
    copy = ceilings()["copy_TBps"] if on_gpu else 1.0

    def timed(chain, nbytes: int) -> dict | None:
        ms = timer(chain)
        return None if ms is None else {
            "us_per_layer": 1000 * ms / layers, "pct_copy": 100 * nbytes * layers / (ms * 1e-3) / 1e12 / copy}

    def down_partials(act: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return partial_gemm.linear_partials(act, w, None, F.linear)

    out = []
    for m in rows:
        x = torch.randn(m, hidden, device=device, dtype=torch.bfloat16, generator=gen)
        act = triton_ops.silu_mul(F.linear(x, w_gu[0]))
        row: dict = {"rows": m, "layers": layers, "rel_err": {}, "us": {
            "unfused/mlp": timed(lambda x=x: [down_partials(triton_ops.silu_mul(F.linear(x, a)), b)
                                              for a, b in zip(w_gu, w_down)], down_bytes + gate_up_bytes),
            "unfused/gate_up+silu": timed(lambda x=x: [triton_ops.silu_mul(F.linear(x, a)) for a in w_gu],
                                          gate_up_bytes)}}
        for spec in tiles:
            cfg = gate_up_silu.choose_config(m, inter, hidden, sms) if spec is None else gate_up_silu.GateUpConfig(*spec)
            if cfg is None:
                continue
            key = ("launcher " if spec is None else "") + (
                f"bn{cfg.block_n}_bk{cfg.block_k}_w{cfg.num_warps}_st{cfg.num_stages}")
            try:
                row["rel_err"][key] = rel_err(gate_up_silu.gate_up_silu(x, w_gu[0], cfg), act)
                row["us"][f"fused {key}/gate_up+silu"] = timed(
                    lambda x=x, cfg=cfg: [gate_up_silu.gate_up_silu(x, a, cfg) for a in w_gu], gate_up_bytes)
                row["us"][f"fused {key}/mlp"] = timed(
                    lambda x=x, cfg=cfg: [down_partials(gate_up_silu.gate_up_silu(x, a, cfg), b)
                                          for a, b in zip(w_gu, w_down)], down_bytes + gate_up_bytes)
            except Exception as e:  # noqa: BLE001  (a tile set that does not compile or fit is a finding)
                row["us"][key] = {"error": f"{type(e).__name__}: {e}"[:300]}
        out.append(row)
        print(f"gate|up + silu M={m}:", flush=True)
        for k, v in row["us"].items():
            print(f"   {k}: " + (f"{v['us_per_layer']:.2f} us ({v['pct_copy']:.0f} %)" if v and "us_per_layer" in v
                                   else str(v)), flush=True)
        print(f"   errors: {row['rel_err']}", flush=True)
    return out


@triton.jit
def _grid_barrier_kernel(counter_ptr, out_ptr, iters, NPROG: tl.constexpr):
    """``iters`` grid-wide barriers among NPROG co-resident programs: each arrives (release add at GPU
    scope, after bar.sync) and spins on acquire reads until all NPROG have arrived at barrier i. The
    probe's own kernel (a persistent layer kernel would sync its phases so); the count it ends on is
    checked. Compiled only: the interpreter runs programs one after another, so it would spin forever."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    for i in range(iters):
        tl.debug_barrier()
        tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
        target = (i + 1) * NPROG
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
    if tl.program_id(0) == 0:
        tl.store(out_ptr, seen)


@triton.jit
def _tick_kernel(out_ptr):
    tl.store(out_ptr + tl.program_id(0), 1)


def grid_barrier_case(gen, iters: int = 1000, device: str = "cuda") -> dict:
    """What a persistent decode-layer kernel would pay to sync its phases, against what a kernel
    boundary costs the step now: the time of one grid-wide barrier (atomic arrive, spin on acquire
    reads) among 1 or 2 programs an SM, as (one launch of ``iters`` barriers - one of none) / iters;
    and the time per launch of ``iters`` back-to-back launches of a trivial kernel of the same grid in
    one CUDA graph (each launch waits for the one before, as the step's kernels do)."""
    sms = decode_attention.num_sms(torch.device(device))
    out: dict = {"sms": sms, "iters": iters, "rows": []}
    for per_sm in (1, 2):
        nprog = sms * per_sm
        counter = torch.zeros(1, dtype=torch.int32, device=device)
        seen = torch.zeros(1, dtype=torch.int32, device=device)

        def launch(n: int, nprog=nprog, counter=counter, seen=seen) -> None:
            counter.zero_()
            _grid_barrier_kernel[(nprog,)](counter, seen, n, NPROG=nprog, num_warps=4)

        launch(iters)
        torch.cuda.synchronize()
        ok = int(seen.item()) == iters * nprog
        t_iters, t_none = bench(lambda: launch(iters)), bench(lambda: launch(0))
        ticks = torch.zeros(nprog, dtype=torch.int32, device=device)
        chain_ms = bench_graph(lambda nprog=nprog, ticks=ticks: [_tick_kernel[(nprog,)](ticks) for _ in range(iters)])
        row = {"programs": nprog, "count_ok": ok, "barrier_us": 1e3 * (t_iters - t_none) / iters,
               "launch_us_in_graph": None if chain_ms is None else 1e3 * chain_ms / iters}
        out["rows"].append(row)
        print(f"grid barrier, {nprog} programs: {row['barrier_us']:.2f} us a barrier (count ok {ok}); "
              f"a kernel boundary in a graph {row['launch_us_in_graph']} us", flush=True)
    return out


def argmax_case(gen, rows=(1, 8, 32, 128), vocab=128256) -> list[dict]:
    """Greedy decoding's argmax over fp32 logits [B, V] as the sampler runs it after each decode step
    (eagerly, outside the step's graph): ``torch.argmax`` (one block a row) against the one-launch
    ``prefixgate_kernels.argmax`` (32 programs a row at Llama 3's V, the last merging; persistent
    counters as the sampler keeps them), same indices checked."""
    from prefixgate_kernels import argmax

    out = []
    for b in rows:
        x = torch.randn(b, vocab, device="cuda", generator=gen) * 4
        counters = torch.zeros(b, dtype=torch.int32, device="cuda")
        same = bool(torch.equal(argmax.argmax_rows(x, counters), x.argmax(dim=-1)))
        row: dict = {"rows": b, "vocab": vocab, "same_indices": same}
        for name, fn in (("torch", lambda x=x: x.argmax(dim=-1)),
                         ("triton", lambda x=x, c=counters: argmax.argmax_rows(x, c))):
            graph_ms = bench_graph(fn)  # the device's time; eager adds the host's launch where it is longer
            row[f"{name}_graph_us"] = None if graph_ms is None else graph_ms * 1e3
            row[f"{name}_eager_us"] = bench(fn) * 1e3
        if row["torch_graph_us"] and row["triton_graph_us"]:
            row["speedup_graph"] = row["torch_graph_us"] / row["triton_graph_us"]
        out.append(row)
        print(f"argmax {b} x {vocab}: graph torch {row['torch_graph_us']} us, one launch {row['triton_graph_us']} us; "
              f"eager {row['torch_eager_us']:.1f} / {row['triton_eager_us']:.1f} us; same indices {same}", flush=True)
    return out


# Programs of one or two warps (session 21). Nsight Compute on the 9 / 3 class's launches (call 1,
# benchmarks/ncu_probe.py): fp8 issues on 48 % of its cycles with 0.8 eligible warps a scheduler, 20 %
# of its stall samples at barriers and shared-memory reads, and its DRAM reads run at 2.1 TB/s: the
# four warps of a program split a tile's tokens, so every row max and sum crosses warps through
# shared memory behind a barrier. A one-warp program keeps its reductions in shuffles. No sweep had
# timed fewer than four warps. (block_n, num_warps, num_stages).
FEW_WARP_TILES = [(32, 1, 3), (64, 1, 2), (64, 1, 3), (32, 2, 3), (64, 2, 3), (128, 2, 5)]
FEW_WARP_SPLITS = (4, 8, 16)
FEW_WARP_SMALL_BATCH_TILES = [(64, 4, 2), (32, 1, 3), (64, 1, 2), (32, 2, 3), (64, 2, 2)]


def few_warps_case(gen) -> dict:
    """``odd_heads_sweep_case`` and ``small_batch_tiles_case`` over programs of one and two warps: the 9 / 3
    class (bf16, fp8) and the engine's batch-1 and batch-8 decode launches, the launcher's own beside them."""
    return {"odd_heads": odd_heads_sweep_case(gen, tiles=FEW_WARP_TILES, splits=FEW_WARP_SPLITS),
            "small_batch": small_batch_tiles_case(gen, tiles=FEW_WARP_SMALL_BATCH_TILES)}


# The prefill attention with the softmax overlapping the MMAs (prefixgate_kernels/prefill_overlap.py,
# Gluon; session 21) against the launcher's paged_prefill: (label, sequences, cached, new, q heads,
# kv heads, head dim); and its tile / ring variants (block_m, block_n, num_buf, num_warps): 128-row tiles
# in two warpgroups (one program an SM), 64-row ones in one (two programs an SM, each overlapping the other).
OVERLAP_SHAPES = [("hit", 1, 7680, 512, 32, 8, 128), ("4x(8192+512)", 4, 8192, 512, 32, 8, 128),
                  ("cold 2K", 1, 0, 2048, 32, 8, 128), ("hit hd64", 1, 7680, 512, 32, 8, 64),
                  ("4x(8192+512) hd64", 4, 8192, 512, 32, 8, 64), ("cold 2K hd64", 1, 0, 2048, 32, 8, 64),
                  ("hit hd64 9/3", 1, 7680, 512, 9, 3, 64), ("suffix 64", 1, 8128, 64, 32, 8, 128),
                  ("suffix 64 hd64", 1, 8128, 64, 32, 8, 64)]
OVERLAP_TILES = [(128, 128, 2, 8), (128, 128, 3, 8), (128, 64, 3, 8), (64, 64, 2, 4), (64, 128, 2, 4), (64, 64, 3, 4)]
# (key tile, ring slots, MMAs in turns) for the warp-specialised kernel (prefill_specialized), 128 query rows
SPECIALIZED_TILES = [(128, 2, False), (128, 3, False), (64, 4, False), (128, 2, True), (128, 3, True), (64, 4, True)]
# its KV splits (at the launcher's tiles), for the launches the Triton kernel splits: few heads, short chunks;
# then packed GQA rows, unsplit and at 4 splits
SPECIALIZED_SPLITS = (2, 4, 8)


def overlap_prefill_case(gen, shapes=OVERLAP_SHAPES, tiles=OVERLAP_TILES) -> list[dict]:
    """Each shape's prefill attention, the launcher's ``paged_prefill`` (its own tiles and splits) against
    ``paged_prefill_overlap`` at each (block_n, ring slots), as CUDA-graph replays, each checked against
    the reference; TFLOP/s of the causal work."""
    out = []
    for shape in shapes:
        row = _overlap_row(gen, *shape, tiles=tiles)
        out.append(row)
        print(f"overlap prefill {row['label']}: " + "  ".join(
            f"{k} {v['ms']:.4f} ms ({v['tflops']:.0f} TF/s, err {v['rel_err']:.1e})" if v.get("ms") else
            f"{k} {v.get('error', 'no graph')[:80]}" for k, v in row.items() if isinstance(v, dict)), flush=True)
        torch.cuda.empty_cache()
    return out


def _checked_replay(run: Callable[[], torch.Tensor], want: torch.Tensor) -> dict:
    """One variant's error against the reference and its graph-replay time, or why it could not run (a ring
    past shared memory, a GQA group that cannot pack: findings, recorded, not fatal)."""
    try:
        return {"rel_err": rel_err(run(), want), "ms": bench_graph(run)}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def _overlap_row(gen, label, seqs, cached, new, q_heads, kv_heads, head_dim, tiles) -> dict:
    from prefixgate_kernels.prefill_overlap import paged_prefill_overlap
    from prefixgate_kernels.prefill_specialized import paged_prefill_specialized

    context = cached + new
    kv, tables, lens = paged_setup(seqs, kv_heads, head_dim, context, 16, gen)
    k_cache, v_cache = kv[:, 0, 0], kv[:, 0, 1]
    scale = 1 / math.sqrt(head_dim)
    q = torch.randn(seqs * new, q_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu = torch.arange(0, seqs + 1, device="cuda", dtype=torch.int32) * new
    want = ref.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale)
    flops = seqs * 4 * q_heads * head_dim * new * (cached + (new + 1) / 2)

    def base() -> torch.Tensor:
        return prefill_attention.paged_prefill(q, k_cache, v_cache, tables, cu, lens, scale, None, None,
                                               max_q_len=new, context_lens=[context] * seqs)
    held, prefill_attention.PREFILL_KERNEL = prefill_attention.PREFILL_KERNEL, prefill_attention.PrefillKernel.TRITON
    try:
        row: dict = {"label": label, "seqs": seqs, "cached": cached, "new": new, "head_dim": head_dim,
                     "triton": {"ms": bench_graph(base), "rel_err": rel_err(base(), want)}}
    finally:
        prefill_attention.PREFILL_KERNEL = held
    row["launcher"] = {"ms": bench_graph(base), "rel_err": rel_err(base(), want)}  # what the engine runs
    for bm, bn, nbuf, warps in tiles:
        def overlap(bm=bm, bn=bn, nbuf=nbuf, warps=warps) -> torch.Tensor:
            return paged_prefill_overlap(q, k_cache, v_cache, tables, cu, lens, scale, max_q_len=new, block_m=bm,
                                         block_n=bn, num_buf=nbuf, num_warps=warps)
        row[f"overlap_m{bm}n{bn}b{nbuf}w{warps}"] = _checked_replay(overlap, want)
    for bn, nbuf, pp in SPECIALIZED_TILES:
        def specialized(bn=bn, nbuf=nbuf, pp=pp) -> torch.Tensor:
            return paged_prefill_specialized(q, k_cache, v_cache, tables, cu, lens, scale, max_q_len=new, block_n=bn,
                                             num_buf=nbuf, pingpong=pp)
        row[f"specialized_n{bn}b{nbuf}" + ("_pingpong" if pp else "")] = _checked_replay(specialized, want)
    for splits, pack in [(n, False) for n in SPECIALIZED_SPLITS] + [(1, True), (4, True)]:
        def split_run(splits=splits, pack=pack) -> torch.Tensor:
            return paged_prefill_specialized(q, k_cache, v_cache, tables, cu, lens, scale, max_q_len=new,
                                             **prefill_attention.SPECIALIZED_TILES, num_splits=splits, pack=pack)
        key = "specialized" + ("_pack" if pack else "") + (f"_split{splits}" if splits > 1 else "")
        row[key] = _checked_replay(split_run, want)
    for v in row.values():
        if isinstance(v, dict) and v.get("ms"):
            v["tflops"] = flops / (v["ms"] * 1e-3) / 1e12
    return row


# Probes that run alone after the ceilings, each one case of ``gen`` only: flag -> (result key, case, what it
# times, for --help)
SOLO_PROBES: dict[str, tuple[str, Callable[..., object], str]] = {
    "joined-heads": ("joined_heads", joined_heads_case, "the 9 / 3 head-dim-64 class with its KV heads read as one "
                     "row against per head, over tile sets and split counts (joined_heads_case)"),
    "odd-heads": ("odd_heads", odd_heads_sweep_case, "the 9 / 3 head-dim-64 class per head over tile sets x split "
                  "counts, bf16 and fp8 (odd_heads_sweep_case)"),
    "split-rule": ("split_rule", split_rule_case, "decode launches at the wave model's split count against the "
                   "one-wave rule's, where they differ (split_rule_case)"),
    "small-batch-tiles": ("small_batch_tiles", small_batch_tiles_case, "the engine's decode launches at batch 1 "
                          "and 8, 32 in a graph, over tile sets x split counts (small_batch_tiles_case)"),
    "gate-up-silu": ("gate_up_silu", gate_up_silu_chain_case, "the decode MLP after its norm, 32 layers in a "
                     "graph: silu_mul after cuBLAS's gate|up against the gate|up GEMM storing SiLU x up "
                     "(gate_up_silu_chain_case)"),
    "rope-decode": ("rope_decode", rope_decode_chain_case, "a decode step's RoPE + K/V write and attention, two "
                    "kernels a layer against one launch, 32 layers in a graph (rope_decode_chain_case)"),
    "grid-barrier": ("grid_barrier", grid_barrier_case, "one grid-wide barrier among 1 or 2 programs an SM "
                     "against a kernel boundary in a CUDA graph (grid_barrier_case)"),
    "few-warps": ("few_warps", few_warps_case, "decode programs of one and two warps: the 9 / 3 class and the "
                  "engine's batch-1 / batch-8 launches (few_warps_case)"),
    "overlap-prefill": ("overlap_prefill", overlap_prefill_case, "the prefill attention whose softmax overlaps "
                        "the MMAs (Gluon) against paged_prefill (overlap_prefill_case)"),
    "argmax": ("argmax", argmax_case, "greedy decoding's argmax over [B, 128256] fp32 logits, torch's against "
               "the one-launch kernel (argmax_case)"),
}


def summarise_stamps(stamps: torch.Tensor) -> dict:
    """[programs, 5] int64 stamps (``paged_decode``'s: start, stream end, count, merge end in ns, then
    the SM; -1 where not written) -> the launch's timeline in us (see ``launch_stamps_case``), and
    how programs holding keys fell on SMs: the most and fewest on one SM, and for each such count the
    median time at which those SMs' last stream ended (SMs given more programs finishing later is
    the imbalance a split count that is not a multiple of the SMs leaves)."""
    started = stamps[stamps[:, 0] >= 0]
    ran = started[started[:, 1] >= 0].double()
    t0 = started[:, 0].double().min()
    start, stream_end = ran[:, 0] - t0, ran[:, 1] - t0
    counted = ran[:, 2] >= 0
    merged = ran[:, 3] >= 0
    last = torch.maximum(ran[:, 1], torch.maximum(ran[:, 2], ran[:, 3])).max() - t0
    stream = stream_end - start

    def us(x: torch.Tensor) -> float:
        return float(x) / 1000 if x.numel() else 0.0
    per_sm: dict[int, list[float]] = {}
    for sm, end in zip(ran[:, 4].long().tolist(), stream_end.tolist()):
        per_sm.setdefault(sm, []).append(end)
    by_load: dict[int, list[float]] = {}
    for ends in per_sm.values():
        by_load.setdefault(len(ends), []).append(max(ends))
    return {"programs": int(ran.shape[0]), "empty_programs": int(started.shape[0] - ran.shape[0]),
            "span_us": us(last), "last_start_us": us(start.max()),
            "stream_med_us": us(stream.median()), "stream_max_us": us(stream.max()),
            "first_stream_end_us": us(stream_end.min()), "last_stream_end_us": us(stream_end.max()),
            "count_med_us": us((ran[counted, 2] - ran[counted, 1]).median()) if counted.any() else 0.0,
            "merge_med_us": us((ran[merged, 3] - ran[merged, 2]).median()) if merged.any() else 0.0,
            "merge_max_us": us((ran[merged, 3] - ran[merged, 2]).max()) if merged.any() else 0.0,
            "sms": len(per_sm), "most_on_an_sm": max(len(v) for v in per_sm.values()),
            "fewest_on_an_sm": min(len(v) for v in per_sm.values()),
            "last_end_by_programs_on_sm_us": {k: statistics.median(v) / 1000 for k, v in sorted(by_load.items())}}


def line_fit(points: Sequence[tuple[float, float]]) -> dict:
    """Least squares ms = intercept + bytes / rate: {"TBps": rate, "fixed_us": intercept} (None below 2 points)."""
    if len(points) < 2:
        return {"TBps": None, "fixed_us": None}
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx  # ms per byte
    return {"TBps": 1 / (slope * 1e-3) / 1e12 if slope > 0 else None, "fixed_us": 1000 * (my - slope * mx)}


def merge_chain_case(gen, ceil: dict, batches=(1, 8, 32), context=2048, table_tokens=8448, layers=32, q_heads=32,
                     kv_heads=8, head_dim=128, block_size=16) -> dict:
    """The split merge inside the decode kernel (its last program per sequence and kv head) against
    the second kernel it replaced, as a decode step runs them: ``layers`` launches back to back in one
    CUDA graph, each over its own layer's cache (one block table for all, as in the engine), graph-
    shaped (no length hint, a table ``table_tokens`` wide). bf16; the step's floor is the KV read."""
    rows = []
    scale = 1 / math.sqrt(head_dim)
    for batch in batches:
        kv, wide, lens, q, caches, tiles, counters = chained_layers_setup(
            batch, q_heads, kv_heads, head_dim, context, table_tokens, block_size, layers, gen)
        sms = decode_attention.num_sms(q.device)
        kv_bytes = layers * 2 * batch * context * kv_heads * head_dim * kv.element_size()
        want = ref.paged_decode_attention(q, kv[:, 0, 0], kv[:, 0, 1], wide, lens, scale)
        row: dict = {"shape": {"batch": batch, "context": context, "table_tokens": table_tokens, "layers": layers,
                               "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim,
                               "block_size": block_size},
                     "splits": decode_attention.choose_num_splits(
                         batch, kv_heads, table_tokens, sms, tiles.block_n, programs_per_sm=tiles.programs_per_sm)}
        for label, fused in (("fused", True), ("two_kernels", False)):
            def step(fused=fused, q=q, wide=wide, lens=lens, counters=counters, caches=caches):
                return [decode_attention.paged_decode(q, c[:, 0, 0], c[:, 0, 1], wide, lens, scale, None, None,
                                                      merge_counters=counters, fused_merge=fused) for c in caches]
            err = rel_err(step()[0], want)
            ms = bench_graph(step) or float("nan")
            row[label] = {"graph_ms": ms, "us_per_launch": 1000 * ms / layers, "rel_err": err,
                          "pct_copy": kv_bytes / (ms * 1e-3) / 1e12 / ceil["copy_TBps"]}
        row["two_kernels_over_fused"] = row["two_kernels"]["graph_ms"] / row["fused"]["graph_ms"]
        print(f"merge {batch} x {context} ({row['splits']} splits), {layers} launches in a graph: fused "
              f"{row['fused']['us_per_launch']:.2f} us a launch, two kernels {row['two_kernels']['us_per_launch']:.2f} "
              f"(x{row['two_kernels_over_fused']:.3f}); err {row['fused']['rel_err']:.1e} / "
              f"{row['two_kernels']['rel_err']:.1e}", flush=True)
        rows.append(row)
        del kv, caches
        torch.cuda.empty_cache()
    return {"rows": rows}


def mixed_case(gen, ceil: dict, q_heads=32, kv_heads=8, head_dim=128, block_size=16, layout: str = "token") -> dict:
    """One batch of very different lengths (MIXED_LENS). The launcher gets the lengths as a host-side
    hint (``context_lens``, as the engine's eager steps pass them) and fits its split count to them;
    without the hint it must assume every sequence fills the table (timed too: ``no_hint``). ``layout``: the
    cache's page layout (``paged_setup``)."""
    batch, lo, hi = MIXED_LENS
    lens_l = torch.randint(lo, hi + 1, (batch,), generator=torch.Generator().manual_seed(7)).tolist()
    per_seq = -(-hi // block_size)
    num_blocks = batch * per_seq
    kv = random_pages(num_blocks, block_size, kv_heads, head_dim, gen, layout=layout)
    tables = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32).view(batch, per_seq).contiguous()
    lens = torch.tensor(lens_l, dtype=torch.int32, device="cuda")
    k_cache, v_cache = kv[:, 0, 0], kv[:, 0, 1]
    q = torch.randn(batch, q_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = 1 / math.sqrt(head_dim)
    def launch(hint=True):
        return triton_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale,
                                                 context_lens=lens_l if hint else None)

    out = launch()
    want = ref.paged_decode_attention(q[:4], k_cache, v_cache, tables[:4], lens[:4], scale)
    kv_bytes = 2 * sum(lens_l) * kv_heads * head_dim * kv.element_size()
    ms = bench(launch)
    graph_ms = bench_graph(launch)
    best = min(x for x in (ms, graph_ms) if x is not None)
    no_hint_ms = bench(lambda: launch(False))
    no_hint_graph_ms = bench_graph(lambda: launch(False))
    # diagnostic only (the figure above is the launcher's own choice): what other split counts give
    # on this batch, where the split count is chosen for the longest sequence
    split_ms = {s: bench(lambda s=s: decode_attention.paged_decode(q, k_cache, v_cache, tables, lens, scale, None,
                                                                   None, num_splits=s)) for s in (2, 4, 8, 16, 32)}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bn = decode_attention.choose_tiles(head_dim, kv.dtype, batch * kv_heads, sms).block_n
    row_splits = {"chosen": decode_attention.choose_num_splits(batch, kv_heads, per_seq * block_size, sms, bn,
                                                               context_lens=lens_l),
                  "chosen_without_hint": decode_attention.choose_num_splits(batch, kv_heads, per_seq * block_size,
                                                                            sms, bn),
                  "ms_by_splits": split_ms, "no_hint_ms": no_hint_ms, "no_hint_graph_ms": no_hint_graph_ms}
    row = {"page_layout": layout, "splits": row_splits, "shape": {"batch": batch, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim,
                     "lens": f"{lo}-{hi}", "block_size": block_size},
           "total_tokens": sum(lens_l), "rel_err": rel_err(out[:4], want), "bf16_ms": ms, "bf16_graph_ms": graph_ms,
           "bf16_pct_copy": kv_bytes / (best * 1e-3) / 1e12 / ceil["copy_TBps"]}
    del kv
    torch.cuda.empty_cache()
    return row


def fused_ops_case(gen, ceil: dict, tokens: int, hidden=4096, inter=14336, q_heads=32, kv_heads=8,
                   head_dim=128) -> dict:
    """The fused layer kernels vs the unfused torch code they replace (prefixgate_kernels.reference), at one row
    count: time and bandwidth of the bytes the fused kernel must move."""
    dt = torch.bfloat16
    x = torch.randn(tokens, hidden, device="cuda", dtype=dt, generator=gen)
    res = torch.randn(tokens, hidden, device="cuda", dtype=dt, generator=gen)
    w = torch.randn(hidden, device="cuda", dtype=dt, generator=gen)
    gu = torch.randn(tokens, 2 * inter, device="cuda", dtype=dt, generator=gen)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, device="cuda", dtype=dt, generator=gen)
    ang = torch.rand(tokens, head_dim, device="cuda", generator=gen) * 6.28
    cos, sin = ang.cos(), ang.sin()
    nb = -(-tokens // 16) + 1
    kv = torch.randn(nb, 1, 2, 16, kv_heads, head_dim, device="cuda", dtype=dt, generator=gen)
    kc, vc = kv[:, 0, 0], kv[:, 0, 1]
    slots = torch.randperm(nb * 16, device="cuda", generator=gen)[:tokens].to(torch.int64)
    row: dict = {"tokens": tokens}
    cases = {
        "add_rms_norm": (lambda m: m.add_rms_norm(x, res, w, 1e-5), 3 * x.numel() * 2 + hidden * 2),
        "silu_mul": (lambda m: m.silu_mul(gu), gu.numel() * 2 * 3 // 2),
        "rotary_write_kv": (lambda m: m.rotary_write_kv(qkv, cos, sin, kc, vc, slots, q_heads),
                            qkv.numel() * 2 + (q_heads + 2 * kv_heads) * head_dim * tokens * 2),
    }
    for name, (fn, nbytes) in cases.items():
        saved = res.clone()  # add_rms_norm updates res in place: both sides of the check start equal
        got = fn(triton_ops)
        res.copy_(saved)
        err = rel_err(got, fn(ref))
        fused_ms, torch_ms = bench(lambda fn=fn: fn(triton_ops)), bench(lambda fn=fn: fn(ref))
        row[name] = {"fused_ms": fused_ms, "torch_ms": torch_ms, "speedup": torch_ms / fused_ms, "rel_err": err,
                     "fused_pct_copy": nbytes / (fused_ms * 1e-3) / 1e12 / ceil["copy_TBps"]}
    return row


GEMM_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
               "lm_head": (128256, 4096)}  # Llama-3.1-8B's decode GEMMs (out, in), merged as the engine runs them


def decode_gemm_case(gen, ceil: dict, full_sweeps: bool = False) -> dict:
    """cuBLAS (F.linear, bf16) and prefixgate_kernels.skinny_gemm on the decode step's weight shapes at M = 1..128
    rows, timed as CUDA-graph replays (as the engine runs them: a small GEMM is shorter than a Triton
    launch from Python, so eager timings measure the host): the weight bytes each reads over its time,
    as a share of copy bandwidth. Diagnostic: where a decode step's GPU time above the floor goes."""
    out: dict = {}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, (n, k) in GEMM_SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        wbytes = w.numel() * 2
        for m in (1, 8, 32, 128):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            ms = bench_graph(lambda x=x, w=w: F.linear(x, w)) or float("nan")
            row = {"ms": ms, "pct_copy": wbytes / (ms * 1e-3) / 1e12 / ceil["copy_TBps"]}
            cfg = skinny_gemm.choose_config(m, n, k, sms)
            if cfg is not None:
                want = F.linear(x.float(), w.float())
                row["ours_rel_err"] = rel_err(skinny_gemm.skinny_linear(x, w, None, cfg), want)
                row["ours_ms"] = bench_graph(lambda x=x, w=w, c=cfg: skinny_gemm.skinny_linear(x, w, None, c)) or float("nan")
                row["ours_pct_copy"] = wbytes / (row["ours_ms"] * 1e-3) / 1e12 / ceil["copy_TBps"]
                row["ours_config"] = str(cfg)
                if full_sweeps and m in SKINNY_SWEEP_ROWS:
                    sweep = {}
                    for bn, bk, nw, ns, auto_split in SKINNY_VARIANTS:
                        split = skinny_gemm.split_for(n, k, bn, bk, sms) if auto_split else 1
                        c = skinny_gemm.SkinnyConfig(bn, bk, split, nw, ns)
                        try:
                            t = bench_graph(lambda x=x, w=w, c=c: skinny_gemm.skinny_linear(x, w, None, c))
                            sweep[f"n{bn}_k{bk}_w{nw}_s{ns}_split{split}"] = round(
                                wbytes / (t * 1e-3) / 1e12 / ceil["copy_TBps"], 3)
                        except Exception as e:  # noqa: BLE001  (a tile that does not fit: recorded)
                            sweep[f"n{bn}_k{bk}_w{nw}_s{ns}_split{split}"] = f"{type(e).__name__}"
                    row["ours_sweep_pct_copy"] = sweep
            out[f"{name}_m{m}"] = row
        del w
    return out


def decode_gemm_chain_case(gen, ceil: dict, layers: int = 32) -> dict:
    """The decode step's GEMMs as the model runs them: q|k|v, o, gate|up, down for each of ``layers``
    layers, each with its own weights (nothing stays in L2 from one to the next), one CUDA graph,
    at M = 1 / 8 / 32 rows; the weight bytes over the replay's time as a share of copy bandwidth.
    A single GEMM's graph (``decode_gemm_case``) pays its ramp-up and tail alone; here they overlap
    as in a real step. Each BLAS back end torch offers is measured in the same run (cuBLAS, cuBLASLt),
    checked against the first on the same inputs.

    Two rows tell the chain's gap apart (session 8): ``no_glue`` is the same GEMMs without the small
    add that keeps each output live (a graph runs every captured kernel, used or not), and
    ``one_gemm`` one cuBLAS GEMM reading the same bytes (K = 4096): how fast cuBLAS streams these
    weights when no kernel boundary interrupts the stream. chain < no_glue < one_gemm in time means
    the boundaries between GEMMs (ramp and tail of each) are what the chain loses."""
    shapes = [GEMM_SHAPES[k] for k in ("qkv", "o", "gate_up", "down")]
    weights = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 for n, k in shapes]
               for _ in range(layers)]
    wbytes = sum(w.numel() * 2 for ws in weights for w in ws)
    out: dict = {"layers": layers, "weight_GB": wbytes / 1e9}
    one_k = 4096
    one_w = torch.randn(wbytes // (2 * one_k), one_k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    one_bytes = one_w.numel() * 2
    default = torch.backends.cuda.preferred_blas_library()
    for m in (1, 8, 32):
        xs = {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen) for _, k in shapes}

        def chain(xs=xs) -> torch.Tensor:
            acc = None
            for ws in weights:
                for w in ws:
                    y = F.linear(xs[w.shape[1]], w)
                    acc = y[:, :1] if acc is None else acc + y[:, :1]  # keeps every GEMM live
            return acc

        row: dict = {}
        ref = None
        for lib in ("cublas", "cublaslt"):
            try:
                torch.backends.cuda.preferred_blas_library(lib)
                got = chain()
                ms = bench_graph(chain) or float("nan")
                err = 0.0 if ref is None else rel_err(got, ref)
                ref = got if ref is None else ref
                row[lib] = {"ms": ms, "pct_copy": wbytes / (ms * 1e-3) / 1e12 / ceil["copy_TBps"], "rel_err_vs_first": err}
            except Exception as e:  # noqa: BLE001  (a back end missing from this build: recorded)
                row[lib] = {"error": f"{type(e).__name__}: {e}"}
            finally:
                torch.backends.cuda.preferred_blas_library(default)

        def no_glue(xs=xs) -> list[torch.Tensor]:
            return [F.linear(xs[w.shape[1]], w) for ws in weights for w in ws]
        ms = bench_graph(no_glue) or float("nan")
        row["no_glue"] = {"ms": ms, "pct_copy": wbytes / (ms * 1e-3) / 1e12 / ceil["copy_TBps"]}
        x1 = torch.randn(m, one_k, device="cuda", dtype=torch.bfloat16, generator=gen)
        ms = bench_graph(lambda x1=x1, w1=one_w: F.linear(x1, w1)) or float("nan")
        row["one_gemm"] = {"ms": ms, "pct_copy": one_bytes / (ms * 1e-3) / 1e12 / ceil["copy_TBps"]}
        want = torch.cat([y.flatten().float() for y in no_glue()])
        for label, variant in CHAIN_VARIANTS.items():
            linears = {w.shape: variant(*w.shape) for ws in weights[:1] for w in ws}

            def tchain(xs=xs, linears=linears) -> list[torch.Tensor]:
                return [linears[w.shape].run(xs[w.shape[1]], w) for ws in weights for w in ws]
            try:
                err = rel_err(torch.cat([y.flatten().float() for y in tchain()]), want)
                ms = bench_graph(tchain) or float("nan")
                row[label] = {"ms": ms, "pct_copy": wbytes / (ms * 1e-3) / 1e12 / ceil["copy_TBps"],
                              "rel_err_vs_cublas": err, "configs": {str(k): v.config for k, v in linears.items()}}
            except Exception as e:  # noqa: BLE001  (PDL refused by this driver or build: recorded)
                row[label] = {"error": f"{type(e).__name__}: {e}"}
        one = CHAIN_VARIANTS["triton"](*one_w.shape)  # the kernel's streaming rate with no boundary in the way
        ms = bench_graph(lambda x1=x1, w1=one_w, one=one: one.run(x1, w1)) or float("nan")
        row["triton_one_gemm"] = {"ms": ms, "pct_copy": one_bytes / (ms * 1e-3) / 1e12 / ceil["copy_TBps"]}
        out[f"m{m}"] = row
    del one_w
    return out


def pdl_gemm_config(n: int, k: int, pdl: bool = False,
                    launch_next: skinny_gemm.LaunchNext = skinny_gemm.LaunchNext.AT_START) -> skinny_gemm.SkinnyConfig:
    """Session 8's weight-streaming tiles for the chain: the whole K range per program (no split, so no
    reduce kernel and one boundary per GEMM), 16-64 output rows per program, the widest that still
    gives two programs per SM; 256-wide K slices, three stages for 64-row tiles (80 KB of shared
    memory: 2 programs per SM; four would hold one), four otherwise."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return dataclasses.replace(skinny_gemm.chain_config(1, n, k, sms), pdl=pdl, launch_next=launch_next)


@dataclass(frozen=True)
class ChainLinear:
    """One GEMM of the chain as a variant runs it: x [M, K] -> x @ w.T, and the tiles it used."""

    run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    config: str


def skinny_variant(**kw) -> Callable[[int, int], ChainLinear]:
    def make(n: int, k: int) -> ChainLinear:
        cfg = pdl_gemm_config(n, k, **kw)
        return ChainLinear(lambda x, w: skinny_gemm.skinny_linear(x, w, None, cfg), str(cfg))
    return make


# The chain through prefixgate_kernels.skinny_gemm (session 8, calls 2-3 and 6): whole-K programs; PDL with the
# next grid launched at each program's start (20 points slower) or after its weight loop (no gain).
# Also measured and dropped: 512-wide K tiles, 8 warps, the L2 prefetch and no explicit trigger (in
# skinny_gemm until 8d8a8ca), and a persistent grid of 1-2 programs per SM (prefixgate_kernels/stream_gemm.py at
# 13472b9: 67 % without PDL, 40 % with it at M = 1; one GEMM 77 %: too few bytes in flight per SM).
# Session 12: the trigger after the program's wait (no chain of parked grids), with and without the L2
# prefetch, and a small kernel before each GEMM with PDL: 62-64 % at M = 1 (at 5ef5902; docs/gpu.md).
CHAIN_VARIANTS: dict[str, Callable[[int, int], ChainLinear]] = {
    "triton": skinny_variant(),
    "triton_pdl": skinny_variant(pdl=True),
    "triton_pdl_after_loop": skinny_variant(pdl=True, launch_next=skinny_gemm.LaunchNext.AFTER_LOOP),
}


SKINNY_SWEEP_ROWS = (1, 32)
SKINNY_VARIANTS = [  # (block_n, block_k, num_warps, num_stages, split automatically)
    (64, 256, 4, 4, True), (32, 256, 4, 4, True), (128, 256, 4, 4, True), (64, 128, 4, 4, True),
    (64, 256, 4, 3, True), (64, 256, 8, 4, True), (64, 256, 4, 4, False), (32, 128, 4, 6, True),
    (128, 128, 8, 4, True), (16, 512, 4, 4, True),
]


def prefill_case(gen, ceil: dict, quick: bool, full_sweeps: bool = False, batch=4, cached=8192, new=512, q_heads=32, kv_heads=8,
                 head_dim=128, block_size=16, sweep_splits: bool = False, quantized: bool = False) -> dict:
    context = cached + new
    scale = 1 / math.sqrt(head_dim)
    kv, tables, lens = paged_setup(batch, kv_heads, head_dim, context, block_size, gen)
    k_cache, v_cache = kv[:, 0, 0], kv[:, 0, 1]
    q = torch.randn(batch * new, q_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * new
    # Visible (query, key) pairs per head: every cached key + the causal triangle of the new ones.
    pairs = batch * (new * cached + new * (new + 1) // 2)
    flops = 4 * pairs * q_heads * head_dim
    row: dict = {"shape": {"batch": batch, "cached": cached, "new": new, "q_heads": q_heads, "kv_heads": kv_heads,
                           "head_dim": head_dim, "block_size": block_size}, "flops": flops}
    hint = [context] * batch  # the engine's eager steps pass the lengths (AttentionMetadata.context_lens)
    out = triton_ops.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale, context_lens=hint)
    want = ref.paged_prefill_attention(q[:new], k_cache, v_cache, tables[:1], cu[:2], lens[:1], scale)
    row["rel_err"] = rel_err(out[:new], want)
    ms = bench(lambda: triton_ops.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale,
                                                          context_lens=hint))
    row["ms"] = ms
    row["graph_ms"] = bench_graph(lambda: triton_ops.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens,
                                                                             scale, context_lens=hint))
    row["TFLOPs"] = flops / (ms * 1e-3) / 1e12
    row["pct_matmul"] = row["TFLOPs"] / ceil["matmul_bf16_TFLOPs"]
    tiles = prefill_attention.choose_prefill_tiles(batch * new, True)
    row["tiles"] = {"block_m": tiles.block_m, "block_n": tiles.block_n, "num_warps": tiles.num_warps,
                    "programs_per_sm": tiles.programs_per_sm}
    plan = prefill_attention.plan_prefill(batch * new, batch, q_heads, context, q.device, CacheLayout.of(q.dtype, k_cache))
    row["num_splits"], row["kernel"] = plan.splits, plan.kernel.value  # what the launches above ran
    row["no_hint_ms"] = bench(lambda: triton_ops.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale))
    if sweep_splits:
        split_ms = {}
        for label, bm, bn, nw, ns in PREFILL_SPLIT_TILES:
            for sp in PREFILL_SPLITS:
                def run_s(bm=bm, bn=bn, nw=nw, ns=ns, sp=sp):
                    return prefill_attention.paged_prefill(q, k_cache, v_cache, tables, cu, lens, scale, None, None,
                                                           max_q_len=new, block_m=bm, block_n=bn, num_warps=nw,
                                                           num_stages=ns, num_splits=sp)
                try:
                    err = rel_err(run_s()[:new], want)
                    t = bench(run_s)
                    split_ms[f"{label}_splits{sp}"] = {"ms": t, "TFLOPs": flops / (t * 1e-3) / 1e12, "rel_err": err}
                except Exception as e:  # noqa: BLE001  (record, keep going)
                    split_ms[f"{label}_splits{sp}"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        row["split_sweep"] = split_ms
    if quantized:  # the same launch on fp8 / int8 caches, against the reference on those caches
        for qname, dtype in (("fp8", ref.FP8_DTYPE), ("int8", torch.int8)):
            qkv, ks, vs = quantize_cache(kv, dtype)
            kq, vq = qkv[:, 0, 0], qkv[:, 0, 1]
            outq = triton_ops.paged_prefill_attention(q, kq, vq, tables, cu, lens, scale, ks, vs, context_lens=hint)
            wantq = ref.paged_prefill_attention(q[:new], kq, vq, tables[:1], cu[:2], lens[:1], scale, ks, vs)
            row[f"{qname}_rel_err"] = rel_err(outq[:new], wantq)
            row[f"{qname}_vs_bf16_rel_err"] = rel_err(outq, out)
            row[f"{qname}_ms"] = bench(lambda kq=kq, vq=vq, ks=ks, vs=vs: triton_ops.paged_prefill_attention(
                q, kq, vq, tables, cu, lens, scale, ks, vs, context_lens=hint))
            del qkv, kq, vq
    if not quick and full_sweeps:
        variants = {}
        for bm, bn, nw, ns in PREFILL_VARIANTS:
            def run(bm=bm, bn=bn, nw=nw, ns=ns):
                return prefill_attention.paged_prefill(q, k_cache, v_cache, tables, cu, lens, scale, None, None,
                                                       max_q_len=new, block_m=bm, block_n=bn, num_warps=nw,
                                                       num_stages=ns)
            try:
                err = rel_err(run()[:new], want)
                t = bench(run)
                variants[f"m{bm}_n{bn}_w{nw}_s{ns}"] = {"ms": t, "TFLOPs": flops / (t * 1e-3) / 1e12, "rel_err": err}
            except Exception as e:  # e.g. out of shared memory for a large tile: record, keep going
                variants[f"m{bm}_n{bn}_w{nw}_s{ns}"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        row["variants"] = variants

    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(new, context)
    qs = q.view(batch, new, q_heads, head_dim).transpose(1, 2)  # [B, Hq, new, D]

    def gather_sdpa(gqa: bool):
        ids = tables.long()
        k = k_cache[ids].reshape(batch, context, kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, ctx, D]
        v = v_cache[ids].reshape(batch, context, kv_heads, head_dim).transpose(1, 2)
        if not gqa:
            k = k.repeat_interleave(q_heads // kv_heads, dim=1)
            v = v.repeat_interleave(q_heads // kv_heads, dim=1)
            return F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
        return F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    for gqa in (True, False):
        try:
            g = gather_sdpa(gqa).transpose(1, 2).reshape(batch * new, q_heads, head_dim)
            row["gather_sdpa_form"] = "enable_gqa" if gqa else "repeat_interleave"
            break
        except Exception as e:
            row["gather_sdpa_gqa_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    row["gather_sdpa_rel_err"] = rel_err(g, out)
    row["gather_sdpa_ms"] = bench(lambda: gather_sdpa(row["gather_sdpa_form"] == "enable_gqa"))
    row["vs_gather_sdpa"] = row["gather_sdpa_ms"] / ms
    del kv
    torch.cuda.empty_cache()
    return row


# (label, block_m, block_n, num_warps, num_stages, programs_per_sm) timed beside the launcher's choice on
# steps of 16-256 tokens over ~8K cached (--suffix-sweep), each at the split count the launcher's policy
# gives that tile set: where the 64-row tiles stop paying
SUFFIX_VARIANTS = [("m64_n64_w4_s3", 64, 64, 4, 3, 2), ("m64_n64_w4_s2", 64, 64, 4, 2, 2),
                   ("m128_n128_w8_s3", 128, 128, 8, 3, 1), ("m128_n128_w8_s2", 128, 128, 8, 2, 1),
                   ("m128_n64_w8_s3", 128, 64, 8, 3, 1)]


def suffix_sweep(gen, news=(16, 64, 128, 256, 512), head_dims=(128, 64), context=8192, q_heads=32, kv_heads=8,
                 block_size=16, variants: bool = True) -> list[dict]:
    """Short and mid-sized steps over a long cached prefix: the launcher's tiles against SUFFIX_VARIANTS
    (``variants``), all against the reference. Timed as CUDA-graph replays (``ms``), as the engine runs
    these steps (engine/prefill_graphs.py): a launch of 0.05-0.1 ms of kernels is host-bound when timed
    eagerly (session 10 call 2: one tile set read 0.060 and 0.120 ms in two eager timings); the
    launcher's eager time is kept as ``eager_ms``. ``first_call_s`` is the launcher's first call of the
    row: with an empty Triton cache it holds the compile of any (tiles, split) variant not met before,
    which is what a server pays at its prefill-graph capture."""
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for head_dim in head_dims:
        kv, tables, lens = paged_setup(1, kv_heads, head_dim, context, block_size, gen)
        k_cache, v_cache = kv[:, 0, 0], kv[:, 0, 1]
        scale = 1 / math.sqrt(head_dim)
        for new in news:
            q = torch.randn(new, q_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
            cu = torch.tensor([0, new], device="cuda", dtype=torch.int32)
            want = ref.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale)
            tiles = prefill_attention.choose_prefill_tiles(new, True)
            row: dict = {"new": new, "cached": context - new, "head_dim": head_dim, "q_heads": q_heads,
                         "kv_heads": kv_heads, "launcher": {"tiles": f"m{tiles.block_m}_n{tiles.block_n}_w"
                                                            f"{tiles.num_warps}"}}

            def launch(q=q, k_cache=k_cache, v_cache=v_cache, tables=tables, cu=cu, lens=lens, scale=scale, **kw):
                return prefill_attention.paged_prefill(q, k_cache, v_cache, tables, cu, lens, scale, None, None,
                                                       context_lens=[context], **kw)
            torch.cuda.synchronize()
            t_first = time.perf_counter()
            got = launch()
            torch.cuda.synchronize()
            row["launcher"]["first_call_s"] = time.perf_counter() - t_first
            plan = prefill_attention.plan_prefill(new, 1, q_heads, context, q.device,
                                                  CacheLayout.of(q.dtype, k_cache))
            row["launcher"]["splits"] = plan.splits
            row["launcher"]["kernel"] = plan.kernel.value
            row["launcher"]["rel_err"] = rel_err(got, want)
            row["launcher"]["ms"] = bench_graph(launch)
            row["launcher"]["eager_ms"] = bench(launch)
            for label, bm, bn, nw, ns, pps in (SUFFIX_VARIANTS if variants else ()):
                splits = prefill_attention.splits_for_launch(new, 1, q_heads, context, sms, bm, pps)
                kw = {"block_m": bm, "block_n": bn, "num_warps": nw, "num_stages": ns, "num_splits": splits}
                try:
                    err = rel_err(launch(**kw), want)
                    row[label] = {"ms": bench_graph(lambda kw=kw: launch(**kw)), "splits": splits, "rel_err": err}
                except Exception as e:  # noqa: BLE001  (a tile that does not fit: record, keep going)
                    row[label] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
            rows.append(row)
            print(f"suffix {new} over {context - new}, D{head_dim} (graph ms): launcher {row['launcher']['tiles']} "
                  f"x{row['launcher']['splits']} {_ms(row['launcher']['ms'])} (eager {row['launcher']['eager_ms']:.3f}, "
                  f"first call {row['launcher']['first_call_s']:.2f} s); "
                  + ", ".join(f"{k} {_ms(v['ms'])} ({v['splits']} splits)" for k, v in row.items()
                              if isinstance(v, dict) and "ms" in v and k != "launcher"), flush=True)
        del kv
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/kernels_h200.json")
    ap.add_argument("--quick", action="store_true", help="skip the tile-size variants")
    ap.add_argument("--full-sweeps", action="store_true",
                    help="also the bf16 split sweep, the skinny-GEMM tile sweep, the prefill tile variants and "
                         "the prefill split counts at the prefix-hit shapes "
                         "(session 2's diagnostics; ~60 s more)")
    ap.add_argument("--shapes", default=None, help="comma-separated indices into DECODE_SHAPES (default: all)")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--prefill-only", action="store_true", help="only the ceilings and the prefill cases")
    ap.add_argument("--suffix-sweep", action="store_true",
                    help="only the ceilings and steps of 16-256 tokens over 8K cached: launcher vs SUFFIX_VARIANTS")
    ap.add_argument("--skip-classes", action="store_true", help="skip DECODE_CLASSES, the mixed batch, fused ops")
    ap.add_argument("--page-layouts", default=ENGINE_CUDA_LAYOUT,
                    help="comma-separated KV page layouts (token: a token's heads adjacent; head: each page head by "
                         "head). The first lays out the decode shapes, the class table, the mixed batch and the "
                         "chains; each further one, the classes again (result['classes_by_layout']) and, with "
                         f"--classes, their chains too. Default: the engine's own on CUDA ({ENGINE_CUDA_LAYOUT})")
    ap.add_argument("--class-variants", action="store_true",
                    help="with --classes: time the 8-bit tile variants on those classes too")
    ap.add_argument("--classes", default=None, help="comma-separated indices into DECODE_CLASSES: only those "
                                                    "classes (no decode shapes unless --shapes names some, no "
                                                    "mixed batch, fused ops or GEMMs)")
    ap.add_argument("--gemm-only", action="store_true", help="only the ceilings and the decode GEMMs")
    ap.add_argument("--graph-splits-only", action="store_true",
                    help="only the ceilings and the graph-shaped decode launches (graph_split_case)")
    ap.add_argument("--merge-only", action="store_true",
                    help="only the ceilings and the split merge in the kernel against a second kernel (merge_chain_case)")
    ap.add_argument("--fp8-split-sweep", action="store_true",
                    help="only the ceilings and fp8 on the few-pair classes at split counts around the launcher's, "
                         "both fp8 tile sets (fp8_split_sweep_case)")
    ap.add_argument("--launch-floor", action="store_true",
                    help="only the ceilings and batch-1 decode launches over 4K-128K contexts: stream rate and "
                         "fixed cost per launch (launch_floor_case)")
    ap.add_argument("--launch-stamps", action="store_true",
                    help="only the ceilings, the GPU-timer stamps of every program of a few decode launches "
                         "(launch_stamps_case) and CHAIN_CLASSES in chains of launches (few_pair_chain_case)")
    ap.add_argument("--chain-splits", action="store_true",
                    help="only the ceilings and the engine's graph-shaped decode launches chained at split counts "
                         "around the launcher's (chain_split_sweep_case)")
    ap.add_argument("--probes16", action="store_true",
                    help="only the ceilings, the prefix hit's attention over tile sets / stages / splits "
                         "(hit_tile_sweep_case) and the o / down GEMMs as sliced batched GEMMs (gemm_split_probe_case)")
    for flag, (_, _, what) in SOLO_PROBES.items():
        ap.add_argument(f"--{flag}", action="store_true", help=f"only the ceilings and {what}")
    ap.add_argument("--gemm-split-shapes", default=None,
                    help="only the ceilings and gemm_split_probe_case on these GEMM_SHAPES names (e.g. qkv,gate_up)")
    ap.add_argument("--skip-gemms", action="store_true", help="skip the decode GEMM diagnostics")
    ap.add_argument("--launcher-only", action="store_true",
                    help="decode: time the launcher's own tiles only (not the session-2 tiles or the other fp8 set); "
                         "with --suffix-sweep: the launcher's rows only")
    args = ap.parse_args()
    layouts = [x for x in args.page_layouts.split(",") if x]
    if not layouts or any(x not in PAGE_LAYOUTS for x in layouts):
        ap.error(f"--page-layouts: each of {PAGE_LAYOUTS}, got {args.page_layouts!r}")
    primary = layouts[0]
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.time()
    ceil = ceilings()
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "gpu": torch.cuda.get_device_name(0),
        "commit": git_commit(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "ceilings": ceil,
        "page_layout": primary,
        "decode": [],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        # after every case, so that a run cut off by a time limit keeps what it measured (session 3
        # run 2 lost every figure to a timeout before the final write)
        result["wall_s"] = time.time() - t0
        out.write_text(json.dumps(result, indent=2))

    picked = DECODE_SHAPES if args.shapes is None else [DECODE_SHAPES[int(i)] for i in args.shapes.split(",") if i]
    if args.classes is not None and args.shapes is None:
        # --classes asks for those classes only (its help); the decode shapes before them cost a device call
        # ~80 s and, in session 32's call 1, its whole time limit
        picked = []
    if args.prefill_only:
        picked, args.skip_classes, args.skip_prefill = [], True, False
    if args.suffix_sweep:
        picked, args.skip_classes, args.skip_prefill = [], True, True
        result["suffix_sweep"] = suffix_sweep(gen, variants=not args.launcher_only)
        save()
    if args.graph_splits_only:
        picked, args.skip_classes, args.skip_prefill = [], True, True
        result["graph_splits"] = graph_split_case(gen, ceil)
        save()
    if args.merge_only:
        picked, args.skip_classes, args.skip_prefill = [], True, True
        result["merge_chain"] = merge_chain_case(gen, ceil)
        save()
    if args.fp8_split_sweep:
        picked, args.skip_classes, args.skip_prefill = [], True, True
        result["fp8_split_sweep"] = fp8_split_sweep_case(gen)
        save()
        def ms(x: float | None) -> str:  # bench_graph gives None where a capture failed
            return "-" if x is None else f"{x:.4f}"
        for row in result["fp8_split_sweep"]:
            got = {k: v["graph_ms"] for k, v in row.items() if isinstance(v, dict) and "graph_ms" in v}
            best = min(got, key=lambda k: got[k] or float("inf"))
            print(f"fp8 splits {','.join(str(v) for v in row['shape'].values())}: bf16 {ms(row['bf16_graph_ms'])} ms, "
                  f"launcher ({row['launcher_tiles']}) {ms(row['launcher_graph_ms'])} (merge in a second kernel "
                  f"{ms(row['second_kernel_merge_graph_ms'])}); persistent counters bf16 {ms(row['bf16_persistent_graph_ms'])}, "
                  f"fp8 {ms(row['launcher_persistent_graph_ms'])}, chunk 16 {ms(row['chunk16_persistent_graph_ms'])}; "
                  f"best {best} {ms(got[best])}: "
                  + "  ".join(f"{k} {ms(v)}" for k, v in got.items()), flush=True)
    if args.launch_floor:
        picked, args.skip_classes, args.skip_prefill = [], True, True
        result["launch_floor"] = floor = launch_floor_case(gen)
        save()
        print(f"launch floor: a one-kernel graph {floor['null_graph_ms']:.4f} ms; "
              + "  ".join(f"{k} {v['TBps'] or 0:.2f} TB/s + {v['fixed_us'] or 0:.1f} us" for k, v in floor["fits"].items()),
              flush=True)
        for r in floor["rows"]:
            print(f"  1 x {r['context']} ({r['bf16']['splits']} / {r['fp8']['splits']} splits): "
                  + "  ".join(f"{n} " + "/".join(f"{v:.4f}" for k, v in r[n].items() if k.endswith("_ms") and v)
                              for n in ("bf16", "fp8"))
                  + f"  err {r['bf16']['rel_err']:.1e} / {r['fp8']['rel_err']:.1e}", flush=True)
    if args.launch_stamps:
        picked, args.skip_classes, args.skip_prefill = [], True, True
        result["launch_stamps"] = launch_stamps_case(gen)
        save()
        result["few_pair_chain"] = few_pair_chain_case(gen)
        save()
    if args.chain_splits:
        picked, args.skip_classes, args.skip_prefill = [], True, True
        result["chain_splits"] = chain_split_sweep_case(gen)
        save()
    if args.probes16:
        picked, args.skip_classes, args.skip_prefill = [], True, True
        result["gemm_split_probe"] = gemm_split_probe_case(gen, ceil)
        save()
        result["hit_tile_sweep"] = hit_tile_sweep_case(gen)
        save()
    for flag, (key, case, _) in SOLO_PROBES.items():
        if vars(args)[flag.replace("-", "_")]:
            picked, args.skip_classes, args.skip_prefill = [], True, True
            result[key] = case(gen)
            save()
    if args.gemm_split_shapes:
        picked, args.skip_classes, args.skip_prefill = [], True, True
        result["gemm_split_probe"] = gemm_split_probe_case(gen, ceil, names=tuple(args.gemm_split_shapes.split(",")))
        save()
    if args.gemm_only:
        picked, args.skip_classes, args.skip_prefill = [], True, True
        result["decode_gemms"] = decode_gemm_case(gen, ceil, args.full_sweeps)
        result["decode_gemm_chain"] = decode_gemm_chain_case(gen, ceil)
        save()
    for shape in picked:
        result["decode"].append(decode_case(shape, gen, ceil, args.quick, args.full_sweeps,
                                            compare_tiles=not args.launcher_only, layout=primary))
        save()
        print(f"decode {shape} done ({time.time() - t0:.0f}s)", flush=True)
    if args.classes is not None and not args.skip_classes:
        # --class-variants: the 8-bit tile variants on the picked classes too (head dim 64: QUANT_TILES_HD64)
        picked_classes = [int(i) for i in args.classes.split(",") if i]
        result["classes"] = [decode_case(DECODE_CLASSES[i], gen, ceil, quick=not args.class_variants,
                                         layout=primary) for i in picked_classes]
        save()
        for layout in layouts[1:]:
            result.setdefault("classes_by_layout", {})[layout] = [
                decode_case(DECODE_CLASSES[i], gen, ceil, quick=not args.class_variants, compare_tiles=False,
                            layout=layout) for i in picked_classes]
            save()
            chains = result.setdefault("chain_by_layout", {})
            for each in (primary, layout):
                chains[each] = few_pair_chain_case(gen, classes=picked_classes, layout=each)
                save()
    elif not args.skip_classes:
        result["classes"] = []
        for shape in DECODE_CLASSES:
            try:
                result["classes"].append(decode_case(shape, gen, ceil, quick=True, compare_tiles=not args.launcher_only,
                                                     layout=primary))
            except Exception as e:  # noqa: BLE001  (one shape failing must not lose the others)
                result["classes"].append({"shape": dict(zip(["batch", "q_heads", "kv_heads", "head_dim", "context",
                                                             "block_size"], shape)), "error": f"{type(e).__name__}: {e}"})
            save()
            print(f"class {shape} done ({time.time() - t0:.0f}s)", flush=True)
        result["mixed"] = mixed_case(gen, ceil, layout=primary)
        save()
        result["graph_splits"] = graph_split_case(gen, ceil)
        save()
        result["merge_chain"] = merge_chain_case(gen, ceil)
        save()
        # the classes whose one-launch graphs carry the graph's own launch in every figure (session 15)
        result["few_pair_chain"] = few_pair_chain_case(gen, layout=primary)
        save()
        for layout in layouts[1:]:
            result.setdefault("classes_by_layout", {})[layout] = [
                decode_case(shape, gen, ceil, quick=True, compare_tiles=False, layout=layout)
                for shape in DECODE_CLASSES]
            save()
        result["fused_ops"] = [fused_ops_case(gen, ceil, n) for n in (32, 16384)]
        if not args.skip_gemms:
            result["decode_gemms"] = decode_gemm_case(gen, ceil, args.full_sweeps)
    if not args.skip_prefill:
        result["prefill"] = prefill_case(gen, ceil, args.quick, args.full_sweeps)
        save()
        # a prefix hit's step: one sequence, 512 new tokens over 7,680 cached (the launcher picks its tiles)
        result["prefill_hit"] = prefill_case(gen, ceil, args.quick, args.full_sweeps, batch=1, cached=7680, new=512,
                                             sweep_splits=args.full_sweeps, quantized=True)
        save()
        # a short suffix over a long prefix (a chat turn after a cached system prompt): 32 programs unsplit
        result["prefill_hit_short"] = prefill_case(gen, ceil, args.quick, args.full_sweeps, batch=1, cached=8128,
                                                   new=64, sweep_splits=args.full_sweeps, quantized=True)
        save()
        # the issue's hit shape with block size 32 and GQA 1 / head dim 64 (the launcher's choice only)
        result["prefill_hit_classes"] = [
            prefill_case(gen, ceil, True, batch=1, cached=7680, new=512, block_size=32),
            prefill_case(gen, ceil, True, batch=1, cached=8128, new=64, q_heads=32, kv_heads=32),
            prefill_case(gen, ceil, True, batch=1, cached=8128, new=64, q_heads=32, kv_heads=8, head_dim=64),
        ]
    save()
    print_table(result)
    print(f"wrote {out}")
    return 0


def print_table(r: dict) -> None:
    c = r["ceilings"]
    print(f"\n{r['gpu']}  torch {r['torch']}  triton {r['triton']}  commit {r['commit'][:10]}")
    print(f"copy {c['copy_TBps']:.2f} TB/s (read+write)   bf16 matmul {c['matmul_bf16_TFLOPs']:.0f} TFLOP/s   "
          f"KV pages: {r.get('page_layout', 'token')}")
    hdr = (f"{'decode B,Hq,Hkv,D,ctx,BS':<28}{'ours ms':>9}{'again':>7}{'%copy':>7}{'sdpa':>8}{'gath+sdpa':>10}"
           f"{'fp8 ms':>8}{'fp8 x':>7}{'int8 ms':>8}{'int8 x':>7}{'err bf16/fp8/int8':>24}")
    print(hdr)
    for d in r["decode"]:
        s = ",".join(str(v) for v in d["shape"].values())
        print(f"{s:<28}{d['bf16_ms']:>9.3f}{d['bf16_ms_repeat']:>7.3f}{100 * d['bf16_pct_copy']:>6.0f}%"
              f"{d['sdpa_contig_ms']:>8.3f}{d['gather_sdpa_ms']:>10.3f}{d['fp8_ms']:>8.3f}{d['fp8_speedup_vs_bf16']:>7.2f}"
              f"{d['int8_ms']:>8.3f}{d['int8_speedup_vs_bf16']:>7.2f}"
              f"   {d['bf16_rel_err']:.1e}/{d['fp8_rel_err']:.1e}/{d['int8_rel_err']:.1e}")
    print("fp8 vs bf16, launcher's tiles / session-2 tiles (64, 4 warps, 2 stages), eager: " + "  ".join(
        f"{d['shape']['batch']}x{d['shape']['context']}: {d['fp8_speedup_vs_bf16']:.2f}/"
        f"{d['bf16_ms'] / d['fp8_prev_tiles_ms'] if 'fp8_prev_tiles_ms' in d else float('nan'):.2f}"
        for d in r["decode"]))
    print("CUDA-graph replay (ms): " + "  ".join(
        f"{d['shape']['batch']}x{d['shape']['context']}: bf16 {_ms(d.get('bf16_graph_ms'))} fp8 {_ms(d.get('fp8_graph_ms'))}"
        f" int8 {_ms(d.get('int8_graph_ms'))}" for d in r["decode"]))
    if r.get("classes"):
        print(f"{'shape class B,Hq,Hkv,D,ctx,BS':<30}{'splits':>7}{'eager ms':>9}{'graph ms':>9}{'%copy':>7}"
              f"{'vs sdpa':>8}{'fp8 x':>7}{'prev tiles bf16/fp8 ms':>24}")
        for d in r["classes"]:
            s = ",".join(str(v) for v in d["shape"].values())
            if "error" in d:
                print(f"{s:<30}  ERROR {d['error'][:80]}")
                continue
            best = min(x for x in (d["bf16_ms"], d.get("bf16_graph_ms")) if x is not None)
            fp8_best = min(x for x in (d["fp8_ms"], d.get("fp8_graph_ms")) if x is not None)
            prev = "/".join(_ms(_best(d, f"{k}_prev_tiles_ms", f"{k}_prev_tiles_graph_ms")) for k in ("bf16", "fp8"))
            print(f"{s:<30}{d['num_splits']:>7}{d['bf16_ms']:>9.3f}{_ms(d.get('bf16_graph_ms')):>9}"
                  f"{100 * d['bf16_pct_copy'] * d['bf16_ms'] / best:>6.0f}%{d['sdpa_contig_ms'] / best:>8.2f}"
                  f"{best / fp8_best:>7.2f}{prev:>24}")
            if "fp8_rows" in d and "bf16_rows" in d:  # decode_rows beside the launcher (session 32)
                fr, br = d["fp8_rows"], d["bf16_rows"]
                print(f"{'':<30}whole rows: bf16 {_ms(br.get('graph_ms'))} ms, fp8 {_ms(fr.get('graph_ms'))} ms "
                      f"(fp8 x {best / min(x for x in (fr['ms'], fr.get('graph_ms')) if x is not None):.2f} "
                      f"of the launcher's bf16; err {br['rel_err']:.1e} / {fr['rel_err']:.1e})")
    for row in r.get("graph_splits", {}).get("rows", []):
        sh = row["shape"]
        cells = "  ".join(f"{name} {row[f'{name}_fixed']['graph_ms']:.4f} / {row[f'{name}_by_length']['graph_ms']:.4f}"
                          f" / {row[f'{name}_exact_table']['graph_ms']:.4f}" for name in ("bf16", "fp8"))
        print(f"graph-shaped decode {sh['batch']} x {sh['context']} in a {sh['table_tokens']}-token table, ms fixed / "
              f"by length / exact table: {cells}")
    for row in r.get("merge_chain", {}).get("rows", []):
        sh = row["shape"]
        print(f"split merge, {sh['layers']} launches of {sh['batch']} x {sh['context']} in a graph: in the kernel "
              f"{row['fused']['us_per_launch']:.2f} us a launch, a second kernel {row['two_kernels']['us_per_launch']:.2f}"
              f" (x{row['two_kernels_over_fused']:.3f})")
    m = r.get("mixed")
    if m:
        sp = m["splits"]
        print(f"mixed lengths {m['shape']['lens']} x {m['shape']['batch']}: {m['bf16_ms']:.3f} ms eager, "
              f"{_ms(m.get('bf16_graph_ms'))} graph, {100 * m['bf16_pct_copy']:.0f}% of copy, err {m['rel_err']:.1e}; "
              f"splits {sp['chosen']} with the length hint, {sp.get('chosen_without_hint')} without "
              f"({_ms(sp.get('no_hint_ms'))} eager, {_ms(sp.get('no_hint_graph_ms'))} graph)")
    for f in r.get("fused_ops", []):
        print(f"fused ops at {f['tokens']} rows: " + "  ".join(
            f"{k} {v['fused_ms']:.3f} ms ({v['speedup']:.1f}x torch, {100 * v['fused_pct_copy']:.0f}% copy, "
            f"err {v['rel_err']:.0e})" for k, v in f.items() if isinstance(v, dict)))
    ch = r.get("decode_gemm_chain")
    if ch:
        print(f"decode GEMM chain ({ch['layers']} layers, {ch['weight_GB']:.1f} GB, one graph), % of copy: " + "  ".join(
            f"m{m} " + "/".join(f"{lib} {100 * v['pct_copy']:.0f}" if "pct_copy" in v else f"{lib} error"
                                for lib, v in ch[f"m{m}"].items()) for m in (1, 8, 32)))
    g = r.get("decode_gemms")
    if g:
        print("decode GEMMs, % of copy, cuBLAS / ours: " + "  ".join(
            f"{k} {100 * v['pct_copy']:.0f}/{100 * v.get('ours_pct_copy', float('nan')):.0f}" for k, v in g.items()))
        for k, v in g.items():
            if "ours_sweep_pct_copy" in v:
                print(f"  {k} sweep: " + " ".join(f"{a}:{b}" for a, b in v["ours_sweep_pct_copy"].items()))
    for key in ("prefill_hit", "prefill_hit_short"):
        h = r.get(key)
        if not h:
            continue
        sh = h["shape"]
        v = {**h.get("variants", {}), **h.get("split_sweep", {})}
        print(f"prefill 1x({sh['cached']} cached + {sh['new']} new): ours {h['ms']:.3f} ms, graph {_ms(h.get('graph_ms'))} "
              f"({h['num_splits']} splits; "
              f"{h['no_hint_ms']:.3f} without the hint) = {h['TFLOPs']:.0f} TFLOP/s, gather+SDPA "
              f"{h['gather_sdpa_ms']:.3f} ms; fp8 {_ms(h.get('fp8_ms'))} int8 {_ms(h.get('int8_ms'))} ms, err bf16/fp8/int8 "
              f"{h['rel_err']:.1e}/{h.get('fp8_rel_err', float('nan')):.1e}/{h.get('int8_rel_err', float('nan')):.1e}")
        if v:
            print("   " + ", ".join(f"{k} {x['ms']:.3f}" for k, x in v.items() if "ms" in x))
    for h in r.get("prefill_hit_classes", []):
        sh = h["shape"]
        print(f"prefill 1x({sh['cached']}+{sh['new']}) Hq{sh['q_heads']}/Hkv{sh['kv_heads']} D{sh['head_dim']} "
              f"BS{sh['block_size']}: {h['ms']:.3f} ms, graph {_ms(h.get('graph_ms'))} ({h['num_splits']} splits; "
              f"{h['no_hint_ms']:.3f} without), "
              f"gather+SDPA {h['gather_sdpa_ms']:.3f}, err {h['rel_err']:.1e}")
    p = r.get("prefill")
    if p is None:
        return
    print(f"prefill 4x(8192 cached + 512 new): ours {p['ms']:.3f} ms = {p['TFLOPs']:.0f} TFLOP/s "
          f"({100 * p['pct_matmul']:.0f}% of matmul), gather+SDPA {p['gather_sdpa_ms']:.3f} ms "
          f"[{p.get('gather_sdpa_form')}], x{p['vs_gather_sdpa']:.2f}, err {p['rel_err']:.1e}")


def _ms(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _best(d: dict, *keys: str) -> float | None:
    vals = [d[k] for k in keys if d.get(k) is not None]
    return min(vals) if vals else None


if __name__ == "__main__":
    sys.exit(main())
