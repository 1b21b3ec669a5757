"""benchmarks/decode_fp8_ablation.py's head-major pages: the same cache values laid head by head in each page,
read by the engine's launches (fp8 and bf16) and the probe's loads in the interpreter."""

from __future__ import annotations

import pytest
import torch

import benchmarks.decode_fp8_ablation as ablation
import benchmarks.kernels as kbench
import prefixgate_kernels.reference as ref
from tests.kernels.kernel_cases import INTERPRET

pytestmark = pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels in the interpreter (TRITON_INTERPRET=1)")

SHAPE = (2, 9, 3, 64, 64, 16)  # the 9 / 3 class, two sequences of 64 tokens in 16-token pages


def _case(layout: str) -> ablation.Case:
    return ablation.Case(SHAPE, torch.Generator().manual_seed(7), layout=layout, device="cpu")


def test_head_major_keeps_values_and_lays_each_page_head_by_head():
    x = torch.randn(5, 1, 2, 16, 3, 64)
    hm = kbench.head_major(x)
    assert torch.equal(hm, x)
    # [.., BS, Hkv, D] strides: a head's 16 x 64 elements of a page contiguous, the next head 16 x 64 further
    assert hm.stride()[-3:] == (64, 16 * 64, 1)


@pytest.mark.parametrize("dtype", ["fp8", "int8"])
def test_quantized_cache_keeps_the_page_layout(dtype):
    kv, _, _ = kbench.paged_setup(2, 3, 64, 64, 16, torch.Generator().manual_seed(3), device="cpu", layout="head")
    assert kv.stride()[-3:] == (64, 16 * 64, 1)
    qkv, ks, vs = kbench.quantize_cache(kv, ref.FP8_DTYPE if dtype == "fp8" else torch.int8)
    assert qkv.stride() == kv.stride()
    token, _, _ = kbench.quantize_cache(kv.contiguous(), ref.FP8_DTYPE if dtype == "fp8" else torch.int8)
    assert torch.equal(qkv.view(torch.uint8), token.view(torch.uint8))  # the same bytes' values, laid otherwise
    with pytest.raises(ValueError, match="layout"):
        kbench.paged_setup(1, 3, 64, 64, 16, torch.Generator(), device="cpu", layout="heads")


@pytest.mark.parametrize("layout", ["token", "head"])
def test_engine_launches_read_either_layout(layout):
    case = _case(layout)
    assert (case.k.stride(2) == case.block_size * case.head_dim) == (layout == "head")
    want = ref.paged_decode_attention(case.q, case.k, case.v, case.tables, case.lens, case.scale,
                                      case.k_scale, case.v_scale)
    assert kbench.rel_err(case.engine(), want) < 2e-2
    want16 = ref.paged_decode_attention(case.q, case.k16, case.v16, case.tables, case.lens, case.scale)
    assert kbench.rel_err(case.engine_bf16(), want16) < 2e-2
    assert ("rows" in case.modes, "heads" in case.modes) == ((layout == "token"),) * 2


def test_probe_loads_read_the_same_words_in_both_layouts():
    # every program xors the same K / V words whichever way the page lays them out
    sinks = []
    for layout in ("token", "head"):
        case = _case(layout)
        case.launch("loads")
        sinks.append(case.sink.clone())
    assert torch.equal(sinks[0], sinks[1])
    assert sinks[0].abs().sum() > 0


def test_batch_fits_recover_fixed_cost_per_layout():
    rows = {}
    for batch in (64, 256):
        for layout in ("token", "head"):
            nbytes = 1e8 * batch / 64
            fixed = 0.020 if layout == "token" else 0.010  # ms
            rows[f"{batch} {layout}"] = {"shape": (batch, 9, 3, 64, 4096, 16), "layout": layout, "kv_bytes": nbytes,
                                         "ms": {"engine": [fixed + nbytes / 2e12 * 1e3, None],
                                                "engine_bf16": [fixed + 2 * nbytes / 3e12 * 1e3]}}
    rows["control"] = {"shape": (64, 32, 8, 128, 4096, 16), "layout": "token", "kv_bytes": 5e8,
                       "ms": {"engine": [1.0]}}
    fits = ablation.batch_fits(rows)
    assert fits["head"]["engine_bf16"]["TBps"] == pytest.approx(3.0)
    assert fits["head"]["engine_bf16"]["fixed_us"] == pytest.approx(10.0)
    assert fits["token"]["engine_bf16"]["fixed_us"] == pytest.approx(20.0)
    assert "engine" not in fits["token"]  # a launch with an untimed round is left out
