"""Elastic KV's idle hook inside vLLM 0.34.0's own engine-core loop (CPU).

What runs through vLLM's own code: an ``EngineCoreProc`` built without ``__init__`` (the
attributes its loop reads) runs its real ``_process_input_queue`` (patched by the plugin's engine
sites), ``_wait_for_output``, ``_handle_client_request``, ``pause_scheduler``, ``sleep`` and
``wake_up``, over vLLM's real ``Scheduler`` with the elastic pool (``trace.TraceRun``) and
vLLM's ``Executor`` (built without ``__init__``: its sleep tags, ``sleep``, ``wake_up`` and cache
resets) whose ``collective_rpc`` runs each call on every worker. Load is vLLM's scheduler
stepped with the plugin's worker step (``on_update_requests``, the stamp) on every worker.

Workers: one ``trace.CountingCache`` in process, or, for sleep, 2 spawned ranks with real
``VllmKVCache``s (host backend) and the plugin's ``VmmkvSleepModeBackend`` around vLLM's own
``CuMemBackend`` (its CUDA allocator recorded, ``tests.test_vllm_sleep._RecordingAllocator``).

Checked: a pause in mode "wait" completes when the engine drains, not ``idle_seconds`` later;
an input vLLM deferred during the last step is handled before any idle wait; the idle wait
runs with vLLM's watchdog off; sleep, an idle engine loop while asleep, then wake leave the
scheduler's limit equal to every worker's committed size and commit nothing while asleep.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

import pytest

from tests.helpers import vllm_marks
from vmmkv.testing.spawn import run_world

pytestmark = vllm_marks()

IDLE_S = 1.0  # the idle wait under test; the checks allow a quarter of it
KNOBS = {
    # as a deployment sets them: vLLM's plugin loader, in any process vLLM starts (its model
    # inspection too, when no earlier test of the process has cached it), refuses
    # VLLM_VMMKV_ELASTIC=1 without the plugin on
    "VLLM_USE_VMMKV": "1",
    "VLLM_VMMKV_ELASTIC": "1",
    "VMMKV_CHUNK_MIB": "0.5",  # 5 blocks of 100,864 B (2 layers) per chunk
    "VMMKV_ELASTIC_WATERMARK_BLOCKS": "16",
    "VMMKV_ELASTIC_FLOOR_BLOCKS": "32",  # rounded up to the quantum: 35
    "VMMKV_ELASTIC_RELEASE_STEPS": "1000",  # no release in band: the idle hook's
    "VMMKV_ELASTIC_IDLE_S": str(IDLE_S),
}
N = 256


@pytest.fixture
def engine_sites(monkeypatch):
    from vmmkv.integrations.vllm import _elastic_worker as worker_side
    from vmmkv.integrations.vllm import _install
    from vmmkv.integrations.vllm._state import _STATE

    for k, v in KNOBS.items():
        monkeypatch.setenv(k, v)
    _install.install_engine()
    worker_side.WORKER.reset()
    try:
        yield
    finally:
        _STATE.active = None
        worker_side.WORKER.reset()
        _install.uninstall()


def _executor(cfg, call):
    """vLLM's ``Executor`` without ``__init__``; ``collective_rpc`` returns ``call(method, args,
    kwargs)``, the list of every worker's result, and records the method's name."""
    from vllm.v1.executor.abstract import Executor

    class Workers(Executor):
        def _init_executor(self):
            pass

        def check_health(self):
            pass

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False):
            self.calls.append(method if isinstance(method, str) else method.__name__)
            return call(method, tuple(args), dict(kwargs or {}))

    ex = object.__new__(Workers)
    ex.vllm_config, ex.sleeping_tags, ex.calls = cfg, set(), []
    return ex


def _engine(run, executor):
    """vLLM's ``EngineCoreProc`` without ``__init__``: what its input loop, pause and sleep
    read."""
    from vllm.v1.engine import CheckpointState
    from vllm.v1.engine.core import EngineCoreProc, EngineShutdownState

    eng = object.__new__(EngineCoreProc)
    eng.scheduler, eng.model_executor = run.scheduler, executor
    eng.engines_running, eng.batch_queue = False, None
    eng.shutdown_state = EngineShutdownState.RUNNING
    eng.input_queue, eng.output_queue, eng.aborts_queue = (queue.Queue() for _ in range(3))
    eng._deferred_inputs, eng._idle_state_callbacks = deque(), []
    eng.process_input_queue_block = True
    eng._checkpoint_state = CheckpointState.RUNNING
    eng._kv_cache_reclaimable = False
    eng.mm_receiver_cache = None
    eng.reject_new_requests = False
    return eng


def _in_process_call(cache):
    """``collective_rpc``'s body for one in-process worker over ``cache``: the plugin's
    callables (worker step, idle release) run; vLLM's named methods do nothing here."""

    def call(method, args, kwargs):
        return [method(None, *args, **kwargs)] if callable(method) else [None]

    return call


