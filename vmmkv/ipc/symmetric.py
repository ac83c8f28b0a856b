"""``SymmetricRegion``: every rank's ``VirtualRegion`` of one capacity, mapped by every other
rank, resized collectively.

Contract:
- Collective (every rank of the group, same order of calls): the constructor, ``resize``,
  ``set_block_layout``, ``resize_blocks``, ``agree``, ``host_barrier``. Each ends with one outcome on every rank (``vmmkv.ipc.comm``):
  all ranks succeed, or all raise. Local: ``close`` (idempotent; a peer may be dead), views and
  properties.
- ``peers`` selects peer mapping: ``"require"`` maps every peer or raises on every rank
  (:class:`DirectUnsupported` when impossible); ``"auto"`` tries, and on any failure that is not
  the caller's (mapping impossible, an fd exchange or a mapping failed, ranks in different PID
  namespaces) every rank falls back together to an unmapped region, ``why_not_mapped`` saying
  why (identical on every rank); ``"off"`` never maps. Timeouts (a rank missing) and
  configuration mismatches (:class:`ConfigMismatch`) always raise.
- ``handle_type``: how chunks are shared. One collective step before the region exists (two
  on CUDA across hosts with ``"auto"``) compares every rank's request: ranks that ask for
  different types raise the same :class:`ConfigMismatch`. ``"auto"`` (default): by value (``"fabric"`` on CUDA when every
  rank's fabric probe passes, ``"shm_name"``, the simulation, on the host backend) when the
  ranks run on several hosts of one NVLink domain and every rank sets ``VMMKV_FABRIC=1`` (an
  opt-in until fabric memory has run on real hardware), else ``"posix_fd"``; ranks of several NVLink
  domains (or several hosts without fabric) fall back to gather (``peers="auto"``) or raise
  :class:`DirectUnsupported` (``"require"``), naming the domains and their ranks.
- ``must_match``: per-rank settings of the caller that must be equal on every rank; gathered
  with the first request, a mismatch raises the same error on every rank.
- The constructor's arguments (capacity, chunk size, initial size, backend, device) are
  checked before any driver call or collective step; a bad one still travels in the first
  request, so every rank raises at once: the rank that passed it
  :class:`RendezvousValueError`/:class:`RendezvousTypeError` (also a ValueError/TypeError, as
  ``resize`` raises them), the others :class:`RendezvousError` naming it.
- ``view(rank)`` is the committed prefix of ``rank``'s region (ValueError when nothing is
  committed or with a block layout); ``view(rank, reserve=True)`` the whole capacity, of which
  only committed chunks may be touched. ``region.tensor()`` (the ``VirtualRegion``) is always
  the whole capacity (address space, see ``vmmkv.alloc.region``).
- Two ways to size the region, one protocol (docs/design.md, "Resize protocol"):
  - prefix (the default): ``resize(committed_bytes)`` grows or shrinks every rank's committed
    prefix; ``committed_table`` (device int64 ``[1]``) holds the committed size (chunk-rounded).
  - block layout: ``set_block_layout(segments, max_blocks)`` (collective, once, while nothing is
    committed) declares segments ``(offset_bytes, block_bytes)``, segment ``i`` spanning
    ``[offset_i, offset_i + max_blocks * block_bytes_i)``; then ``resize_blocks(n)`` commits
    (or decommits) on every rank the chunks covering ``[offset_i, offset_i + n *
    block_bytes_i)`` of every segment (a chunk two segments share stays while either needs
    it), and peers map exactly the same chunks. ``committed_table`` becomes device int64
    ``[len(segments)]`` holding ``offset_i + n * block_bytes_i`` (exact, not chunk-rounded);
    ``bound_for(start, end)`` is the 1-element view of it for a view inside one segment.
    ``resize`` refuses on a region with a block layout and ``resize_blocks`` on one without,
    on every rank.
  Kernels read ``committed_table`` as their bound on every launch, so growth after CUDA-graph
  capture needs no new arguments; every resize updates all its elements in one device write.
- ``resize``/``resize_blocks`` are refused during CUDA stream capture on the calling thread (a
  capture running on another thread cannot be seen: do not resize while another thread
  captures). A failed grow leaves every rank at the old size (bytes or blocks) and the group
  usable; a failed shrink leaves the bound lowered and the object refusing further resizes
  (some ranks may have unmapped their peers' chunks).

Ownership: a ``SymmetricRegion`` owns its ``VirtualRegion`` and its ``PeerMap``; ``close`` unmaps
peers' memory first, then releases the own region.
"""

