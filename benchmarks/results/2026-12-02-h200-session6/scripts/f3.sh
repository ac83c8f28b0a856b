#!/usr/bin/env bash
set -u
R=$PWD
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
L="$OUT/f3.log"
date -u | tee "$L"
echo "== before the fix (barrier.py of 2b0afc9), test_exit_gpu -k global" | tee -a "$L"
(cd .ab/old && export PYTHONPATH=$R/.ab/old:$R/.gpu-site && for k in 1 2 3; do timeout 40 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_exit_gpu.py -k global 2>&1 | grep -aE "AssertionError: \('victim'|passed|failed" | tail -2; done) | tee -a "$L"
echo "== with the fix" | tee -a "$L"
export PYTHONPATH=$R:$R/.gpu-site
for k in 1 2 3 4 5 6 7 8; do timeout 40 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_exit_gpu.py -k global 2>&1 | grep -aE "AssertionError: \('victim'|passed|failed" | tail -2; done | tee -a "$L"
date -u | tee -a "$L"
