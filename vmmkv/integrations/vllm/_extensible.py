"""vLLM 0.34's extensible KV cache with vmmkv as its physical layer (PCP > 1).

vLLM 0.34 reserves the KV cache's address range itself (``ExtensibleKVCache``, on by default on
CUDA), commits a prefix of blocks on demand and keeps the planning, the post-capture sizing, the
views, sleep, discard and shutdown. It builds its byte buffer through the module-level name
``vllm.v1.worker.extensible_kv_cache.ExtensibleTensor``; the plugin binds that name to
:func:`make_buffer`, which under PCP > 1 returns a :class:`PeerKVBuffer`: the same nine members
vLLM uses (``device``, ``free``, ``full_view``, ``granularity``, ``physical_bytes``,
``release_physical``, ``resize_segments_``, ``segment_view``, ``segments_backed_by_one_chunk``)
over one :class:`VllmKVCache`, whose region every PCP rank maps: a commit is vmmkv's collective
grow (exportable chunks, fd exchange, peer maps, the new blocks zeroed before any peer maps them), a
release its collective shrink to 0 (peers unmapped first). With PCP = 1 it returns vLLM's own
``ExtensibleTensor``: nothing of vmmkv runs.

Why this seam (docs/design.md, "vLLM 0.34's extensible KV cache"): vLLM keeps what 0.34 gives
every user by default (sizing after CUDA-graph capture from measured memory, the 1.0
``gpu_memory_utilization`` default, ``release_kv_cache_memory`` and sleep without a special
backend, KV lending for layer-wise weight updates), and vmmkv adds what 0.34 lacks: every rank
maps its peers' replicas, and the PCP gather + insert becomes one direct store.

The sites (installed with the others by ``_patches.install``):

| site | replaced by |
|---|---|
| ``extensible_kv_cache: ExtensibleTensor`` | :func:`make_buffer` |
| ``extensible_kv_cache: ExtensibleKVCache.__init__`` | vLLM's, with its config and layout handed to :func:`make_buffer` (the buffer's own parameters carry only sizes) |
| ``extensible_kv_cache: _release_for_weight_update`` | vLLM's decision taken on every PCP rank, then agreed: if any rank lends, every rank lends (a rank releasing alone would leave its peers writing into chunks it dropped) |

``_patches``' ``allocate_kv_cache`` replacement, called by vLLM with ``allocate=`` the cache's
hook, hands over to :func:`allocate_extensible`: vLLM builds its views over the buffer (its
hook commits the minimum, collectively), and every MLA and indexer view must be one vmmkv bound.
``extend_kv_cache`` later re-binds views sized to the committed blocks at the same addresses,
which the cache's bindings accept (``VllmKVCache.binding``).

Why every collective lines up: vLLM calls the buffer on every rank in the same order: the
allocate hook, warmup commits (counts min-reduced over the world group), the two shrink-remaps
before capture, ``extend_kv_cache`` (a ``collective_rpc``), sleep, wake and discard
(``collective_rpc``), shutdown (``free``, local). The one per-rank decision, lending for a
weight update, is agreed here.

Elastic mode (``VLLM_VMMKV_ELASTIC=1``, docs/design.md "Elastic KV in vLLM"): the engine
core's pool lives below the budget ``extend_kv_cache`` commits; :func:`settle_elastic` brings
every rank down to the floor right after it, and ``_elastic_sites`` keeps vLLM's count of
committed blocks equal to vmmkv's (:func:`vllm_cache_of` finds vLLM's cache), so that vLLM's
recommit commits the elastic size; :attr:`PeerKVBuffer.released` says that vLLM holds the
memory released (nothing is committed for a resize then).

Contract: :func:`make_buffer`, ``resize_segments_``, ``release_physical``,
:func:`settle_elastic` and the lending decision are collective over the PCP group; the views, ``free`` (idempotent; closes the cache
and clears the plugin's active cache) and the properties are local. Not capture-safe: vLLM
commits outside graph capture. The buffer owns its ``VllmKVCache``; vLLM owns the buffer
(``ExtensibleKVCache.free`` at the runner's shutdown).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

import torch

from ._state import _STATE

__all__ = ["PeerKVBuffer", "allocate_extensible", "make_buffer", "settle_elastic", "vllm_cache_of"]

log = logging.getLogger(__name__)

MODULE = "vllm.v1.worker.extensible_kv_cache"


class PeerKVBuffer:
    """vLLM's ``ExtensibleTensor`` interface over a :class:`VllmKVCache` whose region every PCP
    rank maps. Segment ``i`` holds blocks of stride ``strides[i]``; its committed prefix is
    always ``committed_blocks * strides[i]`` bytes (vmmkv commits blocks ``[0, n)`` of every
    segment together, as vLLM's ``ExtensibleKVCache.commit`` asks)."""

    def __init__(self, cache: Any, offsets: Sequence[int], capacities: Sequence[int],
                 strides: Sequence[int]) -> None:  # fmt: skip
        self.cache = cache
        self._offsets, self._capacities = list(offsets), list(capacities)
        self._strides = list(strides)
        self._device = torch.device(cache.cache.device)
        self._closed = False
        # vLLM released the memory (sleep, discard, lending) and has not committed since
        self.released = False
        # elastic mode: the blocks vLLM's extend_kv_cache committed (the scheduler's capacity)
        self.budget: int | None = None

    # -- what vLLM uses ------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def granularity(self) -> int:
        # The unit a commit rounds each segment to (the region's chunk: the driver's granule
        # unless VMMKV_CHUNK_MIB), which vLLM's physical_bytes_for rounds every segment up to:
        # vLLM sizes the cache after capture by what vmmkv maps.
        return int(self.cache.cache.region.chunk_bytes)

    @property
    def physical_bytes(self) -> int:
        """The own replica's mapped bytes (its runs; peers' not counted)."""
        return 0 if self._closed else int(self.cache.cache.committed_bytes)

    def full_view(self) -> torch.Tensor:
        """The uint8 tensor over the whole reservation (vLLM's backing size)."""
        self._check_open("full_view")
        return self.cache.buffer

    def segment_view(self, index: int) -> torch.Tensor:
        """The uint8 tensor over segment ``index``'s committed prefix, sized exactly to it."""
        self._check_open("segment_view")
        if not 0 <= index < len(self._offsets):
            raise IndexError(f"segment {index} out of range ({len(self._offsets)})")
        start = self._offsets[index]
        return self.cache.buffer[start : start + self._committed(index)]

    def resize_segments_(self, sizes: Sequence[int], zero_new: bool = False) -> None:
        """Collective: grow every segment to ``sizes`` bytes, which must be the same block
        count of every segment (vLLM's commit). The new blocks are always zeroed, in every
        replica before any rank returns (vLLM's own buffer zeroes them too: its ``commit``
        promises zeroed blocks); ``zero_new`` is accepted for vLLM's signature."""
        self._check_open("resize_segments_")
        n = self._blocks_of(sizes)
        if n < self.cache.committed_blocks:
            raise ValueError(
                f"rank {self.cache.rank}: resize_segments_ is grow-only: {n} blocks requested, "
                f"{self.cache.committed_blocks} committed"
            )
        self.cache.grow(n)
        self.released = False

    def release_physical(self) -> None:
        """Collective: every replica drops all its memory (peers unmapped first); addresses and
        views stay valid, and nothing may be written until the next commit."""
        self._check_open("release_physical")
        self.cache.shrink(0)
        self.released = True

    def segments_backed_by_one_chunk(self, sizes: Sequence[int]) -> list[bool]:
        """Whether each segment's first ``sizes[i]`` bytes lie inside one run of the own
        replica (one driver allocation), as vLLM's own buffer answers it (an RDMA registration
        of a segment needs one allocation). Local. vLLM asks it only to defragment for a KV
        connector, which the plugin refuses today."""
        self._check_open("segments_backed_by_one_chunk")
        if len(sizes) != len(self._offsets):
            raise ValueError(
                f"rank {self.cache.rank}: segments_backed_by_one_chunk: expected "
                f"{len(self._offsets)} segment sizes, got {len(sizes)}"
            )
        region = self.cache.cache.region.region
        base = self.cache.buffer.data_ptr() - region.base_ptr
        runs = region.chunks()
        starts = [c.offset for c in runs]
        out = []
        for off, size in zip(self._offsets, sizes, strict=True):
            lo = base + off
            i = bisect.bisect_right(starts, lo) - 1
            out.append(i >= 0 and lo + size <= runs[i].offset + runs[i].size)
        return out

    def free(self) -> None:
        """Local, idempotent: close the cache (the views are invalid afterwards)."""
        if self._closed:
            return
        self._closed = True
        if _STATE.active is self.cache:
            from ._patches import close_active

            close_active("vLLM frees its extensible KV cache")
        else:
            self.cache.close()

    # -- more of ExtensibleTensor, for tools and tests -----------------------------------------
    @property
    def segment_offsets(self) -> list[int]:
        return list(self._offsets)

    @property
    def segment_capacities(self) -> list[int]:
        return list(self._capacities)

    @property
    def num_segments(self) -> int:
        return len(self._offsets)

    @property
    def num_bytes(self) -> int:
        return sum(self._committed(i) for i in range(len(self._offsets)))

    # -- internals -----------------------------------------------------------------------------
    def _committed(self, index: int) -> int:
        return 0 if self._closed else self.cache.committed_blocks * self._strides[index]

    def _blocks_of(self, sizes: Sequence[int]) -> int:
        if len(sizes) != len(self._strides):
            raise ValueError(f"expected {len(self._strides)} segment sizes, got {len(sizes)}")
        counts = {
            s // st if s % st == 0 else -1 for s, st in zip(sizes, self._strides, strict=True)
        }
        n = counts.pop() if len(counts) == 1 else -1
        if n < 0 or n > self.cache.num_blocks:
            raise ValueError(
                f"rank {self.cache.rank}: segment sizes {list(sizes)} are not one block count "
                f"(<= {self.cache.num_blocks}) of the segments' block strides {self._strides}"
            )
        return n

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"rank {self.cache.rank}: {what} on a freed vmmkv KV buffer")


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
    from ._cache import _chunk_bytes_from_env
    from ._patches import build_cache, check_vllm_config, close_active, original

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
    """Elastic mode (``VLLM_VMMKV_ELASTIC=1``): its chunk (``_cache.elastic_chunk_bytes``, the
    grid its releases return memory in), after
    the refusals of vmmkv's own allocation in elastic mode (what it has not been tested with; a
    layer-major layout, whose blocks span every layer's segment); the worker's applied resize
    requests reset. None otherwise. Local."""
    from ._elastic import elastic_enabled

    if not elastic_enabled():
        return None
    from ._cache import elastic_chunk_bytes
    from ._elastic_sites import WORKER, check_elastic_config
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


