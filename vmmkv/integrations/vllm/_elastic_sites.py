"""Elastic KV: the vLLM 0.34.0 call sites elastic mode adds, in the engine core and in every
worker (``_elastic`` holds the policy; the package docstring, "Elastic KV", the user's view).

Engine core (``ENGINE_SITES``, installed by ``_patches.install_engine`` when elastic mode is on,
in every process that imports ``vllm.v1.engine.core``, through an import hook if the plugins
load first):

| site | replaced by |
|---|---|
| ``Scheduler.__init__`` | vLLM's, then an :class:`~._elastic.ElasticPool` on its block pool (PCP > 1 only; refusals first); the manager's ``allocate_slots`` watched for refusals (KV pressure) |
| ``Scheduler.schedule`` | the pool's step (cached cap, grow or release), vLLM's schedule, the resize request set on the output |
| ``Scheduler.update_from_output`` | the pool reads the worker's stamp (confirms or refuses a pending grow), then vLLM's |
| ``EngineCoreProc._process_input_queue`` (the busy loop of an engine-core process) | the inputs vLLM deferred during the last step handled first (as vLLM's loop does); then, while idle, awake, unpaused, with no idle-state callback pending and blocks above the floor: wait ``idle_seconds`` for a request (vLLM's watchdog off), else the idle release through ``collective_rpc`` (ordered with every step in vLLM's one queue); then vLLM's |
| ``EngineCore.vmmkv_elastic_stats`` (added: vLLM has none) | the pool's ``stats()``, a utility vLLM's client calls by name (:func:`elastic_stats`) |

Worker (``WORKER_SITES``, added to the plugin's sites in elastic mode):

| site | replaced by |
|---|---|
| ``GPUModelRunner.update_requests`` | a step without a resize request refused (an engine core without the engine sites); the step's resize request applied (collective, once per sequence number, before vLLM's zeroing and block copies, outside any graph), every block id the step adds checked committed, then vLLM's |
| ``GPUModelRunner.execute_model``, ``sample_tokens`` | vLLM's; the output stamped ``(seq, committed blocks, error)`` |
| ``Worker.extend_kv_cache`` | vLLM's (its extensible KV cache commits the budget on every rank), then, under vmmkv's buffer, every rank down to the floor, vLLM's count of committed blocks with it (``_extensible.settle_elastic``) |

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
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import Any

from ... import _blockset as blockset
from ._elastic import ElasticPool
from ._elastic_settings import RESIZE, STAMP, check_elastic_config, settings_for
from ._extensible import PeerKVBuffer, settle_elastic, vllm_cache_of

log = logging.getLogger(__name__)

__all__ = [
    "ENGINE_SITES", "STATS_UTILITY", "WORKER", "WORKER_SITES", "ElasticWorker", "elastic_stats",
    "worker_resize", "worker_stats",
]  # fmt: skip


# -- the worker ------------------------------------------------------------------------------


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
        if ext is not None:
            self._apply_extensible(cache, ext, _as_int_if_prefix(target))
            return
        released = _released(cache)
        if released is not None:
            self._retarget_released(cache, released, target)
            return
        held = getattr(cache, "committed_block_set", None)
        if isinstance(target, int) and (held is None or blockset.as_prefix(held) is not None):
            self._resize_prefix(cache, target)
        else:
            self._resize_set(cache, target)

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
        sleep-mode backend, or vLLM's recommit under its extensible KV cache)."""
        ext = vllm_cache_of(cache)
        if ext is not None:
            blocks = ext.num_committed_blocks if ext.buffer.released else cache.committed_blocks
            return (self.seq, blocks, self.error)
        released = _released(cache)
        if released is not None:
            return (self.seq, released.committed, self.error)
        held = getattr(cache, "committed_block_set", None)
        if held is None or blockset.as_prefix(held) is not None:
            return (self.seq, cache.committed_blocks, self.error)
        return (self.seq, held, self.error)


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
    from ._state import _STATE

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
    if resize is None:
        raise RuntimeError(
            f"rank {cache.rank}: update_requests: elastic KV (VLLM_VMMKV_ELASTIC=1) got a "
            f"SchedulerOutput without {RESIZE}: the engine core runs without vmmkv's elastic "
            f"engine sites, so vLLM's scheduler may hand out blocks this worker never committed "
            f"({cache.committed_blocks} are). Give the engine core's process VLLM_USE_VMMKV=1 "
            "and VLLM_VMMKV_ELASTIC=1 as well, or run every process without "
            "VLLM_VMMKV_ELASTIC=1"
        )
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
    from ._state import active_cache

    cache = active_cache()
    if cache is None:
        return None
    WORKER.apply(cache, (seq, target))
    return WORKER.stamp(cache)


def _update_requests(orig: Callable[..., Any]) -> Callable[..., Any]:
    def update_requests(self, scheduler_output):
        from ._state import active_cache

        cache = active_cache()
        if cache is not None:
            on_update_requests(cache, scheduler_output)
        return orig(self, scheduler_output)

    return update_requests


