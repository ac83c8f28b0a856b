"""The geometry of a region's memory: the chunk grid, byte ranges and the runs a commit creates.

Pure functions and values: no driver call, no torch, no state. A region's range is cut into a
grid of **chunks** (chunk ``k`` spans ``[k * chunk_bytes, min((k + 1) * chunk_bytes,
capacity))``): what a region commits is always a set of whole chunks, the chunks that cover the
byte ranges asked for. The physical memory behind them comes in **runs**: one physical
allocation per stretch of chunks that one commit adds to one of its ranges, never crossing a
multiple of the run grid ``run_bytes`` (a multiple of ``chunk_bytes``). With ``run_bytes ==
chunk_bytes`` every chunk is a run of its own. A run is mapped, exported, imported and
unmapped whole (the driver maps and unmaps whole allocations), so a region's books, and each
peer's, list runs: :class:`Chunk` values, each one mapped piece.

Errors: TypeError/ValueError naming the value got and what was expected.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .._blockset import difference, union
from .._util import ceil_div, require_int

__all__ = [
    "Chunk",
    "MAX_CHUNKS",
    "Range",
    "block_layout_chunk_bytes",
    "covering_chunks",
    "intersection",
    "plan_runs",
]

MAX_DEFAULT_CHUNK = 1 << 30
# The most chunks block_layout_chunk_bytes gives a region: a grow's cost is per chunk and peer
# (measured on one H200: ~0.39 ms per chunk and peer), so a full grow of 512 chunks at PCP 8
# stays under 2 s (docs/design.md, "Chunk sizes").
MAX_CHUNKS = 512
DEFAULT_CHUNKS = 64

Range = tuple[int, int]  # [start, end) in bytes from a region's base


@dataclass(frozen=True)
class Chunk:
    """One mapped piece of a region: ``size`` bytes at ``offset`` from the base, one physical
    allocation (a run of grid chunks; a single chunk when runs are one chunk long)."""

    offset: int
    size: int


def offset_key(c: Chunk) -> int:
    return c.offset


def require_positive(name: str, value: Any) -> int:
    require_int(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def require_granular(name: str, value: int, granularity: int) -> int:
    if value % granularity:
        raise ValueError(
            f"{name}={value} is not a multiple of the allocation granularity {granularity}"
        )
    return value


def check_ranges(op: str, ranges: Any, capacity: int) -> list[Range]:
    """``ranges`` as a list of ``(start, end)`` int pairs with ``0 <= start <= end <=
    capacity``, in the caller's order; TypeError/ValueError naming ``op``, the value got and
    what was expected."""
    if isinstance(ranges, (str, bytes)) or not hasattr(ranges, "__iter__"):
        raise TypeError(
            f"{op}: ranges must be a sequence of (start, end) pairs, got {type(ranges).__name__}"
        )
    out: list[Range] = []
    for i, r in enumerate(ranges):
        if not isinstance(r, (tuple, list)) or len(r) != 2:
            raise TypeError(f"{op}: ranges[{i}] must be a (start, end) pair, got {r!r}")
        start, end = r
        require_int(f"{op}: ranges[{i}] start", start)
        require_int(f"{op}: ranges[{i}] end", end)
        if not 0 <= start <= end <= capacity:
            raise ValueError(
                f"{op}: ranges[{i}] = ({start}, {end}) is not inside [0, capacity={capacity}] "
                "with start <= end"
            )
        out.append((start, end))
    return out


def merged(ranges: Iterable[Range]) -> list[Range]:
    """The union of ``ranges`` as sorted, disjoint, non-empty ranges."""
    out: list[Range] = []
    for start, end in sorted(r for r in ranges if r[0] < r[1]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def overlaps(sorted_ranges: list[Range], offset: int, size: int) -> bool:
    """Whether ``[offset, offset + size)`` overlaps one of ``sorted_ranges`` (``merged``)."""
    i = bisect.bisect_left(sorted_ranges, offset + size, key=lambda r: r[0]) - 1
    return i >= 0 and sorted_ranges[i][1] > offset


def intersection(ranges: Iterable[Range], pieces: Iterable[Chunk]) -> list[Range]:
    """The bytes of ``ranges`` that lie inside one of ``pieces``, as sorted, disjoint ranges."""
    a = merged(ranges)
    b = merged((c.offset, c.offset + c.size) for c in pieces)
    out: list[Range] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def block_layout_chunk_bytes(
    segments: Any,
    capacity: int,
    granularity: int,
    *,
    waste: float = 1 / 32,
    max_chunks: int = MAX_CHUNKS,
) -> int:
    """The chunk size for a region that grows by blocks of ``segments`` (``(offset,
    block_bytes)`` pairs, as ``set_block_layout`` takes them) in runs of one chunk: the largest
    power-of-two multiple of ``granularity`` (at most 1 GiB, at least the granularity) whose
    worst-case overhead, one partly used chunk at each end of every segment (``2 *
    len(segments)`` chunks), stays within ``waste * capacity``; then doubled until the capacity
    holds at most ``max_chunks`` chunks (while the 1 GiB ceiling allows). Pure geometry.

    Why: the default (``capacity / 64``) is larger than a segment as soon as a layout has more
    than 64 of them (a DeepSeek-V3.2 cache has 122), and then any block count commits the whole
    capacity. Smaller chunks follow the committed blocks closer, but where every chunk is a run
    of its own, every chunk costs driver calls on every rank at every grow (create, map, access
    and export its own; import, map and access it on every peer), so the count is capped
    (``MAX_CHUNKS``; docs/design.md, "Chunk sizes"). Regions whose runs span many chunks
    (``run_bytes``) pay per run instead and can take the granularity."""
    require_positive("capacity", capacity)
    require_positive("granularity", granularity)
    require_positive("max_chunks", max_chunks)
    count = len(list(segments))
    chunk = granularity
    while chunk * 2 <= min(capacity, MAX_DEFAULT_CHUNK) and (
        2 * count * chunk * 2 <= waste * capacity or ceil_div(capacity, chunk) > max_chunks
    ):
        chunk *= 2
    return chunk


def covering_chunks(ranges: Any, chunk_bytes: int, capacity: int) -> list[Chunk]:
    """The chunks of the grid ``chunk_bytes`` over ``[0, capacity)`` (chunk ``k`` at ``k *
    chunk_bytes``, the last one cut at the capacity) that overlap one of ``ranges`` (``(start,
    end)`` byte pairs; empty ones cover nothing), in address order. Pure geometry."""
    require_positive("chunk_bytes", chunk_bytes)
    require_positive("capacity", capacity)
    out: list[Chunk] = []
    last = -1
    for start, end in merged(check_ranges("covering_chunks", ranges, capacity)):
        first = max(start // chunk_bytes, last + 1)
        last = ceil_div(end, chunk_bytes) - 1
        for k in range(first, last + 1):
            offset = k * chunk_bytes
            out.append(Chunk(offset, min(chunk_bytes, capacity - offset)))
    return out


def plan_runs(
    ranges: Any, mapped: Iterable[Chunk], chunk_bytes: int, run_bytes: int, capacity: int
) -> list[Chunk]:
    """The runs a commit of ``ranges`` creates over the pieces ``mapped`` already: for each
    range in the order given (empty ones cover nothing), the grid chunks that cover it and that
    neither ``mapped`` nor an earlier range of the same commit holds; each stretch of them one
    run, cut where it crosses a multiple of ``run_bytes``. In address order. Ranges are kept
    apart (not merged) so that a block layout's segments get runs of their own, as vLLM's own
    buffer commits each segment's range. Pure geometry."""
    require_positive("chunk_bytes", chunk_bytes)
    require_positive("run_bytes", run_bytes)
    require_positive("capacity", capacity)
    if run_bytes % chunk_bytes:
        raise ValueError(f"run_bytes={run_bytes} is not a multiple of chunk_bytes={chunk_bytes}")
    held = tuple(
        (c.offset // chunk_bytes, ceil_div(c.offset + c.size, chunk_bytes))
        for c in sorted(mapped, key=offset_key)
    )
    held = union(held, ())
    out: list[Chunk] = []
    for start, end in check_ranges("plan_runs", ranges, capacity):
        if start == end:
            continue
        new = difference(((start // chunk_bytes, ceil_div(end, chunk_bytes)),), held)
        for first, last in new:
            lo, hi = first * chunk_bytes, min(last * chunk_bytes, capacity)
            while lo < hi:
                cut = min(hi, (lo // run_bytes + 1) * run_bytes)
                out.append(Chunk(lo, cut - lo))
                lo = cut
        held = union(held, new)
    return sorted(out, key=offset_key)
