"""Elastic KV: the engine core's side. vLLM's block pool hands out only the blocks vmmkv has
committed, lowest free id first, and asks the PCP group to grow ahead of demand and to release
the tail when it is free.

Why in the engine core: only the scheduler knows which blocks are free, cached or in use, and
every PCP worker receives its ``SchedulerOutput``s identically and in one order (vLLM's
broadcast queue). So the decision is made here and rides on every ``SchedulerOutput`` as
``vmmkv_resize = (seq, target)``; each worker applies a new ``seq`` once, collectively, before
vLLM zeroes or copies blocks (``_elastic_sites``). docs/design.md, "Elastic KV in vLLM", has the
measurements behind each rule.

- :class:`LowestIdFreeQueue` replaces vLLM's ``FreeKVCacheBlockQueue`` in the ``BlockPool``
  (the same methods, as ``BlockPool`` calls them). It holds the free blocks below ``limit``
  (the committed ones): uncached ones are handed out lowest id first (vLLM reuses them LIFO,
  which keeps the highest block in use near its peak forever), cached ones after them in LRU
  order as vLLM does. Blocks at or above ``limit`` are *parked*: free, uncommitted, invisible
  to vLLM's admission (``num_free_blocks`` counts committed blocks only).
- :class:`ElasticPool` is the policy, called by the patched ``Scheduler`` once per step:

  - **cached cap**: at most ``cached_blocks`` cached-free blocks are kept; the oldest lose their
    hash (vLLM's own ``_maybe_evict_cached_block``) and become ordinary free blocks;
  - **grow, two phases**: when free committed blocks fall below ``watermark`` (or vLLM's KV
    cache manager refused an allocation in the last step: a request that waits for something
    else, tokens or a pause, grows nothing), ask for ``limit + max(watermark, limit / 4)``; the new blocks are
    handed out only once a worker output confirms them (``vmmkv_kv_blocks`` stamped by the
    worker); a grow refused by the group (vmmkv's error is the same on every rank and leaves
    every size unchanged) only delays admission, and the next attempt waits
    ``release_steps`` steps;
  - **release in band**: when the highest block in use lets ``limit`` fall by at least
    ``release_min`` blocks while keeping ``2 x watermark`` free, for ``release_steps``
    consecutive steps, the tail is parked at once (cached blocks in it lose their hash) and the
    lower target sent: every step that could still write those blocks was sent to the workers
    before this one, and vmmkv's shrink synchronizes the device before it decommits;
  - **idle release** (:meth:`idle_release`): down to the floor or the highest block in use,
    for the engine's idle hook (an idle engine does not step);
  - targets are multiples of ``quantum`` (blocks per chunk), never below ``floor``.

Local to the engine core, single-threaded like vLLM's scheduler. Host cost per step: O(1)
amortized plus O(log n) per block handed out or freed (BENCHMARKS.md, "Elastic KV").
"""

from __future__ import annotations

import heapq
import math
import os
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ELASTIC_ENV",
    "KNOBS",
    "ElasticPool",
    "ElasticSettings",
    "LowestIdFreeQueue",
    "elastic_enabled",
    "elastic_settings",
]

ELASTIC_ENV = "VLLM_VMMKV_ELASTIC"
# knob -> environment variable (every PCP rank and the engine core read the same environment)
KNOBS = {
    "floor": "VMMKV_ELASTIC_FLOOR_BLOCKS",
    "watermark": "VMMKV_ELASTIC_WATERMARK_BLOCKS",
    "release_steps": "VMMKV_ELASTIC_RELEASE_STEPS",
    "cached_blocks": "VMMKV_ELASTIC_CACHED_BLOCKS",
    "idle_seconds": "VMMKV_ELASTIC_IDLE_S",
    "order": "VMMKV_ELASTIC_ORDER",  # "lowest" (default) or "lifo" (vLLM's, for comparison)
}
ORDERS = ("lowest", "lifo")
# Elastic mode's chunk: 64 MiB in a block-major layout (docs/design.md, "Elastic KV in
# vLLM"): a grow costs one driver call per chunk and peer; on one H200, 2 processes, a
# +256-block DeepSeek-V3.2 grow took 21.6-25.1 ms at 64 MiB, 28.3-32.6 ms at 32 MiB (two runs),
# and committed bytes stay within 0.4 % of the blocks' own at 1000 blocks.
ELASTIC_CHUNK_MIB = 64
CACHED_TOKENS = 16384  # default cap on cached-free blocks, in tokens (kvcached keeps 16000)
RELEASE_STEPS = 10
# A release must free at least limit / RELEASE_FRACTION (and release_min): a grow adds
# limit / 4, so the overshoot of the last grow under steady load is not released and grown
# again (hysteresis; docs/design.md, "Elastic KV in vLLM").
RELEASE_FRACTION = 8
IDLE_SECONDS = 5.0
STAMP = "vmmkv_kv_blocks"  # (seq, committed blocks, error or None) on a ModelRunnerOutput
RESIZE = "vmmkv_resize"  # (seq, target blocks) on every SchedulerOutput


