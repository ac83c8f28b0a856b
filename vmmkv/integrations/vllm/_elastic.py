"""Elastic KV's policy, in the engine core. vLLM's block pool hands out only the blocks vmmkv has
committed, lowest free id first, and asks the PCP group to grow ahead of demand and to release
the tail when it is free.

Why in the engine core: only the scheduler knows which blocks are free, cached or in use, and
every PCP worker receives its ``SchedulerOutput``s identically and in one order (vLLM's
broadcast queue). So the decision is made here and rides on every ``SchedulerOutput`` as
``vmmkv_resize = (seq, target)``; each worker applies a new ``seq`` once, collectively, before
vLLM zeroes or copies blocks (``_elastic_worker``). docs/design.md, "Elastic KV in vLLM", has the
measurements behind each rule.

- ``_elastic_queue.LowestIdFreeQueue`` replaces vLLM's ``FreeKVCacheBlockQueue`` in the
  ``BlockPool``: the committed free blocks only, uncached ones lowest id first; the pool parks
  the rest (the tail at or above ``limit``, the holes below it).
- :class:`ElasticPool` is the policy (its readings of the load: ``_elastic_load.LoadWatch``; its
  hole scan: ``_elastic_holes.HoleScan``; its settings: ``_elastic_settings``), called by the
  patched ``Scheduler`` once per step (``_elastic_engine``), on a clock (``time.monotonic``; a
  trace injects simulated time):

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

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ... import _blockset as blockset
from ._elastic_holes import HoleScan
from ._elastic_load import LoadWatch
from ._elastic_queue import LowestIdFreeQueue
from ._elastic_settings import RESIZE, STAMP, ElasticSettings

log = logging.getLogger(__name__)

__all__ = ["LEVEL_SECONDS", "ElasticPool"]

# the sizes a grow or a release asked for are remembered this long: a load that returns to a
# level within it gets the size it had (a few periods of a load that swings every minute or so)
LEVEL_SECONDS = 120.0


class ElasticPool(LoadWatch, HoleScan):
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
        self.idle_since: float | None = None  # when the engine went idle (its input loop)
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

    # -- the policy, once per step ------------------------------------------------------------
    def resize_request(self) -> tuple[int, int]:
        return (self.seq, self.target)

    def before_schedule(self) -> None:
        """Before ``Scheduler.schedule``: cap the cached blocks, then grow or release."""
        now = self.clock()
        self.idle_since = None  # the engine steps: not idle
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
            "capacity": self.s.num_blocks, "floor": self.s.floor, "limit": self.limit,
            "committed": self.committed,
            "committed_bytes": self.committed * self.s.block_bytes, "target": self.target,
            "holes": self.holes,
            "seq": self.seq, "pending": self.pending is not None,
            "free": q.num_free_blocks, "uncached_free": q.num_uncached,
            "cached_free": len(q.lru), "in_use": self.committed - 1 - q.num_free_blocks,
            "watermark": self.watermark, "usage": self.usage(),
            "dropped_by_handout": q.cached_taken, **self.counts,
        }  # fmt: skip
