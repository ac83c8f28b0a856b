"""``Backend``: the interface every memory backend of ``vmmkv.alloc`` implements.

Two implementations: ``CudaBackend`` (``cuda.py``: CUDA VMM) and ``HostBackend`` (``host.py``:
memfd + mmap, so the whole lifecycle runs in CI without a GPU). The region code above talks to
this interface only; a new backend is a new file, never a branch in the region.

Contract for implementations:
- Every method is local (never collective) and may be called from any thread.
- ``create`` and ``import_fd`` return a handle that ``map`` always consumes, on success and on
  failure. ``export`` returns a new fd that the caller closes exactly once; ``import_fd`` never
  closes the fd it is given.
- ``unmap`` leaves the range reserved and inaccessible (an access faults); on failure the
  mapping is left as it was, so the caller can keep it on its books and retry.
- By-value handles (``handle_type`` ``"fabric"`` on CUDA, ``"shm_name"``, the host simulation;
  ``"posix_fd"`` has none): ``export_value(ptr, size, tag=...)`` returns the chunk mapped at
  ``ptr`` as ``bytes`` that can travel through any channel (the group's store: no socket, no
  fd); ``import_value(value, size)`` returns a handle that ``map`` consumes, like
  ``import_fd``. ``release_values(tag)`` drops whatever exports under ``tag`` left behind, by
  any process (host simulation: the names in ``/dev/shm``; CUDA: nothing, a fabric handle
  holds no resource); the exchange calls it on every rank once every importer mapped the
  chunks, and on every failure path. ``tag``: letters and digits, unique per exchange.
- ``free_reservation`` gives a reserved range back; it is called only once every mapping in the
  range is gone. ``frees_from_any_thread`` says whether that call is safe at any moment on any
  thread (a DLPack deleter may make it); when False the region layer defers such frees to its
  next safe point (see ``reservation.py``).
- ``zero`` and ``synchronize`` are device work: they must not run during a stream capture, which
  ``is_capturing`` reports (for the calling thread; see each backend for the limits).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Backend", "Handle"]

Handle = Any  # an fd (host) or a CUmemGenericAllocationHandle (CUDA); opaque to the region


@runtime_checkable
class Backend(Protocol):
    name: str
    handle_type: str
    device: torch.device
    granularity: int
    frees_from_any_thread: bool
    keeps_fds: bool  # one open fd per committed own chunk (counted in vmmkv.ipc.fdbudget)

    def describe(self) -> str:
        """A short human description for reprs and errors (device, handle type)."""
        ...

    def context(self) -> AbstractContextManager[Any]:
        """A guard around a batch of calls (CUDA: the primary context made current once)."""
        ...

    def device_uuid(self) -> str: ...

    def reserve(self, size: int) -> int:
        """Reserve ``size`` bytes of address space (inaccessible); returns the base address."""
        ...

    def free_reservation(self, ptr: int, size: int) -> None: ...

    def create(self, size: int) -> Handle:
        """A new physical chunk of ``size`` bytes, exportable as this backend's handle type."""
        ...

    def import_fd(self, fd: int, size: int) -> Handle: ...

    def release(self, handle: Handle) -> None: ...

    def map(self, ptr: int, size: int, handle: Handle, *, exportable: bool = False) -> None: ...

    def unmap(self, ptr: int, size: int) -> None: ...

    def export(self, ptr: int, size: int) -> int: ...

    def export_value(self, ptr: int, size: int, *, tag: str = "") -> bytes:
        """The chunk mapped at ``ptr`` as a by-value handle (see the module doc)."""
        ...

    def import_value(self, value: bytes, size: int) -> Handle:
        """A handle for a peer's by-value export; ``map`` consumes it."""
        ...

    def release_values(self, tag: str) -> None:
        """Drop what the by-value exports under ``tag`` left behind (idempotent)."""
        ...

    def zero(self, ptr: int, size: int) -> None: ...

    def synchronize(self) -> None: ...

    def is_capturing(self) -> bool: ...

    def memory_in_use(self) -> int: ...
