#!/usr/bin/env bash
set -u
export PYTHONPATH=$PWD:$PWD/.gpu-site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
L="$OUT/f2-summary.log"
W=$PWD/f2work; mkdir -p $W
date -u | tee "$L"
echo "== python -m vmmkv demo" | tee -a "$L"
timeout 120 python3 -m vmmkv demo > $W/demo.log 2>&1; echo "demo rc=$?" | tee -a "$L"; tail -4 $W/demo.log | tee -a "$L"
echo "== gpu_liveness.sh" | tee -a "$L"
OUT=$W/liveness timeout 330 bash benchmarks/gpu_liveness.sh 2>&1 | tail -45 | tee -a "$L"
echo "== test_exit_gpu.py x6" | tee -a "$L"
for k in 1 2 3 4 5 6; do timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_exit_gpu.py 2>&1 | tail -1; done | tee -a "$L"
B="python3 benchmarks/bench_store.py --tokens 2048,16384,65536 --dests 1,4,8 --iters 30"
for v in 71651e3 main; do
  echo "== bench_store kernels $v" | tee -a "$L"
  if [ $v = main ]; then unset VMMKV_CSRC_DIR; else export VMMKV_CSRC_DIR=$PWD/.ab/csrc-$v; fi
  timeout 100 $B --out "$W/bench_store-$v.json" 2>&1 | grep -av " done$" > "$W/bench_store-$v.log"
  grep -aE "^ *(2048|16384|65536) \|" "$W/bench_store-$v.log" | cut -c1-80 | tee -a "$L"
done
unset VMMKV_CSRC_DIR
date -u | tee -a "$L"
tar czf "$OUT/f2-work.tgz" -C $W .
