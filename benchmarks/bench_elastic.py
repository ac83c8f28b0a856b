"""Elastic KV in vLLM 0.34.0's own scheduler (CPU): committed memory, prefix hits and
preemptions on workload families at ``vllm serve``'s defaults, on the step-scale traces, and the
engine core's host cost per step.

Families (``vmmkv.testing.vllm.workloads``: ramp, long-lived requests at a peak, Zipf over
a few long prefixes, a square wave of one repeated period, idle; simulated seconds,
DeepSeek-V3.2 block bytes, 4096 blocks, ``max_num_batched_tokens`` 8192, ``max_num_seqs`` 1024,
no elastic knob set) in three scheduling modes (``workloads.MODES``: sync, async, a batch queue
of 2 without async scheduling), each run three ways through vLLM's real ``Scheduler`` +
``BlockPool``: vLLM unchanged (every block committed), elastic KV with vLLM's own free order
("lifo"), elastic KV as shipped. Per run: committed of capacity (time-weighted mean, peak, per
phase), committed over what it must hold (in use + cached-free kept + watermark), prefix-hit
tokens over vLLM's, preemptions, drain time (last arrival to the last release), releases,
grows, the shortest time from a release to the next grow decision, and the figures the targets
read (``TARGETS``: the worst case over modes and seeds, and which missed). Per family and way:
mean [min, max] over modes and seeds. ``bench_elastic.svg`` beside the JSON: committed of
capacity over time per family, the first seed, async scheduling (``svgplot``).

Traces (``vmmkv.testing.vllm.trace``: burst / steady / drain / idle, and a square wave, in
0.03 s steps with the knobs below): per-phase means, unless ``--no-traces``.

Host cost: vLLM's scheduler with ``--running`` decoding requests (default 256, 20 ms of the
pool's clock a step); per step,
``schedule()`` + ``update_from_output()`` timed with and without elastic KV (defaults) in the
same process (medians after warm-up), and the time inside the elastic hooks alone.

The workers are the plugin's worker step over a block counter (``trace.counting_worker``):
this measures the engine core's decisions, not memory.

usage (a vLLM 0.34.0 venv): python benchmarks/bench_elastic.py [--seeds 0,1,2]
    [--families ramp,long,zipf,wave,idle] [--modes sync,async,bq2] [--no-traces] [--out F]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import arguments, median, percentile, table, write_json  # noqa: E402

ENV = {"VLLM_USE_VMMKV": "1", "VLLM_VMMKV_ELASTIC": "1"}
# the step-scale traces' knobs (2048 blocks of 2 layers, 100,864 B per block): 15 blocks per
# chunk; a calm time of 10 of their 0.03 s steps
KNOBS = {
    "VMMKV_CHUNK_MIB": "1.5",
    "VMMKV_ELASTIC_WATERMARK_BLOCKS": "160",
    "VMMKV_ELASTIC_FLOOR_BLOCKS": "64",
    "VMMKV_ELASTIC_CACHED_BLOCKS": "256",
    "VMMKV_ELASTIC_CALM_S": "0.3",
    "VMMKV_ELASTIC_WINDOW_S": "1.5",
}
WAYS = (("vllm", False, None), ("elastic-lifo", True, "lifo"), ("elastic", True, "lowest"))


class scoped_env:
    """The environment with ``values`` set for a block, restored after."""

    def __init__(self, values: dict) -> None:
        self.values, self.saved = values, {}

    def __enter__(self) -> None:
        self.saved = {k: os.environ.get(k) for k in self.values}
        os.environ.update(self.values)

    def __exit__(self, *exc) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _series(run, step: float = 0.25) -> list[tuple[float, float, float]]:
    """(t, committed, in use) of capacity, sampled every ``step`` simulated seconds."""
    rows, cap, out = run.rows, run.num_blocks, []
    end, j = rows[-1].t + rows[-1].dt, 0
    for k in range(int(end / step) + 1):
        t = k * step
        while j + 1 < len(rows) and rows[j + 1].t <= t:
            j += 1
        out.append((t, rows[j].committed / cap, rows[j].in_use / cap))
    return out


def _checks(run, got: dict) -> dict:
    """The figures the targets read, beyond ``summary``'s."""
    from vmmkv.testing.vllm.workloads import WAVE_PERIOD_S, wave_mismatches

    out = {}
    rows, cap = run.rows, run.num_blocks
    went = run.went_idle[-1] if run.went_idle else 0.0  # the engine's last idle start
    at_floor = [r.t for r in rows if r.t >= went and r.committed == run.el.s.floor]
    # (to the µs: the idle hook fires at went + idle_s, which float sums round either way)
    out["floor_after_s"] = round(at_floor[0] - went, 6) if at_floor else float("inf")
    if run.trace == "long":
        fell = dict(run.phase_ends)["peak"]
        light = [r.committed for r in rows if r.phase == "light" and r.t >= fell + 10.0]
        out["light_max"] = max(light) / cap
    if run.trace == "ramp":
        out["drain_mean"] = got["phases"].get("drain", 0.0)
    if run.trace == "wave":
        releases = [t for t, k, _ in run.events if k == "release"]
        half = WAVE_PERIOD_S / 2
        out["low_releases_max"] = max(
            sum(WAVE_PERIOD_S * p + half <= t < WAVE_PERIOD_S * (p + 1) for t in releases)
            for p in range(4)
        )
        out["wave_mismatches"] = wave_mismatches(run)
        out["periodic"] = not out["wave_mismatches"]
        out["periodic_from_third"] = not wave_mismatches(run, first=2)  # reported, no target
    return out