def worker_step(worker, so):
    """A worker's part of a step (the patched ``update_requests`` and stamp)."""
    from vmmkv.integrations.vllm import _elastic_worker as worker_side
    from vmmkv.integrations.vllm._state import active_cache

    cache = active_cache()
    worker_side.on_update_requests(cache, so)
    return worker_side.WORKER.stamp(cache)


def _step(run, executor):
    """One engine step: vLLM's schedule, every worker's step, vLLM's update from rank 0's
    output (which carries its stamp)."""
    from vmmkv.testing.vllm.trace import model_output, schedule

    so = schedule(run.scheduler)
    stamps = executor.collective_rpc(worker_step, args=(so,))
    run.scheduler.update_from_output(so, model_output(so, stamps[0]))


def _grown(executor_for, requests=6, plen=700):
    """vLLM's scheduler with the elastic pool, grown by load above its floor; returns the run and
    the executor (``executor_for(cfg)``) with requests still running."""
    from vmmkv.testing.vllm.trace import TraceRun

    run = TraceRun(trace="ranks", num_blocks=N, max_num_batched_tokens=256, max_num_seqs=16)
    run.build()
    ex = executor_for(run.vllm_config)
    for _ in range(requests):
        run._add(plen, 200, shared=False)
    el = run.el
    for _ in range(100):
        if el.counts["grows"] >= 2 and el.pending is None and not run.scheduler.waiting:
            break
        _step(run, ex)
    assert run.el.limit > run.el.s.floor and run.scheduler.running
    return run, ex


def _loop_in_thread(eng):
    """vLLM's ``_process_input_queue`` (as patched) in a thread; returns a stopper that ends
    vLLM's wait (shutdown requested, then a WAKEUP input) and joins it."""
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core import EngineShutdownState

    errors = []
    eng.shutdown_state = EngineShutdownState.RUNNING

    def body():
        try:
            eng._process_input_queue()
        except BaseException as exc:  # reported by stop()
            errors.append(exc)

    th = threading.Thread(target=body, daemon=True)
    th.start()

    def stop():
        eng.shutdown_state = EngineShutdownState.REQUESTED
        eng.input_queue.put((EngineCoreRequestType.WAKEUP, None))
        th.join(30)
        assert not th.is_alive() and not errors, errors

    return stop


def _in_process(cache):
    from vmmkv.integrations.vllm._state import _STATE

    _STATE.active = cache
    return lambda cfg: _executor(cfg, _in_process_call(cache))


def _wait_for(cond, seconds=10.0):
    end = time.monotonic() + seconds
    while not cond() and time.monotonic() < end:
        time.sleep(0.005)
    return cond()


