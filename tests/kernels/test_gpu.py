"""The same kernel checks compiled on a CUDA GPU, bf16 included (the interpreter cannot check bf16 dots).

Run with benchmarks/gpu_suite.sh (PREFIXGATE_KERNELS_GPU=1 keeps the interpreter off).
"""

from __future__ import annotations

import pytest
import torch

from prefixgate_kernels import prefill_attention, triton_ops
from prefixgate_kernels import reference as ref
from prefixgate_kernels.launch_layout import CacheLayout
from tests.kernels import test_decode_attention as decode
from tests.kernels import test_decode_rows as whole_rows
from tests.kernels import test_fused_layer_ops as fused
from tests.kernels import test_kv_write as kvw
from tests.kernels import test_prefill_attention as prefill
from tests.kernels.kernel_cases import gpu_ready

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_ready(), reason="needs CUDA and compiled Triton")]
KV_DTYPES = [None, ref.FP8_DTYPE, torch.int8]
# the Gluon kernels' own tests (the prefills, gemv_pdl): sm_90 and Triton 3.6 only (prefill_attention.gluon_supported)
needs_gluon = pytest.mark.skipif(not gpu_ready() or not prefill_attention.gluon_runs_on(torch.device("cuda")),
                                 reason="the Gluon prefills need an sm_90 GPU and Triton 3.6")
needs_pdl = pytest.mark.skipif(not gpu_ready() or torch.cuda.get_device_capability()[0] < 9,
                               reason="programmatic dependent launch (griddepcontrol) needs compute capability 9.0")


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("head_dim,group,block_size", [(64, 1, 16), (128, 4, 16), (128, 8, 32)])
@pytest.mark.parametrize("num_splits", [None, 7])
def test_decode_gpu(kv_dtype, head_dim, group, block_size, num_splits, q_dtype=torch.bfloat16):
    lens = [1, 15, 16, 17, 300, 1025, 4000, 77]
    decode.run_case(head_dim, group, block_size, lens, kv_dtype, q_dtype=q_dtype, num_splits=num_splits,
                    kv_heads=2, seed=head_dim + group, device="cuda")


@pytest.mark.parametrize("kv_dtype", [ref.FP8_DTYPE, torch.int8])
@pytest.mark.parametrize("head_dim,block_n,num_warps,num_stages,max_registers", [
    (128, 128, 4, 2, 128), (128, 128, 8, 5, None), (64, 256, 4, 2, None), (64, 256, 4, 5, None)])
def test_decode_gpu_8bit_tile_candidates(kv_dtype, head_dim, block_n, num_warps, num_stages, max_registers):
    """The 8-bit candidates benchmarks/kernels.py times (QUANT_TILES, QUANT_TILES_HD64), compiled: a
    register cap, 8 warps, 256-token tiles at head dim 64."""
    lens = [1, 17, 300, 1025, 4000, 77]
    decode.run_case(head_dim, 4, 16, lens, kv_dtype, q_dtype=torch.bfloat16, kv_heads=2, seed=block_n + num_warps,
                    device="cuda", num_splits=2, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                    max_registers=max_registers)


