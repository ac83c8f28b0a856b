#!/usr/bin/env bash
# Session 10 call 3 (nvidia-h200): head vs shift (power-of-two block size: slot >> log2) at D=1,4
# alternated three times; SASS of head's vmmkv_store_layer; ncu instruction counts of head and shift.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$PWD; L=/tmp/exp3; mkdir -p $L
run() {
    echo "== $1 round $R"
    PYTHONPATH=$ROOT VMMKV_CSRC_DIR=$2 timeout 150 python3 benchmarks/bench_store.py --tokens 2048,16384,65536 \
        --dests 1,4 --iters 30 --out $L/exp3-$1-$R.json > $L/exp3-$1-$R.log 2>&1 || echo "$1 failed rc=$?"
    grep -a -E "^ *(2048|16384|65536) +\| +[14] " $L/exp3-$1-$R.log | awk -F'|' '{print $1,$2,$3,$5,$6,$9,$10}'
}
for R in 1 2 3; do
    run head $ROOT/csrc
    run shift $ROOT/.ab/shift/csrc
done
for v in head shift; do
  d=$ROOT/csrc; [ $v = shift ] && d=$ROOT/.ab/shift/csrc
  PYTHONPATH=$ROOT VMMKV_CSRC_DIR=$d timeout 120 ncu -k regex:vmmkv_store_layer --launch-skip 3 --launch-count 1 \
     --section SpeedOfLight --section InstructionStats --section WarpStateStats --section SchedulerStats \
     --metrics smsp__inst_executed.sum,smsp__sass_inst_executed_op_global_st.sum,smsp__sass_inst_executed_op_global_ld.sum,sm__cycles_elapsed.avg.per_second \
     python3 .ab/ncu_one.py 65536 > $L/ncu-$v.txt 2>&1; echo "ncu $v rc=$?"
  grep -E "Duration|inst_executed|Issued Ipc|Issue Slots|Executed Instructions " $L/ncu-$v.txt
done
C=$(PYTHONPATH=$ROOT python3 -c "from vmmkv.ops import build; print(build.cache_dir())")
ls -la $C | head
for f in $C/kv_store-*.cubin; do cuobjdump -sass -fun vmmkv_store_layer $f > $L/sass-$(basename $f).txt 2>&1; wc -l $L/sass-$(basename $f).txt; done
tar -C /tmp -czf $OUT/exp3.tgz exp3