def test_a_wait_mode_pause_completes_when_the_engine_drains_not_idle_seconds_later(engine_sites):
    from vmmkv.testing.vllm.trace import CountingCache

    cache = CountingCache(35)
    run, ex = _grown(_in_process(cache))
    eng = _engine(run, ex)
    future = eng.pause_scheduler(mode="wait")  # vLLM's: the running requests drain first
    assert future is not None and not future.done()
    while eng.has_work():  # the drain, one step at a time
        _step(run, ex)
    limit = run.el.limit
    assert limit > run.el.s.floor
    done = []
    future.add_done_callback(lambda f: done.append(time.monotonic()))
    t0 = time.monotonic()
    stop = _loop_in_thread(eng)
    try:
        assert _wait_for(lambda: done, 4 * IDLE_S)
    finally:
        stop()
    assert done[0] - t0 < IDLE_S / 4, done[0] - t0
    assert "worker_resize" not in ex.calls  # no idle release held the pause back
    assert ex.calls[-1] == "reset_encoder_cache"  # vLLM's _finish_pause ran
    assert run.el.limit == limit == cache.committed_blocks  # paused: the size is kept


def test_an_input_vllm_deferred_during_the_last_step_is_handled_before_any_idle_wait(
    engine_sites,
):
    """vLLM 0.34 holds a utility call that arrives during a step (``_wait_for_output``) in
    ``_deferred_inputs`` until the step ends; the idle hook must not wait or release first."""
    from vllm.v1.engine import EngineCoreRequestType

    from vmmkv.testing.vllm.trace import CountingCache

    cache = CountingCache(35)
    run, ex = _grown(_in_process(cache))
    eng = _engine(run, ex)
    while run.scheduler.has_requests():  # to the last step
        _step(run, ex)

    class StepOutput:  # the last step's output, not ready at the first poll
        polls = 0

        def poll(self):
            self.polls += 1
            return self.polls > 1

        def wait_briefly(self, pending, deadline):
            pass

        def result(self):
            return "step output"

    eng.input_queue.put((EngineCoreRequestType.UTILITY, (0, 7, "reset_prefix_cache", ())))
    assert eng._wait_for_output(StepOutput()) == "step output"
    assert len(eng._deferred_inputs) == 1 and eng.input_queue.empty()  # vLLM deferred it
    t0 = time.monotonic()
    stop = _loop_in_thread(eng)
    try:
        assert _wait_for(lambda: not eng.output_queue.empty(), 4 * IDLE_S)
        answered, calls = time.monotonic() - t0, list(ex.calls)
        assert _wait_for(lambda: run.el.limit == run.el.s.floor, 4 * IDLE_S)  # then idle
    finally:
        stop()
    client, out = eng.output_queue.get_nowait()
    assert (client, out.utility_output.call_id) == (0, 7)
    assert out.utility_output.failure_message is None
    assert answered < IDLE_S / 4 and "worker_resize" not in calls, (answered, calls)
    assert ex.calls.count("worker_resize") == 1 and cache.committed_blocks == run.el.s.floor


def test_the_idle_wait_runs_with_vllms_watchdog_off_and_then_releases(engine_sites):
    from vllm.utils import watch_dog

    from vmmkv.testing.vllm.trace import CountingCache

    cache = CountingCache(35)
    run, ex = _grown(_in_process(cache))
    eng = _engine(run, ex)
    while run.scheduler.has_requests():
        _step(run, ex)
    floor = run.el.s.floor

    class Dog(watch_dog.NoopWatchDog):
        active = True

        def disable(self):
            outer = self

            class Off:
                def __enter__(self):
                    outer.active = False

                def __exit__(self, *exc):
                    outer.active = True

            return Off()

    dog = Dog()
    seen = []

    class Queue(queue.Queue):
        def get(self, block=True, timeout=None):
            seen.append((timeout, dog.active))
            return super().get(block, timeout)

    eng.input_queue = Queue()
    real, watch_dog._watch_dog = watch_dog._watch_dog, dog
    try:
        stop = _loop_in_thread(eng)
        try:
            assert _wait_for(lambda: run.el.limit == floor, 4 * IDLE_S)
        finally:
            stop()
    finally:
        watch_dog._watch_dog = real
    assert seen[0] == (IDLE_S, False), seen  # the plugin's wait, the watchdog off
    assert all(active is False for _, active in seen), seen  # and vLLM's own
    assert ex.calls.count("worker_resize") == 1 and cache.committed_blocks == floor


