#!/usr/bin/env bash
# Issue 12 (ops layer) on the device machine in one call: the ops GPU tests, then every number
# the issue asks for. Logs and JSON go to $OUT (the folder whose files come back; 4 files).
#   bash benchmarks/gpu_ops.sh tests|bench|all
# On 2 GPUs (nvidia-h200-x2): the tests run their 2-rank cases one process per GPU, and the
# bench prints the PCP2 tables (eager host time 2 launches vs 1, graph time, barrier vs torch
# symmetric memory, publish vs peer copy). On 1 GPU (nvidia-h200): the same with two processes
# sharing the GPU, plus the 1/2/4/8-destination table. Both print the host-cost breakdown.
set -u
export PYTHONPATH=$PWD:$PWD/.gpu-site NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/bench-out}
mkdir -p "$OUT"
what=${1:-all}
LOG="$OUT/ops.log"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG"
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "== GPUs: $ngpu  torch: $(python3 -c 'import torch; print(torch.__version__)')" | tee -a "$LOG"
if [ "$what" = tests ] || [ "$what" = all ]; then
    echo "== ops tests (GPU + CPU)" | tee -a "$LOG"
    timeout 1500 python3 -m pytest -q -rs -p no:cacheprovider tests/test_kernels_gpu.py \
        tests/test_compile_gpu.py tests/test_ops_cpu.py tests/test_nvrtc.py 2>&1 \
        | tee "$OUT/ops-tests.log" | tail -40 | tee -a "$LOG"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    echo "== host cost per call (one process)" | tee -a "$LOG"
    timeout 300 python3 benchmarks/bench_store.py --host-cost --out "$OUT/host_cost.json" 2>&1 | tee -a "$LOG"
    echo "== PCP2 publish (2 ranks)" | tee -a "$LOG"
    timeout 900 python3 benchmarks/bench_store.py --pcp 2 --out "$OUT/pcp2.json" 2>&1 | tee -a "$LOG"
    if [ "$ngpu" -eq 1 ]; then
        echo "== one GPU: 1/2/4/8 destinations" | tee -a "$LOG"
        timeout 900 python3 benchmarks/bench_store.py --out "$OUT/bench_store.json" 2>&1 \
            | grep -v " done$" | tee -a "$LOG"
    fi
fi