from __future__ import annotations

import bisect
import logging
import secrets
import threading
import time
from typing import Any

import torch

from .._util import require_int, run_all
from ..alloc import Chunk, VirtualRegion
from ..alloc.region import _resolve_device, check_device, covering_chunks
from . import fdbudget
from .comm import GroupError, PeerTimeoutError, StoreComm
from .errors import ConfigMismatch, RendezvousError, as_rendezvous_error
from .peers import BY_VALUE_HANDLES, PeerMap, exchange_then_agree, gather_requests, map_peers
from .placement import choose_handle_type

__all__ = ["PEER_MODES", "RendezvousTypeError", "RendezvousValueError", "SymmetricRegion"]

log = logging.getLogger(__name__)

PEER_MODES = ("require", "auto", "off")


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


def _new_chunks(layout: _Prefix | _Segments, size: int) -> int:
    """How many chunks ``layout.commit(size)`` would add (pure geometry, no driver call)."""
    region = layout._region
    have = {c.offset for c in region.chunks()}
    want = covering_chunks(layout.ranges(size), region.chunk_bytes, region.capacity_bytes)
    return sum(c.offset not in have for c in want)


class _Segments:
    """A block layout: sizes in blocks, one bound per segment (``offset_i + n * block_i``)."""

    unit = "blocks"

    def __init__(
        self, region: VirtualRegion, segments: tuple[tuple[int, int], ...], max_blocks: int
    ) -> None:
        self._region = region
        self.segments = segments
        self.max_blocks = self.limit = max_blocks
        self.blocks = 0
        self._by_start = sorted(
            (off, off + max_blocks * block, i) for i, (off, block) in enumerate(segments)
        )

    def current(self) -> int:
        return self.blocks

    def rounded(self, blocks: int) -> int:
        return blocks

    def ranges(self, blocks: int) -> list[tuple[int, int]]:
        return [(off, off + blocks * block) for off, block in self.segments]

    def commit(self, blocks: int) -> list[Chunk]:
        """Commit the chunks of ``blocks`` blocks per segment; the new blocks read zero. Fresh
        chunks are zero already; new blocks in chunks that stayed committed (a segment's tail
        chunk after a shrink, a chunk shared with a neighbour) still hold old bytes: they are
        zeroed first (beyond every bound, so nothing writes there) and synchronized before the
        agreement lets any peer write into them. A grow that then fails leaves them zero."""
        chunk = self._region.chunk_bytes
        old = {c.offset for c in self._region.chunks()}
        stale = []
        for off, block in self.segments:
            lo, hi = off + self.blocks * block, off + blocks * block
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

    def decommit(self, blocks: int) -> None:
        self._region.decommit_outside(self.ranges(blocks))

    def unmap_peers(self, peers: PeerMap, blocks: int) -> None:
        peers.unmap_peers_outside(self.ranges(blocks))

    def bounds(self, blocks: int) -> list[int]:
        return [off + blocks * block for off, block in self.segments]

    def moved(self, blocks: int) -> None:
        self.blocks = blocks

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


class RendezvousValueError(RendezvousError, ValueError):
    """A caller's bad argument (a value) found in a collective setup: raised on the rank that
    passed it, while the others raise :class:`RendezvousError` naming it. A ValueError, so
    ``except ValueError`` catches it as it catches the same mistake in ``resize``."""


class RendezvousTypeError(RendezvousError, TypeError):
    """As :class:`RendezvousValueError`, for an argument of the wrong type."""


