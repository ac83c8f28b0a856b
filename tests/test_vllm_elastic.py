"""Elastic KV's engine-core side through vLLM 0.34.0's own ``Scheduler``, ``KVCacheManager`` and
``BlockPool`` (CPU, no workers' memory): the plugin's engine sites are installed on vLLM's
classes, the pool comes from the patched ``Scheduler.__init__``, every ``SchedulerOutput`` goes
to the plugin's worker step (``ElasticWorker`` over a block counter, ``trace.counting_worker``),
whose stamp returns on the output as a worker's would. The traces are ``vmmkv.integrations.vllm.
trace``'s (2048 blocks, DeepSeek-V3.2 specs, 2 layers).

Checked, on three seeds: committed memory against blocks in use per phase (steady, drain, idle),
the same trace with vLLM's own free order (the order is what makes memory follow load), prefix
hits against unmodified vLLM, no step touching an uncommitted block (``TraceRun`` asserts it at
every step), the square wave (one release per period, no drift), a grow refused by the group,
released cached blocks losing their hash, vLLM's prefix-cache reset with parked blocks,
determinism, and async scheduling (vLLM's ``AsyncScheduler``, a batch queue of 2).
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from tests.helpers import vllm_marks

pytestmark = vllm_marks()

N = 2048
W = 160
KNOBS = {
    # as a deployment sets them: vLLM's plugin loader, in any process vLLM starts (its model
    # inspection too), refuses VLLM_VMMKV_ELASTIC=1 without the plugin on
    "VLLM_USE_VMMKV": "1",
    "VLLM_VMMKV_ELASTIC": "1",
    "VMMKV_CHUNK_MIB": "1.5",  # 15 blocks of 100,864 B per chunk
    "VMMKV_ELASTIC_WATERMARK_BLOCKS": str(W),
    "VMMKV_ELASTIC_FLOOR_BLOCKS": "64",
    "VMMKV_ELASTIC_CACHED_BLOCKS": "256",
    # the traces' time scale: 0.03 s steps, half periods of 1.5 s (``workloads`` has traces in
    # seconds at the defaults)
    "VMMKV_ELASTIC_CALM_S": "0.3",
    "VMMKV_ELASTIC_WINDOW_S": "1.5",
}


@pytest.fixture
def engine(monkeypatch):
    """The plugin's engine-core sites on vLLM's classes for one test, with the trace's knobs."""
    from vmmkv.integrations.vllm import _install

    for k, v in KNOBS.items():
        monkeypatch.setenv(k, v)
    _install.install_engine()
    try:
        yield monkeypatch
    finally:
        _install.uninstall()


def _run(trace="burst", seed=0, **kw):
    from vmmkv.testing.vllm.trace import TraceRun

    run = TraceRun(trace=trace, seed=seed, **{"num_blocks": N, **kw})
    run.run()
    return run


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_committed_memory_follows_load_and_vllms_own_order_does_not(engine, seed):
    plain = _run(seed=seed, elastic=False)
    run = _run(seed=seed)
    engine.setenv("VMMKV_ELASTIC_ORDER", "lifo")
    lifo = _run(seed=seed)
    engine.delenv("VMMKV_ELASTIC_ORDER")
    m, p, lf = run.phase_means(), plain.phase_means(), lifo.phase_means()
    assert p["steady"]["committed"] == N  # vLLM unchanged commits everything
    steady, drain = m["steady"], m["drain"]
    bound = steady["in_use"] + steady["cached_free"] + 2 * W
    # steady: a release keeps the calm time's largest rise of the need (this phase's swings
    # are ~200 blocks) and frees a watermark at least: up to 1.2 x the bound, 0.92 of capacity
    assert steady["committed"] <= 1.2 * bound, (steady, bound)
    assert steady["committed"] <= 0.92 * N, steady
    # drain: what the need (in use + cached kept + 2 x watermark) or the highest block in use
    # (a release takes the tail only) holds; seeds 0 and 2 <= 0.6 of capacity, seed 1 0.73: one
    # request of the steady phase keeps block 1434 through the drain (a hole would free it); a
    # release frees a watermark at least, so up to one more stays
    need = max(drain["pinned"], drain["in_use"] + drain["cached_free"] + 2 * W)
    assert drain["committed"] <= 1.1 * need + W + run.el.s.quantum, drain
    assert drain["committed"] <= (0.75 if seed == 1 else 0.6) * N, drain
    assert lf["drain"]["pinned"] >= 0.85 * N, lf["drain"]  # LIFO keeps the tail in use
    assert run.hit_tokens >= 0.95 * plain.hit_tokens > 0
    assert run.preemptions == plain.preemptions == 0
    floor = run.el.s.floor
    assert m["idle"]["end"] == floor and run.el.stats()["in_use"] == 0
    # the same trace gives the same committed sizes step by step
    again = _run(seed=seed)
    assert [s.committed for s in again.steps] == [s.committed for s in run.steps]


