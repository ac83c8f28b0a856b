"""vLLM 0.34.0 sleep mode with the KV cache on vmmkv memory: the ``vmmkv`` sleep-mode backend,
the plugin's sleep-mode configuration check, and the CuMem pool escape of vmmkv's bookkeeping.

With vLLM's extensible KV cache (0.34's default, ``_buffer``) none of this module's
release runs: vLLM's worker releases the cache (``release_physical``, vmmkv's collective shrink
to 0) before the backend's ``suspend`` and recommits it after ``resume``, whatever the backend,
and :func:`check_config` refuses nothing of it. The rest of this docstring is about vmmkv's own
allocation (the extensible cache off).

What vLLM's sleep does to vmmkv's KV memory without the ``vmmkv`` backend (read in vLLM 0.34.0):

- ``Worker.sleep(level)`` / ``wake_up(tags)`` / ``discard(tags)`` (``v1/worker/gpu_worker.py``)
  hand the memory work to ``SleepModeBackendFactory.create_backend(model_config)``, by default
  ``CuMemBackend``, which drives ``CuMemAllocator``. That allocator knows only the allocations
  made through its own pool (``pointer_to_data``, filled by its malloc callback): vmmkv's region
  is reserved, committed and mapped by vmmkv itself, so sleep **leaves the KV memory untouched**:
  still committed on every rank, peer mappings kept, not offloaded, not released, not zeroed.
- vLLM reaches that backend whether or not sleep mode is on: ``LLM.sleep()``,
  ``LLM.release_kv_cache_memory()`` and the dev endpoints check no flag
  (``v1/engine/core.py``), and ``Worker.sleep``/``discard`` always use
  ``model_config.sleep_mode_backend`` (default ``cumem``).

vmmkv's bookkeeping (:class:`OutsideCuMemPools`): the worker builds the KV cache inside
``use_memory_pool(tag="runtime")`` and ``use_memory_pool(tag="kv_cache")`` whenever
``enable_cumem_allocator`` is on (``initialize_from_config``), and every device tensor allocated
there is a CuMem allocation: ``CuMemBackend.suspend`` offloads ``weights`` (less the
parameters a level-2 sleep passes as discardable), ``runtime`` and ``cudagraph`` and discards
the rest without a backup, and a wake maps fresh,
uninitialized memory under it. The plugin therefore builds the cache with the calling thread
taken out of every CuMem pool (as vLLM builds its own KV-zero metadata outside the pool): the
peer pointer and signal tables, the committed-bytes table, the error counter and the barrier's
tensors come from PyTorch's default allocator, which no sleep backend touches.

What the ``vmmkv`` backend does (``--sleep-mode-backend vmmkv``; registered through vLLM's
``SleepModeBackendFactory`` by the plugin's ``install``). It wraps vLLM's own backend (``cumem``,
or the one named by ``VMMKV_SLEEP_INNER_BACKEND``), which keeps handling weights, runtime state
and graphs. When the plugin holds this worker's KV cache (:func:`active_cache`):

- ``suspend(level)``: the KV cache's device memory is released on every PCP rank: a collective
  ``VllmKVCache.shrink(0)`` (bounds lowered first, peers' chunks unmapped, own chunks
  decommitted: nothing of the region stays mapped), the committed block count remembered; then
  the inner backend's suspend.
- ``resume(tags)``: the inner backend's resume first; then, when ``tags`` is None or holds
  ``"kv_cache"``, a collective ``VllmKVCache.grow(n)`` to the remembered count (or the last
  elastic target a worker applied while released, ``_elastic_worker``): the blocks come
  back **zeroed** (a grow's new blocks read zero before any peer writes them), at the **same virtual
  addresses** (the reservation never moves), so vLLM's views and captured CUDA graphs stay
  valid. vLLM clears its prefix cache before a sleep of level 1 or 2 (``EngineCore.sleep``), so
  no content is expected back. A wake without ``"kv_cache"`` keeps the KV released.
- ``discard(tags)`` with ``"kv_cache"`` (vLLM's ``EngineCore.release_kv_cache_memory``): the
  same release as ``suspend``, then the inner backend's discard of the same tags. A later
  ``resume`` with ``"kv_cache"`` (or no tags) restores the blocks zeroed, as after a sleep.
- Without an active vmmkv cache (PCP size 1: vLLM's own KV cache) every call goes to the inner
  backend unchanged.

Collective: ``suspend``, ``resume`` and ``discard`` over the PCP group when a vmmkv cache is
active. vLLM calls them on every worker with the same arguments (``Executor.sleep``/``wake_up``/
``discard`` -> ``collective_rpc``), so every PCP rank calls them in the same order. Releasing
twice, or restoring what is not released, does nothing (the same on every rank).

Refusals (:func:`check_config`, :class:`UnsupportedKVCache`, at allocation):

- another sleep-mode backend while vLLM's sleep allocator is on (``enable_cumem_allocator``,
  which ``enable_sleep_mode`` turns on): vLLM then offers sleep and KV release through that
  backend, which would report success and release none of vmmkv's KV memory. With the
  allocator off nothing of vLLM's own KV cache is releasable either (it is outside any pool),
  and vmmkv behaves as vLLM does;
- ``sleep_mode_offload_cudagraph`` under the ``vmmkv`` backend with sleep mode and CUDA graphs
  on: vLLM puts graphs into CuMem's offloadable pool only under the backend name ``cumem``
  (``VllmConfig.use_cumem_cudagraph_pool``), so the request would be ignored without a word and
  the graphs' memory would stay resident while asleep (the graphs stay valid either way).
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from collections.abc import Collection
from typing import Any

import torch
from vllm.device_allocator.sleep_mode_backend import (
    SleepModeBackend,
    SleepModeBackendFactory,
)

from ._state import _STATE, UnsupportedVLLM, _Released, active_cache

__all__ = [
    "INNER_ENV",
    "KV_TAG",
    "NAME",
    "OutsideCuMemPools",
    "VmmkvSleepModeBackend",
    "check_config",
    "register_backend",
]

log = logging.getLogger(__name__)

NAME = "vmmkv"
KV_TAG = "kv_cache"
INNER_ENV = "VMMKV_SLEEP_INNER_BACKEND"
DEFAULT_INNER = "cumem"
CUMEM_MODULE = "vllm.device_allocator.cumem"
# vLLM's graph pool, routed by capture (not by thread) and never current while vLLM allocates
GRAPH_POOL_TAG = "cudagraph"


def inner_name() -> str:
    """The vLLM sleep-mode backend the ``vmmkv`` backend wraps (``VMMKV_SLEEP_INNER_BACKEND``,
    default ``cumem``)."""
    name = os.environ.get(INNER_ENV, "").strip() or DEFAULT_INNER
    if name == NAME:
        raise ValueError(f"{INNER_ENV} must name another sleep-mode backend than {NAME!r}")
    return name


def _own_cache() -> Any:
    """The active cache when vmmkv allocated it; None under vLLM 0.34's extensible KV cache,
    which vLLM's worker releases and recommits itself around the backend."""
    cache = active_cache()
    return None if cache is None or cache.extensible else cache


