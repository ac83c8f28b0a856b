#!/usr/bin/env bash
# Barrier liveness, lane misuse, timeout records and the publish stress with its mutants,
# in one device-machine call of about 6 minutes on one GPU. Usage, from the
# repository root:
#   OUT=/some/folder bash benchmarks/gpu_liveness.sh
# Logs go to $OUT (default ./liveness-out): pytest.log (everything), stress-*.json (each stress
# run), latency.log. The last lines printed are one summary line per check:
#   CHECK <name>: PASS|FAIL|SKIP  and  OUTCOME/STRESS lines (what each mutant run showed).
# Mutants (tests/mutants/*.patch) are applied by the tests to a temporary copy of csrc/
# (VMMKV_CSRC_DIR); the tree is never modified. On a 2-GPU machine the same command runs the
# stress one process per GPU as well.
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/liveness-out}
mkdir -p "$OUT"
export OUT
PY=${PYTHON:-python3}
start=$(date +%s)

# 1. The one-launch publish latency at T = 1 (graph-replayed, one rank, 100 launches a graph):
#    the abort poll is off the fast path (only every 1024 spins). Measured twice in one call: the
#    real kernels, and a test build without the lane checks (VMMKV_TEST_NO_LANE_CHECK: no busy
#    word, a plain epoch store), whose difference is what the lane-misuse checks cost.
cat > "$OUT/latency.py" <<'EOF'
import statistics, torch
from vmmkv.ops import DeviceBarrier, KVTarget, prepare, warm_up
dev = torch.device("cuda", 0); warm_up(dev)
e, nb, bs = 656, 64, 16
region = torch.zeros(nb * bs * e, dtype=torch.uint8, device=dev)
table = torch.tensor([region.data_ptr()], dtype=torch.int64, device=dev)
t = KVTarget("rows", table, 0, 0, nb, bs, bs * e, e, e,
             torch.tensor([region.numel()], device=dev), torch.zeros(1, dtype=torch.int32, device=dev), region)
sig = torch.zeros(4, dtype=torch.int32, device=dev)
bar = DeviceBarrier(torch.tensor([sig.data_ptr()], dtype=torch.int64, device=dev), None, 0, 1, 1, dev)
rows = torch.randint(1, 255, (1, e), dtype=torch.uint8, device=dev)
slots = torch.tensor([5], device=dev)
p = prepare((t,))
s = torch.cuda.Stream(dev)
with torch.cuda.stream(s):
    for _ in range(10): p.publish((rows,), slots, 0, bar, 0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for _ in range(100): p.publish((rows,), slots, 0, bar, 0)
torch.cuda.synchronize()
times = []
for _ in range(30):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(s):
        a.record(); g.replay(); b.record()
    b.synchronize(); times.append(a.elapsed_time(b) * 10.0)  # ms per 100 -> us per launch
assert bytes(region.view(-1, e)[5].cpu().tolist()) == bytes(rows[0].cpu().tolist())
print(f"LATENCY one-launch publish T=1 world=1 graph-replayed: median {statistics.median(times):.2f} us"
      f" (min {min(times):.2f}) per launch; epochs {bar.epochs.tolist()}")
EOF
: > "$OUT/latency.log"
for defines_round in 1; do
    for defines in "" "VMMKV_TEST_NO_LANE_CHECK"; do
        VMMKV_TEST_DEFINES="$defines" $PY "$OUT/latency.py" 2>&1 | tail -3 \
            | sed "s/^LATENCY/LATENCY [${defines:-real kernels}]/" >> "$OUT/latency.log"
    done
done

# 2. The GPU tests: liveness, misuse, records, the killed peer (test_faults), the opt-in trap and
#    the existing barrier tests, the stress and its mutants.
$PY -m pytest -p no:cacheprovider -m gpu -rA -q \
    tests/test_barrier_liveness_gpu.py \
    tests/test_barrier_stress_gpu.py \
    "tests/test_faults.py::test_a_peer_killed_during_a_replayed_step_stops_the_survivors_barrier_with_a_diagnostic" \
    > "$OUT/pytest.log" 2>&1
rc=$?
$PY -m pytest -p no:cacheprovider -m gpu -rA -q tests/test_kernels_gpu.py \
    -k "barrier or publish or trap or lanes or captured or two_ranks" >> "$OUT/pytest.log" 2>&1
rc2=$?
[ $rc -eq 0 ] && rc=$rc2
end=$(date +%s)

echo "==================== gpu_liveness summary ($((end - start)) s, pytest rc=$rc) ===================="
grep -h "LATENCY\|Error" "$OUT/latency.log" | head -8
grep -E "^((PASSED|FAILED|ERROR) tests/|SKIPPED \[)" "$OUT/pytest.log" \
    | sed -E 's/^PASSED (.*)/CHECK \1: PASS/; s/^FAILED ([^ ]*).*/CHECK \1: FAIL/; s/^ERROR ([^ ]*).*/CHECK \1: ERROR/; s/^SKIPPED (.*)/CHECK SKIP \1/'
grep -hE "^(STRESS|OUTCOME)" "$OUT/pytest.log" | sort -u
grep -E "^=+ .*(passed|failed|error).* =+$" "$OUT/pytest.log"
exit $rc
