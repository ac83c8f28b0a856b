#!/usr/bin/env bash
# Session 10 call 1 (nvidia-h200): D=1 store experiments, variants alternated twice.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$PWD
which ncu nsys 2>&1 | head -2
regs() {
python3 - <<'PY'
import torch
from cuda.bindings import driver as cu
from vmmkv.ops import build
m = build.load_module(0)
for n in ("vmmkv_store_layer", "vmmkv_store_layer_barrier", "vmmkv_store_ds_mla"):
    f = m.function(n)
    e, r = cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, f)
    e2, l = cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f)
    print(n, "regs", r, "local", l)
PY
}
run() {  # name, pythonpath, csrc
    echo "== $1 round $R"
    if [ $R = 1 ]; then PYTHONPATH=$2 VMMKV_CSRC_DIR=$3 regs 2>&1 | tail -3; fi
    PYTHONPATH=$2 VMMKV_CSRC_DIR=$3 timeout 150 python3 benchmarks/bench_store.py --tokens 16384,65536 \
        --dests 1 --iters 30 --out $OUT/exp1-$1-$R.json > $OUT/exp1-$1-$R.log 2>&1 || echo "$1 failed rc=$?"
    grep -E "^\s*(16384|65536)\b|fill|GB/s" $OUT/exp1-$1-$R.log | head -12
}
for R in 1 2; do
    run head $ROOT $ROOT/csrc
    run pipe $ROOT $ROOT/.ab/pipe/csrc
    run grid $ROOT/.ab/grid:$ROOT $ROOT/csrc
    run pipegrid $ROOT/.ab/grid:$ROOT $ROOT/.ab/pipe/csrc
done
