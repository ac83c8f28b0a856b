"""Elastic KV in vLLM 0.34.0's own scheduler (CPU): committed memory, prefix hits and
preemptions on workload families at ``vllm serve``'s defaults, on the step-scale traces, and the
engine core's host cost per step.

Families (``vmmkv.integrations.vllm.workloads``: ramp, long-lived requests at a peak, Zipf over
a few long prefixes, a square wave, idle; simulated seconds, DeepSeek-V3.2 block bytes, 4096
blocks, ``max_num_batched_tokens`` 8192, ``max_num_seqs`` 1024, async scheduling, no elastic
knob set), each run three ways through vLLM's real ``Scheduler`` + ``BlockPool``: vLLM unchanged
(every block committed), elastic KV with vLLM's own free order ("lifo"), elastic KV as shipped.
Per run: committed of capacity (time-weighted mean, peak, per phase), committed over what it
must hold (in use + cached-free kept + watermark), prefix-hit tokens over vLLM's, preemptions,
drain time (last arrival to the last release), releases, grows, the shortest time from a
release to the next grow decision.

Traces (``vmmkv.integrations.vllm.trace``: burst / steady / drain / idle, and a square wave, in
0.03 s steps with the knobs below): per-phase means and every step's (in use, cached-free,
committed), and ``bench_elastic.png`` beside the JSON (matplotlib; otherwise one line says so).

Host cost: vLLM's scheduler with ``--running`` decoding requests (default 256, 20 ms of the
pool's clock a step); per step,
``schedule()`` + ``update_from_output()`` timed with and without elastic KV (defaults) in the
same process (medians after warm-up), and the time inside the elastic hooks alone.

The workers are the plugin's worker step over a block counter (``trace.counting_worker``):
this measures the engine core's decisions, not memory.

usage (a vLLM 0.34.0 venv): python benchmarks/bench_elastic.py [--seeds 0,1,2]
    [--families ramp,long,zipf,wave,idle] [--no-traces] [--out F]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import arguments, median, table, write_json  # noqa: E402

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


def families(names: list[str], seeds: list[int]) -> list[dict]:
    from vmmkv.integrations.vllm.workloads import FamilyRun, summary

    rows = []
    for family in names:
        for seed in seeds:
            got = {}
            for way, elastic, order in WAYS:
                with scoped_env({"VMMKV_ELASTIC_ORDER": order or "lowest"}):
                    run = FamilyRun(trace=family, seed=seed, elastic=elastic)
                    t0 = time.perf_counter()
                    run.run()
                    wall = time.perf_counter() - t0
                got[way] = {"way": way, **summary(run), "wall_s": wall}
            base = got["vllm"]
            for row in got.values():
                hits = base["hit_tokens"]
                row["hits_of_vllm"] = row["hit_tokens"] / hits if hits else None
                row["preemptions_over_vllm"] = row["preemptions"] - base["preemptions"]
                rows.append(row)
    return rows


def traces(seeds: list[int]) -> tuple[list[dict], dict]:
    from vmmkv.integrations.vllm.trace import TraceRun

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
    from vmmkv.integrations.vllm.trace import TraceRun, counting_worker, model_output

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
            so = s.schedule()
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


def plot(series: dict, path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install -e '.[plot]')"
    keys = sorted({k.rsplit("-", 1)[0].rsplit("-", 1)[0] for k in series})
    keys = [k for k in ("burst-0", "square-0") if k in keys] or keys[:2]
    fig, axes = plt.subplots(len(keys), 1, figsize=(10, 4 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys, strict=True):
        base = series[f"{key}-elastic"]
        ax.fill_between(range(len(base)), [u for u, _, _ in base], color="0.8", label="in use")
        ax.plot([u + c for u, c, _ in base], color="0.5", lw=0.8, label="in use + cached-free")
        for way, style in (("vllm", ":"), ("elastic-lifo", "--"), ("elastic", "-")):
            ax.plot([c for _, _, c in series[f"{key}-{way}"]], style, label=f"committed: {way}")
        ax.set_title(f"vLLM 0.34 scheduler, 2048 blocks, trace {key}")
        ax.set_xlabel("step")
        ax.set_ylabel("blocks")
        ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"plot: {path}"


def main() -> None:
    ap = arguments(__doc__, "bench_elastic")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--families", default="ramp,long,zipf,wave,idle")
    ap.add_argument("--no-traces", action="store_true", help="families and host cost only")
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    os.environ.update(ENV)
    from vmmkv.integrations.vllm import _patches

    _patches.install_engine()
    try:
        fam = families([f for f in args.families.split(",") if f], seeds)
        rows, series = ([], {}) if args.no_traces else traces(seeds)
        cost = host_cost(args.running, args.steps)
    finally:
        _patches.uninstall()
    cols = ["family", "seed", "way", "committed_mean", "committed_peak", "over_need"]
    print(table(fam, cols + ["hits_of_vllm", "preemptions", "drain_s", "releases", "grows",
                             "release_to_grow_min_s"]))  # fmt: skip
    for r in fam:
        if r["way"] == "elastic":
            print(r["family"], r["seed"], {k: round(v, 3) for k, v in r["phases"].items()})
    if rows:
        cols = ["trace", "seed", "way", "phase", "in_use", "cached_free", "committed"]
        print(table(rows, cols + ["of_capacity", "hit_tokens", "grows", "releases"]))
    print(table(cost, ["elastic", "running", "steps", "step_us", "hooks_us", "committed"]))
    write_json(
        args.out, "bench_elastic", fam, traces=rows, host_cost=cost, env=ENV, trace_knobs=KNOBS,
        series=series, command=" ".join(sys.argv),
    )  # fmt: skip
    if series:
        out = os.path.join(os.path.dirname(os.path.abspath(args.out)), "bench_elastic.png")
        print(plot(series, out))


if __name__ == "__main__":
    main()