@pytest.mark.parametrize("kv_dtype", [ref.FP8_DTYPE, torch.int8])
def test_decode_gpu_8bit_many_pairs(kv_dtype):
    """At least one (sequence, kv head) pair per SM: fp8 takes FP8_WAVE_TILES (one buffer, a
    128-register cap) by default, int8 the ring; both against the reference."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lens = [1 + (i * 613) % 2100 for i in range(sms // 2 + 1)]  # x 2 kv heads >= one pair per SM
    decode.run_case(128, 4, 16, lens, kv_dtype, q_dtype=torch.bfloat16, kv_heads=2, seed=11, device="cuda")


@pytest.mark.parametrize("joined", [2, 1])
def test_decode_gpu_fp8_kv_heads_in_pairs(joined):
    """fp8 at head dim 64 with 8 KV heads: read in pairs (the launcher's choice, the 128-wide tiles
    then) and per head, a graph-shaped table of 4K holding 1-4,100 tokens, against the reference."""
    lens = [1 + (i * 613) % 4100 for i in range(64)]
    decode.run_case(64, 4, 16, lens, ref.FP8_DTYPE, q_dtype=torch.bfloat16, kv_heads=8, seed=5, device="cuda",
                    table_width=4160 // 16, joined_heads=joined)


@pytest.mark.parametrize("kv_dtype", [ref.FP8_DTYPE, None])
@pytest.mark.parametrize("joined", [3, 1])
def test_decode_gpu_kv_heads_in_threes(kv_dtype, joined):
    """SmolLM2-135M's 9 / 3 heads of 64: the three KV heads read as one row of 192 (padded to 256,
    the compiled V_PAIRS path for fp8) and per head, a graph-shaped table of 4K holding 1-4,100
    tokens, by-length splits, against the reference."""
    lens = [1 + (i * 613) % 4100 for i in range(64)]
    decode.run_case(64, 3, 16, lens, kv_dtype, q_dtype=torch.bfloat16, kv_heads=3, seed=6, device="cuda",
                    table_width=4160 // 16, joined_heads=joined, num_splits=8, split_by_length=True)


@pytest.mark.parametrize("kv_dtype", [None, ref.FP8_DTYPE])
@pytest.mark.parametrize("group,kv_heads,num_splits", [(3, 3, None), (3, 3, 1), (1, 5, 7), (8, 1, None)])
def test_decode_rows_gpu(kv_dtype, group, kv_heads, num_splits):
    """Every KV head of a token read as one row (``decode_rows.paged_decode_rows``), compiled: V as int16 pairs for
    fp8, bf16 queries, the launcher's tiles and splits or forced ones, over a graph-shaped table of 4K holding
    1-4,100 tokens."""
    lens = [1 + (i * 613) % 4100 for i in range(48)]
    whole_rows.run_rows_case(64, group, kv_heads, lens, kv_dtype, q_dtype=torch.bfloat16, seed=group + kv_heads,
                             device="cuda", table_width=4160 // 16, num_splits=num_splits)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("head_dim,split_by_length", [(64, None), (128, None), (128, False)])
def test_decode_gpu_graph_shaped_table(kv_dtype, head_dim, split_by_length):
    """The launch a decode CUDA graph makes: no length hint, a table sized for 16K tokens holding
    contexts of 1-5,000; the splits cut from each live context (the default) or at fixed offsets."""
    lens = [5000, 1, 17, 2048, 300, 64, 4097, 2]
    decode.run_case(head_dim, 4, 16, lens, kv_dtype, q_dtype=torch.bfloat16, kv_heads=2, seed=head_dim + 9,
                    device="cuda", table_width=16384 // 16, split_by_length=split_by_length)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_gpu_length_hint(kv_dtype, head_dim):
    """Host-side lengths pick the split count (choose_num_splits' length model) on compiled kernels."""
    lens = [9000, 3, 40, 1700, 17, 900, 5000, 2]
    decode.run_case(head_dim, 4, 16, lens, kv_dtype, q_dtype=torch.bfloat16, kv_heads=2, seed=head_dim + 5,
                    device="cuda", length_hint=True)


@pytest.mark.parametrize("kv_dtype", [None, ref.FP8_DTYPE])
@pytest.mark.parametrize("batch,table_tokens", [(32, 4096), (3, 65536)])
def test_decode_gpu_fused_merge_in_a_graph(kv_dtype, batch, table_tokens):
    """The split merge done by each (sequence, kv head)'s last program, on real concurrency: eight
    launches (a step's layers) in one CUDA graph share one counter buffer, replayed five times on
    fresh queries; every output against the reference, the counters zero after every replay. 32
    sequences give 256 counters at two splits each (the decode graphs' launch at 32 x 2K), 3 long
    ones up to 64 splits each."""
    from prefixgate_kernels import decode_attention
    from tests.kernels.kernel_cases import make_block_tables, make_kv_cache, rel_err

    gen = torch.Generator().manual_seed(batch)
    kv_heads, group, head_dim, block_size = 8, 4, 128, 16
    lens = [int(n) for n in torch.randint(1, table_tokens + 1, (batch,), generator=gen)]
    lens[0] = table_tokens  # one sequence fills the table: every split holds keys
    num_blocks = sum(-(-n // block_size) for n in lens) + 1
    k_cache, v_cache, ks, vs = make_kv_cache(num_blocks, block_size, kv_heads, head_dim,
                                             kv_dtype if kv_dtype is not None else torch.bfloat16, "cuda", gen,
                                             layers=1, layer=0)
    tables = make_block_tables(lens, block_size, num_blocks, gen, "cuda", extra_cols=0)
    pad = table_tokens // block_size - tables.shape[1]
    tables = torch.cat([tables, torch.zeros(batch, pad, dtype=tables.dtype, device="cuda")], dim=1)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    qs = torch.empty(8, batch, kv_heads * group, head_dim, dtype=torch.bfloat16, device="cuda")
    counters = torch.zeros(batch * kv_heads, dtype=torch.int32, device="cuda")
    scale = head_dim ** -0.5

    def step():
        return [triton_ops.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, ks, vs,
                                                  merge_counters=counters) for q in qs]

    qs.copy_(torch.randn(qs.shape, generator=gen).to(qs))
    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    assert decode_attention.choose_num_splits(batch, kv_heads, table_tokens, decode_attention.num_sms(qs.device),
                                              64) > 1
    tol = decode.TOL[kv_dtype if kv_dtype is not None else torch.bfloat16]
    check = [0, batch - 1]  # the reference is a Python loop: two sequences of each launch
    for _ in range(5):
        qs.copy_(torch.randn(qs.shape, generator=gen).to(qs))
        graph.replay()
        torch.cuda.synchronize()
        assert int(counters.abs().sum()) == 0
        for q, out in zip(qs, outs):
            want = ref.paged_decode_attention(q[check], k_cache, v_cache, tables[check], seq_lens[check], scale, ks, vs)
            assert rel_err(out[check], want) < tol


@pytest.mark.parametrize("kv_dtype", [None, ref.FP8_DTYPE])
def test_decode_gpu_stamps(kv_dtype):
    """``stamps``: the launch's attention is unchanged, and every program that holds keys stamps its
    start, its stream's end and (split sequences) its partial's count in that order; each split
    sequence's kv head has exactly one merging program, stamped after its count; a one-split
    sequence's programs store directly and stamp no count."""
    lens = [4000, 300, 1]
    kv_heads, splits = 2, 8
    stamps = torch.full((len(lens) * kv_heads * splits * 5,), -1, dtype=torch.int64, device="cuda")
    counters = torch.zeros(len(lens) * kv_heads, dtype=torch.int32, device="cuda")
    decode.run_case(128, 4, 16, lens, kv_dtype, q_dtype=torch.bfloat16, num_splits=splits, kv_heads=kv_heads,
                    seed=91, device="cuda", split_by_length=True, fused_merge=True, merge_counters=counters,
                    stamps=stamps)
    torch.cuda.synchronize()
    st = stamps.view(len(lens), kv_heads, splits, 5).cpu()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert bool((st[..., 0] >= 0).all())  # every program stamps its start and SM, empty splits too
    assert bool(((st[..., 4] >= 0) & (st[..., 4] < sms)).all())
    for b, n in enumerate(lens):
        for h in range(kv_heads):
            ran = st[b, h][st[b, h, :, 1] >= 0]
            assert ran.shape[0] >= 1
            assert bool((ran[:, 1] >= ran[:, 0]).all())
            if n == 1:  # one split holds the only key: stored directly, no count, no merge
                assert ran.shape[0] == 1 and bool((ran[:, 2:4] == -1).all())
                continue
            assert ran.shape[0] > 1
            assert bool((ran[:, 2] >= ran[:, 1]).all())
            mergers = ran[ran[:, 3] >= 0]
            assert mergers.shape[0] == 1 and int(mergers[0, 3]) >= int(mergers[0, 2])
    assert int(counters.abs().sum()) == 0


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("head_dim,group,block_size", [(64, 1, 16), (128, 4, 16), (128, 8, 32)])
def test_prefill_gpu(kv_dtype, head_dim, group, block_size, q_dtype=torch.bfloat16):
    prefill.run_case(head_dim, group, block_size, cached=[0, 21, 700, 5, 1000], new=[300, 7, 1, 0, 513],
                     kv_dtype=kv_dtype, q_dtype=q_dtype, kv_heads=2, seed=head_dim * group, device="cuda")


def test_fp16_attention_gpu():
    decode.run_case(128, 4, 16, [3, 500, 2049], None, q_dtype=torch.float16, kv_heads=2, seed=1, device="cuda")
    prefill.run_case(128, 4, 16, cached=[64, 0], new=[100, 129], q_dtype=torch.float16, seed=2, device="cuda")


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16, ref.FP8_DTYPE, torch.int8])
def test_write_kv_gpu(kv_dtype):
    src = kv_dtype if kv_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    kvw.run_case(kv_dtype, src, kv_heads=8, head_dim=128, block_size=16, seed=3, device="cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, ref.FP8_DTYPE, torch.int8])
def test_block_ops_gpu(dtype):
    gen = torch.Generator().manual_seed(0)
    cache = (torch.randn(64, 4, 2, 16, 8, 128, generator=gen) * 10).to(dtype).cuda()
    want = cache.clone()
    src = torch.tensor([0, 5, 9], device="cuda")
    dst = torch.tensor([60, 61, 2], device="cuda")
    ref.copy_blocks(want, src, dst)
    triton_ops.copy_blocks(cache, src, dst)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    ids = torch.tensor([3, 1, 40], device="cuda")
    packed = triton_ops.gather_blocks(cache[:, 2, 1], ids)
    assert torch.equal(packed.view(torch.uint8), cache[:, 2, 1][ids].view(torch.uint8))
    triton_ops.scatter_blocks(cache, torch.tensor([7, 8], device="cuda"), cache[[1, 2]].clone())
    assert torch.equal(cache[7].view(torch.uint8), cache[1].view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, ref.FP8_DTYPE, torch.int8])
