#!/usr/bin/env bash
# bench_gather.py --host-cost on the CPU (host backend), two trees alternated: $OLD (main's
# library code, db6cb67) and $NEW (branch exp/gather-host, 04ae9ca), $REPS runs each; one JSON
# per run in $OUT. Each tree runs its own copy of the benchmark (the stage calls follow its
# internals; the "total" stage is the same call in both).
set -euo pipefail
: "${OLD:?worktree of db6cb67}" "${NEW:?worktree of exp/gather-host}" "${OUT:?output folder}"
PY=${PY:-python3}
REPS=${REPS:-5}
mkdir -p "$OUT"
for i in $(seq 1 "$REPS"); do
    for tree in OLD NEW; do
        dir=${!tree}
        (cd "$dir" && "$PY" benchmarks/bench_gather.py --host-cost --backend host \
            --tokens 1 512 2048 --out "$OUT/host-cost-$tree-$i.json" > /dev/null)
    done
done
