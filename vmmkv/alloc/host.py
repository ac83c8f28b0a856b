"""Host backend: the region interface on host memory, with real fds and real shared mappings.

Physical chunk = a ``memfd`` of the chunk size; reservation = a ``PROT_NONE`` anonymous mapping of
the full capacity; map = ``mmap(MAP_FIXED | MAP_SHARED)`` of the memfd over a piece of the
reservation; unmap = put a ``PROT_NONE`` anonymous mapping back over the piece (so the hole stays
reserved and no other mapping can land there); export = ``dup`` of the memfd; import = ``dup`` of
the received fd. Any process holding the memfd sees the same bytes, which is what lets the whole
lifecycle (rendezvous, growth, shrink) run in CI without a GPU.

Handle type ``"shm_name"`` (the simulation of by-value handles, e.g. CUDA fabric handles): a chunk
is an unnamed tmpfs file (``O_TMPFILE`` in ``/dev/shm``); ``export_value(ptr, size, tag=T)``
links it under the name ``/dev/shm/vmmkv-T-<random>`` and returns that name (the "handle
value": bytes, no fd); ``import_value`` opens the name. The name is the only thing that can
leak: the exchange that exported it removes every name of its tag with
``release_values(T)`` once every importer mapped it, and on every failure path, on every
rank (a dead exporter's names are removed by the survivors: the tag is the exchange's nonce).
A chunk can be exported by value once (the kernel links an ``O_TMPFILE`` file once); the
protocols export each chunk once (a rendezvous its committed chunks, a grow its new chunks).

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
import glob
import os
import re
import secrets
import threading

import torch

__all__ = ["SHM_DIR", "HostBackend", "reservations", "shm_names"]

SHM_DIR = "/dev/shm"
_NAME_PREFIX = "vmmkv-"
_TAG = re.compile(r"[0-9A-Za-z]{1,64}")
_VALUE = re.compile(r"vmmkv-[0-9A-Za-z]{1,64}-[0-9a-f]{16}")


def shm_names(tag: str = "") -> list[str]:
    """The by-value names (``/dev/shm/vmmkv-<tag>-*``) that exist now: a leak check."""
    return sorted(glob.glob(os.path.join(SHM_DIR, f"{_NAME_PREFIX}{tag}*")))


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
    frees_from_any_thread = True  # munmap: no device, no stream capture to disturb
    # One memfd per committed own chunk, kept for later exports: each chunk is a file of its
    # own, as each CUDA chunk is a physical allocation of its own (vmmkv.ipc.fdbudget).
    keeps_fds = True

    def __init__(self, handle_type: str = "posix_fd") -> None:
        if handle_type not in ("posix_fd", "shm_name"):
            raise ValueError(
                f"the host backend has handle types 'posix_fd' and 'shm_name', got {handle_type!r}"
            )
        self.handle_type = handle_type
        self.device = torch.device("cpu")
        self.granularity = os.sysconf("SC_PAGE_SIZE")
        self._kept: dict[int, int] = {}  # mapped address -> memfd kept for export
        self._lock = threading.Lock()

    def describe(self) -> str:
        return "host memory (" + ("memfd" if self.handle_type == "posix_fd" else "shm_name") + ")"

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
        if self.handle_type == "shm_name":
            fd = os.open(SHM_DIR, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        else:
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

    def export_value(self, ptr: int, size: int, *, tag: str = "") -> bytes:
        """The chunk mapped at ``ptr`` as a name in ``/dev/shm`` (see the module doc); the
        caller removes it with ``release_values(tag)``."""
        if self.handle_type != "shm_name":
            raise ValueError(f"export_value: handle type {self.handle_type!r} has no values")
        if not _TAG.fullmatch(tag):
            raise ValueError(f"export_value: tag must be 1-64 letters/digits, got {tag!r}")
        with self._lock:
            fd = self._kept.get(ptr)
        if fd is None:
            raise ValueError(f"export_value: no exportable chunk is mapped at {ptr:#x}")
        name = f"{_NAME_PREFIX}{tag}-{secrets.token_hex(8)}"
        # Linked through a directory fd: /dev/shm may be mounted twice (a path link gets EXDEV).
        d = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=d, follow_symlinks=True)
        except OSError as exc:
            raise HostError(
                exc.errno, f"export_value: linking the chunk at {ptr:#x} as {name} failed: {exc}"
            ) from exc
        finally:
            os.close(d)
        return name.encode()

    def import_value(self, value: bytes, size: int) -> int:
        """Open the chunk named ``value`` (from a peer's ``export_value``); a handle (an fd)
        that ``map`` consumes."""
        if not isinstance(value, bytes):
            raise TypeError(f"import_value: value must be bytes, got {type(value).__name__}")
        name = value.decode("ascii", "replace")
        if not _VALUE.fullmatch(name):
            raise ValueError(f"import_value: not a vmmkv shm name: {value[:80]!r}")
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            raise HostError(exc.errno, f"import_value: opening {name} failed: {exc}") from exc
        try:
            held = os.fstat(fd).st_size
            if held < size:
                raise ValueError(f"import_value: {name} holds {held} bytes, expected >= {size}")
        except BaseException:
            os.close(fd)  # a refused import keeps nothing open
            raise
        return fd

    def release_values(self, tag: str) -> None:
        """Remove every name exported under ``tag`` (by any process; absent names are fine)."""
        if not _TAG.fullmatch(tag):
            raise ValueError(f"release_values: tag must be 1-64 letters/digits, got {tag!r}")
        for path in shm_names(f"{tag}-"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def zero(self, ptr: int, size: int) -> None:
        ctypes.memset(ptr, 0, size)

    def synchronize(self) -> None:
        pass

    def is_capturing(self) -> bool:
        return False

    def memory_in_use(self) -> int:
        return 0
