"""What a CPU machine cannot run of vLLM 0.34's GPU engine, replaced so that the rest of it runs
unchanged: the stubs of the engine harness (``vmmkv.testing.vllm.engine``).

vLLM's own code runs everywhere else, from the engine core's ``EngineCoreProc`` (its busy loop,
``step`` and ``step_with_batch_queue``, its ``Scheduler`` or ``AsyncScheduler``) through its
``MultiprocExecutor`` (worker processes, shared-memory broadcast queue, ``collective_rpc``) to
the GPU ``Worker`` and MRV2's ``GPUModelRunner`` (request states, block tables, ``PCPManager``,
attention metadata builders, the sampler, vLLM's Triton kernels in Triton's interpreter on host
memory). Every replacement is listed in :data:`STUBS` with its reason, and :func:`install`
records each attribute it sets (:data:`REPLACED`); ``engine.foreign_objects`` finds every vmmkv
object installed in a vLLM module or class of a process, which the tests compare with this list
and the plugin's own sites (nothing else may be replaced).

:data:`ENV` must be in the environment before vLLM is imported: vLLM decides at import whether
Triton is usable (``CUDA_VISIBLE_DEVICES`` empty: "a distributed environment whose devices are
not visible yet"), and Triton's interpreter runs kernels on host tensors
(``TRITON_INTERPRET=1``). vLLM forks the engine core and its workers from the process that
installs the stubs (``VLLM_WORKER_MULTIPROC_METHOD=fork``), so they inherit them.

Local, not thread-safe; :func:`install` is idempotent and never undone (a harness process runs
one engine at a time and exits).
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ENV", "REPLACED", "STUBS", "HostAllocator", "install", "install_worker", "memory",
    "set_free_memory",
]  # fmt: skip

ENV = {
    "CUDA_VISIBLE_DEVICES": "",
    "TRITON_INTERPRET": "1",
    "VLLM_WORKER_MULTIPROC_METHOD": "fork",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
}

# (where, replaced by, why): the one list of what the harness replaces (docs, the stub test)
STUBS: tuple[tuple[str, str, str], ...] = (
    ("torch.cuda: Stream, Event, stream, current_stream, set_stream",
     "host stand-ins that order nothing", "a CPU has one stream; no CUDA driver here"),
    ("torch.accelerator: synchronize, empty_cache, reset_peak_memory_stats, memory_stats, "
     "memory_reserved, memory_allocated, max_memory_allocated, get_memory_info, "
     "current_device_index",
     "host answers: free memory from :func:`set_free_memory` minus vmmkv's memfd mappings",
     "device queries; no accelerator here"),
    ("vllm.platforms.current_platform: device_type, is_cuda_alike, is_pin_memory_available, "
     "get_current_memory_usage, num_compute_units, set_device, manual_seed_all, "
     "is_sleep_mode_available, is_cumem_allocator_available; vllm.utils.torch_utils.PIN_MEMORY",
     "'cpu', True, False, 0, 132, nothing, torch.manual_seed, True, True; False",
     "vLLM finds no platform on this machine (UnspecifiedPlatform); its CUDA paths run on host "
     "memory"),
    ("vllm.v1.attention.backends.mla.flashmla_sparse: get_mla_metadata, torch's pinned memory",
     "(None, None); pin_memory dropped", "FlashMLA's tile scheduler is a CUDA kernel; pinned "
     "memory needs the driver"),
    ("vllm.v1.sample.ops.topk_topp_sampler: HAS_TRITON", "False: vLLM's PyTorch top-k/top-p",
     "Triton's interpreter cannot run that kernel"),
    ("vllm.v1.worker.gpu_worker: kernel_warmup", "nothing",
     "JIT autotuning of device kernels"),
    ("vllm.v1.worker.gpu_worker: vmm_unavailable_reason, granule_size",
     "None (VMM usable); 2 MiB, what the CUDA driver reports on NVIDIA GPUs",
     "vLLM asks the CUDA driver; vmmkv's buffer maps host memory instead"),
    ("vllm.v1.worker.gpu_worker: measure_kv_cache_blocks", "the harness's budget",
     "free device memory measured after CUDA-graph capture"),
    ("vllm.v1.worker.extensible_kv_cache: max_layer_reload_bytes",
     "the harness's figure (1 GiB)", "the model has no weights for vLLM to measure"),
    ("vllm.cumem_allocator (C extension); get_mem_allocator_instance in vllm.device_allocator, "
     "vllm.v1.worker.gpu_worker, vllm.compilation.cudagraph_pool",
     "absent (as without CUDA); :class:`HostAllocator` (records sleep, wake_up, discard)",
     "CuMem is a CUDA memory pool"),
    ("the model (a load format registered with vLLM's register_model_loader)",
     "``model.HarnessModel``: vLLM's DeepseekV32IndexerCache and a stand-in MLA layer per "
     "layer, whose forward makes the KV writes of vLLM's DeepSeek-V3.2 attention and sparse "
     "indexer through their call sites", "no weights, no attention kernels on a CPU"),
    ("vllm.v1.worker.gpu_worker.Worker (parallel_config.worker_cls): init_device, "
     "determine_available_memory; annotate_profile observed",
     "``worker.HarnessWorker``: a host device and vLLM's own distributed setup on gloo; the "
     "harness's memory figure; each SchedulerOutput recorded for the reference",
     "device setup and memory profiling"),
    ("vllm.v1.engine.core.EngineCore: harness_foreign, harness_snapshot (added)",
     "``engine.foreign_objects``; the pool's stats with every worker's checks, between two "
     "steps", "utilities the tests call by name"),
    ("CacheConfig.enable_extensible_kv_cache", "set after vLLM's config check",
     "vLLM refuses the extensible cache off CUDA (config/vllm.py)"),
)  # fmt: skip


@dataclass
class _Replaced:
    owner: Any
    name: str
    original: Any
    replacement: Any


REPLACED: list[_Replaced] = []
BUDGET_ENV = "VMMKV_HARNESS_BUDGET_BLOCKS"  # blocks "free after capture" (extensible cache)
KV_BYTES_ENV = "VMMKV_HARNESS_KV_BYTES"  # bytes "profiling" finds for the KV cache
CUDA_GRANULE = 2 << 20
LAYER_BYTES_ENV = "VMMKV_HARNESS_LAYER_BYTES"  # the model's largest layer, for a weight update
_FREE = {"bytes": 1 << 40}
TOTAL_MEMORY = 1 << 41


def _set(owner: Any, name: str, value: Any) -> None:
    REPLACED.append(_Replaced(owner, name, getattr(owner, name, None), value))
    setattr(owner, name, value)


class _Stream:
    """A CUDA stream on the host: every wait, record and synchronize is immediate."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _Event()

    def query(self) -> bool:
        return True

    cuda_stream = 0


