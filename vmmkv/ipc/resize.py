"""How a ``SymmetricRegion`` (``vmmkv.ipc.symmetric``) is sized: its layout (a committed prefix
or a block layout), the bound table its kernels read, and the collective resize protocol
(docs/design.md, "Resize protocol") that grows or shrinks every rank's region together.

Contract:
- ``Resizer`` is composed by one ``SymmetricRegion``. It borrows that region's ``StoreComm``, its
  ``VirtualRegion``, its lock (which also orders ``close``) and, per call, its ``PeerMap``; it
  closes none of them. It owns the layout, ``table`` (the device int64 bound table the region
  exposes as ``committed_table``) and ``broken``.
- Collective (every rank of the group, same order of calls): ``resize``, ``resize_set`` (a
  block set: a grow to the union of the old and new sets, then a shrink to the new one) and
  ``set_block_layout``. Each gathers every rank's request first (a bad one raises on every rank:
  the offending rank its own TypeError/ValueError/RuntimeError, the others
  :class:`RendezvousError` naming it) and ends with one outcome on every rank
  (``vmmkv.ipc.comm``). Local: ``commit_initial`` (before the region's first collective step),
  ``check_fds`` and the layouts (geometry; ``commit``/``decommit`` call the driver).
- Not capture-safe: a resize commits, maps and unmaps memory, writes the bound table and
  synchronizes; ``resize`` refuses on every rank while the calling thread captures a CUDA
  stream. Kernels read ``table`` on every launch, so what was captured before a resize is
  bounded by the new size without new arguments.
- A failed grow rolls every rank back to the old size (peers' new chunks unmapped first, then
  the own ones decommitted) and leaves the group usable. A failed shrink leaves the bound
  lowered and ``broken`` set (as does a rollback that itself failed): every later resize is
  refused on every rank.
- fd budget (``vmmkv.ipc.fdbudget``): a step that commits or exchanges chunks first checks that
  its exchange rounds and the fds its chunks keep (host backend: one memfd each) fit under the
  hard open-file limit (``check_fds``), raising ``FdBudgetError`` before any driver call.
"""

from __future__ import annotations

import bisect
import logging
import secrets
import threading
import time
from typing import Any

import torch

from .. import _blockset as blockset
from .._blockset import BlockSet
from .._util import require_int, run_all
from ..alloc import Chunk, VirtualRegion
from ..alloc.region import covering_chunks
from . import fdbudget
from .comm import GroupError, StoreComm
from .errors import ConfigMismatch, RendezvousError, as_rendezvous_error
from .peers import PeerMap, exchange_then_agree

__all__ = ["Resizer"]

# One logger for all a SymmetricRegion reports, its resizes included.
log = logging.getLogger("vmmkv.ipc.symmetric")


# --------------------------------------------------------------------------------------------
# how a size maps onto the region: a committed prefix (bytes) or a block layout (blocks)
# --------------------------------------------------------------------------------------------


class _Prefix:
    """The committed prefix: sizes in bytes, one bound (the committed size, chunk-rounded)."""

    unit = "bytes"

    def __init__(self, region: VirtualRegion) -> None:
        self._region = region
        self.limit = region.capacity_bytes

    def current(self) -> int:
        return self._region.committed_bytes

    def rounded(self, nbytes: int) -> int:
        return self._region.round_up(nbytes)

    def commit(self, nbytes: int) -> list[Chunk]:
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
        pass  # the size is the region's own committed size


def _new_chunks(layout: _Prefix | _Segments, size: Any) -> int:
    """How many chunks ``layout.commit(size)`` would add (pure geometry, no driver call)."""
    region = layout._region
    have = {c.offset for c in region.chunks()}
    want = covering_chunks(layout.ranges(size), region.chunk_bytes, region.capacity_bytes)
    return sum(c.offset not in have for c in want)


