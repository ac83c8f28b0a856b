#!/usr/bin/env bash
# One device-machine call: `tests` (the GPU suite + CLI on the GPU) and/or `bench` (every
# benchmark). Logs and JSON go to $OUT (the folder whose files come back). Usage:
#   bash benchmarks/gpu_session.sh tests|bench|all
# The device machine runs its own packages. If it lacks the test extras (hypothesis,
# pytest-timeout), unpack their wheels into .gpu-site/ here (ignored by git) and name .gpu-site
# in the call's carry list; the path below puts it on PYTHONPATH.
set -u
# NVLink multicast off for the whole session (the ranks the spawner starts get it anyway).
export PYTHONPATH=$PWD:$PWD/.gpu-site NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/bench-out}
mkdir -p "$OUT"
what=${1:-all}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if [ "$what" = tests ] || [ "$what" = all ]; then
    python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
    {
        echo "== python -m vmmkv doctor"; python3 -m vmmkv doctor; echo "rc=$?"
        echo "== python -m vmmkv demo"; python3 -m vmmkv demo; echo "rc=$?"
        echo "== python examples/engine_allocator.py"; python3 examples/engine_allocator.py; echo "rc=$?"
    } > "$OUT/cli.log" 2>&1
    tail -30 "$OUT/cli.log"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    {
        python3 benchmarks/bench_store.py --out "$OUT/bench_store.json"
        python3 -m vmmkv bench --quick --out "$OUT"
        python3 benchmarks/bench_region.py --out "$OUT/bench_region.json"
        python3 benchmarks/bench_rendezvous.py --out "$OUT/bench_rendezvous.json"
    } 2>&1 | tee "$OUT/bench.log" | grep -v " done$"
fi
