#!/usr/bin/env bash
# One device-machine call. Logs and JSON go to $OUT (the folder whose files come back). Usage:
#   bash benchmarks/gpu_session.sh tests|tests-a|tests-b|bench|all|ops-tests|ops-bench|ops|bw|scale|elastic|extensible|extensible-compare|sparse
# - scale: DeepSeek-V3.2 caches at full size (`bench_scale.py`): 2 x 50, 4 x 25 and 8 x 12 GiB
#   per rank (ranks share the GPUs), LBNHC and BLNHC, at the machine's open-file limit and at
#   4096: start, sleep, wake, byte-exact stores; the chunk-budget rule and 12,800 chunks of
#   4 MiB at 4096 too; logged to $OUT/scale.log, JSON beside it.
# - elastic: elastic KV's worker-side grow/release latency (`bench_elastic_gpu.py`): BL 32/64 MiB
#   and LB 2 MiB chunks, 2 and 4 ranks sharing the GPUs; logged to $OUT/elastic.log, JSON beside it.
# - extensible: vLLM 0.34's extensible-cache call order on the plugin's buffer at DeepSeek-V3.2
#   size (`bench_extensible_gpu.py`: 9000 blocks reserved, ~27 GiB per rank, extend to 8500, a
#   CUDA graph captured before the extend and replayed after it and every wake), LB and BL, 2
#   and 4 ranks sharing the GPUs; logged to $OUT/extensible.log, JSON beside it.
# - extensible-compare: start, sleep and wake side by side (`extensible_compare.py`): this tree
#   (runs), a baseline tree unpacked as baseline-main/ (`git archive d517260
#   --prefix=baseline-main/ vmmkv csrc 'benchmarks/*.py' pyproject.toml | tar -x` before the call; it
#   travels as an untracked folder) and the floor (`floor_extensible_gpu.py`, plain cuda-python),
#   LBNHC and BLNHC, 2 ranks at ~25 GiB each and 4 at ~25 GiB (a GPU of over 100 GiB) or ~17 GiB,
#   then elastic mode's +256 grow and release at both trees; JSON and logs in $OUT, the summary
#   table last (about 5 minutes on an H100).
# - sparse: what the block layout costs a DSA sparse read (`bench_sparse_read.py`): a 40 GiB
#   DeepSeek-V3.2 cache, 128 queries x 61 layers x 2048 top-k rows (656 + 132 B), LBNHC and
#   BLNHC over torch.empty and a VirtualRegion in 2 and 64 MiB chunks, each checked against a
#   torch reference; logged to $OUT/sparse.log, JSON to $OUT/sparse-read.json.
# - tests: the GPU suite + CLI on the GPU; bench: every benchmark; all: both.
# - tests-a / tests-b: the suite in two device calls (the whole suite does not fit one
#   10-minute call with a machine start): a = every GPU test but the kernel tests, the
#   byte-identity proof and the soak, plus the CLI; b = those three files.
# - bw: the bandwidth and host-cost rows: the exhaustive division proof, the gather fallback's
#   host time by stage (`bench_gather.py --host-cost`, one process), then `bench_store.py
#   --pcp 2` with a row at each copy-ceiling size (T = 8192, 32768, 65536: 6.5, 25.8, 51.6 MB);
#   with 2 GPUs the gather fallback against its ideal with its host-time profile
#   (`bench_gather.py --profile`), on one GPU the 1/4/8-destination table; logged to $OUT/bw.log.
# - ops-tests / ops-bench / ops (both): the ops layer alone, everything also logged
#   to $OUT/ops.log. ops-tests: the ops GPU and CPU tests. ops-bench: the host-cost breakdown and
#   the PCP2 tables (eager host time 2 launches vs 1, graph time, barrier vs torch symmetric
#   memory, publish vs peer copy); on 2 GPUs (nvidia-h200-x2) one rank per GPU, on 1 GPU
#   (nvidia-h200) two processes share it and the 1/2/4/8-destination table is added.
# The device machine runs its own packages. If it lacks the test extras (hypothesis,
# pytest-timeout), unpack their wheels into .gpu-site/ here (ignored by git) and name .gpu-site
# in the call's carry list; the path below puts it on PYTHONPATH.
set -u
# NVLink multicast off for the whole session (the ranks the spawner starts get it anyway).
export PYTHONPATH=$PWD:$PWD/.gpu-site NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/bench-out}
mkdir -p "$OUT"
what=${1:-all}
LOG=/dev/null
case "$what" in ops*) LOG="$OUT/ops.log" ;; bw) LOG="$OUT/bw.log" ;; scale) LOG="$OUT/scale.log" ;; elastic) LOG="$OUT/elastic.log" ;; extensible) LOG="$OUT/extensible.log" ;; extensible-compare) LOG="$OUT/extensible-compare.log" ;; sparse) LOG="$OUT/sparse.log" ;; esac
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG"
SPLIT="tests/test_kernels_gpu.py tests/test_quant_exact_gpu.py tests/test_soak.py"
if [ "$what" = tests-b ]; then
    python3 -m pytest -q -m gpu -rs -p no:cacheprovider $SPLIT ${PYTEST_ARGS:-} 2>&1 \
        | tee "$OUT/gpu-tests-b.log" | tail -40
