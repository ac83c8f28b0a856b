#!/usr/bin/env bash
# Device call 4 of session 8 (nvidia-h200): the final tree, the rest of the GPU suite: the
# kernel tests, the byte-identity proof (test_quant_exact_gpu.py) and the soak.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PYTHONPATH=$PWD timeout 560 python3 -m pytest -m gpu -rs -p no:cacheprovider --durations=25 \
    tests/test_kernels_gpu.py tests/test_quant_exact_gpu.py tests/test_soak.py \
    > $OUT/call4-gpu-tests-b.log 2>&1
echo "suite part B rc=$?"; tail -8 $OUT/call4-gpu-tests-b.log