def test_under_vllms_extensible_cache_the_pool_is_the_measured_budget_and_keeps_its_figures(
    engine,
):
    """vLLM 0.34's extensible KV cache: the planner reserves more blocks than fit after
    capture; the engine core builds the scheduler with the config vLLM's
    ``finalize_extensible_kv_cache`` shrank to the measured budget. The pool's capacity and
    every setting derive from that budget, no step uses a block at or above it, and the
    figures against the budget are those of a pool of that size."""
    capacity = N + 512  # reserved; N fit after capture
    run = _run(num_blocks=capacity, budget=N)
    plain = _run(num_blocks=capacity, budget=N, elastic=False)
    assert run.scheduler.kv_cache_config.num_blocks == run.el.s.num_blocks == N
    assert run.pool.num_gpu_blocks == N and run.capacity == N
    assert max(s.committed for s in run.steps) <= N  # the limit never passes the budget
    # the same trace on a pool of N blocks planned directly, with holes off as they are under
    # the extensible cache (its recommit commits a prefix): the same decisions step by step,
    # so the figures test_committed_memory_follows_load_... checks hold against the budget
    assert not run.el.s.holes
    from vmmkv.testing.vllm.trace import TraceRun

    direct = TraceRun(trace="burst", seed=0, num_blocks=N)
    direct.build()
    assert direct.el.s.holes and run.el.s == dataclasses.replace(direct.el.s, holes=False)
    direct.el.s = run.el.s
    direct.run()
    assert [(s.committed, s.in_use) for s in run.steps] == [
        (s.committed, s.in_use) for s in direct.steps
    ]
    assert run.hit_tokens == direct.hit_tokens >= 0.98 * plain.hit_tokens > 0
    m = run.phase_means()
    assert m["steady"]["committed"] <= 0.92 * N, m["steady"]
    assert m["drain"]["committed"] <= 0.6 * N, m["drain"]
    assert m["idle"]["end"] == run.el.s.floor
    assert plain.phase_means()["steady"]["committed"] == N


def test_async_scheduling_follows_load_without_touching_uncommitted_blocks(engine):
    """vLLM's AsyncScheduler, step k+1 scheduled before step k's output (batch queue of 2):
    confirmations arrive a step later; ``TraceRun`` checks every step's blocks."""
    run = _run(async_depth=2)
    plain = _run(async_depth=2, elastic=False)
    m = run.phase_means()
    assert m["drain"]["committed"] <= 0.6 * N
    assert m["idle"]["end"] == run.el.s.floor
    assert run.hit_tokens >= 0.95 * plain.hit_tokens
    assert run.el.counts["grows"] > 0 and run.el.counts["releases"] > 0


def test_square_wave_releases_once_per_period_without_drift(engine):
    # a calm time of a third of the 3 s period (33 steps): releases come 2 calm times apart
    engine.setenv("VMMKV_ELASTIC_CALM_S", "1.0")
    run = _run(trace="square")
    per = []
    steps = run.steps
    for p in range(10):
        rows = [s for s in steps if s.phase in (f"high{p}", f"low{p}")]
        start = steps.index(rows[0])
        sizes = [steps[start - 1].committed if start else run.el.s.floor] + [
            s.committed for s in rows
        ]
        pairs = list(zip(sizes, sizes[1:], strict=False))
        per.append(
            (
                sum(b > a for a, b in pairs),
                sum(b < a for a, b in pairs),
                max(s.in_use for s in rows),
                min(sizes),
                max(sizes),
            )
        )
    assert all(releases <= 1 for _, releases, *_ in per), per
    # periods 2-10 alike (no drift): the same releases, peak and low size; the grows and the
    # high size within what the growth-rate term's sampling phase moves (a few percent)
    assert len({(r, peak, low) for _, r, peak, low, _ in per[1:]}) == 1, per
    highs, grows = [p[4] for p in per[1:]], [p[0] for p in per[1:]]
    assert max(highs) - min(highs) <= 0.05 * N and max(grows) - min(grows) <= 2, per
    # a real wave: high in use; the low size keeps the low half's own rise (its 13 requests
    # arrive at once) and 2 watermarks: 960 blocks
    assert per[1][2] >= 1400 and per[1][3] <= 0.5 * N


