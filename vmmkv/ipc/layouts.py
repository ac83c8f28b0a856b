"""How a size maps onto a ``SymmetricRegion``'s region: a committed prefix (bytes) or a block
layout (blocks, any block set), the chunks and runs each size needs, and the words errors use.

- ``_Prefix``: sizes in bytes; the committed prefix, chunk-rounded; one bound.
- ``_Segments``: a block layout (``SymmetricRegion.set_block_layout``): sizes are block sets
  (``vmmkv._blockset``), one bound per segment.
- ``planned_runs(layout, size)``: the runs a grow to ``size`` creates (what it exchanges and
  what the open-file budget counts), without a driver call.

Contract: local, used by the ``Resizer`` (``vmmkv.ipc.resize``) between its collective points;
``commit``/``decommit`` call the driver (not capture-safe), the rest is geometry. Bytes that
join the committed size read zero: fresh runs are zeroed when created, and the part of them
that a run kept mapped from before (a shrink that ended inside a run, a chunk shared with a
neighbouring segment, the edge of a hole) is zeroed in place and synchronized before ``commit``
returns, so before any peer can write there.
"""

from __future__ import annotations

import bisect
from typing import Any

from .. import _blockset as blockset
from .._blockset import BlockSet
from .._util import require_int
from ..alloc import Chunk, VirtualRegion
from .peers import PeerMap

__all__ = ["planned_runs"]


def _zero_kept(region: VirtualRegion, ranges: list[tuple[int, int]]) -> None:
    """Zero the bytes of ``ranges`` (what joins the committed size) that runs already hold,
    then synchronize: they were committed before and may hold old bytes."""
    kept = region.mapped_parts([r for r in ranges if r[0] < r[1]])
    if not kept:
        return
    whole = region.tensor()
    for lo, hi in kept:
        whole[lo:hi].zero_()
    del whole
    region.synchronize()


class _Prefix:
    """The committed prefix: sizes in bytes, one bound (the committed size, chunk-rounded).

    ``size`` is the prefix asked for, chunk-rounded; the memory mapped (``committed_bytes``)
    is at least that, more when a shrink ended inside a run (the run stays whole)."""

    unit = "bytes"

    def __init__(self, region: VirtualRegion) -> None:
        self._region = region
        self.limit = region.capacity_bytes
        self.size = region.committed_bytes

    def current(self) -> int:
        return self.size

    def rounded(self, nbytes: int) -> int:
        return self._region.round_up(nbytes)

    def commit(self, nbytes: int) -> list[Chunk]:
        _zero_kept(self._region, [(self.size, self.rounded(nbytes))])
        return self._region.commit(nbytes)

    def decommit(self, nbytes: int) -> None:
        self._region.decommit(nbytes)

    def unmap_peers(self, peers: PeerMap, nbytes: int) -> None:
        peers.unmap_peers_from(self._region.round_up(nbytes))

    def bounds(self, nbytes: int) -> list[int]:
        return [self._region.round_up(nbytes)]

    def ranges(self, nbytes: int) -> list[tuple[int, int]]:
        return [(0, self.rounded(nbytes))]

    def moved(self, nbytes: int) -> None:
        self.size = self.rounded(nbytes)


def planned_runs(layout: _Prefix | _Segments, size: Any) -> list[Chunk]:
    """The runs ``layout.commit(size)`` would create now (pure geometry, no driver call)."""
    return layout._region.plan_runs(layout.ranges(size))


class _Segments:
    """A block layout: sizes are block sets (``vmmkv._blockset``: sorted block intervals; the
    prefix of ``n`` blocks is ``((0, n),)``), one bound per segment (``offset_i + top *
    block_i``, ``top`` one past the set's highest block).

    The chunks a set needs are those covering its blocks' bytes in every segment (their union),
    committed in runs of each segment's own (one per stretch of new chunks of an interval, cut
    at the region's run grid). A run is released only when it holds no block of the set in
    any segment, so a hole releases the runs that lie wholly inside the hole in every segment
    (block-major with runs of one chunk: the whole chunks inside it) and keeps the others
    committed; their hole blocks are outside the set (never handed out) as the tail beyond a
    prefix is."""

    unit = "blocks"

    def __init__(
        self, region: VirtualRegion, segments: tuple[tuple[int, int], ...], max_blocks: int
    ) -> None:
        self._region = region
        self.segments = segments
        self.max_blocks = self.limit = max_blocks
        self.set: BlockSet = ()
        self._by_start = sorted(
            (off, off + max_blocks * block, i) for i, (off, block) in enumerate(segments)
        )

    @property
    def blocks(self) -> int:
        """The top of the committed set (its block count when it is a prefix): the bound."""
        return blockset.top(self.set)

    def current(self) -> BlockSet:
        return self.set

    def rounded(self, blocks: BlockSet) -> BlockSet:
        return blocks

    def ranges(self, blocks: BlockSet) -> list[tuple[int, int]]:
        return [
            (off + start * block, off + end * block)
            for off, block in self.segments
            for start, end in blocks
        ]

    def commit(self, blocks: BlockSet) -> list[Chunk]:
        """Commit the chunks of the set ``blocks`` (a superset of the committed one); the new
        blocks read zero (module doc: the part runs already hold is zeroed in place first,
        outside the set, so nothing writes there; a grow that then fails leaves it zero).
        Blocks that stay in the set keep their bytes. Returns the runs created."""
        _zero_kept(self._region, self.ranges(blockset.difference(blocks, self.set)))
        return self._region.commit_ranges(self.ranges(blocks))

    def decommit(self, blocks: BlockSet) -> None:
        self._region.decommit_outside(self.ranges(blocks))

    def unmap_peers(self, peers: PeerMap, blocks: BlockSet) -> None:
        peers.unmap_peers_outside(self.ranges(blocks))

    def bounds(self, blocks: BlockSet) -> list[int]:
        top = blockset.top(blocks)
        return [off + top * block for off, block in self.segments]

    def moved(self, blocks: BlockSet) -> None:
        self.set = blocks

    def containing(self, start: int, end: int) -> int | None:
        """The index of the segment that contains ``[start, end)``, or None."""
        k = bisect.bisect_right(self._by_start, start, key=lambda t: t[0]) - 1
        if k < 0:
            return None
        seg_start, seg_end, index = self._by_start[k]
        return index if start >= seg_start and max(start, end) <= seg_end else None

    def describe(self, limit: int = 6) -> str:
        shown = ", ".join(
            f"#{i} [{off}, {off + self.max_blocks * block}) of {block}-byte blocks"
            for i, (off, block) in enumerate(self.segments[:limit])
        )
        more = len(self.segments) - limit
        return f"{len(self.segments)} segments of {self.max_blocks} blocks: {shown}" + (
            f", ... {more} more" if more > 0 else ""
        )


