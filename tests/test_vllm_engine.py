"""vmmkv's plugin inside a real vLLM 0.34.0 engine on the CPU: every call its sites receive is
made by vLLM's own code (``vmmkv.testing.vllm.engine``: what runs, and the stubs with their
reasons in ``vmmkv.testing.vllm.host.STUBS``).

Each engine runs in a launcher process of its own (``vmmkv.testing.spawn``), which vLLM forks its
engine core and workers from: vLLM's ``EngineCoreProc`` with its ``Scheduler`` or
``AsyncScheduler`` (``step`` or ``step_with_batch_queue``), its ``MultiprocExecutor`` and one
``WorkerProc`` per rank with vLLM's TP, PCP and DCP groups on gloo, vLLM's GPU ``Worker`` and
MRV2's ``GPUModelRunner`` on a host device. The lifecycle each engine goes through, by vLLM's
client calls only: start (vLLM's ``_initialize_kv_caches``: initialize_from_config,
compile_or_warm_up_model with its kernel warmup and, under the extensible cache, the sizing
warmup and the shrink before capture, finalize_extensible_kv_cache, extend_kv_cache), requests
sharing a prefix, ``reset_prefix_cache`` (both forms), sleep level 1 with the partial wake RL
frameworks use (``["weights"]`` then ``["kv_cache"]``), sleep level 2 and a full wake, the pause
modes (keep, wait, abort) and ``release_kv_cache_memory`` with its wake, under the extensible
cache a weight update that borrows the KV cache's memory (``reload_weights``), in elastic mode the
idle release, and shutdown.

After every step of every engine, every worker compares its whole mapped replica with vLLM's own
gather plus vmmkv's reference insert (``reference.Reference``); after every phase the tests
check what each worker holds: vLLM's count of committed blocks equal to vmmkv's (extensible
cache), the scheduler's limit inside every worker's committed blocks (elastic), nothing of the
cache mapped or open while asleep or released, every request finished.
"""

from __future__ import annotations

import time

import pytest

from tests.helpers import vllm_marks
from vmmkv.testing.spawn import run_world

pytestmark = vllm_marks()

IDLE_S = 1.5  # elastic mode's idle release, short for the test (VMMKV_ELASTIC_IDLE_S)


def _spec(shape, extensible, elastic, async_scheduling, **kw):
    from vmmkv.testing.vllm.engine import Spec

    env = {"VMMKV_ELASTIC_IDLE_S": str(IDLE_S)} if elastic else {}
    return Spec(shape, extensible=extensible, elastic=elastic,
                async_scheduling=async_scheduling, env_extra=env, **kw)  # fmt: skip


def _phase(eng, name, record, *, asleep=False):
    """Every worker's checks and state after a phase, the pool's stats in elastic mode: one
    moment between two steps of the engine core."""
    snap = eng.client.call_utility("harness_snapshot", name)
    record.append({"phase": name, "asleep": asleep, "t": time.monotonic(), **snap})


def _serve(eng, seed, n, shared=0, tokens=10):
    from vmmkv.testing.vllm.engine import prompts

    for p in prompts(seed, n, shared=shared):
        eng.submit(p, tokens)
    eng.run(timeout=300)


def _lifecycle(eng):
    """One engine through every lifecycle step (module docstring); the records of each phase."""
    c, rec = eng.client, []
    _phase(eng, "start", rec)
    _serve(eng, 1, 6, shared=70)
    _phase(eng, "serve", rec)
    assert c.reset_prefix_cache() is True
    _phase(eng, "reset_prefix_cache", rec)
    c.sleep(1)
    _phase(eng, "sleep 1", rec, asleep=True)
    c.wake_up(["weights"])
    _phase(eng, "wake weights", rec, asleep=True)
    c.wake_up(["kv_cache"])
    _phase(eng, "wake kv_cache", rec)
    # a reset with requests running: vLLM preempts them first, then resets
    for p in __import__("vmmkv.testing.vllm.engine", fromlist=["prompts"]).prompts(2, 4, shared=70):
        eng.submit(p, 16)
    for _ in range(4):
        c.get_output()
    assert c.reset_prefix_cache(reset_running_requests=True) is True
    eng.run(timeout=300)
    _phase(eng, "reset running", rec)
    c.sleep(2)
    _phase(eng, "sleep 2", rec, asleep=True)
    c.wake_up()
    _phase(eng, "wake", rec)
    _serve(eng, 3, 4)
    _phase(eng, "serve after wake", rec)
    for mode in ("keep", "wait", "abort"):
        c.call_utility("pause_scheduler", mode, True, True)
        _phase(eng, f"pause {mode}", rec)
        c.call_utility("resume_scheduler")
    c.call_utility("pause_scheduler", "abort", True, True)
    c.release_kv_cache_memory()
    _phase(eng, "release_kv_cache_memory", rec, asleep=True)
    c.wake_up(["kv_cache"])
    _phase(eng, "wake after release", rec)
    if eng.spec.extensible:
        # a weight update that finds too little free memory on PCP rank 0 of TP rank 0 and a
        # cleared cache: vLLM lends the KV cache's memory; vmmkv agrees it over the PCP group
        c.call_utility("pause_scheduler", "abort", True, True)
        eng.rpc("harness_set_free_memory", 1 << 20, [0])
        eng.rpc("reload_weights", [], None, True)
        eng.rpc("harness_set_free_memory", 1 << 40, None)
        c.call_utility("resume_scheduler")
        _phase(eng, "weight update", rec)
    _serve(eng, 4, 4)
    _phase(eng, "serve after all", rec)
    if eng.spec.elastic:  # cached blocks hold the idle release up: none after a reset
        assert c.reset_prefix_cache() is True
        time.sleep(IDLE_S * 3)
        _phase(eng, "idle", rec)
    return rec