fi
if [ "$what" = tests-a ]; then
    python3 -m pytest -q -m gpu -rs -p no:cacheprovider ${SPLIT//tests\//--deselect tests/} \
        tests ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu-tests-a.log" | tail -40
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
    python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
fi
if [ "$what" = tests ] || [ "$what" = tests-a ] || [ "$what" = all ]; then
    {
        echo "== python -m vmmkv doctor"; python3 -m vmmkv doctor; echo "rc=$?"
        echo "== python -m vmmkv demo"; python3 -m vmmkv demo; echo "rc=$?"
        echo "== python examples/engine_allocator.py"; python3 examples/engine_allocator.py; echo "rc=$?"
    } > "$OUT/cli.log" 2>&1
    tail -30 "$OUT/cli.log"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    {
        python3 benchmarks/bench_store.py --out "$OUT/bench_store.json"
        python3 -m vmmkv bench --quick --out "$OUT"
        python3 benchmarks/bench_region.py --out "$OUT/bench_region.json"
        python3 benchmarks/bench_rendezvous.py --out "$OUT/bench_rendezvous.json"
    } 2>&1 | tee "$OUT/bench.log" | grep -v " done$"
fi
if [ "$what" = ops-tests ] || [ "$what" = ops-bench ] || [ "$what" = ops ]; then
    ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
    echo "== GPUs: $ngpu  torch: $(python3 -c 'import torch; print(torch.__version__)')" | tee -a "$LOG"
fi
if [ "$what" = ops-tests ] || [ "$what" = ops ]; then
    echo "== ops tests (GPU + CPU)" | tee -a "$LOG"
    timeout 1500 python3 -m pytest -q -rs -p no:cacheprovider tests/test_kernels_gpu.py \
        tests/test_compile_gpu.py tests/test_ops_cpu.py tests/test_nvrtc.py 2>&1 \
        | tee "$OUT/ops-tests.log" | tail -40 | tee -a "$LOG"
fi
if [ "$what" = ops-bench ] || [ "$what" = ops ]; then
    echo "== host cost per call (one process)" | tee -a "$LOG"
    timeout 300 python3 benchmarks/bench_store.py --host-cost --out "$OUT/host_cost.json" 2>&1 | tee -a "$LOG"
    echo "== PCP2 publish (2 ranks)" | tee -a "$LOG"
    timeout 900 python3 benchmarks/bench_store.py --pcp 2 --out "$OUT/pcp2.json" 2>&1 | tee -a "$LOG"
    if [ "$ngpu" -eq 1 ]; then
        echo "== one GPU: 1/2/4/8 destinations" | tee -a "$LOG"
        timeout 900 python3 benchmarks/bench_store.py --out "$OUT/bench_store.json" 2>&1 \
            | grep -v " done$" | tee -a "$LOG"
    fi
fi
if [ "$what" = scale ]; then
    S="python3 benchmarks/bench_scale.py"
    {
        $S --ranks 2,4,8 --gib 50,25,12 --chunks default --nofile 0,4096 --out "$OUT/scale-default.json"
        $S --ranks 2,4 --gib 50,25 --chunks budget --nofile 4096 --out "$OUT/scale-budget.json"
        $S --ranks 2 --gib 50 --layouts LBNHC --chunks 4 --nofile 4096,0 --out "$OUT/scale-4mib.json"
    } 2>&1 | tee -a "$LOG"
fi
if [ "$what" = elastic ]; then
    python3 benchmarks/bench_elastic_gpu.py --out "$OUT/elastic-gpu.json" 2>&1 | tee -a "$LOG"
fi
if [ "$what" = extensible ]; then
    python3 benchmarks/bench_extensible_gpu.py --out "$OUT/extensible-gpu.json" 2>&1 | tee -a "$LOG"
fi
if [ "$what" = extensible-compare ]; then
    timeout 570 python3 benchmarks/extensible_compare.py --out "$OUT" 2>&1 | tee -a "$LOG"
fi
if [ "$what" = sparse ]; then
    python3 benchmarks/bench_sparse_read.py --out "$OUT/sparse-read.json" 2>&1 | tee -a "$LOG"
fi
if [ "$what" = bw ]; then
    ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
    echo "== GPUs: $ngpu" | tee -a "$LOG"
    timeout 300 python3 -m pytest -q -rs -s -p no:cacheprovider tests/test_quant_exact_gpu.py 2>&1 \
        | tee -a "$LOG" | tail -8
    echo "== gather fallback: host time of one eager store by stage (one process)" | tee -a "$LOG"
    timeout 300 python3 benchmarks/bench_gather.py --host-cost --out "$OUT/gather_host_cost.json" \
        2>&1 | tee -a "$LOG"
    echo "== PCP2 publish and copy ceilings (2 ranks)" | tee -a "$LOG"
    timeout 900 python3 benchmarks/bench_store.py --pcp 2 --tokens 1,2048,8192,32768,65536 \
        --out "$OUT/pcp2_bw.json" 2>&1 | tee -a "$LOG"
    if [ "$ngpu" -ge 2 ]; then
        echo "== gather fallback vs its ideal, with the host-time profile (2 ranks, NCCL)" | tee -a "$LOG"
        timeout 900 python3 benchmarks/bench_gather.py --tokens 1 8 128 2048 8192 --profile \
            --out "$OUT/bench_gather.json" 2>&1 | tee -a "$LOG"
    fi
    if [ "$ngpu" -eq 1 ]; then
        echo "== one GPU: 1/4/8 destinations" | tee -a "$LOG"
        timeout 600 python3 benchmarks/bench_store.py --tokens 1,2048,16384,65536 --dests 1,4,8 \
            --out "$OUT/bench_store.json" 2>&1 | grep -v " done$" | tee -a "$LOG"
    fi
fi