def test_head_major_block_transfers_gpu(dtype):
    # the engine's GPU pool (pages head by head) seen through its token view: blocks gather to token order and
    # token-ordered rows scatter back in one pass each (block_copy.copy_pages), byte for byte as the reference
    gen = torch.Generator().manual_seed(1)
    raw = (torch.randn(64, 4, 2, 8, 16, 128, generator=gen) * 10)
    pool = (raw.to(torch.int8) if dtype == torch.int8 else raw.to(dtype)).cuda().transpose(3, 4)
    ids = torch.tensor([3, 60, 17], device="cuda")
    packed = triton_ops.gather_blocks(pool, ids)
    assert packed.is_contiguous()
    assert torch.equal(packed.view(torch.uint8), pool[ids].contiguous().view(torch.uint8))
    want = pool.clone()
    dst = torch.tensor([9, 0, 41], device="cuda")
    ref.scatter_blocks(want, dst, packed)
    triton_ops.scatter_blocks(pool, dst, packed)
    assert torch.equal(pool.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_gpu(dtype, with_residual):
    fused.run_norm_case(37, 4096, dtype, with_residual, seed=11, device="cuda")
    fused.run_norm_case(3, 896, dtype, with_residual, seed=12, device="cuda")


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, ref.FP8_DTYPE, torch.int8])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size", [(32, 8, 128, 16), (28, 4, 128, 32), (14, 2, 64, 16)])
def test_rotary_write_kv_gpu(kv_dtype, q_heads, kv_heads, head_dim, block_size):
    fused.run_rotary_case(q_heads, kv_heads, head_dim, block_size, kv_dtype, torch.bfloat16, seed=q_heads,
                          device="cuda", tokens=33)
    if kv_dtype == ref.FP8_DTYPE:  # the fp8 calibration's key bias, subtracted in the kernel
        fused.run_rotary_case(q_heads, kv_heads, head_dim, block_size, kv_dtype, torch.bfloat16, seed=q_heads + 1,
                              device="cuda", tokens=33, with_bias=True)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, ref.FP8_DTYPE, torch.int8])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size", [(32, 8, 128, 16), (28, 4, 128, 32), (14, 2, 64, 16)])
@pytest.mark.parametrize("hint", [False, True])
def test_fused_rope_decode_gpu(kv_dtype, q_heads, kv_heads, head_dim, block_size, hint):
    """RoPE + K/V write inside the decode launch, compiled: caches byte for byte as rotary_write_kv
    writes them, output as the two kernels' (the launcher's own tiles and split count; with a length
    hint the splits fall at fixed offsets, without it each sequence's context is cut on the device)."""
    from tests.kernels import test_rope_decode as rope

    lens = [1, 17, 300, 2049, 4000, 33]
    case = rope.rope_decode_inputs(q_heads, kv_heads, head_dim, block_size, kv_dtype, torch.bfloat16, lens,
                                   seed=q_heads + head_dim, device="cuda", with_bias=kv_dtype == ref.FP8_DTYPE)
    launch = {"context_lens": case["seq_lens"].tolist()} if hint else {}
    # against the reference, whose own K/V write may round an element of the new token one bf16 ulp
    # apart, which an 8-bit cache can turn into a step (test_rotary_write_kv_gpu)
    tol = decode.TOL[kv_dtype] if kv_dtype == torch.bfloat16 else 3e-2
    rope.check_fused_case(case, tol, exact=False, **launch)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, ref.FP8_DTYPE, torch.int8])