class _Segments:
    """A block layout: sizes are block sets (``vmmkv._blockset``: sorted block intervals; the
    prefix of ``n`` blocks is ``((0, n),)``), one bound per segment (``offset_i + top *
    block_i``, ``top`` one past the set's highest block).

    The chunks a set needs are those covering its blocks' bytes in every segment (their union):
    a chunk is released only when it holds no block of the set in any segment, so a hole
    releases the chunks that lie wholly inside the hole in every segment (block-major, one
    segment: the whole chunks inside it) and keeps the others committed; their hole blocks are
    outside the set (never handed out) as the tail beyond a prefix is."""

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
        blocks read zero. Fresh chunks are zero already; new blocks in chunks that stayed
        committed (a segment's tail chunk after a shrink, the edge chunk of a hole, a chunk
        shared with a neighbour) still hold old bytes: they are zeroed first (outside the set,
        so nothing writes there) and synchronized before the agreement lets any peer write
        into them. A grow that then fails leaves them zero. Blocks that stay in the set keep
        their bytes."""
        chunk = self._region.chunk_bytes
        old = {c.offset for c in self._region.chunks()}
        stale = []
        for lo, hi in self.ranges(blockset.difference(blocks, self.set)):
            stale += [
                (max(lo, c), min(hi, c + chunk))
                for c in range(lo - lo % chunk, hi, chunk)
                if c in old
            ]
        if stale:
            whole = self._region.tensor()
            for lo, hi in stale:
                whole[lo:hi].zero_()
            del whole
            self._region.synchronize()
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


# --------------------------------------------------------------------------------------------
# the collective resize
# --------------------------------------------------------------------------------------------


class Resizer:
    """The size of one ``SymmetricRegion``'s region and the protocol that changes it (see the
    module docstring). ``peers``, passed to ``resize``, is the region's ``PeerMap`` (None when
    peers are not mapped)."""

    def __init__(self, comm: StoreComm, region: VirtualRegion, lock: threading.Lock) -> None:
        self._comm = comm
        self.region = region
        self._lock = lock
        self.layout: _Prefix | _Segments = _Prefix(region)
        self.table: torch.Tensor | None = None  # the bound table, made by commit_initial
        self.broken = ""  # why resizes are refused: a failed shrink or rollback left mappings

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def block_layout(self) -> _Segments | None:
        """The block layout, or None while the region is sized by its committed prefix."""
        layout = self.layout
        return layout if isinstance(layout, _Segments) else None

    def bound_for(self, start: int, end: int, what: str) -> torch.Tensor:
        """Local: ``SymmetricRegion.bound_for``."""
        layout = self.block_layout
        if layout is None:
            return self.table
        i = layout.containing(start, end)
        if i is None:
            raise ValueError(
                f"{what}: region bytes [{start}, {end}) lie inside no single segment of the "
                f"block layout ({layout.describe()}); a view must stay inside one segment"
            )
        return self.table[i : i + 1]

    def describe_committed(self) -> str:
        """Local: ``SymmetricRegion.describe_committed``."""
        layout = self.block_layout
        total = self.region.committed_bytes
        if layout is not None:
            n = blockset.as_prefix(layout.set)
            held = f"{n}" if n is not None else f"the block set {_show(layout.set)}"
            return (
                f"with a block layout, {held} of {layout.max_blocks} blocks of each of "
                f"its {len(layout.segments)} segments are committed ({total} bytes in chunks of "
                f"{self.region.chunk_bytes})"
            )
        return f"the committed prefix is {total} of {self.region.capacity_bytes} bytes"

    def commit_initial(self, initial_bytes: int, *, world: int) -> None:
        """Local, before the region's first collective step: check the fd budget (``world``
        ranks exchange fds), commit the initial prefix and make the bound table."""
        region = self.region
        # Every chunk of the capacity may be committed later: refuse now, before anything
        # is committed, a hard open-file limit that could never hold a full grow.
        grid = -(-region.capacity_bytes // region.chunk_bytes)
        self.check_fds("setting up", grid, world=world, keep=False)
        initial = _new_chunks(self.layout, initial_bytes)
        self.check_fds("the initial commit", initial, world=world)
        region.commit(initial_bytes)
        self.table = torch.full(
            (1,), region.committed_bytes, dtype=torch.int64, device=region.device
        )

    def check_fds(self, what: str, chunks: int, *, world: int, keep: bool = True) -> None:
        """Before a step commits or exchanges ``chunks`` chunks (``vmmkv.ipc.fdbudget``): raise
        ``FdBudgetError`` when its exchange rounds and the fds its chunks keep (host backend:
        one memfd each) cannot fit under the hard limit; with ``keep`` (the step commits them now)
        also make room under the soft limit for the fds kept."""
        kept = chunks if self.region.keeps_fds else 0
        fdbudget.exchange_round(
            rank=self.rank, world=world, device=self.region.device, what=what, chunks=chunks,
            kept=kept,
        )  # fmt: skip
        if keep:
            fdbudget.keep_fds(rank=self.rank, device=self.region.device, what=what, count=kept)

    # -- block layout ----------------------------------------------------------------------
    def set_block_layout(self, segments: Any, max_blocks: int, refuse: str) -> None:
        """Collective: ``SymmetricRegion.set_block_layout``."""
        checked: tuple[tuple[int, int], ...] = ()
        table = None
        problem, kind = "", type(None)
        try:
            checked = _check_layout(segments, max_blocks, self.region.capacity_bytes)
        except (TypeError, ValueError) as exc:
            problem, kind = str(exc), type(exc)
        if not problem:
            state = self._layout_refused(refuse)
            if state:
                problem, kind = f"refused: {state}", RuntimeError
        if not problem:
            try:  # local setup before the step that settles the outcome
                table = torch.tensor(
                    [off for off, _ in checked], dtype=torch.int64, device=self.region.device
                )
            except Exception as exc:
                problem, kind = f"creating the bound table failed: {exc!r}", RuntimeError
        with self._lock:
            request = (None if problem else [max_blocks, [list(seg) for seg in checked]], problem)
            reqs = self._gather(request, "block layout")
            self._raise_problems(reqs, problem, kind, "set_block_layout rejected")
            layouts = [layout for layout, _ in reqs]
            if any(layout != layouts[0] for layout in layouts):
                raise ConfigMismatch(
                    f"set_block_layout (rank {self.rank} of {self._comm.world_size}): the layout "
                    f"must be identical on every rank: {_layout_differences(layouts)}"
                )
            self.layout = _Segments(self.region, checked, max_blocks)
            self.table = table

    def _layout_refused(self, refuse: str) -> str:
        if refuse:
            return refuse
        if isinstance(self.layout, _Segments):
            return "a block layout is already set (it is set once)"
        if self.region.committed_bytes:
            return (
                f"{self.region.committed_bytes} bytes are committed; a block layout is set "
                "while nothing is (initial_bytes=0, before any grow)"
            )
        if self.broken:
            return f"unusable after {self.broken}; close it"
        return ""

    # -- collective resize -----------------------------------------------------------------
    def resize(
        self, size: Any, direction: str | None, *, blocks: bool, peers: PeerMap | None
    ) -> int:
        """Collective: ``SymmetricRegion.resize`` (``blocks=False``) or ``resize_blocks``
        (the block set ``[0, size)``; returns its top)."""
        if blocks:
            return blockset.top(self.resize_set(size, direction, peers=peers))
        problem, kind = self._resize_problem(size, direction, blocks)
        with self._lock:
            # A fresh nonce per exchange names its sockets: unpredictable before this step.
            request = (None if problem else size, problem, secrets.token_hex(16))
            reqs = self._gather(request, "resize request")
            self._raise_problems(reqs, problem, kind, "resize rejected")
            sizes = [size for size, _, _ in reqs]
            if any(size != sizes[0] for size in sizes):
                raise RendezvousError(
                    f"resize: the target size ({self.layout.unit}) must be identical on all "
                    "ranks, got " + ", ".join(f"rank {r}: {n}" for r, n in enumerate(sizes))
                )
            layout = self.layout
            current = layout.current()
            if layout.rounded(size) > current:
                self._grow(current, size, reqs[0][2], peers)
            elif layout.rounded(size) < current:
                self._shrink(size, peers)
            return layout.current()

    def resize_set(self, request: Any, direction: str | None, *, peers: PeerMap | None) -> BlockSet:
        """Collective: ``SymmetricRegion.resize_block_set`` (``request`` a block set) or
        ``resize_blocks`` (``request`` an int ``n``: the prefix ``[0, n)``). A change that both
        adds and drops blocks runs as a grow to the union of the old and the new set, then a
        shrink to the new one: each phase keeps its failure rule (a failed grow leaves every
        rank at the old set, a failed shrink leaves ``broken``)."""
        target, problem, kind = self._set_problem(request, direction)
        with self._lock:
            # A fresh nonce per exchange names its sockets: unpredictable before this step.
            shown = request if isinstance(request, int) and not problem else None
            wire = None if problem else [list(iv) for iv in target]
            reqs = self._gather((wire, problem, secrets.token_hex(16), shown), "resize request")
            self._raise_problems(reqs, problem, kind, "resize rejected")
            sets = [tuple(tuple(iv) for iv in req[0]) for req in reqs]
            if any(s != sets[0] for s in sets):
                show = [req[3] if req[3] is not None else req[0] for req in reqs]
                differ = [r for r, s in enumerate(sets) if s != sets[0]]
                raise RendezvousError(
                    "resize: the target block set must be identical on all ranks (ranks "
                    f"{differ} differ from rank 0), got "
                    + ", ".join(f"rank {r}: {n}" for r, n in enumerate(show))
                )
            layout = self.layout
            old = layout.current()
            grown = blockset.union(old, target)
            if grown != old:
                self._grow(old, grown, reqs[0][2], peers)
            if target != grown:
                self._shrink(target, peers)
            return layout.current()

    def _set_problem(self, request: Any, direction: str | None) -> tuple[BlockSet, str, type]:
        """(the canonical target set, '', None) when this rank's block request is valid, else
        ((), reason, exception type)."""
        layout = self.layout
        if not isinstance(layout, _Segments):
            why = "no block layout is set: resize by bytes (resize; ReplicatedKVCache.grow/shrink)"
            return (), why, RuntimeError
        if isinstance(request, int) and not isinstance(request, bool):
            if not 0 <= request <= layout.limit:
                return (), f"blocks={request} outside [0, {layout.limit}]", ValueError
            target = blockset.prefix(request)
            name = f"{request}"
        elif isinstance(request, bool) or not isinstance(request, (tuple, list)):
            what = "blocks must be an int or a block set ((start, end), ...)"
            return (), f"{what}, got {type(request).__name__}", TypeError
        else:
            try:
                target = blockset.block_set(request, layout.limit, "block set")
            except (TypeError, ValueError) as exc:
                return (), str(exc), type(exc)
            name = f"the block set {_show(target)}"
        if direction not in (None, "grow", "shrink"):
            return (), f"direction must be None, 'grow' or 'shrink', got {direction!r}", ValueError
        current = layout.current()
        plain = blockset.as_prefix(current) is not None and blockset.as_prefix(target) is not None
        if direction == "grow" and not blockset.is_subset(current, target):
            lost = "" if plain else f" (it drops {_show(blockset.difference(current, target))})"
            below = f"below the committed {_show_size(current)}{lost}"
            return (), f"grow to {name} is {below}; use shrink", ValueError
        if direction == "shrink" and not blockset.is_subset(target, current):
            gained = "" if plain else f" (it adds {_show(blockset.difference(target, current))})"
            above = f"above the committed {_show_size(current)}{gained}"
            return (), f"shrink to {name} is {above}; use grow", ValueError
        if self.region.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return (), "refused during CUDA stream capture (resize before or after)", RuntimeError
        if self.broken:
            return (), f"unusable after {self.broken}; close it", RuntimeError
        return target, "", type(None)

    def _gather(self, request: Any, what: str) -> list[Any]:
        try:
            return self._comm.all_gather(request, what)
        except GroupError as exc:
            raise as_rendezvous_error(exc) from None

    def _raise_problems(self, reqs: list[Any], problem: str, kind: type, what: str) -> None:
        """Every rank raises when any request carries a problem: this rank's own with ``kind``,
        the others' as RendezvousError naming them."""
        problems = {r: req[1] for r, req in enumerate(reqs) if req[1]}
        if problems:
            msg = f"{what}: " + "; ".join(f"rank {r}: {p}" for r, p in problems.items())
            raise (kind if problem else RendezvousError)(msg)

    def _resize_problem(self, size: Any, direction: str | None, blocks: bool) -> tuple[str, type]:
        """('', None) when this rank's resize request is valid, else (reason, exception type)."""
        layout = self.layout
        name = "blocks" if blocks else "committed_bytes"
        if blocks != isinstance(layout, _Segments):
            why = (
                "no block layout is set: resize by bytes (resize; ReplicatedKVCache.grow/shrink)"
                if blocks
                else "a block layout is set: resize by blocks (resize_blocks; "
                "ReplicatedKVCache.grow_blocks/shrink_blocks), not by a byte prefix"
            )
            return why, RuntimeError
        if isinstance(size, bool) or not isinstance(size, int):
            return f"{name} must be an int, got {type(size).__name__}", TypeError
        if not 0 <= size <= layout.limit:
            return f"{name}={size} outside [0, {layout.limit}]", ValueError
        if direction not in (None, "grow", "shrink"):
            return f"direction must be None, 'grow' or 'shrink', got {direction!r}", ValueError
        current = layout.current()
        if direction == "grow" and size < current:
            return f"grow to {size} is below the committed {current}; use shrink", ValueError
        if direction == "shrink" and size > current:
            return f"shrink to {size} is above the committed {current}; use grow", ValueError
        if self.region.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return "refused during CUDA stream capture (resize before or after)", RuntimeError
        if self.broken:
            return f"unusable after {self.broken}; close it", RuntimeError
        return "", type(None)

    def _grow(self, current: Any, size: Any, nonce: str, peers: PeerMap | None) -> None:
        layout = self.layout
        what = f"grow to {_size_words(size, layout.unit)}"
        deadline = time.monotonic() + self._comm.timeout
        added: list[Chunk] = []
        error: Exception | None = None
        bounds = None
        doing = "building the new bounds"
        try:
            # The new bounds are built before the agreement: after it, nothing that can fail
            # on one rank alone may stand between the agreement and the bounds' device write.
            bounds = self._bounds_tensor(layout, size)
            world = 1 if peers is None or peers.by_value else self._comm.world_size
            doing = "the open-file check"
            self.check_fds(what, _new_chunks(layout, size), world=world)
            doing = "the local commit"
            added = layout.commit(size)
        except Exception as exc:
            error = RendezvousError(
                f"rank {self._comm.rank} ({self.region.device}): {what}: {doing} failed: {exc!r}"
            )
            error.__cause__ = exc
        try:
            if peers is None:
                self._comm.agree(error, f"{what} (local commit)")
            else:
                exchange_then_agree(
                    self._comm,
                    f"{what} (peer mapping)",
                    lambda err: peers.exchange_new(added, nonce, err, deadline),
                    error,
                    deadline,
                    finish=lambda: peers.finish_exchange(nonce),
                )
        except GroupError as exc:
            self._release_local(current, peers)
            raise as_rendezvous_error(exc) from error
        self._set_bounds(layout, size, bounds)

    def _release_local(self, current: Any, peers: PeerMap | None) -> None:
        """Roll a failed grow back to ``current``: peers' new chunks first, then our own. Errors
        are logged, not raised: the grow's own error is the one the caller raises."""
        layout = self.layout
        steps = [lambda: layout.decommit(current)]
        if peers is not None:
            steps.insert(0, lambda: layout.unmap_peers(peers, current))
        try:
            run_all(steps)
        except Exception as exc:
            # Chunks that stayed mapped stay on the books, but the next grow would find them
            # in its way: refuse further resizes, as after a failed shrink.
            self.broken = f"a failed grow rollback ({exc})"
            log.error("rank %d: rolling back a failed grow: %s", self.rank, exc)

    def _shrink(self, size: Any, peers: PeerMap | None) -> None:
        # Kernels stop writing past the new bounds from here on. If anything below fails, the
        # bounds stay lowered (writes beyond them are skipped and counted, never faulting) and
        # the object refuses further resizes: some ranks may have unmapped their peers' chunks.
        layout = self.layout
        self._set_bounds(layout, size)
        try:
            self.region.synchronize()
            self._comm.barrier("shrink: all ranks idle")
            error = None
            try:
                if peers is not None:
                    layout.unmap_peers(peers, size)
            except Exception as exc:
                error = exc
            self._comm.agree(error, "shrink: peers unmapped")
            layout.decommit(size)
        except BaseException as exc:
            self.broken = f"a failed shrink to {_size_words(size, layout.unit)} ({exc})"
            if isinstance(exc, GroupError):
                raise as_rendezvous_error(exc) from exc
            raise

    @staticmethod
    def _bounds_tensor(layout: _Prefix | _Segments, size: Any) -> torch.Tensor:
        return torch.tensor(layout.bounds(size), dtype=torch.int64)

    def _set_bounds(
        self, layout: _Prefix | _Segments, size: Any, bounds: torch.Tensor | None = None
    ) -> None:
        """Every element of the bound table in one device write, then a synchronize."""
        if bounds is None:
            bounds = self._bounds_tensor(layout, size)
        self.table.copy_(bounds)
        layout.moved(size)
        if self.region.device.type == "cuda":
            torch.cuda.synchronize(self.region.device)
