#!/usr/bin/env bash
# Session 11 device call 3 (nvidia-h200), the submitted tree: ncu's L2 write lookups and warp
# stall reasons of store_layer at T = 65536, 8 destinations, runs/random slots; then the GPU
# suite's part A (doctor, demo, examples, the barrier liveness and stress tests with their
# mutants, faults, ...).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=benchmarks/results/2026-12-03-h200-session11/scripts
L=/tmp/call3; mkdir -p $L
M=gpu__time_duration.sum,lts__t_sectors_op_write.sum,lts__t_sectors_op_write_lookup_hit.sum,lts__t_sectors_op_write_lookup_miss.sum,lts__t_requests_srcunit_tex_op_write.sum,dram__bytes_read.sum,dram__bytes_write.sum
for p in runs random; do
  echo "== ncu 8 $p $(date +%T)"
  PYTHONPATH=$PWD timeout 90 /usr/local/cuda/bin/ncu -k regex:'vmmkv_store_layer$' --launch-skip 3 --launch-count 1 \
      --metrics $M --section WarpStateStats --csv python3 $S/scatter.py ncu 65536 8 $p layer > $L/ncu-8-$p.csv 2>&1 || echo "ncu $p rc=$?"
  grep -a -E "lts__|duration|Stall|ERR" $L/ncu-8-$p.csv | awk -F'","' '{print $(NF-2), $(NF-1), $NF}'
done
tar -C /tmp -czf $OUT/call3.tgz call3
echo "== tests-a $(date +%T)"
bash benchmarks/gpu_session.sh tests-a 2>&1 | tail -8
echo "== end $(date +%T)"