def test_fused_rope_decode_on_head_major_pages_gpu(kv_dtype):
    """The engine's CUDA pool lays each page head by head (engine/kv_layout.py): the fused launch on such pages,
    32 / 8 heads of 64 (fp8 reads them in pairs on token-ordered pages, per head here), against the two kernels on
    the same pages and the reference; heads read one by one there, so ``rotary_decode_attention`` takes it."""
    from prefixgate_kernels import decode_attention
    from tests.kernels import test_rope_decode as rope

    lens = [1, 17, 300, 2049, 33]
    case = rope.rope_decode_inputs(32, 8, 64, 16, kv_dtype, torch.bfloat16, lens, seed=64, device="cuda",
                                   with_bias=kv_dtype == ref.FP8_DTYPE)
    for name in ("k_cache", "v_cache"):  # the same values, each page head by head
        case[name] = case[name].transpose(1, 2).contiguous().transpose(1, 2)
    assert decode_attention.launcher_joined_heads(case["k_cache"], case["v_cache"]) == 1
    tol = decode.TOL[kv_dtype] if kv_dtype == torch.bfloat16 else 3e-2
    rope.check_fused_case(case, tol, exact=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_gpu(dtype):
    fused.run_silu_case(33, 14336, dtype, seed=4, device="cuda")


@pytest.mark.parametrize("m,n,k,split_k,bias", [(32, 6144, 4096, 4, False), (1, 4096, 14336, 7, True),
                                                (8, 448, 512, 1, True)])
def test_skinny_gemm_gpu(m, n, k, split_k, bias):
    fused.run_skinny_case(m, n, k, torch.bfloat16, split_k, bias, seed=m + n, device="cuda", block_k=256)


@pytest.mark.parametrize("m,inter,k,block_n", [(1, 14336, 4096, 32), (8, 14336, 4096, 16), (16, 1000, 512, 64),
                                              (32, 14336, 4096, 32)])
def test_gate_up_silu_gpu(m, inter, k, block_n):
    fused.run_gate_up_silu_case(m, inter, k, torch.bfloat16, seed=m + inter, device="cuda", block_n=block_n,
                                block_k=256)


@pytest.mark.parametrize("m", [1, 8, 16, 32])
def test_mlp_partials_gpu(m, monkeypatch):
    """The op the engine's MLP calls, at a Llama-8B layer's shape: without the fused kernel exactly the
    unfused ops; with the gate|up GEMM storing SiLU x up, within bf16's rounding of them and of the
    float64 product (the same roundings; only the GEMM's summation order may differ)."""
    from prefixgate_kernels import gate_up_silu

    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 4096, generator=gen).to("cuda", torch.bfloat16)
    w_gu = (torch.randn(2 * 14336, 4096, generator=gen) * 4096 ** -0.5).to("cuda", torch.bfloat16)
    w_down = (torch.randn(4096, 14336, generator=gen) * 14336 ** -0.5).to("cuda", torch.bfloat16)
    want = triton_ops.linear_partials(triton_ops.silu_mul(triton_ops.linear(x, w_gu)), w_down)
    monkeypatch.setattr(gate_up_silu, "ENGINE_MAX_ROWS", 0)
    assert torch.equal(triton_ops.mlp_partials(x, w_gu, None, w_down), want)
    monkeypatch.setattr(gate_up_silu, "ENGINE_MAX_ROWS", gate_up_silu.MAX_ROWS)
    got = triton_ops.mlp_partials(x, w_gu, None, w_down)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert fused.rel_err(got.sum(0) if got.dim() == 3 else got, want.sum(0) if want.dim() == 3 else want) < 1e-2
    exact = ref.silu_mul((x.double() @ w_gu.double().T).to(torch.bfloat16)).double() @ w_down.double().T
    assert fused.rel_err(got.sum(0) if got.dim() == 3 else got, exact) < 1e-2


@needs_pdl
@pytest.mark.parametrize("m", [1, 8])
def test_gate_up_silu_under_pdl_after_the_norm_gpu(m):
    """The norm letting the next kernel launch at its start and gate|up + SiLU launched with PDL (its first
    K slice loaded before it waits): the same bytes as the plain pair, eagerly and replayed from a CUDA
    graph whose norm rewrites the input each time (a gate|up that read x before the wait would see the
    previous replay's)."""
    from prefixgate_kernels import gate_up_silu, rmsnorm

    gen = torch.Generator(device="cuda").manual_seed(m)
    parts = torch.randn(4, m, 4096, device="cuda", generator=gen)
    res0 = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    w_norm = 1 + 0.1 * torch.randn(4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    w_gu = torch.randn(2 * 14336, 4096, device="cuda", dtype=torch.bfloat16, generator=gen) * 4096 ** -0.5
    config = gate_up_silu.choose_config(m, 14336, 4096, torch.cuda.get_device_properties(0).multi_processor_count)

    def pair(res: torch.Tensor, pdl: bool) -> torch.Tensor:
        h = rmsnorm.add_rms_norm(parts, res, w_norm, 1e-5, launch_dependents=pdl)
        return gate_up_silu.gate_up_silu(h, w_gu, config, pdl=pdl)

    want_res = res0.clone()
    want = pair(want_res, False)
    got_res = res0.clone()
    assert torch.equal(pair(got_res, True), want) and torch.equal(got_res, want_res)
    res, want_res = res0.clone(), res0.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pair(res, True)
    for _ in range(3):  # each replay adds the partials to the residual again: a new x every time
        graph.replay()
        want = pair(want_res, False)
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.equal(res, want_res)


@needs_gluon
@pytest.mark.parametrize("dtype,n,k", [(torch.bfloat16, 4096, 4096), (torch.float16, 1024, 8192),
                                       (torch.bfloat16, 640, 1024), (torch.bfloat16, 4096, 14336),
                                       (torch.float16, 320, 3072)])
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("m", [1, 3, 8, 13, 32])
def test_partials_gemv_gpu(dtype, n, k, pdl, m, monkeypatch):
    """``gemv_pdl.partials_gemv``: four fp32 partials over K's quarters whose sum is the product (within
    fp32 rounding of the float64 one), each quarter its own slice of K (against ``partial_gemm``'s); one row
    on CUDA cores, several on the tensor cores; quarters of 1, 4, 8 and, not a power of two, 3 and 14 steps
    (Llama-8B's down projection)."""
    from prefixgate_kernels import gemv_pdl, partial_gemm

    monkeypatch.setattr(gemv_pdl, "MAX_ROWS", gemv_pdl.MMA_ROWS_LIMIT)
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) * k ** -0.5
    if not gemv_pdl.fits_shared_memory(m, k):  # 32 rows at K = 8,192: x's quarter (128 KB) beside the ring's 128
        assert not gemv_pdl.supports(x, w, None)
        return
    assert gemv_pdl.supports(x, w, None)
    parts = gemv_pdl.partials_gemv(x, w, pdl=pdl)
    assert parts.shape == (4, m, n) and parts.dtype == torch.float32
    want = partial_gemm.sliced_partials(x, w, 4).double()
    assert fused.rel_err(parts.double(), want) < 1e-5
    assert fused.rel_err(parts.sum(0).double(), x.double() @ w.double().T) < 1e-5


