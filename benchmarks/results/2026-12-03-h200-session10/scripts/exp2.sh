#!/usr/bin/env bash
# Session 10 call 2 (nvidia-h200): head vs pipe vs pipe5 at D=1 (alternated twice), ncu of head and pipe.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$PWD; L=/tmp/exp2; mkdir -p $L
run() {
    echo "== $1 round $R"
    PYTHONPATH=$ROOT VMMKV_CSRC_DIR=$2 timeout 150 python3 benchmarks/bench_store.py --tokens 16384,65536 \
        --dests 1,4 --iters 30 --out $L/exp2-$1-$R.json > $L/exp2-$1-$R.log 2>&1 || echo "$1 failed rc=$?"
    grep -a -E "^ *(16384|65536) +\| +[14] " $L/exp2-$1-$R.log | awk -F'|' '{print $1,$2,$3,$5,$6,$9,$10}'
}
for R in 1 2; do
    run head $ROOT/csrc
    run pipe $ROOT/.ab/pipe/csrc
    run pipe5 $ROOT/.ab/pipe5/csrc
done
for v in head pipe; do
  d=$ROOT/csrc; [ $v = pipe ] && d=$ROOT/.ab/pipe/csrc
  PYTHONPATH=$ROOT VMMKV_CSRC_DIR=$d timeout 120 ncu -k regex:vmmkv_store_layer --launch-skip 3 --launch-count 1 \
     --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
     --section LaunchStats --section SchedulerStats --section ComputeWorkloadAnalysis \
     python3 .ab/ncu_one.py 65536 > $L/ncu-$v.txt 2>&1; echo "ncu $v rc=$?"
done
grep -E "Duration|Memory Throughput|DRAM Throughput|Registers|Achieved Occupancy|Stall|Issued Warp|No Eligible|Theoretical Occ" $L/ncu-head.txt | head -30
tar -C /tmp -czf $OUT/exp2.tgz exp2
