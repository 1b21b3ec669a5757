"""Kernel tests: Triton's CPU interpreter where there is no GPU, the real compiler where there is one.

TRITON_INTERPRET must be set before ``triton.jit`` decorates our kernels (triton reads it at
decoration time), so it is set here, at import, on machines without CUDA (CI) unless
PREFIXGATE_KERNELS_GPU=1 asks for compiled kernels (benchmarks/gpu_suite.sh). On a CUDA machine it
is left alone, so GPU tests of other packages in the same session still get compiled kernels; the
interpreter tests then skip and tests/kernels/test_gpu.py covers the kernels. If some other test
module imported the kernels first, compiled, they are re-imported so the interpreter takes effect.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch  # does not import triton

if os.environ.get("PREFIXGATE_KERNELS_GPU") != "1" and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    for module in ("decode_attention", "prefill_attention", "kv_write", "block_copy", "rmsnorm", "rotary",
                   "activation", "skinny_gemm", "gate_up_silu", "argmax", "triton_ops",
                   "chacha20_poly1305", "penalties"):
        name = f"prefixgate_kernels.{module}"
        if name in sys.modules:
            importlib.reload(sys.modules[name])
