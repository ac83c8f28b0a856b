"""Seeded load traces through vLLM 0.34.0's own ``Scheduler``, ``KVCacheManager`` and
``BlockPool`` on the CPU (no model: every scheduled request samples one fixed token), with or
without elastic KV. For the elastic tests and ``benchmarks/bench_elastic.py``; needs vLLM.

Traces (block size 64, DeepSeek-V3.2 cache specs):

- ``"burst"``: 120 requests at step 0 (prompts 200-1500 tokens, outputs 50-400), steps 0-149;
  then about 0.5 arrivals per step (prompts 100-800, outputs 50-300) to step 749 (steady); no
  arrivals to step 999 (drain); then idle to step 1099. 30 % of the prompts start with one
  shared 512-token prefix.
- ``"square"``: a square wave of blocks in use, 10 periods of 100 steps, then idle: 100
  requests of 15 blocks (about 1500 blocks) at the start of each high half, 13 (about 200) at
  the start of each low half, each ending within its half (40 output tokens; 16384 tokens per
  step, so the prefills take 6 steps).

- ``"ranks"``: a short trace for the multi-rank tests (``max_num_batched_tokens`` and
  ``max_num_seqs`` as given): 16 requests at step 0 (prompts 200-800 tokens, outputs 60-160),
  steps 0-29; about 0.4 arrivals per step (prompts 60-500, outputs 4-32) to step 79; then no
  arrivals but right after each of the first two idle releases (the step after it): 1 short
  request and 5 of 300-600 tokens after the first, 2 (one with the shared prefix) after the
  second; to step 309. 30 % of the other prompts start with the shared 512-token prefix.

Time is simulated: every step takes ``step_seconds`` (0.03 s) and the pool's clock reads the
simulated time, so a run is exact and independent of the machine (``workloads`` models a
step's time from its tokens instead). The engine's idle hook is emulated: after
``IDLE_STEPS`` steps without a request, the pool's
``idle_release`` runs once (``on_idle`` receives its resize request). Async scheduling
(``async_depth=2``: vLLM's ``AsyncScheduler``) schedules step k+1 before step k's output is
processed, as ``EngineCore.step_with_batch_queue`` does. ``pipeline``: vLLM's
``pipeline_parallel_size`` in the scheduler's config (its ``max_concurrent_batches`` and so the
pool's settings follow it; the plugin refuses pipeline parallelism for its workers, the trace
builds the engine core's side past that refusal).

Local; each :class:`TraceRun` owns its scheduler.
"""

from __future__ import annotations

import contextlib
import copy
import random
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ... import _blockset as blockset
from ...integrations.vllm._elastic_settings import RESIZE, STAMP

__all__ = [
    "IDLE_STEPS", "PHASES", "CountingCache", "TraceRun", "TraceStep", "model_output", "schedule",
]  # fmt: skip

BS = 64
IDLE_STEPS = 20
STEP_SECONDS = 0.03  # simulated time per step of these traces (the pool's clock)
PHASES = {
    "burst": (("burst", 150), ("steady", 600), ("drain", 250), ("idle", 100)),
    "square": tuple((f"{h}{p}", 50) for p in range(10) for h in ("high", "low")) + (("idle", 60),),
    "ranks": (("burst", 30), ("steady", 50), ("drain", 230)),
}


@contextlib.contextmanager
def _pipeline_allowed() -> Iterator[None]:
    """The plugin's config check with pipeline stages let through (the engine core's side
    alone: its refusal is about the workers' collectives, which a trace does not run)."""
    from ...integrations.vllm import _elastic_engine

    check = _elastic_engine.check_elastic_config

    def without_stages(cfg: Any) -> None:
        pc = cfg.parallel_config
        stages, pc.pipeline_parallel_size = pc.pipeline_parallel_size, 1
        try:
            check(cfg)
        finally:
            pc.pipeline_parallel_size = stages

    _elastic_engine.check_elastic_config = without_stages
    try:
        yield
    finally:
        _elastic_engine.check_elastic_config = check


SAMPLING = "_vmmkv_trace_sampling"  # the requests of a step that sample a token


def schedule(scheduler: Any) -> Any:
    """vLLM's ``scheduler.schedule()``, its output marked with the requests that sample a token
    in that step: those vLLM's scheduler does not leave in a prefill chunk
    (``Request.is_prefill_chunk``, set as it schedules). vLLM's model runner discards the token
    of a partial prefill chunk; the mark must be taken here, before a later schedule (async
    scheduling, a batch queue) moves the request on."""
    so = scheduler.schedule()
    reqs = scheduler.requests
    setattr(so, SAMPLING, frozenset(
        r for r in so.num_scheduled_tokens if not reqs[r].is_prefill_chunk
    ))  # fmt: skip
    return so


