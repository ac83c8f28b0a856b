#!/usr/bin/env bash
# Session 11 device call 1 (nvidia-h200), tree 4c4795d + this folder. (a) bench_store at 1/4/8
# destinations with main's kernels (PREV, .ab/prev/csrc = csrc/ of bf2a945..4c4795d) and two
# variants: Q16B = session 10's quantize16 + __launch_bounds__(256, 4) on every store, Q16C = the
# same bound on the fused (*_barrier) stores only; alternated twice. (b) ncu DRAM/L2 byte counts
# of store_layer at T = 65536, 1/4/8 destinations, runs/random slots (main's kernels).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=benchmarks/results/2026-12-03-h200-session11/scripts
L=/tmp/call1; mkdir -p $L
nvidia-smi -q | grep -iA4 "ECC Mode" > $L/ecc.txt; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv >> $L/ecc.txt
for i in 1 2; do
  for v in PREV Q16B Q16C; do
    d=$PWD/.ab/prev/csrc; [ $v = Q16B ] && d=$PWD/.ab/q16b/csrc; [ $v = Q16C ] && d=$PWD/.ab/q16c/csrc
    echo "== $v $i $(date +%T)"
    PYTHONPATH=$PWD VMMKV_CSRC_DIR=$d timeout 90 python3 benchmarks/bench_store.py --tokens 16384,65536 \
        --dests 1,4,8 --iters 30 --out $L/bench_store-$v-$i.json > $L/bench_store-$v-$i.log 2>&1 || echo "$v $i rc=$?"
    grep -a -E "^ *(65536) +\| +[148] " $L/bench_store-$v-$i.log | awk -F'|' '{print $1,$2,$3,$5,$6,$9,$10}'
  done
done
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_op_write.sum,lts__t_sectors_op_read.sum,smsp__inst_executed.sum
for D in 1 4 8; do
  for p in runs random; do
    echo "== ncu $D $p $(date +%T)"
    PYTHONPATH=$PWD timeout 60 /usr/local/cuda/bin/ncu -k regex:'vmmkv_store_layer$' --launch-skip 3 --launch-count 1 \
        --metrics $M --csv python3 $S/ncu_dests.py 65536 $D $p > $L/ncu-$D-$p.csv 2>&1 || echo "ncu $D $p rc=$?"
    grep -a -E "dram__bytes|lts__t_sectors|duration|inst_exec|ERR" $L/ncu-$D-$p.csv | awk -F'","' '{print $(NF-2), $(NF-1), $NF}'
  done
done
/usr/local/cuda/bin/ncu --query-metrics 2>/dev/null | grep -E "^(dram__|lts__t_sectors|lts__t_requests|fbpa__)" > $L/metrics.txt
tar -C /tmp -czf $OUT/call1.tgz call1
