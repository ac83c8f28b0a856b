"""``VirtualRegion``: a stable virtual address range whose committed memory is a set of chunks.

Contract:
- The full capacity is reserved once; ``base_ptr`` never changes for the life of the object, so
  kernels and CUDA graphs captured over the range stay valid while it grows and shrinks.
- The range is cut into a fixed grid of chunks: chunk ``k`` spans
  ``[k * chunk_bytes, min((k + 1) * chunk_bytes, capacity))``. The committed memory is a set of
  grid chunks, kept on the books in address order. Two ways to change it, both local (not
  collective) and refused during a CUDA stream capture on the calling thread (see
  ``CudaBackend.is_capturing`` for captures on other threads):
  - by ranges: ``commit_ranges(ranges)`` commits every grid chunk that overlaps one of the
    byte ranges ``[(start, end), ...]`` (empty ranges cover nothing); new bytes are zero on
    return. ``decommit_outside(ranges)`` decommits every committed chunk that overlaps none of
    them, after a device synchronize. So a chunk two ranges share stays while either needs it.
  - by prefix (a particular chunk set, the API of every existing caller): ``commit(n)`` is
    ``commit_ranges([(0, n)])`` (the prefix grows to ``n`` rounded up to ``chunk_bytes``),
    ``decommit(n)`` is ``decommit_outside([(0, n)])`` (it shrinks to ``n`` rounded up).
  ``covering_chunks`` / ``VirtualRegion.chunks_covering`` give the chunk set of some ranges
  without committing anything. ``committed_bytes`` is the committed total (for a prefix: its
  end).
- Failure rules (every way of changing the set): a failing commit unmaps what it mapped and
  leaves the region as it was. An unmap that fails (``decommit``, ``decommit_outside``,
  ``PeerRegion.unmap_from``/``unmap_outside``, the rollback of a failed commit) stops at the
  failing chunk: chunks are unmapped last first, so that chunk and every doomed chunk below it
  stay mapped and on the books (a prefix stays a prefix: no hole), the call raises
  :class:`UnmapError` naming what is still mapped, and a later call retries. Chunks a failed
  rollback could not unmap stay committed, with unspecified contents (the commit's own error is
  raised, the rest logged).
- ``tensor(dtype)`` is a view over the whole capacity, committed or not (address space, by
  contract: kernels and CUDA graphs are built over the range before it grows); only committed
  chunks may be touched, and touching an uncommitted byte kills the process (host backend:
  SIGSEGV; CUDA: an illegal address). The layers above hand engines checked views
  (``ReplicatedKVCache.allocate``, ``SymmetricRegion.view``). A CUDA graph may be captured over
  uncommitted addresses with kernels (they touch memory only when they run); a memcpy/memset
  node is validated against the range at capture time and fails there.
- Views keep the address range reserved: ``close()`` unmaps and releases every chunk at once
  (device memory returns immediately), but the range itself is given back only when the last
  view created by ``tensor()`` is gone, so no later reservation can land under a stale view.
  Touching a view after ``close()`` faults (host: SIGSEGV on a ``PROT_NONE`` range; CUDA: an
  illegal address on an unmapped range), it never reaches someone else's memory. CUDA graphs that
  captured the addresses must not be replayed after ``close()``: they fault the same way, and the
  range is reused once the views are gone.
- There is no ``__del__``: a finalizer could run a device synchronize in the middle of someone's
  graph capture. An unclosed region lives until the process exits (the OS reclaims it).
- ``close()`` is local and idempotent; it finishes every step (synchronize, unmap every chunk,
  release the reservation) even when one fails, then raises the first error; a chunk whose unmap
  failed stays on the books and keeps the reservation, and a later ``close()`` retries. It skips
  driver calls while the interpreter is finalizing. Afterwards every method raises
  :class:`RegionClosedError`.
- ``PeerRegion`` is the importing side: a reservation of a peer's full capacity into which the
  peer's exported chunks are mapped at their offsets (the ipc layer builds peer maps from it).
  ``map_fd`` maps a chunk anywhere it overlaps no mapped chunk; ``unmap_from(offset)`` (prefix)
  and ``unmap_outside(ranges)`` (chunk set) unmap whole mappings. Its views and its ``close()``
  follow the same rules.

Ownership: a region owns its reservation (shared with its views, see ``reservation.py``) and its
mappings; physical handles are released right after mapping (the mapping keeps the memory
alive). ``export_chunk`` returns an fd the caller closes. ``PeerRegion.map_fd`` never closes the
fd it is given.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .._util import ceil_div, require_int, run_all
from .._util import round_up as _round_up
from . import driver
from .backend import Backend
from .dlpack import tensor_at
from .host import HostBackend
from .reservation import Reservation

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

_MAX_DEFAULT_CHUNK = 1 << 30
# The most chunks block_layout_chunk_bytes gives a region: a grow's cost is per chunk and peer
# (measured on one H200: ~0.39 ms per chunk and peer), so a full grow of 512 chunks at PCP 8
# stays under 2 s (docs/design.md, "Chunk sizes").
MAX_CHUNKS = 512
_DEFAULT_CHUNKS = 64


class RegionClosedError(RuntimeError):
    """A method was called on a closed region."""


@dataclass(frozen=True)
class Chunk:
    """One committed piece of a region: ``size`` bytes at ``offset`` from the base."""

    offset: int
    size: int


class UnmapError(RuntimeError):
    """An unmap failed part-way. ``unmapped``: the chunks that did go (address order);
    ``still_mapped``: the chunks asked for that are still mapped and still on the region's books
    (address order). The backend's error is the ``__cause__``."""

    def __init__(self, message: str, *, unmapped: list[Chunk], still_mapped: list[Chunk]):
        super().__init__(message)
        self.unmapped = unmapped
        self.still_mapped = still_mapped


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