def model_output(so: Any, stamp: Any = None) -> Any:
    """The output rank's ``ModelRunnerOutput`` for ``so``: one fixed sampled token per request
    that samples in the step (:func:`schedule` marks them: a partial prefill chunk samples
    none; an output not made by it, every request), with the worker's elastic stamp when
    given."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(so.num_scheduled_tokens)
    sampling = getattr(so, SAMPLING, None)
    out = ModelRunnerOutput(
        req_ids=ids,
        sampled_token_ids=[[7] if sampling is None or r in sampling else [] for r in ids],
    )  # fmt: skip
    if stamp is not None:
        setattr(out, STAMP, stamp)
    return out


class CountingCache:
    """The workers' committed blocks without memory, for traces of the scheduler alone: what
    ``ElasticWorker`` needs of a ``VllmKVCache`` (every resize succeeds), prefixes and block
    sets with holes alike."""

    rank = 0

    def __init__(self, committed: int, num_blocks: int = 1 << 40) -> None:
        self.num_blocks = num_blocks
        self.committed_block_set = blockset.prefix(committed)

    @property
    def committed_blocks(self) -> int:
        return blockset.count(self.committed_block_set)

    def grow(self, n: int) -> int:
        self.committed_block_set = blockset.prefix(n)
        return n

    shrink = grow

    def set_committed_blocks(self, blocks: blockset.BlockSet) -> None:
        self.committed_block_set = blockset.block_set(blocks, self.num_blocks)

    def check_blocks(self, block_ids: list[int]) -> None:
        held = self.committed_block_set
        bad = [i for i in block_ids if not blockset.contains(held, i)]
        if bad:
            raise AssertionError(f"blocks {bad[:8]} are not committed ({held})")


def counting_worker(run: TraceRun) -> Callable[[Any], Any]:
    """An ``on_step`` for :meth:`TraceRun.run`: the plugin's worker step
    (``_elastic_worker.ElasticWorker``) over a :class:`CountingCache` starting at the floor."""
    from ...integrations.vllm._elastic_worker import ElasticWorker, step_block_ids

    cache, worker = CountingCache(run.el.s.floor, run.el.s.num_blocks), ElasticWorker()

    def on_step(so: Any) -> Any:
        worker.apply(cache, getattr(so, RESIZE))
        cache.check_blocks(step_block_ids(so))
        return worker.stamp(cache)

    run.on_idle_default = lambda resize: worker.apply(cache, resize)
    return on_step


@dataclass
class TraceStep:
    """One step of a trace, as the scheduler saw it after its output was processed."""

    step: int
    phase: str
    in_use: int  # blocks with a reference (the null block aside)
    cached_free: int  # free blocks holding a prefix-cache entry, committed
    committed: int  # the blocks the pool may hand out (all of them without elastic KV)
    scheduled: bool  # whether the scheduler ran this step
    highest: int = 0  # the highest block id in use (0: none, or not tracked without the pool)


@dataclass
class TraceRun:
    """A seeded trace through vLLM's scheduler. ``elastic``: install the elastic pool (through
    the plugin's patched ``Scheduler.__init__``; the caller installs the engine sites);
    ``order``: the elastic queue's order ("lowest" or vLLM's "lifo"). ``budget``: vLLM 0.34's
    extensible KV cache: ``num_blocks`` is the reserved capacity, and the scheduler is built,
    as ``EngineCore`` builds it, with the config vLLM's ``finalize_extensible_kv_cache``
    shrank to the budget the workers measured; the figures are then against the budget
    (:attr:`capacity`)."""

    trace: str = "burst"
    seed: int = 0
    num_blocks: int = 2048
    elastic: bool = True
    async_depth: int = 1
    pipeline: int = 1  # vLLM's pipeline_parallel_size: batches in flight without async
    world: int = 2
    layers: int = 2
    max_num_batched_tokens: int = 4096
    max_num_seqs: int = 128
    max_model_len: int = 4096
    step_seconds: float = STEP_SECONDS  # the simulated time one step takes
    steps: list[TraceStep] = field(default_factory=list)
    hit_tokens: int = 0
    preemptions: int = 0
    outputs: list[Any] = field(default_factory=list)
    idle_releases: list[int] = field(default_factory=list)  # steps of the idle releases
    budget: int | None = None

    @property
    def capacity(self) -> int:
        """The scheduler's block count: the budget under the extensible KV cache."""
        return self.num_blocks if self.budget is None else self.budget

    def build(self) -> Any:
        from vllm.config import set_current_vllm_config
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import (
            generate_scheduler_kv_cache_config,
            get_request_block_hasher,
            init_none_hash,
        )
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        from .configs import build_kv_cache_config

        cfg, kvc = build_kv_cache_config(
            "BLNHC", num_blocks=self.num_blocks, num_layers=self.layers, pcp=self.world
        )
        self.worker_kv_cache_config = kvc
        kvc = generate_scheduler_kv_cache_config([kvc])
        cfg.cache_config.num_gpu_blocks = kvc.num_blocks
        if self.budget is not None:  # EngineCore._initialize_kv_caches, extensible KV cache
            from vllm.v1.core.kv_cache_planning import finalize_extensible_kv_cache
            from vllm.v1.worker.worker_base import CompilationTimes

            cfg.cache_config.enable_extensible_kv_cache = True
            measured = [CompilationTimes(0.0, 0.0, num_kv_blocks=self.budget)] * self.world
            with set_current_vllm_config(cfg):
                finalize_extensible_kv_cache(cfg, [copy.copy(self.worker_kv_cache_config)],
                                             kvc, measured)  # fmt: skip
        cfg.cache_config.enable_prefix_caching = True
        for c in (cfg.model_config, cfg.scheduler_config):
            c.max_model_len = self.max_model_len
        cfg.scheduler_config.max_num_batched_tokens = (
            16384 if self.trace == "square" else self.max_num_batched_tokens
        )
        cfg.scheduler_config.max_num_seqs = self.max_num_seqs
        cfg.scheduler_config.async_scheduling = self.async_depth > 1
        cfg.parallel_config.pipeline_parallel_size = self.pipeline
        hf = get_hash_fn_by_name(cfg.cache_config.prefix_caching_hash_algo)
        init_none_hash(hf)
        self._hasher = get_request_block_hasher(BS, hf)
        cls = AsyncScheduler if self.async_depth > 1 else Scheduler
        if not self.elastic:  # the same config without the pool: PCP 1 in the scheduler's eyes
            cfg.parallel_config.prefill_context_parallel_size = 1
        with set_current_vllm_config(cfg), _pipeline_allowed():
            self.scheduler = cls(
                vllm_config=cfg, kv_cache_config=kvc,
                structured_output_manager=StructuredOutputManager(cfg), block_size=BS,
                log_stats=False,
            )  # fmt: skip
        self.vllm_config = cfg
        self.pool = self.scheduler.kv_cache_manager.block_pool
        self.el = getattr(self.scheduler, "_vmmkv_elastic", None)
        if self.elastic and self.el is None:
            raise RuntimeError("elastic trace: the engine sites are not installed")
        self.now = 0.0  # simulated seconds: the pool's clock
        if self.el is not None:
            self.el.clock = lambda: self.now
        self._rng = random.Random(self.seed)
        self._shared = [self._rng.randrange(500) for _ in range(512)]
        self._n = 0
        return self.scheduler

    # -- requests ---------------------------------------------------------------------------
    def _add(self, plen: int, out: int, shared: bool | None = None) -> str:
        rng = self._rng
        toks = [rng.randrange(500) for _ in range(plen)]
        if shared if shared is not None else rng.random() < 0.3:
            toks = self._shared + toks
        return self._submit(toks, out)

    def _submit(self, prompt: list[int], out: int) -> str:
        """Hand vLLM's scheduler a request of ``prompt`` that decodes ``out`` tokens; its id."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        rid = f"r{self._n}"
        self._n += 1
        self.scheduler.add_request(
            Request(
                request_id=rid,
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=out, ignore_eos=True),
                pooling_params=None,
                block_hasher=self._hasher,
            )  # fmt: skip
        )
        return rid

    def _arrivals(self, phase: str, k: int) -> None:
        rng = self._rng
        if self.trace == "ranks":
            self._ranks_arrivals(phase, k)
            return
        if self.trace == "burst":
            if phase == "burst" and k == 0:
                for _ in range(120):
                    self._add(rng.randrange(200, 1500), rng.randrange(50, 400))
            elif phase == "steady":
                p = rng.random()
                while p > 0.67:  # about 0.5 arrivals per step, geometric
                    self._add(rng.randrange(100, 800), rng.randrange(50, 300))
                    p = rng.random()
            return
        if k == 0:  # each half period's requests end within it (prefill + 40 decodes)
            for _ in range(100 if phase.startswith("high") else 13 if phase != "idle" else 0):
                self._add(15 * BS - 8, 40, shared=False)

    def _ranks_arrivals(self, phase: str, k: int) -> None:
        rng, released = self._rng, self.idle_releases
        if phase == "burst" and k == 0:
            for _ in range(16):
                self._add(rng.randrange(200, 800), rng.randrange(60, 160))
        elif phase == "steady":
            while rng.random() > 0.7:  # about 0.4 arrivals per step, geometric
                self._add(rng.randrange(60, 500), rng.randrange(4, 32))
        elif released and released[-1] == len(self.steps) - 1 and len(released) <= 2:
            if len(released) == 1:  # right after the first idle release
                self._add(100, 8, shared=False)
                for _ in range(5):
                    self._add(rng.randrange(300, 600), rng.randrange(8, 24), shared=False)
            else:
                self._add(200, 8, shared=True)
                self._add(rng.randrange(100, 300), 8, shared=False)

    # -- the loop ---------------------------------------------------------------------------
    def run(
        self,
        on_step: Callable[[Any], Any] | None = None,
        on_idle: Callable[[tuple[int, int]], None] | None = None,
    ) -> list[TraceStep]:
        """Run the trace. ``on_step(scheduler_output)`` (the workers' part) returns the stamp
        the output rank puts on its output, or None; ``on_idle(resize)`` gets the idle
        release's request. Returns the per-step records (also in ``self.steps``)."""

        s = self.build() if not hasattr(self, "scheduler") else self.scheduler
        if on_step is None and self.el is not None:
            on_step = counting_worker(self)
            on_idle = on_idle or self.on_idle_default
        inflight: deque[tuple[Any, Any]] = deque()
        idle = step = 0

        def process(so: Any, stamp: Any) -> None:
            s.update_from_output(so, model_output(so, stamp))

        for phase, length in PHASES[self.trace]:
            for k in range(length):
                self._arrivals(phase, k)
                busy = s.has_requests() or bool(inflight)
                idle = 0 if busy else idle + 1
                if idle == IDLE_STEPS and self.el is not None:
                    resize = self.el.idle_release()
                    if resize is not None:
                        self.idle_releases.append(step)
                        if on_idle is not None:
                            on_idle(resize)
                ran = s.has_requests()
                if ran:
                    so = schedule(s)
                    self.hit_tokens += sum(r.num_computed_tokens for r in so.scheduled_new_reqs)
                    self.preemptions += len(so.preempted_req_ids or ())
                    if self.el is not None:
                        self._check_committed(so)
                    inflight.append((so, on_step(so) if on_step is not None else None))
                while inflight and (len(inflight) >= self.async_depth or not ran):
                    process(*inflight.popleft())
                self.steps.append(self._record(step, phase, ran))
                step += 1
                self.now += self.step_seconds
        while inflight:
            process(*inflight.popleft())
        return self.steps

    def _check_committed(self, so: Any) -> None:
        from ...integrations.vllm._elastic_worker import step_block_ids

        el, ids = self.el, step_block_ids(so)
        if ids and max(ids) >= el.limit:
            raise AssertionError(
                f"step uses block {max(ids)} beyond the committed limit {el.limit}"
            )
        if el.holes:  # and none in a hole
            bad = [i for i in ids if blockset.contains(el.holes, i)]
            if bad:
                raise AssertionError(f"step uses blocks {bad[:8]} in the holes {el.holes}")
        target = blockset.as_set(getattr(so, RESIZE)[1])
        if not blockset.is_subset(blockset.difference(blockset.prefix(el.limit), el.holes), target):
            raise AssertionError(f"target {getattr(so, RESIZE)} below the committed blocks")

    def _record(self, step: int, phase: str, ran: bool) -> TraceStep:
        blocks = self.pool.blocks
        limit = self.el.limit if self.el is not None else self.capacity
        in_use = sum(1 for b in blocks if b.ref_cnt > 0 and not b.is_null)
        cached = sum(1 for b in blocks[:limit] if b.ref_cnt == 0 and b.block_hash is not None)
        highest = self.el.highest_in_use() if self.el is not None else 0
        committed = self.el.committed if self.el is not None else limit
        return TraceStep(step, phase, in_use, cached, committed, ran, highest)

    # -- summaries --------------------------------------------------------------------------
    def phase_means(self) -> dict[str, dict[str, float]]:
        """Per phase: mean blocks in use, cached-free, committed, the highest block in use + 1;
        committed at its end."""
        out: dict[str, dict[str, float]] = {}
        for phase, _ in PHASES[self.trace]:
            rows = [r for r in self.steps if r.phase == phase]
            n = len(rows)
            out[phase] = {
                "in_use": sum(r.in_use for r in rows) / n,
                "cached_free": sum(r.cached_free for r in rows) / n,
                "committed": sum(r.committed for r in rows) / n,
                "pinned": sum(r.highest + 1 for r in rows) / n,
                "end": rows[-1].committed,
            }
        return out
