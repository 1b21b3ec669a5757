"""A decode projection of 1 to 32 rows into K-quarter partials whose weights stream under the kernel before it
(Gluon, PDL).

At batch 1 the decode attention is one wave of short, latency-bound programs under which the HBM is mostly
idle, and the o projection after it reads the layer's o weights (32 MiB at Llama-8B). Launched with
programmatic dependent launch after an attention that lets it launch at its start
(``paged_decode(..., launch_dependents=True)``), this kernel puts its first weight tiles in flight into its
own shared memory and only then waits (``griddepcontrol.wait``) for the attention's output::

    grid = (SMs rounded down to a multiple of 4,)     one program an SM
    items                 (64 output rows, a quarter of K), dealt round robin: program p takes p, p + grid, ...
                          (all in quarter p % 4, so the program reads one quarter of x)
    ring                  NUM_BUF slots of [64, 256] weights that the TMA fills, NUM_BUF in flight
    program               fill every slot -> griddepcontrol.wait -> x's quarter into shared memory ->
                          for each step: wait its slot, y += W_slot . x_step (fp32), refill the slot;
                          at an item's end store its 64 sums as quarter q's partial
    out                   fp32 partials [4, M, N], as ``partial_gemm.linear_partials`` returns them: the
                          next ``add_rms_norm`` sums them

That is the one-row kernel (CUDA cores: each thread multiplies its weights by x and the rows are summed
across threads). For 2 to ``MAX_ROWS`` rows (a decode batch of a few sequences) ``_partials_mma_kernel`` keeps
the items, the ring and the wait and takes each slot as a warpgroup MMA's A operand, x's rows (padded to a
power of two from 8, with zeros) as its B: each weight byte is still read once, where CUDA cores would
spend a pass of FMAs a row. Launched plainly it is 2-8 % faster than cuBLAS at 1-8 rows and 0-3 % slower at
16-32; under the attention the engine's decode step at batch 4 / 8 / 16 / 32 gains 3.0 / 2.4 / 2.0 / 1.3 %
(H100, docs/gpu.md session 31).

Without PDL (or after a kernel that does not let it launch early) it is an ordinary GEMV that streams the
weights at about cuBLAS's rate (session 31: 13.7 against 14.1 us a layer for 4,096 x 4,096 on an H100). Measured
in ``benchmarks/pdl_o_probe.py`` and ``benchmarks/pdl_layer_probe.py`` (docs/gpu.md, session 30): under the
attention, at the engine's table width, -1.6 to -1.7 us a layer on an H100. Compiled only (Gluon has no
interpreter); where ``supports`` says (sm_90 under Triton 3.6, as the Gluon prefills).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from prefixgate_kernels._common import num_sms
from prefixgate_kernels.prefill_attention import gluon_runs_on

SLOT_ROWS, SLOT_COLS, QUARTERS = 64, 256, 4
# Rows the kernels take: 1 on CUDA cores (``_partials_gemv_kernel``), 2..MAX_ROWS on the tensor cores
# (``_partials_mma_kernel``: a warpgroup MMA of a 64-row weight slot by the rows, padded to ``mma_rows``)
MAX_ROWS = 32  # session 31 (H100): against 8, the decode step at batch 16 / 24 / 32 -2.0 / -1.2 / -1.3 %
MMA_ROWS_LIMIT = 32  # the most rows tested and measured (an MMA N of 32); shared memory is fits_shared_memory's
SHARED_BYTES = 220 * 1024  # what one program may allocate (sm_90: 227 KB a block, less the barriers' slack)
# 4 slots (128 KB): beside two programs of the bf16 decode attention at head dim 128 (2 x ~39 KB) an SM
# still has room for the ring, so every SM's program starts under the attention (5 slots measured the same)
NUM_BUF = 4
BLOCK_N, BLOCK_K = gl.constexpr(SLOT_ROWS), gl.constexpr(SLOT_COLS)


def mma_rows(m: int) -> int:
    """The MMA's N for ``m`` rows: a power of two from 8 (gl.arange takes powers of two; wgmma N is a multiple
    of 8)."""
    return max(8, 1 << (m - 1).bit_length())


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Shapes and dtypes the kernels take: 1 to ``MAX_ROWS`` 16-bit rows of a contiguous x on the weight's
    device, and the weight as ``takes`` says."""
    if x.dim() != 2 or not x.is_contiguous() or x.device != weight.device:
        return False
    return takes(x.shape[0], x.dtype, weight, bias)