def _check_region_args(
    capacity_bytes: Any, device: Any, chunk_bytes: Any, initial_bytes: Any, backend: Any
) -> None:
    """The constructor's arguments, without a driver call: TypeError/ValueError naming the
    argument, the value got and what was expected (the granularity is checked later, by the
    region, since it needs the device)."""
    require_int("capacity_bytes", capacity_bytes, lo=1)
    if chunk_bytes is not None:
        require_int("chunk_bytes", chunk_bytes, lo=1)
        if chunk_bytes > capacity_bytes:
            raise ValueError(f"chunk_bytes={chunk_bytes} exceeds capacity_bytes={capacity_bytes}")
    require_int("initial_bytes", initial_bytes, lo=0, hi=capacity_bytes)
    check_device(device, backend)


def _raise_setup_error(
    exc: RendezvousError, error: BaseException | None, rank: int, device: Any, backend: Any
) -> None:
    """Raise the failed setup ``exc`` (every rank raises it): on the rank whose own argument
    was bad (``error`` a TypeError/ValueError), as that class, its own message first."""
    if isinstance(error, (TypeError, ValueError)) and not isinstance(exc, ConfigMismatch):
        kind = RendezvousTypeError if isinstance(error, TypeError) else RendezvousValueError
        raise kind(
            f"{error} (rank {rank}, device={device!r}, backend={backend!r}: creating the region "
            f"failed, and every rank of the group raises: {exc})"
        ) from error
    raise exc


