"""benchmarks/engine_gpu.py's decode profile sorts a step's kernels into classes by name (no GPU needed)."""

from __future__ import annotations

import pytest

import benchmarks.engine_gpu as engine_gpu


@pytest.mark.parametrize("name,cls", [
    ("_gate_up_silu_kernel", "gemm"),  # the gate|up GEMM storing SiLU x up is a GEMM, not the activation
    ("_silu_mul_kernel", "activation"),
    ("nvjet_tst_128x64_64x8_1x1_v_bz_coopA_TNN", "gemm"),
    ("_decode_split_kernel", "attention"),
    ("_prefill_kernel", "attention"),
    ("_prefill_specialized_kernel", "attention"),  # the Gluon prefills (session 22's hit profile missed them)
    ("_prefill_overlap_kernel", "attention"),
    ("_add_rms_norm_kernel", "norm"),
    ("_rotary_write_kv_kernel", "rotary_kv_write"),
    ("_partials_gemv_kernel", "gemm"),  # gemv_pdl's one-row and tensor-core forms
    ("_partials_mma_kernel", "gemm"),
    ("argmax_kernel", "other"),
])
def test_decode_kernel_class(name, cls):
    assert engine_gpu.decode_kernel_class(name) == cls


@pytest.mark.parametrize("name,cls", [
    ("_prefill_specialized_kernel", "attention"),  # session 31's hit profile counted it as "other"
    ("_merge_kernel", "attention"),
    ("nvjet_sm90_tst_176x128_64x5_1x2_h_bz_TNN", "gemm"),
    ("_add_rms_norm_kernel", "other"),
    ("_silu_mul_kernel", "other"),
])
def test_hit_profile_kernel_category(name, cls):
    assert engine_gpu._kernel_category(name) == cls
