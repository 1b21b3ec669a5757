"""prefixgate_kernels.triton_ops is a drop-in for prefixgate_kernels.reference: same names, same parameters, same defaults."""

from __future__ import annotations

import inspect

import pytest
import torch

from prefixgate_kernels import reference, triton_ops

OPS = ["write_kv", "paged_decode_attention", "paged_prefill_attention", "copy_blocks", "gather_blocks",
       "scatter_blocks", "add_rms_norm", "linear", "linear_partials"]


@pytest.mark.parametrize("name", OPS)
def test_same_signature_as_reference(name):
    ref_sig = inspect.signature(getattr(reference, name))
    ops_sig = inspect.signature(getattr(triton_ops, name))
    assert list(ops_sig.parameters) == list(ref_sig.parameters)
    for p_ref, p_ops in zip(ref_sig.parameters.values(), ops_sig.parameters.values()):
        assert p_ops.default == p_ref.default and p_ops.kind == p_ref.kind, name


def test_split_choice_fills_the_last_wave():
    from prefixgate_kernels.decode_attention import choose_num_splits

    # 128 programs a split on 132 SMs x 4: 4 splits fill one wave; 5 would start a second, mostly idle.
    assert choose_num_splits(16, 8, 32768, num_sms=132, block_n=64) == 4
    assert choose_num_splits(256, 8, 2048, num_sms=132, block_n=64) == 1  # already 3.9 waves
    assert choose_num_splits(1, 8, 100, num_sms=132, block_n=64) == 1  # too short to split
    assert 60 <= choose_num_splits(1, 8, 131072, num_sms=132, block_n=64) <= 66


def test_one_wave_full_enough_beats_several_fuller_ones_for_16_bit_caches():
    """The wave model alone takes 3 full waves of 8 splits for 9 / 3 heads at 64 x 4K; one wave 73 % full
    at 2 splits was 8 % faster on the H200 (session 17), so 16-bit caches take it."""
    from prefixgate_kernels.decode_attention import (
        ONE_WAVE_FILL,
        OneWaveRule,
        choose_num_splits,
        one_wave_rule_for,
    )

    assert one_wave_rule_for(torch.bfloat16) == OneWaveRule() == one_wave_rule_for(torch.float16)
    assert OneWaveRule().fill == ONE_WAVE_FILL and OneWaveRule().max_split_tokens is None
    assert choose_num_splits(64, 3, 4096, num_sms=132, block_n=64) == 8
    assert choose_num_splits(64, 3, 4096, num_sms=132, block_n=64, one_wave=OneWaveRule()) == 2
    # the engine's graph of 56 sequences over 8 KV heads: 7 splits (3 waves) -> 1 (448 of 528 slots)
    assert choose_num_splits(56, 8, 8448, num_sms=132, block_n=64, one_wave=OneWaveRule()) == 1
    # 300 pairs: one split fills 57 % of the wave, under the fill: the model's count stands
    own = choose_num_splits(100, 3, 4096, num_sms=132, block_n=64)
    assert own > 1 and choose_num_splits(100, 3, 4096, num_sms=132, block_n=64, one_wave=OneWaveRule()) == own
    # the engine benchmark's batches (1 / 8 / 32 / 128 in an 8,448-token table) split as before
    for batch in (1, 8, 32, 128):
        assert choose_num_splits(batch, 8, 8448, num_sms=132, block_n=64, one_wave=OneWaveRule()) == \
            choose_num_splits(batch, 8, 8448, num_sms=132, block_n=64), batch


def test_fp8_takes_one_wave_only_where_its_splits_are_short():
    """fp8 won with one wave where each program streamed <= 2,048 tokens and lost 6 % at 4K and 8K
    (session 17 call 5): the rule is bounded by the table cut into the one wave's splits; int8 keeps
    the model."""
    from prefixgate_kernels.decode_attention import (
        FP8_ONE_WAVE_SPLIT_TOKENS,
        FP8_WAVE_TILES,
        choose_num_splits,
        one_wave_rule_for,
    )
    from prefixgate_kernels.reference import FP8_DTYPE

    fp8 = one_wave_rule_for(FP8_DTYPE)
    assert fp8 is not None and fp8.max_split_tokens == FP8_ONE_WAVE_SPLIT_TOKENS == 2048
    assert one_wave_rule_for(torch.int8) is None
    # the 9 / 3 class at 64 x 4K (head dim 64: 128-token ring, 4 an SM): 8 -> 2 splits of 2,048
    assert choose_num_splits(64, 3, 4096, num_sms=132, block_n=128) == 8
    assert choose_num_splits(64, 3, 4096, num_sms=132, block_n=128, one_wave=fp8) == 2
    # 48 x 4K full tables on the wave tiles: one split would stream 4,096 tokens, the model's 4 stand
    wave = dict(num_sms=132, block_n=FP8_WAVE_TILES.block_n, programs_per_sm=FP8_WAVE_TILES.programs_per_sm)
    assert choose_num_splits(48, 8, 4096, one_wave=fp8, **wave) == choose_num_splits(48, 8, 4096, **wave) == 4
    # the engine's decode graphs (8,448-token tables) keep the model too
    for batch in (24, 48, 56):
        assert choose_num_splits(batch, 8, 8448, one_wave=fp8, **wave) == choose_num_splits(batch, 8, 8448, **wave)