def _run_engines(rank, world, specs):
    """The launcher: each spec's engine through the lifecycle, one after the other."""
    from vmmkv.testing.vllm.engine import Engine

    out = []
    for spec in specs:
        t0 = time.monotonic()
        eng = Engine(spec)
        try:
            out.append({"spec": str(spec), "t0": t0, "phases": _lifecycle(eng),
                        "finished": len(eng.finished), "submitted": len(eng.tokens),
                        "foreign": [eng.client.call_utility("harness_foreign"),
                                    *eng.rpc("harness_foreign")]})  # fmt: skip
        finally:
            eng.close()
    return out


def _launch(specs, timeout):
    env = specs[0].env()
    assert all(s.env() == env for s in specs), "one launcher runs engines of one environment"
    return run_world(_run_engines, 1, args=(specs,), init_group=False, env=env,
                     timeout=timeout)[0]  # fmt: skip


def _check_run(run):
    """Every assertion of the module docstring over one engine's records."""
    spec = run["spec"]
    assert run["finished"] == run["submitted"], spec
    for ph in run["phases"]:
        where = f"{spec}, {ph['phase']}"
        for w in ph["workers"]:
            assert w["reference"]["mismatch"] == [], (where, w["rank"], w["reference"])
            mem = w["memory"]
            assert mem["other_mapped"] == 0, (where, w["rank"], mem)
            if ph["asleep"]:
                assert (mem["kv_mapped"], mem["kv_memfds"]) == (0, 0), (where, w["rank"], mem)
                continue
            assert w["committed"] and mem["kv_mapped"] > 0, (where, w)
            if "-ext-" in spec:
                assert w["vllm_committed"] == w["committed"], (where, w["rank"])
        if ph["pool"] is not None and not ph["asleep"]:
            pool = ph["pool"]
            for w in ph["workers"]:
                assert pool["committed"] <= w["committed"], (where, pool, w["rank"])
    if "-elastic-" in spec:
        start, idle = run["phases"][0], run["phases"][-1]
        floor = start["pool"]["floor"]
        # warmup addressed blocks above the floor (vmmkv's own allocation grew to them, vLLM's
        # extensible cache committed them) and every rank came back down to the floor
        assert all(w["reference"]["peak"] > floor for w in start["workers"]), (spec, start)
        assert {w["committed"] for w in start["workers"]} == {floor}, (spec, start)
        assert idle["phase"] == "idle" and idle["pool"]["limit"] == floor, (spec, idle["pool"])
        assert {w["committed"] for w in idle["workers"]} == {floor}, (spec, idle)
    for i, f in enumerate(run["foreign"]):  # the engine core, then every worker
        assert f["foreign"] == sorted(set(f["plugin"]) | set(f["harness"])), (spec, f)
        want = LAUNCHER_STUBS if i == 0 else LAUNCHER_STUBS | WORKER_STUBS
        assert set(f["replaced"]) == want, (spec, i, set(f["replaced"]) ^ want)
        if i:  # a worker: vLLM's Worker with the listed methods replaced, vLLM's runner itself
            assert f["worker_defines"] == WORKER_DEFINES, (spec, f["worker_defines"])
            assert f["runner_is_vllms"], (spec, f["runner"])


# What the harness replaces, attribute by attribute (``host.STUBS`` gives each one's reason): in
# the launcher, inherited by the engine core and the workers, and in each worker.
_PLATFORM = "vllm.platforms.interface.UnspecifiedPlatform()."
LAUNCHER_STUBS = {
    *(f"torch.cuda.{n}" for n in ("Stream", "Event", "stream", "current_stream", "set_stream")),
    *(f"torch.accelerator.{n}" for n in (
        "synchronize", "empty_cache", "reset_peak_memory_stats", "memory_stats",
        "memory_reserved", "memory_allocated", "max_memory_allocated", "get_memory_info",
        "current_device_index")),
    *(_PLATFORM + n for n in (
        "device_type", "is_cuda_alike", "is_pin_memory_available", "get_current_memory_usage",
        "num_compute_units", "set_device", "manual_seed_all", "is_sleep_mode_available",
        "is_cumem_allocator_available")),
    "vllm.utils.torch_utils.PIN_MEMORY",
    "vllm.v1.engine.core.EngineCore.harness_foreign",
    "vllm.v1.engine.core.EngineCore.harness_snapshot",
}  # fmt: skip
WORKER_STUBS = {
    "vllm.v1.attention.backends.mla.flashmla_sparse.get_mla_metadata",
    "vllm.v1.attention.backends.mla.flashmla_sparse.torch",
    "vllm.v1.sample.ops.topk_topp_sampler.HAS_TRITON",
    *(f"vllm.v1.worker.gpu_worker.{n}" for n in (
        "kernel_warmup", "vmm_unavailable_reason", "granule_size", "measure_kv_cache_blocks",
        "get_mem_allocator_instance")),
    "vllm.v1.worker.extensible_kv_cache.max_layer_reload_bytes",
    "vllm.device_allocator.get_mem_allocator_instance",
    "vllm.compilation.cudagraph_pool.get_mem_allocator_instance",
}  # fmt: skip

