"""Seeded workload families through vLLM 0.34.0's own ``Scheduler`` at ``vllm serve``'s defaults,
in simulated seconds, with or without elastic KV: what committed memory, prefix hits and
preemptions a policy gives on load it was not tuned on. For the elastic tests and
``benchmarks/bench_elastic.py``; needs vLLM.

Setting (no elastic knob set): ``max_num_batched_tokens`` 8192, ``max_num_seqs`` 1024, prefix
caching on, block size 64 and DeepSeek-V3.2's per-block bytes (61 layers, 3,076,352 B: 21
blocks per 64 MiB chunk), ``CAPACITY`` blocks. The workers are the plugin's worker step over a
block counter (``trace.counting_worker``); the pool's settings are the plugin's for the mode
(its lead follows vLLM's ``max_concurrent_batches``).

Scheduling modes (``MODES``), each driven as ``EngineCore`` drives it: ``"sync"``, vLLM's
``Scheduler`` through ``step()`` (schedule, wait, process); ``"async"``, its ``AsyncScheduler``
(``vllm serve``'s default where the executor supports it) through ``step_with_batch_queue``
with a queue of 2; ``"bq2"``, the plain ``Scheduler`` through ``step_with_batch_queue`` with a
queue of 2 (2 pipeline stages without async scheduling). The loop is that method's: schedule
whenever the scheduler has requests, an empty batch included (it takes a queue slot); wait for
the oldest batch only when the queue is full or nothing more can be scheduled. Under "bq2" a
decoding request with a step in flight gets no tokens until that step's output is processed
(the plain scheduler's own rule), while a chunked prefill's next chunk may be scheduled.

Time: a batch's model time is ``STEP_BASE_S + STEP_TOKEN_S x`` its scheduled tokens (a model,
not a measurement: 8192 prefill tokens 0.13 s, 150 decodes 12 ms; an empty batch none), run
through the pipeline's stages in order, each stage taking its share (one stage unless "bq2");
scheduling takes no time, the engine's clock moves when it waits for a batch. The pool's clock
reads the simulated time. An idle engine jumps to the next arrival; the engine's idle hook runs
when it was idle ``idle_seconds`` (the pool's) before that. So a run is exact,
machine-independent and takes seconds of CPU for minutes of load.

Families (arrival phases; then "drain" until the idle release after the last arrival, "idle"):

- ``"ramp"``: Poisson arrivals at a rate rising 0 -> 16/s over 60 s ("up"), held 30 s ("peak"),
  falling to 0 over 60 s ("down"); lognormal prompts (median 1024 tokens, sigma 0.9, 16-8000)
  and outputs (median 192, sigma 0.8, 8-1500).
- ``"long"``: long-lived requests admitted at a peak, then light load: 12 requests (prompts
  256, outputs 6000 tokens: a minute) among Poisson 14/s "ramp"-like ones for 15 s ("peak"), then 1
  short request a second (prompts median 512, outputs 96) for 75 s ("light"). Tail release
  alone cannot follow it: the long requests keep blocks spread over the peak's range; the
  pool's holes free the whole chunks between them.
- ``"zipf"``: 8 shared prefixes of 1500-3000 tokens chosen with Zipf(1.1) popularity, unique
  suffixes (lognormal median 128) and outputs (median 96), Poisson 12/s for 120 s ("load").
- ``"wave"``: a square wave of one period repeated 4 times: Poisson 12/s for 20 s
  ("high<p>"), 1/s for 20 s ("low<p>"), prompts and outputs as "ramp", drawn once; every
  period repeats those arrival times and lengths with fresh tokens (so no prefix hit links the
  periods). Periodic load makes "the same behaviour every period" checkable
  (:func:`wave_mismatches`); the first period starts from the floor and may differ.
- ``"idle"``: 40 requests at t=0 ("burst", 10 s), then nothing for 60 s.

Local; each :class:`FamilyRun` owns its scheduler.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .trace import TraceRun, counting_worker, model_output, schedule

__all__ = [
    "CAPACITY",
    "FAMILIES",
    "MODES",
    "FamilyRun",
    "Row",
    "summary",
    "wave_periods",
    "wave_mismatches",
]

CAPACITY = 4096
STEP_BASE_S = 0.01
STEP_TOKEN_S = 1.5e-5
FAMILIES = ("ramp", "long", "zipf", "wave", "idle")
# scheduling mode -> (TraceRun.async_depth, TraceRun.pipeline): vLLM's Scheduler stepping one
# batch at a time; its AsyncScheduler with a batch queue of 2; its Scheduler with a batch queue
# of 2 (2 pipeline stages, no async scheduling)
MODES = {"sync": (1, 1), "async": (2, 1), "bq2": (1, 2)}
WAVE_PERIOD_S = 40.0
WAVE_PERIODS = 4


@dataclass
class Row:
    """One stretch of simulated time with one state: a step, or an idle gap."""

    t: float
    dt: float
    phase: str
    in_use: int
    cached_free: int  # -1: not tracked (vLLM unchanged)
    committed: int
    watermark: int


@dataclass
class FamilyRun(TraceRun):
    """A family (``trace``: one of ``FAMILIES``) through vLLM's scheduler at ``vllm serve``'s
    defaults. ``elastic``/``order`` as :class:`~.trace.TraceRun`."""

    trace: str = "ramp"
    num_blocks: int = CAPACITY
    mode: str = "async"
    layers: int = 61
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    max_model_len: int = 16384
    rows: list[Row] = field(default_factory=list)
    events: list[tuple[float, str, int]] = field(default_factory=list)  # (t, kind, blocks)
    # when the engine went idle (no request, no batch in flight): its idle hook counts from here
    went_idle: list[float] = field(default_factory=list)
    phase_ends: list[tuple[str, float]] = field(default_factory=list)
    last_arrival: float = 0.0
    now: float = 0.0

    # -- arrivals ---------------------------------------------------------------------------
    def _lognormal(self, median: float, sigma: float, lo: int, hi: int) -> int:
        return min(hi, max(lo, int(self._rng.lognormvariate(math.log(median), sigma))))

    def _poisson(self, t0: float, t1: float, rate, out: list) -> None:
        """Arrival times in [t0, t1) of a Poisson process of ``rate(t)`` (thinning)."""
        rng, peak = self._rng, max(rate(t0 + (t1 - t0) * i / 64) for i in range(65))
        t = t0
        while peak > 0:
            t += rng.expovariate(peak)
            if t >= t1:
                break
            if rng.random() * peak < rate(t):
                out.append(t)

    def _plan(self) -> list[tuple[float, list[int], int]]:
        """The family's arrivals: (time, prompt tokens, output tokens), by time."""
        rng, fam, times = self._rng, self.trace, []

        def toks(n: int) -> list[int]:
            return [rng.randrange(500) for _ in range(n)]

        def plain() -> tuple[list[int], int]:
            return toks(self._lognormal(1024, 0.9, 16, 8000)), self._lognormal(192, 0.8, 8, 1500)

        def short() -> tuple[list[int], int]:
            return toks(self._lognormal(512, 0.8, 16, 4000)), self._lognormal(96, 0.7, 8, 600)

        out: list[tuple[float, list[int], int]] = []
        if fam == "ramp":
            self.phase_ends = [("up", 60.0), ("peak", 90.0), ("down", 150.0)]
            self._poisson(0, 150, lambda t: 16 * min(t / 60, 1.0, max(0.0, (150 - t) / 60)), times)
            out = [(t, *plain()) for t in times]
        elif fam == "long":
            self.phase_ends = [("peak", 15.0), ("light", 90.0)]
            for i in range(12):
                out.append((15.0 * i / 12, toks(256), 6000))
            self._poisson(0, 15, lambda t: 14.0, times)
            out += [(t, *plain()) for t in times]
            times = []
            self._poisson(15, 90, lambda t: 1.0, times)
            out += [(t, *short()) for t in times]
        elif fam == "zipf":
            self.phase_ends = [("load", 120.0)]
            prefixes = [toks(rng.randrange(1500, 3001)) for _ in range(8)]
            weights = [1 / (k + 1) ** 1.1 for k in range(8)]
            self._poisson(0, 120, lambda t: 12.0, times)
            for t in times:
                (p,) = rng.choices(prefixes, weights)
                sfx = toks(self._lognormal(128, 0.8, 16, 1024))
                out.append((t, p + sfx, self._lognormal(96, 0.7, 8, 512)))
        elif fam == "wave":
            period = WAVE_PERIOD_S
            for p in range(WAVE_PERIODS):
                self.phase_ends += [(f"high{p}", period * (p + 0.5)), (f"low{p}", period * (p + 1))]
            self._poisson(0, period, lambda t: 12.0 if t < period / 2 else 1.0, times)
            shape = [(t, self._lognormal(1024, 0.9, 16, 8000), self._lognormal(192, 0.8, 8, 1500))
                     for t in times]  # fmt: skip
            out = [(period * p + t, toks(n), o) for p in range(WAVE_PERIODS) for t, n, o in shape]
        elif fam == "idle":
            self.phase_ends = [("burst", 10.0)]
            out = [(0.0, *plain()) for _ in range(40)]
        else:
            raise ValueError(f"unknown workload family {fam!r}; expected one of {FAMILIES}")
        out.sort(key=lambda a: a[0])
        self.last_arrival = out[-1][0] if out else 0.0
        return out

    # -- the loop ---------------------------------------------------------------------------
    def _phase(self) -> str:
        for name, end in self.phase_ends:
            if self.now < end:
                return name
        released = any(t > self.last_arrival and k == "idle" for t, k, _ in self.events)
        return "idle" if released else "drain"

    def _row(self, dt: float) -> None:
        el = self.el
        if el is None:
            in_use = self.num_blocks - 1 - self.pool.get_num_free_blocks()
            self.rows.append(Row(self.now, dt, self._phase(), in_use, -1, self.num_blocks, 0))
            return
        q = el.queue
        self.rows.append(
            Row(
                self.now,
                dt,
                self._phase(),
                el.committed - 1 - q.num_free_blocks,
                len(q.lru),
                el.committed,
                el.watermark,
            )  # fmt: skip
        )

    def build(self) -> Any:
        if self.mode not in MODES:
            raise ValueError(f"unknown scheduling mode {self.mode!r}; expected one of {MODES}")
        self.async_depth, self.pipeline = MODES[self.mode]
        return super().build()

    def _advance(self, t: float) -> None:
        if t > self.now:
            self._row(t - self.now)
            self.now = t

    def run(self, on_step=None, on_idle=None, idle_tail: float = 20.0) -> list[Row]:
        """Run the family; ``idle_tail`` seconds of idle after its last arrival phase and the
        last request (at least ``idle_seconds`` + 5 s for the idle release to show)."""
        s = self.build()
        plan = self._plan()
        if self.el is not None:
            on_step = on_step or counting_worker(self)
            on_idle = on_idle or self.on_idle_default
            idle_s = self.el.s.idle_seconds
        else:
            idle_s = math.inf
        depth, stages = self.vllm_config.max_concurrent_batches, self.pipeline
        free = [0.0] * stages  # when each pipeline stage is next free
        end_of_load = max(self.phase_ends[-1][1], self.last_arrival)
        inflight: deque[tuple[Any, Any, float]] = deque()  # (output, stamp, ready at)
        i, idle_since, idle_done = 0, 0.0, False
        while True:
            while i < len(plan) and plan[i][0] <= self.now:
                self._submit(plan[i][1], plan[i][2])
                i += 1
            if not (s.has_requests() or inflight):
                nxt = plan[i][0] if i < len(plan) else None
                stop = max(end_of_load, idle_since) + idle_tail
                until = nxt if nxt is not None else stop
                if not idle_done and idle_since + idle_s < until:  # the engine's idle hook
                    self._advance(idle_since + idle_s)
                    resize = self.el.idle_release()
                    idle_done = True
                    if resize is not None:
                        self.events.append((self.now, "idle", self.el.committed))
                        on_idle(resize)
                self._advance(until)
                if nxt is None:
                    break
                continue
            idle_done = False
            if s.has_requests():  # EngineCore.step_with_batch_queue (step() at depth 1)
                seq, releases = (self.el.seq, self.el.counts["releases"]) if self.el else (0, 0)
                so = schedule(s)
                if self.el is not None:
                    if self.el.counts["releases"] > releases:
                        self.events.append((self.now, "release", self.el.committed))
                    elif self.el.seq > seq and self.el.pending is not None:
                        self.events.append((self.now, "grow", self.el.pending[1]))
                    self._check_committed(so)
                self.hit_tokens += sum(r.num_computed_tokens for r in so.scheduled_new_reqs)
                self.preemptions += len(so.preempted_req_ids or ())
                tokens = so.total_num_scheduled_tokens
                d = STEP_BASE_S + STEP_TOKEN_S * tokens if tokens else 0.0
                t = self.now
                for k in range(stages):  # each stage runs 1/stages of the model, in order
                    t = free[k] = max(t, free[k]) + d / stages
                inflight.append((so, on_step(so) if on_step is not None else None, t))
                if len(inflight) < depth and (tokens > 0 or s.has_requests()):
                    continue  # the batch queue is not full: schedule again without waiting
            so0, stamp, ready = inflight.popleft()  # block on the oldest batch
            self._advance(ready)
            s.update_from_output(so0, model_output(so0, stamp))
            if not (s.has_requests() or inflight):
                idle_since = self.now
                self.went_idle.append(idle_since)
        return self.rows


