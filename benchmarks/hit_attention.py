"""The prefix hit's attention on the H200: the paged Triton kernel against torch's SDPA backends.

The issue's hit (512 new tokens over 7,680 cached, 32 query heads over 8 KV heads, head dim 128)
spends ~38 % of its device time in attention (session 7, run 1: 7.0 of 18.6 ms), where the
repository's kernel runs at ~340 TFLOP/s, about half the bf16 matmul rate. This measures what the
same attention costs through torch's scaled_dot_product_attention on each backend it offers
(cuDNN, FlashAttention-2, memory-efficient), on a contiguous copy of the keys and values, plus the
gather that makes that copy from the paged cache: whether a gather + library kernel would beat
the paged kernel at this shape, before any engine code is written for it.

    python benchmarks/hit_attention.py [--out benchmarks/results/hit_attention_h200.json]

Every variant is checked against the paged kernel's output (relative error) in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.kernels import bench, ceilings, paged_setup, rel_err  # noqa: E402
from benchmarks.provenance import git_commit  # noqa: E402
from prefixgate_kernels import triton_ops  # noqa: E402


def run(cached: int, new: int, q_heads: int, kv_heads: int, head_dim: int, block_size: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    gen = torch.Generator(device="cuda").manual_seed(7)
    context = cached + new
    scale = head_dim ** -0.5
    kv, tables, lens = paged_setup(1, kv_heads, head_dim, context, block_size, gen)
    k_cache, v_cache = kv[:, 0, 0], kv[:, 0, 1]
    q = torch.randn(new, q_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu = torch.tensor([0, new], device="cuda", dtype=torch.int32)
    pairs = new * cached + new * (new + 1) // 2
    flops = 4 * pairs * q_heads * head_dim
    row: dict = {"shape": {"cached": cached, "new": new, "q_heads": q_heads, "kv_heads": kv_heads,
                           "head_dim": head_dim, "block_size": block_size}, "flops": flops}

    def paged():
        return triton_ops.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale, context_lens=[context])

    want = paged()
    ms = bench(paged)
    row["paged_triton"] = {"ms": ms, "TFLOPs": flops / (ms * 1e-3) / 1e12}

    ids = tables[0].long()

    def gather():  # [1, Hkv, ctx, D] contiguous, as SDPA wants them
        k = k_cache.index_select(0, ids).reshape(1, context, kv_heads, head_dim).transpose(1, 2).contiguous()
        v = v_cache.index_select(0, ids).reshape(1, context, kv_heads, head_dim).transpose(1, 2).contiguous()
        return k, v

    k, v = gather()
    row["gather"] = {"ms": bench(gather), "bytes": 4 * k.numel() * k.element_size()}
    qs = q.unsqueeze(0).transpose(1, 2).contiguous()  # [1, Hq, new, D]
    mask = causal_lower_right(new, context)
    group = q_heads // kv_heads
    k_rep = k.repeat_interleave(group, dim=1)
    v_rep = v.repeat_interleave(group, dim=1)
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    for name, backend in backends.items():
        for form in ("enable_gqa", "repeat_kv"):
            label = f"sdpa_{name}_{form}"

            def attend(backend=backend, form=form):
                with sdpa_kernel([backend]):
                    if form == "enable_gqa":
                        return F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
                    return F.scaled_dot_product_attention(qs, k_rep, v_rep, attn_mask=mask, scale=scale)

            try:
                out = attend().transpose(1, 2).reshape(new, q_heads, head_dim)
                t = bench(attend)
                row[label] = {"ms": t, "TFLOPs": flops / (t * 1e-3) / 1e12, "rel_err_vs_paged": rel_err(out, want)}
            except Exception as e:  # noqa: BLE001  (a backend that refuses the shape or mask: record it)
                row[label] = {"error": f"{type(e).__name__}: {str(e)[:240]}"}
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "hit_attention_h200.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/hit_attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
              "commit": os.environ.get("PREFIXGATE_COMMIT") or git_commit(),
              "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
              "cudnn": torch.backends.cudnn.version(), "python": platform.python_version(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "ceilings": ceilings(), "cases": []}
    for shape in ((7680, 512, 32, 8, 128, 16), (8128, 64, 32, 8, 128, 16)):
        result["cases"].append(run(*shape))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'case':<22}{'variant':<28}{'ms':>8}{'TFLOP/s':>9}{'rel err':>10}")
    for c in result["cases"]:
        s = c["shape"]
        name = f"1x({s['cached']}+{s['new']})"
        for k, v in c.items():
            if isinstance(v, dict) and ("ms" in v or "error" in v) and k != "shape":
                if "error" in v:
                    print(f"{name:<22}{k:<28}  {v['error'][:70]}")
                else:
                    print(f"{name:<22}{k:<28}{v['ms']:>8.3f}{v.get('TFLOPs', float('nan')):>9.0f}"
                          f"{v.get('rel_err_vs_paged', float('nan')):>10.1e}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
