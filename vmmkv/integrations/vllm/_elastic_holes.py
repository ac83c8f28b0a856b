"""Elastic KV's holes (:class:`HoleScan`, a part of ``_elastic.ElasticPool``; the rule is the
"holes" item of ``_elastic``'s module docstring): the whole chunks below the highest block in
use whose blocks are all free, found by a scan that reads at most ``SCAN_BLOCKS`` blocks a step,
and the requests holes lead to: a grow refills the lowest holes first
(:meth:`~HoleScan._grow_target`), and the workers are asked for the committed block set while
there are holes (:meth:`~HoleScan._request`).

Local to the engine core, single-threaded like vLLM's scheduler; the state lives on the pool
(``ElasticPool.__init__`` sets it up).
"""

from __future__ import annotations

from ... import _blockset as blockset

__all__ = ["SCAN_BLOCKS", "HoleScan"]

# blocks a step's hole scan reads at most, so that no step of the engine core pays for a scan of
# the whole pool (4096 blocks: about 200 µs on a CPU core; 256 blocks: 13-25 µs); a scan of 4096
# blocks then spans 16 steps, a fraction of a second beside the calm time's 10 s
SCAN_BLOCKS = 256


class HoleScan:
    """The hole scan and hole-aware requests of :class:`~._elastic.ElasticPool`."""

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
