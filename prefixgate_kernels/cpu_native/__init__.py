"""The native CPU attention kernel (paged_attention.cpp): built on first use, cached, optional.

Why native: at head dim 32 PyTorch's CPU flash kernel (SDPA) reaches ~53 GFLOP/s on one core and
was 60% of an uncached prefill; no composition of torch ops got past it (measured: query-blocked
bf16 bmm 33-60 GFLOP/s, compiled flex_attention 30 GFLOP/s). The kernel is one C++ file with
AVX-512 BF16 intrinsics and no torch headers, so it builds in seconds with the system ``g++`` and
is called through ``ctypes`` with tensor data pointers.

Build and cache: the shared library is compiled once per (source, compiler, flags) into
``$PREFIXGATE_NATIVE_CACHE`` (default ``~/.cache/prefixgate/native``), written to a temporary name
and renamed, so concurrent first uses (test workers, two servers) never load a half-written file.

Fallback (never an error): no compiler, a failed build, a CPU without AVX-512 BF16, an unsupported
shape or dtype, or ``PREFIXGATE_CPU_NATIVE=0`` -> ``load()`` returns None / ``supports`` False and
``prefixgate_kernels.cpu_attention`` keeps its SDPA path. The reason is logged once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.cpp")
# No -march: the kernels carry their own target attributes and the CPU is checked at load.
FLAGS = ("-O3", "-shared", "-fPIC", "-fopenmp", "-std=c++17")
ENV_SWITCH = "PREFIXGATE_CPU_NATIVE"


@dataclass(frozen=True)
class NativeKernel:
    """The loaded library; ``attention`` runs the paged causal attention of the packed batch."""

    lib: ctypes.CDLL

    def supports(self, head_dim: int, group: int) -> bool:
        return bool(self.lib.pg_shape_supported(head_dim, group))

    def attention(
        self,
        q: torch.Tensor,  # [T, Hq, D] bf16 contiguous
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D] bf16, each block contiguous
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [B, max_blocks] int32 contiguous
        cu_q: torch.Tensor,  # [B + 1] int32
        seq_lens: torch.Tensor,  # [B] int32
        scale: float,
        out: torch.Tensor,  # [T, Hq, D] bf16 contiguous: rows of sequences with >= min_tq tokens written
        min_tq: int,
    ) -> None:
        t, hq, d = q.shape
        nb, bs, hkv, dk = k_cache.shape
        if dk != d or v_cache.shape != k_cache.shape or k_cache.stride() != v_cache.stride():
            raise ValueError(f"k/v caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not match q {tuple(q.shape)}")
        for name, x in (("q", q), ("out", out), ("block_tables", block_tables), ("cu_q", cu_q), ("seq_lens", seq_lens)):
            if not x.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        for name, x in (("block_tables", block_tables), ("cu_q", cu_q), ("seq_lens", seq_lens)):
            if x.dtype != torch.int32:
                raise ValueError(f"{name} must be int32, got {x.dtype}")
        if q.dtype != torch.bfloat16 or out.dtype != torch.bfloat16 or k_cache.dtype != torch.bfloat16:
            raise ValueError("q, out and the caches must be bfloat16")
        if k_cache.stride()[1:] != (hkv * d, d, 1):
            raise ValueError("each cache block must be contiguous [BS, Hkv, D]")
        rc = self.lib.pg_paged_attention(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), bs, hkv, d, hq // hkv,
            block_tables.data_ptr(), block_tables.stride(0), cu_q.data_ptr(), seq_lens.data_ptr(),
            seq_lens.shape[0], min_tq, ctypes.c_float(scale), out.data_ptr(), torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"native paged attention failed (code {rc}: 1 = out of memory, 2 = shape)")

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """x [M, in] bf16 @ weight [out, in]^T bf16 (+ bias [out] bf16) -> [M, out] in ``out_dtype``
        (bfloat16 or float32, accumulated in float32). For decode-sized M: one pass over the weights."""
        m, k = x.shape
        n = weight.shape[0]
        if weight.shape[1] != k or k % 32 != 0:
            raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: in must match and be a multiple of 32")
        if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or (bias is not None and bias.dtype != torch.bfloat16):
            raise ValueError("x, weight and bias must be bfloat16")
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
        x, weight = x.contiguous(), weight.contiguous()
        bias = None if bias is None else bias.contiguous()
        out = torch.empty(m, n, dtype=out_dtype)
        rc = self.lib.pg_linear(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), m, k, n,
                                out.data_ptr(), int(out_dtype == torch.float32), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"native linear failed (code {rc})")
        return out


def cache_dir() -> Path:
    env = os.environ.get("PREFIXGATE_NATIVE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "prefixgate" / "native"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def build(target_dir: Path | None = None) -> Path:
    """Compile the library (or find the cached one) -> its path. Raises OSError / CalledProcessError."""
    cxx = _compiler()
    if cxx is None:
        raise OSError("no C++ compiler (g++) on PATH")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + version.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    target_dir = target_dir or cache_dir()
    lib = target_dir / f"prefixgate_paged_attention_{key}.so"
    if lib.exists():
        return lib
    target_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, check=True)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.pg_cpu_supported.restype = i32
    lib.pg_cpu_supported.argtypes = []
    lib.pg_shape_supported.restype = i32
    lib.pg_shape_supported.argtypes = [i32, i32]
    lib.pg_paged_attention.restype = i32
    lib.pg_paged_attention.argtypes = [p, p, p, i64, i32, i32, i32, i32, p, i64, p, p, i32, i32, ctypes.c_float, p, i32]
    lib.pg_linear.restype = i32
    lib.pg_linear.argtypes = [p, p, p, i32, i32, i32, p, i32, i32]
    return lib


@functools.lru_cache(maxsize=1)
def load() -> NativeKernel | None:
    """The kernel, or None (reason logged once) when it cannot or should not run here."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        log.info("native CPU attention disabled (%s=0)", ENV_SWITCH)
        return None
    try:
        lib = _open(build())
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("native CPU attention unavailable, using SDPA: %s", str(detail).strip()[:500])
        return None
    if not lib.pg_cpu_supported():
        log.info("native CPU attention needs AVX-512 BF16; this CPU lacks it, using SDPA")
        return None
    return NativeKernel(lib)