def _chunk_and_runs(
    granularity: int, size: int, elastic: int | None, env: int | None
) -> tuple[int, int]:
    """The region's ``(chunk_bytes, run_bytes)`` for a cache of ``size`` bytes. ``env``
    (``VMMKV_CHUNK_MIB``) makes both that chunk (one allocation per chunk); else the chunk is
    the allocation ``granularity``, so that vLLM's estimate (each segment rounded up to the
    buffer's ``granularity``) is what vmmkv maps, and runs follow vLLM's own buffer: one
    allocation per stretch of each segment a commit adds (DeepSeek-V3.2's layer-major cache:
    122 runs, one per layer segment), cut at elastic mode's chunk (``elastic``, 64 MiB) so that
    its releases return what a grid of those chunks returns (docs/design.md, "Chunk sizes").
    Pure: no vLLM, no driver call.

    Why runs: a commit's time is per allocation and peer, not per byte; an extend of ~25 GiB in
    2 MiB allocations took 4.9 s at 2 ranks on one H100, where the same bytes in 122 runs take
    a plain driver replay 16 ms (docs/design.md, "Chunk sizes")."""
    from ..._util import round_up

    if env:
        return env, env
    if elastic:
        return granularity, round_up(elastic, granularity)
    return granularity, round_up(size, granularity)


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


