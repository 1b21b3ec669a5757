"""benchmarks/kernels.py's summaries of launch timings, on made-up figures (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

import benchmarks.kernels as kbench
from tests.kernels.kernel_cases import INTERPRET


def test_summarise_stamps_reads_a_launch_timeline():
    # four programs (ns); the last row never ran (-1); program 1 merges, program 2 stored directly
    # (start, stream end, count, merge end, SM); the fourth program held no key, the fifth never ran
    stamps = torch.tensor([[1_000, 11_000, 12_000, -1, 0],
                           [3_000, 15_000, 16_000, 20_000, 0],
                           [2_000, 6_000, -1, -1, 1],
                           [2_500, -1, -1, -1, 1],
                           [-1, -1, -1, -1, -1]], dtype=torch.int64)
    got = kbench.summarise_stamps(stamps)
    assert (got["programs"], got["empty_programs"]) == (3, 1)
    assert (got["sms"], got["fewest_on_an_sm"], got["most_on_an_sm"]) == (2, 1, 2)
    assert got["last_end_by_programs_on_sm_us"] == {1: pytest.approx(5.0), 2: pytest.approx(14.0)}
    assert got["span_us"] == pytest.approx(19.0)  # 1,000 -> 20,000 ns
    assert got["last_start_us"] == pytest.approx(2.0)
    assert got["stream_med_us"] == pytest.approx(10.0)  # 10, 12 and 4 us
    assert got["stream_max_us"] == pytest.approx(12.0)
    assert (got["first_stream_end_us"], got["last_stream_end_us"]) == (pytest.approx(5.0), pytest.approx(14.0))  # 6,000 and 15,000 ns
    assert got["count_med_us"] == pytest.approx(1.0)
    assert (got["merge_med_us"], got["merge_max_us"]) == (pytest.approx(4.0), pytest.approx(4.0))


def test_line_fit_recovers_rate_and_fixed_cost():
    # 20 us plus 4 TB/s: ms = 0.020 + bytes / 4e12 * 1e3
    pts = [(b, 0.020 + b / 4e12 * 1e3) for b in (1e6, 5e7, 2e8)]
    fit = kbench.line_fit(pts)
    assert fit["TBps"] == pytest.approx(4.0, rel=1e-6)
    assert fit["fixed_us"] == pytest.approx(20.0, rel=1e-6)
    assert kbench.line_fit(pts[:1]) == {"TBps": None, "fixed_us": None}


@pytest.mark.skipif(not INTERPRET, reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")
def test_joined_heads_probe_runs_each_launch_and_checks_it():
    """``--joined-heads``' flow on the interpreter with tiny shapes: every launch runs (the timer is
    handed each one), each is checked against the reference, and the later shapes take the first
    shape's fastest tiles."""
    timed = []

    def timer(fn):
        fn()
        timed.append(fn)
        return 0.001 * len(timed)  # later launches "slower": the first tile set is the fastest

    gen = torch.Generator().manual_seed(0)
    rows = kbench.joined_heads_case(gen, shapes=[(2, 9, 3, 64, 128, 16), (1, 9, 3, 64, 256, 16)],
                                    tiles=[(32, 4, 2), (64, 4, 2)], launches=2, device="cpu", timer=timer)
    for row in rows:
        for name in ("bf16", "fp8"):
            res = row[name]
            errs = [res["per_head"]["rel_err"], res["joined_default"]["rel_err"]]
            errs += [v["rel_err"] for v in res["joined"].values()] + [res["whole_rows"]["rel_err"]]
            assert all(e < 1e-2 for e in errs), errs
            assert res["best_joined"].startswith("bn32_w4_s2_")
            assert res["per_head"]["chain_per_launch_ms"] is not None and res["best_chain_per_launch_ms"] is not None
            assert res["whole_rows"]["chain_per_launch_ms"] is not None
    assert all(v["tiles"] == (32, 4, 2) for v in rows[1]["fp8"]["joined"].values())


@pytest.mark.skipif(not INTERPRET, reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")
def test_odd_heads_sweep_checks_every_launch():
    """``--odd-heads``' flow on the interpreter: the launcher's launch and each tile x split one run,
    each against the reference; the fastest by the timer is named."""
    times = iter([0.003, 0.002, 0.001, 0.004] * 2)

    def timer(fn):
        fn()
        return next(times)

    gen = torch.Generator().manual_seed(1)
    got = kbench.odd_heads_sweep_case(gen, shape=(2, 9, 3, 64, 128, 16), tiles=[(64, 4, 3)], splits=(1, 2, 4),
                                      device="cpu", timer=timer)
    for name in ("bf16", "fp8"):
        rows = {k: v for k, v in got[name].items() if isinstance(v, dict)}
        assert set(rows) == {"launcher", "bn64_w4_s3_sp1", "bn64_w4_s3_sp2", "bn64_w4_s3_sp4"}
        assert all(v["rel_err"] < 1e-2 for v in rows.values())
        assert got[name]["best"] == "bn64_w4_s3_sp2"


@pytest.mark.skipif(not INTERPRET, reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")
def test_split_rule_case_checks_both_counts():
    gen = torch.Generator().manual_seed(2)
    rows = kbench.split_rule_case(gen, shapes=[(3, 9, 3, 64, 200, 256)], device="cpu",
                                  timer=lambda fn: (fn(), 0.002)[1])
    for name in ("bf16", "fp8"):
        res = rows[0][name]
        assert res["launcher"]["rel_err"] < 1e-2 and res["rule"]["rel_err"] < 1e-2
        assert res["rule_x"] == pytest.approx(1.0)


@pytest.mark.skipif(not INTERPRET, reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")
def test_rope_decode_chain_case_checks_both_ways():
    gen = torch.Generator().manual_seed(3)
    rows = kbench.rope_decode_chain_case(gen, batches=(2,), context=48, table_tokens=96, layers=2, q_heads=4,
                                         kv_heads=2, head_dim=32, device="cpu", timer=lambda fn: (fn(), 0.004)[1])
    for name in ("bf16", "fp8"):
        res = rows[0][name]
        assert res["same_cache_bytes"] and res["rel_err"] < 1e-3
        assert res["fused_us_per_layer"] == pytest.approx(2.0) and res["fused_x"] == pytest.approx(1.0)


@pytest.mark.skipif(not INTERPRET, reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")
def test_gate_up_silu_chain_case_checks_and_times_both_ways():
    """``--gate-up-silu``'s flow on the interpreter with tiny shapes: the launcher's tiles and a given
    set, each checked against the unfused ops, and every chain timed (by a stand-in timer)."""
    gen = torch.Generator().manual_seed(3)
    rows = kbench.gate_up_silu_chain_case(gen, rows=(2,), layers=2, hidden=256, inter=256, tiles=[None, (32, 64, 4, 2)],
                                          device="cpu", timer=lambda fn: (fn(), 0.01)[1])
    (row,) = rows
    assert set(row["rel_err"]) == {"launcher bn16_bk256_w4_st4", "bn32_bk64_w4_st2"}
    assert all(err < 2e-2 for err in row["rel_err"].values()), row["rel_err"]
    assert {"unfused/mlp", "unfused/gate_up+silu", "fused bn32_bk64_w4_st2/mlp",
            "fused launcher bn16_bk256_w4_st4/gate_up+silu"} <= set(row["us"])
    assert row["us"]["unfused/mlp"]["us_per_layer"] == pytest.approx(5.0)  # 0.01 ms over 2 layers
