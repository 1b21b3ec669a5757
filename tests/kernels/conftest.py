"""Kernel tests: Triton's CPU interpreter in CI, the real compiler on a GPU.

TRITON_INTERPRET must be set before ``triton.jit`` decorates our kernels (triton reads it at
decoration time), so it is set here, at import, unless PREFIXGATE_KERNELS_GPU=1 asks for compiled
kernels (benchmarks/gpu_suite.sh). If some other test module imported the kernels first,
compiled, they are re-imported so the interpreter takes effect.
"""

from __future__ import annotations

import importlib
import os
import sys

if os.environ.get("PREFIXGATE_KERNELS_GPU") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    for name in ("kernels.decode_attention", "kernels.prefill_attention", "kernels.kv_write",
                 "kernels.block_copy", "kernels.triton_ops"):
        if name in sys.modules:
            importlib.reload(sys.modules[name])
