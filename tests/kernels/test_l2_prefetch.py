"""The L2 prefetch is compiled-CUDA only (inline PTX): elsewhere it says so instead of doing nothing."""

from __future__ import annotations

import pytest
import torch

from kernels.l2_prefetch import PrefetchMode, prefetch_l2


@pytest.mark.parametrize("mode", list(PrefetchMode))
def test_prefetch_refuses_a_cpu_tensor(mode):
    with pytest.raises(ValueError, match="CUDA tensor and compiled kernels"):
        prefetch_l2(torch.zeros(1024, dtype=torch.bfloat16), mode)
