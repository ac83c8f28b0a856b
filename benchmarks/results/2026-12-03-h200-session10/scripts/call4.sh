#!/usr/bin/env bash
# Session 10 device call 4 (nvidia-h200): the submitted tree. The GPU suite's part A
# (gpu_session.sh tests-a: all but the kernel, proof and soak files, plus the CLI), then the new
# block-size test against a mutant kernel set that shifts for every block size (.ab/mut/csrc):
# the non-power-of-two sizes must fail, 1 and 64 pass.
set -u
bash benchmarks/gpu_session.sh tests-a
echo "== mutant: shift for every block size"
PYTHONPATH=$PWD VMMKV_CSRC_DIR=$PWD/.ab/mut/csrc timeout 120 python3 -m pytest -q -p no:cacheprovider \
    tests/test_kernels_gpu.py -k any_block_size 2>&1 | tee $OUT/call4-mutant.log | grep -E "passed|failed|FAILED" | tail -14