def _check_layout(segments: Any, max_blocks: Any, capacity: int) -> tuple[tuple[int, int], ...]:
    """The block layout as a tuple of ``(offset_bytes, block_bytes)``, in the caller's order;
    TypeError/ValueError naming the segment, the value got and what was expected."""
    require_int("max_blocks", max_blocks, lo=1)
    if isinstance(segments, (str, bytes)) or not hasattr(segments, "__iter__"):
        raise TypeError(
            "segments must be a sequence of (offset_bytes, block_bytes) pairs, got "
            f"{type(segments).__name__}"
        )
    out = []
    for i, seg in enumerate(segments):
        if not isinstance(seg, (tuple, list)) or len(seg) != 2:
            raise TypeError(
                f"segments[{i}] must be an (offset_bytes, block_bytes) pair, got {seg!r}"
            )
        off, block = seg
        require_int(f"segments[{i}] offset_bytes", off, lo=0)
        require_int(f"segments[{i}] block_bytes", block, lo=1)
        end = off + max_blocks * block
        if end > capacity:
            raise ValueError(
                f"segments[{i}] = ({off}, {block}) spans [{off}, {end}) with max_blocks="
                f"{max_blocks}, beyond the capacity {capacity}"
            )
        out.append((off, block))
    if not out:
        raise ValueError("segments must hold at least one (offset_bytes, block_bytes) pair")
    spans = sorted((off, off + max_blocks * block, i) for i, (off, block) in enumerate(out))
    for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:], strict=False):
        if start_b < end_a:
            raise ValueError(
                f"segments[{a}] = {out[a]} and segments[{b}] = {out[b]} overlap with max_blocks="
                f"{max_blocks} (segment {a} ends at {end_a}, segment {b} starts at {start_b})"
            )
    return tuple(out)


def _layout_differences(layouts: list[Any]) -> str:
    """Which ranks passed which layout: ranks grouped by layout, each group with its segment
    count, max_blocks and its first segment that differs from rank 0's."""
    groups: dict[str, list[int]] = {}
    for rank, layout in enumerate(layouts):
        groups.setdefault(repr(layout), []).append(rank)
    first = layouts[0]
    parts = []
    for ranks in groups.values():
        max_blocks, segs = layouts[ranks[0]]
        diff = next(
            (i for i, (a, b) in enumerate(zip(segs, first[1], strict=False)) if a != b),
            None if len(segs) == len(first[1]) else min(len(segs), len(first[1])),
        )
        at = ""
        if diff is not None and ranks[0] != 0:
            theirs = tuple(segs[diff]) if diff < len(segs) else None
            ours = tuple(first[1][diff]) if diff < len(first[1]) else None
            at = f", first differing segment #{diff}: {theirs} (rank 0: {ours})"
        parts.append(f"ranks {ranks} have {len(segs)} segments, max_blocks={max_blocks}{at}")
    return "; ".join(parts)


def _show(s: BlockSet, limit: int = 8) -> str:
    """A block set in words: its intervals (the first ``limit``) and its block count."""
    shown = ", ".join(f"[{a}, {b})" for a, b in s[:limit])
    more = f", ... {len(s) - limit} more" if len(s) > limit else ""
    return f"{{{shown}{more}}} ({blockset.count(s)} blocks)" if s else "{} (0 blocks)"


def _show_size(s: BlockSet) -> str:
    """A committed block set: ``n`` when it is the prefix ``[0, n)``, else the set."""
    n = blockset.as_prefix(s)
    return str(n) if n is not None else _show(s)


def _size_words(size: Any, unit: str) -> str:
    """A resize target in words: ``n blocks`` for a prefix, the set otherwise; bytes as is."""
    if not isinstance(size, tuple):
        return f"{size} {unit}"
    n = blockset.as_prefix(size)
    return f"{n} blocks" if n is not None else f"the block set {_show(size)}"