def test_a_refused_grow_keeps_every_size_and_the_next_grow_works(engine):
    """The worker refuses the 2nd grow (as vmmkv's resize does on every rank: an error, sizes
    unchanged); the scheduler keeps its limit, hands out nothing beyond it, and grows later."""
    from vmmkv.integrations.vllm._elastic_settings import RESIZE
    from vmmkv.integrations.vllm._elastic_worker import ElasticWorker, step_block_ids
    from vmmkv.testing.vllm.trace import CountingCache, TraceRun

    run = TraceRun(trace="burst", seed=0, num_blocks=N)
    run.build()
    cache, worker = CountingCache(run.el.s.floor), ElasticWorker()
    grows = []
    real_grow = cache.grow

    def grow(n):
        grows.append(n)
        if len(grows) == 2:
            raise RuntimeError("injected: the group refused the grow")
        return real_grow(n)

    cache.grow = grow
    refused_at = []

    def on_step(so):
        before = cache.committed_blocks
        worker.apply(cache, getattr(so, RESIZE))
        cache.check_blocks(step_block_ids(so))
        if worker.error is not None and not refused_at:
            refused_at.append((len(run.steps), before, run.el.limit))
            assert cache.committed_blocks == before
        return worker.stamp(cache)

    run.run(on_step=on_step, on_idle=lambda r: worker.apply(cache, r))
    assert run.el.counts["refused"] == 1 and "injected" in run.el.last_error
    step, before, limit = refused_at[0]
    assert before == limit  # the limit was not raised by the refused request
    assert run.el.counts["grows"] >= 2 and len(grows) >= 3  # later grows succeeded
    assert run.steps[step + 1].committed == limit  # unchanged right after the refusal
    assert run.preemptions == 0


def test_released_cached_blocks_lose_their_hash_and_reset_sees_parked_blocks(engine):
    run = _run()
    el, pool = run.el, run.pool
    assert el.counts["cached_dropped"] > 0
    parked = pool.blocks[el.limit :]
    assert parked and all(b.block_hash is None and b.ref_cnt == 0 for b in parked)
    hashed = {b.block_id for b in pool.blocks if b.block_hash is not None}
    assert not hashed & {b.block_id for b in parked}
    assert len(el.queue.lru) <= el.s.cached_blocks
    # vLLM's reset (sleep level >= 1, RL weight updates) counts every block outside the queue
    # as in use; parked ones are free
    assert run.scheduler.reset_prefix_cache()
    assert not any(b.block_hash is not None for b in pool.blocks)
    assert pool.get_usage() == 0.0 and el.queue.num_free_blocks == el.limit - 1


