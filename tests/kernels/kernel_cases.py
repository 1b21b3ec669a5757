"""Builders for random paged caches and ragged batches shared by the kernel tests."""

from __future__ import annotations

import os

import torch

from prefixgate_kernels import reference as ref

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def gpu_ready() -> bool:
    return torch.cuda.is_available() and not INTERPRET


def make_kv_cache(num_blocks, block_size, kv_heads, head_dim, dtype, device, gen, layers=2, layer=1):
    """A block-major engine cache [NB, L, 2, BS, Hkv, D] of random values and its layer views.

    Returns (k_cache, v_cache, k_scale, v_scale): strided views kv[:, layer, 0] / kv[:, layer, 1]
    whose block stride is L*2*BS*Hkv*D (not BS*Hkv*D), as the engine hands them to kernels.
    """
    shape = (num_blocks, layers, 2, block_size, kv_heads, head_dim)
    x = torch.randn(shape, generator=gen, dtype=torch.float32).to(device)
    k_scale = v_scale = None
    if dtype == ref.FP8_DTYPE:
        kv = (x * 40).clamp(-448, 448).to(dtype)
        k_scale = torch.tensor([0.03], device=device)
        v_scale = torch.tensor([0.05], device=device)
    elif dtype == torch.int8:
        kv = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8).to(device)
        sshape = (num_blocks, block_size, kv_heads)
        k_scale = (torch.rand(sshape, generator=gen) * 0.02 + 0.002).to(device)
        v_scale = (torch.rand(sshape, generator=gen) * 0.02 + 0.002).to(device)
    else:
        kv = x.to(dtype)
    return kv[:, layer, 0], kv[:, layer, 1], k_scale, v_scale


def make_block_tables(seq_lens, block_size, num_blocks, gen, device, extra_cols=1):
    """Distinct random blocks per sequence (fragmented, out of order); unused entries hold junk ids."""
    need = [(n + block_size - 1) // block_size for n in seq_lens]
    width = max(need) + extra_cols
    assert sum(need) <= num_blocks, "test cache too small"
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, num_blocks, (len(seq_lens), width), generator=gen, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[at : at + n].to(torch.int32)
        at += n
    return table.to(device)


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    out, want = out.double(), want.double()
    assert torch.isfinite(out).all(), "kernel output has NaN/inf"
    return float((out - want).norm() / want.norm().clamp(min=1e-12))