def _inner_class() -> type[SleepModeBackend]:
    return SleepModeBackendFactory.get_backend_class(inner_name())


def register_backend() -> None:
    """Register the ``vmmkv`` sleep-mode backend with vLLM's ``SleepModeBackendFactory``
    (lazy: vLLM imports this module when it resolves the name). Local, idempotent. Raises
    UnsupportedVLLM when vLLM's backend interface is not the one of 0.34.0."""
    for method, params in (("suspend", ("self", "discardable")), ("resume", ("self", "tags")),
                           ("discard", ("self", "tags"))):  # fmt: skip
        _check_signature(getattr(SleepModeBackend, method), params, f"SleepModeBackend.{method}")
    try:
        SleepModeBackendFactory.register_backend(NAME, __name__, "VmmkvSleepModeBackend")
    except ValueError:  # registered already: by us (idempotent), or someone else's name
        if SleepModeBackendFactory.get_backend_class(NAME) is not VmmkvSleepModeBackend:
            raise


def check_config(cfg: Any) -> None:
    """Refuse (UnsupportedKVCache) what vLLM's sleep machinery would do wrong with vmmkv's KV
    cache (module docstring, "Refusals"): a sleep-mode backend other than ``vmmkv`` while vLLM's
    sleep allocator is on (``enable_cumem_allocator``, implied by ``enable_sleep_mode``), and
    ``sleep_mode_offload_cudagraph`` under the ``vmmkv`` backend with sleep mode and CUDA graphs
    on. Local."""
    model = getattr(cfg, "model_config", None)
    if model is None:
        return
    from ._layout import UnsupportedKVCache

    backend = getattr(model, "sleep_mode_backend", DEFAULT_INNER)
    sleep_mode = bool(getattr(model, "enable_sleep_mode", False))
    cumem = bool(getattr(model, "enable_cumem_allocator", False))
    # vLLM 0.34's extensible KV cache is released and recommitted by vLLM's worker itself
    # around any backend (_buffer): the refusal is for vmmkv's own allocation only
    extensible = bool(getattr(getattr(cfg, "cache_config", None), "enable_extensible_kv_cache",
                              False))  # fmt: skip
    if backend != NAME and (sleep_mode or cumem) and not extensible:
        why = "--enable-sleep-mode" if sleep_mode else "--enable-cumem-allocator"
        raise UnsupportedKVCache(
            f"the sleep-mode backend {backend!r} with vLLM's sleep allocator on ({why}): vLLM "
            "then offers sleep and KV release (LLM.sleep, release_kv_cache_memory, the dev "
            "endpoints) through that backend, which knows only CuMem's pool and would release "
            "none of vmmkv's KV memory while reporting success; use --sleep-mode-backend "
            f"{NAME} (it wraps {DEFAULT_INNER!r} for everything else; {INNER_ENV} picks "
            "another), or turn the allocator off"
        )
    if (
        backend == NAME
        and sleep_mode
        and getattr(model, "sleep_mode_offload_cudagraph", False)
        and _cudagraphs_on(cfg)
    ):
        raise UnsupportedKVCache(
            f"--sleep-mode-offload-cudagraph with --sleep-mode-backend {NAME}: vLLM puts "
            "CUDA graphs into CuMem's offloadable pool only under the backend name "
            f"{DEFAULT_INNER!r} (VllmConfig.use_cumem_cudagraph_pool), so the graphs' memory "
            "would stay resident while asleep; drop --sleep-mode-offload-cudagraph (the "
            "graphs stay valid across sleep and keep their memory)"
        )


