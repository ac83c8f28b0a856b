#!/usr/bin/env bash
# Session 11 device call 2 (nvidia-h200): the submitted kernels (quantize16 + the fused stores
# bounded to 64 registers; PREV = .ab/prev/csrc, the kernels of bf2a945..4c4795d). The GPU
# suite's part B (kernel tests, exhaustive division proof, soak); bench_store PREV/NEW
# alternated twice with the `blocks` slot pattern; scatter.py (store_layer against a copy of
# formatted entries, every slot pattern); ncu DRAM counters of both; bench_store --pcp 2 with two
# processes on the one GPU (a functional check only: no NVLink).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=benchmarks/results/2026-12-03-h200-session11/scripts
L=/tmp/call2; mkdir -p $L
echo "== tests-b $(date +%T)"
bash benchmarks/gpu_session.sh tests-b 2>&1 | tail -5
for i in 1 2; do
  for v in PREV NEW; do
    d=$PWD/csrc; [ $v = PREV ] && d=$PWD/.ab/prev/csrc
    echo "== $v $i $(date +%T)"
    PYTHONPATH=$PWD VMMKV_CSRC_DIR=$d timeout 120 python3 benchmarks/bench_store.py --tokens 16384,65536 \
        --dests 1,4,8 --slots runs,blocks,random --iters 30 --out $L/bench_store-$v-$i.json > $L/bench_store-$v-$i.log 2>&1 || echo "$v $i rc=$?"
    grep -a -E "^ *(65536) +\| +[148] " $L/bench_store-$v-$i.log | awk -F'|' '{print $1,$2,$3,$5,$6,$9,$10}'
  done
done
echo "== scatter $(date +%T)"
PYTHONPATH=$PWD timeout 120 python3 $S/scatter.py time 65536 1,4,8 2>&1 | tee $L/scatter.txt
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__cycles_active.avg,dram__cycles_elapsed.avg,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_op_write.sum
for run in "8 runs layer" "8 blocks layer" "8 random layer" "8 runs rows" "8 random rows" "4 blocks layer" "4 random layer"; do
  set -- $run
  k='vmmkv_store_layer$'; [ $3 = rows ] && k='vmmkv_publish_rows$'
  echo "== ncu $run $(date +%T)"
  PYTHONPATH=$PWD timeout 60 /usr/local/cuda/bin/ncu -k regex:"$k" --launch-skip 3 --launch-count 1 \
      --metrics $M --csv python3 $S/scatter.py ncu 65536 $1 $2 $3 > "$L/ncu-$1-$2-$3.csv" 2>&1 || echo "ncu $run rc=$?"
  grep -a -E "dram__|lts__t_sectors|duration|ERR" "$L/ncu-$1-$2-$3.csv" | awk -F'","' '{print $(NF-2), $(NF-1), $NF}'
done
echo "== pcp2 on one GPU $(date +%T)"
PYTHONPATH=$PWD timeout 150 python3 benchmarks/bench_store.py --pcp 2 --tokens 1,8192,65536 --iters 5 \
    --out $L/pcp2-one-gpu.json > $L/pcp2-one-gpu.log 2>&1; echo "pcp2 rc=$?"; tail -25 $L/pcp2-one-gpu.log
tar -C /tmp -czf $OUT/call2.tgz call2
echo "== end $(date +%T)"
