#!/usr/bin/env bash
# GPU check of the kernels in one call: the `-m gpu` pytest subset (bf16 dots, fp8/int8 KV, compiled
# Triton) and benchmarks/kernels.py, then a short table. Run from the repository root on a CUDA machine:
#   bash benchmarks/gpu_suite.sh [--quick]
# Results: benchmarks/results/kernels_h200.json (or $OUT/ when the device tool sets OUT).
set -uo pipefail
export PREFIXGATE_KERNELS_GPU=1   # compiled Triton: tests/kernels/conftest.py leaves the interpreter off
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
RES=${OUT:-benchmarks/results}
mkdir -p "$RES"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true

"$PY" -m pytest tests/kernels -m gpu -q -p no:cacheprovider -o addopts="" 2>&1 | tee "$RES/kernels_gpu_pytest.log"
TEST_RC=${PIPESTATUS[0]}

BENCH_JSON=${BENCH_JSON:-$RES/kernels_h200.json}
"$PY" benchmarks/kernels.py --out "$BENCH_JSON" "$@" 2>&1 | tee "$RES/kernels_bench.log"
BENCH_RC=${PIPESTATUS[0]}

echo
echo "== gpu suite =="
echo "pytest -m gpu: $(tail -n 1 "$RES/kernels_gpu_pytest.log")  (rc $TEST_RC)"
if [ "$BENCH_RC" = 0 ]; then
  "$PY" - "$BENCH_JSON" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{'decode shape':<26}{'%copy':>7}{'vs sdpa':>9}{'vs gather':>10}{'fp8 x':>7}")
for d in r["decode"]:
    s = ",".join(str(v) for v in d["shape"].values())
    print(f"{s:<26}{100*d['bf16_pct_copy']:>6.0f}%{d['vs_sdpa_contig']:>9.2f}{d['vs_gather_sdpa']:>10.2f}"
          f"{d['fp8_speedup_vs_bf16']:>7.2f}")
p = r.get("prefill") or {"TFLOPs": float("nan"), "pct_matmul": float("nan"), "vs_gather_sdpa": float("nan")}
print(f"prefill {p['TFLOPs']:.0f} TFLOP/s ({100*p['pct_matmul']:.0f}% of matmul), x{p['vs_gather_sdpa']:.2f} vs gather+SDPA")
PYEOF
else
  echo "benchmark failed (rc $BENCH_RC): see $RES/kernels_bench.log"
fi
exit $(( TEST_RC != 0 || BENCH_RC != 0 ))
