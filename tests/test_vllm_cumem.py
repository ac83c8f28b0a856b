"""vmmkv's bookkeeping and vLLM 0.34.0's CuMem sleep allocator (CPU, host backend, 2 PCP ranks).

With ``enable_cumem_allocator`` on (``enable_sleep_mode`` turns it on), vLLM's worker builds the
KV cache inside ``CuMemAllocator.use_memory_pool(tag="runtime")`` and, nested,
``use_memory_pool(tag="kv_cache")`` (``v1/worker/gpu_worker.py``, ``initialize_from_config``,
then MRV2's ``init_kv_cache``). What is allocated there is CuMem memory, and vLLM's default
sleep backend discards the ``kv_cache`` tag without a backup. The plugin builds vmmkv's cache
outside those pools; this module checks that vmmkv's tables (peer pointer and signal tables,
local and committed tables, error counter) are not CuMem allocations and come back unchanged
from a sleep under vLLM's ``cumem`` backend and under the plugin's ``vmmkv`` backend.

vLLM's own code runs: ``CuMemAllocator`` (``use_memory_pool``, its malloc callback, ``sleep``,
``wake_up``), ``CuMemBackend`` and ``SleepModeBackendFactory``, MRV2's ``init_kv_cache`` with the
plugin's ``allocate_kv_cache``, PyTorch's ``use_mem_pool``. Stand-ins, for what the CPU lacks,
all below vLLM:

- the CUDA driver calls under CuMem: ``create_and_map`` maps fresh memory (filled with
  ``POISON``, as uninitialized device memory may read), ``unmap_and_release`` does nothing,
  ``cudaMemcpy`` is ``memmove``; ``torch.accelerator`` sync and cache calls do nothing;
- PyTorch's CUDA pool routing (:class:`_TorchPools`): the caching allocator's list of pools
  routing a thread's allocations (``_cuda_beginAllocateCurrentThreadToPool`` appends,
  ``_cuda_endAllocateToPool`` removes or raises when absent, ``_cuda_releasePool`` drops a
  reference; the first entry of the current thread serves an allocation), ``MemPool`` and the
  pluggable allocator, whose malloc is the callback vLLM registers through ``init_module``. A
  dispatch mode hands every new storage made on a routed thread to that callback and keeps it
  alive, as a pool segment is.

The control: a tensor the test allocates inside vLLM's own ``use_memory_pool(tag="kv_cache")``
comes back as ``POISON`` from the same sleep, so the stand-ins do discard that tag.
"""

from __future__ import annotations

import pytest

from tests.helpers import vllm_marks, vllm_world_fixture

pytestmark = vllm_marks()

BS, NUM_BLOCKS, LAYOUT = 64, 32, "LBNHC"
POISON = 0xA5