@needs_gluon
def test_partials_gemv_supports_only_its_shapes_gpu(monkeypatch):
    from prefixgate_kernels import gemv_pdl

    def ok(m=1, n=4096, k=4096, dtype=torch.bfloat16, bias=False, device="cuda"):
        x = torch.empty(m, k, device=device, dtype=dtype)
        w = torch.empty(n, k, device=device, dtype=dtype)
        return gemv_pdl.supports(x, w, torch.empty(n, device=device, dtype=dtype) if bias else None)

    assert ok() and ok(k=8192) and ok(n=64, k=1024) and ok(m=2) and ok(m=gemv_pdl.MAX_ROWS)
    assert not ok(m=gemv_pdl.MAX_ROWS + 1) and not ok(m=0) and not ok(bias=True)
    assert not ok(dtype=torch.float32) and not ok(device="cpu")
    assert not ok(n=4000) and not ok(k=3584)  # N % 64; K % 1024
    assert ok(k=3072) and ok(k=14336) and ok(m=8, k=14336)  # quarters of 3 and 14 steps
    assert not ok(m=16, k=14336)  # 16 rows of a 3,584-wide quarter (112 KB) beside the ring's 128
    x = torch.empty(2, 4096, device="cuda", dtype=torch.bfloat16)
    assert not gemv_pdl.supports(x.t().contiguous().t(), torch.empty(64, 4096, device="cuda", dtype=torch.bfloat16),
                                 None)  # x not contiguous
    monkeypatch.setattr(gemv_pdl, "MAX_ROWS", gemv_pdl.MMA_ROWS_LIMIT)
    # 32 rows of x's quarter fit beside the ring at K = 4,096 (64 KB), not at 16,384 (256 KB)
    assert ok(m=32) and ok(m=16, k=8192) and not ok(m=32, k=16384) and not ok(m=33)


