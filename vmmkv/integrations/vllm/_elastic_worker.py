"""Elastic KV: the worker's side. Every worker applies the engine core's resize requests
collectively and stamps its outputs with what it holds (``_elastic`` has the policy,
``_elastic_engine`` the engine core's sites; the package docstring, "Elastic KV", the user's
view).

The sites (``_install.WORKER_SITES``, added to the plugin's worker sites in elastic mode):

| site | replaced by |
|---|---|
| ``GPUModelRunner.update_requests`` | a step without a resize request refused (an engine core without the engine sites); the step's resize request applied (collective, once per sequence number, before vLLM's zeroing and block copies, outside any graph), every block id the step adds checked committed, then vLLM's |
| ``GPUModelRunner.execute_model``, ``sample_tokens`` | vLLM's; the output stamped ``(seq, committed blocks, error)`` |
| ``Worker.extend_kv_cache`` | vLLM's (its extensible KV cache commits the budget on every rank), then, under vmmkv's buffer, every rank down to the floor, vLLM's count of committed blocks with it (:func:`settle_elastic`) |

Why the worker may resize there: every PCP rank receives the same ``SchedulerOutput``s in the
same order and runs ``update_requests`` for each (even a step of 0 tokens), before any graph
replay; vmmkv's resize checks that every rank asks for the same size. A grow refused by the
group leaves every rank at its old size with the same error; the worker reports it on its
output instead of failing the step, because the scheduler hands out the new blocks only after a
confirmation. A resize that reaches a worker while the sleep-mode backend holds its cache
released commits nothing: it becomes the size the wake restores (every rank alike). Under
vLLM's extensible KV cache every resize also sets vLLM's count of committed blocks, so vLLM's
own recommit (wake, the end of a lending) commits the size elastic mode holds; a target above
the budget vLLM committed at extend is refused on the stamp. Local
state: one :class:`ElasticWorker` per worker process, reset with each cache.

Under vLLM's extensible KV cache (docs/design.md, "Elastic KV in vLLM") the engine core's pool
lives below the budget ``extend_kv_cache`` commits: :func:`settle_elastic` brings every rank down
to the floor right after it (collective over the PCP group), and :func:`vllm_cache_of` finds
vLLM's ``ExtensibleKVCache`` over the process's cache (``_allocation.capture_spec`` keeps a weak
reference to it in ``_state``), whose count of committed blocks every resize sets.

Also run on every worker through vLLM's ``collective_rpc``: :func:`worker_resize` (the engine
core's idle release) and :func:`worker_stats` (each rank's committed blocks and bytes).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from ... import _blockset as blockset
from ._buffer import PeerKVBuffer, elastic_chunk_bytes
from ._elastic_settings import RESIZE, STAMP, settings_for
from ._state import _STATE, active_cache

log = logging.getLogger(__name__)

__all__ = [
    "WORKER", "ElasticWorker", "on_update_requests", "settle_elastic", "vllm_cache_of",
    "worker_resize", "worker_stats",
]  # fmt: skip


class ElasticWorker:
    """A worker's applied resize requests: the last sequence number and its outcome.

    A request is ``(seq, target)``: ``target`` an int ``n`` (blocks ``[0, n)``, the prefix) or
    a block set ``((start, end), ...)`` (``VllmKVCache.set_committed_blocks``: holes release
    the chunks no block of the set needs). The stamp is ``(seq, committed, error)``:
    ``committed`` an int while the committed set is a prefix (always, unless a set made
    holes), else the canonical set itself (a few intervals: the engine core confirms a grow
    by ``blockset.is_subset(target, blockset.as_set(committed))``)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seq = 0
        self.error: str | None = None
        # "start" until vLLM's compile_or_warm_up_model returns: its warmup steps are vLLM's own
        # SchedulerOutputs, without a resize request; "serving" afterwards
        self.phase = "start"
        self.floor: int | None = None  # vmmkv's own allocation: the floor the pool starts at
        # the committed block sets every worker of the engine reported at the last agreement
        # (None with one PCP group): the stamp reports what all of them hold
        self.agreed: list[Any] | None = None
        self._comm: Any = None  # a StoreComm over vLLM's world group, for those agreements

    def apply(self, cache: Any, resize: tuple[int, Any] | None) -> None:
        """Collective when ``resize`` carries a new sequence number: every PCP rank gets the
        same one in the same step. A refused resize (the group's error, every size unchanged)
        is recorded for the stamp; one that left this rank's size changed re-raises. While the
        sleep-mode backend holds ``cache`` released (every rank alike), nothing is committed:
        the target becomes the size the wake restores, as the scheduler's limit follows it."""
        if resize is None or resize[0] <= self.seq:
            return
        seq, target = resize
        self.seq, self.error = seq, None
        ext = vllm_cache_of(cache)
        released = _released(cache)
        held = getattr(cache, "committed_block_set", None)
        if ext is not None:
            self._apply_extensible(cache, ext, _as_int_if_prefix(target))
        elif released is not None:
            self._retarget_released(cache, released, target)
        elif isinstance(target, int) and (held is None or blockset.as_prefix(held) is not None):
            self._resize_prefix(cache, target)
        else:
            self._resize_set(cache, target)
        self._agree(cache)

    def _agree(self, cache: Any) -> None:
        """With more than one PCP group in the engine (TP > 1: one group and one cache per TP
        rank), every worker of the engine reports what it holds and its error; each group
        resized on its own, so a grow refused in one group (out of memory on one GPU) is seen
        by all: the stamp then reports the blocks every group holds and every error, the same
        on every worker, and the engine core's pool confirms nothing that one group lacks. A
        group that grew keeps its memory (targets are absolute: the next grow is a no-op
        there). Collective over vLLM's world group, bounded by the cache's timeout; every
        worker reaches it once per sequence number (every worker gets every step)."""
        # Outside vLLM's distributed setup (tools driving the policy, where vLLM may not even be
        # installed, as on the GPU machines): one group. vLLM's parallel state is read only if a
        # vLLM worker already imported it.
        ps = sys.modules.get("vllm.distributed.parallel_state")
        world = (
            ps.get_world_group() if ps is not None and ps.model_parallel_is_initialized() else None
        )
        if world is None or world.world_size == ps.get_pcp_group().world_size:
            self.agreed = None
            return
        if self._comm is None:
            from ...ipc.comm import StoreComm

            self._comm = StoreComm(world.cpu_group, cache.timeout, tag="elastic-engine")
        mine = [list(map(list, self._held(cache))), self.error]
        votes = self._comm.all_gather(mine, f"elastic resize {self.seq}")
        self.agreed = [tuple(tuple(p) for p in held) for held, _ in votes]
        errors = {e: r for r, (_, e) in reversed(list(enumerate(votes))) if e}
        if errors:
            self.error = "; ".join(f"global rank {r}: {e}" for e, r in errors.items())

    def _held(self, cache: Any) -> Any:
        """This worker's committed blocks as a block set (what a wake restores while
        released)."""
        committed = self._own(cache)
        return blockset.as_set(committed) if isinstance(committed, int) else committed

    def cover(self, cache: Any, so: Any) -> None:
        """A step of vLLM's own start-up (warmup) on vmmkv's own allocation: commit the blocks it
        addresses, collectively over the PCP group (every rank runs the same warmup steps).
        Under vLLM's extensible KV cache vLLM commits them itself (``ensure_kv_cache_blocks``)."""
        ids = step_block_ids(so)
        if not ids or vllm_cache_of(cache) is not None:
            return
        need = max(ids) + 1
        if (
            need > cache.committed_blocks
            and blockset.as_prefix(cache.committed_block_set) is not None
        ):
            cache.grow(need)

    def end_warmup(self, cache: Any) -> None:
        """vLLM's ``compile_or_warm_up_model`` returned: on vmmkv's own allocation every rank
        comes back down to the floor the engine core's pool starts at (collective over the PCP
        group: vLLM runs warmup through a ``collective_rpc``); then steps must carry a resize
        request. Under vLLM's extensible KV cache ``settle_elastic`` sets the floor after
        ``extend_kv_cache``."""
        if (
            vllm_cache_of(cache) is None
            and self.floor is not None
            and cache.committed_blocks > self.floor
        ):
            cache.shrink(self.floor)
        self.phase = "serving"

    def _resize_prefix(self, cache: Any, target: int) -> None:
        before = cache.committed_blocks
        if target == before:
            return
        try:
            (cache.grow if target > before else cache.shrink)(target)
        except Exception as exc:
            if cache.committed_blocks != before:
                raise
            self._refused(cache, before, target, exc)

    def _resize_set(self, cache: Any, target: Any) -> None:
        """A block set (or a prefix over a set with holes), collectively on every rank."""
        before = cache.committed_block_set
        try:
            want = blockset.prefix(target) if isinstance(target, int) else target
            if blockset.block_set(want, cache.num_blocks, "elastic target") == before:
                return
            cache.set_committed_blocks(want)
        except Exception as exc:
            if cache.committed_block_set != before:
                raise
            self._refused(cache, before, target, exc)

    def _refused(self, cache: Any, before: Any, target: Any, exc: Exception) -> None:
        self.error = f"rank {cache.rank}: {type(exc).__name__}: {exc}"
        log.warning("vmmkv: elastic resize %s -> %s refused: %s", before, target, self.error)

    def _retarget_released(self, cache: Any, released: Any, target: Any) -> None:
        """The wake restores ``target`` (a prefix or a set): nothing is committed now."""
        try:
            want = blockset.as_set(target) if isinstance(target, int) else target
            want = blockset.block_set(want, cache.num_blocks, "elastic target")
        except (TypeError, ValueError) as exc:
            self._refused(cache, released.blocks, target, exc)
            return
        log.info(
            "vmmkv: rank %d: elastic resize to %s while the KV cache is released (sleep or "
            "discard): the wake restores it, not %s", cache.rank, target, released.committed,
        )  # fmt: skip
        released.set_committed(want)

    def _apply_extensible(self, cache: Any, ext: Any, target: Any) -> None:
        """Under vLLM's extensible KV cache: resize, and set vLLM's count of committed blocks
        to the outcome, so that vLLM's own recommit (wake, the end of a lending) commits the
        size elastic mode holds. While vLLM holds the memory released nothing is committed:
        the target becomes vLLM's count (every rank alike, no collective). A target above
        the budget vLLM committed at extend (its views end there) is refused, and so is a
        block set with holes: vLLM's recommit commits a prefix of its count, so a hole would
        come back committed after every wake (refused on the stamp, every size unchanged)."""
        buffer = ext.buffer
        if not isinstance(target, int):
            self.error = (
                f"rank {cache.rank}: ValueError: elastic target {target} is not a prefix: refused "
                "under vLLM's extensible KV cache, whose recommit (wake, the end of a lending) "
                "commits a prefix of its num_committed_blocks"
            )
            log.warning("vmmkv: elastic resize refused: %s", self.error)
            return
        if buffer.released:
            log.info(
                "vmmkv: rank %d: elastic resize to %d blocks while vLLM holds the KV cache "
                "released: its recommit commits %d blocks, not %d", cache.rank, target,
                target, ext.num_committed_blocks,
            )  # fmt: skip
            ext.num_committed_blocks = target
            return
        before = cache.committed_blocks
        try:
            if buffer.budget is None or target > buffer.budget:
                raise ValueError(
                    f"elastic target {target} blocks above vLLM's committed budget "
                    f"{buffer.budget} (extend_kv_cache)"
                )
            if target != before:
                (cache.grow if target > before else cache.shrink)(target)
        except Exception as exc:
            if cache.committed_blocks != before:
                raise
            self._refused(cache, before, target, exc)
        finally:
            ext.num_committed_blocks = cache.committed_blocks

    def stamp(self, cache: Any) -> tuple[int, Any, str | None]:
        """``(seq, committed, error)``: ``committed`` the committed blocks, an int while they
        are a prefix, else the block set; while released, what the wake restores (vmmkv's
        sleep-mode backend, or vLLM's recommit under its extensible KV cache). With several
        PCP groups, the blocks every worker of the engine reported at the last agreement and
        this worker holds now (the same on every worker)."""
        committed = self._own(cache)
        if self.agreed is not None:
            common = self._held(cache)
            for held in self.agreed:
                common = blockset.intersection(common, held)
            n = blockset.as_prefix(common)
            committed = common if n is None else n
        return (self.seq, committed, self.error)

    def _own(self, cache: Any) -> Any:
        ext = vllm_cache_of(cache)
        if ext is not None:
            return ext.num_committed_blocks if ext.buffer.released else cache.committed_blocks
        released = _released(cache)
        if released is not None:
            return released.committed
        held = getattr(cache, "committed_block_set", None)
        if held is None or blockset.as_prefix(held) is not None:
            return cache.committed_blocks
        return held


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