class _Event(_Stream):
    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def elapsed_time(self, other: Any) -> float:
        return 0.0


_STREAM = _Stream()


def memory() -> int:
    """Bytes of vmmkv's host chunks (memfd mappings) this process maps, per the kernel."""
    total = 0
    with open("/proc/self/maps") as f:
        for line in f:
            if "memfd:" in line:
                a, b = (int(x, 16) for x in line.split()[0].split("-"))
                total += b - a
    return total


def set_free_memory(nbytes: int) -> None:
    """What the stub device reports free beside vmmkv's mappings (default: 1 TiB)."""
    _FREE["bytes"] = int(nbytes)


def _memory_info(*args: Any, **kwargs: Any) -> tuple[int, int]:
    return max(_FREE["bytes"] - memory(), 0), TOTAL_MEMORY


class HostAllocator:
    """Stands in for vLLM's ``CuMemAllocator`` behind its own ``CuMemBackend``: records every
    call (the sleep-mode backend's order against vmmkv's release and restore)."""

    default_tag = "default"
    calls: list[tuple[Any, ...]] = []

    def sleep(self, offload_tags: Any = None, discardable: Any = ()) -> None:
        self.calls.append(("sleep", tuple(offload_tags or ())))

    def wake_up(self, tags: Any = None) -> None:
        self.calls.append(("wake_up", None if tags is None else tuple(tags)))

    def discard(self, tags: Any) -> None:
        self.calls.append(("discard", tuple(tags)))

    def use_memory_pool(self, tag: str | None = None) -> Any:
        return contextlib.nullcontext()

    def get_current_usage(self) -> int:
        return 0