def vllm_cache_of(cache: Any) -> Any:
    """vLLM's ``ExtensibleKVCache`` whose buffer holds ``cache``, or None (vmmkv's own
    allocation, or that cache gone). Local."""
    ext = _STATE.extensible() if _STATE.extensible is not None else None
    buffer = getattr(ext, "buffer", None)
    return ext if isinstance(buffer, PeerKVBuffer) and buffer.cache is cache else None


def settle_elastic(ext: Any, vllm_config: Any, kv_cache_config: Any, budget: int) -> int:
    """Elastic mode, right after vLLM's ``extend_kv_cache`` committed ``budget`` blocks on every
    rank: every rank comes down to the floor the engine core's pool starts at (both computed
    from ``budget``, the scheduler's block count, and the same config and environment), and
    vLLM's count of committed blocks with it, so that a wake or a lending's recommit commits
    what elastic mode holds. Collective over the PCP group (vLLM extends through a
    ``collective_rpc``). ``kv_cache_config``: the worker's (reserved capacity). Returns the
    committed blocks.

    Why after the commit of ``budget``, not instead of it: ``extend_kv_cache`` re-binds views of
    ``budget`` blocks and checks its count against them, and mapping ``budget`` once on every
    rank proves at start that the pool's largest size can be mapped. CUDA graphs captured
    before (over the reserved range, the minimum committed) stay valid: their kernels resolve
    block addresses at replay, and the pool hands out no block at or above the floor until a
    grow to it is confirmed."""
    from ._cache import elastic_chunk_bytes
    from ._elastic_sites import settings_for
    from ._layout import UnsupportedKVCache

    buffer = ext.buffer
    settings = settings_for(vllm_config, kv_cache_config, elastic_chunk_bytes(), budget)
    if settings.floor < ext.min_committed_blocks:
        raise UnsupportedKVCache(
            f"elastic KV: a floor of {settings.floor} blocks is below the "
            f"{ext.min_committed_blocks} blocks vLLM's extensible KV cache keeps committed under "
            "a block-major layout; raise VMMKV_ELASTIC_FLOOR_BLOCKS"
        )
    buffer.budget = budget
    cache = buffer.cache
    if cache.committed_blocks > settings.floor:
        cache.shrink(settings.floor)
    ext.num_committed_blocks = cache.committed_blocks
    log.info(
        "vmmkv: elastic KV under vLLM's extensible KV cache: %d of %d committed blocks kept "
        "(the floor) on PCP rank %d of %d", cache.committed_blocks, budget, cache.rank,
        cache.world_size,
    )  # fmt: skip
    return cache.committed_blocks


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


