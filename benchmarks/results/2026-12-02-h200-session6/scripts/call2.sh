#!/usr/bin/env bash
set -u
export PYTHONPATH=$PWD:$PWD/.gpu-site PYTHONUNBUFFERED=1
L="$OUT/call2.log"
date -u | tee "$L"
timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/test_kernels_gpu.py tests/test_quant_exact_gpu.py 2>&1 | tail -3 | tee -a "$L"
VMMKV_CSRC_DIR=$PWD/.ab/csrc-split-lb5 timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/test_kernels_gpu.py 2>&1 | tail -2 | tee -a "$L"
B="python3 benchmarks/bench_store.py --tokens 2048,16384,65536 --dests 1,4,8 --iters 30"
for v in 71651e3 split 71651e3-lb5 split-lb5 71651e3-again; do
  echo "== $v" | tee -a "$L"
  VMMKV_CSRC_DIR=$PWD/.ab/csrc-$v timeout 200 $B --out "$OUT/bench_store-$v.json" 2>&1 | grep -av " done$" > "$OUT/bench_store-$v.log"
  grep -aE "^ *(2048|16384|65536) \|" "$OUT/bench_store-$v.log" | cut -c1-75 | tee -a "$L"
done
date -u | tee -a "$L"
