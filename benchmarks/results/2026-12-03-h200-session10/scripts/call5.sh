#!/usr/bin/env bash
# Session 10 device call 5 (nvidia-h200): the submitted tree. The GPU suite's part B (the kernel
# tests, the exhaustive division proof, the soak), then bench_store at 1/4/8 destinations with
# the kernels of eb3e2c3 (.ab/old/csrc, OLD) and of this tree (NEW), alternated three times.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
bash benchmarks/gpu_session.sh tests-b
L=/tmp/call5; mkdir -p $L
for i in 1 2 3; do
  for v in OLD NEW; do
    d=$PWD/csrc; [ $v = OLD ] && d=$PWD/.ab/old/csrc
    echo "== $v $i"
    PYTHONPATH=$PWD VMMKV_CSRC_DIR=$d timeout 100 python3 benchmarks/bench_store.py --tokens 2048,16384,65536 \
        --dests 1,4,8 --iters 30 --out $L/bench_store-$v-$i.json > $L/bench_store-$v-$i.log 2>&1 || echo "$v $i rc=$?"
    grep -a -E "^ *(65536) +\| +1 " $L/bench_store-$v-$i.log | awk -F'|' '{print $1,$2,$3,$5,$6,$9,$10}'
  done
done
tar -C /tmp -czf $OUT/call5-bench.tgz call5
