"""vLLM 0.34's own ``ExtensibleKVCache`` with vmmkv as its physical layer, driven in the order
vLLM 0.34's GPU worker calls it (CPU, host backend, gloo, spawned PCP ranks).

Every object vLLM builds here is vLLM's: its config planner (``get_kv_cache_configs``), its
granule padding of layer-major layouts (``pad_kv_cache_segments``), its ``ExtensibleKVCache``
(constructed as MRV2's ``initialize_kv_cache`` does, the plugin's buffer inside through the
module-level ``ExtensibleTensor`` name), MRV2's ``allocate_kv_cache`` with the cache's
``allocate`` hook (the patched site), its ``commit``/``committed_views``/``free``, its
``Worker.sleep``/``wake_up``/``discard`` (levels 1 and 2, ``CuMemBackend`` over a recording
allocator), its ``kv_cache_lent_for_weight_update``; slot mappings and rows come from its
``PCPManager`` (``tests.test_vllm_pcp``). What needs CUDA is replayed in the worker's order
(``Worker.initialize_from_config``, ``compile_or_warm_up_model``, ``extend_kv_cache``): the
warmup commits, the two shrink-remaps before capture, the extend to a budget below the reserved
capacity; no CUDA graph is captured on the CPU.

The reference is vLLM's unpatched gather (its gloo all-gather) with the rows inserted at its
slots into a plain allocation of the same padded config; every replica equals it over every
segment's committed bytes after every step, direct publication and gather fallback.
"""

from __future__ import annotations

import pytest

from tests.helpers import vllm_marks
from tests.test_vllm_pcp import BS, LAYERS, MIXES, NUM_BLOCKS, _call_sites, _pcp_step
from tests.test_vllm_pcp import _vllm_reference as _reference
from vmmkv.testing.spawn import run_world

pytestmark = vllm_marks()

CAPACITY = NUM_BLOCKS + 11  # reserved by the planner; the measured budget is NUM_BLOCKS
WARMUP_BLOCKS = 9  # what warmup commits as it goes (a min over ranks in vLLM)
GRANULE = 2 << 20  # vLLM's granule floor (extensible_tensor.granule_size)


def _segments(ext):
    """(offset, committed bytes) of every segment of vLLM's cache."""
    n = ext.num_committed_blocks
    return [(o, n * s) for o, s in zip(ext.segment_offsets, ext.segment_strides, strict=True)]


def _committed_equal(got, want, ext):
    """(every segment's committed bytes equal, how many bytes differ)."""
    diff = sum(int((got[o : o + n] != want[o : o + n]).sum()) for o, n in _segments(ext))
    return diff == 0, diff


def _stores(views, plain, vc, pcp, prank, pcp_size, seed0, dcps):
    """Every DCP x step mix through vLLM's call sites and the reference."""
    import torch.distributed as dist

    for n, (dcp, mix) in enumerate((d, m) for d in dcps for m in MIXES):
        for layer in range(LAYERS):
            step = _pcp_step(mix, layer, seed0 + 100 * n + 1, prank, pcp_size, dcp)
            _call_sites(views, layer, *step, pcp_size)
            _reference(vc, plain, layer, *step)
        dist.barrier(group=pcp.cpu_group)