def _mean(rows: list[Row], f) -> float:
    total = sum(r.dt for r in rows)
    return sum(f(r) * r.dt for r in rows) / total if total > 0 else 0.0


def summary(run: FamilyRun) -> dict[str, Any]:
    """Time-weighted figures of one run: committed of capacity (mean, peak, per phase),
    committed over what it must hold (in use + cached kept + watermark), prefix-hit tokens,
    preemptions, drain time (last arrival to the last release), releases and grows (and the
    shortest time from a release to the next grow decision)."""
    rows, cap = [r for r in run.rows if r.dt > 0], run.num_blocks
    out: dict[str, Any] = {
        "family": run.trace, "seed": run.seed, "seconds": rows[-1].t + rows[-1].dt if rows else 0,
        "committed_mean": _mean(rows, lambda r: r.committed) / cap,
        "committed_peak": max(r.committed for r in rows) / cap,
        "in_use_mean": _mean(rows, lambda r: r.in_use) / cap,
        "hit_tokens": run.hit_tokens, "preemptions": run.preemptions,
    }  # fmt: skip
    phases: dict[str, float] = {}
    for name in dict.fromkeys(r.phase for r in rows):
        phases[name] = _mean([r for r in rows if r.phase == name], lambda r: r.committed) / cap
    out["phases"] = phases
    if run.el is None:
        return out
    need = _mean(rows, lambda r: r.in_use + r.cached_free + r.watermark)
    out["over_need"] = _mean(rows, lambda r: r.committed) / need if need else 0.0
    ev = run.events
    releases = [t for t, k, _ in ev if k in ("release", "idle")]
    grows = [t for t, k, _ in ev if k == "grow"]
    gaps = [min((g - t for g in grows if g > t), default=math.inf) for t in releases]
    out.update(
        releases=run.el.counts["releases"], grows=len(grows),
        release_to_grow_min_s=min(gaps, default=math.inf),
        drain_s=max((t for t in releases if t > run.last_arrival), default=run.last_arrival)
        - run.last_arrival,
        dropped=run.el.counts["cached_dropped"] + run.el.queue.cached_taken,
        floor=run.el.s.floor / cap,
    )  # fmt: skip
    return out


