#!/usr/bin/env bash
# Prefill/decode split on a GPU machine (docs/disaggregation.md), in one call: the `-m gpu` tests of
# the shared-buffer transport (CUDA IPC between two processes; GPU 0 -> GPU 1 where two are visible),
# then benchmarks/pd.py on the 8B-shaped model: two engine processes (benchmarks/pd_node.py) sharing
# GPU 0, or GPU 0 -> GPU 1 with PD_GPUS=2 on a two-GPU machine (issue #23). Run from the repository root:
#   bash benchmarks/gpu_pd.sh            (PD_ARGS="..." adds pd.py flags; results in $OUT or benchmarks/results)
set -uo pipefail
export PYTHONUNBUFFERED=1 LITELLM_LOCAL_MODEL_COST_MAP=True HF_HUB_OFFLINE=1
# NVLink multicast stays off on shared multi-GPU hosts
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
RES=${OUT:-benchmarks/results}
mkdir -p "$RES"
"$PY" -m pytest tests/disagg/test_shared_transport.py tests/disagg/test_transport_choice.py -m gpu -q \
  -p no:cacheprovider -o addopts="" 2>&1 | tee "$RES/pd_gpu_pytest.log"
TEST_RC=${PIPESTATUS[0]}
G=${PD_GPUS:-1}
NAME=pd_cuda_8b$([ "$G" = 2 ] && echo _2gpu)
# KV blocks a node (2 MiB each at the 8B shape): 8,192 (16 GiB) beside its 16 GB of weights when each node has
# its own GPU or the one GPU is an H200's 141 GB; two nodes sharing an 80 GB card do not fit that (session 37: the
# second node's 16 GiB pool ran out of memory on an H100), so there 4,096 (8 GiB, 64K tokens: the 16 decoders'
# 384 blocks and a long prompt's 513, of which only a few live at once as each decodes 8 tokens; finished ones
# stay cached until evicted; session 39 ran it to the end on an H100). PD_KV_BLOCKS overrides.
GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 2>/dev/null | head -1 | tr -d ' ')
KV_BLOCKS=${PD_KV_BLOCKS:-$([ "$G" = 2 ] || [ "${GPU_MIB:-0}" -ge 120000 ] && echo 8192 || echo 4096)}
"$PY" benchmarks/pd.py --device cuda --gpus "$G" --shape 8b --decoders 16 --short-tokens 256 --decode-tokens 128 \
  --long-arrivals 8 --long-tokens 8192 --interval-s 0.5 --warmup-s 1 --repeats 5 --kv-blocks "$KV_BLOCKS" --split-min-tokens 1024 \
  --mixed-repeats 3 --out "$RES/$NAME.json" ${PD_ARGS:-} 2>&1 | tee "$RES/${NAME}.log"
BENCH_RC=${PIPESTATUS[0]}
echo "pd: pytest rc $TEST_RC, pd.py rc $BENCH_RC"
exit $(( TEST_RC != 0 || BENCH_RC != 0 ))
