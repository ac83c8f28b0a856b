"""Elastic KV's free-block queue: :class:`LowestIdFreeQueue` replaces vLLM's
``FreeKVCacheBlockQueue`` in the ``BlockPool`` (the same methods, as ``BlockPool`` calls them). It
holds the free blocks below ``limit`` (the committed ones): those without a prefix-cache entry are
handed out first, lowest id first (vLLM reuses them LIFO, which keeps the highest block in use
near its peak forever); a cached one only when none is left, oldest first as vLLM does, so no
prefix-cache entry is given up while an uncached committed block is free. Blocks at or above
``limit`` are *parked*: free, uncommitted, invisible to vLLM's admission (``num_free_blocks``
counts committed blocks only); so are the blocks of holes below ``limit`` (the pool,
``_elastic.ElasticPool``, takes them out of the queue).

Local to the engine core, single-threaded like vLLM's scheduler.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

__all__ = ["LowestIdFreeQueue"]


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

    def demote_unhashed(self) -> int:
        """Every cached-free block without a hash (vLLM's ``reset_prefix_cache`` clears them
        all) becomes an ordinary free block, handed out lowest id first; returns how many."""
        gone = [b for b in self.lru.values() if b.block_hash is None]
        for b in gone:
            self.demote(b)
        return len(gone)