def _as_int_if_prefix(target: Any) -> Any:
    """A block set that is a prefix ``[0, n)`` as ``n``; anything else as it is."""
    if isinstance(target, int) or not isinstance(target, (tuple, list)):
        return target
    try:
        n = blockset.as_prefix(blockset.block_set(target, 1 << 62))
    except (TypeError, ValueError):
        return target
    return target if n is None else n


def _released(cache: Any) -> Any:
    """The sleep-mode backend's record of ``cache`` while it holds it released, else None."""
    released = _STATE.released
    return released if released is not None and released.cache is cache else None


WORKER = ElasticWorker()


def step_block_ids(so: Any) -> list[int]:
    """Every block id a ``SchedulerOutput`` adds to the workers' block tables, zeroes or copies."""
    ids = [i for r in so.scheduled_new_reqs for g in r.block_ids for i in g]
    for new in so.scheduled_cached_reqs.new_block_ids:
        if new:
            ids += [i for g in new for i in g]
    ids += so.new_block_ids_to_zero or ()
    for pair in so.kv_cache_block_copies or ():
        ids += pair
    return ids


def on_update_requests(cache: Any, so: Any) -> None:
    """The worker's part of a step, before vLLM's ``update_requests``: apply the step's resize
    request, then refuse any block id the step adds beyond the committed blocks. A step without
    a resize request comes from an engine core without the elastic sites, whose scheduler hands
    out every block: RuntimeError at once (every rank receives the same step, so every rank
    raises), not at the first block above the floor."""
    resize = getattr(so, RESIZE, None)
    if resize is None and WORKER.phase != "serving":
        WORKER.cover(cache, so)  # vLLM's own warmup step
    elif resize is None:
        raise RuntimeError(
            f"rank {cache.rank}: update_requests: elastic KV (VLLM_VMMKV_ELASTIC=1) got a "
            f"SchedulerOutput without {RESIZE}: the engine core runs without vmmkv's elastic "
            f"engine sites, so vLLM's scheduler may hand out blocks this worker never committed "
            f"({cache.committed_blocks} are). Give the engine core's process VLLM_USE_VMMKV=1 "
            "and VLLM_VMMKV_ELASTIC=1 as well, or run every process without "
            "VLLM_VMMKV_ELASTIC=1"
        )
    else:
        WORKER.apply(cache, resize)
    cache.check_blocks(step_block_ids(so))