def elastic_enabled(env: Mapping[str, str] | None = None) -> bool:
    """``VLLM_VMMKV_ELASTIC``: '1' turns elastic mode on (with ``VLLM_USE_VMMKV=1``)."""
    value = (os.environ if env is None else env).get(ELASTIC_ENV, "0").strip()
    if value not in ("0", "1", ""):
        raise ValueError(f"{ELASTIC_ENV} must be '0' or '1', got {value!r}")
    return value == "1"


@dataclass(frozen=True)
class ElasticSettings:
    """What the engine core and every worker agree on without talking: both compute it from
    the same config and environment (:func:`elastic_settings`)."""

    num_blocks: int  # vLLM's pool size (the capacity; block 0 is vLLM's null block)
    quantum: int  # blocks per chunk: targets are multiples of it (or num_blocks)
    floor: int  # committed at start and after an idle release
    watermark: int  # grow when fewer committed blocks are free
    release_steps: int  # calm steps before a release; steps to wait after a refused grow
    release_min: int  # release only when the limit falls by at least this
    cached_blocks: int  # at most this many cached-free blocks are kept
    idle_seconds: float  # idle time before the engine's idle release
    order: str = "lowest"  # free blocks: lowest id first, or vLLM's order ("lifo")

    def round(self, blocks: int) -> int:
        """``blocks`` rounded up to the quantum, within [floor, num_blocks]."""
        q = self.quantum
        return min(self.num_blocks, max(self.floor, -(-blocks // q) * q))


def _knob(env: Mapping[str, str], name: str, default: float, *, lo: float, kind=int) -> Any:
    var = KNOBS[name]
    raw = env.get(var, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or value < lo or (kind is float and not math.isfinite(value)):
        raise ValueError(f"{var}={raw!r}: expected {kind.__name__} >= {lo}")
    return value


def elastic_settings(
    num_blocks: int,
    block_bytes: int,
    chunk_bytes: int,
    *,
    block_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    async_scheduling: bool,
    env: Mapping[str, str] | None = None,
) -> ElasticSettings:
    """Elastic mode's settings for a pool of ``num_blocks`` blocks of ``block_bytes`` (every
    layer's bytes of one block, one replica) in chunks of ``chunk_bytes``.

    Defaults: one step can take ``ceil(max_num_batched_tokens / block_size) + max_num_seqs``
    blocks at most; a grow becomes usable 1 step later (2 with async scheduling's batch queue),
    so ``watermark`` covers that many steps plus the current one (at most a quarter of the
    pool); ``floor`` = 2 x ``watermark``; ``release_min`` = max(quantum, watermark / 2)."""
    env = os.environ if env is None else env
    if num_blocks < 2 or block_bytes <= 0 or chunk_bytes <= 0:
        raise ValueError(
            f"elastic KV needs >= 2 blocks of > 0 bytes and chunks of > 0 bytes, got "
            f"{num_blocks} blocks of {block_bytes} B, chunks of {chunk_bytes} B"
        )
    quantum = max(1, chunk_bytes // block_bytes)
    per_step = -(-max_num_batched_tokens // block_size) + max_num_seqs
    watermark = _knob(
        env, "watermark", min(num_blocks // 4, (3 if async_scheduling else 2) * per_step), lo=1
    )
    floor = _knob(env, "floor", 2 * watermark, lo=1)
    floor = min(num_blocks, -(-floor // quantum) * quantum)
    return ElasticSettings(
        num_blocks=num_blocks,
        quantum=quantum,
        floor=floor,
        watermark=watermark,
        release_steps=_knob(env, "release_steps", RELEASE_STEPS, lo=1),
        release_min=max(quantum, watermark // 2),
        cached_blocks=_knob(env, "cached_blocks", -(-CACHED_TOKENS // block_size), lo=0),
        idle_seconds=_knob(env, "idle_seconds", IDLE_SECONDS, lo=0.0, kind=float),
        order=_order(env),
    )


def _order(env: Mapping[str, str]) -> str:
    raw = env.get(KNOBS["order"], "").strip() or ORDERS[0]
    if raw not in ORDERS:
        raise ValueError(f"{KNOBS['order']}={raw!r}: expected one of {ORDERS}")
    return raw


class LowestIdFreeQueue:
    """vLLM's ``FreeKVCacheBlockQueue`` as ``BlockPool`` uses it (``num_free_blocks``,
    ``popleft``, ``popleft_n``, ``remove``, ``append``, ``append_n``, ``prepend_n``,
    ``get_all_free_blocks``), over the committed blocks only.

    Order "lowest": the free block with the lowest id is handed out first, cached or not (the
    pool evicts a cached one's hash as it hands it out), so blocks in use gather at the bottom
    and the tail empties. Order "lifo" is vLLM's own (uncached blocks most recently freed
    first, then cached ones oldest first), for comparison. Either way the blocks vLLM frees
    with a hash (``append_n``: prefix-cache entries, ``unpin_blocks``' readable ones) are also
    kept in age order (``lru``) for the cap on cached blocks."""

    def __init__(self, blocks: list[Any], free_ids: Iterable[int], order: str = "lowest") -> None:
        self.blocks = blocks
        self.lifo = order == "lifo"
        # lazy: an id leaves _low / lru without leaving its heap (or stack)
        self._uncached: list[int] = []
        self._cached: list[int] = []
        self._low: set[int] = set()  # free, uncached, committed
        self.lru: OrderedDict[int, Any] = OrderedDict()  # free, cached, committed; oldest first
        self.num_free_blocks = 0
        self.prepend_n([blocks[i] for i in free_ids])

    @staticmethod
    def _top(heap: list[int], live: Any) -> int | None:
        while heap and heap[0] not in live:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def _pop(self) -> Any:
        if self.lifo:
            while self._uncached:
                i = self._uncached.pop()
                if i in self._low:
                    self._low.remove(i)
                    return self.blocks[i]
            return self.lru.popitem(last=False)[1]
        u, c = self._top(self._uncached, self._low), self._top(self._cached, self.lru)
        if c is not None and (u is None or c < u):
            heapq.heappop(self._cached)
            return self.lru.pop(c)
        heapq.heappop(self._uncached)
        self._low.remove(u)
        return self.blocks[u]

    def popleft(self) -> Any:
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[Any]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot take {n} free blocks from {self.num_free_blocks}")
        out = [self._pop() for _ in range(n)]
        self.num_free_blocks -= n
        return out

    def remove(self, block: Any) -> None:
        i = block.block_id
        if i in self._low:
            self._low.remove(i)
        else:
            del self.lru[i]
        self.num_free_blocks -= 1

    def append(self, block: Any) -> None:
        self.append_n([block])

    def append_n(self, blocks: list[Any]) -> None:
        for b in blocks:
            self.lru[b.block_id] = b
            if not self.lifo:
                self._push(self._cached, b.block_id)
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: list[Any]) -> None:
        # vLLM frees cached blocks here too when another tier holds their contents
        # (BlockPool.free_blocks(evict_first=True)): they keep their hash, so they join the age
        # order at its front (blocks[0] evicted first), never the uncached set
        uncached = [b for b in blocks if b.block_hash is None]
        for b in reversed([b for b in blocks if b.block_hash is not None]):
            self.lru[b.block_id] = b
            self.lru.move_to_end(b.block_id, last=False)
            if not self.lifo:
                self._push(self._cached, b.block_id)
        for b in reversed(uncached) if self.lifo else uncached:  # lifo: blocks[0] is next
            self._low.add(b.block_id)
            self._push(self._uncached, b.block_id)
        self.num_free_blocks += len(blocks)

    def _push(self, heap: list[int], i: int) -> None:
        if self.lifo:
            heap.append(i)
        else:
            heapq.heappush(heap, i)
        if len(heap) > 4 * len(self.blocks):  # drop the stale entries now and then
            live = self._low if heap is self._uncached else self.lru
            if self.lifo:  # the live ids in stack order, each at its latest place
                kept: dict[int, None] = {}
                for j in reversed(heap):
                    if j in live:
                        kept.setdefault(j)
                heap[:] = list(kept)[::-1]
            else:  # a sorted list is a heap
                heap[:] = sorted({j for j in heap if j in live})

    def contains(self, block_id: int) -> bool:
        return block_id in self._low or block_id in self.lru

    def get_all_free_blocks(self) -> list[Any]:
        return [self.blocks[i] for i in sorted(self._low)] + list(self.lru.values())

    def demote(self, block: Any) -> None:
        """A cached-free block that lost its hash becomes an ordinary free block."""
        del self.lru[block.block_id]
        self._low.add(block.block_id)
        self._push(self._uncached, block.block_id)


class ElasticPool:
    """The committed limit of one vLLM ``BlockPool`` and its policy (module docstring).

    Installed on a fresh pool (every block but the null block free); blocks from
    ``settings.floor`` up are parked at once: the workers commit ``floor`` blocks at start."""

    def __init__(self, block_pool: Any, settings: ElasticSettings) -> None:
        if block_pool.num_gpu_blocks != settings.num_blocks:
            raise ValueError(
                f"elastic KV: vLLM's block pool has {block_pool.num_gpu_blocks} blocks, the "
                f"settings {settings.num_blocks}"
            )
        busy = [b.block_id for b in block_pool.blocks if b.ref_cnt and not b.is_null]
        if busy or block_pool.get_num_free_blocks() != settings.num_blocks - 1:
            raise RuntimeError(
                "elastic KV is installed on a fresh block pool only; blocks in use: "
                f"{busy[:8]}, free {block_pool.get_num_free_blocks()}"
            )
        self.pool, self.s = block_pool, settings
        self.limit = settings.floor  # blocks [0, limit) may be handed out
        self.queue = LowestIdFreeQueue(block_pool.blocks, range(1, self.limit), settings.order)
        block_pool.free_block_queue = self.queue
        self._in_use: list[int] = []  # max-heap (negated ids), lazy
        self.seq = 0  # resize requests sent
        self.target = self.limit  # the size the workers are asked to hold
        self.pending: tuple[int, int] | None = None  # an unconfirmed grow (seq, target)
        self.calm = 0  # consecutive steps a release was possible
        self.hold = 0  # steps to wait after a refused grow
        self.starved = False  # vLLM's KV cache manager refused an allocation in the last step
        self.refused_now = False  # ... in this step (set through kv_refused)
        self.counts = {"grows": 0, "releases": 0, "refused": 0, "cached_dropped": 0}
        self.last_error: str | None = None
        self._watch(block_pool)

    # -- tracking the highest block in use ----------------------------------------------------
    def _watch(self, pool: Any) -> None:
        """Wrap the queue's two exits into use (handed out, prefix hit) to remember ids."""
        q, heap = self.queue, self._in_use
        popleft_n, remove = q.popleft_n, q.remove

        def popleft_n_watched(n: int) -> list[Any]:
            out = popleft_n(n)
            for b in out:
                heapq.heappush(heap, -b.block_id)
            return out

        def remove_watched(block: Any) -> None:
            remove(block)
            heapq.heappush(heap, -block.block_id)

        q.popleft_n, q.remove = popleft_n_watched, remove_watched
        self._remove_quietly = remove

    def highest_in_use(self) -> int:
        """The highest block id with a reference (0 when none but the null block)."""
        heap, blocks = self._in_use, self.pool.blocks
        while heap and blocks[-heap[0]].ref_cnt == 0:
            heapq.heappop(heap)
        if len(heap) > 4 * len(blocks):
            heap[:] = [-b.block_id for b in blocks if b.ref_cnt and not b.is_null]
            heapq.heapify(heap)
        return -heap[0] if heap else 0

    # -- the policy, once per step ------------------------------------------------------------
    def resize_request(self) -> tuple[int, int]:
        return (self.seq, self.target)

    def before_schedule(self) -> None:
        """Before ``Scheduler.schedule``: cap the cached blocks, then grow or release."""
        self._cap_cached()
        s = self.s
        free = self.queue.num_free_blocks
        if self.hold:  # a grow was refused: wait release_steps steps before the next
            self.hold -= 1
        elif self.pending is None and self.limit < s.num_blocks:
            if free < s.watermark or self.starved:
                self.seq += 1
                self.target = s.round(self.limit + max(s.watermark, self.limit // 4))
                self.pending = (self.seq, self.target)
                self.calm = 0
                self.starved = False
                return
        self.starved = False
        if self.pending is not None:
            return
        used = self.limit - 1 - free  # blocks with a reference (the null block aside)
        want = s.round(max(self.highest_in_use() + 1, used + 1 + 2 * s.watermark))
        if self.limit - want >= max(s.release_min, self.limit // RELEASE_FRACTION):
            self.calm += 1
            if self.calm >= s.release_steps:
                self._release(want)
        else:
            self.calm = 0

    def kv_refused(self) -> None:
        """vLLM's ``KVCacheManager.allocate_slots`` returned None: KV is what holds a request
        back in this step (not the token budget, a pause, or a sequence limit)."""
        self.refused_now = True

    def after_schedule(self, scheduler: Any, scheduler_output: Any) -> None:
        """After ``Scheduler.schedule``: the resize request rides on the output; a step in which
        an allocation was refused asks for a grow in the next step."""
        setattr(scheduler_output, RESIZE, (self.seq, self.target))
        self.starved, self.refused_now = self.refused_now, False

    def on_output(self, model_runner_output: Any) -> None:
        """Before ``Scheduler.update_from_output``: a worker's stamp confirms or refuses the
        pending grow (outputs of earlier steps carry earlier sequence numbers)."""
        stamp = getattr(model_runner_output, STAMP, None)
        if self.pending is None or stamp is None or stamp[0] != self.pending[0]:
            return
        _, committed, error = stamp
        target = self.pending[1]
        self.pending = None
        if error is None and committed >= target:
            self.queue.prepend_n([self.pool.blocks[i] for i in range(self.limit, target)])
            self.limit = target
            self.counts["grows"] += 1
        else:
            self.target = self.limit
            self.hold = self.s.release_steps
            self.counts["refused"] += 1
            self.last_error = error or f"the workers hold {committed} blocks, not {target}"

    def idle_release(self) -> tuple[int, int] | None:
        """The engine is idle: park everything above the floor or the highest block in use;
        returns the resize request for every worker, or None when nothing is released (or a
        grow is pending)."""
        self._cap_cached()
        if self.pending is not None:
            return None
        want = self.s.round(self.highest_in_use() + 1)
        if want >= self.limit:
            return None
        self._release(want)
        return self.resize_request()

    def _release(self, want: int) -> None:
        pool, q = self.pool, self.queue
        for i in range(want, self.limit):
            b = pool.blocks[i]
            if b.ref_cnt:
                raise AssertionError(f"elastic KV: block {i} is in use, cannot release it")
            if b.block_id in q.lru and pool._maybe_evict_cached_block(b):
                self.counts["cached_dropped"] += 1
            self._remove_quietly(b)
        self.limit = want
        self.seq += 1
        self.target = want
        self.calm = 0
        self.counts["releases"] += 1

    def _cap_cached(self) -> None:
        q, extra = self.queue, len(self.queue.lru) - self.s.cached_blocks
        while extra > 0:
            b = next(iter(q.lru.values()))  # the oldest
            self.pool._maybe_evict_cached_block(b)
            q.demote(b)
            self.counts["cached_dropped"] += 1
            extra -= 1

    # -- what vLLM asks the pool about the whole pool -----------------------------------------
    def usage(self) -> float:
        """``BlockPool.get_usage`` over the committed blocks."""
        total = self.limit - 1
        return 1.0 - self.queue.num_free_blocks / total if total > 0 else 0.0

    def parked(self) -> int:
        return self.s.num_blocks - self.limit

    def stats(self) -> dict[str, Any]:
        return {
            "limit": self.limit, "target": self.target, "seq": self.seq,
            "free": self.queue.num_free_blocks, "cached_free": len(self.queue.lru),
            "in_use": self.limit - 1 - self.queue.num_free_blocks, **self.counts,
        }  # fmt: skip