@needs_gluon
@pytest.mark.parametrize("rows", [1, 4])
def test_o_projection_under_pdl_after_the_attention_gpu(rows):
    """The decode attention letting the next kernel launch at its start, and the o projection launched with
    PDL streaming its weights before it waits: the same partials as launched plainly after it, eagerly and
    from a CUDA graph whose replays give the attention new queries (a projection that read the attention's
    output before the wait would see the previous replay's). One row (CUDA cores) and four (tensor cores)."""
    from prefixgate_kernels import gemv_pdl
    from prefixgate_kernels.decode_attention import paged_decode

    gen = torch.Generator(device="cuda").manual_seed(3)
    k_cache = torch.randn(160, 16, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn(160, 16, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    table = torch.randperm(160, device="cuda", generator=gen).to(torch.int32).view(4, 40)[:rows].contiguous()
    seq_lens = torch.tensor([600, 37, 640, 211][:rows], dtype=torch.int32, device="cuda")
    q = torch.randn(rows, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    w_o = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=gen) * 4096 ** -0.5

    def pair(trigger: bool, pdl: bool) -> torch.Tensor:
        out = paged_decode(q, k_cache, v_cache, table, seq_lens, 128 ** -0.5, None, None, launch_dependents=trigger)
        return gemv_pdl.partials_gemv(out.view(rows, 4096), w_o, pdl=pdl)

    want = pair(False, False).clone()
    assert torch.equal(pair(True, True), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = pair(True, True)
    for _ in range(3):
        q.normal_(generator=gen)
        graph.replay()
        want = pair(False, False)
        torch.cuda.synchronize()
        assert torch.equal(got, want)


@needs_gluon
@pytest.mark.parametrize("rows", [1, 5])
def test_down_projection_under_pdl_after_gate_up_silu_gpu(rows):
    """gate|up + SiLU letting the next kernel launch as its programs run, and the down projection launched with
    PDL streaming its weights before it waits (``triton_ops.DOWN_PDL``): the same partials as the pair launched
    plainly, eagerly and from a CUDA graph whose replays give gate|up a new input each time (a down projection
    that read the activation before the wait would see the previous replay's). Llama-8B's MLP widths: down's K
    quarter is 14 steps of 256; one row on CUDA cores, five on the tensor cores."""
    from prefixgate_kernels import gate_up_silu, gemv_pdl
    from prefixgate_kernels._common import num_sms

    gen = torch.Generator(device="cuda").manual_seed(5)
    hidden, inter = 4096, 14336
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    w_gate_up = torch.randn(2 * inter, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) * hidden ** -0.5
    w_down = torch.randn(hidden, inter, device="cuda", dtype=torch.bfloat16, generator=gen) * inter ** -0.5
    config = gate_up_silu.choose_config(rows, inter, hidden, num_sms(x.device))
    assert config is not None

    def pair(linked: bool) -> torch.Tensor:
        act = gate_up_silu.gate_up_silu(x, w_gate_up, config, launch_dependents=linked)
        return gemv_pdl.partials_gemv(act, w_down, pdl=linked)

    want = pair(False).clone()
    assert torch.equal(pair(True), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = pair(True)
    for _ in range(3):
        x.normal_(generator=gen)
        graph.replay()
        want = pair(False)
        torch.cuda.synchronize()
        assert torch.equal(got, want)


@needs_gluon
@pytest.mark.parametrize(("rows", "k"), [(1, 4096), (5, 4096), (32, 4096), (1, 14336), (8, 14336)])
def test_norm_under_pdl_after_gemv_pdl_gpu(rows, k):
    """A ``gemv_pdl`` projection letting the next kernel launch once its wait returns, and ``add_rms_norm`` launched
    with PDL (its weight loaded, then the wait) letting the kernel after it launch in turn (``triton_ops.NORM_PDL``):
    the same residual and output as the chain launched plainly, eagerly and from a CUDA graph whose replays give
    the projection a new input and the residual new values each time (a norm that read the partials or the
    residual before its wait would see the previous replay's). The o projection's K (4,096) and down's (14,336),
    one row on CUDA cores, more on the tensor cores; the norm then lets a second ``gemv_pdl`` launch as the
    engine's q|k|v or gate|up would."""
    from prefixgate_kernels import gemv_pdl, rmsnorm

    gen = torch.Generator(device="cuda").manual_seed(11)
    hidden = 4096
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(hidden, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
    w_next = torch.randn(1024, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) * hidden ** -0.5
    gamma = 1 + 0.1 * torch.randn(hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    residual0 = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)

    def chain(linked: bool, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        parts = gemv_pdl.partials_gemv(x, w, pdl=linked, launch_dependents=linked)
        h = rmsnorm.add_rms_norm(parts, residual, gamma, 1e-5, launch_dependents=linked, pdl=linked)
        return h, gemv_pdl.partials_gemv(h, w_next, pdl=linked)

    plain_res, linked_res = residual0.clone(), residual0.clone()
    want_h, want_next = chain(False, plain_res)
    got_h, got_next = chain(True, linked_res)
    assert torch.equal(linked_res, plain_res) and torch.equal(got_h, want_h) and torch.equal(got_next, want_next)
    graph = torch.cuda.CUDAGraph()
    captured_res = residual0.clone()
    with torch.cuda.graph(graph):
        got_h, got_next = chain(True, captured_res)
    for _ in range(3):
        x.normal_(generator=gen)
        fresh = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        captured_res.copy_(fresh)
        graph.replay()
        plain_res = fresh.clone()
        want_h, want_next = chain(False, plain_res)
        torch.cuda.synchronize()
        assert torch.equal(captured_res, plain_res) and torch.equal(got_h, want_h) and torch.equal(got_next, want_next)


@needs_gluon
@pytest.mark.parametrize("lens", [[700], [700, 45, 1290]])
def test_rotary_decode_attention_reads_gemv_pdl_partials_gpu(lens):
    """The q|k|v projection as ``gemv_pdl``'s K-quarter partials, summed by the decode launch: the same cache
    bytes and the same output as the launch given their rounded sum (``partial_gemm.summed``); one row and
    three."""
    from prefixgate_kernels import gemv_pdl, partial_gemm
    from tests.kernels.test_rope_decode import _copy_caches, rope_decode_inputs

    case = rope_decode_inputs(32, 8, 128, 16, torch.bfloat16, torch.bfloat16, lens, seed=9, device="cuda",
                              padded_row=False)
    gen = torch.Generator(device="cuda").manual_seed(9)
    x = torch.randn(len(lens), 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(48 * 128, 4096, device="cuda", dtype=torch.bfloat16, generator=gen) * 4096 ** -0.5
    parts = gemv_pdl.partials_gemv(x, w)
    summed = partial_gemm.summed(parts, torch.bfloat16)
    a, b = _copy_caches(case), _copy_caches(case)

    def attend(c, qkv, **kw):
        return triton_ops.rotary_decode_attention(qkv, c["cos"], c["sin"], c["k_cache"], c["v_cache"],
                                                  c["slot_mapping"], 32, c["block_tables"], c["seq_lens"], 0.125,
                                                  **kw)

    out_parts = attend(a, parts, qkv_dtype=torch.bfloat16)
    out_sum = attend(b, summed)
    assert torch.equal(a["k_cache"], b["k_cache"]) and torch.equal(a["v_cache"], b["v_cache"])
    assert fused.rel_err(out_parts, out_sum) < 1e-3  # two compiled programs: equal within their schedules


@pytest.mark.parametrize("m", [1, 16])
def test_linear_through_the_skinny_gemm_gpu(m, monkeypatch):
    """``ops.linear`` with the weight-streaming GEMM switched on (q|k|v's shape, chain_config's tiles)."""
    from prefixgate_kernels import skinny_gemm

    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 4096, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randn(6144, 4096, generator=gen) * 4096 ** -0.5).to("cuda", torch.bfloat16)
    monkeypatch.setattr(skinny_gemm, "ENGINE_MAX_ROWS", 16)
    got = triton_ops.linear(x, w)
    assert got.shape == (m, 6144) and got.dtype == torch.bfloat16
    assert fused.rel_err(got, x.double() @ w.double().T) < 1e-2


@pytest.mark.parametrize("m,block_n,launch_next", [(1, 16, 0), (8, 32, 1), (32, 64, 0), (3, 16, 1)])
def test_skinny_gemm_gpu_pdl(m, block_n, launch_next):
    """Programmatic dependent launch: each GEMM of a chain consumes the previous one's output, so a
    wait placed wrong shows as a wrong product. Eager and as one CUDA graph (PDL edges captured),
    against float64 F.linear; N not a multiple of the tile."""
    from prefixgate_kernels import skinny_gemm

    gen = torch.Generator(device="cuda").manual_seed(m * block_n + launch_next)
    dims = [4096, 1008, 2048, 4096]  # w_i: [dims[i+1], dims[i]]; 1008 leaves a partial 32/64-row tile
    ws = [torch.randn(dims[i + 1], dims[i], device="cuda", dtype=torch.bfloat16, generator=gen) * 0.03
          for i in range(len(dims) - 1)]
    x = torch.randn(m, dims[0], device="cuda", dtype=torch.bfloat16, generator=gen)

    def chain():
        y = x
        for w in ws:
            k = w.shape[1]
            cfg = skinny_gemm.SkinnyConfig(block_n=block_n, block_k=256 if k % 256 == 0 else 16, split_k=1, pdl=True,
                                           launch_next=skinny_gemm.LaunchNext(launch_next))
            y = skinny_gemm.skinny_linear(y, w, None, cfg)
        return y

    want = x.double()
    for w in ws:
        want = torch.nn.functional.linear(want.to(torch.bfloat16).double(), w.double())
    assert fused.rel_err(chain(), want) < 2e-2
    graph = torch.cuda.CUDAGraph()
    chain()
    with torch.cuda.graph(graph):
        out = chain()
    x.copy_(torch.randn(m, dims[0], device="cuda", dtype=torch.bfloat16, generator=gen))
    graph.replay()
    want = x.double()
    for w in ws:
        want = torch.nn.functional.linear(want.to(torch.bfloat16).double(), w.double())
    assert fused.rel_err(out, want) < 2e-2


def test_linear_gpu():
    gen = torch.Generator(device="cuda").manual_seed(3)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    for m in (1, 17, 32, 33, 300):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
        assert fused.rel_err(triton_ops.linear(x, w), torch.nn.functional.linear(x.double(), w.double())) < 1e-2


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("head_dim,group,block_size", [(64, 1, 16), (128, 4, 16), (128, 8, 32)])
def test_prefill_gpu_split_kv(kv_dtype, head_dim, group, block_size):
    """Split-KV prefill on the compiled kernel (GPU tiles): a forced split count over fresh prompts,
    a long prefix, a one-token chunk and an empty sequence; then the launcher's own choice from the
    length hint for a short suffix over a long prefix (it splits there)."""
    prefill.run_case(head_dim, group, block_size, cached=[0, 21, 3000, 5, 1000], new=[300, 7, 1, 0, 513],
                     kv_dtype=kv_dtype, q_dtype=torch.bfloat16, kv_heads=2, seed=head_dim * group + 7, device="cuda",
                     num_splits=3)
    prefill.run_case(head_dim, group, block_size, cached=[8100], new=[40], kv_dtype=kv_dtype,
                     q_dtype=torch.bfloat16, kv_heads=2, seed=head_dim * group + 8, device="cuda",
                     context_lens=[8140])


def test_add_rms_norm_partials_gpu():
    fused.run_partials_norm_case(4, 37, 4096, torch.bfloat16, seed=5, device="cuda")
    fused.run_partials_norm_case(2, 3, 896, torch.float16, seed=6, device="cuda")


@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (8, 4096, 14336), (32, 896, 4864)])
def test_linear_partials_gpu(m, n, k):
    """At decode sizes: fp32 partials [S, M, N] (one batched GEMM, also inside a CUDA graph) whose sum
    is the product; past MAX_ROWS, with a bias, or in fp32: the [M, N] product itself."""
    from prefixgate_kernels import partial_gemm

    gen = torch.Generator(device="cuda").manual_seed(m + n)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    want = torch.nn.functional.linear(x.double(), w.double())
    parts = triton_ops.linear_partials(x, w)
    assert parts.shape == (partial_gemm.SLICES, m, n) and parts.dtype == torch.float32
    assert float((parts.double().sum(0) - want).norm() / want.norm()) < 1e-5
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_ops.linear_partials(x, w)
    x.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, triton_ops.linear_partials(x, w), rtol=1e-5, atol=1e-5)
    big = torch.randn(partial_gemm.MAX_ROWS + 1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    assert triton_ops.linear_partials(big, w).shape == (partial_gemm.MAX_ROWS + 1, n)
    assert triton_ops.linear_partials(x, w, torch.zeros(n, device="cuda", dtype=torch.bfloat16)).shape == (m, n)
    assert triton_ops.linear_partials(x.float(), w.float()).shape == (m, n)


@pytest.mark.parametrize("rows", [1, 8, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_gpu(rows, dtype):
    """Greedy decoding's argmax at Llama 3's vocabulary, compiled: torch.argmax's indices exactly
    (random rows, ties across chunks, a NaN), the counters left zero between launches."""
    from prefixgate_kernels import argmax
    from tests.kernels import test_argmax

    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = (torch.randn(rows, 128256, device="cuda", generator=gen) * 4).to(dtype)
    counters = torch.zeros(rows, dtype=torch.int32, device="cuda")
    test_argmax.check_rows(x, counters)
    x[0, [7, argmax.CHUNK + 1, 128255]] = 1e4
    x[-1, 99_000] = float("nan")
    for _ in range(3):
        test_argmax.check_rows(x, counters)


@needs_gluon
@pytest.mark.parametrize("head_dim,group,block_size", [(128, 4, 16), (64, 8, 16), (128, 1, 32)])
@pytest.mark.parametrize("block_m,block_n,num_buf,num_warps", [(128, 128, 2, 8), (128, 64, 3, 8), (64, 64, 2, 4)])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_prefill_overlap_gpu(head_dim, group, block_size, block_m, block_n, num_buf, num_warps, q_dtype):
    """The Gluon prefill whose softmax overlaps the MMAs (prefixgate_kernels/prefill_overlap.py) against
    the reference on fresh prompts: a fresh prompt, a long cached prefix under a few new tokens, one-token
    and empty chunks, tiles crossing the diagonal and the ends of blocks."""
    from prefixgate_kernels.prefill_overlap import paged_prefill_overlap

    def overlap(*args):
        return paged_prefill_overlap(*args, block_m=block_m, block_n=block_n, num_buf=num_buf, num_warps=num_warps)
    prefill.run_case(head_dim, group, block_size, cached=[0, 21, 3000, 5, 1000], new=[300, 7, 1, 0, 513],
                     q_dtype=q_dtype, kv_heads=2, seed=head_dim * group + block_n, device="cuda", prefill=overlap)


@needs_gluon
@pytest.mark.parametrize("head_dim,group,block_size", [(128, 4, 16), (64, 8, 16), (128, 1, 32)])
@pytest.mark.parametrize("block_n,num_buf,pingpong", [(128, 2, False), (128, 3, False), (64, 4, False),
                                                     (128, 2, True), (64, 4, True)])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_prefill_specialized_gpu(head_dim, group, block_size, block_n, num_buf, pingpong, q_dtype):
    """The warp-specialised Gluon prefill (prefixgate_kernels/prefill_specialized.py: a cp.async loader and
    two consumer warpgroups on an mbarrier ring) against the reference, on the overlap test's cases:
    rings that wrap many times, a tile whose second warpgroup has no rows, one-token and empty chunks; with
    and without the consumers' MMAs issued in turns."""
    from prefixgate_kernels.prefill_specialized import paged_prefill_specialized

    def specialized(*args):
        return paged_prefill_specialized(*args, block_n=block_n, num_buf=num_buf, pingpong=pingpong)
    prefill.run_case(head_dim, group, block_size, cached=[0, 21, 3000, 5, 1000], new=[300, 7, 1, 0, 513],
                     q_dtype=q_dtype, kv_heads=2, seed=head_dim * group + block_n + num_buf + pingpong, device="cuda",
                     prefill=specialized)


@needs_gluon
@pytest.mark.parametrize("head_dim,group,block_size", [(128, 4, 16), (64, 3, 16)])
@pytest.mark.parametrize("num_splits", [2, 4, 16])
def test_prefill_specialized_splits_gpu(head_dim, group, block_size, num_splits):
    """The warp-specialised prefill with its keys shared out among ``num_splits`` programs a tile and merged
    (prefill_attention.merge_splits) against the reference: splits that hold no key of a tile (16 splits
    of a short prompt), rows that see no key of their split (the causal part), one-token and empty chunks."""
    from prefixgate_kernels.prefill_specialized import paged_prefill_specialized

    def specialized(*args):
        return paged_prefill_specialized(*args, block_n=128, num_buf=3, pingpong=True, num_splits=num_splits)
    prefill.run_case(head_dim, group, block_size, cached=[0, 21, 3000, 5, 1000], new=[300, 7, 1, 0, 513],
                     q_dtype=torch.bfloat16, kv_heads=2, seed=head_dim + group + num_splits, device="cuda",
                     prefill=specialized)


@needs_gluon
@pytest.mark.parametrize("head_dim,group,block_size,q_dtype", [(64, 3, 16, torch.bfloat16), (128, 4, 32, torch.float16)])
@pytest.mark.parametrize("cached,new", [([8100], [100]), ([8128], [64]), ([8000, 3000, 5], [100, 70, 0])])
def test_prefill_launcher_splits_on_specialized_gpu(head_dim, group, block_size, q_dtype, cached, new):
    """The launcher's own choice from a length hint where Triton would split (two KV heads: a few programs
    over a long prefix): the warp-specialised kernel takes the launch at its own split count
    (prefill_attention.plan_prefill, asserted so that this test checks that path), against the reference."""
    lens = [c + n for c, n in zip(cached, new)]
    layout = CacheLayout(head_dim, block_size, q_dtype, q_dtype)
    plan = prefill_attention.plan_prefill(sum(new), len(new), 2 * group, max(lens), torch.device("cuda"), layout)
    assert plan.kernel is prefill_attention.PrefillKernel.SPECIALIZED and plan.splits > 1, plan
    prefill.run_case(head_dim, group, block_size, cached=cached, new=new, q_dtype=q_dtype, kv_heads=2,
                     seed=head_dim + group + sum(new), device="cuda", context_lens=lens)


@needs_gluon
@pytest.mark.parametrize("head_dim,group,block_size", [(128, 4, 16), (64, 8, 32), (128, 1, 16), (64, 2, 16)])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_prefill_specialized_packed_gpu(head_dim, group, block_size, num_splits):
    """The warp-specialised prefill with a KV head's q heads packed into a program's rows (``pack``: 128 /
    group tokens of each head, each K / V tile read once for the group), with and without splits, against
    the reference: the token a row belongs to decides its causal mask, its output row and its partial."""
    from prefixgate_kernels.prefill_specialized import paged_prefill_specialized

    def specialized(*args):
        return paged_prefill_specialized(*args, block_n=128, num_buf=3, pingpong=True, num_splits=num_splits,
                                         pack=True)
    prefill.run_case(head_dim, group, block_size, cached=[0, 21, 3000, 5, 1000], new=[300, 7, 1, 0, 513],
                     q_dtype=torch.bfloat16, kv_heads=2, seed=head_dim + group + num_splits + 7, device="cuda",
                     prefill=specialized)


@pytest.mark.parametrize(("rows", "penalised"), [(1, 1), (32, 5), (32, 32)])
def test_penalty_kernels_gpu(rows, penalised):
    """The sampling penalties compiled, at Llama 3's vocabulary, against the torch reference on the same
    device: bit for bit (the division rounded to nearest, no fused multiply-add); the picks counted."""
    from prefixgate_kernels import penalties
    from tests.kernels import test_penalty_kernels

    test_penalty_kernels.check_case(rows * 7 + penalised, rows, 128256, 64, penalised, device="cuda")
    table = torch.zeros(8, 128256, device="cuda")
    index = torch.tensor([[0, 1], [6, 2]], dtype=torch.int64, device="cuda")
    picks = torch.tensor([128255, 7], dtype=torch.int64, device="cuda")
    penalties.count_picks(table, index, picks)
    assert table[6, 128255].item() == 1.0 and table[2, 7].item() == 1.0 and table.sum().item() == 2.0