def stamp_output(out: Any, cache: Any) -> Any:
    """The worker's output carrying this worker's stamp; an async output stamps the output it
    yields later with the stamp of now (the step's). vLLM's shared empty output is copied."""
    if out is None or cache is None:
        return out
    stamp = WORKER.stamp(cache)
    get_output = getattr(out, "get_output", None)
    if get_output is not None and not hasattr(out, "req_ids"):

        def stamped_get_output():
            return _stamped(get_output(), stamp)

        out.get_output = stamped_get_output
        return out
    return _stamped(out, stamp)


def _stamped(out: Any, stamp: tuple) -> Any:
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    if out is EMPTY_MODEL_RUNNER_OUTPUT:
        import copy

        out = copy.copy(out)
    setattr(out, STAMP, stamp)
    return out


def worker_resize(worker: Any, seq: int, target: int) -> tuple[int, int, str | None] | None:
    """The idle release's ``collective_rpc`` body on every worker (``worker`` is vLLM's worker,
    unused): apply ``(seq, target)``; returns this worker's stamp (None without a cache)."""
    cache = active_cache()
    if cache is None:
        return None
    WORKER.apply(cache, (seq, target))
    return WORKER.stamp(cache)


def _update_requests(orig: Callable[..., Any]) -> Callable[..., Any]:
    def update_requests(self, scheduler_output):
        cache = active_cache()
        if cache is not None:
            on_update_requests(cache, scheduler_output)
        return orig(self, scheduler_output)

    return update_requests


