"""The allocation of vLLM 0.34.0's KV cache on vmmkv memory, in each worker whose PCP group has
more than one rank: the call sites vLLM allocates and shuts its KV cache down through, installed
by ``_install`` with the other worker sites.

| site (module: name) | replaced by |
|---|---|
| ``vllm.v1.worker.gpu.attn_utils: allocate_kv_cache`` (MRV2's allocation) | with vLLM's extensible KV cache's ``allocate`` hook: :func:`allocate_extensible` (vLLM's allocation over vmmkv's buffer, every view checked to be bound); without it a :class:`VllmKVCache` over the PCP group, which *replaces* the process's previous one (closed first: vLLM allocates a small profiling cache, tears it down, then allocates the real one); vLLM's own allocation when PCP is 1 |
| ``vllm.v1.worker.extensible_kv_cache: ExtensibleTensor`` | :func:`make_buffer` |
| ``vllm.v1.worker.extensible_kv_cache: ExtensibleKVCache.__init__`` | vLLM's, with its config and layout handed to :func:`make_buffer` (the buffer's own parameters carry only sizes) |
| ``vllm.v1.worker.gpu.model_runner: GPUModelRunner.shutdown`` | vLLM's shutdown, then the cache is closed |

Why vLLM's extensible KV cache is the seam (docs/design.md, "vLLM 0.34's extensible KV cache"):
vLLM keeps what 0.34 gives every user by default (sizing after CUDA-graph capture from measured
memory, the 1.0 ``gpu_memory_utilization`` default, ``release_kv_cache_memory`` and sleep
without a special backend, KV lending for layer-wise weight updates), and vmmkv adds what 0.34
lacks: every rank maps its peers' replicas, and the PCP gather + insert becomes one direct store.
:func:`make_buffer` builds vLLM's buffer, a ``_buffer.PeerKVBuffer``, in the chunk and runs
``_buffer`` chooses.

The replaced ``allocate_kv_cache`` first runs ``check_vllm_config`` (``_support``; local, before
any collective: every rank refuses alike), then builds the cache outside vLLM's CuMem pools
(:func:`build_cache`, ``_sleep.OutsideCuMemPools``: vmmkv's small device tensors must not be
dropped by a sleep). Called by vLLM with ``allocate=`` the extensible cache's hook, it hands over
to :func:`allocate_extensible`: vLLM builds its views over the buffer (its hook commits the
minimum, collectively), and every MLA and indexer view must be one vmmkv bound.
``extend_kv_cache`` later re-binds views sized to the committed blocks at the same addresses,
which the cache's bindings accept (``VllmKVCache.binding``).

Elastic mode (``VLLM_VMMKV_ELASTIC=1``): both allocations first refuse what elastic mode has not
been tested with and a layer-major layout, take elastic mode's chunk
(``_buffer.elastic_chunk_bytes``) and reset the worker's applied resize requests
(``_elastic_worker.WORKER``); vmmkv's own allocation commits the floor at once, vLLM's
extensible cache its budget, which ``_elastic_worker.settle_elastic`` brings down to the floor.

Contract: the allocations (PCP > 1) are collective over the PCP group, every rank allocating in
the same order; each replaces (closes, locally) the process's previous cache first and makes the
new one ``_state``'s active cache. ``shutdown`` closes it (local).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

from ._buffer import PeerKVBuffer, _chunk_and_runs, _chunk_bytes_from_env, elastic_chunk_bytes
from ._elastic_settings import check_elastic_config, elastic_enabled, settings_for
from ._elastic_worker import WORKER
from ._state import _STATE, close_active, original
from ._support import check_vllm_config, vllm_indexer_kind, vllm_mla_kind

__all__ = ["allocate_extensible", "build_cache", "capture_spec", "make_buffer"]

log = logging.getLogger(__name__)

MODULE = "vllm.v1.worker.extensible_kv_cache"


def _allocate(orig: Callable[..., Any]) -> Callable[..., Any]:
    def allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes=None, allocate=None):
        from vllm.config import get_current_vllm_config_or_none
        from vllm.distributed.parallel_state import get_pcp_group

        pcp = get_pcp_group()
        if pcp.world_size == 1:
            log.info("vmmkv: prefill context parallel size 1: vLLM allocates its KV cache")
            return orig(kv_cache_config, device, layout, kernel_block_sizes, allocate)
        cfg = get_current_vllm_config_or_none()
        if allocate is not None:  # vLLM's extensible KV cache over vmmkv's buffer (_buffer)
            return allocate_extensible(
                orig, kv_cache_config, device, layout, kernel_block_sizes, allocate
            )
        if cfg is not None:
            check_vllm_config(cfg)
        # vLLM allocates more than once per worker (MRV2 with CUDA graphs: a profiling cache,
        # torn down by _teardown_profiling_state, then the real one; an engine re-created in
        # the same process): every allocation replaces the previous cache. vLLM dropped the
        # old views and graphs by then; a view it still held faults instead of reaching other
        # memory (the reservation lives as long as a view). Every rank allocates in the same
        # order, so every rank closes (local) and then builds the new cache (collective).
        close_active("vLLM allocates a new KV cache")
        cache = build_cache(
            cfg, pcp, "allocate_kv_cache", kv_cache_config, layout, device=device,
            kernel_block_sizes=kernel_block_sizes,
            **_elastic_kwargs(cfg, kv_cache_config, layout),
        )  # fmt: skip
        _STATE.active = cache
        return dict(cache.views)

    return allocate_kv_cache


def build_cache(cfg: Any, pcp: Any, call: str, kv_cache_config: Any, layout: Any,
                **kwargs: Any) -> Any:  # fmt: skip
    """A :class:`VllmKVCache` over vLLM's PCP group ``pcp`` (collective), built outside vLLM's
    CuMem pools: vLLM allocates inside them ("runtime", "kv_cache") when its sleep allocator
    is on, and a sleep discards what lives there. A refusal names the model (every rank refuses
    alike); a table that still reached a pool closes the cache and raises, naming ``call``."""
    from ._cache import VllmKVCache
    from ._layout import UnsupportedKVCache
    from ._sleep import OutsideCuMemPools

    outside = OutsideCuMemPools()
    try:
        with outside:
            cache = VllmKVCache(
                kv_cache_config, layout, cpu_group=pcp.cpu_group,
                device_group=pcp.device_group, mla_kind=vllm_mla_kind(),
                indexer_kind=vllm_indexer_kind(), **kwargs,
            )  # fmt: skip
    except UnsupportedKVCache as exc:
        model = cfg.model_config.model if cfg is not None and cfg.model_config else "?"
        raise UnsupportedKVCache(f"vmmkv cannot hold the KV cache of {model!r}: {exc}") from exc
    landed = "; ".join(outside.landed())
    if landed:
        cache.close()
        raise RuntimeError(
            f"rank {pcp.rank_in_group} ({kwargs.get('device')}): {call}: vmmkv's KV-cache "
            f"tables reached vLLM's CuMem pool although the plugin builds them outside it "
            f"({landed}); a sleep would discard them without a backup. Run without "
            "--enable-cumem-allocator and --enable-sleep-mode"
        )
    return cache


def _elastic_kwargs(cfg: Any, kv_cache_config: Any, layout: Any) -> dict[str, Any]:
    """Elastic mode (``VLLM_VMMKV_ELASTIC=1``): the floor committed at start and the elastic
    chunk, as the engine core computes them; a block-major layout is required (a layer-major
    one spreads each block over every layer's segment: chunks of 64 MiB would commit up to 2 x
    the blocks' bytes, small chunks cost a driver call each). Otherwise nothing."""
    if not elastic_enabled():
        return {}
    from ._layout import UnsupportedKVCache

    if cfg is None:
        raise UnsupportedKVCache("elastic KV needs vLLM's config in the allocating worker")
    check_elastic_config(cfg)
    if layout.name not in ("BLNHC", "BLHNC"):
        raise UnsupportedKVCache(
            f"elastic KV (VLLM_VMMKV_ELASTIC=1) needs a block-major KV cache layout, got "
            f"{layout.name}: set VLLM_KV_CACHE_LAYOUT=BLNHC"
        )
    chunk = elastic_chunk_bytes()
    WORKER.reset()  # a new cache: no resize applied yet
    WORKER.floor = settings_for(cfg, kv_cache_config, chunk).floor
    return {"initial_blocks": WORKER.floor, "chunk_bytes": chunk}


def _pcp_group() -> Any:
    from vllm.distributed.parallel_state import get_pcp_group

    return get_pcp_group()


def make_buffer(
    max_num_bytes: int,
    device: Any = None,
    num_segments: int = 1,
    segment_capacities: Sequence[int] | None = None,
    export_handle_types: int = 0,
) -> Any:
    """What ``ExtensibleKVCache`` constructs as its buffer: vLLM's own ``ExtensibleTensor``
    with PCP = 1 or outside ``ExtensibleKVCache``; under PCP > 1 a :class:`PeerKVBuffer`
    over a new ``VllmKVCache`` of that cache's config and layout, nothing committed (collective
    over the PCP group; it replaces the process's previous cache). Refuses
    (``UnsupportedKVCache``) what the plugin cannot hold, and export handle types (a KV
    connector's), before any collective."""
    from ..._util import round_up
    from ...alloc.region import make_backend

    spec = _STATE.extensible_spec
    pcp = _pcp_group()
    if spec is None or pcp.world_size == 1:
        vllm_class = original(_module(), "ExtensibleTensor")
        return vllm_class(max_num_bytes, device, num_segments, segment_capacities,
                          export_handle_types)  # fmt: skip
    from vllm.config import get_current_vllm_config_or_none

    from ._layout import UnsupportedKVCache

    kv_cache_config, layout = spec
    cfg = get_current_vllm_config_or_none()
    if cfg is not None:
        check_vllm_config(cfg)
    elastic = _elastic_chunk(cfg, layout)
    gran = make_backend(device, "auto").granularity
    cap = round_up(max_num_bytes, gran)
    # elastic mode reads VMMKV_CHUNK_MIB as its own chunk, a small cache being one chunk
    env = _chunk_bytes_from_env(1, 1 << 62) if elastic else _chunk_bytes_from_env(gran, cap)
    chunk, runs = _chunk_and_runs(gran, max_num_bytes, elastic, env and min(env, cap))
    if export_handle_types:
        raise UnsupportedKVCache(
            f"vLLM asks the KV cache to be exportable to other processes (handle types "
            f"{export_handle_types:#x}, for a KV-transfer connector): not with VLLM_USE_VMMKV=1"
        )
    if segment_capacities is None:
        segment_capacities = [max_num_bytes // num_segments] * num_segments
    close_active("vLLM allocates a new KV cache")
    cache = build_cache(
        cfg, pcp, "ExtensibleKVCache", kv_cache_config, layout, device=device,
        initial_blocks=0, chunk_bytes=chunk, run_bytes=runs,
    )  # fmt: skip
    try:
        offsets = list(accumulate([0, *segment_capacities[:-1]]))
        ours = [off for off, _ in cache.plan.segments]
        if cache.plan.size != max_num_bytes or ours != offsets:
            raise UnsupportedKVCache(
                f"vLLM's extensible KV cache lays out {max_num_bytes} B in segments at "
                f"{offsets}, vmmkv's plan of the same config {cache.plan.size} B at {ours}"
            )
        # the strides are the plan's: a commit whose sizes are not one block count of them
        # (another placement than vLLM's) is refused by resize_segments_
        strides = [bb for _, bb in cache.plan.segments]
        buffer = PeerKVBuffer(cache, offsets, segment_capacities, strides)
        cache.extensible = True
    except BaseException:
        cache.close()
        raise
    _STATE.active = cache
    log.info(
        "vmmkv: vLLM's extensible KV cache on vmmkv memory: %d segments, %d blocks reserved, "
        "path %s over %d PCP ranks", len(offsets), cache.num_blocks, cache.cache.path,
        cache.world_size,
    )  # fmt: skip
    return buffer


def _elastic_chunk(cfg: Any, layout: Any) -> int | None:
    """Elastic mode (``VLLM_VMMKV_ELASTIC=1``): its chunk (``_buffer.elastic_chunk_bytes``, the
    grid its releases return memory in), after the refusals of vmmkv's own allocation in
    elastic mode (what it has not been tested with; a layer-major layout, whose blocks span
    every layer's segment); the worker's applied resize requests reset. None otherwise. Local."""
    if not elastic_enabled():
        return None
    from ._layout import UnsupportedKVCache

    if cfg is None:
        raise UnsupportedKVCache("elastic KV needs vLLM's config in the allocating worker")
    check_elastic_config(cfg)
    if not layout.is_block_outermost:
        raise UnsupportedKVCache(
            f"elastic KV (VLLM_VMMKV_ELASTIC=1) needs a block-major KV cache layout, got "
            f"{layout.name}: set VLLM_KV_CACHE_LAYOUT=BLNHC"
        )
    WORKER.reset()  # a new cache: no resize applied yet
    return elastic_chunk_bytes()


def _module() -> Any:
    import importlib

    return importlib.import_module(MODULE)


def capture_spec(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``ExtensibleKVCache.__init__``: vLLM's, with the config and layout it was given handed to
    :func:`make_buffer` through the plugin state for its duration."""

    def __init__(self, kv_cache_config, device, layout, export_handle_types=0):
        import weakref

        _STATE.extensible_spec = (kv_cache_config, layout)
        try:
            orig(self, kv_cache_config, device, layout, export_handle_types)
        finally:
            _STATE.extensible_spec = None
        if isinstance(self.buffer, PeerKVBuffer):
            _STATE.extensible = weakref.ref(self)

    return __init__


def allocate_extensible(orig: Callable[..., Any], kv_cache_config: Any, device: Any,
                        layout: Any, kernel_block_sizes: Any, allocate: Any) -> Any:  # fmt: skip
    """``allocate_kv_cache`` with vLLM's extensible hook under PCP > 1: vLLM's own allocation
    over the :class:`PeerKVBuffer` (its hook commits the minimum: collective), then every MLA
    and indexer view checked to be one the cache bound. Returns vLLM's views."""
    from ._layout import UnsupportedKVCache, plan_kv_cache

    owner = getattr(allocate, "__self__", None)
    buffer = getattr(owner, "buffer", None)
    if not isinstance(buffer, PeerKVBuffer):
        raise UnsupportedKVCache(
            "vLLM's extensible KV cache was built without vmmkv's buffer under PCP > 1 (the "
            "plugin was installed after the cache was created?); restart with VLLM_USE_VMMKV=1 "
            "set in every process"
        )
    cache = buffer.cache
    # the same refusals as the plugin's own allocation (kernel-block splitting, specs, layout)
    plan_kv_cache(kv_cache_config, layout, kernel_block_sizes, mla_kind=cache.mla_kind,
                  indexer_kind=cache.indexer_kind)  # fmt: skip
    views = orig(kv_cache_config, device, layout, kernel_block_sizes, allocate)
    for name, place in cache.plan.layers.items():
        view = views.get(name)
        if view is None or cache.binding(view, cache._family(place.kind)) is None:
            got = "missing" if view is None else f"{list(view.shape)} at {view.data_ptr():#x}"
            raise RuntimeError(
                f"rank {cache.rank}: vLLM's view of layer {name!r} ({got}) is not the one vmmkv "
                f"bound ({list(cache.views[name].shape)} at {cache.views[name].data_ptr():#x})"
            )
    return views


def _shutdown(orig: Callable[..., Any]) -> Callable[..., Any]:
    def shutdown(self):
        try:
            orig(self)
        finally:
            close_active("the worker's model runner shuts down")

    return shutdown
