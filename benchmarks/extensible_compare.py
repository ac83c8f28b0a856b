"""Start, sleep and wake of vLLM's extensible KV cache on vmmkv, side by side in one device call:
this tree (runs), a baseline tree (the chunk grid of an earlier commit, unpacked beside it) and
the floor (plain cuda-python doing only what a wake cannot avoid), at DeepSeek-V3.2 size.

Usage (the lead's one step besides the device call)::

    git archive d517260 --prefix=baseline-main/ vmmkv csrc 'benchmarks/*.py' pyproject.toml | tar -x
    bash benchmarks/gpu_session.sh extensible-compare      # on the GPU machine; $OUT comes back

What runs, in this order, each a subprocess with a time limit (a failure is recorded and the next
one runs):

1. per group size (``--ranks``, default 2 and 4; ranks share the GPUs): the floor
   (``floor_extensible_gpu.py``), this tree's ``bench_extensible_gpu.py`` and the baseline's own
   ``bench_extensible_gpu.py`` (``PYTHONPATH`` set to the baseline's folder: its code and its
   script, unchanged), LBNHC and BLNHC, all three at one size: per rank ~25 GiB (9000 blocks
   reserved, 8500 committed) with 2 ranks, and with 4 ranks ~25 GiB on a GPU of over 100 GiB
   (an H200), else ~17 GiB (6400 / 6000 blocks: an H100);
2. elastic mode's +256-block grow and release (``bench_elastic_gpu.py``, BLNHC, 2 ranks): this
   tree in its plugin geometry (granule chunks in runs cut at 64 MiB, ``--runs``) and the
   baseline in 64 MiB chunks.

``--backend host --small`` runs the same orchestration on the host backend at a tiny size,
without the floor (it needs CUDA): a check of this script, not a measurement. Writes every
JSON and log to ``--out`` (``$OUT``), ``extensible-compare.json`` with the summary,
and prints the summary table last: per (ranks, layout), extend, sleep, wake and the peak of open
fds at this tree and at the baseline, the floor's wake and sleep, and the ratios the issue reads
(this tree's extend and wake over the floor's wake, and over the baseline's BLNHC).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SIZES = {25: (9000, 8500), 17: (6400, 6000)}  # GiB per rank -> (blocks reserved, committed)
STEPS = ("extend", "sleep", "wake")


SMALL = ["--layers", "2", "--capacity", "64", "--budget", "40", "--warmup", "8"]


def gpu_memory_gib() -> float:
    """GPU 0's memory through NVML (no CUDA context in this process, which outlives the
    benchmarks), 0 without a GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total / (
                1 << 30
            )
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return 0.0


def gib_for(world: int, memory_gib: float) -> int:
    """Per-rank GiB: 25, or 17 with 4 ranks on a GPU of at most 100 GiB (4 x 25 do not fit)."""
    return 25 if world <= 2 or memory_gib > 100 else 17


