"""A decode layer's second half with its weight streams started under the latency-bound kernels before them
(programmatic dependent launch; issue #19 item 1, session 30).

At batch 1 two kernels of each layer leave the HBM nearly idle: the attention (~10-12 us for ~8 MB of K/V)
and the norm after the o projection (~2.7 us for a few KB). ``benchmarks/pdl_o_probe.py`` measured the o
projection's tiles put in flight under the attention; this probe adds the second link and times the two
together, in the engine's order::

    attention                 paged_decode, at the engine's table width (no length hint: 32 splits)
      -> o projection         cuBLAS K-slice partials (engine) | pdl_o_probe's Gluon kernel under PDL
    add_rms_norm              (engine) | lets the next kernel launch at its start (launch_dependents)
      -> gate|up + SiLU       gate_up_silu (engine) | under PDL, its first K slice loaded before the wait
    down                      cuBLAS K-slice partials (the next layer's norm sums them)

Each link alone and both, against the engine's chain, 32 layers in one CUDA graph with their own caches and
weights, two rounds; and the second link alone (norm -> MLP, no attention). Batch 1, bf16, Llama-8B's shapes.
Compiled only (Gluon, PDL).

    python benchmarks/pdl_layer_probe.py --out benchmarks/results/pdl_layer_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.pdl_o_probe import (  # noqa: E402
    BLOCK_SIZE,
    CONTEXT,
    HEAD_DIM,
    HIDDEN,
    KV_HEADS,
    Q_HEADS,
    Config,
    OPartials,
    layer_caches,
    padded_table,
    start_gpu_run,
)
from prefixgate_kernels.decode_attention import paged_decode  # noqa: E402

INTER = 14336
TABLE_TOKENS = 8448  # the engine's decode graphs at an 8K max_model_len: the launcher runs 32 splits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/pdl_layer_probe.json")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    run = start_gpu_run("benchmarks/pdl_layer_probe.py")
    if run is None:
        return 2
    from benchmarks.kernels import bench_graph, rel_err
    from prefixgate_kernels import gate_up_silu as gus
    from prefixgate_kernels import rmsnorm, triton_ops

    dev, sms, gen, copy = run.dev, run.sms, run.gen, run.copy_TBps
    layers, eps = args.layers, 1e-5
    caches = layer_caches(layers, gen, dev)
    table = padded_table(TABLE_TOKENS, torch.randperm(CONTEXT // BLOCK_SIZE, device=dev, generator=gen).to(torch.int32))
    seq_lens = torch.full((1,), CONTEXT, dtype=torch.int32, device=dev)
    counters = torch.zeros(KV_HEADS, dtype=torch.int32, device=dev)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, device=dev, dtype=torch.bfloat16, generator=gen) * cols ** -0.5

    w_o = [weight(HIDDEN, HIDDEN) for _ in range(layers)]
    w_gu = [weight(2 * INTER, HIDDEN) for _ in range(layers)]
    w_down = [weight(HIDDEN, INTER) for _ in range(layers)]
    norm_w = [1 + 0.1 * torch.randn(HIDDEN, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(layers)]
    q = torch.randn(1, Q_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=gen)
    residual = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16, generator=gen)
    o_parts = torch.randn(4, 1, HIDDEN, device=dev, generator=gen) * 0.1  # the MLP-only chain's norm input
    gu_config = gus.choose_config(1, INTER, HIDDEN, sms, max_rows=gus.ENGINE_MAX_ROWS)
    assert gu_config is not None
    gluon_o = [OPartials(w_o[i], sms, Config(5, 5, True)) for i in range(layers)]

    def attention(i: int, trigger: bool) -> torch.Tensor:
        k, v = caches[i]
        return paged_decode(q, k, v, table, seq_lens, 1 / HEAD_DIM ** 0.5, None, None, merge_counters=counters,
                            launch_dependents=trigger).view(1, HIDDEN)

    def mlp(i: int, x_parts: torch.Tensor, res: torch.Tensor, pdl: bool) -> torch.Tensor:
        h = rmsnorm.add_rms_norm(x_parts, res, norm_w[i], eps, launch_dependents=pdl)
        return triton_ops.linear_partials(gus.gate_up_silu(h, w_gu[i], gu_config, pdl=pdl), w_down[i])

    def layer_half(i: int, res: torch.Tensor, o_link: bool, mlp_link: bool) -> torch.Tensor:
        if o_link:
            parts = gluon_o[i](attention(i, True))
        else:
            parts = triton_ops.linear_partials(attention(i, False), w_o[i])
        return mlp(i, parts, res, mlp_link)

    result: dict = {**run.header(layers), "table_tokens": TABLE_TOKENS, "us_per_layer": {}, "rel_err": {}}
    print(f"{result['gpu']}: copy {copy:.2f} TB/s, {sms} SMs", flush=True)
    chains: dict[str, Callable[[], object]] = {}
    for mlp_link in (False, True):
        res = residual.clone()
        chains[f"norm -> MLP{', PDL' if mlp_link else ''}"] = (
            lambda r=res, p=mlp_link: [mlp(i, o_parts, r, p) for i in range(layers)])
    for o_link, mlp_link in ((False, False), (False, True), (True, False), (True, True)):
        res = residual.clone()
        name = "engine" if not (o_link or mlp_link) else " + ".join(
            n for n, on in (("o under the attention", o_link), ("MLP under the norm", mlp_link)) if on)
        chains[f"layer half: {name}"] = lambda r=res, o=o_link, m=mlp_link: [
            layer_half(i, r, o, m) for i in range(layers)]

    # correctness first: each form's layer-0 output and residual against the engine's
    want_res = residual.clone()
    want = layer_half(0, want_res, False, False)
    for o_link, mlp_link in ((False, True), (True, False), (True, True)):
        got_res = residual.clone()
        got = layer_half(0, got_res, o_link, mlp_link)
        torch.cuda.synchronize()
        key = f"o {o_link}, mlp {mlp_link}"
        result["rel_err"][key] = {"down partials": rel_err(got, want), "residual": rel_err(got_res, want_res)}
        print(f"relative error against the engine's ({key}): {result['rel_err'][key]}", flush=True)

    for r in range(args.rounds):
        for name, fn in chains.items():
            ms = bench_graph(fn)
            value = 1000 * ms / layers if ms is not None else None
            result["us_per_layer"].setdefault(name, []).append(value)
            if r == 0:
                print(f"{name}: {value:.2f} us a layer" if value is not None else f"{name}: capture failed",
                      flush=True)
    print("us a layer, the rounds in turn: " + "; ".join(
        f"{k} {' / '.join('-' if x is None else f'{x:.2f}' for x in v)}" for k, v in result["us_per_layer"].items()),
        flush=True)
    result["wall_s"] = time.time() - run.t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