def _require_positive(name: str, value: Any) -> int:
    require_int(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def _require_granular(name: str, value: int, granularity: int) -> int:
    if value % granularity:
        raise ValueError(
            f"{name}={value} is not a multiple of the allocation granularity {granularity}"
        )
    return value


Range = tuple[int, int]  # [start, end) in bytes from a region's base


def _check_ranges(op: str, ranges: Any, capacity: int) -> list[Range]:
    """``ranges`` as a list of ``(start, end)`` int pairs with ``0 <= start <= end <=
    capacity``; TypeError/ValueError naming ``op``, the value got and what was expected."""
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


def _merged(ranges: list[Range]) -> list[Range]:
    """The union of ``ranges`` as sorted, disjoint, non-empty ranges."""
    out: list[Range] = []
    for start, end in sorted(r for r in ranges if r[0] < r[1]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _overlaps(merged: list[Range], offset: int, size: int) -> bool:
    """Whether ``[offset, offset + size)`` overlaps one of the ``merged`` ranges."""
    i = bisect.bisect_left(merged, offset + size, key=lambda r: r[0]) - 1
    return i >= 0 and merged[i][1] > offset


def block_layout_chunk_bytes(
    segments: Any,
    capacity: int,
    granularity: int,
    *,
    waste: float = 1 / 32,
    max_chunks: int = MAX_CHUNKS,
) -> int:
    """The chunk size for a region that grows by blocks of ``segments`` (``(offset,
    block_bytes)`` pairs, as ``set_block_layout`` takes them): the largest power-of-two multiple
    of ``granularity`` (at most 1 GiB, at least the granularity) whose worst-case overhead, one
    partly used chunk at each end of every segment (``2 * len(segments)`` chunks), stays within
    ``waste * capacity``; then doubled until the capacity holds at most ``max_chunks`` chunks
    (while the 1 GiB ceiling allows). Pure geometry.

    Why: the default (``capacity / 64``) is larger than a segment as soon as a layout has more
    than 64 of them (a DeepSeek-V3.2 cache has 122), and then any block count commits the whole
    capacity. Smaller chunks follow the committed blocks closer, but every chunk costs driver
    calls on every rank at every grow (create, map, access and export its own; import, map and
    access it on every peer), so the count is capped (``MAX_CHUNKS``; docs/design.md, "Chunk
    sizes"). A caller that only ever commits everything or nothing (the vLLM plugin) needs no
    fine chunks at all and takes the region's default."""
    _require_positive("capacity", capacity)
    _require_positive("granularity", granularity)
    _require_positive("max_chunks", max_chunks)
    count = len(list(segments))
    chunk = granularity
    while chunk * 2 <= min(capacity, _MAX_DEFAULT_CHUNK) and (
        2 * count * chunk * 2 <= waste * capacity or ceil_div(capacity, chunk) > max_chunks
    ):
        chunk *= 2
    return chunk


def covering_chunks(ranges: Any, chunk_bytes: int, capacity: int) -> list[Chunk]:
    """The chunks of the grid ``chunk_bytes`` over ``[0, capacity)`` (chunk ``k`` at ``k *
    chunk_bytes``, the last one cut at the capacity) that overlap one of ``ranges`` (``(start,
    end)`` byte pairs; empty ones cover nothing), in address order. Pure geometry."""
    _require_positive("chunk_bytes", chunk_bytes)
    _require_positive("capacity", capacity)
    out: list[Chunk] = []
    last = -1
    for start, end in _merged(_check_ranges("covering_chunks", ranges, capacity)):
        first = max(start // chunk_bytes, last + 1)
        last = ceil_div(end, chunk_bytes) - 1
        for k in range(first, last + 1):
            offset = k * chunk_bytes
            out.append(Chunk(offset, min(chunk_bytes, capacity - offset)))
    return out


def _offset_key(c: Chunk) -> int:
    return c.offset


class _MappedRange:
    """What ``VirtualRegion`` and ``PeerRegion`` share: a reservation (held by the views), a set
    of mapped chunks on the books (address order), the read-only properties, views, unmapping
    and teardown."""

    _what = "object"

    def __init__(self, backend: Backend, capacity_bytes: int) -> None:
        self._backend: Backend = backend
        self._capacity = capacity_bytes
        self._chunks: list[Chunk] = []  # disjoint, in address order
        self._lock = threading.RLock()
        self._closed = False
        self._settled = False  # close() has run every step without an error
        self._reservation = Reservation(backend, capacity_bytes)
        self._base = self._reservation.base

    # -- properties -------------------------------------------------------------------------
    @property
    def base_ptr(self) -> int:
        self._check_open()
        return self._base

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def granularity(self) -> int:
        return self._backend.granularity

    @property
    def device(self) -> torch.device:
        return self._backend.device

    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def handle_type(self) -> str:
        return self._backend.handle_type

    @property
    def keeps_fds(self) -> bool:
        """Whether each committed own chunk holds an open fd (the host backend's memfds)."""
        return self._backend.keeps_fds

    @property
    def closed(self) -> bool:
        return self._closed

    def _mapped_total(self) -> int:
        return sum(c.size for c in self._chunks)

    def chunks(self) -> list[Chunk]:
        """The mapped chunks in address order (a copy)."""
        self._check_open()
        return list(self._chunks)

    def device_uuid(self) -> str:
        return self._backend.device_uuid()

    # -- the books ---------------------------------------------------------------------------
    def _index(self, books: list[Chunk], chunk: Chunk) -> int:
        """Where ``chunk`` is in ``books`` (address order), or -1."""
        i = bisect.bisect_left(books, chunk.offset, key=_offset_key)
        return i if i < len(books) and books[i] == chunk else -1

    def _overlaps_mapped(self, chunk: Chunk) -> Chunk | None:
        """A mapped chunk that overlaps ``chunk``, or None."""
        i = bisect.bisect_left(self._chunks, chunk.offset + chunk.size, key=_offset_key) - 1
        if i >= 0:
            c = self._chunks[i]
            if c.offset + c.size > chunk.offset:
                return c
        return None

    # -- views -----------------------------------------------------------------------------
    def tensor(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """1-D view over the full capacity, mapped or not: address space (only mapped chunks
        may be touched; an unmapped byte kills the process). The view keeps the address range
        reserved after ``close()`` (see the module doc)."""
        with self._lock:  # close() cannot release the reservation in between
            self._check_open()
            return tensor_at(
                self._base, self._capacity, dtype, self._backend.device, self._reservation
            )

    # -- unmapping -------------------------------------------------------------------------
    def _unmap_chunks(self, books: list[Chunk], doomed: list[Chunk]) -> list[Chunk]:
        """Unmap ``doomed`` (chunks of ``books``, address order), last first; each leaves
        ``books`` once its own unmap succeeded. Stops at the first failure, so the failed chunk
        and every doomed chunk below it stay on the books (a prefix stays a prefix), and raises
        :class:`UnmapError`. Returns the unmapped chunks in address order."""
        done: list[Chunk] = []
        for n, c in enumerate(reversed(doomed)):
            try:
                self._backend.unmap(self._base + c.offset, c.size)
            except Exception as exc:
                still = doomed[: len(doomed) - n]
                raise UnmapError(
                    self._unmap_failed(c, exc, still), unmapped=done[::-1], still_mapped=still
                ) from exc
            del books[self._index(books, c)]
            done.append(c)
        return done[::-1]

    def _unmap_if(self, keep: Callable[[Chunk], bool]) -> list[Chunk]:
        """Unmap every chunk on the books that ``keep`` rejects (see ``_unmap_chunks``)."""
        return self._unmap_chunks(self._chunks, [c for c in self._chunks if not keep(c)])

    def _unmap_every(self) -> None:
        """close(): try every chunk, last first, so all the memory that can go goes now; the
        chunks that fail stay on the books (close retries them) and one UnmapError names them."""
        failed: list[tuple[Chunk, Exception]] = []
        done: list[Chunk] = []
        for c in reversed(self._chunks[:]):
            try:
                self._backend.unmap(self._base + c.offset, c.size)
            except Exception as exc:
                failed.append((c, exc))
                continue
            del self._chunks[self._index(self._chunks, c)]
            done.append(c)
        if failed:
            c, exc = failed[0]
            still = list(self._chunks)
            raise UnmapError(
                self._unmap_failed(c, exc, still), unmapped=done[::-1], still_mapped=still
            ) from exc

    def _unmap_failed(self, chunk: Chunk, exc: Exception, still: list[Chunk]) -> str:
        return (
            f"{self._what} on {self._backend.describe()}: unmapping the chunk at offset "
            f"{chunk.offset} ({chunk.size} bytes) failed: {exc}; chunks at offsets "
            f"{[k.offset for k in still]} are still mapped and stay on the books "
            f"({self._mapped_total()} bytes in {len(self._chunks)} chunks mapped now); a later "
            "call retries them"
        )

    # -- teardown --------------------------------------------------------------------------
    def _close_first(self) -> list[Callable[[], None]]:
        """Steps that run before the unmapping in ``close()``."""
        return []

    def _release_reservation(self) -> None:
        if not self._chunks:  # else a mapping is still in it: _unmap_every raised for it
            self._reservation.release()

    def close(self) -> None:
        """Local and idempotent: unmap every chunk, then give the reservation to its views (it
        is freed when the last one goes, at once when there is none). Every step runs; the first
        error is raised, and a later ``close()`` retries what failed."""
        with self._lock:
            if self._settled:
                return
            self._closed = True
            if not driver.finalizing():
                run_all([*self._close_first(), self._unmap_every, self._release_reservation])
            self._settled = True

    def _check_open(self) -> None:
        if self._closed:
            raise RegionClosedError(f"{self._what} is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class VirtualRegion(_MappedRange):
    """Reserved VA of ``capacity_bytes`` on ``device`` whose committed memory is a set of grid
    chunks (a prefix for the prefix API); see the module doc."""

    _what = "VirtualRegion"

    def __init__(
        self,
        capacity_bytes: int,
        device: Any = None,
        *,
        chunk_bytes: int | None = None,
        backend: str = "auto",
        handle_type: str = "posix_fd",
    ) -> None:
        _require_positive("capacity_bytes", capacity_bytes)
        if chunk_bytes is not None:
            _require_positive("chunk_bytes", chunk_bytes)
        be = make_backend(device, backend, handle_type)
        gran = be.granularity
        _require_granular("capacity_bytes", capacity_bytes, gran)
        if chunk_bytes is None:
            per = ceil_div(capacity_bytes, _DEFAULT_CHUNKS)
            chunk_bytes = min(_round_up(per, gran), max(gran, _MAX_DEFAULT_CHUNK))
        _require_granular("chunk_bytes", chunk_bytes, gran)
        if chunk_bytes > capacity_bytes:
            raise ValueError(f"chunk_bytes={chunk_bytes} exceeds capacity_bytes={capacity_bytes}")
        self._chunk = chunk_bytes
        super().__init__(be, capacity_bytes)

    @property
    def chunk_bytes(self) -> int:
        return self._chunk

    @property
    def committed_bytes(self) -> int:
        """Bytes committed: the sum of the committed chunks (for a prefix: its end)."""
        return self._mapped_total()

    def memory_in_use(self) -> int:
        """Device memory in use on this region's device (0 on the host backend)."""
        return self._backend.memory_in_use()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"committed={self.committed_bytes}"
        return (
            f"VirtualRegion({self._backend.describe()}, capacity={self._capacity}, "
            f"chunk={self._chunk}, {state})"
        )

    # -- sizing ----------------------------------------------------------------------------
    def round_up(self, nbytes: int) -> int:
        """``nbytes`` rounded up to a whole number of chunks, capped at the capacity."""
        return min(_round_up(nbytes, self._chunk), self._capacity)

    def chunks_covering(self, ranges: Any) -> list[Chunk]:
        """The grid chunks that overlap ``ranges`` (committed or not), in address order."""
        return covering_chunks(ranges, self._chunk, self._capacity)

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
        checked = _check_ranges(op, ranges, self._capacity)
        self._refuse_during_capture(op)
        return checked

    # -- commit ----------------------------------------------------------------------------
    def commit(self, nbytes: int) -> list[Chunk]:
        """Grow the committed prefix to cover ``nbytes``; returns the chunks added (zeroed)."""
        with self._lock:
            self._check_open()
            target = self._target("commit", nbytes)
            return self._commit(self.chunks_covering([(0, target)]))

    def commit_ranges(self, ranges: Any) -> list[Chunk]:
        """Commit every grid chunk that overlaps one of ``ranges`` (``(start, end)`` byte
        pairs) and is not committed yet; returns the chunks added (zeroed), address order."""
        with self._lock:
            self._check_open()
            checked = self._ranges("commit_ranges", ranges)
            return self._commit(self.chunks_covering(checked))

    def _commit(self, wanted: list[Chunk]) -> list[Chunk]:
        new = [c for c in wanted if self._index(self._chunks, c) < 0]
        added: list[Chunk] = []
        try:
            with self._backend.context():
                self._map_new(new, added)
        except BaseException:
            self._roll_back(added)
            raise
        for c in added:
            bisect.insort(self._chunks, c, key=_offset_key)
        return added

    def _map_new(self, new: list[Chunk], added: list[Chunk]) -> None:
        """Create, map and zero the chunks ``new`` (address order), recording each in ``added``
        as soon as it is mapped (so the caller can roll back exactly what exists). Zeroes each
        contiguous run of new chunks with one call."""
        for c in new:
            handle = self._backend.create(c.size)
            self._backend.map(self._base + c.offset, c.size, handle, exportable=True)
            added.append(c)
        run_start = None
        for i, c in enumerate(added):
            if run_start is None:
                run_start = c.offset
            end = c.offset + c.size
            if i + 1 == len(added) or added[i + 1].offset != end:
                self._backend.zero(self._base + run_start, end - run_start)
                run_start = None

    def _roll_back(self, added: list[Chunk]) -> None:
        """Unmap a failed commit's chunks. Those an unmap failure leaves mapped join the books
        (for a prefix: contiguously, ``added`` starts at its end) so a later decommit or close
        handles them; errors are logged, the commit's own error is the one raised."""
        try:
            self._unmap_chunks(added, list(added))
        except Exception as exc:
            log.error("%r: rolling back a failed commit: %s", self, exc)
        finally:
            for c in added:
                bisect.insort(self._chunks, c, key=_offset_key)

    # -- decommit --------------------------------------------------------------------------
    def decommit(self, nbytes: int) -> list[Chunk]:
        """Shrink the committed prefix to ``nbytes`` rounded up to chunks (every chunk at or
        beyond it goes); returns the dropped chunks in address order. Synchronizes the device
        first so no queued kernel touches what goes away. Raises :class:`UnmapError` when an
        unmap fails (see the module doc)."""
        with self._lock:
            self._check_open()
            target = self._target("decommit", nbytes)
            return self._decommit(lambda c: c.offset < target)

    def decommit_outside(self, ranges: Any) -> list[Chunk]:
        """Decommit every committed chunk that overlaps none of ``ranges`` (a chunk two ranges
        share stays while either needs it); returns the dropped chunks in address order.
        Synchronizes first; :class:`UnmapError` as ``decommit``."""
        with self._lock:
            self._check_open()
            merged = _merged(self._ranges("decommit_outside", ranges))
            return self._decommit(lambda c: _overlaps(merged, c.offset, c.size))

    def _decommit(self, keep: Callable[[Chunk], bool]) -> list[Chunk]:
        if all(keep(c) for c in self._chunks):
            return []
        self._backend.synchronize()
        return self._unmap_if(keep)

    # -- sharing ---------------------------------------------------------------------------
    def export_chunk(self, chunk: Chunk) -> int:
        """A new fd for a committed chunk; the caller owns it and closes it exactly once."""
        with self._lock:
            self._check_open()
            if not isinstance(chunk, Chunk) or self._index(self._chunks, chunk) < 0:
                raise ValueError(f"export_chunk: {chunk} is not committed in {self!r}")
            return self._backend.export(self._base + chunk.offset, chunk.size)

    def export_chunk_value(self, chunk: Chunk, tag: str) -> bytes:
        """A committed chunk as a by-value handle (``Backend.export_value``); the exchange
        that sends it calls ``release_values(tag)`` once it is over."""
        with self._lock:
            self._check_open()
            if not isinstance(chunk, Chunk) or self._index(self._chunks, chunk) < 0:
                raise ValueError(f"export_chunk_value: {chunk} is not committed in {self!r}")
            return self._backend.export_value(self._base + chunk.offset, chunk.size, tag=tag)

    def release_values(self, tag: str) -> None:
        """Local: drop what the by-value exports under ``tag`` left behind (any rank's)."""
        self._backend.release_values(tag)

    def open_peer(self) -> PeerRegion:
        """A new, empty reservation of this region's capacity for mapping a peer's chunks."""
        self._check_open()
        return PeerRegion(self._backend, self._capacity)

    def synchronize(self) -> None:
        self._check_open()
        self._backend.synchronize()

    # -- teardown --------------------------------------------------------------------------
    def _close_first(self) -> list[Callable[[], None]]:
        return [self._backend.synchronize]


class PeerRegion(_MappedRange):
    """A reservation of a peer region's capacity; the peer's chunks are mapped into it.

    Local object; ``close()`` unmaps every chunk then gives up the reservation (idempotent).
    """

    _what = "PeerRegion"  # built by ``VirtualRegion.open_peer()``: PeerRegion(backend, capacity)

    @property
    def mapped_bytes(self) -> int:
        """Bytes mapped: the sum of the mapped chunks (for a prefix: its end)."""
        return self._mapped_total()

    def map_fd(self, fd: int, chunk: Chunk) -> None:
        """Import ``fd`` and map it at ``chunk.offset``: anywhere inside the capacity that no
        mapped chunk overlaps (a prefix grows by mapping at its end). The fd stays the caller's
        to close."""
        self._map_import("map_fd", chunk, lambda: self._backend.import_fd(fd, chunk.size))

    def map_value(self, value: bytes, chunk: Chunk) -> None:
        """Import the by-value handle ``value`` (``Backend.import_value``) and map it at
        ``chunk.offset``, with the same rules as ``map_fd``."""
        self._map_import("map_value", chunk, lambda: self._backend.import_value(value, chunk.size))

    def _map_import(self, op: str, chunk: Chunk, importer: Callable[[], Any]) -> None:
        if not isinstance(chunk, Chunk):
            raise TypeError(f"{op}: chunk must be a Chunk, got {type(chunk).__name__}")
        with self._lock:
            self._check_open()
            if chunk.size <= 0 or chunk.offset < 0 or chunk.offset + chunk.size > self._capacity:
                raise ValueError(f"{op}: {chunk} outside capacity {self._capacity}")
            other = self._overlaps_mapped(chunk)
            if other is not None:
                raise ValueError(f"{op}: {chunk} overlaps the mapped {other}")
            handle = importer()
            self._backend.map(self._base + chunk.offset, chunk.size, handle)
            bisect.insort(self._chunks, chunk, key=_offset_key)

    def unmap_from(self, offset: int) -> list[Chunk]:
        """Unmap every chunk at or beyond ``offset`` (whole mappings only); returns them in
        address order. Raises :class:`UnmapError` when an unmap fails (see the module doc)."""
        require_int("unmap_from: offset", offset, lo=0)
        with self._lock:
            self._check_open()
            return self._unmap_if(lambda c: c.offset < offset)

    def unmap_outside(self, ranges: Any) -> list[Chunk]:
        """Unmap every chunk that overlaps none of ``ranges`` (whole mappings only); returns
        them in address order. :class:`UnmapError` as ``unmap_from``."""
        with self._lock:
            self._check_open()
            merged = _merged(_check_ranges("unmap_outside", ranges, self._capacity))
            return self._unmap_if(lambda c: _overlaps(merged, c.offset, c.size))