def _warmup(orig: Callable[..., Any]) -> Callable[..., Any]:
    def compile_or_warm_up_model(self):
        WORKER.phase = "warmup"
        out = orig(self)
        cache = active_cache()
        if cache is not None:
            WORKER.end_warmup(cache)
        return out

    return compile_or_warm_up_model


def _extend(orig: Callable[..., Any]) -> Callable[..., Any]:
    def extend_kv_cache(self, num_blocks):
        orig(self, num_blocks)
        ext = getattr(self.model_runner, "extensible_kv_cache", None)
        if ext is not None and isinstance(ext.buffer, PeerKVBuffer):
            settle_elastic(ext, self.vllm_config, self._kv_cache_config, num_blocks)

    return extend_kv_cache


def _stamping(orig: Callable[..., Any]) -> Callable[..., Any]:
    def stamped(self, *args, **kwargs):
        return stamp_output(orig(self, *args, **kwargs), active_cache())

    return stamped


def worker_stats(worker: Any) -> dict[str, Any] | None:
    """This worker's KV cache as elastic mode left it, for ``collective_rpc(worker_stats)``
    (vLLM runs it on every worker, with the worker as its argument): the rank, the committed
    blocks (a count and the block set), the bytes mapped for them on this rank (whole chunks
    of every segment), the last resize's sequence number and error. None before the cache is
    allocated. Local, read-only."""
    cache = active_cache()
    if cache is None:
        return None
    seq, committed, error = WORKER.stamp(cache)
    return {
        "rank": cache.rank, "committed_blocks": cache.committed_blocks,
        "committed_block_set": cache.committed_block_set,
        "committed_bytes": cache.cache.committed_bytes, "seq": seq, "stamp": committed,
        "error": error,
    }  # fmt: skip
