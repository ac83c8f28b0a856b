"""Block sets: the committed state of a block layout as block intervals (pure, no torch).

A block set is a tuple of ``(start, end)`` block intervals, sorted, disjoint, non-empty and not
touching (the canonical form: two equal sets are equal tuples, so ranks compare them as
values). The committed prefix of ``n`` blocks is ``((0, n),)``; nothing committed is ``()``.

Contract: every function is local and pure. ``block_set`` validates and canonicalizes a
caller's set (TypeError/ValueError naming the interval, the value got and what was expected);
the others take canonical sets.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

from ._util import require_int

__all__ = [
    "BlockSet",
    "as_prefix",
    "as_set",
    "block_set",
    "contains",
    "count",
    "intersection",
    "difference",
    "is_subset",
    "prefix",
    "top",
    "union",
]

BlockSet = tuple[tuple[int, int], ...]


def _merge(intervals: Iterable[tuple[int, int]]) -> BlockSet:
    out: list[tuple[int, int]] = []
    for start, end in sorted(iv for iv in intervals if iv[0] < iv[1]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return tuple(out)


def block_set(intervals: Any, max_blocks: int, what: str = "block set") -> BlockSet:
    """``intervals`` (``(start, end)`` int pairs, ``0 <= start <= end <= max_blocks``, any
    order, overlapping or touching ones merged, empty ones dropped) in canonical form."""
    if isinstance(intervals, (str, bytes)) or not hasattr(intervals, "__iter__"):
        raise TypeError(
            f"{what} must be a sequence of (start, end) block intervals, got "
            f"{type(intervals).__name__} {intervals!r:.80}"
        )
    checked = []
    for i, iv in enumerate(intervals):
        if not isinstance(iv, (tuple, list)) or len(iv) != 2:
            raise TypeError(f"{what}[{i}] must be a (start, end) block interval, got {iv!r:.80}")
        start = require_int(f"{what}[{i}] start", iv[0])
        end = require_int(f"{what}[{i}] end", iv[1])
        if not 0 <= start <= end <= max_blocks:
            raise ValueError(
                f"{what}[{i}] = ({start}, {end}) is not inside [0, max_blocks={max_blocks}] "
                "with start <= end"
            )
        checked.append((start, end))
    return _merge(checked)


def as_set(size: int | BlockSet) -> BlockSet:
    """A committed size as a block set: an int ``n`` is the prefix ``[0, n)``, a set is itself
    (what a worker's stamp carries either way)."""
    return prefix(size) if isinstance(size, int) else tuple((a, b) for a, b in size)


def prefix(n: int) -> BlockSet:
    """Blocks ``[0, n)``."""
    return ((0, n),) if n > 0 else ()


def as_prefix(s: BlockSet) -> int | None:
    """``n`` when ``s`` is the prefix ``[0, n)`` (0 for the empty set), else None."""
    if not s:
        return 0
    return s[0][1] if len(s) == 1 and s[0][0] == 0 else None


def top(s: BlockSet) -> int:
    """One past the highest block of ``s`` (0 when empty): a kernel bound that covers it."""
    return s[-1][1] if s else 0


def count(s: BlockSet) -> int:
    return sum(end - start for start, end in s)


def union(a: BlockSet, b: BlockSet) -> BlockSet:
    return _merge((*a, *b))


def difference(a: BlockSet, b: BlockSet) -> BlockSet:
    """The blocks of ``a`` not in ``b``."""
    out = []
    for start, end in a:
        cur = start
        for bs, be in b:
            if be <= cur or bs >= end:
                continue
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
            if cur >= end:
                break
        if cur < end:
            out.append((cur, end))
    return tuple(out)


def intersection(a: BlockSet, b: BlockSet) -> BlockSet:
    """The blocks in both ``a`` and ``b``."""
    return difference(a, difference(a, b))


def is_subset(a: BlockSet, b: BlockSet) -> bool:
    return not difference(a, b)


def contains(s: BlockSet, block: int) -> bool:
    """Whether block ``block`` lies in ``s`` (a bisection: a step checks every block id)."""
    i = bisect.bisect_right(s, block, key=lambda iv: iv[0]) - 1
    return i >= 0 and block < s[i][1]