class _TorchPools:
    """PyTorch's routing of allocations to ``MemPool`` s on the CPU (see the module docstring):
    ``entries`` are (pool id, thread) in begin order, ``uses`` each pool's references (one held
    by the ``MemPool`` itself)."""

    def __init__(self):
        self.entries = []
        self.uses = {}
        self.pools = {}
        self.callbacks = {}
        self.kept = []

    def begin(self, device, pool_id):
        import threading

        pid = tuple(pool_id)
        if any(p == pid for p, _ in self.entries):
            raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
        self.uses[pid] += 1
        self.entries.append((pid, threading.get_ident()))

    def end(self, device, pool_id):
        pid = tuple(pool_id)
        for i, (p, _) in enumerate(self.entries):
            if p == pid:
                del self.entries[i]
                return
        raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    def release(self, device, pool_id):
        pid = tuple(pool_id)
        self.uses[pid] -= 1
        assert self.uses[pid] >= 0, pid

    def routed(self):
        """The pool serving the current thread's allocations, or None."""
        import threading

        me = threading.get_ident()
        for pid, thread in self.entries:
            if thread == me:
                return self.pools[pid]
        return None

    def install(self):
        """Stand in for PyTorch's CUDA pool calls and vLLM's C extension (no device here)."""
        import itertools

        import torch
        import torch.cuda.memory as tcm
        from vllm.device_allocator import cumem

        counter = itertools.count(1)
        routing = self

        class MemPool:
            def __init__(self, allocator=None, *args):
                self.allocator = allocator
                self.id = (0, next(counter))
                routing.pools[self.id] = self
                routing.uses[self.id] = 1

            def snapshot(self, include_traces=True):
                return []  # nothing freed inside a pool here: CuMem's trim finds nothing

        class PluggableAllocator:
            def __init__(self, path, alloc_fn_name, free_fn_name):
                self._allocator = dict(routing.callbacks)

        def init_module(malloc, free):
            routing.callbacks.update(malloc=malloc, free=free)

        tcm._cuda_beginAllocateCurrentThreadToPool = self.begin
        tcm._cuda_endAllocateToPool = self.end
        tcm._cuda_releasePool = self.release
        tcm.MemPool = MemPool
        tcm.CUDAPluggableAllocator = PluggableAllocator
        torch.cuda.current_device = lambda: 0
        torch.cuda.is_current_stream_capturing = lambda: False
        cumem.init_module = init_module
        cumem.lib_name = "cumem_allocator (stand-in)"

    def mode(self):
        """A dispatch mode: each new storage allocated while a pool routes this thread goes to
        that pool's malloc callback (vLLM's), with handle (device 0, bytes, address, 0)."""
        import torch
        from torch.utils import _pytree as pytree
        from torch.utils._python_dispatch import TorchDispatchMode

        routing = self
        fresh_ops = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)

        class Route(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                pool = routing.routed()
                leaves = pytree.tree_leaves((args, kwargs))
                # torch.tensor(data) allocates before dispatch; lift_fresh hands it over
                inputs = set() if func in fresh_ops else {
                    t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)
                }  # fmt: skip
                out = func(*args, **kwargs)
                if pool is None:
                    return out
                for t in pytree.tree_leaves(out):
                    if not isinstance(t, torch.Tensor):
                        continue
                    storage = t.untyped_storage()
                    ptr = storage.data_ptr()
                    if ptr and ptr not in inputs:
                        pool.allocator["malloc"]((0, storage.nbytes(), ptr, 0))
                        routing.kept.append(t)
                return out

        return Route()


def _driver_stand_ins():
    """CuMem's driver calls and torch.accelerator on the host (module docstring)."""
    import ctypes
    from types import SimpleNamespace

    import torch
    from vllm.device_allocator import cumem

    cumem.cumem_available = True
    cumem.create_and_map = lambda h: ctypes.memset(h[2], POISON, h[1])
    cumem.unmap_and_release = lambda h: None
    cumem.libcudart = SimpleNamespace(
        cudaMemcpy=lambda dst, src, n: ctypes.memmove(dst, src, n),
        cudaMemset=lambda p, v, n: ctypes.memset(p, v, n),
    )
    cumem.PIN_MEMORY = False
    torch.accelerator.empty_cache = lambda *a, **k: None
    torch.accelerator.synchronize = lambda *a, **k: None


def _tables(vc):
    """vmmkv's small tensors of the cache ``vc`` (host backend: no device barrier)."""
    sr = vc.cache.region
    return {
        "ptr_table": sr.peers.ptr_table,
        "signal_table": sr.peers.signal_table,
        "local_table": sr.local_table,
        "committed_table": sr.committed_table,
        "error_counter": vc.cache.error_counter,
    }


def _in_pool(allocator, tensor):
    """The tag of the CuMem allocation holding ``tensor``'s bytes, or None."""
    lo = tensor.untyped_storage().data_ptr()
    for ptr, data in allocator.pointer_to_data.items():
        if ptr <= lo < ptr + data.handle[1]:
            return data.tag
    return None


