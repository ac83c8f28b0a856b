#!/usr/bin/env bash
# Device call 6 of session 8 (nvidia-h200), on the final tree (after the stream-handle move into
# vmmkv/ops/launch.py and the benchmarks' shared target setup): the GPU tests of every prepared
# launch and of the gather path, the CLI demo, and both host-cost tools.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
timeout 200 python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/test_kernels_gpu.py \
    tests/test_gather_gpu.py tests/test_cache.py 2>&1 | tail -6
echo "tests rc=${PIPESTATUS[0]}"
timeout 60 python3 -m vmmkv demo 2>&1 | tail -4; echo "demo rc=${PIPESTATUS[0]}"
timeout 60 python3 benchmarks/bench_store.py --host-cost --out $OUT/call6-store-host-cost.json 2>&1 | tail -30
echo "bench_store --host-cost rc=${PIPESTATUS[0]}"
timeout 60 python3 benchmarks/bench_gather.py --host-cost --out $OUT/call6-gather-host-cost.json 2>&1
echo "bench_gather --host-cost rc=$?"
} > $OUT/call6.log 2>&1
grep -E "passed|failed|rc=|PASS|total" $OUT/call6.log
