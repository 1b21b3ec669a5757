"""Where the decode MLP's SiLU(gate) * up runs, for ``triton_ops.mlp_partials``.

The MLP after its norm is three launches as the unfused path runs it: the gate|up GEMM, ``silu_mul``,
the down GEMM (its split-K partials, ``partial_gemm``). Two kernels can take the activation into a
GEMM (docs/gpu.md, session 19): ``glu_down`` forms it as the down GEMM loads its operand,
``gate_up_silu`` as the gate|up GEMM stores its output. Each is a weight-streaming Triton GEMM in
place of a cuBLAS one, so which (if either) the engine uses is a measured choice, set here.
"""

from __future__ import annotations

import enum


class MlpFusion(enum.Enum):
    NONE = "none"  # cuBLAS gate|up, silu_mul, the down partials: three launches
    DOWN_PROLOGUE = "down_prologue"  # cuBLAS gate|up, then prefixgate_kernels.glu_down
    GATE_UP_EPILOGUE = "gate_up_epilogue"  # prefixgate_kernels.gate_up_silu, then the down partials


# The engine's choice for 16-bit decode batches on CUDA of at most the fused kernel's MAX_ROWS rows;
# NONE until measured inside the engine's decode graphs (benchmarks/engine_gpu.py --sections decode_mlp).
ENGINE_FUSION = MlpFusion.NONE
