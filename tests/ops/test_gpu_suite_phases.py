"""benchmarks/gpu_suite.sh's phase selection, on the CPU: ``ONLY`` names the phases a device call runs
(the whole suite no longer fits one 600 s call), ``DRY_RUN=1`` says which it would run and stops before
touching a GPU, and a misspelt phase is refused with one line and exit code 2 instead of running nothing
(or everything) for a whole device call."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.serverutil import REPO

SUITE = REPO / "benchmarks" / "gpu_suite.sh"
ALL = ["tests", "kernel_bench", "engine_bench", "first_use", "pd", "tiers"]
SKIPS = ["SKIP_TESTS", "SKIP_KERNEL_BENCH", "SKIP_ENGINE_BENCH", "SKIP_FIRST_USE", "SKIP_PD_BENCH", "SKIP_TIERS"]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(**env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in SKIPS and k not in ("ONLY", "DRY_RUN")}
    return subprocess.run(["bash", str(SUITE)], env=base | {"DRY_RUN": "1"} | env, cwd=REPO,
                          capture_output=True, text=True, timeout=30)


def _phases(out: subprocess.CompletedProcess[str]) -> list[str]:
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith("phases:"), line
    return line.removeprefix("phases:").split()


def test_every_phase_runs_by_default():
    assert _phases(_run()) == ALL


def test_only_runs_the_phases_it_names_in_the_suite_order():
    assert _phases(_run(ONLY="tiers,engine_bench,first_use")) == ["engine_bench", "first_use", "tiers"]


def test_skip_variables_still_leave_phases_out():
    assert _phases(_run(SKIP_TESTS="1", SKIP_TIERS="1")) == ["kernel_bench", "engine_bench", "first_use", "pd"]


def test_only_wins_over_a_skip_variable():
    assert _phases(_run(ONLY="tests", SKIP_TESTS="1")) == ["tests"]


@pytest.mark.parametrize("only", ["engine", "tests,kernels", "tests,,pd ,tiers"])
def test_an_unknown_phase_is_refused_with_one_line_and_exit_code_2(only: str):
    out = _run(ONLY=only)
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown phase" in lines[0] and "kernel_bench" in lines[0], out.stderr