def _cudagraphs_on(cfg: Any) -> bool:
    """Whether vLLM captures CUDA graphs under ``cfg`` (a cudagraph mode other than NONE)."""
    from vllm.config import CUDAGraphMode

    mode = getattr(getattr(cfg, "compilation_config", None), "cudagraph_mode", None)
    return mode is not None and mode != CUDAGraphMode.NONE


class OutsideCuMemPools:
    """A context in which the calling thread's device allocations go to PyTorch's default
    allocator, not to the CuMem pools vLLM made current for it, and to the same pools in the
    same order afterwards.

    ``CuMemAllocator.use_memory_pool(tag)`` enters ``torch.cuda.memory.use_mem_pool`` on a new
    ``MemPool`` of CuMem's pluggable allocator: the caching allocator appends the pool to its
    list of pools routing allocations (here: those of the current thread) and serves each
    allocation from the first matching entry. Entering ends every such entry of CuMem's pools
    (``_cuda_endAllocateToPool``, dropping the reference the entry took), oldest pool first;
    leaving begins them again for this thread in that order, each taking its reference back.
    A pool that is not routing allocations (its context has exited) refuses the end and is left
    alone, and so is vLLM's graph pool (routed by capture, not by thread).

    :meth:`landed` lists the CuMem allocations made while inside: none unless a pool routed
    allocations in a way this escape does not know. Nothing at all when vLLM has no CuMem
    allocator in this process (never loaded, or never instantiated: the allocator is off).
    Local; vLLM's worker allocates from one thread, as this assumes."""

    def __init__(self) -> None:
        cumem = sys.modules.get(CUMEM_MODULE)
        self.allocator = None if cumem is None else cumem.CuMemAllocator.instance
        self.suspended: list[Any] = []
        self.before: set[int] = set()
        self.device = -1

    def __enter__(self) -> OutsideCuMemPools:
        allocator = self.allocator
        if allocator is None:
            return self
        import torch.cuda.memory as pools

        self.device = torch.cuda.current_device()  # the device use_mem_pool began them on
        candidates = sorted(
            (entry[0] for tag, entries in allocator.allocator_and_pools.items()
             if tag != GRAPH_POOL_TAG for entry in entries),
            key=lambda pool: tuple(pool.id),
        )  # fmt: skip
        try:
            for pool in candidates:
                try:
                    pools._cuda_endAllocateToPool(self.device, pool.id)
                except RuntimeError:  # not routing allocations: its context has exited
                    continue
                self.suspended.append(pool)
                pools._cuda_releasePool(self.device, pool.id)
        except BaseException:
            self._resume()
            raise
        self.before = set(allocator.pointer_to_data)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._resume()

    def _resume(self) -> None:
        import torch.cuda.memory as pools

        suspended, self.suspended = self.suspended, []
        for pool in suspended:
            pools._cuda_beginAllocateCurrentThreadToPool(self.device, pool.id)

    def landed(self) -> list[str]:
        """The CuMem allocations made inside the context (``"<tag>: <bytes> bytes at
        <address>"``), in address order; empty when everything went to the default
        allocator."""
        if self.allocator is None:
            return []
        data = self.allocator.pointer_to_data
        return [
            f"{data[ptr].tag}: {data[ptr].handle[1]} bytes at {ptr:#x}"
            for ptr in sorted(set(data) - self.before)
        ]