@pytest.mark.parametrize("running", [False, True], ids=["idle", "reset-running-requests"])
def test_after_reset_prefix_cache_every_free_block_counts_as_uncached_lowest_id_first(
    engine, running
):
    """vLLM's ``reset_prefix_cache`` (every sleep of level >= 1, RL weight syncs) drops every
    hash but leaves its free queue as it was: the pool then files no free block as cached
    (its "free" is every free committed block), hands them out lowest id first, and forgets
    which blocks prefix hits reused. Both forms: idle, and preempting running requests first."""
    from vmmkv.testing.vllm.trace import TraceRun, counting_worker, model_output, schedule

    engine.setenv("VMMKV_ELASTIC_CACHED_BLOCKS", "32")
    run = TraceRun(trace="ranks", seed=0, num_blocks=128, max_num_batched_tokens=256,
                   max_num_seqs=16)  # fmt: skip
    s = run.build()
    el, q, on_step = run.el, run.el.queue, counting_worker(run)

    def step():
        so = schedule(s)
        s.update_from_output(so, model_output(so, on_step(so)))
        run.now += 0.03

    for _ in range(6):  # shared prefixes: their full blocks stay cached, hits reuse them
        run._add(300, 4, shared=True)
    while s.has_requests():
        step()
    if running:
        for _ in range(3):
            run._add(300, 40, shared=True)
        for _ in range(4):
            step()
        assert s.running
    assert len(q.lru) > 0 and el.hit, (len(q.lru), el.hit)
    assert s.reset_prefix_cache(reset_running_requests=running) is True
    assert not any(b.block_hash is not None for b in run.pool.blocks)
    assert len(q.lru) == 0 and not el.hit
    assert q.num_uncached == q.num_free_blocks == el.stats()["uncached_free"]
    assert el.stats()["cached_free"] == 0
    free = sorted(b.block_id for b in q.get_all_free_blocks())
    assert [b.block_id for b in q.popleft_n(3)] == free[:3]


def test_what_elastic_mode_has_not_been_tested_with_is_refused_by_name(engine):
    """Refused before anything is built: in the engine core (the pool) and in the worker (the
    allocation: also a layer-major layout)."""
    from types import SimpleNamespace

    from vllm.v1.kv_cache_layout import KVCacheLayout

    from vmmkv.integrations.vllm._allocation import _elastic_chunk, _elastic_kwargs
    from vmmkv.integrations.vllm._elastic_settings import check_elastic_config
    from vmmkv.integrations.vllm._layout import UnsupportedKVCache
    from vmmkv.testing.vllm.configs import build_kv_cache_config

    cfg, kvc = build_kv_cache_config("BLNHC", num_blocks=256, num_layers=2, pcp=2)
    check_elastic_config(cfg)  # the plain PCP config passes
    cases = {
        "pipeline parallelism (2 stages)": ("parallel_config", "pipeline_parallel_size", 2),
        "data parallelism (2 ranks)": ("parallel_config", "data_parallel_size", 2),
        "speculative decoding": (None, "speculative_config", SimpleNamespace()),
        "KV cache events": (None, "kv_events_config", SimpleNamespace(enable_kv_cache_events=1)),
    }
    for words, (part, name, value) in cases.items():
        owner = getattr(cfg, part) if part else cfg
        old = getattr(owner, name, None)
        object.__setattr__(owner, name, value)
        try:
            with pytest.raises(UnsupportedKVCache, match=re.escape(f"tested with {words}")):
                check_elastic_config(cfg)
        finally:
            object.__setattr__(owner, name, old)
    with pytest.raises(UnsupportedKVCache, match="needs a block-major KV cache layout, got LBNHC"):
        _elastic_kwargs(cfg, kvc, KVCacheLayout.LBNHC)
    with pytest.raises(UnsupportedKVCache, match="needs a block-major KV cache layout, got LBNHC"):
        _elastic_chunk(cfg, KVCacheLayout.LBNHC)  # under vLLM's extensible KV cache
    assert _elastic_chunk(cfg, KVCacheLayout.BLNHC) == int(1.5 * (1 << 20))
    got = _elastic_kwargs(cfg, kvc, KVCacheLayout.BLNHC)
    assert got == {"initial_blocks": 75, "chunk_bytes": int(1.5 * (1 << 20))}  # 64 -> 5 chunks
    engine.delenv("VLLM_VMMKV_ELASTIC")
    assert _elastic_kwargs(cfg, kvc, KVCacheLayout.LBNHC) == {}
    assert _elastic_chunk(cfg, KVCacheLayout.LBNHC) is None


def test_register_refuses_elastic_without_the_plugin(engine):
    from vmmkv.integrations import vllm as integration

    engine.delenv("VLLM_USE_VMMKV", raising=False)
    with pytest.raises(ValueError, match="VLLM_VMMKV_ELASTIC=1 needs VLLM_USE_VMMKV=1"):
        integration.register()


