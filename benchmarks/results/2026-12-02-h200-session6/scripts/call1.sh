#!/usr/bin/env bash
# Dev call: kernel tests on the new kernels (runs on, and the per-token path alone), then the
# one-GPU store table for three kernel sets side by side in one call.
set -u
export PYTHONPATH=$PWD:$PWD/.gpu-site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/call1.log"
date -u | tee -a "$OUT/call1.log"
timeout 240 python3 -m pytest -q -rs -p no:cacheprovider -x tests/test_kernels_gpu.py tests/test_quant_exact_gpu.py 2>&1 | tail -15 | tee -a "$OUT/call1.log"
VMMKV_TEST_DEFINES=VMMKV_TEST_NO_RUNS timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/test_kernels_gpu.py -k "runs or store_ds_mla_writes or store_layer_writes" 2>&1 | tail -5 | tee -a "$OUT/call1.log"
B="python3 benchmarks/bench_store.py --tokens 2048,16384,65536 --dests 1,4,8 --iters 30"
echo "== kernels of 71651e3" | tee -a "$OUT/call1.log"
VMMKV_CSRC_DIR=$PWD/.ab/csrc-71651e3 timeout 200 $B --out "$OUT/bench_store-71651e3.json" 2>&1 | grep -av " done$" > "$OUT/bench_store-71651e3.log"
echo "== new kernels" | tee -a "$OUT/call1.log"
timeout 200 $B --out "$OUT/bench_store-runs.json" 2>&1 | grep -av " done$" > "$OUT/bench_store-runs.log"
echo "== new kernels, VMMKV_TEST_NO_RUNS" | tee -a "$OUT/call1.log"
VMMKV_TEST_DEFINES=VMMKV_TEST_NO_RUNS timeout 200 $B --out "$OUT/bench_store-noruns.json" 2>&1 | grep -av " done$" > "$OUT/bench_store-noruns.log"
for f in 71651e3 runs noruns; do echo "== $f"; grep -aE "^ *(2048|16384|65536) \|" "$OUT/bench_store-$f.log" | cut -c1-110; done | tee -a "$OUT/call1.log"
date -u | tee -a "$OUT/call1.log"