def _check_signature(fn: Any, params: tuple[str, ...], what: str) -> None:
    """UnsupportedVLLM unless ``fn`` takes the named parameters (vLLM 0.34.0's signatures)."""
    try:
        names = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as exc:
        raise UnsupportedVLLM(f"vmmkv: cannot read the signature of {what}: {exc}") from exc
    if names[: len(params)] != params:
        raise UnsupportedVLLM(
            f"vmmkv: {what} takes {names}, vmmkv was written for {params} (vLLM 0.34.0)"
        )


def _inner_capability(name: str) -> classmethod:
    """A capability class method answered by the inner backend's class."""

    def ask(cls) -> bool:
        return bool(getattr(_inner_class(), name)())

    ask.__name__ = name
    return classmethod(ask)


class VmmkvSleepModeBackend(SleepModeBackend):
    """vLLM's sleep-mode backend plus the release and restore of vmmkv's KV cache (see the
    module docstring). ``inner``: the wrapped vLLM backend."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _inner_class()()

    # -- what vLLM calls -------------------------------------------------------------
    def suspend(self, discardable: Collection[int] = ()) -> None:
        cache = _own_cache()
        if cache is not None:
            self._release(cache, "sleep")
        self.inner.suspend(discardable)
        self._state = "SUSPENDED"

    def resume(self, tags: list[str] | None = None) -> None:
        self._state = "RESUMING"
        self.inner.resume(tags)  # first: weights and runtime state back before the KV grows
        if tags is None or KV_TAG in tags:
            self._restore()
        self._state = "RUNNING"

    def discard(self, tags: tuple[str, ...]) -> None:
        tags = tuple(tags)
        cache = _own_cache()
        if cache is not None and KV_TAG in tags:
            self._release(cache, "discard")
        self.inner.discard(tags)  # CuMem's kv_cache tag holds nothing of vmmkv's
        self._state = "SUSPENDED"

    # -- capabilities: the inner backend's ---------------------------------------------
    is_supported = _inner_capability("is_supported")
    preserves_communicators = _inner_capability("preserves_communicators")
    preserves_compiled_artifacts = _inner_capability("preserves_compiled_artifacts")
    preserves_graphs_with_communicators = _inner_capability("preserves_graphs_with_communicators")

    @classmethod
    def supports_durable_storage(cls) -> bool:
        # vmmkv's KV memory and peer mappings do not survive the process
        return False

    # -- vmmkv -----------------------------------------------------------------------
    @property
    def released_blocks(self) -> int | None:
        """The committed blocks a wake restores, or None when the KV cache is not
        released."""
        released = _STATE.released
        return None if released is None else released.blocks

    def _release(self, cache: Any, why: str) -> None:
        """Collective: the KV cache to 0 blocks on every PCP rank (memory released, peers
        unmapped), the count before remembered (in ``_state``, where elastic mode's worker
        retargets it). Nothing when it is released already."""
        if _STATE.released is not None and _STATE.released.cache is cache:
            return
        blocks, held = cache.committed_blocks, cache.committed_block_set
        cache.shrink(0)
        _STATE.released = _Released(cache, blocks)
        _STATE.released.set_committed(held)
        log.info(
            "vmmkv: %s released the KV cache (%d of %d blocks committed before) on PCP "
            "rank %d of %d", why, blocks, cache.num_blocks, cache.rank, cache.world_size,
        )  # fmt: skip

    def _restore(self) -> None:
        """Collective: the released KV cache back to its block count, zeroed, at the same
        addresses. Nothing when nothing is released."""
        if _STATE.released is None:
            return
        released = _STATE.released
        cache, blocks = released.cache, released.blocks
        if cache is not active_cache():
            log.warning(
                "vmmkv: the KV cache released at sleep is not the active one any more "
                "(closed or replaced); nothing to restore"
            )
            _STATE.released = None
            return
        # raises on every rank on failure: the record stays, retry
        if released.block_set is None:
            cache.grow(blocks)
        else:  # holes the engine core made stay holes: only the set is committed
            cache.set_committed_blocks(released.block_set)
        _STATE.released = None
        log.info(
            "vmmkv: wake-up restored %d KV blocks (zeroed) on PCP rank %d of %d",
            blocks, cache.rank, cache.world_size,
        )  # fmt: skip