def families(names: list[str], seeds: list[int], modes: list[str]) -> tuple[list[dict], dict]:
    from vmmkv.testing.vllm.workloads import FamilyRun, summary

    rows, series = [], {}
    for family in names:
        for mode in modes:
            for seed in seeds:
                got = {}
                for way, elastic, order in WAYS:
                    with scoped_env({"VMMKV_ELASTIC_ORDER": order or "lowest"}):
                        run = FamilyRun(trace=family, seed=seed, mode=mode, elastic=elastic)
                        t0 = time.perf_counter()
                        run.run()
                        wall = time.perf_counter() - t0
                    row = {"way": way, "mode": mode, **summary(run), "wall_s": wall}
                    if elastic:
                        row.update(_checks(run, row), lead_steps=run.el.s.lead_steps)
                    got[way] = row
                    if seed == seeds[0]:
                        series[f"{family}-{mode}-{way}"] = _series(run)
                base = got["vllm"]
                for row in got.values():
                    hits = base["hit_tokens"]
                    row["hits_of_vllm"] = row["hit_tokens"] / hits if hits else None
                    row["preemptions_over_vllm"] = row["preemptions"] - base["preemptions"]
                    rows.append(row)
                print(family, mode, seed, f"{sum(r['wall_s'] for r in got.values()):.0f} s",
                      flush=True)  # fmt: skip
    return rows, series


# (family or "*", figure, "<=" or ">=", bound): the targets elastic KV is held to at vllm
# serve's defaults, every mode and seed
TARGETS = (
    ("*", "hits_of_vllm", ">=", 0.98),
    ("*", "preemptions_over_vllm", "<=", 1),
    ("long", "light_max", "<=", 0.5),
    ("ramp", "drain_mean", "<=", 0.5),
    ("ramp", "committed_mean", "<=", 0.6),
    ("idle", "floor_after_s", "<=", 5.0),
    ("wave", "low_releases_max", "<=", 1),
    ("wave", "release_to_grow_min_s", ">=", 5.0),
    ("wave", "periodic", ">=", True),
)


def targets(rows: list[dict], way: str = "elastic") -> list[dict]:
    """Per target: the worst case over modes and seeds, where, and whether every one met it."""
    out = []
    for family, key, op, bound in TARGETS:
        got = [r for r in rows if r["way"] == way and family in ("*", r["family"])]
        got = [r for r in got if r.get(key) is not None]
        for fam in sorted({r["family"] for r in got}) if family == "*" else [family]:
            mine = [r for r in got if r["family"] == fam]
            if not mine:
                continue
            worst = (max if op == "<=" else min)(mine, key=lambda r: r[key])
            bad = [f"{r['mode']}/{r['seed']}" for r in mine
                   if not (r[key] <= bound if op == "<=" else r[key] >= bound)]  # fmt: skip
            out.append({
                "family": fam, "figure": key, "target": f"{op} {bound}", "worst": worst[key],
                "at": f"{worst['mode']}/{worst['seed']}", "missed": ",".join(bad) or "-",
            })  # fmt: skip
    return out


def per_family(rows: list[dict]) -> list[dict]:
    """Per family and way: mean [min, max] over modes and seeds of the main figures."""
    out = []
    keys = ("committed_mean", "committed_peak", "over_need", "hits_of_vllm", "preemptions",
            "drain_s", "releases", "grows")  # fmt: skip
    for fam in dict.fromkeys(r["family"] for r in rows):
        for way, *_ in WAYS:
            mine = [r for r in rows if r["family"] == fam and r["way"] == way]
            row = {"family": fam, "way": way, "runs": len(mine)}
            for k in keys:
                v = [r[k] for r in mine if r.get(k) is not None]
                if v:
                    row[k] = f"{sum(v) / len(v):.3g} [{min(v):.3g}, {max(v):.3g}]"
            out.append(row)
    return out


