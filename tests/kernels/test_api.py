"""kernels.triton_ops is a drop-in for kernels.reference: same names, same parameters, same defaults."""

from __future__ import annotations

import inspect

import pytest

from kernels import reference, triton_ops

OPS = ["write_kv", "paged_decode_attention", "paged_prefill_attention", "copy_blocks", "gather_blocks",
       "scatter_blocks"]


@pytest.mark.parametrize("name", OPS)
def test_same_signature_as_reference(name):
    ref_sig = inspect.signature(getattr(reference, name))
    ops_sig = inspect.signature(getattr(triton_ops, name))
    assert list(ops_sig.parameters) == list(ref_sig.parameters)
    for p_ref, p_ops in zip(ref_sig.parameters.values(), ops_sig.parameters.values()):
        assert p_ops.default == p_ref.default and p_ops.kind == p_ref.kind, name


def test_split_choice_fills_the_last_wave():
    from kernels.decode_attention import choose_num_splits

    # 128 programs a split on 132 SMs x 4: 4 splits fill one wave; 5 would start a second, mostly idle.
    assert choose_num_splits(16, 8, 32768, num_sms=132, block_n=64) == 4
    assert choose_num_splits(256, 8, 2048, num_sms=132, block_n=64) == 1  # already 3.9 waves
    assert choose_num_splits(1, 8, 100, num_sms=132, block_n=64) == 1  # too short to split
    assert 60 <= choose_num_splits(1, 8, 131072, num_sms=132, block_n=64) <= 66
