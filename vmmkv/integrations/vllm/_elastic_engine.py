"""Elastic KV: the engine core's side, the vLLM 0.34.0 call sites that put the pool
(``_elastic``'s policy) on vLLM's scheduler and run its idle release (``_elastic_worker`` is the
workers' side; the package docstring, "Elastic KV", the user's view).

The sites (``_install.ENGINE_SITES``, installed by ``_install.install_engine`` when elastic mode is
on, in every process that imports ``vllm.v1.engine.core``, through an import hook if the plugins
load first):

| site | replaced by |
|---|---|
| ``Scheduler.__init__`` | vLLM's, then an :class:`~._elastic.ElasticPool` on its block pool (PCP > 1 only; refusals first); the manager's ``allocate_slots`` watched for refusals (KV pressure) |
| ``Scheduler.schedule`` | the pool's step (cached cap, grow or release), vLLM's schedule, the resize request set on the output |
| ``Scheduler.update_from_output`` | the pool reads the worker's stamp (confirms or refuses a pending grow), then vLLM's |
| ``EngineCoreProc._process_input_queue`` (the busy loop of an engine-core process) | the inputs vLLM deferred during the last step handled first (as vLLM's loop does); then, while the engine has no work and blocks above the floor, its inputs taken and handled here (:func:`idle_loop`): ``idle_seconds`` after it went idle, awake and unpaused, the idle release through ``collective_rpc`` (ordered with every step in vLLM's one queue); then vLLM's |
| ``EngineCore.vmmkv_elastic_stats`` (added: vLLM has none) | the pool's ``stats()``, a utility vLLM's client calls by name (:func:`elastic_stats`) |

Local to the engine core, single-threaded like vLLM's scheduler.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import Any

from ._buffer import elastic_chunk_bytes
from ._elastic import ElasticPool
from ._elastic_settings import check_elastic_config, settings_for
from ._elastic_worker import worker_resize

log = logging.getLogger(__name__)

__all__ = ["STATS_UTILITY", "elastic_stats", "idle_release", "install_pool", "pool_of"]


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

    def reset_prefix_cache():
        # vLLM counts every block not in the queue as in use: the parked ones count as free
        el.queue.num_free_blocks += el.parked()
        try:
            done = reset()
        finally:
            el.queue.num_free_blocks -= el.parked()
        if done:  # vLLM dropped every hash but left its free queue (ours) as it was
            el.queue.demote_unhashed()
            el.hit.clear()
        return done

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
    """Whether the engine's idle time counts toward the idle release: blocks above the floor,
    no work, running, and nothing that holds the size as it is: inputs vLLM deferred during the
    last step (handled first, as vLLM's loop does), idle-state callbacks to run (a pause
    completing), a pause (it keeps the size it was given) or sleep (it released the KV cache
    itself)."""
    return (
        el.limit > el.s.floor
        and not engine._deferred_inputs
        and not engine._idle_state_callbacks
        and not engine.is_scheduler_paused()
        and not engine.model_executor.is_sleeping
        and not engine.has_work()
        and engine.is_running()
    )


def idle_loop(engine: Any, el: ElasticPool) -> None:
    """While the engine has no work and holds blocks above the floor, take its inputs here
    instead of in vLLM's loop (which blocks until there is work, and would never come back to
    release): each one handled as vLLM's loop handles it, the idle-state callbacks run before
    each wait as vLLM's loop runs them. The idle time counts from when the engine went idle
    (``el.idle_since``, cleared by every step): a utility call (stats, a prefix-cache reset, a
    ``collective_rpc``) handled meanwhile neither ends nor restarts it; a pause or sleep holds
    it; work ends the loop. Once ``idle_seconds`` have passed: the idle release. The waits run
    with vLLM's watchdog off, as vLLM's own idle wait."""
    from vllm.utils.watch_dog import get_watch_dog

    while engine.is_running() and not engine.has_work() and el.limit > el.s.floor:
        engine._notify_idle_state_callbacks()
        timeout = None  # not due (a pause, sleep, callbacks): wait for the input that ends it
        if idle_wait_due(engine, el):
            now = el.clock()
            if el.idle_since is None:
                el.idle_since = now
            timeout = el.idle_since + el.s.idle_seconds - now
            if timeout <= 0:
                idle_release(engine, el)
                return
        try:
            with get_watch_dog().disable():
                req = engine.input_queue.get(timeout=timeout)
        except queue.Empty:
            idle_release(engine, el)
            return
        engine._handle_client_request(*req)
        while engine._deferred_inputs:  # vLLM defers inputs only during a step; none here
            engine._handle_client_request(*engine._deferred_inputs.popleft())


def _process_input_queue(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _process_input_queue(self):
        el = pool_of(self.scheduler)
        if el is not None:
            while self._deferred_inputs:  # vLLM's order: inputs deferred by the last step first
                self._handle_client_request(*self._deferred_inputs.popleft())
            idle_loop(self, el)
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