def _extend(orig: Callable[..., Any]) -> Callable[..., Any]:
    def extend_kv_cache(self, num_blocks):
        orig(self, num_blocks)
        ext = getattr(self.model_runner, "extensible_kv_cache", None)
        if ext is not None and isinstance(ext.buffer, PeerKVBuffer):
            settle_elastic(ext, self.vllm_config, self._kv_cache_config, num_blocks)

    return extend_kv_cache


def _stamping(orig: Callable[..., Any]) -> Callable[..., Any]:
    def stamped(self, *args, **kwargs):
        from ._state import active_cache

        return stamp_output(orig(self, *args, **kwargs), active_cache())

    return stamped


WORKER_SITES: tuple[tuple[str, str, Callable[..., Any], tuple[str, ...]], ...] = (
    (
        "vllm.v1.worker.gpu.model_runner", "GPUModelRunner.update_requests", _update_requests,
        ("self", "scheduler_output"),
    ),
    (
        "vllm.v1.worker.gpu.model_runner", "GPUModelRunner.execute_model", _stamping,
        ("self", "scheduler_output", "intermediate_tensors", "dummy_run",
         "skip_attn_for_dummy_run", "is_profile", "context_len", "valid_dummy_state_slots",
         "randomize_inputs"),
    ),
    (
        "vllm.v1.worker.gpu.model_runner", "GPUModelRunner.sample_tokens", _stamping,
        ("self", "grammar_output"),
    ),
    ("vllm.v1.worker.gpu_worker", "Worker.extend_kv_cache", _extend, ("self", "num_blocks")),
)  # fmt: skip


# -- the engine core -------------------------------------------------------------------------


def pool_of(scheduler: Any) -> ElasticPool | None:
    return getattr(scheduler, "_vmmkv_elastic", None)


def install_pool(scheduler: Any, chunk_bytes: int) -> ElasticPool:
    """An :class:`ElasticPool` on the scheduler's (single) block pool; vLLM's whole-pool
    questions (usage, prefix-cache reset) answered over the committed blocks; a refused
    ``allocate_slots`` reported to the pool (the only "starved" signal)."""
    cfg = scheduler.vllm_config
    check_elastic_config(cfg)
    pool = scheduler.kv_cache_manager.block_pool
    el = ElasticPool(pool, settings_for(cfg, scheduler.kv_cache_config, chunk_bytes))
    reset = pool.reset_prefix_cache

    def reset_prefix_cache():  # vLLM counts every block not in the queue as in use
        el.queue.num_free_blocks += el.parked()
        try:
            return reset()
        finally:
            el.queue.num_free_blocks -= el.parked()

    pool.reset_prefix_cache = reset_prefix_cache
    pool.get_usage = el.usage
    manager = scheduler.kv_cache_manager
    allocate_slots = manager.allocate_slots

    def allocate_slots_watched(*args, **kwargs):  # None: KV holds a request back
        blocks = allocate_slots(*args, **kwargs)
        if blocks is None:
            el.kv_refused()
        return blocks

    manager.allocate_slots = allocate_slots_watched
    scheduler._vmmkv_elastic = el
    log.info(
        "vmmkv: elastic KV: %d of %d blocks committed at start (floor), watermark %d, "
        "quantum %d, cached cap %d", el.limit, el.s.num_blocks, el.s.watermark, el.s.quantum,
        el.s.cached_blocks,
    )  # fmt: skip
    return el


def _scheduler_init(orig: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs):
        from ._cache import elastic_chunk_bytes

        orig(self, vllm_config, kv_cache_config, *args, **kwargs)
        if vllm_config.parallel_config.prefill_context_parallel_size > 1:
            install_pool(self, elastic_chunk_bytes())

    return __init__


def _schedule(orig: Callable[..., Any]) -> Callable[..., Any]:
    def schedule(self, *args, **kwargs):
        el = pool_of(self)
        if el is not None:
            el.before_schedule()
        out = orig(self, *args, **kwargs)
        if el is not None:
            el.after_schedule(self, out)
        return out

    return schedule


def _update_from_output(orig: Callable[..., Any]) -> Callable[..., Any]:
    def update_from_output(self, scheduler_output, model_runner_output):
        el = pool_of(self)
        if el is not None:
            el.on_output(model_runner_output)
        return orig(self, scheduler_output, model_runner_output)

    return update_from_output


def idle_release(engine: Any, el: ElasticPool) -> None:
    """Release down to the floor on every worker through ``collective_rpc``. A release the
    group refused (vmmkv's resize: the same error on every rank, every size unchanged) is
    logged and the engine goes on: the pool parked the blocks already, the safe direction.
    Workers that report different outcomes raise RuntimeError naming each worker's stamp."""
    resize = el.idle_release()
    if resize is None:
        return
    stamps = [s for s in engine.collective_rpc(worker_resize, args=resize) if s is not None]
    if all(s[:2] == resize for s in stamps):
        return
    if len({s[:2] for s in stamps}) > 1:
        raise RuntimeError(
            f"vmmkv: elastic idle release to {resize[1]} blocks (seq {resize[0]}): the workers "
            f"report different outcomes (stamps (seq, committed, error) in worker order: "
            f"{stamps})"
        )
    log.warning(
        "vmmkv: elastic idle release to %s blocks (seq %d) refused by the group; the workers "
        "keep %s blocks, the scheduler hands out %d: %s", resize[1], resize[0], stamps[0][1],
        el.committed, stamps[0][2],
    )  # fmt: skip


