"""``VirtualRegion``: a stable virtual address range whose committed memory is a set of chunks,
backed by runs.

Contract:
- The full capacity is reserved once; ``base_ptr`` never changes for the life of the object, so
  kernels and CUDA graphs captured over the range stay valid while it grows and shrinks.
- What is committed is a set of chunks of a fixed grid (``chunk_bytes``; chunk ``k`` spans
  ``[k * chunk_bytes, min((k + 1) * chunk_bytes, capacity))``). The physical memory comes in
  **runs** (``vmmkv.alloc.geometry``): a commit creates one physical allocation per stretch of
  new chunks of each range it is given, never crossing a multiple of ``run_bytes`` (a multiple of
  ``chunk_bytes``; the default, ``chunk_bytes``, makes every chunk a run of its own). A run is
  created, mapped, zeroed, exported and unmapped whole. The books list the runs in address
  order (``chunks()``); ``committed_bytes`` is their total (the memory mapped). Two ways to
  change the set, both local (not collective) and refused during a CUDA stream capture on the
  calling thread (see ``CudaBackend.is_capturing`` for captures on other threads):
  - by ranges: ``commit_ranges(ranges)`` commits every grid chunk that overlaps one of the
    byte ranges ``[(start, end), ...]`` and no run holds (empty ranges cover nothing), each
    range's new chunks in runs of their own; new bytes are zero on return.
    ``decommit_outside(ranges)`` unmaps, after a device synchronize, every run that overlaps
    none of them. So a chunk two ranges share stays while either needs it, and a run stays
    whole while any range needs a byte of it: a shrink that ends inside a run releases nothing
    of that run (its memory stays mapped, with its bytes, until no range needs it).
  - by prefix (the API of every existing caller): ``commit(n)`` is ``commit_ranges([(0, n)])``
    (the prefix grows to cover ``n`` rounded up to ``chunk_bytes``), ``decommit(n)`` is
    ``decommit_outside([(0, n)])``.
  ``plan_runs(ranges)`` gives the runs a commit would create, ``covering_chunks`` the grid
  chunks of some ranges, ``mapped_parts(ranges)`` the bytes of ranges that runs hold, without
  committing anything.
- Failure rules: a failing commit unmaps what it mapped and leaves the region as it was; an
  unmap that fails follows ``vmmkv.alloc.mapped`` (it stops at the failing run, which stays on
  the books with every doomed run below it, and raises :class:`UnmapError`); runs a failed
  rollback could not unmap stay committed, with unspecified contents (the commit's own error is
  raised, the rest logged).
- Views (``tensor()``), ``close()`` and its order (synchronize, unmap every run, release the
  reservation once no view holds it): ``vmmkv.alloc.mapped``. A CUDA graph may be captured over
  uncommitted addresses with kernels (they touch memory only when they run); a memcpy/memset
  node is validated against the range at capture time and fails there.

Ownership: a region owns its reservation (shared with its views, see ``reservation.py``) and its
runs; physical handles are released right after mapping (the mapping keeps the memory alive).
``export_chunk`` returns an fd the caller closes. ``PeerRegion`` (``vmmkv.alloc.mapped``) is the
importing side. The geometry's names (``Chunk``, ``covering_chunks``,
``block_layout_chunk_bytes``, ``MAX_CHUNKS``) are importable from here too.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from typing import Any

import torch

from .._util import ceil_div, delegate, require_int, run_all
from .._util import round_up as _round_up
from . import driver
from .backend import Backend
from .geometry import (
    DEFAULT_CHUNKS,
    MAX_CHUNKS,
    MAX_DEFAULT_CHUNK,
    Chunk,
    Range,
    block_layout_chunk_bytes,
    check_ranges,
    covering_chunks,
    intersection,
    merged,
    offset_key,
    overlaps,
    plan_runs,
    require_granular,
    require_positive,
)
from .host import HostBackend
from .mapped import PeerRegion, RegionClosedError, UnmapError, _MappedRange

__all__ = [
    "Chunk",
    "PeerRegion",
    "RegionClosedError",
    "UnmapError",
    "VirtualRegion",
    "MAX_CHUNKS",
    "block_layout_chunk_bytes",
    "covering_chunks",
    "make_backend",
    "run_all",
]

log = logging.getLogger(__name__)


def check_device(device: Any, backend: str) -> torch.device | None:
    """The checks of ``device`` and ``backend`` that need no driver call: the device as a
    ``torch.device`` (None for None), or TypeError/ValueError naming the value got and what
    was expected."""
    if not isinstance(backend, str) or backend not in ("auto", "cuda", "host"):
        raise ValueError(f"backend must be 'auto', 'cuda' or 'host', got {backend!r}")
    if device is None:
        dev = None
    elif isinstance(device, bool):
        raise TypeError(f"device must be None, int, str or torch.device, got {device!r}")
    elif isinstance(device, int):
        if device < 0:
            raise ValueError(f"device must be a cuda ordinal >= 0, got {device}")
        dev = torch.device("cuda", device)
    elif isinstance(device, (str, torch.device)):
        try:
            dev = torch.device(device)
        except RuntimeError as exc:  # torch's parse error, e.g. "cdua:0"
            raise ValueError(
                f"device must be a cuda or cpu device, got {device!r}: {exc}"
            ) from None
    else:
        raise TypeError(f"device must be None, int, str or torch.device, got {type(device)}")
    if dev is not None and dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be a cuda or cpu device, got {dev}")
    if backend == "host" and dev is not None and dev.type != "cpu":
        raise ValueError(f"the host backend lives on the cpu device, got device={dev}")
    if backend == "cuda" and dev is not None and dev.type != "cuda":
        raise ValueError(f"the cuda backend needs a cuda device, got device={dev}")
    return dev


def _resolve_device(device: Any, backend: str) -> tuple[str, int | None]:
    """Returns (backend name, cuda ordinal or None)."""
    dev = check_device(device, backend)
    if backend == "auto":
        if dev is not None and dev.type == "cpu":
            backend = "host"
        else:
            backend = "cuda" if driver.cuda_usable() else "host"
    if backend == "host":
        if dev is not None and dev.type != "cpu":
            raise ValueError(f"the host backend lives on the cpu device, got device={dev}")
        return "host", None
    if dev is not None and dev.type != "cuda":
        raise ValueError(f"the cuda backend needs a cuda device, got device={dev}")
    if not driver.cuda_usable():
        raise RuntimeError(f"backend='cuda' but CUDA is not usable: {driver.why_no_cuda()}")
    if dev is None or dev.index is None:
        ordinal = torch.cuda.current_device() if torch.cuda.is_available() else 0
    else:
        ordinal = dev.index
    if not 0 <= ordinal < driver.device_count():
        raise ValueError(f"cuda ordinal {ordinal} out of range [0, {driver.device_count()})")
    return "cuda", ordinal


def make_backend(
    device: Any = None, backend: str = "auto", handle_type: str = "posix_fd"
) -> Backend:
    """The backend object for ``device`` ('auto' picks host when no CUDA device is usable)."""
    name, ordinal = _resolve_device(device, backend)
    if name == "host":
        return HostBackend(handle_type)
    from .cuda import CudaBackend

    return CudaBackend(ordinal, handle_type)


class VirtualRegion(_MappedRange):
    """Reserved VA of ``capacity_bytes`` on ``device`` whose committed memory is a set of grid
    chunks (a prefix for the prefix API) backed by runs; see the module doc."""

    _what = "VirtualRegion"

    def __init__(
        self,
        capacity_bytes: int,
        device: Any = None,
        *,
        chunk_bytes: int | None = None,
        run_bytes: int | None = None,
        backend: str = "auto",
        handle_type: str = "posix_fd",
    ) -> None:
        require_positive("capacity_bytes", capacity_bytes)
        if chunk_bytes is not None:
            require_positive("chunk_bytes", chunk_bytes)
        if run_bytes is not None:
            require_positive("run_bytes", run_bytes)
        be = make_backend(device, backend, handle_type)
        gran = be.granularity
        require_granular("capacity_bytes", capacity_bytes, gran)
        if chunk_bytes is None:
            per = ceil_div(capacity_bytes, DEFAULT_CHUNKS)
            chunk_bytes = min(_round_up(per, gran), max(gran, MAX_DEFAULT_CHUNK))
        require_granular("chunk_bytes", chunk_bytes, gran)
        if chunk_bytes > capacity_bytes:
            raise ValueError(f"chunk_bytes={chunk_bytes} exceeds capacity_bytes={capacity_bytes}")
        if run_bytes is None:
            run_bytes = chunk_bytes
        elif run_bytes % chunk_bytes:
            raise ValueError(
                f"run_bytes={run_bytes} is not a multiple of chunk_bytes={chunk_bytes} (a run "
                "is a stretch of whole chunks)"
            )
        self._chunk = chunk_bytes
        self._run = run_bytes
        super().__init__(be, capacity_bytes)

    chunk_bytes = delegate(
        "_chunk", "The grid a commit rounds to: what is committed is always whole chunks."
    )
    run_bytes = delegate("_run", "The run grid: no physical allocation crosses a multiple of it.")

    @property
    def committed_bytes(self) -> int:
        """Bytes committed: the sum of the runs (the memory mapped; for a prefix: its end)."""
        return self._mapped_total()

    def memory_in_use(self) -> int:
        """Device memory in use on this region's device (0 on the host backend)."""
        return self._backend.memory_in_use()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"committed={self.committed_bytes}"
        runs = "" if self._run == self._chunk else f", runs<={self._run}"
        return (
            f"VirtualRegion({self._backend.describe()}, capacity={self._capacity}, "
            f"chunk={self._chunk}{runs}, {state})"
        )

    # -- sizing ----------------------------------------------------------------------------
    def round_up(self, nbytes: int) -> int:
        """``nbytes`` rounded up to a whole number of chunks, capped at the capacity."""
        return min(_round_up(nbytes, self._chunk), self._capacity)

    def chunks_covering(self, ranges: Any) -> list[Chunk]:
        """The grid chunks that overlap ``ranges`` (committed or not), in address order."""
        return covering_chunks(ranges, self._chunk, self._capacity)

    def plan_runs(self, ranges: Any) -> list[Chunk]:
        """The runs ``commit_ranges(ranges)`` would create now, in address order (no driver
        call): what a grow exchanges, and what the open-file budget counts."""
        with self._lock:
            self._check_open()
            return plan_runs(ranges, self._chunks, self._chunk, self._run, self._capacity)

    def mapped_parts(self, ranges: Any) -> list[Range]:
        """The bytes of ``ranges`` that runs hold now (sorted, disjoint ``(start, end)``)."""
        with self._lock:
            self._check_open()
            checked = check_ranges("mapped_parts", ranges, self._capacity)
            return intersection(checked, self._chunks)

    def covers(self, start: int, end: int) -> bool:
        """Whether every byte of ``[start, end)`` lies in a run (an empty range: True)."""
        if end <= start:
            return True
        return sum(hi - lo for lo, hi in self.mapped_parts([(start, end)])) == end - start

    def _refuse_during_capture(self, op: str) -> None:
        if self._backend.is_capturing():
            raise RuntimeError(
                f"{op} refused during CUDA stream capture: the region's mappings must not change "
                "while a graph is being captured (grow/shrink before or after capture)"
            )

    def _target(self, op: str, nbytes: Any) -> int:
        require_int(f"{op}: nbytes", nbytes)
        if not 0 <= nbytes <= self._capacity:
            raise ValueError(f"{op}: nbytes={nbytes} outside [0, capacity={self._capacity}]")
        self._refuse_during_capture(op)
        return self.round_up(nbytes)

    def _ranges(self, op: str, ranges: Any) -> list[Range]:
        checked = check_ranges(op, ranges, self._capacity)
        self._refuse_during_capture(op)
        return checked

    # -- commit ----------------------------------------------------------------------------
    def commit(self, nbytes: int) -> list[Chunk]:
        """Grow the committed prefix to cover ``nbytes``; returns the runs added (zeroed)."""
        with self._lock:
            self._check_open()
            target = self._target("commit", nbytes)
            return self._commit([(0, target)])

    def commit_ranges(self, ranges: Any) -> list[Chunk]:
        """Commit every grid chunk that overlaps one of ``ranges`` (``(start, end)`` byte
        pairs) and that no run holds, each range's in runs of its own (``plan_runs``);
        returns the runs added (zeroed), address order."""
        with self._lock:
            self._check_open()
            return self._commit(self._ranges("commit_ranges", ranges))

    def _commit(self, ranges: list[Range]) -> list[Chunk]:
        new = plan_runs(ranges, self._chunks, self._chunk, self._run, self._capacity)
        added: list[Chunk] = []
        try:
            with self._backend.context():
                self._map_new(new, added)
        except BaseException:
            self._roll_back(added)
            raise
        for c in added:
            bisect.insort(self._chunks, c, key=offset_key)
        return added

    def _map_new(self, new: list[Chunk], added: list[Chunk]) -> None:
        """Create, map and zero the runs ``new`` (address order), recording each in ``added``
        as soon as it is mapped (so the caller can roll back exactly what exists). Zeroes each
        stretch of adjacent new runs with one call."""
        for c in new:
            handle = self._backend.create(c.size)
            self._backend.map(self._base + c.offset, c.size, handle, exportable=True)
            added.append(c)
        for start, end in merged((c.offset, c.offset + c.size) for c in added):
            self._backend.zero(self._base + start, end - start)

    def _roll_back(self, added: list[Chunk]) -> None:
        """Unmap a failed commit's runs. Those an unmap failure leaves mapped join the books
        (for a prefix: contiguously, ``added`` starts at its end) so a later decommit or close
        handles them; errors are logged, the commit's own error is the one raised."""
        try:
            self._unmap_chunks(added, list(added))
        except Exception as exc:
            log.error("%r: rolling back a failed commit: %s", self, exc)
        finally:
            for c in added:
                bisect.insort(self._chunks, c, key=offset_key)

    # -- decommit --------------------------------------------------------------------------
    def decommit(self, nbytes: int) -> list[Chunk]:
        """Shrink the committed prefix to ``nbytes`` rounded up to chunks (every run that
        starts at or beyond it goes; one that straddles it stays whole); returns the dropped
        runs in address order. Synchronizes the device first so no queued kernel touches what
        goes away. Raises :class:`UnmapError` when an unmap fails (see the module doc)."""
        with self._lock:
            self._check_open()
            target = self._target("decommit", nbytes)
            return self._decommit(lambda c: c.offset < target)

    def decommit_outside(self, ranges: Any) -> list[Chunk]:
        """Decommit every run that overlaps none of ``ranges`` (a run any range needs a byte
        of stays whole); returns the dropped runs in address order. Synchronizes first;
        :class:`UnmapError` as ``decommit``."""
        with self._lock:
            self._check_open()
            keep = merged(self._ranges("decommit_outside", ranges))
            return self._decommit(lambda c: overlaps(keep, c.offset, c.size))

    def _decommit(self, keep: Callable[[Chunk], bool]) -> list[Chunk]:
        if all(keep(c) for c in self._chunks):
            return []
        self._backend.synchronize()
        return self._unmap_if(keep)

    # -- sharing ---------------------------------------------------------------------------
    def export_chunk(self, chunk: Chunk) -> int:
        """A new fd for a committed run; the caller owns it and closes it exactly once."""
        with self._lock:
            self._check_open()
            if not isinstance(chunk, Chunk) or self._index(self._chunks, chunk) < 0:
                raise ValueError(
                    f"export_chunk: {chunk} is not committed in {self!r} (not one of its runs)"
                )
            return self._backend.export(self._base + chunk.offset, chunk.size)

    def export_chunk_value(self, chunk: Chunk, tag: str) -> bytes:
        """A committed run as a by-value handle (``Backend.export_value``); the exchange that
        sends it calls ``release_values(tag)`` once it is over."""
        with self._lock:
            self._check_open()
            if not isinstance(chunk, Chunk) or self._index(self._chunks, chunk) < 0:
                raise ValueError(
                    f"export_chunk_value: {chunk} is not committed in {self!r} (not one of "
                    "its runs)"
                )
            return self._backend.export_value(self._base + chunk.offset, chunk.size, tag=tag)

    def release_values(self, tag: str) -> None:
        """Local: drop what the by-value exports under ``tag`` left behind (any rank's)."""
        self._backend.release_values(tag)

    def open_peer(self) -> PeerRegion:
        """A new, empty reservation of this region's capacity for mapping a peer's runs."""
        self._check_open()
        return PeerRegion(self._backend, self._capacity)

    def synchronize(self) -> None:
        self._check_open()
        self._backend.synchronize()

    # -- teardown --------------------------------------------------------------------------
    def _close_first(self) -> list[Callable[[], None]]:
        return [self._backend.synchronize]