def run(name: str, argv: list[str], out: str, timeout: float, pythonpath: str,
        extra_env: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """``argv`` under ``python`` with ``PYTHONPATH=pythonpath``, its output in ``out/name.log``;
    the record of what happened (seconds, exit code, the JSON it wrote or None)."""
    env = {**os.environ, "PYTHONPATH": pythonpath, **(extra_env or {})}
    log = os.path.join(out, f"{name}.log")
    t0 = time.monotonic()
    with open(log, "w") as f:
        print(f"== {name}: {' '.join(argv)} (PYTHONPATH={pythonpath})", file=f, flush=True)
        try:
            rc = subprocess.run([sys.executable, *argv], stdout=f, stderr=subprocess.STDOUT,
                                env=env, cwd=ROOT, timeout=timeout).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = "timeout"
    secs = round(time.monotonic() - t0, 1)
    path = os.path.join(out, f"{name}.json")
    data = None
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    print(f"{name}: rc={rc} in {secs} s", flush=True)
    return {"name": name, "rc": rc, "seconds": secs, "data": data, "log": log}


def steps_of(data: dict[str, Any] | None, world: int, layout: str) -> dict[str, dict[str, Any]]:
    """``bench_extensible_gpu`` rows of (world, layout) by step name."""
    if not data:
        return {}
    rows = [r for r in data["rows"] if r.get("pcp") == world and r.get("layout") == layout]
    return {r["step"]: r for r in rows if "step" in r}


def floor_of(data: dict[str, Any] | None, world: int, layout: str) -> dict[str, Any]:
    if not data:
        return {}
    return next((r for r in data["rows"] if r["pcp"] == world and r["layout"] == layout), {})


def summary(results: dict[str, Any], worlds: list[int]) -> list[dict[str, Any]]:
    rows = []
    for world in worlds:
        base_bl = steps_of(results.get(f"main-pcp{world}", {}).get("data"), world, "BL")
        for layout in ("LB", "BL"):
            ours = steps_of(results.get(f"runs-pcp{world}", {}).get("data"), world, layout)
            main = steps_of(results.get(f"main-pcp{world}", {}).get("data"), world, layout)
            floor = floor_of(results.get(f"floor-pcp{world}", {}).get("data"), world, layout)
            row: dict[str, Any] = {"pcp": world, "layout": layout}
            for step in STEPS:
                row[f"{step}_ms"] = ours.get(step, {}).get("ms")
                row[f"main_{step}_ms"] = main.get(step, {}).get("ms")
            row["fds"] = max((r.get("peak_fds", 0) for r in ours.values()), default=None)
            row["main_fds"] = max((r.get("peak_fds", 0) for r in main.values()), default=None)
            row["allocs"] = ours.get("wake", {}).get("chunks")
            row["main_allocs"] = main.get("wake", {}).get("chunks")
            row["floor_wake_ms"] = floor.get("wake_ms")
            row["floor_sleep_ms"] = floor.get("sleep_ms")
            for step in ("extend", "wake"):
                mine, fl = row[f"{step}_ms"], row["floor_wake_ms"]
                bl = base_bl.get(step, {}).get("ms")
                row[f"{step}/floor"] = round(mine / fl, 2) if mine and fl else None
                row[f"{step}/main_BL"] = round(mine / bl, 2) if mine and bl else None
            mine, fl = row["sleep_ms"], row["floor_sleep_ms"]
            row["sleep/floor"] = round(mine / fl, 2) if mine and fl else None
            row["read_ok"] = all(ours.get(s, {}).get("read_ok") for s in ("extend", "wake"))
            rows.append(row)
    return rows


def elastic_row(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for tree in ("runs", "main"):
        data = results.get(f"elastic-{tree}", {}).get("data")
        for r in (data or {}).get("rows", []):
            out.append({"tree": tree, **{k: r.get(k) for k in (
                "pcp", "layout", "chunk_MiB", "run_MiB", "grow_ms", "grow_max_ms", "release_ms",
                "floor_ratio", "grow_chunks", "release_chunks", "zero_ok", "blocks_ok", "error")}})  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "bench-out")))
    ap.add_argument("--baseline", default=os.path.join(ROOT, "baseline-main"),
                    help="the baseline tree (vmmkv/ and benchmarks/ of an earlier commit)")  # fmt: skip
    ap.add_argument("--baseline-commit", default="d517260")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--no-elastic", action="store_true")
    ap.add_argument("--backend", default="cuda", choices=("cuda", "host"))
    ap.add_argument("--small", action="store_true", help="a tiny size (a check, with host)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    sys.path.insert(0, HERE)
    from common import machine, table  # noqa: E402

    worlds = [int(w) for w in a.ranks.split(",")]
    memory = gpu_memory_gib()
    have_base = os.path.exists(os.path.join(a.baseline, "benchmarks", "bench_extensible_gpu.py"))
    if not have_base:
        print(f"no baseline at {a.baseline}: run `git archive {a.baseline_commit} "
              "--prefix=baseline-main/ vmmkv csrc 'benchmarks/*.py' pyproject.toml | tar -x` in "
              "the checkout first; this tree and the floor run without it", flush=True)  # fmt: skip
    base_env = {"GIT_COMMIT": a.baseline_commit}
    results: dict[str, Any] = {}
    for world in worlds:
        gib = gib_for(world, memory)
        capacity, budget = SIZES[gib]
        size = ["--ranks", str(world), "--capacity", str(capacity), "--budget", str(budget)]
        bench = ["--backend", a.backend, *size, *(SMALL if a.small else [])]
        limit = 240 if world > 2 else 150

        def out_of(name: str) -> list[str]:
            return ["--out", os.path.join(a.out, f"{name}.json")]

        if a.backend == "cuda":  # the floor is cuda-python only
            results[f"floor-pcp{world}"] = run(
                f"floor-pcp{world}", ["benchmarks/floor_extensible_gpu.py", *size,
                                      *out_of(f"floor-pcp{world}")], a.out, limit, ROOT)  # fmt: skip
        results[f"runs-pcp{world}"] = run(
            f"runs-pcp{world}", ["benchmarks/bench_extensible_gpu.py", *bench,
                                 *out_of(f"runs-pcp{world}")], a.out, limit, ROOT)  # fmt: skip
        if have_base:
            script = os.path.join(a.baseline, "benchmarks", "bench_extensible_gpu.py")
            results[f"main-pcp{world}"] = run(
                f"main-pcp{world}", [script, *bench, *out_of(f"main-pcp{world}")], a.out,
                2 * limit, a.baseline, base_env,
            )  # fmt: skip
    if not a.no_elastic:
        common = ["--ranks", "2", "--configs", "BL:64", "--backend", a.backend]
        if a.small:
            common += ["--layers", "2", "--max-blocks", "300", "--floor", "100", "--step", "20",
                       "--reps", "2"]  # fmt: skip
        results["elastic-runs"] = run(
            "elastic-runs", ["benchmarks/bench_elastic_gpu.py", *common, "--runs", "--out",
                             os.path.join(a.out, "elastic-runs.json")], a.out, 150, ROOT)  # fmt: skip
        if have_base:
            script = os.path.join(a.baseline, "benchmarks", "bench_elastic_gpu.py")
            results["elastic-main"] = run(
                "elastic-main", [script, *common, "--out", os.path.join(a.out, "elastic-main.json")],
                a.out, 150, a.baseline, base_env,
            )  # fmt: skip
    rows = summary(results, worlds)
    elastic = elastic_row(results)
    record = {"benchmark": "extensible_compare", "machine": machine(), "gpu_memory_GiB": memory,
              "baseline": a.baseline_commit if have_base else None,
              "runs": {k: {kk: v[kk] for kk in ("rc", "seconds", "log")} for k, v in results.items()},
              "rows": rows, "elastic": elastic}  # fmt: skip
    with open(os.path.join(a.out, "extensible-compare.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"\n{machine().get('gpu')}, {memory:.0f} GiB; ms: slowest rank; main = "
          f"{a.baseline_commit if have_base else 'absent'}; floor: plain cuda-python, runs")  # fmt: skip
    cols = ["pcp", "layout", "allocs", "extend_ms", "wake_ms", "sleep_ms", "fds", "main_allocs",
            "main_extend_ms", "main_wake_ms", "main_sleep_ms", "main_fds", "floor_wake_ms",
            "floor_sleep_ms", "extend/floor", "wake/floor", "sleep/floor", "extend/main_BL",
            "wake/main_BL", "read_ok"]  # fmt: skip
    print(table(rows, cols))
    if elastic:
        print()
        print(table(elastic, [c for c in elastic[0] if any(e.get(c) is not None for e in elastic)]))
    print(" ".join(f"{k}: rc={v['rc']} {v['seconds']} s" for k, v in results.items()), flush=True)


if __name__ == "__main__":
    main()
