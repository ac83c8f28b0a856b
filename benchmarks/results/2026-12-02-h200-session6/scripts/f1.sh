#!/usr/bin/env bash
set -u
export PYTHONPATH=$PWD:$PWD/.gpu-site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
L="$OUT/f1-summary.log"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee "$L"
timeout 540 python3 -m pytest -q -m gpu -rs -p no:cacheprovider --timeout=300 tests \
  --ignore=tests/test_barrier_stress_gpu.py --ignore=tests/test_barrier_liveness_gpu.py > "$OUT/f1-gpu-tests.log" 2>&1
echo "suite rc=$?" | tee -a "$L"
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/f1-gpu-tests.log" | tail -12 | tee -a "$L"
date -u | tee -a "$L"