# what worker.HarnessWorker defines over vLLM's Worker: the two stubs, the observer, the tests'
# calls by name and the reference they read
WORKER_DEFINES = sorted([
    "init_device", "determine_available_memory", "annotate_profile", "harness_check",
    "harness_state", "harness_set_free_memory", "harness_fail_commits", "harness_foreign",
    "_reference", "reference",
])  # fmt: skip

SHAPES = [(1, 2, 1), (1, 2, 2), (2, 2, 1), (2, 2, 2), (2, 2, 4), (1, 4, 1), (1, 4, 4)]
SHAPE_IDS = [f"tp{t}xpcp{p}-dcp{d}" for t, p, d in SHAPES]


@pytest.mark.timeout(3600)
@pytest.mark.parametrize(
    "elastic",
    [pytest.param(False, id="fixed", marks=pytest.mark.long), pytest.param(True, id="elastic")],
)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_a_real_engine_holds_byte_exact_replicas_through_its_whole_lifecycle(shape, elastic):
    """Two engines of one shape, elastic mode on or off (one launcher: one environment): vLLM's
    extensible KV cache on and off, one with sync scheduling and the other async, swapped
    between the shape's elastic and fixed cells and from one shape to the next, so every shape
    runs each cache both ways and each way of scheduling runs with each cache at every
    elastic setting. (All four engines in every cell take twice the time, about 40 minutes on
    a 2-core machine, for the product of settings whose code paths the pairs already cover.)
    The default run keeps the elastic cells of every shape (the newest paths); ``-m long`` and
    CI's vLLM job add the rest."""
    from vmmkv.testing.vllm.engine import Shape

    flip = (SHAPES.index(shape) + elastic) % 2 == 1
    specs = [
        _spec(Shape(*shape), True, elastic, flip),
        _spec(Shape(*shape), False, elastic, not flip),
    ]
    runs = _launch(specs, timeout=3000)
    for run in runs:
        _check_run(run)


def _split_grow(rank, world, spec):
    """TP 2 x PCP 2, elastic: the next grow fails with an out-of-memory on global rank 3 (the
    PCP group of TP rank 1) only, then load that needs grows."""
    from vmmkv.testing.vllm.engine import Engine

    eng = Engine(spec)
    rec = []
    try:
        _phase(eng, "start", rec)
        eng.rpc("harness_fail_commits", [3], 1)
        from vmmkv.testing.vllm.engine import prompts

        for p in prompts(5, 14):
            eng.submit(p, 24)
        while len(eng.finished) < len(eng.tokens):
            eng.run_some()
            _phase(eng, "load", rec)
        return {"phases": rec, "finished": len(eng.finished), "submitted": len(eng.tokens)}
    finally:
        eng.close()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("extensible", [True, False], ids=["ext", "own"])
def test_tp2_pcp2_a_grow_refused_in_one_group_hands_out_nothing_and_the_next_succeeds(extensible):
    """One PCP group refuses a grow (out of memory on one GPU), the other grows: the engine
    neither hangs (a timeout bounds the run) nor hands out blocks the refusing group lacks (every
    worker checks each step's blocks, the reference every live request's), and a later grow
    succeeds on every group."""
    from vmmkv.testing.vllm.engine import Shape

    spec = _spec(Shape(2, 2, 1), extensible, True, False)
    out = run_world(_split_grow, 1, args=(spec,), init_group=False, env=spec.env(),
                    timeout=600)[0]  # fmt: skip
    assert out["finished"] == out["submitted"]
    first, last = out["phases"][0], out["phases"][-1]
    floor = first["pool"]["floor"]
    assert last["pool"]["refused"] >= 1, last["pool"]
    assert last["pool"]["committed"] > floor, last["pool"]
    for ph in out["phases"]:
        for w in ph["workers"]:
            assert w["reference"]["mismatch"] == [], (ph["phase"], w["rank"], w["reference"])
            assert ph["pool"]["committed"] <= w["committed"], (ph["pool"], w)
    groups = {w["tp_rank"]: w["committed"] for w in last["workers"]}
    assert min(groups.values()) >= last["pool"]["committed"], (groups, last["pool"])
