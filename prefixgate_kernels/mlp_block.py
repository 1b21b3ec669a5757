"""A decode step's MLP half in one persistent launch: four kernels' work between grid-wide barriers.

At 1-8 rows the step's kernels are short and each boundary costs a ramp and a drain (docs/gpu.md,
sessions 16-21: ~1.2 us a boundary in a graph plus the ~2-3 us a GEMM takes to reach its stream and
leave it). From the o projection's partials to the next layer's normalised input the engine runs
four launches: ``add_rms_norm`` (post-attention), ``gate_up_silu``, the down projection's partials
(a batched cuBLAS GEMM) and ``add_rms_norm`` (the next layer's input norm). Here one grid of one
program an SM runs them as phases::

    phase 1  residual += sum(o partials)  (column tiles)   sum of squares of each tile's rows -> ss_a
    -- grid barrier --
    phase 2  gate|up . x, x normalised on the fly from residual and ss_a   -> act = silu(gate) * up
    -- grid barrier --
    phase 3  down . act in K slices (column tile x slice)                  -> fp32 partials
    -- grid barrier --
    phase 4  residual += sum(down partials)  (column tiles)                  -> ss_b
    -- grid barrier --
    phase 5  out = w_next * normalised residual (column tiles)

Every tile of a phase belongs to one program (tiles handed out round robin), so the results do not
depend on timing. The roundings are those of the four kernels (``prefixgate_kernels.reference``'s
order: partials summed in fp32 and rounded, the add rounded, the row normalised and rounded, the
weight product rounded; gate and up rounded before SiLU, SiLU rounded, the product rounded); only the
sum of squares is added in another order (32-column tiles, then the tiles in order), so the
normalised row may differ from ``add_rms_norm``'s by an ulp.

The barrier is sense-reversing (``_grid_sync``): an arrival count that the last arrival zeroes and a
generation word it advances, so one pair of int32s serves every launch and every barrier with no
reset between them. It needs every program resident at once, which one program an SM of these tiles
is. The interpreter runs programs one after another, so there each phase is its own launch
(``one_launch=False``), the same code without the barriers; compiled, both forms run and agree
bit for bit (tests/kernels/test_gpu.py).

The GEMM phases run each program's tiles as one flattened loop over (tile, K slice) that loads the
weights two iterations ahead by hand (Triton's pipeliner does not take these loops: no async copies in
the sm_90 compile), so one program an SM keeps three weight tiles in flight across tile boundaries; the
first two of a phase are loaded before the barrier it waits at, since weights depend on nothing the step
computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from prefixgate_kernels._common import interpreting

# Rows up to which the engine's decode steps take this launch (``triton_ops.mlp_block_or_none``); 0: the
# four kernels always. Off until measured against them in the engine (docs/gpu.md, session 29).
ENGINE_MAX_ROWS = 0
MAX_ROWS = 16  # x's tiles are [16, BLOCK_K]: the MMA's smallest M; past 16 rows the GEMMs want wider tiles
NORM_COLS = 32  # columns per tile of the norm phases (phase 1, 4, 5) and of their sums of squares


@dataclass(frozen=True)
class BlockConfig:
    """Tiles of ``mlp_block``: programs (one an SM), gate|up columns per tile, down columns per tile and
    its K slices, the K tile of both GEMMs, and Triton's warps and pipeline depth."""

    programs: int
    gate_up_cols: int = 16
    down_cols: int = 32
    down_slices: int = 4
    block_k: int = 256
    # 8 warps: three weight tiles in flight take 252 registers a thread without spilling (the sm_90
    # compile here; 4 warps spill 344 bytes), one program an SM
    num_warps: int = 8
    num_stages: int = 1  # Triton's pipeliner does not take the flattened loops; the kernel prefetches itself


def choose_config(m: int, hidden: int, inter: int, num_sms: int) -> BlockConfig | None:
    """Tiles for ``m`` rows of a hidden size / intermediate size, or None where the kernel does not apply
    (no rows or more than ``MAX_ROWS``, sizes the tiles do not divide). Shapes only: CUDA-graph safe."""
    if not 0 < m <= MAX_ROWS:
        return None
    for block_k in (256, 128, 64):  # the widest K tile the sizes take (256 for Llama-8B's 4,096 / 14,336)
        cfg = BlockConfig(programs=num_sms, block_k=block_k)
        if tiles_fit(cfg, hidden, inter):
            return cfg
    return None


