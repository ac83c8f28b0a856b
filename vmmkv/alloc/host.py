"""Host backend: the region interface on host memory, with real fds and real shared mappings.

Physical chunk = a ``memfd`` of the chunk size; reservation = a ``PROT_NONE`` anonymous mapping of
the full capacity; map = ``mmap(MAP_FIXED | MAP_SHARED)`` of the memfd over a piece of the
reservation; unmap = put a ``PROT_NONE`` anonymous mapping back over the piece (so the hole stays
reserved and no other mapping can land there); export = ``dup`` of the memfd; import = ``dup`` of
the received fd. Any process holding the memfd sees the same bytes, which is what lets the whole
lifecycle (rendezvous, growth, shrink) run in CI without a GPU.

Ownership: ``create`` and ``import_fd`` return a handle (an fd this backend owns); ``map`` always
consumes it (closes it, or keeps it for later export when ``exportable`` is set, until ``unmap``).
Local, never collective; nothing here touches torch's streams. Implements ``backend.Backend``.

An unmapped range (and a whole region after ``close()``) is a ``PROT_NONE`` anonymous mapping:
a stale access through a view faults (SIGSEGV) instead of reaching other memory; the range is
``munmap``-ed only by ``free_reservation``, which is safe on any thread at any time.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import threading

import torch

__all__ = ["HostBackend", "reservations"]

_PROT_NONE = 0x0
_PROT_RW = 0x1 | 0x2
_MAP_SHARED = 0x01
_MAP_PRIVATE = 0x02
_MAP_FIXED = 0x10
_MAP_ANONYMOUS = 0x20
_MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


_reserved: dict[int, int] = {}  # address -> size of every live reservation in this process
_reserved_lock = threading.Lock()


def reservations() -> dict[int, int]:
    """The host reservations this process holds now (address -> size): a leak check."""
    with _reserved_lock:
        return dict(_reserved)


class HostError(OSError):
    """A host-memory system call failed; the message names the call and its arguments."""


def _check_mmap(res: int | None, what: str) -> int:
    if res is None or res == _MAP_FAILED:
        err = ctypes.get_errno()
        raise HostError(err, f"{what} failed: {errno.errorcode.get(err, err)} ({os.strerror(err)})")
    return int(res)


class HostBackend:
    """``backend.Backend`` on host memory (see module doc)."""

    name = "host"
    handle_type = "posix_fd"
    frees_from_any_thread = True  # munmap: no device, no stream capture to disturb

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.granularity = os.sysconf("SC_PAGE_SIZE")
        self._kept: dict[int, int] = {}  # mapped address -> memfd kept for export
        self._lock = threading.Lock()

    def describe(self) -> str:
        return "host memory (memfd)"

    def context(self) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def device_uuid(self) -> str:
        return "host"

    def reserve(self, size: int) -> int:
        res = _mmap(None, size, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        ptr = _check_mmap(res, f"mmap(reserve, size={size})")
        with _reserved_lock:
            _reserved[ptr] = size
        return ptr

    def free_reservation(self, ptr: int, size: int) -> None:
        if _munmap(ptr, size) != 0:
            err = ctypes.get_errno()
            raise HostError(err, f"munmap(ptr={ptr:#x}, size={size}) failed: {os.strerror(err)}")
        with _reserved_lock:
            _reserved.pop(ptr, None)

    def create(self, size: int) -> int:
        fd = os.memfd_create("vmmkv-chunk", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def import_fd(self, fd: int, size: int) -> int:
        if not isinstance(fd, int) or fd < 0:
            raise ValueError(f"import_fd: expected a file descriptor >= 0, got {fd!r}")
        st = os.fstat(fd)
        if st.st_size < size:
            raise ValueError(f"import_fd: fd {fd} holds {st.st_size} bytes, expected >= {size}")
        return os.dup(fd)

    def release(self, handle: int) -> None:
        os.close(handle)

    def map(self, ptr: int, size: int, handle: int, *, exportable: bool = False) -> None:
        try:
            res = _mmap(ptr, size, _PROT_RW, _MAP_SHARED | _MAP_FIXED, handle, 0)
            _check_mmap(res, f"mmap(ptr={ptr:#x}, size={size}, fd={handle})")
        except BaseException:
            os.close(handle)
            raise
        if exportable:
            with self._lock:
                self._kept[ptr] = handle
        else:
            os.close(handle)

    def unmap(self, ptr: int, size: int) -> None:
        with self._lock:
            kept = self._kept.pop(ptr, None)
        try:
            flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE
            _check_mmap(_mmap(ptr, size, _PROT_NONE, flags, -1, 0), f"mmap(unmap ptr={ptr:#x})")
        finally:
            if kept is not None:
                os.close(kept)

    def export(self, ptr: int, size: int) -> int:
        with self._lock:
            fd = self._kept.get(ptr)
        if fd is None:
            raise ValueError(f"export: no exportable chunk is mapped at {ptr:#x}")
        return os.dup(fd)

    def zero(self, ptr: int, size: int) -> None:
        ctypes.memset(ptr, 0, size)

    def synchronize(self) -> None:
        pass

    def is_capturing(self) -> bool:
        return False

    def memory_in_use(self) -> int:
        return 0
