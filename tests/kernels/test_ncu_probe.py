"""benchmarks/ncu_probe.py's summaries of Nsight Compute's CSV pages (no GPU: synthetic pages in the
layout ncu 2025.3 writes)."""

from __future__ import annotations

from pathlib import Path

from benchmarks import ncu_probe

RAW = (
    '"ID","Kernel Name","gpu__time_duration.sum","smsp__issue_active.avg.pct_of_peak_sustained_active",'
    '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",'
    '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",'
    '"sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",'
    '"sm__pipe_tensor_cycles_active.max.pct_of_peak_sustained_active"\n'
    '"","","usecond","%","ratio","ratio","%","%"\n'
    '"0","_decode_split_kernel","55.1","48.0","0.75","3.20","13.0","14.0"\n'
)
SASS = (
    '"Kernel Name","_decode_split_kernel",\n'
    '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_barrier","stall_long_sb"\n'
    '"0x10","      LDC R1, c[0x0][0x28]","1","100","0","1"\n'
    '"0x20","@!P1  HMMA.16816.F32 R36, R48, R20, R36","3","300","0","3"\n'
    '"0x30","      BAR.SYNC.DEFER_BLOCKING 0x0","6","100","6","0"\n'
)


def test_summaries_of_raw_and_source_pages(tmp_path: Path):
    (tmp_path / "ncu_x_raw.csv").write_text(RAW, encoding="utf-8")
    (tmp_path / "ncu_x_sass.csv").write_text(SASS, encoding="utf-8")
    text = "\n".join(ncu_probe.summarise_dir(tmp_path))
    assert "== x: _decode_split_kernel" in text
    assert "duration                     55.1" in text and "issue slots busy %           48.0" in text
    assert "tensor_cycles_active.avg" in text and ".max." not in text  # averages only
    assert "stalls (cycles per issued instruction): barrier 3.20, long_scoreboard 0.75" in text
    # opcodes by executed share (predicates and modifiers dropped), the hottest instruction first
    assert "HMMA        60.0  30.0" in text and "BAR         20.0  60.0" in text
    assert "hot  60.0 % BAR.SYNC.DEFER_BLOCKING 0x0" in text and "barrier 6" in text


def test_empty_pages_summarise_to_nothing(tmp_path: Path):
    (tmp_path / "ncu_y_raw.csv").write_text("==PROF== nothing profiled\n", encoding="utf-8")
    assert ncu_probe.summarise_dir(tmp_path) == ["== y: no kernel row"]