def takes(rows: int, dtype: torch.dtype, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``rows`` contiguous rows of ``dtype`` times ``weight`` are the kernels' shapes: 1 to ``MAX_ROWS``
    16-bit rows, no bias, N a multiple of 64, a quarter of K a multiple of 256 (Llama-8B's down projection:
    14 steps of 256), x's quarter and the ring within ``SHARED_BYTES``; on a device where the Gluon kernels were
    written and measured (an sm_90 GPU under Triton 3.6: ``prefill_attention.gluon_runs_on``, as for the Gluon
    prefills). Shapes only: the engine asks before it has the rows (``triton_ops.mlp_partials``)."""
    if not 0 < rows <= min(MAX_ROWS, MMA_ROWS_LIMIT) or bias is not None or weight.device.type != "cuda":
        return False
    if dtype not in (torch.bfloat16, torch.float16) or weight.dtype != dtype or not weight.is_contiguous():
        return False
    n, k = weight.shape
    if n % SLOT_ROWS or k % (QUARTERS * SLOT_COLS) or not fits_shared_memory(rows, k):
        return False
    return gluon_runs_on(weight.device)


def fits_shared_memory(m: int, k: int) -> bool:
    """Whether a program's ring and, for 2 or more rows, x's quarter of K (``mma_rows(m)`` rows, kept whole in
    shared memory as the MMAs' B operand) fit ``SHARED_BYTES``: 32 rows at K = 4,096 take 64 KB beside the
    ring's 128, at K = 8,192 twice that."""
    x_bytes = k // QUARTERS * mma_rows(m) * 2 if m > 1 else 0
    return NUM_BUF * SLOT_ROWS * SLOT_COLS * 2 + x_bytes <= SHARED_BYTES


@gluon.jit
def _grid_wait(after):
    """``griddepcontrol.wait`` once ``after`` is known: returns when the kernel launched before this one has
    finished and its writes are visible; at once when this launch was not a PDL one."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0 $1", "=r,r", [after], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _launch_dependents(after):
    """``griddepcontrol.launch_dependents`` once ``after`` is known: a kernel launched after this one with PDL (the
    next ``add_rms_norm``) may launch now; it waits for this one's writes before it reads them."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0 $1", "=r,r", [after], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _fill(w_desc, ring, ready, g, n_steps, pid, STEPS: gl.constexpr, NPROG: gl.constexpr, NUM_BUF: gl.constexpr):
    """TMA the program's step ``g`` (its item g // STEPS, K step g % STEPS) into slot g % NUM_BUF; nothing past
    the last."""
    slot = g % NUM_BUF
    ok = g < n_steps
    item = pid + (g // STEPS) * NPROG
    mbarrier.expect(ready.index(slot), BLOCK_N * BLOCK_K * 2, pred=ok)
    tma.async_copy_global_to_shared(w_desc, [(item // 4) * BLOCK_N, ((item % 4) * STEPS + g % STEPS) * BLOCK_K],
                                    ready.index(slot), ring.index(slot), pred=ok)


@gluon.jit
def _ring_started(w_desc, n_steps, pid, STEPS: gl.constexpr, NPROG: gl.constexpr, NUM_BUF: gl.constexpr,
                  LAUNCH_DEPENDENTS: gl.constexpr):
    """The ring's slots and their barriers, every slot's first fill issued, then ``griddepcontrol.wait``: the
    weights depend on nothing the kernel before this one writes, so they stream before the wait. With
    ``LAUNCH_DEPENDENTS`` the next kernel may launch once the wait has returned (not before: launched early
    ourselves, we would let it park beside the kernel we wait on too)."""
    ring = gl.allocate_shared_memory(w_desc.dtype, [NUM_BUF, BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(s), count=1)
    for s in gl.static_range(NUM_BUF):
        _fill(w_desc, ring, ready, s, n_steps, pid, STEPS, NPROG, NUM_BUF)
    _grid_wait(pid)
    if LAUNCH_DEPENDENTS:
        _launch_dependents(pid)
    return ring, ready


@gluon.jit
def _partials_gemv_kernel(w_desc, x_ptr, parts_ptr, N, STEPS: gl.constexpr, X_STEPS: gl.constexpr,
                          NPROG: gl.constexpr, NUM_BUF: gl.constexpr, num_warps: gl.constexpr,
                          LAUNCH_DEPENDENTS: gl.constexpr = False):
    pid = gl.program_id(0)
    quarter = pid % 4
    L: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])  # a [64, 256] slot
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])  # x's quarter, [X_STEPS, 256]
    # x's quarter kept unswizzled, stored whole (rank 2) and read a step at a time through a rank-1 view;
    # X_STEPS is STEPS rounded up to a power of two (gl.arange's), the rows past STEPS zero and never read
    S2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    S1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    n_items = (N // BLOCK_N * 4 - pid + NPROG - 1) // NPROG
    n_steps = n_items * STEPS
    ring, ready = _ring_started(w_desc, n_steps, pid, STEPS, NPROG, NUM_BUF, LAUNCH_DEPENDENTS)
    r = gl.arange(0, X_STEPS, layout=gl.SliceLayout(1, XL))
    c = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, XL))
    x_tile = gl.load(x_ptr + quarter * (STEPS * BLOCK_K) + r[:, None] * BLOCK_K + c[None, :],
                     mask=(r < STEPS)[:, None], other=0.0)
    x_rows = gl.allocate_shared_memory(x_tile.dtype, [X_STEPS, BLOCK_K], S2, x_tile)._reinterpret(
        x_tile.dtype, [X_STEPS, BLOCK_K], S1)
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L))
    for j in range(n_items):
        acc = gl.zeros([BLOCK_N], gl.float32, layout=gl.SliceLayout(1, L))
        for st in range(STEPS):
            g = j * STEPS + st
            slot = g % NUM_BUF
            mbarrier.wait(ready.index(slot), (g // NUM_BUF) & 1)
            w = ring.index(slot).load(L).to(gl.float32)
            x = x_rows.index(st).load(gl.SliceLayout(0, L)).to(gl.float32)
            acc += gl.sum(w * x[None, :], axis=1)
            gl.thread_barrier()  # every warp has read the slot: refill it with step g + NUM_BUF
            _fill(w_desc, ring, ready, g + NUM_BUF, n_steps, pid, STEPS, NPROG, NUM_BUF)
        item = pid + j * NPROG
        gl.store(parts_ptr + quarter * N + (item // 4) * BLOCK_N + rows, acc)
    for s in gl.static_range(NUM_BUF):
        mbarrier.invalidate(ready.index(s))


@gluon.jit
def _partials_mma_kernel(w_desc, x_ptr, parts_ptr, M, N, STEPS: gl.constexpr, NPROG: gl.constexpr,
                         NUM_BUF: gl.constexpr, ROWS: gl.constexpr, num_warps: gl.constexpr,
                         LAUNCH_DEPENDENTS: gl.constexpr = False):
    """``_partials_gemv_kernel``'s items, ring and wait for 2..ROWS rows: one warpgroup a program, each weight
    slot [64, 256] taken as the MMA's A operand and x's step [ROWS, 256] (rows past M zero) as its B, so
    every weight byte is read once whatever the rows (on CUDA cores each row would cost a pass of FMAs)."""
    pid = gl.program_id(0)
    quarter = pid % 4
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, ROWS, 16])
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])  # x's step, [ROWS, 256]
    XS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    n_items = (N // BLOCK_N * 4 - pid + NPROG - 1) // NPROG
    n_steps = n_items * STEPS
    ring, ready = _ring_started(w_desc, n_steps, pid, STEPS, NPROG, NUM_BUF, LAUNCH_DEPENDENTS)
    x_steps = gl.allocate_shared_memory(w_desc.dtype, [STEPS, ROWS, BLOCK_K], XS)
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, XL))
    c = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, XL))
    x_row = x_ptr + r[:, None] * (4 * STEPS * BLOCK_K) + quarter * (STEPS * BLOCK_K) + c[None, :]
    for i in gl.static_range(STEPS):
        x_steps.index(i).store(gl.load(x_row + i * BLOCK_K, mask=(r < M)[:, None], other=0.0))
    fence_async_shared()  # the generic stores above, before the MMAs' async reads
    gl.thread_barrier()
    n_out = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ACC))
    m_out = gl.arange(0, ROWS, layout=gl.SliceLayout(0, ACC))
    for j in range(n_items):
        acc = gl.zeros([BLOCK_N, ROWS], gl.float32, layout=ACC)
        for st in range(STEPS):
            g = j * STEPS + st
            slot = g % NUM_BUF
            mbarrier.wait(ready.index(slot), (g // NUM_BUF) & 1)
            acc = warpgroup_mma(ring.index(slot), x_steps.index(st).permute((1, 0)), acc)  # waits for its result
            gl.thread_barrier()  # every warp's MMA has read the slot: refill it with step g + NUM_BUF
            _fill(w_desc, ring, ready, g + NUM_BUF, n_steps, pid, STEPS, NPROG, NUM_BUF)
        item = pid + j * NPROG
        gl.store(parts_ptr + quarter * M * N + m_out[None, :] * N + (item // 4) * BLOCK_N + n_out[:, None], acc,
                 mask=(m_out < M)[None, :])
    for s in gl.static_range(NUM_BUF):
        mbarrier.invalidate(ready.index(s))


def partials_gemv(x: torch.Tensor, weight: torch.Tensor, pdl: bool = True,
                  launch_dependents: bool = False) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T as fp32 partials [4, M, N] over K's quarters (their sum is the product).
    ``pdl``: launched with programmatic dependent launch (its weights stream under the kernel before it,
    which must let it launch early to gain anything; correct either way). ``launch_dependents``: once its
    wait has returned, each program lets a kernel launched after it with PDL start (the next norm, which
    waits for these partials: ``rmsnorm.add_rms_norm(..., pdl=True)``). One row runs on CUDA cores, 2 to
    ``MAX_ROWS`` on the tensor cores. Shapes as ``supports`` says."""
    assert supports(x, weight, None), f"partials_gemv takes 1 to {MAX_ROWS} 16-bit rows: x {tuple(x.shape)} " \
                                      f"{x.dtype}, weight {tuple(weight.shape)} {weight.dtype}"
    m = x.shape[0]
    n, k = weight.shape
    layout = gl.NVMMASharedLayout.get_default_for([SLOT_ROWS, SLOT_COLS],
                                                  gl.bfloat16 if weight.dtype == torch.bfloat16 else gl.float16)
    desc = TensorDescriptor.from_tensor(weight, [SLOT_ROWS, SLOT_COLS], layout)
    parts = torch.empty(QUARTERS, m, n, dtype=torch.float32, device=x.device)
    grid = num_sms(x.device) // 4 * 4
    steps = k // (QUARTERS * SLOT_COLS)
    if m == 1:
        _partials_gemv_kernel[(grid,)](desc, x, parts, n, STEPS=steps, X_STEPS=1 << (steps - 1).bit_length(),
                                       NPROG=grid, NUM_BUF=NUM_BUF, num_warps=8, LAUNCH_DEPENDENTS=launch_dependents,
                                       launch_pdl=pdl)
    else:
        _partials_mma_kernel[(grid,)](desc, x, parts, m, n, STEPS=steps, NPROG=grid, NUM_BUF=NUM_BUF,
                                      ROWS=mma_rows(m), num_warps=4, LAUNCH_DEPENDENTS=launch_dependents,
                                      launch_pdl=pdl)
    return parts