def _cumem_rank(rank, world, port):
    import sys

    sys.modules["vllm.cumem_allocator"] = None  # no libcuda: cumem.py's not-available branch

    import torch
    import torch.distributed as dist
    import vllm.device_allocator as dalloc
    from vllm.config import set_current_vllm_config
    from vllm.device_allocator import cumem
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker import extensible_kv_cache as ekc
    from vllm.v1.worker.gpu import attn_utils

    from vmmkv.integrations import vllm as integration
    from vmmkv.testing.vllm import configs

    with configs.vllm_groups(configs.vllm_config(LAYOUT, pcp=world), rank, world, port) as ps:
        cfg, config = configs.build_kv_cache_config(LAYOUT, NUM_BLOCKS, pcp=world)
        pcp = ps.get_pcp_group()
        routing = _TorchPools()
        _driver_stand_ins()
        routing.install()
        allocator = cumem.CuMemAllocator.get_instance()
        real_instance = dalloc.get_mem_allocator_instance
        dalloc.get_mem_allocator_instance = lambda: allocator  # the platform lookup (CUDA only)
        out = {}
        try:
            with set_current_vllm_config(cfg), integration.patched(), routing.mode():
                with allocator.use_memory_pool(tag="weights"):
                    weights = torch.arange(64, dtype=torch.int64)
                # Worker.initialize_from_config: runtime pool around, kv_cache pool for allocation
                with allocator.use_memory_pool(tag="runtime"):
                    outer = list(routing.entries)
                    attn_utils.init_kv_cache(
                        {}, config, torch.device("cpu"), [BS], cfg,
                        kv_cache_allocation_context=allocator.use_memory_pool(tag="kv_cache"),
                    )  # fmt: skip
                    out["entries after allocation"] = routing.entries == outer and len(outer) == 1
                    after = torch.zeros(8, dtype=torch.int64)
                    out["routed after allocation"] = _in_pool(allocator, after)
                with allocator.use_memory_pool(tag="kv_cache"):
                    control = torch.arange(16, dtype=torch.int64)
                out["uses"] = sorted(set(routing.uses.values()))
                vc = integration.active_cache()
                tables = _tables(vc)
                good = {k: t.clone() for k, t in tables.items()}
                want_control, want_weights = control.clone(), weights.clone()
                out["in pool"] = {k: _in_pool(allocator, t) for k, t in tables.items()}
                out["control in pool"] = _in_pool(allocator, control)

                def unchanged():
                    return sorted(k for k, t in tables.items() if torch.equal(t, good[k]))

                # vLLM's default backend, as LLM.sleep() reaches it with the allocator on
                cfg.model_config.sleep_mode_backend = "cumem"
                cumem_backend = SleepModeBackendFactory.create_backend(cfg.model_config)
                cumem_backend.suspend(())
                cumem_backend.resume(None)
                out["cumem backend"] = type(cumem_backend).__name__
                out["cumem: unchanged"] = unchanged()
                out["cumem: control poisoned"] = bool((control.view(torch.uint8) == POISON).all())
                out["cumem: weights kept"] = torch.equal(weights, want_weights)
                control.copy_(want_control)
                for k, t in tables.items():  # a failure above must not spill into the next run
                    t.copy_(good[k])
                dist.barrier(group=pcp.cpu_group)

                # the plugin's backend: the KV released and restored, the tables kept
                cfg.model_config.sleep_mode_backend = "vmmkv"
                backend = SleepModeBackendFactory.create_backend(cfg.model_config)
                blocks = vc.committed_blocks
                backend.suspend(())
                out["vmmkv: asleep blocks"] = vc.committed_blocks
                backend.resume(["weights"])
                backend.resume(["kv_cache"])
                out["vmmkv backend"] = type(backend).__name__
                out["vmmkv: blocks"] = (blocks, vc.committed_blocks)
                out["vmmkv: unchanged"] = unchanged()
                out["vmmkv: weights kept"] = torch.equal(weights, want_weights)
                out["tables"] = sorted(tables)
                dist.barrier(group=pcp.cpu_group)

                # a pool of CuMem's allocator that its pool list does not hold routes this thread:
                # the escape cannot see it, the tables land in CuMem, and the allocation is refused
                unlisted = torch.cuda.memory.MemPool(
                    cumem.get_pluggable_allocator(
                        allocator.python_malloc_callback, allocator.python_free_callback
                    )._allocator
                )
                allocator.current_tag = "kv_cache"
                try:
                    with torch.cuda.memory.use_mem_pool(unlisted):
                        attn_utils.allocate_kv_cache(
                            config, torch.device("cpu"), KVCacheLayout[LAYOUT], [BS]
                        )
                    out["unlisted pool"] = ""
                except RuntimeError as exc:
                    out["unlisted pool"] = str(exc)
                finally:
                    allocator.current_tag = allocator.default_tag
                out["active after unlisted pool"] = integration.active_cache() is not None
                dist.barrier(group=pcp.cpu_group)

                # vLLM 0.34's extensible cache: built in the runtime pool by MRV2's
                # initialize_kv_cache, allocated through init_kv_cache's hook in the kv_cache pool
                lay = KVCacheLayout[LAYOUT]
                padded = ekc.pad_kv_cache_segments(config, lay, 2 << 20)
                with allocator.use_memory_pool(tag="runtime"):
                    ext = ekc.ExtensibleKVCache(padded, torch.device("cpu"), lay)
                    attn_utils.init_kv_cache(
                        {}, padded, torch.device("cpu"), [BS], cfg,
                        kv_cache_allocation_context=allocator.use_memory_pool(tag="kv_cache"),
                        allocate=ext.allocate,
                    )  # fmt: skip
                tables = _tables(ext.buffer.cache)
                good = {k: t.clone() for k, t in tables.items()}
                out["extensible: in pool"] = {k: _in_pool(allocator, t) for k, t in tables.items()}
                cumem_backend.suspend(())
                cumem_backend.resume(None)
                out["extensible: unchanged"] = unchanged()
                ext.free()
                dist.barrier(group=pcp.cpu_group)
        finally:
            dalloc.get_mem_allocator_instance = real_instance
    return out


