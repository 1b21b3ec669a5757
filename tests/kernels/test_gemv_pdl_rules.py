"""``gemv_pdl``'s host-side rules, which need no GPU: the MMA's N for a row count, and which row counts and
K fit one program's shared memory (the kernels themselves are tested on the GPU: tests/kernels/test_gpu.py)."""

from __future__ import annotations

import pytest

gemv_pdl = pytest.importorskip("prefixgate_kernels.gemv_pdl", reason="Gluon (triton.experimental.gluon) is absent")


def test_mma_rows_pads_to_a_power_of_two_from_eight():
    assert [gemv_pdl.mma_rows(m) for m in (1, 2, 7, 8, 9, 13, 16, 17, 24, 32)] == [8, 8, 8, 8, 16, 16, 16, 32, 32, 32]


def test_x_and_the_ring_must_fit_shared_memory():
    assert gemv_pdl.fits_shared_memory(1, 1 << 16)  # one row keeps no x in shared memory for the MMA
    assert gemv_pdl.fits_shared_memory(32, 4096) and gemv_pdl.fits_shared_memory(16, 8192)
    assert not gemv_pdl.fits_shared_memory(32, 8192) and not gemv_pdl.fits_shared_memory(2, 65536)
    # the rule is the allocation: the ring's slots and x's quarter, in bytes
    ring = gemv_pdl.NUM_BUF * gemv_pdl.SLOT_ROWS * gemv_pdl.SLOT_COLS * 2
    assert ring + 4096 // 4 * 32 * 2 <= gemv_pdl.SHARED_BYTES < ring + 8192 // 4 * 32 * 2