def test_worker_outputs_carry_the_steps_stamp_through_copies_async_outputs_and_pickle(engine):
    """``stamp_output`` as the patched ``execute_model``/``sample_tokens`` apply it: vLLM's shared
    empty output is copied, never stamped itself; an async output yields the stamp of its step
    even when a later step resized first; the stamp survives pickling (vLLM's worker queue)."""
    import pickle

    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, AsyncModelRunnerOutput

    from vmmkv.integrations.vllm._elastic_settings import STAMP
    from vmmkv.integrations.vllm._elastic_worker import WORKER, stamp_output
    from vmmkv.testing.vllm.trace import CountingCache, model_output

    cache = CountingCache(64)
    WORKER.reset()
    try:
        WORKER.apply(cache, (1, 80))
        out = stamp_output(EMPTY_MODEL_RUNNER_OUTPUT, cache)
        assert out is not EMPTY_MODEL_RUNNER_OUTPUT and getattr(out, STAMP) == (1, 80, None)
        assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, STAMP)
        plain = model_output(type("SO", (), {"num_scheduled_tokens": {"a": 1}})())
        assert stamp_output(plain, cache) is plain and getattr(plain, STAMP) == (1, 80, None)
        assert getattr(pickle.loads(pickle.dumps(plain)), STAMP) == (1, 80, None)

        class Later(AsyncModelRunnerOutput):
            def get_output(self):
                return model_output(type("SO", (), {"num_scheduled_tokens": {"b": 1}})())

            def get_kv_connector_output(self):
                return None

        pending = stamp_output(Later(), cache)
        WORKER.apply(cache, (2, 96))  # the next step resizes before this output is read
        assert getattr(pending.get_output(), STAMP) == (1, 80, None)
        assert stamp_output(None, cache) is None and stamp_output(plain, None) is plain
    finally:
        WORKER.reset()


def test_the_idle_hook_releases_through_collective_rpc_unless_a_request_arrives(engine):
    """The patched ``EngineCoreProc._process_input_queue`` on an engine whose workers are the
    plugin's ``worker_resize`` over the process's active cache (one worker here)."""
    import dataclasses
    import queue

    from vmmkv.integrations.vllm import _elastic_engine as engine_side
    from vmmkv.integrations.vllm import _elastic_worker as worker_side
    from vmmkv.integrations.vllm._state import _STATE
    from vmmkv.testing.spawn import capture_logs
    from vmmkv.testing.vllm.trace import CountingCache, TraceRun

    run = TraceRun(num_blocks=N)
    run.build()
    el = run.el
    el.s = dataclasses.replace(el.s, idle_seconds=0.05)
    el.queue.prepend_n(run.pool.blocks[el.limit : 600])  # as if grown to 600
    el.limit = 600
    cache = CountingCache(600)

    class Engine:
        scheduler = run.scheduler
        input_queue: queue.Queue = queue.Queue()
        handled: list = []
        rpcs: list = []
        work = False  # an added request until vLLM's step would run it
        _deferred_inputs: list = []
        _idle_state_callbacks: list = []
        model_executor = type("Executor", (), {"is_sleeping": False})()

        def is_scheduler_paused(self):
            return False

        def has_work(self):
            return self.work

        def is_running(self):
            return True

        def _notify_idle_state_callbacks(self):
            pass

        def _handle_client_request(self, *req):
            self.handled.append(req)
            self.work = self.work or req[0] == "ADD"

        def collective_rpc(self, method, args=()):
            self.rpcs.append(args)
            return [method(None, *args)]

    hook = engine_side._process_input_queue(lambda self: "vllm's loop")
    eng = Engine()
    worker_side.WORKER.reset()
    _STATE.active = cache
    try:
        eng.input_queue.put(("ADD", "r1"))  # a request arrives during the wait: no release
        assert hook(eng) == "vllm's loop"
        assert eng.handled == [("ADD", "r1")] and eng.rpcs == [] and el.limit == 600
        eng.work = False  # vLLM's step ran it; the engine is idle again
        el.before_schedule()  # a step: the idle time counts from the end of this one
        eng.input_queue.put(("UTILITY", "stats"))  # a utility call neither ends nor restarts it
        assert hook(eng) == "vllm's loop"  # idle: released down to the floor on every worker
        assert eng.handled[-1] == ("UTILITY", "stats")
        assert eng.rpcs == [(1, el.s.floor)] and el.limit == el.s.floor
        assert cache.committed_blocks == el.s.floor
        assert hook(eng) == "vllm's loop" and len(eng.rpcs) == 1  # at the floor: no wait
        el.queue.prepend_n(run.pool.blocks[el.limit : 600])
        el.limit = 600
        # refused by the group (one outcome on every worker, sizes kept): logged, the engine
        # goes on with the tail parked
        eng.collective_rpc = lambda method, args=(): [(args[0], 600, "refused")] * 2
        logs = capture_logs("vmmkv")
        engine_side.idle_release(eng, el)
        assert el.limit == el.s.floor and any("refused by the group" in m for m in logs), logs
        el.queue.prepend_n(run.pool.blocks[el.limit : 600])
        el.limit = 600
        eng.collective_rpc = lambda method, args=(): [(args[0], 75, None), (args[0], 600, "x")]
        with pytest.raises(RuntimeError, match=r"idle release to 75 blocks .* different outcomes"):
            engine_side.idle_release(eng, el)
    finally:
        _STATE.active = None
        worker_side.WORKER.reset()