cumem_run = vllm_world_fixture(_cumem_rank, 2, timeout=400)


@pytest.mark.timeout(450)
def test_vmmkvs_tables_are_no_cumem_allocations_when_vllm_builds_the_cache_in_its_pools(cumem_run):
    for got in cumem_run:
        assert got["control in pool"] == "kv_cache"  # vLLM's pool does take what is made there
        assert got["in pool"] == dict.fromkeys(got["tables"]), got["in pool"]


@pytest.mark.timeout(450)
def test_vmmkvs_tables_under_vllms_extensible_cache_are_no_cumem_allocations_and_survive_a_sleep(
    cumem_run,
):
    for rank in range(2):
        got = cumem_run[rank]
        assert got["extensible: in pool"] and not any(got["extensible: in pool"].values()), got
        assert got["extensible: unchanged"] == sorted(got["extensible: in pool"]), got


def test_vllms_pools_route_as_before_once_the_cache_is_built(cumem_run):
    """After the allocation the runtime pool routes this thread's allocations again (the
    kv_cache context has exited) and every pool holds only its MemPool's reference."""
    for got in cumem_run:
        assert got["entries after allocation"]
        assert got["routed after allocation"] == "runtime"
        assert got["uses"] == [1]


@pytest.mark.timeout(450)
def test_vmmkvs_tables_survive_a_sleep_under_vllms_cumem_backend(cumem_run):
    for got in cumem_run:
        assert got["cumem backend"] == "CuMemBackend"
        assert got["cumem: control poisoned"] and got["cumem: weights kept"]
        assert got["cumem: unchanged"] == got["tables"]


@pytest.mark.timeout(450)
def test_vmmkvs_tables_survive_a_sleep_under_the_vmmkv_backend(cumem_run):
    for got in cumem_run:
        assert got["vmmkv backend"] == "VmmkvSleepModeBackend"
        assert got["vmmkv: asleep blocks"] == 0 and got["vmmkv: blocks"] == (NUM_BLOCKS,) * 2
        assert got["vmmkv: unchanged"] == got["tables"] and got["vmmkv: weights kept"]


@pytest.mark.timeout(450)
def test_tables_that_still_reach_cumem_refuse_the_allocation_naming_the_rank_and_the_tag(
    cumem_run,
):
    for rank, got in enumerate(cumem_run):
        msg = got["unlisted pool"]
        assert msg.startswith(f"rank {rank} (cpu): allocate_kv_cache: vmmkv's KV-cache"), msg
        assert "reached vLLM's CuMem pool" in msg and "kv_cache: " in msg, msg
        assert "--enable-cumem-allocator" in msg, msg
        assert not got["active after unlisted pool"]