def test_the_pools_stats_reach_a_client_through_vllms_utility_call_and_its_encoder(
    engine_sites,
):
    """The added engine-core utility, dispatched by vLLM's ``_handle_client_request`` and
    carried through vLLM's msgpack encoder and decoder, as over the engine core's socket."""
    from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequestType
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from vmmkv.integrations.vllm import STATS_UTILITY
    from vmmkv.testing.vllm.trace import CountingCache

    cache = CountingCache(35)
    run, ex = _grown(_in_process(cache))
    eng = _engine(run, ex)
    el = run.el
    eng._handle_client_request(EngineCoreRequestType.UTILITY, (0, 9, STATS_UTILITY, ()))
    client, out = eng.output_queue.get_nowait()
    got = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(out)).utility_output
    assert (client, got.call_id, got.failure_message) == (0, 9, None)
    stats = got.result.result
    blocks = run.pool.blocks
    in_use = sum(1 for b in blocks if b.ref_cnt > 0 and not b.is_null)
    assert in_use > 0 and el.counts["grows"] >= 2
    assert stats["committed"] == el.limit == cache.committed_blocks > el.s.floor, stats
    assert stats["committed_bytes"] == el.limit * el.s.block_bytes
    assert stats["in_use"] == in_use and stats["capacity"] == N
    assert (stats["grows"], stats["releases"], stats["refused"]) == (
        el.counts["grows"],
        el.counts["releases"],
        el.counts["refused"],
    )
    # vLLM's KV-usage metric, the scheduler's own, reads the same fraction of the capacity
    assert stats["usage"] == run.scheduler.kv_cache_manager.usage == in_use / (N - 1)


def test_elastic_stats_asks_vllms_llm_engine_and_in_process_client_and_refuses_others(
    engine_sites,
):
    from vllm.entrypoints.llm import LLM
    from vllm.v1.engine.core_client import InprocClient, SyncMPClient
    from vllm.v1.engine.llm_engine import LLMEngine

    from vmmkv.integrations.vllm import STATS_UTILITY, elastic_stats
    from vmmkv.testing.vllm.trace import CountingCache

    cache = CountingCache(35)
    run, ex = _grown(_in_process(cache))
    client = object.__new__(InprocClient)
    client.engine_core = _engine(run, ex)
    engine = object.__new__(LLMEngine)
    engine.engine_core = client
    llm = object.__new__(LLM)
    llm.llm_engine = engine
    want = run.el.stats()
    assert elastic_stats(llm) == elastic_stats(engine) == elastic_stats(client) == want
    remote = object.__new__(SyncMPClient)  # over the socket: vLLM's call_utility, by name
    remote.call_utility = lambda method, *args: (method, args)
    engine.engine_core = remote
    assert elastic_stats(llm) == (STATS_UTILITY, ())
    engine.engine_core = client
    client.engine_core.scheduler = object()  # an engine core without a pool (PCP 1)
    assert elastic_stats(llm) is None
    with pytest.raises(TypeError, match="expected vLLM's LLM, LLMEngine or engine-core client"):
        elastic_stats(object())


def test_the_added_utility_is_refused_where_vllm_has_one_and_removed_on_unregister():
    from vllm.v1.engine.core import EngineCore

    from vmmkv.integrations.vllm import STATS_UTILITY, UnsupportedVLLM, _install
    from vmmkv.integrations.vllm._install import ENGINE_SITES

    added = [site for site in ENGINE_SITES if site[3] is None]
    assert [site[1] for site in added] == [f"EngineCore.{STATS_UTILITY}"]
    try:
        _install.install_engine()
        assert callable(getattr(EngineCore, STATS_UTILITY))
    finally:
        _install.uninstall()
    assert not hasattr(EngineCore, STATS_UTILITY)
    setattr(EngineCore, STATS_UTILITY, lambda self: "vLLM's own")
    try:
        with pytest.raises(UnsupportedVLLM, match=f"EngineCore.{STATS_UTILITY}: exists"):
            _install.install_engine()
        assert getattr(EngineCore, STATS_UTILITY)(None) == "vLLM's own"  # nothing patched
    finally:
        delattr(EngineCore, STATS_UTILITY)
        _install.uninstall()


