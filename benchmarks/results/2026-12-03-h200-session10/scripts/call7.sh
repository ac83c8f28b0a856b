#!/usr/bin/env bash
# Session 10 device call 7 (nvidia-h200): the tree with quantize16 (one fast-or-IEEE choice per
# 16 values of an fp8_ds_mla tile). The GPU suite's part B (kernel tests, exhaustive division
# proof, soak), then bench_store at 1 and 4 destinations with the kernels of 21a10d6 (PREV,
# .ab/prev/csrc) and of this tree (NEW), alternated twice, then NEW's instruction count (ncu).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
bash benchmarks/gpu_session.sh tests-b
L=/tmp/call7; mkdir -p $L
for i in 1 2; do
  for v in PREV NEW; do
    d=$PWD/csrc; [ $v = PREV ] && d=$PWD/.ab/prev/csrc
    echo "== $v $i"
    PYTHONPATH=$PWD VMMKV_CSRC_DIR=$d timeout 60 python3 benchmarks/bench_store.py --tokens 16384,65536 \
        --dests 1,4 --iters 30 --out $L/bench_store-$v-$i.json > $L/bench_store-$v-$i.log 2>&1 || echo "$v $i rc=$?"
    grep -a -E "^ *(16384|65536) +\| +[14] " $L/bench_store-$v-$i.log | awk -F'|' '{print $1,$2,$3,$5,$6,$9,$10}'
  done
done
tar -C /tmp -czf $OUT/call7-bench.tgz call7
PYTHONPATH=$PWD timeout 40 ncu -k regex:'vmmkv_store_layer$' --launch-skip 3 --launch-count 1 \
    --metrics smsp__inst_executed.sum python3 benchmarks/results/2026-12-03-h200-session10/scripts/ncu_one.py 65536 \
    2>&1 | grep -E "inst_executed|ERR" | tee $OUT/call7-ncu.txt
