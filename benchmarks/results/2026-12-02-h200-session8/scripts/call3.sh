#!/usr/bin/env bash
# Device call 3 of session 8 (nvidia-h200): the final tree. The --host-cost A/B (OLD = .ab/main
# = 721027f, NEW = this tree, alternated three times), the profile of one eager store, then the
# GPU suite without the kernel, byte-identity-proof and soak files (call 4 runs those).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=benchmarks/results/2026-12-02-h200-session8/scripts
mkdir -p /tmp/hc
for i in 1 2 3; do
    (cd .ab/main && PYTHONPATH=$PWD timeout 90 python3 benchmarks/bench_gather.py --host-cost \
        --out /tmp/hc/host-cost-OLD-$i.json > /dev/null 2>&1) || echo "OLD $i failed"
    PYTHONPATH=$PWD timeout 90 python3 benchmarks/bench_gather.py --host-cost \
        --out /tmp/hc/host-cost-NEW-$i.json > /dev/null 2>&1 || echo "NEW $i failed"
done
python3 benchmarks/results/2026-12-02-cpu-session7/scripts/summary.py /tmp/hc | tee $OUT/call3-host-cost-ab.log
tar -C /tmp -cf $OUT/call3-host-cost-json.tar hc
PYTHONPATH=$PWD timeout 60 python3 $S/profile_gather_host.py > $OUT/call3-profile.log 2>&1
echo "profile rc=$?"
PYTHONPATH=$PWD timeout 420 python3 -m pytest -m gpu -rs -p no:cacheprovider --durations=25 \
    --deselect tests/test_kernels_gpu.py --deselect tests/test_quant_exact_gpu.py \
    --deselect tests/test_soak.py tests > $OUT/call3-gpu-tests-a.log 2>&1
echo "suite part A rc=$?"; tail -8 $OUT/call3-gpu-tests-a.log
