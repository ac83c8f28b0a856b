#!/usr/bin/env bash
# Device call 2 of session 8 (nvidia-h200), from the repository root with .ab/main = main's
# 721027f (vmmkv, benchmarks, csrc) carried: the profile of one eager fallback store, the
# --host-cost A/B (OLD = 721027f, NEW = this tree, alternated), the gather-path GPU tests on
# this tree, and the soak test (the one test call 1's 500 s limit cut off).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=benchmarks/results/2026-12-02-h200-session8/scripts
git log --oneline -1 2>/dev/null; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PYTHONPATH=$PWD timeout 120 python3 $S/profile_gather_host.py > $OUT/call2-profile.log 2>&1
echo "profile rc=$?"
mkdir -p /tmp/hc
for i in 1 2 3; do
    (cd .ab/main && PYTHONPATH=$PWD timeout 90 python3 benchmarks/bench_gather.py --host-cost \
        --out /tmp/hc/host-cost-OLD-$i.json > /dev/null 2>&1) || echo "OLD $i failed"
    PYTHONPATH=$PWD timeout 90 python3 benchmarks/bench_gather.py --host-cost \
        --out /tmp/hc/host-cost-NEW-$i.json > /dev/null 2>&1 || echo "NEW $i failed"
done
python3 benchmarks/results/2026-12-02-cpu-session7/scripts/summary.py /tmp/hc | tee $OUT/call2-host-cost-ab.log
tar -C /tmp -cf $OUT/call2-host-cost-json.tar hc
PYTHONPATH=$PWD timeout 300 python3 -m pytest -q -m gpu -rs -p no:cacheprovider --durations=10 \
    tests/test_gather_gpu.py tests/test_cache.py tests/test_cli.py > $OUT/call2-gather-tests.log 2>&1
echo "gather tests rc=$?"; tail -3 $OUT/call2-gather-tests.log
PYTHONPATH=$PWD timeout 420 python3 -m pytest -q -m gpu -rs -p no:cacheprovider --durations=5 \
    tests/test_soak.py > $OUT/call2-soak.log 2>&1
echo "soak rc=$?"; tail -3 $OUT/call2-soak.log