def _pressure_free_run(setup, steps, arrive_each_step):
    """vLLM's scheduler (256 tokens a step, 16 sequences) with the plugin's worker step; returns
    per step (committed limit, blocks in use, waiting, running) and the run."""
    from vmmkv.testing.vllm.trace import TraceRun, counting_worker, model_output, schedule

    run = TraceRun(trace="ranks", num_blocks=N, max_num_batched_tokens=256, max_num_seqs=16)
    s = run.build()
    on_step = counting_worker(run)
    setup(run, s, on_step)
    rows = []
    for _ in range(steps):
        if arrive_each_step:
            run._add(100, 8, shared=False)
        so = schedule(s)
        s.update_from_output(so, model_output(so, on_step(so)))
        in_use = sum(1 for b in run.pool.blocks if b.ref_cnt > 0 and not b.is_null)
        rows.append((run.el.limit, in_use, len(s.waiting), len(s.running)))
    return rows, run


def _check_no_grow_beyond_pressure(rows, run):
    """Every request that waits, waits for something other than KV: the committed limit stays
    within what the watermark rule asks for (in use + 2 x watermark, one grow's quantum up)."""
    el = run.el
    assert any(waiting for _, _, waiting, _ in rows)  # requests did wait
    for limit, in_use, _, _ in rows:
        bound = el.s.round(max(el.s.floor, in_use + 2 * el.s.watermark + el.s.quantum))
        assert limit <= max(bound, el.s.round(bound + bound // 4)), (limit, in_use, rows)


def test_a_long_chunked_prefill_that_holds_back_requests_does_not_grow_the_pool(engine):
    """One 3,900-token prompt takes the whole 256-token budget of every step while it is
    prefilled: the short requests arriving meanwhile wait for tokens, not for KV."""
    engine.setenv("VMMKV_ELASTIC_WATERMARK_BLOCKS", "32")
    rows, run = _pressure_free_run(lambda run, s, step: run._add(3900, 400, shared=False), 12, True)
    _check_no_grow_beyond_pressure(rows, run)


def test_a_wait_mode_pause_that_holds_back_new_requests_does_not_grow_the_pool(engine):
    """vLLM's ``PAUSED_NEW`` (``pause_generation("wait")``, ``sleep(mode="wait")``): the running
    requests drain, new ones stay waiting until the resume."""
    from vllm.v1.core.sched.interface import PauseState

    from vmmkv.testing.vllm.trace import model_output, schedule

    def paused(run, s, on_step):
        for _ in range(4):
            run._add(200, 40, shared=False)
        so = schedule(s)  # admitted before the pause
        s.update_from_output(so, model_output(so, on_step(so)))
        s.set_pause_state(PauseState.PAUSED_NEW)
        for _ in range(3):
            run._add(100, 8, shared=False)

    engine.setenv("VMMKV_ELASTIC_WATERMARK_BLOCKS", "32")
    rows, run = _pressure_free_run(paused, 12, False)
    _check_no_grow_beyond_pressure(rows, run)
    assert rows[-1][2] == rows[0][2] > 0 and run.el.counts["grows"] == 0  # still waiting
