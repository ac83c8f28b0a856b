"""vLLM 0.33.0 sleep mode with the KV cache on vmmkv memory: the ``vmmkv`` sleep-mode backend.

What vLLM's sleep does to vmmkv's KV memory without this module (read in vLLM 0.33.0):

- ``Worker.sleep(level)`` / ``wake_up(tags)`` / ``discard(tags)`` (``v1/worker/gpu_worker.py``)
  hand the memory work to ``SleepModeBackendFactory.create_backend(model_config)``, by default
  ``CuMemBackend``, which drives ``CuMemAllocator``. That allocator knows only the allocations
  made through its own pool (``pointer_to_data``, filled by its malloc callback): vmmkv's region
  is reserved, committed and mapped by vmmkv itself, so sleep **leaves the KV memory untouched**:
  still committed on every rank, peer mappings kept, not offloaded, not released, not zeroed.
- The worker allocates the KV cache inside ``use_memory_pool(tag="kv_cache")``
  (``initialize_from_config`` -> the runners' ``allocate_kv_cache``), so the small device tensors
  vmmkv creates there (the peer pointer table, the committed-bytes table, the error counter, the
  barrier's tensors) can land in CuMem segments tagged ``kv_cache``. ``CuMemBackend.suspend``
  offloads only ``weights`` (level 1), ``runtime`` and ``cudagraph``: it unmaps those vmmkv
  tensors without a backup, and ``wake_up`` maps fresh memory under them (uninitialized on CUDA;
  zeroed with ``cudaMemset`` on ROCm). That is what wake-up would "zero" of vmmkv's: its
  bookkeeping, never the KV bytes.

What the ``vmmkv`` backend does (``--sleep-mode-backend vmmkv``; registered through vLLM's
``SleepModeBackendFactory`` by the plugin's ``install``). It wraps vLLM's own backend (``cumem``,
or the one named by ``VMMKV_SLEEP_INNER_BACKEND``), which keeps handling weights, runtime state
and graphs. When the plugin holds this worker's KV cache (:func:`active_cache`):

- ``suspend(level)``: the KV cache's device memory is released on every PCP rank: a collective
  ``VllmKVCache.shrink(0)`` (bounds lowered first, peers' chunks unmapped, own chunks
  decommitted: nothing of the region stays mapped), the committed block count remembered; then
  the inner backend's suspend, with CuMem told to offload the ``kv_cache`` tag as well (with
  vmmkv that pool holds only vmmkv's bookkeeping tensors, so the copy is small).
- ``resume(tags)``: the inner backend's resume first (it maps vmmkv's bookkeeping back); then,
  when ``tags`` is None or holds ``"kv_cache"``, a collective ``VllmKVCache.grow(n)`` to the
  remembered count: the blocks come back **zeroed** (grow zeroes its new blocks and runs the
  cache barrier), at the **same virtual addresses** (the reservation never moves), so vLLM's
  views and captured CUDA graphs stay valid. vLLM clears its prefix cache before a sleep of
  level 1 or 2 (``EngineCore.sleep``), so no content is expected back. A wake without
  ``"kv_cache"`` keeps the KV released.
- ``discard(tags)`` with ``"kv_cache"`` (vLLM's ``EngineCore.release_kv_cache_memory``): the
  same release as ``suspend``; the ``kv_cache`` tag is not passed to the inner backend (it would
  drop vmmkv's bookkeeping without a backup), other tags are. A later ``resume`` with
  ``"kv_cache"`` (or no tags) restores the blocks zeroed, as after a sleep.
- Without an active vmmkv cache (PCP size 1: vLLM's own KV cache) every call goes to the inner
  backend unchanged.

Collective: ``suspend``, ``resume`` and ``discard`` over the PCP group when a vmmkv cache is
active. vLLM calls them on every worker with the same arguments (``Executor.sleep``/``wake_up``/
``discard`` -> ``collective_rpc``), so every PCP rank calls them in the same order. Releasing
twice, or restoring what is not released, does nothing (the same on every rank).

Refusal: with ``enable_sleep_mode`` and another sleep-mode backend, :func:`check_config` refuses
the KV cache (:class:`UnsupportedKVCache`): that backend would neither release the KV memory nor
keep vmmkv's bookkeeping. Note: vLLM offloads CUDA-graph memory on sleep
(``sleep_mode_offload_cudagraph``) only under the backend name ``cumem``; under ``vmmkv`` the
graphs' memory stays resident (the graphs stay valid either way).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Iterator
from typing import Any

from vllm.device_allocator.sleep_mode_backend import (
    CuMemBackend,
    SleepModeBackend,
    SleepModeBackendFactory,
)

from ._patches import active_cache

__all__ = [
    "INNER_ENV",
    "KV_TAG",
    "NAME",
    "VmmkvSleepModeBackend",
    "check_config",
    "register_backend",
]

log = logging.getLogger(__name__)

NAME = "vmmkv"
KV_TAG = "kv_cache"
INNER_ENV = "VMMKV_SLEEP_INNER_BACKEND"
DEFAULT_INNER = "cumem"


def inner_name() -> str:
    """The vLLM sleep-mode backend the ``vmmkv`` backend wraps (``VMMKV_SLEEP_INNER_BACKEND``,
    default ``cumem``)."""
    name = os.environ.get(INNER_ENV, "").strip() or DEFAULT_INNER
    if name == NAME:
        raise ValueError(f"{INNER_ENV} must name another sleep-mode backend than {NAME!r}")
    return name


def _inner_class() -> type[SleepModeBackend]:
    return SleepModeBackendFactory.get_backend_class(inner_name())


def register_backend() -> None:
    """Register the ``vmmkv`` sleep-mode backend with vLLM's ``SleepModeBackendFactory``
    (lazy: vLLM imports this module when it resolves the name). Local, idempotent. Raises
    UnsupportedVLLM when vLLM's backend interface is not the one of 0.33.0."""
    for method, params in (("suspend", ("self", "level")), ("resume", ("self", "tags")),
                           ("discard", ("self", "tags"))):  # fmt: skip
        _check_signature(getattr(SleepModeBackend, method), params, f"SleepModeBackend.{method}")
    try:
        SleepModeBackendFactory.register_backend(NAME, __name__, "VmmkvSleepModeBackend")
    except ValueError:  # registered already: by us (idempotent), or someone else's name
        if SleepModeBackendFactory.get_backend_class(NAME) is not VmmkvSleepModeBackend:
            raise