def tiles_fit(config: BlockConfig, hidden: int, inter: int) -> bool:
    """Whether the config's tiles divide the sizes: every phase's loops assume whole tiles."""
    return not (hidden % NORM_COLS or hidden % config.block_k or hidden % config.down_cols
                or inter % config.gate_up_cols or inter % (config.down_slices * config.block_k))


@triton.jit
def _grid_sync(state_ptr, NPROG: tl.constexpr):
    """All NPROG programs wait here for each other. state = [arrivals, generation], int32, arrivals 0.
    Every thread's earlier stores are issued (bar.sync) before one thread's acq_rel arrival at GPU
    scope publishes them; the last to arrive zeroes the count and advances the generation (release),
    the others spin on acquire reads of it. A program reads the generation before it arrives, so it
    cannot miss the advance; the count is zero again before anyone can arrive at the next barrier."""
    tl.debug_barrier()
    gen = tl.atomic_add(state_ptr + 1, 0, sem="acquire", scope="gpu")
    arrived = tl.atomic_add(state_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == NPROG - 1:
        tl.atomic_xchg(state_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(state_ptr + 1, gen + 1, sem="release", scope="gpu")
    else:
        seen = tl.atomic_add(state_ptr + 1, 0, sem="acquire", scope="gpu")
        while seen == gen:
            seen = tl.atomic_add(state_ptr + 1, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _add_partials(parts_ptr, res_ptr, ss_ptr, M, hidden, stride_part, stride_pm, stride_rm, pid,
                  NPROG: tl.constexpr, PARTIALS: tl.constexpr, BLOCK_M: tl.constexpr, NCOL: tl.constexpr):
    """residual += the partials' sum (rounded to residual's dtype, as the projection would have stored
    it), rounded; each tile's rows' sums of squares into ss [tiles, BLOCK_M]. PARTIALS 0: one [M, H]
    product in the residual's dtype instead."""
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    for t in range(pid, hidden // NCOL, NPROG):
        cols = t * NCOL + tl.arange(0, NCOL)
        if PARTIALS > 0:
            acc = tl.zeros([BLOCK_M, NCOL], tl.float32)
            for p in tl.static_range(PARTIALS):
                acc += tl.load(parts_ptr + p * stride_part + rm[:, None] * stride_pm + cols[None, :],
                               mask=m_ok[:, None], other=0.0)
            x = acc.to(res_ptr.dtype.element_ty)
        else:
            x = tl.load(parts_ptr + rm[:, None] * stride_pm + cols[None, :], mask=m_ok[:, None], other=0.0)
        r_ptrs = res_ptr + rm[:, None] * stride_rm + cols[None, :]
        r = tl.load(r_ptrs, mask=m_ok[:, None], other=0.0)
        h = (r.to(tl.float32) + x.to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(r_ptrs, h, mask=m_ok[:, None])
        h32 = h.to(tl.float32)
        tl.store(ss_ptr + t * BLOCK_M + rm, tl.sum(h32 * h32, axis=1))


@triton.jit
def _inv_rms(ss_ptr, hidden, eps, BLOCK_M: tl.constexpr, NCOL: tl.constexpr):
    """1 / rms of each row from the tiles' sums of squares, added in tile order (the same in every
    program, so every program normalises a row by the same value)."""
    rm = tl.arange(0, BLOCK_M)
    total = tl.zeros([BLOCK_M], tl.float32)
    for t in range(0, hidden // NCOL):
        total += tl.load(ss_ptr + t * BLOCK_M + rm)
    return 1.0 / tl.sqrt(total / hidden + eps)


@triton.jit
def _normalise(h, inv, w):
    """add_rms_norm's roundings: the row normalised in fp32 and rounded to its dtype, times the weight
    in fp32, rounded."""
    y = (h.to(tl.float32) * inv[:, None]).to(h.dtype).to(tl.float32)
    return (w.to(tl.float32)[None, :] * y).to(h.dtype)


@triton.jit
def _gate_up_weights(w_ptr, it, n_it, pid, k_steps, inter, stride_wn, NPROG: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """The gate and up weight tiles of this program's iteration ``it`` (tile pid + (it // k_steps) NPROG, K
    slice it % k_steps); nothing read past its last iteration."""
    ok = (tl.full([BLOCK_N], it, tl.int32) < n_it)[:, None]  # (a tensor: the interpreter takes no scalar mask)
    rn = (pid + (it // k_steps) * NPROG) * BLOCK_N + tl.arange(0, BLOCK_N)
    g_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + ((it % k_steps) * BLOCK_K + tl.arange(0, BLOCK_K))[None, :]
    wg = tl.load(g_ptrs, mask=ok, other=0.0)
    wu = tl.load(g_ptrs + inter.to(tl.int64) * stride_wn, mask=ok, other=0.0)
    return wg, wu


@triton.jit
def _gate_up_iterations(inter, hidden, pid, NPROG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's (tile, K slice) iterations of the gate|up phase: tiles pid, pid + NPROG, ..."""
    return tl.cdiv(inter // BLOCK_N - pid, NPROG) * (hidden // BLOCK_K)


@triton.jit
def _gate_up_loop(res_ptr, ss_ptr, w_norm_ptr, w_ptr, act_ptr, M, hidden, inter, eps, stride_rm, stride_wn,
                  stride_am, pid, wg0, wu0, wg1, wu1, NPROG: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NCOL: tl.constexpr, DOT_TY: tl.constexpr):
    """act = silu(x . gate) * (x . up) for this program's column tiles, x = the normalised residual
    (computed per K slice from the residual and ss: every program reads the whole row, 8 KB a row).
    The weights two iterations ahead are loaded before each iteration's product (``wg0 .. wu1``: the
    first two, issued by the caller, before the barrier that this phase's residual waits for): one
    program an SM keeps three tiles in flight, where Triton's pipeliner does not take this loop."""
    inv = _inv_rms(ss_ptr, hidden, eps, BLOCK_M, NCOL)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    rk = tl.arange(0, BLOCK_K)
    k_steps = hidden // BLOCK_K
    n_it = _gate_up_iterations(inter, hidden, pid, NPROG, BLOCK_N, BLOCK_K)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for it in range(0, n_it):
        wg2, wu2 = _gate_up_weights(w_ptr, it + 2, n_it, pid, k_steps, inter, stride_wn, NPROG, BLOCK_N, BLOCK_K)
        k0 = (it % k_steps) * BLOCK_K
        h = tl.load(res_ptr + rm[:, None] * stride_rm + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
        x = _normalise(h, inv, tl.load(w_norm_ptr + k0 + rk)).to(DOT_TY)
        acc_g += tl.dot(x, tl.trans(wg0.to(DOT_TY)))
        acc_u += tl.dot(x, tl.trans(wu0.to(DOT_TY)))
        if it % k_steps == k_steps - 1:
            # gate_up_silu's epilogue: gate and up rounded as the GEMM would store them, silu rounded
            rn = (pid + (it // k_steps) * NPROG) * BLOCK_N + tl.arange(0, BLOCK_N)
            gate = acc_g.to(act_ptr.dtype.element_ty).to(tl.float32)
            up = acc_u.to(act_ptr.dtype.element_ty).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(act_ptr.dtype.element_ty).to(tl.float32)
            tl.store(act_ptr + rm[:, None] * stride_am + rn[None, :], (act * up).to(act_ptr.dtype.element_ty),
                     mask=m_ok[:, None])
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        wg0, wu0, wg1, wu1 = wg1, wu1, wg2, wu2


@triton.jit
def _down_weights(w_ptr, it, n_it, pid, k_steps, inter, stride_wn, NPROG: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, SLICES: tl.constexpr):
    """The down weight tile of this program's iteration ``it`` (work item pid + (it // k_steps) NPROG =
    (column tile, K slice)); nothing read past its last iteration."""
    item = pid + (it // k_steps) * NPROG
    rn = (item // SLICES) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = (item % SLICES) * (inter // SLICES) + (it % k_steps) * BLOCK_K
    ok = (tl.full([BLOCK_N], it, tl.int32) < n_it)[:, None]
    return tl.load(w_ptr + rn.to(tl.int64)[:, None] * stride_wn + (k0 + tl.arange(0, BLOCK_K))[None, :],
                   mask=ok, other=0.0)


@triton.jit
def _down_iterations(inter, hidden, pid, NPROG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SLICES: tl.constexpr):
    return tl.cdiv((hidden // BLOCK_N) * SLICES - pid, NPROG) * (inter // SLICES // BLOCK_K)


@triton.jit
def _down_loop(act_ptr, w_ptr, parts_ptr, M, hidden, inter, stride_am, stride_wn, stride_part, stride_pm, pid, w0, w1,
               NPROG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               SLICES: tl.constexpr, DOT_TY: tl.constexpr):
    """fp32 partials [SLICES, M, hidden] of act . down^T: work item i = (column tile i // SLICES, K slice
    i % SLICES), handed out round robin; weights two iterations ahead as in ``_gate_up_loop``."""
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    rk = tl.arange(0, BLOCK_K)
    k_steps = inter // SLICES // BLOCK_K
    n_it = _down_iterations(inter, hidden, pid, NPROG, BLOCK_N, BLOCK_K, SLICES)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for it in range(0, n_it):
        w2 = _down_weights(w_ptr, it + 2, n_it, pid, k_steps, inter, stride_wn, NPROG, BLOCK_N, BLOCK_K, SLICES)
        item = pid + (it // k_steps) * NPROG
        s = item % SLICES
        k0 = s * (inter // SLICES) + (it % k_steps) * BLOCK_K
        a = tl.load(act_ptr + rm[:, None] * stride_am + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
        acc += tl.dot(a.to(DOT_TY), tl.trans(w0.to(DOT_TY)))
        if it % k_steps == k_steps - 1:
            rn = (item // SLICES) * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(parts_ptr + s * stride_part + rm[:, None] * stride_pm + rn[None, :], acc, mask=m_ok[:, None])
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        w0, w1 = w1, w2


@triton.jit
def _norm_out(res_ptr, ss_ptr, w_ptr, out_ptr, M, hidden, eps, stride_rm, stride_om, pid, NPROG: tl.constexpr,
              BLOCK_M: tl.constexpr, NCOL: tl.constexpr):
    inv = _inv_rms(ss_ptr, hidden, eps, BLOCK_M, NCOL)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    for t in range(pid, hidden // NCOL, NPROG):
        cols = t * NCOL + tl.arange(0, NCOL)
        h = tl.load(res_ptr + rm[:, None] * stride_rm + cols[None, :], mask=m_ok[:, None], other=0.0)
        y = _normalise(h, inv, tl.load(w_ptr + cols))
        tl.store(out_ptr + rm[:, None] * stride_om + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])


@triton.jit
def _mlp_block_kernel(
    o_ptr,  # the o projection: fp32 partials [O_PARTIALS, M, H], or [M, H] in the residual's dtype
    res_ptr,  # [M, H], updated in place twice
    w_post_ptr,  # [H]: post_attention_layernorm
    w_gu_ptr,  # [2I, H]: gate rows, then up rows
    w_down_ptr,  # [H, I]
    w_next_ptr,  # [H]: the next layer's input_layernorm (or the model's final norm)
    act_ptr,  # [M, I] scratch
    down_ptr,  # [SLICES, M, H] fp32 scratch
    ss_ptr,  # [2, H / NCOL, BLOCK_M] fp32 scratch
    out_ptr,  # [M, H]
    state_ptr,  # [2] int32: the barrier's arrivals (0 between barriers) and generation
    M, hidden, inter, eps,
    stride_o_part, stride_om, stride_rm, stride_gu, stride_down, stride_am, stride_outm,
    PHASE: tl.constexpr,  # 0: all five with barriers between them; 1-5: that phase alone
    NPROG: tl.constexpr,
    O_PARTIALS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GU_N: tl.constexpr,
    DOWN_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SLICES: tl.constexpr,
    NCOL: tl.constexpr,
    DOT_TY: tl.constexpr,
):
    pid = tl.program_id(0)
    ss_b = ss_ptr + (hidden // NCOL) * BLOCK_M
    if PHASE == 0 or PHASE == 2:  # the first gate|up weights, before the residual they do not depend on
        n_gu = _gate_up_iterations(inter, hidden, pid, NPROG, GU_N, BLOCK_K)
        wg0, wu0 = _gate_up_weights(w_gu_ptr, 0, n_gu, pid, hidden // BLOCK_K, inter, stride_gu, NPROG, GU_N, BLOCK_K)
        wg1, wu1 = _gate_up_weights(w_gu_ptr, 1, n_gu, pid, hidden // BLOCK_K, inter, stride_gu, NPROG, GU_N, BLOCK_K)
    if PHASE == 0 or PHASE == 1:
        _add_partials(o_ptr, res_ptr, ss_ptr, M, hidden, stride_o_part, stride_om, stride_rm, pid, NPROG,
                      O_PARTIALS, BLOCK_M, NCOL)
    if PHASE == 0:
        _grid_sync(state_ptr, NPROG)
    if PHASE == 0 or PHASE == 2:
        _gate_up_loop(res_ptr, ss_ptr, w_post_ptr, w_gu_ptr, act_ptr, M, hidden, inter, eps, stride_rm, stride_gu,
                      stride_am, pid, wg0, wu0, wg1, wu1, NPROG, BLOCK_M, GU_N, BLOCK_K, NCOL, DOT_TY)
    if PHASE == 0 or PHASE == 3:  # the first down weights, before the barrier that act waits for
        d_steps = inter // SLICES // BLOCK_K
        n_down = _down_iterations(inter, hidden, pid, NPROG, DOWN_N, BLOCK_K, SLICES)
        w0 = _down_weights(w_down_ptr, 0, n_down, pid, d_steps, inter, stride_down, NPROG, DOWN_N, BLOCK_K, SLICES)
        w1 = _down_weights(w_down_ptr, 1, n_down, pid, d_steps, inter, stride_down, NPROG, DOWN_N, BLOCK_K, SLICES)
    if PHASE == 0:
        _grid_sync(state_ptr, NPROG)
    if PHASE == 0 or PHASE == 3:
        _down_loop(act_ptr, w_down_ptr, down_ptr, M, hidden, inter, stride_am, stride_down, M * hidden, hidden,
                   pid, w0, w1, NPROG, BLOCK_M, DOWN_N, BLOCK_K, SLICES, DOT_TY)
    if PHASE == 0:
        _grid_sync(state_ptr, NPROG)
    if PHASE == 0 or PHASE == 4:
        _add_partials(down_ptr, res_ptr, ss_b, M, hidden, M * hidden, hidden, stride_rm, pid, NPROG, SLICES,
                      BLOCK_M, NCOL)
    if PHASE == 0:
        _grid_sync(state_ptr, NPROG)
    if PHASE == 0 or PHASE == 5:
        _norm_out(res_ptr, ss_b, w_next_ptr, out_ptr, M, hidden, eps, stride_rm, stride_outm, pid, NPROG,
                  BLOCK_M, NCOL)


def barrier_state(device: torch.device) -> torch.Tensor:
    """The barrier's two int32s, zero: a caller that launches on one stream keeps one for all its
    launches (the engine's runner does, so CUDA graphs replay with it); each barrier leaves the count
    zero again."""
    return torch.zeros(2, dtype=torch.int32, device=device)


def mlp_block(o: torch.Tensor, residual: torch.Tensor, w_post: torch.Tensor, gate_up_weight: torch.Tensor,
              down_weight: torch.Tensor, w_next: torch.Tensor, eps: float, config: BlockConfig, *,
              state: torch.Tensor | None = None, one_launch: bool | None = None) -> torch.Tensor:
    """From the o projection to the next layer's input, as the engine's four kernels compute it::

        h = add_rms_norm(o, residual, w_post)          (residual updated in place)
        o2 = down(silu(h . gate) * (h . up))           (fp32 K-slice partials)
        return add_rms_norm(o2, residual, w_next)      (residual updated in place again)

    ``o``: fp32 partials [S, M, H] (``linear_partials``) or [M, H] in the residual's dtype. ``state``:
    ``barrier_state``'s buffer (a fresh one when None). ``one_launch``: one persistent launch with grid
    barriers (compiled default), or one launch a phase (the interpreter's, where programs run one after
    another and a barrier would wait forever). Inputs are checked by ``prefixgate_kernels.triton_ops``."""
    m, hidden = residual.shape
    inter = down_weight.shape[1]
    if not tiles_fit(config, hidden, inter) or m > MAX_ROWS:
        raise ValueError(f"{config} does not fit {m} rows of hidden size {hidden}, intermediate {inter}")
    out = torch.empty_like(residual)
    if m == 0:
        return out
    if one_launch is None:
        one_launch = not interpreting()
    if one_launch and interpreting():
        raise ValueError("one launch needs every program resident at once: compiled kernels only")
    block_m = 16
    act = torch.empty((m, inter), dtype=residual.dtype, device=residual.device)
    down = torch.empty((config.down_slices, m, hidden), dtype=torch.float32, device=residual.device)
    ss = torch.empty((2, hidden // NORM_COLS, block_m), dtype=torch.float32, device=residual.device)
    if state is None:
        state = barrier_state(residual.device)
    o_partials = o.shape[0] if o.dim() == 3 else 0
    dot_ty = tl.float32 if interpreting() or residual.dtype == torch.float32 else (
        tl.bfloat16 if residual.dtype == torch.bfloat16 else tl.float16)
    args = (o, residual, w_post, gate_up_weight, down_weight, w_next, act, down, ss, out, state, m, hidden, inter, eps,
            o.stride(0) if o_partials else 0, o.stride(-2), residual.stride(0), gate_up_weight.stride(0),
            down_weight.stride(0), act.stride(0), out.stride(0))
    options = dict(NPROG=config.programs, O_PARTIALS=o_partials, BLOCK_M=block_m, GU_N=config.gate_up_cols,
                   DOWN_N=config.down_cols, BLOCK_K=config.block_k, SLICES=config.down_slices, NCOL=NORM_COLS,
                   DOT_TY=dot_ty, num_warps=config.num_warps, num_stages=config.num_stages)
    if one_launch:
        key = (config, residual.dtype, o_partials, residual.device)
        if key not in _RESIDENT_CHECKED:  # once per compile: the barriers wait forever on a program never started
            _check_resident(_mlp_block_kernel.warmup(*args, PHASE=0, grid=(config.programs,), **options), config,
                            residual.device)
            _RESIDENT_CHECKED.add(key)
    for phase in (0,) if one_launch else (1, 2, 3, 4, 5):
        _mlp_block_kernel[(config.programs,)](*args, PHASE=phase, **options)
    return out


_RESIDENT_CHECKED: set[tuple] = set()


def _check_resident(compiled, config: BlockConfig, device: torch.device) -> None:
    """Refuse a one-launch grid that the GPU could not hold at once (shared memory, registers and threads
    of the compiled kernel against the SM's): its barriers would wait forever for a program that never
    starts."""
    compiled._init_handles()  # Triton loads the binary lazily; its register count is known after
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = triton.runtime.driver.active.utils.get_device_properties(index)
    threads = 32 * config.num_warps
    shared = max(1, compiled.metadata.shared)
    per_sm = min(props["max_shared_mem"] // shared, props["max_num_regs"] // max(1, compiled.n_regs * threads),
                 2048 // threads)
    if config.programs > per_sm * props["multiprocessor_count"]:
        raise ValueError(f"{config.programs} programs of {shared} B shared memory and {compiled.n_regs} registers "
                         f"a thread do not fit at once ({per_sm} an SM x {props['multiprocessor_count']} SMs): "
                         "the grid barriers would never release")


def reference(o: torch.Tensor, residual: torch.Tensor, w_post: torch.Tensor, gate_up_weight: torch.Tensor,
              down_weight: torch.Tensor, w_next: torch.Tensor, eps: float, slices: int = 4) -> torch.Tensor:
    """``mlp_block`` through ``prefixgate_kernels.reference``'s ops (the residual updated in place), the down
    projection's partials cut into the same K slices."""
    from prefixgate_kernels import partial_gemm
    from prefixgate_kernels import reference as ref

    h = ref.add_rms_norm(o, residual, w_post, eps)
    act = ref.silu_mul(ref.linear(h, gate_up_weight))
    parts = partial_gemm.sliced_partials(act, down_weight, slices)
    return ref.add_rms_norm(parts, residual, w_next, eps)

