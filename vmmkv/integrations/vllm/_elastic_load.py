"""What elastic KV's pool reads of vLLM's block pool and of the load (:class:`LoadWatch`, a part
of ``_elastic.ElasticPool``, whose module docstring has the policy that uses the readings): the
highest block in use (a lazy max-heap of the ids handed out), the blocks handed out per step over
the last ``window_seconds`` and the watermark that follows them, the need (in use + cached-free)
over the last calm time, its growth rate and its swing, and from them the free blocks a grow
provides or a release leaves (:meth:`~LoadWatch.keep`) and the smallest release
(:meth:`~LoadWatch.release_min`).

Local to the engine core, single-threaded like vLLM's scheduler; the state lives on the pool
(``ElasticPool.__init__`` sets it up).
"""

from __future__ import annotations

import heapq
import math
from typing import Any

__all__ = ["LoadWatch"]


class LoadWatch:
    """The readings of :class:`~._elastic.ElasticPool` (module docstring)."""

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