# -- sleep over 2 ranks -------------------------------------------------------------------------


def _sleep_ranks(rank, world):
    import pickle

    import torch.distributed as dist
    import vllm.device_allocator as dalloc

    from tests.test_vllm_sleep import _RecordingAllocator
    from vmmkv.integrations.vllm import _elastic_engine as engine_side
    from vmmkv.integrations.vllm import _elastic_settings as settings
    from vmmkv.integrations.vllm import _elastic_worker as worker_side
    from vmmkv.integrations.vllm import _install
    from vmmkv.integrations.vllm._buffer import elastic_chunk_bytes
    from vmmkv.integrations.vllm._cache import VllmKVCache
    from vmmkv.integrations.vllm._sleep import VmmkvSleepModeBackend, register_backend
    from vmmkv.integrations.vllm._state import _STATE
    from vmmkv.testing.vllm import configs

    register_backend()
    cfg, kvc = configs.build_kv_cache_config("BLNHC", num_blocks=N, num_layers=2, pcp=world)
    chunk = elastic_chunk_bytes()
    worker_side.WORKER.reset()
    vc = VllmKVCache(kvc, "BLNHC", cpu_group=dist.group.WORLD, device="cpu", backend="host",
                     initial_blocks=settings.settings_for(cfg, kvc, chunk).floor, chunk_bytes=chunk,
                     timeout=20)  # fmt: skip
    _STATE.active = vc
    rec = _RecordingAllocator(vc)
    dalloc.get_mem_allocator_instance = lambda: rec
    backend = VmmkvSleepModeBackend()
    seen = []  # (method, committed blocks before, after)

    def run_here(method, args, kwargs):
        before = vc.committed_blocks
        if method == "sleep":
            out = backend.suspend(())
        elif method == "wake_up":
            out = backend.resume(kwargs.get("tags"))
        elif callable(method):
            out = method(None, *args, **kwargs)
        else:
            out = None  # synchronize_device, reset_mm_cache, reset_encoder_cache
        name = method if isinstance(method, str) else method.__name__
        seen.append((name, before, vc.committed_blocks))
        return out

    def bcast(msg=None):
        box = [msg]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    if rank != 0:
        while (blob := bcast()) is not None:
            out = run_here(*pickle.loads(blob))
            dist.gather_object(out, None, dst=0)
        vc.close()
        return seen

    def call(method, args, kwargs):
        bcast(pickle.dumps((method, args, kwargs)))
        out = run_here(method, args, kwargs)
        every = [None] * world
        dist.gather_object(out, every, dst=0)
        return every

    from vllm.v1.engine import EngineCoreRequestType

    _install.install_engine()
    try:
        run, ex = _grown(lambda c: _executor(c, call))
        eng = _engine(run, ex)
        el = run.el
        while run.scheduler.has_requests():
            _step(run, ex)
        grown = el.limit
        stats = {"grown": ex.collective_rpc(worker_side.worker_stats)}  # each rank's, through vLLM
        # 1. vLLM's sleep (pause "abort", caches reset, every worker's sleep); while asleep a
        #    client adds a request and drops it: its abort is one more step; then the engine's
        #    loop idles longer than idle_seconds, and a wake arrives
        eng.sleep(level=1)
        assert ex.is_sleeping
        eng.abort_requests([run._add(100, 8, shared=False)])
        while eng.has_work():
            _step(run, ex)
        stats["asleep"] = ex.collective_rpc(worker_side.worker_stats)
        stop = _loop_in_thread(eng)
        time.sleep(2.5 * IDLE_S)
        asleep = el.limit
        eng.input_queue.put((EngineCoreRequestType.UTILITY, (0, 1, "wake_up", (None,))))
        assert _wait_for(lambda: not eng.output_queue.empty())
        stop()
        awake = (el.limit, run.scheduler.pause_state.name)
        # 2. asleep again, and a release reaches the sleeping workers (an idle release)
        eng.sleep(level=1)
        engine_side.idle_release(eng, el)
        released = el.limit
        eng.wake_up(None)
        again = (el.limit, run.scheduler.pause_state.name)
    finally:
        bcast(None)
        _install.uninstall()
    return {"seen": seen, "grown": grown, "asleep": asleep, "awake": awake, "floor": el.s.floor,
            "released": released, "again": again, "stats": stats,
            "block_bytes": el.s.block_bytes, "chunk": chunk}  # fmt: skip