class SymmetricRegion:
    """See the module docstring."""

    def __init__(
        self,
        capacity_bytes: int,
        device: Any = None,
        group: Any = None,
        *,
        chunk_bytes: int | None = None,
        initial_bytes: int = 0,
        backend: str = "auto",
        timeout: float = 60.0,
        peers: str = "require",
        must_match: dict[str, Any] | None = None,
        handle_type: str = "auto",
    ) -> None:
        if peers not in PEER_MODES:
            raise ValueError(f"peers must be one of {PEER_MODES}, got {peers!r}")
        if handle_type not in ("auto", "posix_fd", "fabric", "shm_name"):
            raise ValueError(
                "handle_type must be 'auto', 'posix_fd', 'fabric' or 'shm_name', got "
                f"{handle_type!r}"
            )
        # The caller's arguments, checked before any driver call or collective step. A bad one
        # still travels in the first request (the peers fail at once, naming this rank), and
        # this rank then raises it as the argument's own class (see _raise_setup_error).
        arg_error: Exception | None = None
        try:
            _check_region_args(capacity_bytes, device, chunk_bytes, initial_bytes, backend)
        except (TypeError, ValueError) as exc:
            arg_error = exc
        self._comm = StoreComm(group, timeout)
        # Collective on every rank whatever it asked for, before the region exists (its chunks
        # are created for one handle type): ranks asking for different types get one
        # ConfigMismatch; "auto" is by value for several hosts of one NVLink domain, else fds
        # (see choose_handle_type).
        be, ordinal = "unknown", None
        if handle_type == "auto" and arg_error is None:
            try:
                be, ordinal = _resolve_device(device, backend)
            except Exception:  # the region's creation below reports it, in the request
                pass
        handle_type = choose_handle_type(self._comm, be, ordinal, handle_type)
        self._closed = False
        self._broken = ""  # set when a failed shrink left the mappings inconsistent
        self._lock = threading.Lock()
        self.peers: PeerMap | None = None
        self.why_not_mapped = "peer mapping off" if peers == "off" else ""
        # The region is created after the StoreComm so that every rank runs the same steps
        # whatever fails locally: a local error travels in the first request.
        self.region: VirtualRegion | None = None
        error: BaseException | None = arg_error
        try:
            if arg_error is not None:
                raise arg_error
            self.region = VirtualRegion(
                capacity_bytes, device, chunk_bytes=chunk_bytes, backend=backend,
                handle_type=handle_type,
            )  # fmt: skip
            self._layout: _Prefix | _Segments = _Prefix(self.region)
            # Every chunk of the capacity may be committed later: refuse now, before anything
            # is committed, a hard open-file limit that could never hold a full grow.
            grid = -(-self.region.capacity_bytes // self.region.chunk_bytes)
            fd_world = 1 if peers == "off" or handle_type in BY_VALUE_HANDLES else self.world_size
            self._check_fds("setting up", grid, world=fd_world, keep=False)
            initial = _new_chunks(self._layout, initial_bytes)
            self._check_fds("the initial commit", initial, world=fd_world)
            self.region.commit(initial_bytes)
            # Local device tables before the last agreement (nothing local happens after it).
            self.local_table = torch.tensor(
                [self.region.base_ptr], dtype=torch.int64, device=self.region.device
            )
            self.committed_table = torch.full(
                (1,), self.region.committed_bytes, dtype=torch.int64, device=self.region.device
            )
        except Exception as exc:
            error = exc
        try:
            match = {"peers": peers, **(must_match or {})}
            try:
                reqs = gather_requests(self._comm, self.region, match, error)  # type: ignore[arg-type]
            except RendezvousError as exc:
                _raise_setup_error(exc, error, self.rank, device, backend)
            if peers != "off":
                self.peers = self._map(reqs, peers)
        except BaseException:
            if self.region is not None:
                self.region.close()
            raise

    def _check_fds(self, what: str, chunks: int, *, world: int, keep: bool = True) -> None:
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

    def _map(self, reqs: list[dict[str, Any]], mode: str) -> PeerMap | None:
        try:
            return map_peers(self._comm, self.region, reqs)
        except (PeerTimeoutError, ConfigMismatch):
            raise
        except RendezvousError as exc:
            if mode == "require":
                raise
            self.why_not_mapped = str(exc)
            return None

    # -- properties ------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def world_size(self) -> int:
        return self._comm.world_size

    @property
    def group(self) -> Any:
        return self._comm.group

    @property
    def timeout(self) -> float:
        return self._comm.timeout

    @property
    def device(self) -> torch.device:
        return self.region.device

    @property
    def backend(self) -> str:
        return self.region.backend

    @property
    def base_ptr(self) -> int:
        return self.region.base_ptr

    @property
    def chunk_bytes(self) -> int:
        return self.region.chunk_bytes

    @property
    def committed_bytes(self) -> int:
        return self.region.committed_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.region.capacity_bytes

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def mapped(self) -> bool:
        """True when every peer's region is mapped here (``peers`` is a PeerMap)."""
        return self.peers is not None

    @property
    def ptr_table(self) -> torch.Tensor:
        """Device int64 ``[world]`` of every rank's base here (needs ``mapped``)."""
        return self._peer_map().ptr_table

    def _peer_map(self) -> PeerMap:
        if self.peers is None:
            raise RuntimeError(
                f"rank {self.rank}: peers are not mapped ({self.why_not_mapped or 'peers=off'})"
            )
        return self.peers

    def view(
        self, rank: int, dtype: torch.dtype = torch.uint8, *, reserve: bool = False
    ) -> torch.Tensor:
        """Local: 1-D view of ``rank``'s region as mapped here (this rank's own region for
        ``rank == self.rank``; a peer's needs ``mapped``), from its base.

        By default the view holds the committed prefix only (``[0, committed_bytes)``, taken at
        this call: a later grow does not lengthen it), so every byte of it may be touched;
        ValueError when nothing is committed, and with a block layout (whose committed memory
        is not a prefix). ``reserve=True``: the whole capacity, committed or not (address space
        for kernels and CUDA graphs built before growth); only committed chunks may be touched
        through it (an uncommitted byte kills the process: SIGSEGV on the host backend, an
        illegal address on CUDA)."""
        if not isinstance(reserve, bool):
            raise TypeError(f"view: reserve must be True or False, got {reserve!r}")
        if not reserve:
            prefix = self._committed_prefix(f"view({rank})")
        whole = (
            self.region.tensor(dtype) if rank == self.rank else self._peer_map().view(rank, dtype)
        )
        if reserve:
            return whole
        return whole[: prefix // whole.element_size()]

    def _committed_prefix(self, what: str) -> int:
        """The committed prefix's size in bytes (> 0), or ValueError naming ``what``."""
        self._check_open()
        if isinstance(self._layout, _Segments):
            raise ValueError(
                f"rank {self.rank} ({self.device}): {what}: the region has a block layout, so "
                f"its committed memory is not a prefix ({self.describe_committed()}); pass "
                "reserve=True for the whole capacity and touch only committed blocks"
            )
        committed = self.region.committed_bytes
        if committed == 0:
            raise ValueError(
                f"rank {self.rank} ({self.device}): {what}: nothing is committed; commit first "
                f"({self.how_to_commit()}), or pass reserve=True for a view over address space "
                "whose committed parts alone may be touched"
            )
        return committed

    def is_committed(self, start: int, end: int) -> bool:
        """Local: whether every byte of ``[start, end)`` (region offsets) lies in a committed
        chunk of this rank's region (peers commit the same chunks)."""
        self._check_open()
        if end <= start:
            return True
        have = set(self.region.chunks())
        return all(c in have for c in self.region.chunks_covering([(start, end)]))

    def describe_committed(self) -> str:
        """What is committed, in words (for error messages)."""
        layout = self._layout
        total = self.region.committed_bytes
        if isinstance(layout, _Segments):
            return (
                f"with a block layout, {layout.blocks} of {layout.max_blocks} blocks of each of "
                f"its {len(layout.segments)} segments are committed ({total} bytes in chunks of "
                f"{self.chunk_bytes})"
            )
        return f"the committed prefix is {total} of {self.capacity_bytes} bytes"

    def how_to_commit(self) -> str:
        """The calls that commit memory here, in words (for error messages)."""
        if isinstance(self._layout, _Segments):
            return "grow_blocks(n) with the block layout"
        return "grow(nbytes), or initial_bytes= at construction"

    # -- collective helpers for the layers above -------------------------------------------
    def agree(self, error: BaseException | None, what: str) -> None:
        """Collective: raises the same :class:`GroupError` on every rank if any rank passes
        an error (e.g. the cache's local setup after construction)."""
        self._check_open()
        self._comm.agree(error, what)

    def host_barrier(self, what: str = "host barrier") -> None:
        """Collective host barrier bounded by this object's timeout (not the group's)."""
        self._check_open()
        self._comm.barrier(what)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: SymmetricRegion is closed")

    # -- block layout ----------------------------------------------------------------------
    @property
    def segments(self) -> tuple[tuple[int, int], ...] | None:
        """The block layout's ``(offset_bytes, block_bytes)`` segments, or None (prefix)."""
        layout = self._layout
        return layout.segments if isinstance(layout, _Segments) else None

    @property
    def max_blocks(self) -> int | None:
        layout = self._layout
        return layout.max_blocks if isinstance(layout, _Segments) else None

    @property
    def committed_blocks(self) -> int | None:
        """Blocks every segment holds (the kernels' bound), or None without a block layout."""
        layout = self._layout
        return layout.blocks if isinstance(layout, _Segments) else None

    def set_block_layout(self, segments: Any, max_blocks: int, *, refuse: str = "") -> None:
        """Collective: from now on the region is sized by blocks (see the module docstring).

        Every rank validates its layout (ints, ``block_bytes > 0``, ``max_blocks > 0``, every
        segment inside the capacity, no two overlapping, in any order) and its state (no layout
        yet, nothing committed, ``refuse`` empty: the caller's own reason to refuse, e.g. views
        already bound) before anything else, then the requests are gathered: a bad request
        raises on every rank (the offending rank TypeError/ValueError/RuntimeError, the others
        :class:`RendezvousError` naming it), and layouts that differ raise
        :class:`ConfigMismatch` on every rank naming the ranks. On success ``committed_table``
        is replaced by a table of ``len(segments)`` bounds (``offset_i``: zero blocks)."""
        self._check_open()
        checked: tuple[tuple[int, int], ...] = ()
        table = None
        problem, kind = "", type(None)
        try:
            checked = _check_layout(segments, max_blocks, self.capacity_bytes)
        except (TypeError, ValueError) as exc:
            problem, kind = str(exc), type(exc)
        if not problem:
            state = self._layout_refused(refuse)
            if state:
                problem, kind = f"refused: {state}", RuntimeError
        if not problem:
            try:  # local setup before the step that settles the outcome
                table = torch.tensor(
                    [off for off, _ in checked], dtype=torch.int64, device=self.device
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
                    f"set_block_layout (rank {self.rank} of {self.world_size}): the layout must "
                    f"be identical on every rank: {_layout_differences(layouts)}"
                )
            self._layout = _Segments(self.region, checked, max_blocks)
            self.committed_table = table

    def _layout_refused(self, refuse: str) -> str:
        if refuse:
            return refuse
        if isinstance(self._layout, _Segments):
            return "a block layout is already set (it is set once)"
        if self.region.committed_bytes:
            return (
                f"{self.region.committed_bytes} bytes are committed; a block layout is set "
                "while nothing is (initial_bytes=0, before any grow)"
            )
        if self._broken:
            return f"unusable after {self._broken}; close it"
        return ""

    def bound_for(self, start: int, end: int, what: str = "view") -> torch.Tensor:
        """The device int64 tensor of 1 element that bounds the region bytes ``[start, end)``:
        ``committed_table`` itself without a block layout, else the element of the one segment
        that contains them (a view of the table, updated in place by every resize). Raises
        ValueError naming ``what`` and the segments when no single segment contains them."""
        self._check_open()
        layout = self._layout
        if not isinstance(layout, _Segments):
            return self.committed_table
        i = layout.containing(start, end)
        if i is None:
            raise ValueError(
                f"{what}: region bytes [{start}, {end}) lie inside no single segment of the "
                f"block layout ({layout.describe()}); a view must stay inside one segment"
            )
        return self.committed_table[i : i + 1]

    # -- collective resize -----------------------------------------------------------------
    def resize(self, committed_bytes: int, *, direction: str | None = None) -> int:
        """Collective: grow or shrink every rank's committed prefix to ``committed_bytes``
        (rounded up to chunks). Returns the new committed size.

        Every rank's request (and whatever is wrong with it: type, range, a stream capture in
        progress, a ``direction`` of ``"grow"``/``"shrink"`` that the size contradicts, a block
        layout being set) is gathered first, so a bad request raises on every rank: the
        offending rank raises TypeError/ValueError/RuntimeError, the others RendezvousError
        naming it. A failed grow leaves every rank at the old size and the group usable."""
        return self._resize(committed_bytes, direction, blocks=False)

    def resize_blocks(self, blocks: int, *, direction: str | None = None) -> int:
        """Collective: grow or shrink every segment of the block layout to ``blocks`` blocks
        (the chunks covering ``[offset_i, offset_i + blocks * block_bytes_i)``; see the module
        docstring). Returns the new block count. Same protocol and failure rules as
        ``resize``; refused (on every rank) when no block layout is set."""
        return self._resize(blocks, direction, blocks=True)

    def _resize(self, size: Any, direction: str | None, *, blocks: bool) -> int:
        self._check_open()
        problem, kind = self._resize_problem(size, direction, blocks)
        with self._lock:
            # A fresh nonce per exchange names its sockets: unpredictable before this step.
            request = (None if problem else size, problem, secrets.token_hex(16))
            reqs = self._gather(request, "resize request")
            self._raise_problems(reqs, problem, kind, "resize rejected")
            sizes = [size for size, _, _ in reqs]
            if any(size != sizes[0] for size in sizes):
                raise RendezvousError(
                    f"resize: the target size ({self._layout.unit}) must be identical on all "
                    "ranks, got " + ", ".join(f"rank {r}: {n}" for r, n in enumerate(sizes))
                )
            layout = self._layout
            current = layout.current()
            if layout.rounded(size) > current:
                self._grow(current, size, reqs[0][2])
            elif layout.rounded(size) < current:
                self._shrink(size)
            return layout.current()

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
        layout = self._layout
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
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return "refused during CUDA stream capture (resize before or after)", RuntimeError
        if self._broken:
            return f"unusable after {self._broken}; close it", RuntimeError
        return "", type(None)

    def _grow(self, current: int, size: int, nonce: str) -> None:
        layout = self._layout
        what = f"grow to {size} {layout.unit}"
        deadline = time.monotonic() + self.timeout
        added: list[Chunk] = []
        error: Exception | None = None
        bounds = None
        try:
            # The new bounds are built before the agreement: after it, nothing that can fail
            # on one rank alone may stand between the agreement and the bounds' device write.
            bounds = self._bounds_tensor(layout, size)
            world = 1 if self.peers is None or self.peers.by_value else self.world_size
            self._check_fds(what, _new_chunks(layout, size), world=world)
            added = layout.commit(size)
        except Exception as exc:
            error = exc
        try:
            if self.peers is None:
                self._comm.agree(error, f"{what} (local commit)")
            else:
                peers = self.peers
                exchange_then_agree(
                    self._comm,
                    f"{what} (peer mapping)",
                    lambda err: peers.exchange_new(added, nonce, err, deadline),
                    error,
                    deadline,
                    finish=lambda: peers.finish_exchange(nonce),
                )
        except GroupError as exc:
            self._release_local(current)
            raise as_rendezvous_error(exc) from error
        self._set_bounds(layout, size, bounds)

    def _release_local(self, current: int) -> None:
        """Roll a failed grow back to ``current``: peers' new chunks first, then our own. Errors
        are logged, not raised: the grow's own error is the one the caller raises."""
        layout = self._layout
        steps = [lambda: layout.decommit(current)]
        if self.peers is not None:
            peers = self.peers
            steps.insert(0, lambda: layout.unmap_peers(peers, current))
        try:
            run_all(steps)
        except Exception as exc:
            # Chunks that stayed mapped stay on the books, but the next grow would find them
            # in its way: refuse further resizes, as after a failed shrink.
            self._broken = f"a failed grow rollback ({exc})"
            log.error("rank %d: rolling back a failed grow: %s", self.rank, exc)

    def _shrink(self, size: int) -> None:
        # Kernels stop writing past the new bounds from here on. If anything below fails, the
        # bounds stay lowered (writes beyond them are skipped and counted, never faulting) and
        # the object refuses further resizes: some ranks may have unmapped their peers' chunks.
        layout = self._layout
        self._set_bounds(layout, size)
        try:
            self.region.synchronize()
            self._comm.barrier("shrink: all ranks idle")
            error = None
            try:
                if self.peers is not None:
                    layout.unmap_peers(self.peers, size)
            except Exception as exc:
                error = exc
            self._comm.agree(error, "shrink: peers unmapped")
            layout.decommit(size)
        except BaseException as exc:
            self._broken = f"a failed shrink to {layout.rounded(size)} {layout.unit} ({exc})"
            if isinstance(exc, GroupError):
                raise as_rendezvous_error(exc) from exc
            raise

    @staticmethod
    def _bounds_tensor(layout: _Prefix | _Segments, size: int) -> torch.Tensor:
        return torch.tensor(layout.bounds(size), dtype=torch.int64)

    def _set_bounds(
        self, layout: _Prefix | _Segments, size: int, bounds: torch.Tensor | None = None
    ) -> None:
        """Every element of ``committed_table`` in one device write, then a synchronize."""
        if bounds is None:
            bounds = self._bounds_tensor(layout, size)
        self.committed_table.copy_(bounds)
        layout.moved(size)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        """Local and idempotent: peers' mappings go first, then the own region."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        run_all([self.peers.close if self.peers else lambda: None, self.region.close])

    def __enter__(self) -> SymmetricRegion:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
