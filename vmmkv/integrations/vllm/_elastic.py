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
  (the committed ones): those without a prefix-cache entry are handed out first, lowest id
  first (vLLM reuses them LIFO, which keeps the highest block in use near its peak forever);
  a cached one only when none is left, oldest first as vLLM does, so no prefix-cache entry is
  given up while an uncached committed block is free. Blocks at or above ``limit`` are
  *parked*: free, uncommitted, invisible to vLLM's admission (``num_free_blocks`` counts
  committed blocks only); so are the blocks of holes below ``limit`` (the pool takes them out
  of the queue).
- :class:`ElasticPool` is the policy, called by the patched ``Scheduler`` once per step, on a
  clock (``time.monotonic``; a trace injects simulated time):

  - **cached cap**: at most ``cached_blocks`` cached-free blocks are kept; the oldest lose
    their hash (vLLM's own ``_maybe_evict_cached_block``) and become ordinary free blocks, but
    one that a prefix hit reused since it got its hash is spared once (second chance: it moves
    to the young end, unmarked);
  - **watermark from the allocation rate**: ``lead_steps`` x the most blocks one step took in
    the last ``window_seconds``, within [``watermark_min``, ``watermark``] (one full-budget
    step; the worst ``lead_steps`` steps): a grow must land before the free blocks run out;
  - **grow, two phases**: when fewer uncached committed blocks than the watermark are free
    (cached-free ones are kept, the cap bounds them), or vLLM's KV cache manager refused an
    allocation in the last step (a request that waits for something else, tokens or a pause,
    grows nothing), ask for enough to leave 1.5 watermarks free, plus half a calm time of the
    need's growth rate (a rising load: fewer, larger grows); the new blocks are handed out only
    once a worker output confirms them (``vmmkv_kv_blocks`` stamped by the worker); a grow
    refused by the group (vmmkv's error is the same on every rank and leaves every size
    unchanged) only delays admission, and the next attempt waits ``release_steps`` steps;
  - **release in band, in time**: ``calm_seconds`` (and ``release_steps`` steps) after the last
    grow, two after the last release, once the need (in use + cached-free) has stopped falling
    (it fell by less than ``release_min`` in the last half calm time), the tail above the need
    + its largest rise in the calm time (from within a watermark of the need now: the rise of a
    load that has ended is not kept) + 2 watermarks is parked at once and the lower target
    sent: every step that could still write those blocks was sent to the workers before this
    one, and vmmkv's shrink synchronizes the device before it decommits. Cached blocks in the
    tail lose their hash (counted); the target steps above them when that still frees half as
    much;
  - **holes**: in the same release (same calm, fall and settling rules), when the blocks below
    the highest one in use hold more than that keep, the whole chunks there whose blocks are
    all free are parked as holes too (the highest first, those without prefix-cache entries
    first; cached ones lose their hash, counted as a release's), down to what the release
    keeps; the request is then the committed block set, confirmed by a stamp that holds it.
    A grow refills the lowest holes first, then the tail. Off under vLLM's extensible KV
    cache (``ElasticSettings.holes``: its recommit commits a prefix);
  - **levels**: the size a grow or a release asks for goes to the largest size a resize of
    the same kind asked for in the last ``LEVEL_SECONDS`` that is at most a watermark above it,
    else a quarter watermark above it (a new level): a load that returns to a level gets the
    size it had, so a periodic load repeats its sizes and decisions instead of following each
    period's jitter, and a grow a level covers is one grow;
  - **idle release** (:meth:`idle_release`): down to the floor or the highest block in use,
    for the engine's idle hook (an idle engine does not step);
  - targets are multiples of ``quantum`` (blocks per chunk), never below ``floor``;
  - :meth:`usage` (vLLM's ``get_usage``, its KV usage metric) is blocks in use over the
    capacity; :meth:`stats` has committed blocks and bytes, grows, releases, refusals and the
    prefix-cache entries dropped (by the cap, by releases, handed out); each resize is logged
    once at INFO.

Local to the engine core, single-threaded like vLLM's scheduler. Host cost per step: O(1)
amortized plus O(log n) per block handed out or freed, and O(30) while a release is due; a
hole scan reads every block below the highest in use, at most once a tenth of a calm time
when it finds too little (BENCHMARKS.md, "Elastic KV").
"""

from __future__ import annotations

import heapq
import logging
import math
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ... import _blockset as blockset
from ..._env import boolean, choice, number

log = logging.getLogger(__name__)

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
    "calm_seconds": "VMMKV_ELASTIC_CALM_S",
    "window_seconds": "VMMKV_ELASTIC_WINDOW_S",
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
RELEASE_STEPS = 10  # a release also needs this many calm steps (and calm_seconds)
CALM_SECONDS = 10.0  # a release comes this long after the last grow (twice after a release)
WINDOW_SECONDS = 30.0  # the allocation rate behind the watermark is the peak of this window
IDLE_SECONDS = 5.0
# blocks a step's hole scan reads at most, so that no step of the engine core pays for a scan of
# the whole pool (4096 blocks: about 200 µs on a CPU core; 256 blocks: 13-25 µs); a scan of 4096
# blocks then spans 16 steps, a fraction of a second beside the calm time's 10 s
SCAN_BLOCKS = 256
# the sizes a grow or a release asked for are remembered this long: a load that returns to a
# level within it gets the size it had (a few periods of a load that swings every minute or so)
LEVEL_SECONDS = 120.0
# a new level is a quarter watermark above what a resize needs, so that the next time's need,
# a little higher by the load's jitter, still finds it (a square wave: without it 1 of 9 runs
# repeat their sizes from the second period on, with it 8; BENCHMARKS.md)
LEVEL_MARGIN = 0.25
STAMP = "vmmkv_kv_blocks"  # (seq, committed blocks, error or None) on a ModelRunnerOutput
RESIZE = "vmmkv_resize"  # (seq, target blocks) on every SchedulerOutput


def elastic_enabled(env: Mapping[str, str] | None = None) -> bool:
    """``VLLM_VMMKV_ELASTIC``: true turns elastic mode on (with ``VLLM_USE_VMMKV=1``)."""
    return boolean(ELASTIC_ENV, env=env)


@dataclass(frozen=True)
class ElasticSettings:
    """What the engine core and every worker agree on without talking: both compute it from
    the same config and environment (:func:`elastic_settings`). Only ``num_blocks``,
    ``quantum`` and ``floor`` must be equal everywhere; the rest is the engine core's policy."""

    num_blocks: int  # vLLM's pool size (the capacity; block 0 is vLLM's null block)
    quantum: int  # blocks per chunk: targets are multiples of it (or num_blocks)
    floor: int  # committed at start and after an idle release
    watermark: int  # grow when fewer uncached committed blocks are free (the upper bound)
    release_steps: int  # calm steps a release also needs; steps to wait after a refused grow
    release_min: int  # release only when the limit falls by at least this
    cached_blocks: int  # at most this many cached-free blocks are kept
    idle_seconds: float  # idle time before the engine's idle release
    order: str = "lowest"  # free blocks: lowest id first, or vLLM's order ("lifo")
    # the watermark follows the allocation rate between watermark_min and watermark (0: fixed)
    watermark_min: int = 0
    calm_seconds: float = CALM_SECONDS  # calm time before a release (and since the last grow)
    window_seconds: float = WINDOW_SECONDS  # the window of the observed allocation rate
    lead_steps: int = 2  # steps a grow takes to become usable, plus the current one
    block_bytes: int = 0  # one block's bytes over every layer (stats; with chunk_bytes, holes)
    chunk_bytes: int = 0  # the workers' chunk (0: quantum blocks, aligned)
    # release whole free chunks below the highest block in use (False under vLLM's extensible
    # KV cache, whose recommit commits a prefix: a hole would come back committed)
    holes: bool = True
    # a grow's or a release's new size level is this share of a watermark above what it needs
    # (ElasticPool._level); elastic_settings: LEVEL_MARGIN
    level_margin: float = 0.0

    def round(self, blocks: int) -> int:
        """``blocks`` rounded up to the quantum, within [floor, num_blocks]."""
        q = self.quantum
        return min(self.num_blocks, max(self.floor, -(-blocks // q) * q))


def _knob(env: Mapping[str, str], name: str, default: float, *, lo: float, kind=int) -> Any:
    return number(KNOBS[name], default, minimum=lo, integer=kind is int, env=env)


def elastic_settings(
    num_blocks: int,
    block_bytes: int,
    chunk_bytes: int,
    *,
    block_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    concurrent_batches: int,
    holes: bool = True,
    env: Mapping[str, str] | None = None,
) -> ElasticSettings:
    """Elastic mode's settings for a pool of ``num_blocks`` blocks of ``block_bytes`` (every
    layer's bytes of one block, one replica) in chunks of ``chunk_bytes``.

    Defaults. ``concurrent_batches`` is vLLM's ``max_concurrent_batches`` (1; 2 with async
    scheduling or 2 pipeline stages; pipeline stages + 1 with both): a grow rides on step k's
    ``SchedulerOutput`` and is confirmed by its model output, processed after
    ``concurrent_batches - 1`` more steps were scheduled, so it becomes usable
    ``concurrent_batches`` steps later and the free blocks must cover ``lead_steps`` =
    ``concurrent_batches + 1`` steps. The worst step takes
    ``ceil(max_num_batched_tokens / block_size) + max_num_seqs`` blocks (every running request
    crossing a block boundary at once): ``watermark``, the upper bound, covers ``lead_steps`` of
    those (at most a quarter of the pool). A step that admits a full token budget takes
    ``ceil(max_num_batched_tokens / block_size) + ceil(max_num_seqs / block_size)`` blocks:
    ``watermark_min`` is one of those, and ``floor`` (what an idle engine keeps, and a burst
    after idle is served from until its grow lands) ``lead_steps`` of them. The pool's watermark
    follows ``lead_steps`` x the largest step of the last ``window_seconds`` within those
    bounds. ``VMMKV_ELASTIC_WATERMARK_BLOCKS`` fixes the watermark (and makes the floor's
    default 2 x watermark); ``release_min`` = the quantum (the pool adds the watermark)."""
    env = os.environ if env is None else env
    if num_blocks < 2 or block_bytes <= 0 or chunk_bytes <= 0:
        raise ValueError(
            f"elastic KV needs >= 2 blocks of > 0 bytes and chunks of > 0 bytes, got "
            f"{num_blocks} blocks of {block_bytes} B, chunks of {chunk_bytes} B"
        )
    quantum = max(1, chunk_bytes // block_bytes)
    if concurrent_batches < 1:
        raise ValueError(f"concurrent_batches must be >= 1, got {concurrent_batches}")
    lead = concurrent_batches + 1
    budget = -(-max_num_batched_tokens // block_size)
    worst = min(num_blocks // 4, lead * (budget + max_num_seqs))
    admit = min(worst, budget + -(-max_num_seqs // block_size))
    fixed = bool(env.get(KNOBS["watermark"], "").strip())
    watermark = _knob(env, "watermark", max(1, worst), lo=1)
    floor = _knob(env, "floor", 2 * watermark if fixed else max(1, lead * admit), lo=1)
    floor = min(num_blocks, -(-floor // quantum) * quantum)
    return ElasticSettings(
        num_blocks=num_blocks,
        quantum=quantum,
        floor=floor,
        watermark=watermark,
        release_steps=_knob(env, "release_steps", RELEASE_STEPS, lo=1),
        release_min=quantum,
        cached_blocks=_knob(env, "cached_blocks", -(-CACHED_TOKENS // block_size), lo=0),
        idle_seconds=_knob(env, "idle_seconds", IDLE_SECONDS, lo=0.0, kind=float),
        order=_order(env),
        watermark_min=watermark if fixed else max(1, admit),
        calm_seconds=_knob(env, "calm_seconds", CALM_SECONDS, lo=0.0, kind=float),
        window_seconds=_knob(env, "window_seconds", WINDOW_SECONDS, lo=0.0, kind=float),
        lead_steps=lead,
        block_bytes=block_bytes,
        chunk_bytes=chunk_bytes,
        holes=holes,
        level_margin=LEVEL_MARGIN,
    )


def _order(env: Mapping[str, str]) -> str:
    return choice(KNOBS["order"], ORDERS, ORDERS[0], env=env)


class LowestIdFreeQueue:
    """vLLM's ``FreeKVCacheBlockQueue`` as ``BlockPool`` uses it (``num_free_blocks``,
    ``popleft``, ``popleft_n``, ``remove``, ``append``, ``append_n``, ``prepend_n``,
    ``get_all_free_blocks``), over the committed blocks only.

    Order "lowest": free blocks without a prefix-cache entry are handed out first, lowest id
    first, so blocks in use gather at the bottom and the tail empties; a cached block is handed
    out (losing its hash) only when no uncached one is left, oldest first as vLLM does. Order
    "lifo" is vLLM's own (uncached blocks most recently freed first, then cached ones oldest
    first), for comparison. Either way the blocks vLLM frees with a hash (``append_n``:
    prefix-cache entries, ``unpin_blocks``' readable ones) are kept in age order (``lru``)."""

    def __init__(self, blocks: list[Any], free_ids: Iterable[int], order: str = "lowest") -> None:
        self.blocks = blocks
        self.lifo = order == "lifo"
        # lazy: an id leaves _low without leaving its heap (or stack)
        self._uncached: list[int] = []
        self._low: set[int] = set()  # free, uncached, committed
        self.lru: OrderedDict[int, Any] = OrderedDict()  # free, cached, committed; oldest first
        self.num_free_blocks = 0
        self.cached_taken = 0  # cached blocks handed out (vLLM drops their hash)
        self.prepend_n([blocks[i] for i in free_ids])

    @property
    def num_uncached(self) -> int:
        """Free committed blocks without a prefix-cache entry."""
        return len(self._low)

    def _pop(self) -> Any:
        heap, low = self._uncached, self._low
        if self.lifo:
            while heap:
                i = heap.pop()
                if i in low:
                    low.remove(i)
                    return self.blocks[i]
        else:
            while heap:
                i = heapq.heappop(heap)
                if i in low:
                    low.remove(i)
                    return self.blocks[i]
        self.cached_taken += 1
        return self.lru.popitem(last=False)[1]

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
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: list[Any]) -> None:
        # vLLM frees cached blocks here too when another tier holds their contents
        # (BlockPool.free_blocks(evict_first=True)): they keep their hash, so they join the age
        # order at its front (blocks[0] evicted first), never the uncached set
        uncached = [b for b in blocks if b.block_hash is None]
        for b in reversed([b for b in blocks if b.block_hash is not None]):
            self.lru[b.block_id] = b
            self.lru.move_to_end(b.block_id, last=False)
        for b in reversed(uncached) if self.lifo else uncached:  # lifo: blocks[0] is next
            self._low.add(b.block_id)
            self._push(b.block_id)
        self.num_free_blocks += len(blocks)

    def _push(self, i: int) -> None:
        heap = self._uncached
        if self.lifo:
            heap.append(i)
        else:
            heapq.heappush(heap, i)
        if len(heap) > 4 * len(self.blocks):  # drop the stale entries now and then
            live = self._low
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
        self._push(block.block_id)


class ElasticPool:
    """The committed limit of one vLLM ``BlockPool`` and its policy (module docstring).

    Installed on a fresh pool (every block but the null block free); blocks from
    ``settings.floor`` up are parked at once: the workers commit ``floor`` blocks at start.
    ``clock`` (seconds, monotonic; ``time.monotonic`` by default) times the calm before a
    release and the window of the allocation rate: a simulated clock makes traces exact."""

    def __init__(
        self, block_pool: Any, settings: ElasticSettings, clock: Callable[[], float] | None = None
    ) -> None:
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
        self.clock = clock or time.monotonic
        self.limit = settings.floor  # blocks [0, limit) less the holes may be handed out
        # uncommitted whole chunks below the limit (parked like the tail: never handed out)
        self.holes: blockset.BlockSet = ()
        self.holed = 0  # the holes' blocks
        self._scan_at = -math.inf  # a hole scan that found too little waits until then
        self._scan: tuple[int, int, list] | None = None  # (below, next chunk, found): under way
        self.queue = LowestIdFreeQueue(block_pool.blocks, range(1, self.limit), settings.order)
        block_pool.free_block_queue = self.queue
        self._in_use: list[int] = []  # max-heap (negated ids), lazy
        self.seq = 0  # resize requests sent
        self.target = self.limit  # the size the workers are asked to hold
        self.pending: tuple[int, int] | None = None  # an unconfirmed grow (seq, target)
        self.hold = 0  # steps to wait after a refused grow
        self.starved = False  # vLLM's KV cache manager refused an allocation in the last step
        self.refused_now = False  # ... in this step (set through kv_refused)
        # the allocation rate: blocks handed out in the current step; the window's largest
        # steps (time, blocks; decreasing)
        self.watermark = settings.watermark_min or settings.watermark
        self._handed = 0
        self._peaks: deque[tuple[float, int]] = deque()
        # the need (in use + cached-free) over the last calm time: (time, blocks), 30 samples;
        # its largest value since the last grow decision or release
        self._needs: deque[tuple[float, int]] = deque()
        self.peak_need = 0
        # calm: since the last grow decision, or a calm time after the last release (None: from
        # the next step); in steps
        self.calm_since: float | None = None
        self.calm_steps = 0
        # the sizes grows and releases asked for in the last LEVEL_SECONDS: (time, blocks,
        # "grow" or "release"); the pending grow's
        self._levels: deque[tuple[float, int, str]] = deque()
        self._asked = 0
        self.counts = {
            "grows": 0, "releases": 0, "refused": 0, "cached_dropped": 0,
            "dropped_by_cap": 0, "dropped_by_release": 0, "grown_blocks": 0,
            "released_blocks": 0, "hole_blocks": 0,
        }  # fmt: skip
        self.last_error: str | None = None
        self.hit: set[int] = set()  # cached blocks a prefix hit reused since they got a hash
        self._watch(block_pool)

    @property
    def committed(self) -> int:
        """Blocks committed: the limit less the holes' blocks."""
        return self.limit - self.holed

    # -- tracking the highest block in use and the allocation rate ----------------------------
    def _watch(self, pool: Any) -> None:
        """Wrap the queue's two exits into use (handed out, prefix hit) to remember ids, and
        the pool's ``touch`` (every prefix hit) to mark the blocks hit."""
        q, heap, hit = self.queue, self._in_use, self.hit
        popleft_n, remove, touch = q.popleft_n, q.remove, pool.touch

        def popleft_n_watched(n: int) -> list[Any]:
            out = popleft_n(n)
            self._handed += n
            for b in out:
                heapq.heappush(heap, -b.block_id)
                hit.discard(b.block_id)  # a new block: vLLM drops a hash it had
            return out

        def touch_watched(blocks: Any) -> None:
            for b in blocks:
                hit.add(b.block_id)
            touch(blocks)

        pool.touch = touch_watched

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

    def _observe(self, now: float) -> None:
        """The last step's blocks handed out join the window; the watermark follows it."""
        s, peaks, n = self.s, self._peaks, self._handed
        self._handed = 0
        while peaks and peaks[-1][1] <= n:
            peaks.pop()
        peaks.append((now, n))
        while peaks[0][0] < now - s.window_seconds:
            peaks.popleft()
        if s.watermark_min and s.watermark_min < s.watermark:
            self.watermark = min(s.watermark, max(s.watermark_min, s.lead_steps * peaks[0][1]))
        needs, need = self._needs, self.committed - 1 - self.queue.num_uncached
        self.peak_need = max(self.peak_need, need)
        if not needs or now - needs[-1][0] >= s.calm_seconds / 30:
            needs.append((now, need))
            while len(needs) > 1 and needs[0][0] < now - s.calm_seconds:
                needs.popleft()

    def growth_rate(self) -> float:
        """Blocks per second that the need (in use + cached-free) grew by over the last half
        calm time (0 when it fell)."""
        needs, since = self._needs, self.clock() - self.s.calm_seconds / 2
        if len(needs) < 2:
            return 0.0
        t0, v0 = next((t, v) for t, v in needs if t >= since or (t, v) == needs[-1])
        t1, v1 = needs[-1]  # over half a calm time at least: a burst's first steps are no rate
        return max(0.0, (v1 - v0) / max(t1 - t0, self.s.calm_seconds / 2))

    def swing(self, now: float, need: int) -> tuple[int, int]:
        """Over the last calm time: the largest rise of the need (a later sample above an
        earlier one within a watermark of the need now: a rise that started far above it
        belongs to a load that has ended), and how far it fell in its last half (the need still
        settling)."""
        low, rise, top = math.inf, 0, need
        for t, v in self._needs:
            rise = max(rise, v - low)
            if v <= need + self.watermark:  # a rise from far above the need: a load that ended
                low = min(low, v)
            if t >= now - self.s.calm_seconds / 2:
                top = max(top, v)
        return int(max(rise, need - low)), top - need

    def keep(self, release: bool = False) -> int:
        """Uncached free blocks a grow provides (1.5 x the watermark) or a release leaves (2 x:
        the need must rise by a watermark before the next grow), and half a calm time of the
        need's growth (a rising load uses a grow's overshoot before it could be released)."""
        rise = int(self.s.calm_seconds / 2 * self.growth_rate())
        return self.watermark + self.watermark // (1 if release else 2) + rise

    def release_min(self) -> int:
        """A release frees at least a watermark (and ``release_min``): smaller ones are churn."""
        return max(self.s.release_min, self.watermark)

    # -- the policy, once per step ------------------------------------------------------------
    def resize_request(self) -> tuple[int, int]:
        return (self.seq, self.target)

    def before_schedule(self) -> None:
        """Before ``Scheduler.schedule``: cap the cached blocks, then grow or release."""
        now = self.clock()
        self._cap_cached()
        self._observe(now)
        s, q = self.s, self.queue
        free = q.num_uncached
        if self.hold:  # a grow was refused: wait release_steps steps before the next
            self.hold -= 1
        elif self.pending is None and self.committed < s.num_blocks:
            if free < self.watermark or self.starved:
                need = self.committed - free + self.keep()
                if self.starved:
                    need = max(need, self.committed + self.watermark)
                need = self._asked = self._level(need, now, "grow")
                self.seq += 1
                self.target = self._grow_target(need)
                self.pending = (self.seq, self.target)
                self.calm_since, self.peak_need = None, self.committed - 1 - free
                self.starved = False
                return
        self.starved = False
        if self.pending is not None:
            return
        if self.calm_since is None:
            self.calm_since, self.calm_steps = now, 0
        self.calm_steps += 1
        if self.calm_steps < s.release_steps or now - self.calm_since < s.calm_seconds:
            return  # (a release sets calm_since a calm time ahead)
        need = self.committed - 1 - free  # in use or cached-free (the null block aside)
        top, keep, rm = self.highest_in_use() + 1, self.keep(release=True), self.release_min()
        holed = self.holed  # a tail target counts them as committed
        if self.limit - s.round(max(top, need + 1 + keep + holed)) < rm and not (
            s.holes and self.committed - (need + 1 + keep) >= rm and now >= self._scan_at
        ):
            return
        rise, settling = self.swing(now, need)
        if settling >= rm:  # still falling: release once, where it settles
            return
        if self.peak_need - need < rm:  # no fall since the last grow or release: a plateau
            return
        base = self._level(need + rise + 1 + keep, now, "release")
        want = s.round(max(top, base + holed))
        tail = self.limit - want >= rm
        if tail:
            want = self._spare_cached(self._net_of_dropped(want, need + rise))
        else:
            want = self.limit
        gone = self._free_chunks(min(want, top), want, base, now) if s.holes else ()
        if gone is None:  # the hole scan goes on in the next step
            return
        if gone or tail:
            self._levels.append((now, base, "release"))
        if gone:
            self._release(want, gone)
        elif tail:
            self._release(want)

    def _level(self, blocks: int, now: float, kind: str) -> int:
        """The size a grow or a release (``kind``) asks for, given the ``blocks`` it needs: the
        largest size a resize of that kind asked for in the last ``LEVEL_SECONDS`` that is at
        most a watermark above ``blocks``, else ``blocks`` + ``level_margin`` watermarks (a new
        level, with room for the next time's jitter). A load that returns to a level gets the
        size it had, not one drawn from this time's noise: a square wave's periods repeat their
        sizes, and a grow that a level covers is one grow, not several. Costs at most a
        watermark."""
        levels, wm = self._levels, self.watermark
        while levels and levels[0][0] < now - LEVEL_SECONDS:
            levels.popleft()
        near = [n for _, n, k in levels if k == kind and blocks <= n <= blocks + wm]
        return max(near, default=blocks + int(self.s.level_margin * wm))

    def _net_of_dropped(self, want: int, used_cached: int) -> int:
        """``want`` less the prefix-cache entries a release to it drops (each target counted
        them as kept): one release, not a second one when the need falls by them."""
        lru, target = self.queue.lru, want
        for _ in range(2):  # fewer dropped at a lower target: converges from above
            dropped = sum(1 for i in lru if i >= target)
            if not dropped:
                break
            keep = self.keep(release=True)
            floor = max(self.highest_in_use() + 1, used_cached - dropped + 1 + keep)
            target = self.s.round(max(floor, want - dropped))
        return target

    def _spare_cached(self, want: int) -> int:
        """``want``, or above the prefix-cache entries in the tail when that still releases at
        least half as much (and ``release_min``): a release prefers a tail without them."""
        top = max((i for i in self.queue.lru if i >= want), default=None)
        if top is None:
            return want
        above, gain = self.s.round(top + 1), self.limit - want
        return above if self.limit - above >= max(self.release_min(), gain / 2) else want

    def _chunk_blocks(self, k: int) -> tuple[int, int]:
        """The blocks ``[lo, hi)`` whose bytes overlap chunk ``k`` of the block-major segment:
        a hole of all of them releases the chunk (a worker releases the chunks no committed
        block needs; a block may straddle two chunks)."""
        s = self.s
        if not (s.chunk_bytes and s.block_bytes):
            return k * s.quantum, min(s.num_blocks, k * s.quantum + s.quantum)
        c, bb = s.chunk_bytes, s.block_bytes
        return k * c // bb, min(s.num_blocks, -(-(k + 1) * c // bb))

    def _any_in_use(self, lo: int, hi: int) -> bool:
        blocks = self.pool.blocks
        return any(blocks[i].ref_cnt for i in range(lo, hi))

    def _free_chunks(
        self, below: int, want: int, base: int, now: float
    ) -> blockset.BlockSet | None:
        """Whole chunks from the floor up and below ``below`` (the highest block in use: the
        tail above it is released as a tail), every block of them free, as the blocks to
        park in holes, so that at least ``base`` blocks stay committed below ``want``: the
        highest first (the queue hands out the lowest), those without prefix-cache entries
        before those with (their hashes are dropped). Empty when they and the tail above
        ``want`` free less than ``release_min``; a scan that finds too little waits a tenth
        of a calm time before the next. None while the scan is under way: it reads at most
        ``SCAN_BLOCKS`` blocks a step and goes on in the next step (the release waits for it),
        so no step of the engine core pays for a scan of the whole pool; a chunk it found free
        is checked again before it is chosen."""
        s, lru, holes = self.s, self.queue.lru, self.holes
        tail = blockset.count(blockset.difference(((want, self.limit),), holes))
        spare = self.committed - tail - base  # blocks below want beyond what must stay
        if spare < s.quantum or now < self._scan_at:
            self._scan = None
            return ()
        if self._scan is None or self._scan[0] != below:
            self._scan = (below, 0, [])
        _, k, found = self._scan
        read = 0
        while True:
            lo, hi = self._chunk_blocks(k)
            if hi > below or lo >= hi:  # (the last chunk's blocks end at num_blocks)
                break
            if read >= SCAN_BLOCKS:
                self._scan = (below, k, found)
                return None
            k += 1
            if lo < s.floor or blockset.is_subset(((lo, hi),), holes):
                continue
            read += hi - lo
            if not self._any_in_use(lo, hi):
                found.append((any(i in lru for i in range(lo, hi)), -lo, lo, hi))
        self._scan = None
        found.sort()
        gone: blockset.BlockSet = ()
        for _, _, lo, hi in found:
            more = blockset.union(gone, ((lo, hi),))
            if blockset.count(blockset.difference(more, holes)) > spare:
                break
            if self._any_in_use(lo, hi):  # handed out since the scan
                continue
            gone = more
        gone = blockset.difference(gone, holes)
        if tail + blockset.count(gone) < self.release_min():
            self._scan_at = now + s.calm_seconds / 10
            return ()
        return gone

    def _grow_target(self, want: int) -> int | blockset.BlockSet:
        """The request that commits ``want`` blocks: the lowest holes first (the queue hands
        out lowest ids first), then the tail, to a multiple of the quantum."""
        if not self.holes:
            return self.s.round(want)
        q, extra, filled = self.s.quantum, want - self.committed, []
        for start, end in self.holes:
            for lo in range(start, end, q):
                if extra <= 0:
                    break
                filled.append((lo, min(end, lo + q)))
                extra -= min(end, lo + q) - lo
        held = blockset.union(self._committed_set(), tuple(filled))
        if extra > 0:
            held = blockset.union(held, ((0, self.s.round(self.limit + extra)),))
        n = blockset.as_prefix(held)
        return held if n is None else n

    def _committed_set(self) -> blockset.BlockSet:
        return blockset.difference(blockset.prefix(self.limit), self.holes)

    def _request(self) -> int | blockset.BlockSet:
        """What the workers are asked to hold: the limit while there are no holes (the
        prefix), else the committed set."""
        return self.limit if not self.holes else self._committed_set()

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
        want = blockset.as_set(target)  # (a prefix n: the set [0, n))
        if error is None and blockset.is_subset(want, blockset.as_set(committed)):
            before = self.committed
            new = blockset.difference(want, self._committed_set())
            self.queue.prepend_n([self.pool.blocks[i] for a, b in new for i in range(a, b)])
            self.limit = blockset.top(want)
            self.holes = blockset.difference(blockset.prefix(self.limit), want)
            self.holed = blockset.count(self.holes)
            self.counts["grows"] += 1
            self.counts["grown_blocks"] += self.committed - before
            self._levels.append((self.clock(), self._asked, "grow"))
            self._log("grew", before)
        else:
            self.target = self._request()
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

    def _release(self, want: int, gone: blockset.BlockSet = ()) -> None:
        """Park the tail from ``want`` up and the blocks ``gone`` (new holes below ``want``,
        committed now) and send the committed set that is left."""
        pool, q = self.pool, self.queue
        before, dropped = self.committed, 0
        self._scan = None  # a hole scan under way read the blocks before this release
        spans = blockset.union(blockset.difference(((want, self.limit),), self.holes), gone)
        for start, end in spans:
            for i in range(start, end):
                b = pool.blocks[i]
                if b.ref_cnt:
                    raise AssertionError(f"elastic KV: block {i} is in use, cannot release it")
                if b.block_id in q.lru and pool._maybe_evict_cached_block(b):
                    dropped += 1
                self.hit.discard(i)
                self._remove_quietly(b)
        self.limit = want
        holes = blockset.union(blockset.difference(self.holes, ((want, self.s.num_blocks),)), gone)
        if holes and holes[-1][1] == want:  # a hole that reaches the limit is tail
            self.limit, holes = holes[-1][0], holes[:-1]
        self.holes = holes
        self.holed = blockset.count(self.holes)
        self.counts["hole_blocks"] += blockset.count(gone)
        self.seq += 1
        self.target = self._request()
        self.calm_since = self.clock() + self.s.calm_seconds  # the next: 2 calm times
        self.peak_need = self.committed - 1 - q.num_uncached
        self.counts["releases"] += 1
        self.counts["released_blocks"] += before - self.committed
        self.counts["cached_dropped"] += dropped
        self.counts["dropped_by_release"] += dropped
        self._log("released", before, f", {dropped} prefix-cache entries dropped")

    def _cap_cached(self) -> None:
        """At most ``cached_blocks`` cached-free blocks: the oldest lose their hash, but one
        that a prefix hit reused gets a second chance (it moves to the young end, unmarked)."""
        q, hit, extra = self.queue, self.hit, len(self.queue.lru) - self.s.cached_blocks
        while extra > 0:
            i, b = next(iter(q.lru.items()))  # the oldest
            if i in hit:
                hit.discard(i)
                q.lru.move_to_end(i)
                continue
            self.pool._maybe_evict_cached_block(b)
            q.demote(b)
            self.counts["cached_dropped"] += 1
            self.counts["dropped_by_cap"] += 1
            extra -= 1

    def _log(self, what: str, before: int, more: str = "") -> None:
        st = self.stats()
        log.info(
            "vmmkv: elastic KV %s %d -> %d of %d blocks (%.1f GiB committed): in use %d, "
            "cached-free %d, watermark %d; %d grows, %d releases%s", what, before, self.committed,
            self.s.num_blocks, st["committed_bytes"] / 2**30, st["in_use"], st["cached_free"],
            self.watermark, self.counts["grows"], self.counts["releases"], more,
        )  # fmt: skip

    # -- what vLLM asks the pool about the whole pool -----------------------------------------
    def usage(self) -> float:
        """``BlockPool.get_usage``: blocks in use over the capacity (vLLM's own meaning: the
        share of the KV cache a deployment sized, not of the part committed now)."""
        total = self.s.num_blocks - 1
        return (self.committed - 1 - self.queue.num_free_blocks) / total if total > 0 else 0.0

    def parked(self) -> int:
        """Blocks not committed: the tail from the limit up and the holes."""
        return self.s.num_blocks - self.committed

    def stats(self) -> dict[str, Any]:
        """The pool's state and counters: committed blocks and bytes, blocks in use, free
        (uncached / cached), the watermark, grows, releases, refusals, dropped cache entries."""
        q = self.queue
        return {
            "capacity": self.s.num_blocks, "limit": self.limit, "committed": self.committed,
            "committed_bytes": self.committed * self.s.block_bytes, "target": self.target,
            "holes": self.holes,
            "seq": self.seq, "pending": self.pending is not None,
            "free": q.num_free_blocks, "uncached_free": q.num_uncached,
            "cached_free": len(q.lru), "in_use": self.committed - 1 - q.num_free_blocks,
            "watermark": self.watermark, "usage": self.usage(),
            "dropped_by_handout": q.cached_taken, **self.counts,
        }  # fmt: skip
