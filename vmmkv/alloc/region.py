"""``VirtualRegion``: a stable virtual address range with a growable committed prefix.

Contract:
- The full capacity is reserved once; ``base_ptr`` never changes for the life of the object, so
  kernels and CUDA graphs captured over the range stay valid while it grows and shrinks.
- ``commit(n)`` grows the committed prefix to ``n`` rounded up to ``chunk_bytes``; new bytes are
  zero on return. ``decommit(n)`` shrinks it to ``n`` rounded up to ``chunk_bytes`` after a device
  synchronize. Both are local (not collective), refuse during CUDA stream capture, and are
  transactional: a failing ``commit`` leaves the region as it was.
- ``tensor(dtype)`` is a view over the whole capacity; only the committed prefix may be touched,
  and every view is invalid after ``close()``. A CUDA graph may be captured over uncommitted
  addresses with kernels (they touch memory only when they run); a memcpy/memset node is
  validated against the range at capture time and fails there.
- There is no ``__del__``: a finalizer could run a device synchronize in the middle of someone's
  graph capture. An unclosed region lives until the process exits (the OS reclaims it).
- ``close()`` is local and idempotent; it finishes every step (synchronize, unmap, release the
  reservation) even when one fails, then raises the first error. It skips driver calls while the
  interpreter is finalizing. Afterwards every method raises :class:`RegionClosedError`.
- ``PeerRegion`` is the importing side: a reservation of a peer's full capacity into which the
  peer's exported chunks are mapped at their offsets (the ipc layer builds peer maps from it).

Ownership: a region owns its reservation and its mappings; physical handles are released right
after mapping (the mapping keeps the memory alive). ``export_chunk`` returns an fd the caller
closes. ``PeerRegion.map_fd`` never closes the fd it is given.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .._util import run_all
from . import driver
from .dlpack import tensor_at
from .host import HostBackend

__all__ = ["Chunk", "PeerRegion", "RegionClosedError", "VirtualRegion", "make_backend", "run_all"]

log = logging.getLogger("vmmkv.alloc")

_MAX_DEFAULT_CHUNK = 1 << 30
_DEFAULT_CHUNKS = 64


class RegionClosedError(RuntimeError):
    """A method was called on a closed region."""


@dataclass(frozen=True)
class Chunk:
    """One committed piece of a region: ``size`` bytes at ``offset`` from the base."""

    offset: int
    size: int


def _resolve_device(device: Any, backend: str) -> tuple[str, int | None]:
    """Returns (backend name, cuda ordinal or None)."""
    if backend not in ("auto", "cuda", "host"):
        raise ValueError(f"backend must be 'auto', 'cuda' or 'host', got {backend!r}")
    if device is None:
        dev = None
    elif isinstance(device, int):
        dev = torch.device("cuda", device)
    elif isinstance(device, (str, torch.device)):
        dev = torch.device(device)
    else:
        raise TypeError(f"device must be None, int, str or torch.device, got {type(device)}")
    if dev is not None and dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be a cuda or cpu device, got {dev}")
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


def make_backend(device: Any = None, backend: str = "auto", handle_type: str = "posix_fd"):
    """The backend object for ``device`` ('auto' picks host when no CUDA device is usable)."""
    name, ordinal = _resolve_device(device, backend)
    if name == "host":
        if handle_type != "posix_fd":
            raise ValueError(f"the host backend only has posix_fd handles, got {handle_type!r}")
        return HostBackend()
    from .cuda import CudaBackend

    return CudaBackend(ordinal, handle_type)


def _check_size(name: str, value: Any, granularity: int, *, allow_zero: bool) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    if value % granularity:
        raise ValueError(
            f"{name}={value} is not a multiple of the allocation granularity {granularity}"
        )
    return value


class _Closeable:
    """Shared closed-state handling and chunk unmapping for the two owners below (each has
    ``_backend``, ``_base`` and ``_chunks``)."""

    _closed = False
    _what = "object"
    _backend: Any
    _base: int
    _chunks: list[Chunk]

    def _unmap(self, chunks: list[Chunk]) -> None:
        """Unmap ``chunks`` last first. A chunk leaves ``_chunks`` only once its own unmap
        succeeded, so a failure leaves it owned (and retried by ``close``). Every chunk is
        attempted; the first error is raised afterwards."""

        def one(c: Chunk) -> None:
            self._backend.unmap(self._base + c.offset, c.size)
            if c in self._chunks:
                self._chunks.remove(c)

        run_all([(lambda c=c: one(c)) for c in reversed(chunks)])

    def _teardown(self, first: list[Callable[[], None]]) -> None:
        """close(): ``first`` steps, unmap everything, free the reservation; every step runs."""
        self._closed = True
        if driver.finalizing():
            return
        steps = [*first, lambda: self._unmap(list(self._chunks))]
        steps.append(lambda: self._backend.free_reservation(self._base, self._capacity))
        run_all(steps)

    def _check_open(self) -> None:
        if self._closed:
            raise RegionClosedError(f"{self._what} is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


class VirtualRegion(_Closeable):
    """Reserved VA of ``capacity_bytes`` on ``device`` with a committed prefix (see module doc)."""

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
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise TypeError(f"capacity_bytes must be an int, got {type(capacity_bytes).__name__}")
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if chunk_bytes is not None and (
            isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int)
        ):
            raise TypeError(f"chunk_bytes must be an int or None, got {type(chunk_bytes)}")
        self._backend = make_backend(device, backend, handle_type)
        gran = self._backend.granularity
        _check_size("capacity_bytes", capacity_bytes, gran, allow_zero=False)
        if chunk_bytes is None:
            per = -(-capacity_bytes // _DEFAULT_CHUNKS)
            chunk_bytes = min(-(-per // gran) * gran, max(gran, _MAX_DEFAULT_CHUNK))
        _check_size("chunk_bytes", chunk_bytes, gran, allow_zero=False)
        if chunk_bytes > capacity_bytes:
            raise ValueError(f"chunk_bytes={chunk_bytes} exceeds capacity_bytes={capacity_bytes}")
        self._capacity = capacity_bytes
        self._chunk = chunk_bytes
        self._chunks: list[Chunk] = []
        self._lock = threading.RLock()
        self._base = self._backend.reserve(capacity_bytes)

    # -- properties -------------------------------------------------------------------------
    @property
    def base_ptr(self) -> int:
        self._check_open()
        return self._base

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def chunk_bytes(self) -> int:
        return self._chunk

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
    def committed_bytes(self) -> int:
        return self._chunks[-1].offset + self._chunks[-1].size if self._chunks else 0

    @property
    def closed(self) -> bool:
        return self._closed

    def chunks(self) -> list[Chunk]:
        """The committed chunks in address order (a copy)."""
        self._check_open()
        return list(self._chunks)

    def device_uuid(self) -> str:
        return self._backend.device_uuid()

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
        return min(-(-nbytes // self._chunk) * self._chunk, self._capacity)

    def _target(self, op: str, nbytes: Any) -> int:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise TypeError(f"{op}: nbytes must be an int, got {type(nbytes).__name__}")
        if not 0 <= nbytes <= self._capacity:
            raise ValueError(f"{op}: nbytes={nbytes} outside [0, capacity={self._capacity}]")
        if self._backend.is_capturing():
            raise RuntimeError(
                f"{op} refused during CUDA stream capture: the region's mappings must not change "
                "while a graph is being captured (grow/shrink before or after capture)"
            )
        return self.round_up(nbytes)

    def commit(self, nbytes: int) -> list[Chunk]:
        """Grow the committed prefix to cover ``nbytes``; returns the chunks added (zeroed)."""
        with self._lock:
            self._check_open()
            target = self._target("commit", nbytes)
            added: list[Chunk] = []
            try:
                with self._backend.context():
                    self._commit_chunks(target, added)
            except BaseException:
                try:  # the commit's own error is the one to raise
                    self._unmap(added)
                except Exception as exc:
                    log.error("%r: rolling back a failed commit: %s", self, exc)
                raise
            self._chunks.extend(added)
            return added

    def _commit_chunks(self, target: int, added: list[Chunk]) -> None:
        """Create, map and zero chunks up to ``target``, recording each in ``added`` as soon
        as it is mapped (so the caller can roll back exactly what exists)."""
        offset = self.committed_bytes
        while offset < target:
            size = min(self._chunk, self._capacity - offset)
            handle = self._backend.create(size)
            self._backend.map(self._base + offset, size, handle, exportable=True)
            added.append(Chunk(offset, size))
            offset += size
        if added:
            start = added[0].offset
            self._backend.zero(self._base + start, offset - start)

    def decommit(self, nbytes: int) -> list[Chunk]:
        """Shrink the committed prefix to ``nbytes`` rounded up to chunks; returns the dropped
        chunks. Synchronizes the device first so no queued kernel touches what goes away."""
        with self._lock:
            self._check_open()
            target = self._target("decommit", nbytes)
            dropped = [c for c in self._chunks if c.offset >= target]
            if not dropped:
                return []
            self._backend.synchronize()
            self._unmap(dropped)
            return dropped

    # -- sharing ---------------------------------------------------------------------------
    def export_chunk(self, chunk: Chunk) -> int:
        """A new fd for a committed chunk; the caller owns it and closes it exactly once."""
        with self._lock:
            self._check_open()
            if chunk not in self._chunks:
                raise ValueError(f"export_chunk: {chunk} is not committed in {self!r}")
            return self._backend.export(self._base + chunk.offset, chunk.size)

    def open_peer(self) -> PeerRegion:
        """A new, empty reservation of this region's capacity for mapping a peer's chunks."""
        self._check_open()
        return PeerRegion(self._backend, self._capacity)

    # -- views -----------------------------------------------------------------------------
    def tensor(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """1-D view over the full capacity (only the committed prefix may be touched)."""
        self._check_open()
        return tensor_at(self._base, self._capacity, dtype, self._backend.device)

    def synchronize(self) -> None:
        self._check_open()
        self._backend.synchronize()

    # -- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._teardown([self._backend.synchronize])


class PeerRegion(_Closeable):
    """A reservation of a peer region's capacity; the peer's chunks are mapped into it.

    Local object; ``close()`` unmaps every chunk then frees the reservation (idempotent).
    """

    _what = "PeerRegion"

    def __init__(self, backend: Any, capacity_bytes: int) -> None:
        self._backend = backend
        self._capacity = capacity_bytes
        self._chunks: list[Chunk] = []
        self._lock = threading.RLock()
        self._base = backend.reserve(capacity_bytes)

    @property
    def base_ptr(self) -> int:
        self._check_open()
        return self._base

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def mapped_bytes(self) -> int:
        return self._chunks[-1].offset + self._chunks[-1].size if self._chunks else 0

    def chunks(self) -> list[Chunk]:
        self._check_open()
        return list(self._chunks)

    def map_fd(self, fd: int, chunk: Chunk) -> None:
        """Import ``fd`` and map it at ``chunk.offset``; chunks must arrive in address order.
        The fd stays the caller's to close."""
        with self._lock:
            self._check_open()
            if chunk.offset != self.mapped_bytes:
                raise ValueError(
                    f"map_fd: chunk at offset {chunk.offset} does not extend the mapped prefix "
                    f"({self.mapped_bytes} bytes)"
                )
            if chunk.size <= 0 or chunk.offset + chunk.size > self._capacity:
                raise ValueError(f"map_fd: {chunk} outside capacity {self._capacity}")
            handle = self._backend.import_fd(fd, chunk.size)
            self._backend.map(self._base + chunk.offset, chunk.size, handle)
            self._chunks.append(chunk)

    def unmap_from(self, offset: int) -> list[Chunk]:
        """Unmap every chunk at or beyond ``offset`` (whole mappings only)."""
        with self._lock:
            self._check_open()
            dropped = [c for c in self._chunks if c.offset >= offset]
            self._unmap(dropped)
            return dropped

    def tensor(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        self._check_open()
        return tensor_at(self._base, self._capacity, dtype, self._backend.device)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._teardown([])