def test_uniform_batches_split_as_before_with_a_length_hint():
    """The length-aware model agrees with the width-only one where every sequence fills the table
    (uniform batches must not lose), on the H200's shapes (132 SMs)."""
    from prefixgate_kernels.decode_attention import choose_num_splits

    for batch, kv_heads, context in [(64, 8, 4096), (256, 8, 2048), (16, 8, 32768), (2, 8, 65536), (2, 8, 131072),
                                     (32, 8, 4096), (32, 4, 4096), (32, 32, 2048), (1, 8, 100)]:
        plain = choose_num_splits(batch, kv_heads, context, num_sms=132, block_n=64)
        hinted = choose_num_splits(batch, kv_heads, context, num_sms=132, block_n=64, context_lens=[context] * batch)
        assert hinted == plain, (batch, kv_heads, context)
    # one long sequence: the hint's power-of-two candidates land next to the width-only 63
    assert choose_num_splits(1, 8, 131072, num_sms=132, block_n=64, context_lens=[131072]) == 64


def test_a_mixed_batch_splits_for_its_real_lengths():
    """32 sequences of 100-8,000 tokens (benchmarks/kernels.py MIXED_LENS): the width alone gives 2
    splits (0.181 ms on the H200, session 2), the measured best were 4-32 (0.137-0.141 ms)."""
    from prefixgate_kernels.decode_attention import choose_num_splits

    lens = torch.randint(100, 8001, (32,), generator=torch.Generator().manual_seed(7)).tolist()
    assert choose_num_splits(32, 8, 8000, num_sms=132, block_n=64) == 2
    assert choose_num_splits(32, 8, 8000, num_sms=132, block_n=64, context_lens=lens) in (4, 8, 16)
    # a batch of short sequences in a wide table: few splits, whatever the width says
    assert choose_num_splits(32, 8, 8000, num_sms=132, block_n=64, context_lens=[200] * 31 + [8000]) >= 4
    assert choose_num_splits(64, 8, 8000, num_sms=132, block_n=64, context_lens=[300] * 64) == 1


def test_tiles_per_head_dim_and_cache_width():
    """choose_tiles: what the H200 runs measured best per (head dim, cache dtype) (session 3 run 1;
    fp8 head dim 128: the candidate, faster in CUDA-graph replays on all 11 shapes of the merged run)."""
    from prefixgate_kernels.decode_attention import EIGHT_BIT_RING, choose_num_splits, choose_tiles

    def key(t):
        return (t.block_n, t.num_stages, t.programs_per_sm)

    assert key(choose_tiles(128, torch.bfloat16)) == (64, 2, 4)
    assert key(choose_tiles(128, torch.float32)) == (64, 2, 4)
    assert key(choose_tiles(128, reference.FP8_DTYPE)) == (128, 5, 3)  # 128-token tiles, two-tile ring
    assert key(choose_tiles(128, torch.int8)) == (128, 5, 3)  # the same ring (session 8)
    # fp8 with at least one (sequence, kv head) pair per SM: one buffer, 128 registers, 4 per SM
    wave = choose_tiles(128, reference.FP8_DTYPE, pairs=512, num_sms=132)
    assert key(wave) == (128, 2, 4) and wave.max_registers == 128
    assert key(choose_tiles(128, reference.FP8_DTYPE, pairs=128, num_sms=132)) == (128, 5, 3)  # 16 x 8: the ring
    assert key(choose_tiles(128, torch.int8, pairs=512, num_sms=132)) == (128, 5, 3)  # int8 keeps the ring
    assert choose_tiles(64, reference.FP8_DTYPE, pairs=512, num_sms=132).max_registers is None
    assert key(choose_tiles(64, torch.bfloat16)) == (64, 5, 4)
    assert key(choose_tiles(64, reference.FP8_DTYPE)) == (128, 5, 4)
    assert key(choose_tiles(64, torch.int8)) == (128, 5, 4)
    assert choose_tiles(256, torch.bfloat16).block_n == 32
    # the fp8 candidate's split rule: 512 programs a split on 3 x 132 slots -> 3 splits, four nearly full waves
    assert choose_num_splits(64, 8, 4096, num_sms=132, block_n=EIGHT_BIT_RING.block_n,
                             programs_per_sm=EIGHT_BIT_RING.programs_per_sm) == 3