def traces(seeds: list[int]) -> tuple[list[dict], dict]:
    from vmmkv.testing.vllm.trace import TraceRun

    rows, series = [], {}
    for trace, trace_seeds in (("burst", seeds), ("square", seeds[:1])):
        for seed in trace_seeds:
            for way, elastic, order in WAYS:
                with scoped_env({**KNOBS, "VMMKV_ELASTIC_ORDER": order or "lowest"}):
                    run = TraceRun(trace=trace, seed=seed, elastic=elastic)
                    t0 = time.perf_counter()
                    run.run()
                    wall = time.perf_counter() - t0
                counts = run.el.counts if run.el is not None else {}
                for phase, m in run.phase_means().items():
                    rows.append(
                        {
                            "trace": trace, "seed": seed, "way": way, "phase": phase,
                            "in_use": m["in_use"], "cached_free": m["cached_free"],
                            "committed": m["committed"], "end": m["end"],
                            "of_capacity": m["committed"] / run.num_blocks,
                            "hit_tokens": run.hit_tokens, "preemptions": run.preemptions,
                            "grows": counts.get("grows", 0), "releases": counts.get("releases", 0),
                            "wall_s": wall,
                        }
                    )  # fmt: skip
                series[f"{trace}-{seed}-{way}"] = [
                    (s.in_use, s.cached_free, s.committed) for s in run.steps
                ]
    return rows, series


