"""``SymmetricRegion``: every rank's ``VirtualRegion`` of one capacity, mapped by every other
rank, resized collectively.

Contract:
- Collective (every rank of the group, same order of calls): the constructor, ``resize``,
  ``set_block_layout``, ``resize_blocks``, ``resize_block_set``, ``agree``, ``host_barrier``. Each ends with one outcome on every rank (``vmmkv.ipc.comm``):
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
- Memory comes in runs (``run_bytes``, ``vmmkv.alloc.region``): a grow creates, exchanges
  (one handle each) and maps one allocation per stretch of new chunks of each range; a run
  stays whole while the size needs a byte of it, on every rank and in every peer mapping.
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
  - block sets (holes): ``resize_block_set(intervals)`` commits exactly the chunks covering
    the blocks of a set of ``(start, end)`` block intervals in some segment (``resize_blocks(n)``
    is the set ``((0, n),)``); a hole releases the chunks no block of the set needs in any
    segment. ``committed_block_set`` is the set, ``committed_blocks`` its top, and every
    element of ``committed_table`` is ``offset_i + top * block_bytes_i``: the kernels do not
    see holes below the top, so the caller never hands out a block outside the set.
  Kernels read ``committed_table`` as their bound on every launch, so growth after CUDA-graph
  capture needs no new arguments; every resize updates all its elements in one device write.
- ``resize``/``resize_blocks`` are refused during CUDA stream capture on the calling thread (a
  capture running on another thread cannot be seen: do not resize while another thread
  captures). A failed grow leaves every rank at the old size (bytes or blocks) and the group
  usable; a failed shrink leaves the bound lowered and the object refusing further resizes
  (some ranks may have unmapped their peers' chunks).

Ownership: a ``SymmetricRegion`` owns its ``VirtualRegion`` and its ``PeerMap``; ``close`` unmaps
peers' memory first, then releases the own region. The sizing (the layout, ``committed_table``,
the resize protocol and its fd budget) lives in a ``Resizer`` (``vmmkv.ipc.resize``) that the
region composes: it borrows the region, the group's ``StoreComm``, the lock and the ``PeerMap``,
and closes none of them.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .._util import delegate, delegates, require_int, run_all
from ..alloc import VirtualRegion
from ..alloc.region import _resolve_device, check_device
from .comm import PeerTimeoutError, StoreComm
from .errors import ConfigMismatch, RendezvousError
from .peers import BY_VALUE_HANDLES, PeerMap, gather_requests, map_peers
from .placement import choose_handle_type
from .resize import Resizer

__all__ = ["PEER_MODES", "RendezvousTypeError", "RendezvousValueError", "SymmetricRegion"]

PEER_MODES = ("require", "auto", "off")


class RendezvousValueError(RendezvousError, ValueError):
    """A caller's bad argument (a value) found in a collective setup: raised on the rank that
    passed it, while the others raise :class:`RendezvousError` naming it. A ValueError, so
    ``except ValueError`` catches it as it catches the same mistake in ``resize``."""


class RendezvousTypeError(RendezvousError, TypeError):
    """As :class:`RendezvousValueError`, for an argument of the wrong type."""


def _check_region_args(
    capacity_bytes: Any,
    device: Any,
    chunk_bytes: Any,
    run_bytes: Any,
    initial_bytes: Any,
    backend: Any,
) -> None:
    """The constructor's arguments, without a driver call: TypeError/ValueError naming the
    argument, the value got and what was expected (the granularity is checked later, by the
    region, since it needs the device)."""
    require_int("capacity_bytes", capacity_bytes, lo=1)
    if chunk_bytes is not None:
        require_int("chunk_bytes", chunk_bytes, lo=1)
        if chunk_bytes > capacity_bytes:
            raise ValueError(f"chunk_bytes={chunk_bytes} exceeds capacity_bytes={capacity_bytes}")
    if run_bytes is not None:
        require_int("run_bytes", run_bytes, lo=1)
        if chunk_bytes is not None and run_bytes % chunk_bytes:
            raise ValueError(
                f"run_bytes={run_bytes} is not a multiple of chunk_bytes={chunk_bytes}"
            )
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
        run_bytes: int | None = None,
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
            _check_region_args(
                capacity_bytes, device, chunk_bytes, run_bytes, initial_bytes, backend
            )
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
                capacity_bytes, device, chunk_bytes=chunk_bytes, run_bytes=run_bytes,
                backend=backend, handle_type=handle_type,
            )  # fmt: skip
            self._resizer = Resizer(self._comm, self.region, self._lock)
            fd_world = 1 if peers == "off" or handle_type in BY_VALUE_HANDLES else self.world_size
            # The initial commit and the bound table, then the local table: every local step
            # comes before the last agreement (nothing local happens after it).
            self._resizer.commit_initial(initial_bytes, world=fd_world)
            self.local_table = torch.tensor(
                [self.region.base_ptr], dtype=torch.int64, device=self.region.device
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

    # -- properties: the communicator's and the own region's, passed through ----------------
    rank, world_size, group, timeout = delegates("_comm", "rank", "world_size", "group", "timeout")
    device, backend, base_ptr, chunk_bytes, run_bytes, capacity_bytes = delegates(
        "region", "device", "backend", "base_ptr", "chunk_bytes", "run_bytes", "capacity_bytes"
    )
    committed_bytes = delegate(
        "region.committed_bytes",
        "The memory committed (the sum of the runs): at least what the size asks for, more "
        "when a shrink ended inside a run (it stays whole).",
    )
    committed_table = delegate(
        "_resizer.table",
        "Device int64: the kernels' bound, ``[1]`` (the committed size) or, with a block layout, "
        "``[len(segments)]`` (see the module docstring); a block layout replaces it.",
    )
    closed = delegate("_closed")

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
        if self._resizer.block_layout is not None:
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
        run of this rank's region (peers map the same runs)."""
        self._check_open()
        return self.region.covers(start, end)

    def describe_committed(self) -> str:
        """What is committed, in words (for error messages)."""
        return self._resizer.describe_committed()

    def how_to_commit(self) -> str:
        """The calls that commit memory here, in words (for error messages)."""
        if self._resizer.block_layout is not None:
            return "grow_blocks(n) with the block layout"
        return "grow(nbytes), or initial_bytes= at construction"

    # -- collective helpers for the layers above -------------------------------------------
    def agree(self, error: BaseException | None, what: str) -> None:
        """Collective: raises the same :class:`GroupError` on every rank if any rank passes
        an error (e.g. the cache's local setup after construction)."""
        self._check_open()
        self._comm.agree(error, what)

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        """Collective: every rank's ``obj`` (JSON-serializable) in rank order, bounded by this
        object's timeout (an engine's decision taken per rank, agreed before anyone acts)."""
        self._check_open()
        return self._comm.all_gather(obj, what)

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
        layout = self._resizer.block_layout
        return None if layout is None else layout.segments

    @property
    def max_blocks(self) -> int | None:
        layout = self._resizer.block_layout
        return None if layout is None else layout.max_blocks

    @property
    def committed_blocks(self) -> int | None:
        """The top of the committed block set (one past its highest block: the kernels' bound;
        the block count when the set is a prefix), or None without a block layout."""
        layout = self._resizer.block_layout
        return None if layout is None else layout.blocks

    @property
    def committed_block_set(self) -> tuple[tuple[int, int], ...] | None:
        """The committed block set (``vmmkv._blockset``: sorted, disjoint ``(start, end)``
        block intervals; the prefix ``[0, n)`` is ``((0, n),)``), or None without a block
        layout."""
        layout = self._resizer.block_layout
        return None if layout is None else layout.set

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
        self._resizer.set_block_layout(segments, max_blocks, refuse)

    def bound_for(self, start: int, end: int, what: str = "view") -> torch.Tensor:
        """The device int64 tensor of 1 element that bounds the region bytes ``[start, end)``:
        ``committed_table`` itself without a block layout, else the element of the one segment
        that contains them (a view of the table, updated in place by every resize). Raises
        ValueError naming ``what`` and the segments when no single segment contains them."""
        self._check_open()
        return self._resizer.bound_for(start, end, what)

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

    def resize_block_set(
        self, intervals: Any, *, direction: str | None = None
    ) -> tuple[tuple[int, int], ...]:
        """Collective: every segment of the block layout holds exactly the blocks of
        ``intervals`` (``(start, end)`` block pairs inside ``[0, max_blocks]``, any order,
        overlapping or touching ones merged) afterwards: the chunks covering them in every
        segment are committed on every rank, peers map exactly those, every other chunk is
        released (see the module docstring). Returns the canonical set. ``direction``:
        ``"grow"`` refuses a set that drops a committed block, ``"shrink"`` one that adds a
        block. Same protocol and failure rules as ``resize``; a set that both adds and drops
        blocks is a grow to the union, then a shrink."""
        self._check_open()
        return self._resizer.resize_set(intervals, direction, peers=self.peers)

    def _resize(self, size: Any, direction: str | None, *, blocks: bool) -> int:
        self._check_open()
        return self._resizer.resize(size, direction, blocks=blocks, peers=self.peers)

    # -- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        """Local and idempotent: peers' mappings go first, then the own region."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        run_all([self.peers.close if self.peers else lambda: None, self.region.close,
                 self._comm.release_group])  # fmt: skip

    def __enter__(self) -> SymmetricRegion:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