def _lend(ext, short_ranks, fail_ranks, prank):
    """vLLM's kv_cache_lent_for_weight_update with this rank's free memory short (or far too
    short, with nothing reclaimable) when named: (what happened, committed inside, after)."""
    from contextlib import ExitStack
    from unittest import mock

    from vllm.v1.worker import extensible_kv_cache as ekc

    gib = 1 << 30
    free = gib if prank in short_ranks else (gib // 8 if prank in fail_ranks else 100 * gib)
    inside = None
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(ekc, "device_memory_info", lambda *a: (free, 0)))
        stack.enter_context(mock.patch.object(ekc, "max_layer_reload_bytes", lambda *a: gib // 2))
        for name in ("memory_reserved", "memory_allocated"):
            stack.enter_context(mock.patch(f"torch.accelerator.{name}", lambda *a: 0))
        stack.enter_context(mock.patch("torch.accelerator.empty_cache", lambda *a: None))
        try:
            with ekc.kv_cache_lent_for_weight_update(
                ext, None, reclaimable=not fail_ranks, fail_if_short=True
            ):
                inside = ext.buffer.cache.committed_blocks
            what = "ok"
        except RuntimeError as exc:
            what = str(exc)
    return what, inside, ext.buffer.cache.committed_blocks


def _sleep_wake(cfg, ext, vc, got, want, views, plain, pcp, world):
    """Sleep levels 1 and 2 and a kv_cache discard through vLLM's real ``Worker`` methods (a
    worker built without ``__init__``, ``tests.test_vllm_sleep._worker``), vLLM's ``CuMemBackend``
    over a recording allocator: per phase the committed blocks and physical bytes, whether the
    woken blocks read zero, the stores after the wake equal to the reference, and what the
    allocator saw (with the blocks committed at that moment)."""
    import vllm.device_allocator as dalloc

    from tests.test_vllm_sleep import _HostAccelerator, _RecordingAllocator, _worker

    prank = pcp.rank_in_group
    rec = _RecordingAllocator(vc)
    real = dalloc.get_mem_allocator_instance
    dalloc.get_mem_allocator_instance = lambda: rec
    seen = {}
    try:
        with _HostAccelerator():
            cfg.model_config.sleep_mode_backend = "cumem"
            worker = _worker(cfg)
            worker.model_runner.extensible_kv_cache = ext

            def phase(name):
                seen[name] = (vc.committed_blocks, ext.buffer.physical_bytes)

            def awake(name, seed):
                phase(name)
                seen[name + ": zeroed"] = all(
                    int(got[o : o + n].count_nonzero()) == 0 for o, n in _segments(ext)
                )
                for off, nbytes in _segments(ext):
                    want[off : off + nbytes].zero_()
                pcp_barrier(pcp)  # every replica checked before a peer publishes again
                _stores(views, plain, vc, pcp, prank, world, seed, (1,))
                seen[name + ": equal"] = _committed_equal(got, want, ext)

            worker.sleep(level=1)
            phase("asleep 1")
            worker.wake_up(["weights"])
            phase("weights awake")
            worker.wake_up(["kv_cache"])
            awake("kv awake", 5000)
            worker.sleep(level=2)
            phase("asleep 2")
            worker.wake_up()
            awake("awake 2", 6000)
            worker.discard(("kv_cache",))  # EngineCore.release_kv_cache_memory
            phase("discarded")
            worker.wake_up(["kv_cache"])
            awake("rewoken", 7000)
    finally:
        dalloc.get_mem_allocator_instance = real
    seen["allocator"] = rec.calls
    return seen


def pcp_barrier(pcp):
    import torch.distributed as dist

    dist.barrier(group=pcp.cpu_group)


def _scenario(rank, world, port, runs, dcps):
    import copy
    import os

    import torch
    import torch.distributed as dist
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker import extensible_kv_cache as ekc
    from vllm.v1.worker import utils as worker_utils
    from vllm.v1.worker.gpu import attn_utils

    from tests.test_vllm_pcp import _flat
    from vmmkv.integrations import vllm as integration
    from vmmkv.integrations.vllm._buffer import PeerKVBuffer
    from vmmkv.testing.vllm import configs

    cfg = configs.vllm_config("LBNHC", CAPACITY, pcp=world)
    cpu = torch.device("cpu")
    out = {}
    with configs.vllm_groups(cfg, rank, world, port) as ps:
        pcp = ps.get_pcp_group()
        prank = pcp.rank_in_group
        for layout, direct in runs:
            os.environ["VMMKV_DIRECT"] = "1" if direct else "0"
            lay = KVCacheLayout[layout]
            rep = {}
            _, config = configs.build_kv_cache_config(layout, CAPACITY, pcp=world)
            # Worker.initialize_from_config pads the layer regions onto granules
            config = ekc.pad_kv_cache_segments(config, lay, GRANULE)
            size = config.kv_cache_tensors[0].size
            with set_current_vllm_config(cfg), integration.patched():
                # MRV2 initialize_kv_cache(extensible=True), then init_kv_cache -> allocate hook
                ext = ekc.ExtensibleKVCache(config, cpu, lay)
                rep["buffer"] = type(ext.buffer).__name__
                assert isinstance(ext.buffer, PeerKVBuffer), rep
                vc = ext.buffer.cache
                rep["path"] = vc.cache.path
                rep["kinds"] = sorted({b.kind for b in vc.bindings.values()})
                views = attn_utils.allocate_kv_cache(config, cpu, lay, [BS], allocate=ext.allocate)
                rep["after allocate"] = (ext.num_committed_blocks, vc.committed_blocks,
                                         ext.min_committed_blocks)  # fmt: skip
                rep["active is the buffer's"] = integration.active_cache() is vc
                # compile_or_warm_up_model: warmup commits, then two shrink-remaps to the minimum
                ext.commit(WARMUP_BLOCKS)
                rep["warmup"] = vc.committed_blocks
                ext.commit(ext.min_committed_blocks, shrink=True)
                ext.commit(ext.min_committed_blocks, shrink=True)
                rep["before capture"] = vc.committed_blocks
                # extend_kv_cache to the measured budget (the same on every rank: a min-reduce)
                budget = copy.copy(config)  # what extend_kv_cache hands a connector
                budget.num_blocks = NUM_BLOCKS
                budget.kv_cache_tensors = ext.committed_kv_cache_tensors(budget, lay, NUM_BLOCKS)
                ext.commit(NUM_BLOCKS, defragment=False, shrink=True)
                runner_config = copy.copy(config)  # the runner's, num_blocks set to the commit
                runner_config.num_blocks = ext.num_committed_blocks
                committed = ext.committed_views(runner_config, lay, [BS])
                views = {n: (committed or {}).get(n, v) for n, v in views.items()}
                rep["extended"] = (ext.num_committed_blocks, vc.committed_blocks,
                                   ext.buffer.physical_bytes)  # fmt: skip
                rep["bytes of blocks"] = NUM_BLOCKS * ext.bytes_per_block
                # vLLM's own estimate of a commit's memory, from the buffer's granularity
                rep["vllm's estimate"] = ext.physical_bytes_for(NUM_BLOCKS)
                rep["view blocks"] = sorted({v.shape[0] for v in views.values()})
                # vLLM's ExtensibleTensor documents both views as uint8
                rep["view dtypes"] = sorted(
                    {str(ext.buffer.full_view().dtype)}
                    | {
                        str(ext.buffer.segment_view(i).dtype)
                        for i in range(len(ext.segment_offsets))
                    }
                )
                rep["rebound"] = committed is not None  # None: layers span several segments
                plain = worker_utils.allocate_kv_cache(config, cpu, lay, [BS])
                want = _flat(next(iter(plain.values())), size)
                got = vc.buffer.view(torch.uint8)
                poison = torch.randint(1, 256, (size,), dtype=torch.uint8,
                                       generator=torch.Generator().manual_seed(7))  # fmt: skip
                for off, nbytes in _segments(ext):
                    got[off : off + nbytes].copy_(poison[off : off + nbytes])
                want.copy_(poison)
                dist.barrier(group=pcp.cpu_group)
                _stores(views, plain, vc, pcp, prank, world, 0, dcps)
                rep["extended: equal"] = _committed_equal(got, want, ext)
                # vLLM's own Worker.sleep/wake_up/discard with its default backend (cumem):
                # the worker releases and recommits the cache around the backend
                rep["sleep"] = _sleep_wake(cfg, ext, vc, got, want, views, plain, pcp, world)
                # weight-update lending: one rank short -> every rank lends; one rank failing
                # -> every rank raises and none releases
                rep["lend: one short"] = _lend(ext, {world - 1}, set(), prank)
                rep["lend: none short"] = _lend(ext, set(), set(), prank)
                rep["lend: one failing"] = _lend(ext, set(), {1}, prank)
                # MRV2's shutdown frees the cache (local)
                ext.free()
                rep["freed"] = (integration.active_cache() is None, vc.cache.closed)
            out[f"{layout}/{'direct' if direct else 'gather'}"] = rep
    return out


def _pcp1(rank, world, port):
    """PCP = 1: vLLM's own ExtensibleTensor is built (it refuses a CPU device by itself)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker import extensible_kv_cache as ekc

    from vmmkv.integrations import vllm as integration
    from vmmkv.testing.vllm import configs

    cfg = configs.vllm_config("LBNHC", CAPACITY)
    with configs.vllm_groups(cfg, rank, world, port):
        _, config = configs.build_kv_cache_config("LBNHC", CAPACITY)
        with set_current_vllm_config(cfg), integration.patched():
            try:
                ekc.ExtensibleKVCache(config, torch.device("cpu"), KVCacheLayout.LBNHC)
                return {"built": True, "active": integration.active_cache()}
            except ValueError as exc:
                return {"built": str(exc), "active": integration.active_cache()}


def _check(rep, world, direct):
    assert rep["buffer"] == "PeerKVBuffer" and rep["path"] == ("direct" if direct else "gather")
    assert rep["kinds"] == ["fp8_ds_mla_ue8m0", "indexer_k"]
    mn = rep["after allocate"][2]
    assert rep["after allocate"] == (mn, mn, mn) and rep["active is the buffer's"]
    assert rep["warmup"] == WARMUP_BLOCKS and rep["before capture"] == mn
    blocks, vblocks, physical = rep["extended"]
    assert (blocks, vblocks) == (NUM_BLOCKS, NUM_BLOCKS)
    assert rep["bytes of blocks"] <= physical == rep["vllm's estimate"], rep
    assert rep["view blocks"] == [NUM_BLOCKS if rep["rebound"] else CAPACITY], rep
    assert rep["view dtypes"] == ["torch.uint8"], rep["view dtypes"]
    assert rep["extended: equal"] == (True, 0), rep["extended: equal"]
    sleep = rep["sleep"]
    for name in ("asleep 1", "weights awake", "asleep 2", "discarded"):
        assert sleep[name] == (0, 0), (name, sleep[name])
    for name in ("kv awake", "awake 2", "rewoken"):
        assert sleep[name] == (NUM_BLOCKS, physical), (name, sleep[name], physical)
        assert sleep[name + ": zeroed"] and sleep[name + ": equal"] == (True, 0), name
    tags = ("weights", "runtime", "cudagraph")  # vLLM's CuMemBackend at every level
    assert sleep["allocator"] == [
        ("sleep", tags, 0), ("wake_up", ["weights"], 0), ("wake_up", ["kv_cache"], 0),
        ("sleep", tags, 0), ("wake_up", None, 0),
        ("discard", ("kv_cache",), 0), ("wake_up", ["kv_cache"], 0),
    ], sleep["allocator"]  # fmt: skip
    assert rep["lend: one short"] == ("ok", 0, NUM_BLOCKS), rep["lend: one short"]
    assert rep["lend: none short"] == ("ok", NUM_BLOCKS, NUM_BLOCKS)
    what, inside, after = rep["lend: one failing"]
    assert inside is None and after == NUM_BLOCKS, rep["lend: one failing"]
    assert "cannot borrow the KV cache's memory on PCP ranks [1]" in what, what
    assert "no rank released it" in what and "rank 1: Updating weights" in what, what
    assert rep["freed"] == (True, True)


@pytest.mark.timeout(900)
def test_two_pcp_ranks_under_vllms_extensible_cache_follow_its_call_order_byte_equal(world_store):
    runs = [("LBNHC", True), ("BLNHC", True), ("LBHNC", False)]
    out = run_world(_scenario, 2, args=(world_store.port, runs, (1, 2)), init_group=False,
                    env=world_store.env,
                    timeout=840)  # fmt: skip
    for rank in range(2):
        for layout, direct in runs:
            _check(out[rank][f"{layout}/{'direct' if direct else 'gather'}"], 2, direct)


@pytest.mark.timeout(900)
def test_four_pcp_ranks_under_vllms_extensible_cache_follow_its_call_order_byte_equal(world_store):
    runs = [("LBNHC", True), ("BLHNC", False)]
    out = run_world(_scenario, 4, args=(world_store.port, runs, (1,)), init_group=False,
                    env=world_store.env,
                    timeout=840)  # fmt: skip
    for rank in range(4):
        for layout, direct in runs:
            _check(out[rank][f"{layout}/{'direct' if direct else 'gather'}"], 4, direct)


@pytest.mark.timeout(300)
def test_pcp_size_one_keeps_vllms_own_extensible_tensor(world_store):
    out = run_world(
        _pcp1, 1, args=(world_store.port,), init_group=False, env=world_store.env, timeout=240
    )
    assert out[0] == {"built": "ExtensibleTensor requires a cuda device, got cpu.",
                      "active": None}  # fmt: skip


# -- elastic KV on vLLM's extensible KV cache ----------------------------------------------------
#
# The "ranks" trace of tests/test_vllm_elastic_ranks.py (its knobs, its per-rank worker step and
# checks), with the cache built by vLLM's ExtensibleKVCache in the worker's order and extended
# through vLLM's Worker.extend_kv_cache (the patched site): the reserved capacity is EL_CAPACITY,
# the budget measured after capture (the same on every rank) the trace's 128 blocks, and the
# scheduler is built as EngineCore builds it, from the config vLLM's finalize_extensible_kv_cache
# shrank to the budget. At the second idle release the engine sleeps first (vLLM's Worker.sleep:
# the cache released), the pool's idle release reaches the sleeping workers, then vLLM's
# Worker.wake_up recommits.

EL_CAPACITY = 139  # reserved by the planner; the ranks trace's 128 blocks fit after capture


def _extend_replay(runner, kv_cache_config, num_blocks):
    """vLLM's ``extend_kv_cache`` as far as it runs without a device or a forward context: the
    commit of the budget (a shrink-remap when warmup committed more), the runner's count, the
    views re-built over the committed blocks at the same addresses."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    ext = runner.extensible_kv_cache
    lay = KVCacheLayout[kv_cache_config.kv_cache_layout]
    ext.commit(num_blocks, defragment=False, shrink=True)
    runner.kv_cache_config.num_blocks = ext.num_committed_blocks
    committed = ext.committed_views(runner.kv_cache_config, lay, [BS])
    runner.views = {n: (committed or {}).get(n, v) for n, v in runner.views.items()}


def _elastic_rank_class():
    from tests.test_vllm_elastic_ranks import _blocks, _Rank

    class _ExtRank(_Rank):
        """A rank of the ranks trace whose cache is vLLM's ``ExtensibleKVCache`` over vmmkv;
        sleep and wake through vLLM's own ``Worker``."""

        def step(self, n, blob):
            stamp = super().step(n, blob)
            if self.ext.num_committed_blocks != self.vc.committed_blocks:
                self.problems.append(
                    f"step {n}: vLLM counts {self.ext.num_committed_blocks} committed blocks, "
                    f"vmmkv holds {self.vc.committed_blocks}"
                )
            return stamp

        def sleep_idle(self, n, seq, target):
            """vLLM's Worker.sleep (its extensible cache released), the pool's idle release
            while asleep (the engine's ``collective_rpc`` body), vLLM's Worker.wake_up (its
            recommit): what every phase left committed and mapped."""
            import vllm.device_allocator as dalloc

            from tests.test_vllm_scale import _mapped
            from tests.test_vllm_sleep import _HostAccelerator, _RecordingAllocator
            from vmmkv.integrations.vllm import _elastic_worker as worker_side

            vc, ext, w = self.vc, self.ext, self.worker
            rec, real = _RecordingAllocator(vc), dalloc.get_mem_allocator_instance
            dalloc.get_mem_allocator_instance = lambda: rec
            seen = {"before": (vc.committed_blocks, ext.num_committed_blocks)}
            try:
                with _HostAccelerator():
                    w.sleep(level=1)
                    seen["asleep"] = {"blocks": vc.committed_blocks, **_mapped(vc)}
                    stamp = worker_side.worker_resize(None, seq, target)
                    seen["idle asleep"] = {"blocks": vc.committed_blocks, **_mapped(vc),
                                           "vllm": ext.num_committed_blocks}  # fmt: skip
                    w.wake_up(None)
            finally:
                dalloc.get_mem_allocator_instance = real
            seen["stamps"] = self.gather(stamp)
            seen["awake"] = (vc.committed_blocks, ext.num_committed_blocks)
            seen["zeroed"] = all(
                int(b.count_nonzero()) == 0 for b in _blocks(self.got, vc, 0, vc.committed_blocks)
            )
            for b in _blocks(self.want, vc, 0, vc.committed_blocks):  # a recommit zeroes
                b.zero_()
            seen["step"], seen["calls"] = n, rec.calls
            self.events["sleep"] = seen
            self.agree(f"wake at step {n}", (n, seq, vc.committed_blocks))
            return stamp

    return _ExtRank


def _elastic_one_run(ps, world, async_depth):
    import copy
    import pickle
    from unittest import mock

    import torch
    import torch.distributed as dist
    from vllm.config import set_current_vllm_config
    from vllm.utils import torch_utils
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker import extensible_kv_cache as ekc
    from vllm.v1.worker import gpu_worker
    from vllm.v1.worker import utils as worker_utils
    from vllm.v1.worker.gpu import attn_utils

    from tests.test_vllm_elastic_ranks import LAYERS, SEQS, TOKENS, _poison, _scheduled
    from tests.test_vllm_elastic_ranks import NUM_BLOCKS as BUDGET
    from tests.test_vllm_pcp import _flat
    from tests.test_vllm_sleep import _worker
    from tests.test_vllm_zero_grow import _HostZeroKernel, _zeroer
    from vmmkv.integrations import vllm as integration
    from vmmkv.integrations.vllm import _install
    from vmmkv.testing.vllm import configs
    from vmmkv.testing.vllm.trace import TraceRun

    cfg, config = configs.build_kv_cache_config("BLNHC", EL_CAPACITY, LAYERS, pcp=world)
    sc = cfg.scheduler_config
    sc.max_num_batched_tokens, sc.max_num_seqs = TOKENS, SEQS
    sc.async_scheduling = async_depth > 1
    cfg.model_config.sleep_mode_backend = "cumem"
    cpu, lay = torch.device("cpu"), KVCacheLayout.BLNHC
    config = ekc.pad_kv_cache_segments(config, lay, GRANULE)  # Worker.initialize_from_config
    real_kernel = worker_utils._zero_kv_blocks_kernel
    worker_utils._zero_kv_blocks_kernel = _HostZeroKernel()
    torch_utils.PIN_MEMORY = False
    try:
        with set_current_vllm_config(cfg), integration.patched():
            # MRV2's initialize_kv_cache, warmup commits and the two shrink-remaps before capture
            ext = ekc.ExtensibleKVCache(config, cpu, lay)
            vc = ext.buffer.cache
            views = attn_utils.allocate_kv_cache(config, cpu, lay, [BS], allocate=ext.allocate)
            ext.commit(WARMUP_BLOCKS)
            ext.commit(ext.min_committed_blocks, shrink=True)
            ext.commit(ext.min_committed_blocks, shrink=True)
            # EngineCore: executor.extend_kv_cache(budget) -> every worker's Worker.extend_kv_cache
            w = _worker(cfg)
            w.cache_config, w._kv_cache_config = cfg.cache_config, config
            w.model_runner.extensible_kv_cache = ext
            w.model_runner.kv_cache_config = copy.copy(config)
            w.model_runner.views = views
            with mock.patch.object(gpu_worker, "extend_kv_cache", _extend_replay):
                w.extend_kv_cache(BUDGET)
            views = w.model_runner.views
            extended = (ext.num_committed_blocks, vc.committed_blocks,
                        sorted({v.shape[0] for v in views.values()}),
                        cfg.cache_config.num_gpu_blocks)  # fmt: skip
            plain = worker_utils.allocate_kv_cache(config, cpu, lay, [BS])
            want = _flat(next(iter(plain.values())), config.kv_cache_tensors[0].size)
            zeroer = _zeroer(w.model_runner.kv_cache_config, views)  # over the re-built views
            r = _elastic_rank_class()(ps, vc, views, plain, want, zeroer, cfg,
                                      None)  # fmt: skip
            r.ext, r.worker = ext, w
            r.events["extended"] = extended
            _poison(r)
            dist.barrier(group=r.group)
            if r.rank == 0:
                _install.install_engine()
                run = TraceRun(trace="ranks", seed=0, num_blocks=EL_CAPACITY, budget=BUDGET,
                               async_depth=async_depth, world=world, layers=LAYERS,
                               max_num_batched_tokens=TOKENS, max_num_seqs=SEQS)  # fmt: skip
                run.build()
                el, sched = run.el, []
                r.events["pool at start"] = (el.limit, el.s.num_blocks, el.s.floor)

                def on_step(so):
                    n = len(run.steps)
                    sched.append((n, el.limit, el.counts["grows"], *_scheduled(so)))
                    msg = ("step", n, pickle.dumps(so))
                    r.broadcast(msg)
                    return r.step(n, msg[2])

                def on_idle(resize):
                    n = len(run.steps)
                    if len(run.idle_releases) == 2:  # EngineCore.sleep, idle, wake_up
                        r.events["reset_prefix_cache"] = run.scheduler.reset_prefix_cache()
                        r.broadcast(("sleep_idle", n, *resize))
                        stamp = r.sleep_idle(n, *resize)
                        r.events["limit at wake"] = el.limit
                        return stamp
                    r.broadcast(("idle", n, *resize))
                    return r.idle(n, *resize)

                try:
                    run.run(on_step=on_step, on_idle=on_idle)
                finally:
                    r.broadcast(("lend",))
                    r.events["lend"] = _lend(ext, {world - 1}, set(), r.rank)
                    r.broadcast(("done",))
                r.events["scheduler"] = {
                    "floor": el.s.floor, "counts": dict(el.counts), "limit": el.limit,
                    "idle_releases": run.idle_releases, "left": len(run.scheduler.requests),
                    "steps": sched, "hit_tokens": run.hit_tokens,
                }  # fmt: skip
            else:
                while (msg := r.broadcast()) != ("done",):
                    if msg == ("lend",):
                        r.events["lend"] = _lend(ext, {world - 1}, set(), r.rank)
                    else:
                        getattr(r, msg[0])(*msg[1:])
            r.events["final"] = (vc.committed_blocks, ext.num_committed_blocks)
            ext.free()
            return {"records": r.records, "problems": r.problems, "events": r.events}
    finally:
        worker_utils._zero_kv_blocks_kernel = real_kernel


def _elastic_ranks(rank, world, port, async_depth):
    import torch.distributed as dist

    from tests.test_vllm_elastic_ranks import LAYERS
    from vmmkv.testing.vllm import configs

    cfg = configs.vllm_config("BLNHC", EL_CAPACITY, LAYERS, pcp=world)
    ps = configs.join_vllm_groups(cfg, rank, world, port)
    try:
        out = _elastic_one_run(ps, world, async_depth)
        dist.barrier(group=ps.get_world_group().cpu_group)
    finally:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()
    return out


def _check_elastic(out, world):
    from tests.test_vllm_elastic_ranks import NUM_BLOCKS as BUDGET

    for rank, o in enumerate(out):
        assert o["problems"] == [], (rank, o["problems"][:5])
    ev0 = out[0]["events"]
    s = ev0["scheduler"]
    floor = s["floor"]
    # after extend: every rank at the floor, vLLM's count with it, vLLM's views of the budget;
    # the pool starts at the same floor with the budget as its capacity
    for o in out:
        assert o["events"]["extended"] == (floor, floor, [BUDGET], BUDGET), o["events"]["extended"]
    assert ev0["pool at start"] == (floor, BUDGET, floor) and floor < BUDGET
    heads = [[rec[:4] for rec in o["records"]] for o in out]
    assert all(h == heads[0] for h in heads), "ranks saw different steps"
    assert heads[0][0][2] == floor  # the first stamp reports the floor
    assert max(rec[2] for rec in out[0]["records"]) <= BUDGET
    counts = s["counts"]
    assert counts["grows"] >= 3 and counts["releases"] >= 2 and counts["refused"] == 0, counts
    assert s["left"] == 0 and s["hit_tokens"] > 0
    assert len(s["idle_releases"]) >= 2
    assert ev0["reset_prefix_cache"] is True
    for o in out:
        sl = o["events"]["sleep"]
        before, _ = sl["before"]
        assert before > floor, sl  # the cache had grown: vLLM's own count would recommit more
        assert sl["asleep"] == {"blocks": 0, "own": [], "peers": [[]] * (world - 1)}, sl
        # the idle release reached the sleeping worker: nothing committed, vLLM's count retargeted
        assert sl["idle asleep"] == {"blocks": 0, "own": [], "peers": [[]] * (world - 1),
                                     "vllm": floor}, sl  # fmt: skip
        assert [st[1] for st in sl["stamps"]] == [floor] * world, sl["stamps"]
        assert sl["awake"] == (floor, floor) and sl["zeroed"], sl
        assert [c[0] for c in sl["calls"]] == ["sleep", "wake_up"], sl["calls"]
        # lending for a weight update: every rank lends, vLLM's recommit restores the size
        final, vllm_count = o["events"]["final"]
        assert o["events"]["lend"] == ("ok", 0, final) and vllm_count == final, o["events"]
    assert ev0["limit at wake"] == floor
    assert s["limit"] == out[0]["events"]["final"][0]  # the scheduler's limit == committed
    wake = ev0["sleep"]["step"]
    assert any(n > wake and tokens for n, *_, tokens in out[0]["records"])  # the trace went on


def _elastic_world(world, async_depth):
    """The elastic replay over ``world`` ranks under vLLM's scheduler (``async_depth`` 1: sync,
    2: async), checked by :func:`_check_elastic`."""
    from tests.test_vllm_elastic_ranks import KNOBS
    from vmmkv.testing.spawn import world_store

    with world_store() as store:
        out = run_world(_elastic_ranks, world, args=(store.port, async_depth), init_group=False,
                        env={**KNOBS, **store.env}, timeout=560)  # fmt: skip
    _check_elastic(out, world)


@pytest.mark.timeout(600)
def test_elastic_kv_under_vllms_extensible_cache_starts_at_the_floor_and_follows_the_scheduler():
    _elastic_world(2, 2)


@pytest.mark.timeout(600)
def test_elastic_kv_under_vllms_extensible_cache_over_three_ranks_with_the_sync_scheduler():
    _elastic_world(3, 1)  # three ranks in the default run (four: the long case below)


@pytest.mark.timeout(600)
def test_elastic_kv_under_vllms_extensible_cache_over_four_ranks_with_the_async_scheduler():
    # four ranks: every rank's check reads its replica before the gather that lets its peers
    # into their next step's direct stores (tests/test_vllm_elastic_ranks.py, _Rank.agree)
    _elastic_world(4, 2)