def agreed_lending(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``_release_for_weight_update``: vLLM's decision on every PCP rank, its release held
    back; then one agreement over the group (bounded in time): any rank's error is raised on
    every rank (naming the ranks), else if any rank lends every rank releases (collective)."""

    def _release_for_weight_update(kv_cache, model, *, reclaimable, fail_if_short):
        buffer = kv_cache.buffer
        if not isinstance(buffer, PeerKVBuffer):
            return orig(kv_cache, model, reclaimable=reclaimable, fail_if_short=fail_if_short)
        cache = buffer.cache
        wants: list[bool] = []
        error: BaseException | None = None
        try:
            orig(_DecisionOnly(buffer, wants), model, reclaimable=reclaimable,
                 fail_if_short=fail_if_short)  # fmt: skip
        except Exception as exc:
            error = exc
        mine = "error" if error is not None else ("lend" if wants else "keep")
        votes = cache.cache.region.all_gather(
            [mine, "" if error is None else str(error)], "KV lending for a weight update"
        )
        failed = {r: why for r, (v, why) in enumerate(votes) if v == "error"}
        if failed:
            detail = "; ".join(f"rank {r}: {why}" for r, why in failed.items())
            raise RuntimeError(
                f"rank {cache.rank}: the weight update cannot borrow the KV cache's memory on "
                f"PCP ranks {sorted(failed)} ({detail}); no rank released it"
            ) from error
        if any(v == "lend" for v, _ in votes):
            kv_cache.release_physical()
            return True
        return False

    return _release_for_weight_update


class _DecisionOnly:
    """What ``_release_for_weight_update`` reads of an ``ExtensibleKVCache``, with its release
    recorded instead of done."""

    def __init__(self, buffer: PeerKVBuffer, wants: list[bool]) -> None:
        self.buffer = buffer
        self._wants = wants

    def release_physical(self) -> None:
        self._wants.append(True)
