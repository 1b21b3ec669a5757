"""Hardware counters of the kernels that keep issue #19's last targets open, read with Nsight Compute.

Twenty sessions timed these kernels from the outside (graph replays, variants, in-kernel stamps);
none read the counters, which say *why* a kernel runs where it does: DRAM and L2 throughput against
peak, the tensor pipe's share, occupancy, and what the warps wait on (the stall reasons). The
targets, each one launch of the kernel as the launcher or the engine makes it:

    d93_bf16 / d93_fp8     decode, 64 x 4K, 9 q / 3 kv heads of 64 (the class at fp8 / bf16 1.32)
    dp64_bf16 / dp64_fp8   decode, 64 x 4K, 32 / 8 heads of 64 (read in pairs: fp8 / bf16 1.67)
    d128_bf16 / d128_fp8   decode, 64 x 4K, 32 / 8 heads of 128 (fp8 / bf16 ~1.6)
    b1_bf16 / b8_bf16      decode as a batch-1 / batch-8 engine graph launches it (2K live in an
                           8,448-token table, split by length on the device, one counter buffer)
    norm_m1, gate_up_silu_m1, o_partials_m1, down_partials_m1
                           a batch-1 decode step's other launches (the norm over four fp32 partials,
                           the gate|up GEMM storing SiLU x up, the o / down projections' partials)
    hit_bf16               prefill attention of the prefix hit: 512 new tokens over 7,680 cached, as the
                           launcher runs it (since session 22 the warp-specialised Gluon kernel)
    hit_triton, hit_overlap, hit_hd64, hit_hd64_overlap
                           the same through the Triton kernel and prefill_overlap (Gluon), and at head dim 64
    qkv_m1                 the q|k|v projection at one row (cuBLAS; 76 % of copy in the step)

``python benchmarks/ncu_probe.py --target NAME`` launches one target (warm-up launches first, so the
profiled one is compiled and its caches are in the state a step leaves them). ``--ncu`` runs every
target under ``ncu`` (``--clock-control none``: the device's clocks are left alone) and writes, per
target, the raw metrics as CSV and the SASS lines with their stall samples, then prints a summary.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The kernels are imported by the targets, on the GPU: the summaries (--summarise, the tests) need
# neither them nor Triton.

KERNEL_REGEX = r"regex:^(_decode_split_kernel|_prefill_kernel|_prefill_overlap_kernel|_prefill_specialized_kernel|_add_rms_norm_kernel|_gate_up_silu_kernel|nvjet.*|.*gemm.*|.*gemv.*)"
WARMUP = 3  # launches before the profiled one


def _paged(batch: int, kv_heads: int, head_dim: int, table_tokens: int, block_size: int, gen: torch.Generator):
    """A shuffled paged bf16 cache [NB, BS, Hkv, D] for K and for V, and block tables [B, table_tokens / BS]."""
    per_seq = table_tokens // block_size
    nb = batch * per_seq
    k = torch.randn(nb, block_size, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(nb, block_size, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    tables = torch.randperm(nb, device="cuda", generator=gen).to(torch.int32).view(batch, per_seq).contiguous()
    return k, v, tables


def _fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from prefixgate_kernels import reference as ref

    scale = (x.abs().amax().float() / ref.FP8_MAX).reshape(1)
    return (x.float() / scale).clamp(-ref.FP8_MAX, ref.FP8_MAX).to(ref.FP8_DTYPE), scale


def decode_target(batch: int, q_heads: int, kv_heads: int, head_dim: int, context: int, table_tokens: int,
                  kv: str, engine_shaped: bool) -> Callable[[], torch.Tensor]:
    """One decode launch. ``engine_shaped``: as a decode graph launches it (no host lengths, so the
    kernel cuts each live context by the split count on the device; one persistent counter buffer)."""
    from prefixgate_kernels import decode_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    k, v, tables = _paged(batch, kv_heads, head_dim, table_tokens, 16, gen)
    ks = vs = None
    if kv == "fp8":
        k, ks = _fp8(k)
        v, vs = _fp8(v)
    q = torch.randn(batch, q_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    counters = torch.zeros(batch * kv_heads, dtype=torch.int32, device="cuda")
    scale = 1 / math.sqrt(head_dim)
    host_lens = None if engine_shaped else [context] * batch
    return lambda: decode_attention.paged_decode(q, k, v, tables, lens, scale, ks, vs, context_lens=host_lens,
                                                 merge_counters=counters)


def hit_target(cached: int = 7680, new: int = 512, q_heads: int = 32, kv_heads: int = 8,
               head_dim: int = 128, overlap: bool = False, triton: bool = False) -> Callable[[], torch.Tensor]:
    from prefixgate_kernels import prefill_attention

    if triton:  # the Triton kernel where the launcher would take a Gluon one (this process profiles one target)
        prefill_attention.PREFILL_KERNEL = prefill_attention.PrefillKernel.TRITON

    gen = torch.Generator(device="cuda").manual_seed(0)
    context = cached + new
    k, v, tables = _paged(1, kv_heads, head_dim, context, 16, gen)
    q = torch.randn(new, q_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu = torch.tensor([0, new], device="cuda", dtype=torch.int32)
    lens = torch.tensor([context], device="cuda", dtype=torch.int32)
    if overlap:
        from prefixgate_kernels.prefill_overlap import paged_prefill_overlap

        return lambda: paged_prefill_overlap(q, k, v, tables, cu, lens, 1 / math.sqrt(head_dim))
    return lambda: prefill_attention.paged_prefill(q, k, v, tables, cu, lens, 1 / math.sqrt(head_dim), None, None,
                                                   context_lens=[context])


def gemm_target(rows: int = 1, n: int = 6144, k: int = 4096) -> Callable[[], torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    return lambda: torch.nn.functional.linear(x, w)


def step_target(name: str, rows: int = 1) -> Callable[[], torch.Tensor]:
    """One of a batch-1 decode step's other launches at the 8B shape: the residual add + RMSNorm over
    the o projection's four fp32 partials, the gate|up GEMM that stores SiLU x up, or the o / down
    projection as four K slices' partials (one batched cuBLAS GEMM)."""
    from prefixgate_kernels import triton_ops

    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden, inter = 4096, 14336
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    if name == "norm":
        parts = torch.randn(4, rows, hidden, device="cuda", dtype=torch.float32, generator=gen)
        res = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
        return lambda: triton_ops.add_rms_norm(parts, res, w, 1e-5)
    if name == "gate_up":
        from prefixgate_kernels import gate_up_silu
        from prefixgate_kernels._common import num_sms

        w = torch.randn(2 * inter, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        config = gate_up_silu.choose_config(rows, inter, hidden, num_sms(x.device))
        assert config is not None
        return lambda: gate_up_silu.gate_up_silu(x, w, config)
    k = hidden if name == "o" else inter
    a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(hidden, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    return lambda: triton_ops.linear_partials(a, w)


TARGETS: dict[str, Callable[[], Callable[[], torch.Tensor]]] = {
    "d93_bf16": lambda: decode_target(64, 9, 3, 64, 4096, 4096, "bf16", False),
    "d93_fp8": lambda: decode_target(64, 9, 3, 64, 4096, 4096, "fp8", False),
    "dp64_bf16": lambda: decode_target(64, 32, 8, 64, 4096, 4096, "bf16", False),
    "dp64_fp8": lambda: decode_target(64, 32, 8, 64, 4096, 4096, "fp8", False),
    "d128_bf16": lambda: decode_target(64, 32, 8, 128, 4096, 4096, "bf16", False),
    "d128_fp8": lambda: decode_target(64, 32, 8, 128, 4096, 4096, "fp8", False),
    "b1_bf16": lambda: decode_target(1, 32, 8, 128, 2048, 8448, "bf16", True),
    "b8_bf16": lambda: decode_target(8, 32, 8, 128, 2048, 8448, "bf16", True),
    "hit_bf16": hit_target,
    "hit_triton": lambda: hit_target(triton=True),
    "hit_overlap": lambda: hit_target(overlap=True),
    "hit_hd64": lambda: hit_target(head_dim=64),
    "hit_hd64_overlap": lambda: hit_target(head_dim=64, overlap=True),
    "qkv_m1": gemm_target,
    "norm_m1": lambda: step_target("norm"),
    "gate_up_silu_m1": lambda: step_target("gate_up"),
    "o_partials_m1": lambda: step_target("o"),
    "down_partials_m1": lambda: step_target("down"),
}

# Raw metrics worth a line in the summary (Nsight Compute's names; missing ones are skipped), then
# every metric whose name holds one of PATTERNS (the pipes' utilisation under names that differ
# between ncu versions).
SUMMARY_METRICS = [
    ("gpu__time_duration.sum", "duration"),
    ("dram__throughput.avg.pct_of_peak_sustained_elapsed", "DRAM % peak"),
    ("dram__bytes_read.sum", "DRAM read"),
    ("lts__t_sector_hit_rate.pct", "L2 hit %"),
    ("lts__throughput.avg.pct_of_peak_sustained_elapsed", "L2 % peak"),
    ("l1tex__throughput.avg.pct_of_peak_sustained_active", "L1 % peak"),
    ("sm__throughput.avg.pct_of_peak_sustained_elapsed", "SM % peak"),
    ("smsp__issue_active.avg.pct_of_peak_sustained_active", "issue slots busy %"),
    ("sm__warps_active.avg.pct_of_peak_sustained_active", "achieved occupancy %"),
    ("launch__occupancy_limit_registers", "blocks/SM by registers"),
    ("launch__occupancy_limit_shared_mem", "blocks/SM by smem"),
    ("launch__registers_per_thread", "registers/thread"),
    ("launch__grid_size", "grid"),
    ("smsp__inst_executed.sum", "instructions (warp)"),
]
PATTERNS = ("pipe_tensor", "pipe_fma_cycles", "pipe_alu_cycles", "pipe_xu", "pipe_lsu")
STALL_RE = re.compile(r"^smsp__average_warps?_(?:latency_)?issue_stalled_(\w+?)(?:_per_issue_active)?\.ratio$")


def _run_one(name: str) -> None:
    launch = TARGETS[name]()
    for _ in range(WARMUP + 1):
        launch()
    torch.cuda.synchronize()


def _raw_rows(text: str) -> list[dict[str, str]]:
    """ncu's ``--page raw --csv`` output: a header row, a units row, then one row per kernel."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(rows) < 3:
        return []
    head = rows[0]
    return [dict(zip(head, r)) for r in rows[2:]]


def summarise(name: str, row: dict[str, str]) -> list[str]:
    """The summary lines of one kernel's raw metrics: SUMMARY_METRICS, the pipes' average utilisation,
    and the largest warp stall reasons (cycles a warp waits per issued instruction)."""
    out = [f"== {name}: {row.get('Kernel Name', '?')[:60]}"]
    for key, label in SUMMARY_METRICS:
        if key in row and row[key] not in ("", "n/a"):
            out.append(f"   {label:28s} {row[key]}")
    for key, val in row.items():
        if (any(p in key for p in PATTERNS) and ".avg." in key and key.endswith("pct_of_peak_sustained_active")
                and val not in ("", "n/a")):
            out.append(f"   {key:28s} {val}")
    stalls = []
    for key, val in row.items():
        m = STALL_RE.match(key)
        if m:
            try:
                stalls.append((float(val.replace(",", "")), m.group(1)))
            except ValueError:
                continue
    stalls.sort(reverse=True)
    if stalls:
        out.append("   stalls (cycles per issued instruction): "
                   + ", ".join(f"{n} {v:.2f}" for v, n in stalls[:7]))
    return out


def _sass_rows(text: str) -> list[dict[str, str]]:
    """ncu's ``--page source --csv --print-source sass``: a kernel-name line, a header, one row an instruction."""
    lines = text.splitlines()
    rows = list(csv.reader(io.StringIO("\n".join(lines[1:]))))
    if not rows:
        return []
    head = rows[0]
    return [dict(zip(head, r)) for r in rows[1:] if len(r) == len(head)]


def _count(row: dict[str, str], key: str) -> int:
    try:
        return int(row.get(key) or 0)
    except ValueError:
        return 0


def summarise_sass(name: str, rows: list[dict[str, str]], top: int = 14) -> list[str]:
    """Executed instructions by opcode (predicate stripped, modifiers dropped) with their share of the
    stall samples, then the instructions holding the most samples and their two largest reasons."""
    executed: dict[str, int] = {}
    sampled: dict[str, int] = {}
    total_ex = sum(_count(r, "Instructions Executed") for r in rows) or 1
    total_samples = sum(_count(r, "Warp Stall Sampling (All Samples)") for r in rows) or 1
    for r in rows:
        text = re.sub(r"^@!?U?P\w+\s+", "", r.get("Source", "").strip())
        op = text.split()[0].split(".")[0] if text else "?"
        executed[op] = executed.get(op, 0) + _count(r, "Instructions Executed")
        sampled[op] = sampled.get(op, 0) + _count(r, "Warp Stall Sampling (All Samples)")
    out = [f"== {name}: {total_ex} warp instructions, {total_samples} stall samples; opcode: % executed, % samples"]
    for op in sorted(executed, key=executed.get, reverse=True)[:top]:
        out.append(f"   {op:10s} {100 * executed[op] / total_ex:5.1f} {100 * sampled[op] / total_samples:5.1f}")
    reasons = [k for k in (rows[0] if rows else {}) if k.startswith("stall_") and "Not Issued" not in k]
    hot = sorted(rows, key=lambda r: _count(r, "Warp Stall Sampling (All Samples)"), reverse=True)[:6]
    for r in hot:
        why = sorted(((_count(r, k), k[len("stall_"):]) for k in reasons), reverse=True)[:2]
        out.append(f"   hot {100 * _count(r, 'Warp Stall Sampling (All Samples)') / total_samples:5.1f} % "
                   f"{r.get('Source', '').strip()[:56]:56s} " + ", ".join(f"{k} {v}" for v, k in why if v))
    return out


def summarise_dir(folder: Path) -> list[str]:
    """Every target's summary from the ``ncu_<target>_raw.csv`` / ``_sass.csv`` files in ``folder``."""
    lines: list[str] = []
    for raw in sorted(folder.glob("ncu_*_raw.csv")):
        name = raw.name[len("ncu_"):-len("_raw.csv")]
        rows = _raw_rows(raw.read_text(encoding="utf-8"))
        lines.extend(summarise(name, rows[0]) if rows else [f"== {name}: no kernel row"])
        sass = raw.with_name(f"ncu_{name}_sass.csv")
        if sass.exists():
            lines.extend(summarise_sass(name, _sass_rows(sass.read_text(encoding="utf-8"))))
    return lines


def run_ncu(names: list[str], out_dir: Path, ncu: str) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    summary: list[str] = []
    rc = 0
    for name in names:
        rep = Path("/tmp") / f"ncu_{name}"
        cmd = [ncu, "--clock-control", "none", "--kernel-name", KERNEL_REGEX, "--launch-skip", str(WARMUP),
               "--launch-count", "1", "--set", "full", "--import-source", "no", "-f", "-o", str(rep),
               sys.executable, __file__, "--target", name]
        p = subprocess.run(cmd, capture_output=True, text=True, check=False)
        (out_dir / f"ncu_{name}.log").write_text(p.stdout[-20000:] + "\n" + p.stderr[-20000:], encoding="utf-8")
        if p.returncode != 0 or not rep.with_suffix(".ncu-rep").exists():
            summary.append(f"== {name}: ncu failed (rc {p.returncode}): {p.stderr.strip()[-300:]}")
            rc = 1
            continue
        raw = subprocess.run([ncu, "--import", str(rep.with_suffix(".ncu-rep")), "--page", "raw", "--csv"],
                             capture_output=True, text=True, check=False).stdout
        (out_dir / f"ncu_{name}_raw.csv").write_text(raw, encoding="utf-8")
        src = subprocess.run([ncu, "--import", str(rep.with_suffix(".ncu-rep")), "--page", "source", "--csv",
                              "--print-source", "sass"], capture_output=True, text=True, check=False).stdout
        (out_dir / f"ncu_{name}_sass.csv").write_text(src, encoding="utf-8")
    summary.extend(summarise_dir(out_dir))
    (out_dir / "ncu_summary.txt").write_text("\n".join(summary) + "\n", encoding="utf-8")
    # one archive of the per-target files: the device tool returns a bounded number of files a call
    bundle = out_dir / "ncu_targets.tgz"
    with tarfile.open(bundle, "w:gz") as tar:
        for f in sorted(out_dir.glob("ncu_*")):
            if f != bundle and f.suffix in (".csv", ".log"):
                tar.add(f, arcname=f.name)
                f.unlink()
    print("\n".join(summary), flush=True)
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=sorted(TARGETS), help="launch one target (what ncu profiles)")
    ap.add_argument("--ncu", action="store_true", help="profile every target (or --only) under ncu")
    ap.add_argument("--only", default=None, help="comma-separated targets for --ncu")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--summarise", metavar="DIR", default=None,
                    help="print the summary of a folder of ncu_<target>_raw.csv / _sass.csv files (no GPU needed)")
    args = ap.parse_args()
    if args.summarise:
        print("\n".join(summarise_dir(Path(args.summarise))))
        return 0
    if args.target:
        _run_one(args.target)
        return 0
    if args.ncu:
        ncu = shutil.which("ncu") or next((str(p) for p in sorted(Path("/opt/nvidia").glob("nsight-compute/*/ncu"))),
                                          None)
        if ncu is None:
            print("ncu not found", file=sys.stderr)
            return 2
        names = args.only.split(",") if args.only else list(TARGETS)
        return run_ncu(names, Path(args.out), ncu)
    ap.error("give --target NAME or --ncu")
    return 2


if __name__ == "__main__":
    sys.exit(main())
