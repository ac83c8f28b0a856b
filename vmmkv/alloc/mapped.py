"""What a region and a peer's view of it share: a reserved address range and the mapped pieces on
its books (``_MappedRange``), and ``PeerRegion``, the importing side.

Contract:
- The books list the mapped pieces (:class:`Chunk`, runs of the owner's grid: each one physical
  allocation) in address order, disjoint. Unmapping takes whole pieces: the driver unmaps
  whole allocations. An unmap that fails (``VirtualRegion.decommit``/``decommit_outside``,
  ``PeerRegion.unmap_from``/``unmap_outside``, the rollback of a failed commit) stops at the
  failing piece: pieces are unmapped last first, so that piece and every doomed piece below it
  stay mapped and on the books (a prefix stays a prefix: no hole), the call raises
  :class:`UnmapError` naming what is still mapped, and a later call retries.
- ``tensor(dtype)`` is a view over the whole capacity, mapped or not (address space, by
  contract: kernels and CUDA graphs are built over the range before it grows); only mapped
  pieces may be touched, and touching anything else kills the process (host backend: SIGSEGV;
  CUDA: an illegal address). Views keep the address range reserved (``reservation.py``):
  ``close()`` unmaps every piece at once, the range is given back when the last view is gone.
- ``close()`` is local and idempotent; it finishes every step (synchronize where the owner
  does, unmap every piece, release the reservation) even when one fails, then raises the first
  error; a piece whose unmap failed stays on the books and keeps the reservation, and a later
  ``close()`` retries. It skips driver calls while the interpreter is finalizing. Afterwards
  every method raises :class:`RegionClosedError`. There is no ``__del__``.
- ``PeerRegion``: a reservation of a peer's full capacity into which the peer's exported runs
  are mapped at their offsets (``map_fd``, ``map_value``: anywhere no mapped piece overlaps);
  ``unmap_from(offset)`` (prefix) and ``unmap_outside(ranges)`` (a set) unmap whole pieces by
  the rule the owner decommits with, so a peer maps exactly what its owner holds.
  ``map_fd`` never closes the fd it is given. Local object.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from typing import Any

import torch

from .._util import delegate, delegates, require_int, run_all
from . import driver
from .backend import Backend
from .dlpack import tensor_at
from .geometry import Chunk, check_ranges, merged, offset_key, overlaps
from .reservation import Reservation

__all__ = ["PeerRegion", "RegionClosedError", "UnmapError"]


class RegionClosedError(RuntimeError):
    """A method was called on a closed region."""


class UnmapError(RuntimeError):
    """An unmap failed part-way. ``unmapped``: the runs that did go (address order);
    ``still_mapped``: the runs asked for that are still mapped and still on the region's books
    (address order). The backend's error is the ``__cause__``."""

    def __init__(self, message: str, *, unmapped: list[Chunk], still_mapped: list[Chunk]):
        super().__init__(message)
        self.unmapped = unmapped
        self.still_mapped = still_mapped


class _MappedRange:
    """What ``VirtualRegion`` and ``PeerRegion`` share: a reservation (held by the views), the
    mapped runs on the books (address order), the read-only properties, views, unmapping and
    teardown."""

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

    capacity_bytes = delegate("_capacity")
    closed = delegate("_closed")
    granularity, device, handle_type = delegates("_backend", "granularity", "device", "handle_type")
    backend = delegate("_backend.name")
    keeps_fds = delegate(
        "_backend.keeps_fds", "Whether each own run holds an open fd (the host backend's memfds)."
    )

    def _mapped_total(self) -> int:
        return sum(c.size for c in self._chunks)

    def chunks(self) -> list[Chunk]:
        """The mapped runs in address order (a copy): each one physical allocation."""
        self._check_open()
        return list(self._chunks)

    def device_uuid(self) -> str:
        return self._backend.device_uuid()

    # -- the books ---------------------------------------------------------------------------
    def _index(self, books: list[Chunk], chunk: Chunk) -> int:
        """Where ``chunk`` is in ``books`` (address order), or -1."""
        i = bisect.bisect_left(books, chunk.offset, key=offset_key)
        return i if i < len(books) and books[i] == chunk else -1

    def _overlaps_mapped(self, chunk: Chunk) -> Chunk | None:
        """A mapped chunk that overlaps ``chunk``, or None."""
        i = bisect.bisect_left(self._chunks, chunk.offset + chunk.size, key=offset_key) - 1
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


class PeerRegion(_MappedRange):
    """A reservation of a peer region's capacity; the peer's runs are mapped into it, each at
    its owner's offset and of its owner's size.

    Local object; ``close()`` unmaps every run then gives up the reservation (idempotent).
    """

    _what = "PeerRegion"  # built by ``VirtualRegion.open_peer()``: PeerRegion(backend, capacity)

    @property
    def mapped_bytes(self) -> int:
        """Bytes mapped: the sum of the mapped runs (for a prefix: its end)."""
        return self._mapped_total()

    def map_fd(self, fd: int, chunk: Chunk) -> None:
        """Import ``fd`` (one run of the owner, ``chunk.size`` bytes) and map it at
        ``chunk.offset``: anywhere inside the capacity that no mapped run overlaps (a prefix
        grows by mapping at its end). The fd stays the caller's to close."""
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
            bisect.insort(self._chunks, chunk, key=offset_key)

    def unmap_from(self, offset: int) -> list[Chunk]:
        """Unmap every run that starts at or beyond ``offset`` (whole runs only, as the owner's
        ``decommit``); returns them in address order. Raises :class:`UnmapError` when an unmap
        fails (see the module doc)."""
        require_int("unmap_from: offset", offset, lo=0)
        with self._lock:
            self._check_open()
            return self._unmap_if(lambda c: c.offset < offset)

    def unmap_outside(self, ranges: Any) -> list[Chunk]:
        """Unmap every run that overlaps none of ``ranges`` (whole runs only, as the owner's
        ``decommit_outside``); returns them in address order. :class:`UnmapError` as
        ``unmap_from``."""
        with self._lock:
            self._check_open()
            keep = merged(check_ranges("unmap_outside", ranges, self._capacity))
            return self._unmap_if(lambda c: overlaps(keep, c.offset, c.size))