def _asleep_to_wake(seen, start):
    """From the ``start``-th sleep in ``seen``: the sleep, what ran asleep, the wake."""
    names = [s[0] for s in seen]
    at = [i for i, n in enumerate(names) if n == "sleep"][start]
    wake = names.index("wake_up", at)
    return seen[at], seen[at + 1 : wake], seen[wake]


@pytest.mark.timeout(300)
def test_sleep_an_idle_loop_and_wake_keep_the_limit_equal_to_every_workers_size():
    out = run_world(_sleep_ranks, 2, env=KNOBS, timeout=240)
    r0 = out[0]
    grown, floor = r0["grown"], r0["floor"]
    assert grown > floor
    assert r0["asleep"] == grown and r0["awake"] == (grown, "UNPAUSED")
    assert r0["released"] == floor and r0["again"] == (floor, "UNPAUSED")
    for rank, seen in enumerate([r0["seen"], out[1]]):
        for start, (before, after) in enumerate([(grown, grown), (grown, floor)]):
            sleep, asleep, wake = _asleep_to_wake(seen, start)
            assert sleep[1:] == (before, 0), (rank, start, sleep)
            assert all(s[1:] == (0, 0) for s in asleep), (rank, start, asleep)  # nothing
            assert wake[1:] == (0, after), (rank, start, wake)  # the scheduler's limit
        assert [s[0] for s in asleep] == ["worker_resize"]
    # worker_stats through collective_rpc: each rank's committed blocks and mapped bytes (2
    # layers of BLNHC: one segment, whole chunks), asleep nothing mapped and the wake's size
    bb, chunk = r0["block_bytes"], r0["chunk"]
    for rank, (grown_, asleep) in enumerate(zip(*r0["stats"].values(), strict=True)):
        assert grown_["rank"] == asleep["rank"] == rank and grown_["error"] is None
        assert grown_["committed_blocks"] == grown == grown_["stamp"], grown_
        assert grown_["committed_block_set"] == ((0, grown),)
        assert grown * bb <= grown_["committed_bytes"] < grown * bb + chunk, grown_
        assert asleep["committed_bytes"] == 0 and asleep["stamp"] == grown, asleep


# -- the engine sites whatever the order vLLM loads plugins and the engine core in ---------------


def _plugins_before_the_engine_core(rank, world):
    """A fresh process: vLLM loads its plugins (as ``EngineArgs.__post_init__`` does) before
    ``vllm.v1.engine.core`` is imported; then a forked engine core (vLLM's library default) does
    what ``EngineCore.__init__`` does first and builds vLLM's scheduler."""
    import multiprocessing as mp
    import sys

    import vllm.plugins

    from vmmkv.integrations.vllm._state import _STATE

    before = "vllm.v1.engine.core" in sys.modules
    vllm.plugins.load_general_plugins()
    registered = _STATE.hook is not None  # register() ran: the worker's import hook waits
    import vllm.v1.engine.core  # noqa: F401  what AsyncLLM / LLMEngine import next

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_forked_engine_core, args=(q,))
    p.start()
    got = q.get(timeout=120)
    p.join(60)
    return {"engine.core imported before the plugins": before, "registered": registered,
            "child": got}  # fmt: skip