def check_config(cfg: Any) -> None:
    """Refuse (UnsupportedKVCache) sleep mode with a sleep-mode backend other than ``vmmkv``:
    it would neither release the KV cache (vmmkv memory is outside vLLM's pool) nor keep
    vmmkv's bookkeeping tensors (allocated under vLLM's ``kv_cache`` pool tag). Local."""
    model = getattr(cfg, "model_config", None)
    if model is None or not getattr(model, "enable_sleep_mode", False):
        return
    backend = getattr(model, "sleep_mode_backend", DEFAULT_INNER)
    if backend != NAME:
        from ._layout import UnsupportedKVCache

        raise UnsupportedKVCache(
            f"sleep mode with the sleep-mode backend {backend!r}: vmmkv holds the KV cache "
            "outside vLLM's sleep allocator, so that backend would not release it and would "
            f"drop vmmkv's bookkeeping; use --sleep-mode-backend {NAME} (it wraps "
            f"{DEFAULT_INNER!r} for everything else; {INNER_ENV} picks another)"
        )


def _check_signature(fn: Any, params: tuple[str, ...], what: str) -> None:
    """UnsupportedVLLM unless ``fn`` takes the named parameters (vLLM 0.33.0's signatures)."""
    from ._patches import UnsupportedVLLM

    try:
        names = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as exc:
        raise UnsupportedVLLM(f"vmmkv: cannot read the signature of {what}: {exc}") from exc
    if names[: len(params)] != params:
        raise UnsupportedVLLM(
            f"vmmkv: {what} takes {names}, vmmkv was written for {params} (vLLM 0.33.0)"
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
        # (the VllmKVCache released, its committed blocks before), or None
        self._released: tuple[Any, int] | None = None

    # -- what vLLM calls -------------------------------------------------------------
    def suspend(self, level: int = 1) -> None:
        cache = active_cache()
        offload = self._offload_kv_tag(cache)  # checked before anything is released
        if cache is not None:
            self._release(cache, "sleep")
        with offload:
            self.inner.suspend(level)
        self._state = "SUSPENDED"

    def resume(self, tags: list[str] | None = None) -> None:
        self._state = "RESUMING"
        self.inner.resume(tags)  # first: vmmkv's bookkeeping tensors are mapped back
        if tags is None or KV_TAG in tags:
            self._restore()
        self._state = "RUNNING"

    def discard(self, tags: tuple[str, ...]) -> None:
        tags = tuple(tags)
        cache = active_cache()
        if cache is None or KV_TAG not in tags:
            self.inner.discard(tags)
            self._state = "SUSPENDED"
            return
        rest = tuple(t for t in tags if t != KV_TAG)
        self._release(cache, "discard")
        if rest:
            self.inner.discard(rest)
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
        return None if self._released is None else self._released[1]

    def _release(self, cache: Any, why: str) -> None:
        """Collective: the KV cache to 0 blocks on every PCP rank (memory released, peers
        unmapped), the count before remembered. Nothing when it is released already."""
        if self._released is not None and self._released[0] is cache:
            return
        blocks = cache.committed_blocks
        cache.shrink(0)
        self._released = (cache, blocks)
        log.info(
            "vmmkv: %s released the KV cache (%d of %d blocks committed before) on PCP "
            "rank %d of %d", why, blocks, cache.num_blocks, cache.rank, cache.world_size,
        )  # fmt: skip

    def _restore(self) -> None:
        """Collective: the released KV cache back to its block count, zeroed, at the same
        addresses. Nothing when nothing is released."""
        if self._released is None:
            return
        cache, blocks = self._released
        if cache is not active_cache():
            log.warning(
                "vmmkv: the KV cache released at sleep is not the active one any more "
                "(closed or replaced); nothing to restore"
            )
            self._released = None
            return
        cache.grow(blocks)  # raises on every rank on failure: the record stays, retry
        self._released = None
        log.info(
            "vmmkv: wake-up restored %d KV blocks (zeroed) on PCP rank %d of %d",
            blocks, cache.rank, cache.world_size,
        )  # fmt: skip

    def _offload_kv_tag(self, cache: Any) -> contextlib.AbstractContextManager[None]:
        """With a vmmkv cache under vLLM's CuMem backend: a context in which the
        allocator's ``sleep`` offloads the ``kv_cache`` tag too (it holds vmmkv's
        bookkeeping tensors, not the KV bytes). Else nothing."""
        if cache is None or type(self.inner) is not CuMemBackend:
            return contextlib.nullcontext()
        from vllm.device_allocator import get_mem_allocator_instance

        allocator = get_mem_allocator_instance()
        _check_signature(allocator.sleep, ("offload_tags",), "the sleep allocator's sleep")
        return _kv_tag_offloaded(allocator)


@contextlib.contextmanager
def _kv_tag_offloaded(allocator: Any) -> Iterator[None]:
    """``allocator.sleep(offload_tags=...)`` adds the ``kv_cache`` tag for the duration."""
    sleep = allocator.sleep
    had = "sleep" in vars(allocator)

    def sleep_offloading_kv(offload_tags: Any = None) -> Any:
        if offload_tags is None:
            offload_tags = (getattr(allocator, "default_tag", "default"),)
        elif isinstance(offload_tags, str):
            offload_tags = (offload_tags,)
        return sleep(offload_tags=tuple(dict.fromkeys((*offload_tags, KV_TAG))))

    allocator.sleep = sleep_offloading_kv
    try:
        yield
    finally:
        if had:
            allocator.sleep = sleep
        else:
            del allocator.sleep