def idle_wait_due(engine: Any, el: ElasticPool) -> bool:
    """Whether the engine's input loop may wait ``idle_seconds`` and then release: blocks above
    the floor, and vLLM's loop would otherwise block idle with nothing to hand over. Not while
    vLLM holds inputs deferred from the last step (``_deferred_inputs``: the hook handles them
    first, as vLLM's loop does), has idle-state callbacks to run (a pause completing), is paused or asleep (sleep releases the KV
    cache itself; a pause keeps the size it was given), has work, or shuts down."""
    return (
        el.limit > el.s.floor
        and not engine._deferred_inputs
        and not engine._idle_state_callbacks
        and not engine.is_scheduler_paused()
        and not engine.model_executor.is_sleeping
        and not engine.has_work()
        and engine.is_running()
    )


def _process_input_queue(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _process_input_queue(self):
        el = pool_of(self.scheduler)
        if el is not None:
            while self._deferred_inputs:  # vLLM's order: inputs deferred by the last step first
                self._handle_client_request(*self._deferred_inputs.popleft())
        if el is not None and idle_wait_due(self, el):
            from vllm.utils.watch_dog import get_watch_dog

            try:
                with get_watch_dog().disable():  # an idle wait, as vLLM's own
                    req = self.input_queue.get(timeout=el.s.idle_seconds)
            except queue.Empty:
                idle_release(self, el)
            else:
                self._handle_client_request(*req)
        return orig(self)

    return _process_input_queue


STATS_UTILITY = "vmmkv_elastic_stats"


def _stats_utility(_absent: None) -> Callable[..., Any]:
    def vmmkv_elastic_stats(self):
        """The elastic pool's :meth:`~._elastic.ElasticPool.stats`, or None where elastic
        mode has no pool (PCP 1): an engine-core utility, which vLLM's client calls by name
        (``call_utility``) and answers between steps, in the engine core's one thread."""
        el = pool_of(self.scheduler)
        return None if el is None else el.stats()

    return vmmkv_elastic_stats


def worker_stats(worker: Any) -> dict[str, Any] | None:
    """This worker's KV cache as elastic mode left it, for ``collective_rpc(worker_stats)``
    (vLLM runs it on every worker, with the worker as its argument): the rank, the committed
    blocks (a count and the block set), the bytes mapped for them on this rank (whole chunks
    of every segment), the last resize's sequence number and error. None before the cache is
    allocated. Local, read-only."""
    from ._state import active_cache

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


ENGINE_SITES: tuple[tuple[str, str, Callable[..., Any], tuple[str, ...] | None], ...] = (
    (
        "vllm.v1.core.sched.scheduler", "Scheduler.__init__", _scheduler_init,
        ("self", "vllm_config", "kv_cache_config", "structured_output_manager", "block_size",
         "hash_block_size", "mm_registry", "include_finished_set", "log_stats"),
    ),
    (
        "vllm.v1.core.sched.scheduler", "Scheduler.schedule", _schedule,
        ("self", "throttle_prefills"),
    ),
    (
        "vllm.v1.core.sched.scheduler", "Scheduler.update_from_output", _update_from_output,
        ("self", "scheduler_output", "model_runner_output"),
    ),
    ("vllm.v1.engine.core", "EngineCoreProc._process_input_queue", _process_input_queue, ("self",)),
    ("vllm.v1.engine.core", f"EngineCore.{STATS_UTILITY}", _stats_utility, None),
)  # fmt: skip


def elastic_stats(engine: Any) -> dict[str, Any] | None:
    """The engine core's elastic pool stats (:meth:`~._elastic.ElasticPool.stats`; None where
    elastic mode has no pool) from vLLM's ``LLM``, ``LLMEngine`` or their engine-core client,
    through vLLM's utility call (in process or over its socket). An ``AsyncLLM`` asks with
    ``await engine.engine_core.call_utility_async(STATS_UTILITY)``."""
    obj = getattr(engine, "llm_engine", engine)
    for _ in range(3):  # an LLMEngine, its client, (in process) the engine core
        if hasattr(obj, "call_utility"):  # vLLM's multiprocess client: over its socket
            return obj.call_utility(STATS_UTILITY)
        if hasattr(obj, STATS_UTILITY):  # the engine core itself
            return getattr(obj, STATS_UTILITY)()
        obj = getattr(obj, "engine_core", None)
    raise TypeError(
        f"elastic_stats: expected vLLM's LLM, LLMEngine or engine-core client with the plugin's "
        f"engine sites installed, got {type(engine).__name__}"
    )