def _forked_engine_core(q):
    try:
        from vllm.plugins import load_general_plugins
        from vllm.v1.core.sched.scheduler import Scheduler

        from vmmkv.integrations.vllm import original
        from vmmkv.testing.vllm.trace import TraceRun, counting_worker, model_output, schedule

        load_general_plugins()  # EngineCore.__init__'s first call: a no-op after the fork
        patched = Scheduler.schedule is not original(Scheduler, "schedule")
        run = TraceRun(trace="ranks", num_blocks=N, max_num_batched_tokens=256, max_num_seqs=16)
        s = run.build()  # raises without the engine sites
        on_step = counting_worker(run)
        for _ in range(6):
            run._add(700, 50, shared=False)
        for _ in range(40):
            so = schedule(s)
            s.update_from_output(so, model_output(so, on_step(so)))
        q.put({"patched": patched, "grows": run.el.counts["grows"], "limit": run.el.limit})
    except BaseException as exc:  # reported to the parent
        q.put(f"{type(exc).__name__}: {exc}")


@pytest.mark.timeout(300)
def test_engine_sites_install_when_the_plugins_load_before_the_engine_core_module():
    env = {"VLLM_PLUGINS": "vmmkv", **KNOBS}
    (out,) = run_world(_plugins_before_the_engine_core, 1, env=env, init_group=False, timeout=240)
    assert out["engine.core imported before the plugins"] is False and out["registered"]
    child = out["child"]
    assert isinstance(child, dict), child
    assert child["patched"] and child["grows"] > 0 and child["limit"] > 35, child


def test_a_worker_refuses_a_step_without_a_resize_request_in_elastic_mode(engine_sites):
    """vLLM's scheduler without the engine sites (PCP 1 in its eyes: no pool) sends what an
    engine core without them sends; the worker's step refuses it, naming rank and cause."""
    from vmmkv.integrations.vllm import _elastic_worker as worker_side
    from vmmkv.testing.vllm.trace import CountingCache, TraceRun

    run = TraceRun(trace="ranks", num_blocks=N, elastic=False, max_num_batched_tokens=256)
    s = run.build()
    run._add(100, 8, shared=False)
    so = s.schedule()
    cache = CountingCache(75)
    cache.rank = 1
    worker_side.WORKER.phase = "serving"  # vLLM's compile_or_warm_up_model returned
    with pytest.raises(RuntimeError) as err:
        worker_side.on_update_requests(cache, so)
    msg = str(err.value)
    assert msg.startswith("rank 1: ") and "vmmkv_resize" in msg, msg
    assert "without vmmkv's elastic engine sites" in msg and "VLLM_VMMKV_ELASTIC=1" in msg, msg
    assert cache.committed_blocks == 75 and worker_side.WORKER.seq == 0


def test_before_warmup_ends_a_worker_commits_what_vllms_own_steps_address(engine_sites):
    """vLLM's warmup drives real steps without a resize request (``SchedulerOutput.make_empty``
    filled by ``warmup.py``): until the worker leaves ``compile_or_warm_up_model`` (the phase the
    plugin's site sets, not a guess from request ids) such a step is accepted, and on vmmkv's
    own allocation the worker commits the blocks it addresses; the end of warmup brings it back
    to the floor. The same step in a serving worker is refused (the test above)."""
    from vmmkv.integrations.vllm import _elastic_worker as worker_side
    from vmmkv.testing.vllm.trace import CountingCache, TraceRun

    run = TraceRun(trace="ranks", num_blocks=N, elastic=False, max_num_batched_tokens=256)
    s = run.build()
    run._add(300, 8, shared=False)
    so = s.schedule()
    top = max(worker_side.step_block_ids(so))
    cache = CountingCache(2)
    worker = worker_side.WORKER
    worker.reset()
    worker.floor = 2
    assert worker.phase == "start" and top >= 2
    worker_side.on_update_requests(cache, so)  # accepted: the blocks it adds are committed
    assert cache.committed_blocks == top + 1 and worker.seq == 0
    worker.end_warmup(cache)
    assert worker.phase == "serving" and cache.committed_blocks == 2