def host_cost(running: int, steps: int) -> list[dict]:
    from vmmkv.testing.vllm.trace import TraceRun, counting_worker, model_output, schedule

    rows = []
    for elastic in (False, True):
        run = TraceRun(
            num_blocks=16384, elastic=elastic, max_num_seqs=running,
            max_num_batched_tokens=max(8192, running),
        )  # fmt: skip
        s = run.build()
        worker = counting_worker(run) if elastic else (lambda so: None)
        hooks = []
        if elastic:  # time the hooks alone
            el = run.el
            for name in ("before_schedule", "after_schedule", "on_output"):
                fn = getattr(el, name)

                def timed(*a, _fn=fn, _hooks=hooks, **k):
                    t = time.perf_counter_ns()
                    try:
                        return _fn(*a, **k)
                    finally:
                        _hooks[-1] += time.perf_counter_ns() - t

                setattr(el, name, timed)
        for _ in range(running):
            run._add(512 - 8, 100_000, shared=False)
        per_step = []
        for _ in range(steps):
            hooks.append(0)
            t0 = time.perf_counter_ns()
            so = schedule(s)
            stamp = worker(so)
            s.update_from_output(so, model_output(so, stamp))
            per_step.append(time.perf_counter_ns() - t0)
            run.now += 0.02  # the pool's clock: a decode step of 20 ms
        decode = per_step[steps // 4 :]  # after the prefills and warm-up
        assert len(s.running) == running, f"{len(s.running)} running, wanted {running}"
        rows.append(
            {
                "elastic": elastic, "running": running, "steps": len(decode),
                "step_us": median(decode) / 1e3,
                "hooks_us": median(hooks[steps // 4 :]) / 1e3 if elastic else 0.0,
                "committed": run.el.limit if elastic else run.num_blocks,
            }
        )  # fmt: skip
    return rows


def scan_cost(num_blocks: int = 4096, steps: int = 1500) -> list[dict]:
    """The pool's step (``before_schedule``) while a release is due and the hole scan finds
    nothing: vLLM's ``BlockPool`` of ``num_blocks`` committed to the top, one block in use in
    every chunk (the worst case: every chunk is read, none is free), 20 ms steps on the pool's
    clock. Side by side: the scan bounded to ``SCAN_BLOCKS`` a step, and the whole pool in one
    step (``SCAN_BLOCKS`` unbounded, the scan before it was bounded)."""
    from vmmkv.integrations.vllm import _elastic_holes
    from vmmkv.integrations.vllm._elastic_settings import STAMP
    from vmmkv.testing.vllm.trace import TraceRun

    rows, bounded = [], _elastic_holes.SCAN_BLOCKS
    for per_step in (bounded, 1 << 30):
        _elastic_holes.SCAN_BLOCKS = per_step
        try:
            run = TraceRun(num_blocks=num_blocks, elastic=True, max_num_seqs=256, layers=61)
            run.build()
            el, pool = run.el, run.pool
            live = []
            while el.committed < num_blocks:  # every grow confirmed, every block taken
                live += pool.get_new_blocks(pool.get_num_free_blocks())
                el.before_schedule()
                if el.pending is not None:
                    el.on_output(type("Out", (), {STAMP: (el.seq, el.target, None)})())
            live += pool.get_new_blocks(pool.get_num_free_blocks())
            keep, k = set(), 0
            while True:  # one block in use in every chunk: its last
                lo, hi = el._chunk_blocks(k)
                if lo >= hi or hi > num_blocks:
                    break
                keep.add(hi - 1)
                k += 1
            pool.free_blocks([b for b in live if b.block_id not in keep])
            times = []
            for _ in range(steps):
                run.now += 0.02
                t = time.perf_counter_ns()
                el.before_schedule()
                times.append(time.perf_counter_ns() - t)
            late = times[int(el.s.calm_seconds / 0.02) + 50 :]  # after the calm time
            assert el.counts["releases"] == 0 and el.committed == num_blocks, el.counts
            rows.append({
                "scan_blocks_per_step": per_step if per_step == bounded else "all",
                "blocks": num_blocks, "chunks": k, "steps": len(late),
                "median_us": median(late) / 1e3, "p99_us": percentile(late, 99) / 1e3,
                "max_us": max(late) / 1e3,
                "over_50us": sum(x > 50_000 for x in late),
            })  # fmt: skip
        finally:
            _elastic_holes.SCAN_BLOCKS = bounded
    return rows


def plot(series: dict, path: str, mode: str = "async") -> str:
    """Committed of capacity over simulated time, a panel per family (the first seed)."""
    from svgplot import panels

    fams = list(dict.fromkeys(k.split("-")[0] for k in series))
    plots = []
    for fam in fams:
        el = series.get(f"{fam}-{mode}-elastic")
        if el is None:
            continue
        lines = [("in use (elastic)", "#bbb", "", [(t, u) for t, _, u in el])]
        for way, colour, dash in (("vllm", "#444", "2,3"), ("elastic-lifo", "#d62", "6,3"),
                                  ("elastic", "#16c", "")):  # fmt: skip
            pts = series[f"{fam}-{mode}-{way}"]
            lines.append((f"committed: {way}", colour, dash, [(t, c) for t, c, _ in pts]))
        plots.append((f"{fam} ({mode} scheduling, seed 0): committed of 4096 blocks", lines))
    panels(path, plots, x_label="simulated seconds", y_label="of capacity")
    return f"plot: {path}"


def main() -> None:
    ap = arguments(__doc__, "bench_elastic")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--families", default="ramp,long,zipf,wave,idle")
    ap.add_argument("--modes", default="sync,async,bq2")
    ap.add_argument("--no-traces", action="store_true", help="families and host cost only")
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    os.environ.update(ENV)
    from vmmkv.integrations.vllm import _install

    _install.install_engine()
    try:
        fam, series = families([f for f in args.families.split(",") if f], seeds, modes)
        rows, _ = ([], {}) if args.no_traces else traces(seeds)
        cost = host_cost(args.running, args.steps)
        scan = scan_cost()
    finally:
        _install.uninstall()
    cols = ["family", "mode", "seed", "way", "committed_mean", "committed_peak", "over_need"]
    print(table(fam, cols + ["hits_of_vllm", "preemptions", "drain_s", "releases", "grows",
                             "release_to_grow_min_s", "floor_after_s"]))  # fmt: skip
    for r in fam:
        if r["way"] == "elastic":
            extra = {k: r[k] for k in ("light_max", "drain_mean", "low_releases_max", "periodic",
                                       "periodic_from_third", "wave_mismatches")
                     if k in r}  # fmt: skip
            print(r["family"], r["mode"], r["seed"],
                  {k: round(v, 3) for k, v in r["phases"].items()}, extra)  # fmt: skip
    summ, goals = per_family(fam), targets(fam)
    hooks = max(r["hooks_us"] for r in cost)
    goals.append({"family": "-", "figure": f"hooks_us at {args.running} running",
                  "target": "<= 50", "worst": hooks, "at": "sync",
                  "missed": "-" if hooks <= 50 else "sync"})  # fmt: skip
    print(table(summ, ["family", "way", "runs", "committed_mean", "committed_peak", "over_need",
                       "hits_of_vllm", "preemptions", "drain_s", "releases", "grows"]))  # fmt: skip
    print(table(goals, ["family", "figure", "target", "worst", "at", "missed"]))
    if rows:
        cols = ["trace", "seed", "way", "phase", "in_use", "cached_free", "committed"]
        print(table(rows, cols + ["of_capacity", "hit_tokens", "grows", "releases"]))
    print(table(cost, ["elastic", "running", "steps", "step_us", "hooks_us", "committed"]))
    print(table(scan, ["scan_blocks_per_step", "blocks", "chunks", "steps", "median_us",
                       "p99_us", "max_us", "over_50us"]))  # fmt: skip
    write_json(
        args.out, "bench_elastic", fam, per_family=summ, targets=goals, traces=rows,
        host_cost=cost, scan_cost=scan, env=ENV, trace_knobs=KNOBS, series=series, command=" ".join(sys.argv),
    )  # fmt: skip
    if series:
        out = os.path.join(os.path.dirname(os.path.abspath(args.out)), "bench_elastic.svg")
        print(plot(series, out))


if __name__ == "__main__":
    main()