_ALLOCATOR = HostAllocator()


def _allocator() -> HostAllocator:
    return _ALLOCATOR


def _no_pin_torch() -> types.ModuleType:
    class NoPin(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            obj = getattr(torch, name)
            if not callable(obj) or name not in {"zeros", "empty", "ones", "full", "tensor"}:
                return obj

            def factory(*args: Any, **kwargs: Any) -> Any:
                kwargs.pop("pin_memory", None)
                return obj(*args, **kwargs)

            return factory

    return NoPin("torch")


def install() -> None:
    """The process-wide stubs of :data:`STUBS` (torch's device calls, vLLM's platform, the CuMem
    extension): in the harness's launcher, before the engine core and its workers are forked.
    Needs :data:`ENV` set before vLLM was imported. Idempotent."""
    if any(r.owner is torch.cuda for r in REPLACED):
        return
    missing = {k: v for k, v in ENV.items() if os.environ.get(k) != v}
    if missing:
        raise RuntimeError(f"the engine harness needs {missing} in the environment before vLLM")
    for name, value in {
        "Stream": _Stream, "Event": _Event, "stream": lambda s=None: contextlib.nullcontext(),
        "current_stream": lambda *a, **k: _STREAM, "set_stream": lambda s: None,
    }.items():  # fmt: skip
        _set(torch.cuda, name, value)
    acc = torch.accelerator
    nothing = lambda *a, **k: None  # noqa: E731
    for name, value in {
        "synchronize": nothing, "empty_cache": nothing, "reset_peak_memory_stats": nothing,
        "memory_stats": lambda *a, **k: {}, "memory_reserved": lambda *a, **k: 0,
        "memory_allocated": lambda *a, **k: 0, "max_memory_allocated": lambda *a, **k: 0,
        "get_memory_info": _memory_info, "current_device_index": lambda: 0,
    }.items():  # fmt: skip
        _set(acc, name, value)

    from vllm.platforms import current_platform as p

    for name, value in {
        "device_type": "cpu", "is_cuda_alike": lambda: True,
        "is_pin_memory_available": lambda: False, "get_current_memory_usage": lambda *a, **k: 0,
        "num_compute_units": lambda *a, **k: 132, "set_device": nothing,
        "manual_seed_all": lambda seed: torch.manual_seed(seed),
        "is_sleep_mode_available": lambda: True, "is_cumem_allocator_available": lambda: True,
    }.items():  # fmt: skip
        _set(p, name, value)
    from vllm.utils import platform_utils

    for cached in (platform_utils.is_pin_memory_available, platform_utils.is_uva_available):
        cached.cache_clear()  # answered before the platform said "no pinned memory"
    from vllm.v1.engine.core import EngineCore

    # utilities the tests call by name
    _set(EngineCore, "harness_foreign", _engine_foreign)
    _set(EngineCore, "harness_snapshot", _engine_snapshot)
    # as on a machine without CUDA: vLLM's CuMem module finds no allocator extension (the
    # real one fails to load libcuda with an ImportError vLLM does not expect)
    sys.modules.setdefault("vllm.cumem_allocator", None)
    from vllm.utils import torch_utils

    _set(torch_utils, "PIN_MEMORY", False)  # read by name when vLLM's modules are imported


# vLLM modules every worker imports; the launcher imports them once, before vLLM forks the engine
# core and the workers from it, instead of each worker importing them again (a CPU has two
# cores). Not vLLM's GPU worker module: its import installs the plugin's sites, in the worker.
PRELOAD = (
    "vllm.v1.worker.gpu.model_runner",
    "vllm.model_executor.models.deepseek_v2",
    "vllm.models.deepseek_v32.attention",
    "vllm.model_executor.layers.sparse_attn_indexer",
    "vllm.v1.attention.backends.mla.flashmla_sparse",
    "vllm.v1.attention.backends.mla.indexer",
)


def preload() -> None:
    """Import :data:`PRELOAD` in this process (the launcher), then freeze the heap for the
    collector, as vLLM freezes its own startup heap (``freeze_gc_heap``) once it has started:
    the many ``gc.collect()`` calls of a worker's start then skip what every process imported
    (each took 0.4 s here, most of a worker's model loading)."""
    import gc
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()


def install_worker() -> None:
    """The stubs in vLLM's worker modules (attention metadata, sampler, warmup, memory
    measurement, the CuMem allocator): in a worker process, when ``worker`` is imported there
    (vLLM imports ``parallel_config.worker_cls`` in the worker). Idempotent."""
    install()
    from vllm.v1.worker import gpu_worker

    if gpu_worker.kernel_warmup in [r.replacement for r in REPLACED]:
        return
    from vllm.v1.attention.backends.mla import flashmla_sparse
    from vllm.v1.sample.ops import topk_topp_sampler
    from vllm.v1.worker import gpu_worker

    _set(flashmla_sparse, "get_mla_metadata", lambda *a, **k: (None, None))
    _set(flashmla_sparse, "torch", _no_pin_torch())
    _set(topk_topp_sampler, "HAS_TRITON", False)
    _set(gpu_worker, "kernel_warmup", lambda worker, **kwargs: None)
    _set(gpu_worker, "vmm_unavailable_reason", lambda *args, **kwargs: None)
    _set(gpu_worker, "granule_size", lambda device_index: CUDA_GRANULE)
    _set(gpu_worker, "measure_kv_cache_blocks", _budget)
    from vllm.v1.worker import extensible_kv_cache

    _set(extensible_kv_cache, "max_layer_reload_bytes", _layer_bytes)
    import vllm.device_allocator as dalloc
    from vllm.compilation import cudagraph_pool

    for owner in (dalloc, gpu_worker, cudagraph_pool):  # each holds vLLM's function by name
        _set(owner, "get_mem_allocator_instance", _allocator)


def _engine_snapshot(engine: Any, when: str) -> dict[str, Any]:
    """Between two steps of the engine core: its elastic pool's stats (None without) and every
    worker's checks (``worker.HarnessWorker.harness_check``), one consistent moment: a step in
    flight (async scheduling) reaches the workers before this call does."""
    from vmmkv.integrations.vllm._elastic_engine import pool_of

    pool = pool_of(engine.scheduler)
    stats = None if pool is None else pool.stats()
    return {"pool": stats, "workers": engine.collective_rpc("harness_check", args=(when,))}


def _engine_foreign(engine: Any) -> dict[str, list[str]]:
    from .engine import foreign_objects

    return foreign_objects()


def _layer_bytes(model: Any) -> int:
    """The model's largest layer in checkpoint format (``LAYER_BYTES_ENV``; default 1 GiB):
    the harness's model has no weights for vLLM to measure."""
    return int(os.environ.get(LAYER_BYTES_ENV, str(1 << 30)))


def _budget(kv_cache: Any, *args: Any, **kwargs: Any) -> int:
    """The blocks "free after capture" (``VMMKV_HARNESS_BUDGET_BLOCKS``; default: the reserved
    capacity), as vLLM's ``measure_kv_cache_blocks`` returns them before its min over ranks."""
    budget = int(os.environ.get(BUDGET_ENV, "0"))
    return min(budget, kv_cache.capacity_blocks) if budget else kv_cache.capacity_blocks