def committed_at(run: FamilyRun, t: float) -> int:
    """Committed blocks at simulated time ``t`` (the last row starting at or before it)."""
    return max((r for r in run.rows if r.t <= t), key=lambda r: r.t).committed


def wave_periods(run: FamilyRun) -> list[dict[str, Any]]:
    """Per period of the "wave" family: its resize decisions in order, as (kind, seconds into
    the period), and committed blocks at the end of its high and its low half."""
    out = []
    for p in range(WAVE_PERIODS):
        t0 = WAVE_PERIOD_S * p
        ev = [(k, t - t0) for t, k, _ in run.events if t0 <= t < t0 + WAVE_PERIOD_S]
        ends = [t0 + WAVE_PERIOD_S / 2, t0 + WAVE_PERIOD_S]
        # the half's end, an instant before the next half's first arrival is scheduled
        out.append({"events": ev, "committed": [committed_at(run, t - 1e-9) for t in ends]})
    return out


def wave_mismatches(run: FamilyRun, tol_s: float = 1.0, first: int = 1) -> list[str]:
    """How the wave's periods from period ``first`` on (0-based: 1 is the second) differ from
    that one (empty: periodic). Periodic means: the same resize decisions in the same order
    (grow, release, idle release), each within ``tol_s`` of the reference period's time into
    the period, and committed blocks at the end of each half within one quantum of the
    reference's. The first period starts from the floor and an empty prefix cache, so it may
    differ."""
    per, quantum = wave_periods(run), run.el.s.quantum
    ref, bad = per[first], []
    for p, got in enumerate(per[first + 1 :], first + 1):
        kinds = [k for k, _ in got["events"]]
        if kinds != [k for k, _ in ref["events"]]:
            bad.append(f"period {p}: decisions {got['events']} != {ref['events']}")
        elif any(
            abs(a[1] - b[1]) > tol_s for a, b in zip(got["events"], ref["events"], strict=True)
        ):
            bad.append(f"period {p}: decision times {got['events']} != {ref['events']}")
        for half, a, b in zip(("high", "low"), got["committed"], ref["committed"], strict=True):
            if abs(a - b) > quantum:
                bad.append(f"period {p}: committed at the {half} half's end {a} != {b}")
    return bad
