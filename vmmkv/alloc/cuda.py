"""CUDA backend: VMM physical chunks, VA reservations, mappings with access, fd export/import.

Every call goes through ``driver.call`` (checked; the error names the call, the CUresult, the
device and the sizes) under the device's primary context, so it works from any thread.

Ownership: ``create`` and ``import_fd`` return a ``CUmemGenericAllocationHandle`` that ``map``
always consumes: it maps, grants access, then releases the handle (the mapping keeps the memory
alive); on failure it undoes the map and still releases. ``export`` retains the handle from the
mapped address, exports an fd (the caller owns and closes it) and releases the retained handle.
Local, never collective. ``zero`` and ``synchronize`` must not run during stream capture (the
region refuses growth during capture before reaching them; ``is_capturing`` says what it sees).
Implements ``backend.Backend``. An unmapped range stays reserved: an access to it is an illegal
address fault, never someone else's memory. ``free_reservation`` is a driver call, so frees
triggered by a dying view are deferred by the region layer (``frees_from_any_thread`` False).
"""

from __future__ import annotations

import torch

from .driver import call, cu, nvml_uuid, primary_context
from .fabric import fabric_info

__all__ = ["CudaBackend", "fabric_probe", "nvml_uuid"]  # nvml_uuid: driver's, re-exported

_POSIX_FD = "posix_fd"
_FABRIC = "fabric"


_FABRIC_HANDLE_BYTES = 64  # sizeof(CUmemFabricHandle)


def _handle_enum(handle_type: str):
    if handle_type == _POSIX_FD:
        return cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    if handle_type == _FABRIC:
        return cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
    raise ValueError(f"handle_type must be 'posix_fd' or 'fabric', got {handle_type!r}")


def _alloc_prop(ordinal: int, handle_type: str):
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    prop.requestedHandleTypes = _handle_enum(handle_type)
    return prop


def _attr(ordinal: int, name: str) -> int:
    dev = call(cu.cuDeviceGet, ordinal, device=ordinal)
    return int(
        call(cu.cuDeviceGetAttribute, getattr(cu.CUdevice_attribute, name), dev, device=ordinal)
    )


def fabric_probe(ordinal: int) -> tuple[bool, str]:
    """Can this device create fabric-shareable chunks? Returns (ok, reason when not).

    All three must agree: the device attribute, NVML's fabric state, and a trial ``cuMemCreate``
    of one granule with a fabric handle (released at once). Local; the ipc layer AND-reduces it.
    """
    try:
        with primary_context(ordinal):
            if not _attr(ordinal, "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED"):
                return False, f"device {ordinal}: HANDLE_TYPE_FABRIC_SUPPORTED=0"
    except Exception as exc:
        return False, f"device {ordinal}: attribute query failed: {exc}"
    nvml_reason = _nvml_fabric_state(ordinal)
    if nvml_reason:
        return False, nvml_reason
    try:
        with primary_context(ordinal):
            prop = _alloc_prop(ordinal, _FABRIC)
            gran = int(
                call(
                    cu.cuMemGetAllocationGranularity,
                    prop,
                    cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                    device=ordinal,
                )
            )
            handle = call(cu.cuMemCreate, gran, prop, 0, device=ordinal, handle_type=_FABRIC)
            call(cu.cuMemRelease, handle, device=ordinal)
    except Exception as exc:
        return False, f"device {ordinal}: trial fabric cuMemCreate failed: {exc}"
    return True, ""


def _nvml_fabric_state(ordinal: int) -> str:
    """'' when NVML reports the GPU's fabric registration completed with a success status, else
    the reason (``fabric.fabric_info``'s, naming the device and its UUID; never raises)."""
    info = fabric_info(ordinal)
    if info.state == "completed" and not info.status:
        return ""
    return info.reason


class CudaBackend:
    """``backend.Backend`` on CUDA VMM (see module doc)."""

    name = "cuda"
    # a view can die on any thread, e.g. one in the middle of a global-mode stream capture,
    # where a driver call may be refused and invalidate the capture: defer those frees
    frees_from_any_thread = False
    keeps_fds = False  # a created or imported chunk is a driver handle, not an fd

    def __init__(self, ordinal: int, handle_type: str = _POSIX_FD) -> None:
        self.ordinal = ordinal
        self.device = torch.device("cuda", ordinal)
        self.handle_type = handle_type
        with primary_context(ordinal):
            if not _attr(ordinal, "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"):
                raise RuntimeError(f"device {ordinal} does not support CUDA virtual memory")
            if handle_type == _POSIX_FD and not _attr(
                ordinal, "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"
            ):
                raise RuntimeError(f"device {ordinal} cannot export POSIX fd handles")
            self._prop = _alloc_prop(ordinal, handle_type)
            flags = cu.CUmemAllocationGranularity_flags
            gmin = call(
                cu.cuMemGetAllocationGranularity,
                self._prop,
                flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                device=ordinal,
            )
            grec = call(
                cu.cuMemGetAllocationGranularity,
                self._prop,
                flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                device=ordinal,
            )
            self.granularity = max(int(gmin), int(grec))
            uuid = call(cu.cuDeviceGetUuid, call(cu.cuDeviceGet, ordinal), device=ordinal)
            self._uuid = bytes(uuid.bytes).hex()
        self._access = cu.CUmemAccessDesc()
        self._access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._access.location.id = ordinal
        self._access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE

    def describe(self) -> str:
        return f"cuda:{self.ordinal} ({self.handle_type})"

    def context(self) -> primary_context:
        """One guard around a batch of calls (the nested per-call guards then cost nothing)."""
        return primary_context(self.ordinal)

    def device_uuid(self) -> str:
        return self._uuid

    def reserve(self, size: int) -> int:
        with primary_context(self.ordinal):
            ptr = call(
                cu.cuMemAddressReserve, size, self.granularity, 0, 0, device=self.ordinal, size=size
            )
        return int(ptr)

    def free_reservation(self, ptr: int, size: int) -> None:
        with primary_context(self.ordinal):
            call(cu.cuMemAddressFree, ptr, size, device=self.ordinal, ptr=ptr, size=size)

    def create(self, size: int):
        with primary_context(self.ordinal):
            return call(cu.cuMemCreate, size, self._prop, 0, device=self.ordinal, size=size)

    def import_fd(self, fd: int, size: int):
        if not isinstance(fd, int) or fd < 0:
            raise ValueError(f"import_fd: expected a file descriptor >= 0, got {fd!r}")
        with primary_context(self.ordinal):
            return call(
                cu.cuMemImportFromShareableHandle,
                fd,
                _handle_enum(self.handle_type),
                device=self.ordinal,
                fd=fd,
                size=size,
            )

    def release(self, handle) -> None:
        with primary_context(self.ordinal):
            call(cu.cuMemRelease, handle, device=self.ordinal)

    def map(self, ptr: int, size: int, handle, *, exportable: bool = False) -> None:
        ctx = dict(device=self.ordinal, ptr=ptr, size=size)
        with primary_context(self.ordinal):
            mapped = False
            try:
                call(cu.cuMemMap, ptr, size, 0, handle, 0, **ctx)
                mapped = True
                call(cu.cuMemSetAccess, ptr, size, [self._access], 1, **ctx)
            except BaseException:
                if mapped:
                    try:
                        call(cu.cuMemUnmap, ptr, size, **ctx)
                    except Exception:  # the original error is the one to report
                        pass
                try:
                    call(cu.cuMemRelease, handle, **ctx)
                except Exception:
                    pass
                raise
            call(cu.cuMemRelease, handle, **ctx)

    def unmap(self, ptr: int, size: int) -> None:
        with primary_context(self.ordinal):
            call(cu.cuMemUnmap, ptr, size, device=self.ordinal, ptr=ptr, size=size)

    def export(self, ptr: int, size: int) -> int:
        ctx = dict(device=self.ordinal, ptr=ptr, size=size)
        with primary_context(self.ordinal):
            handle = call(cu.cuMemRetainAllocationHandle, ptr, **ctx)
            try:
                fd = call(
                    cu.cuMemExportToShareableHandle,
                    handle,
                    _handle_enum(self.handle_type),
                    0,
                    **ctx,
                )
            finally:
                call(cu.cuMemRelease, handle, **ctx)
        return int(fd)

    # By-value handles: CUDA fabric handles (CU_MEM_HANDLE_TYPE_FABRIC, 64 bytes, imported on
    # another host of the NVLink domain through IMEX). Written against the driver API; the
    # machines vmmkv was tested on cannot create fabric memory, so this path has not run.
    def export_value(self, ptr: int, size: int, *, tag: str = "") -> bytes:
        if self.handle_type != _FABRIC:
            raise ValueError(
                f"export_value: device {self.ordinal}: handle type {self.handle_type!r} has no "
                "values"
            )
        ctx = dict(device=self.ordinal, ptr=ptr, size=size)
        with primary_context(self.ordinal):
            handle = call(cu.cuMemRetainAllocationHandle, ptr, **ctx)
            try:
                fabric = call(
                    cu.cuMemExportToShareableHandle, handle, _handle_enum(_FABRIC), 0, **ctx
                )
            finally:
                call(cu.cuMemRelease, handle, **ctx)
        value = bytes(fabric.data)
        if len(value) != _FABRIC_HANDLE_BYTES:
            raise RuntimeError(
                f"export_value: a fabric handle of {len(value)} bytes, expected "
                f"{_FABRIC_HANDLE_BYTES} (device {self.ordinal}, ptr {ptr:#x})"
            )
        return value

    def import_value(self, value: bytes, size: int):
        if self.handle_type != _FABRIC:
            raise ValueError(
                f"import_value: device {self.ordinal}: handle type {self.handle_type!r} has no "
                "values"
            )
        if not isinstance(value, bytes):
            raise TypeError(f"import_value: value must be bytes, got {type(value).__name__}")
        if len(value) != _FABRIC_HANDLE_BYTES:
            raise ValueError(
                f"import_value: expected a {_FABRIC_HANDLE_BYTES}-byte fabric handle, got "
                f"{len(value)} bytes"
            )
        fabric = cu.CUmemFabricHandle()
        fabric.data = value
        with primary_context(self.ordinal):
            # the driver reads the 64 bytes at osHandle: cuda-python takes that address as an
            # int (it refuses the CUmemFabricHandle object itself); ``fabric`` outlives the call
            return call(
                cu.cuMemImportFromShareableHandle,
                fabric.getPtr(),
                _handle_enum(_FABRIC),
                device=self.ordinal,
                size=size,
            )

    def release_values(self, tag: str) -> None:
        pass  # a fabric handle is a value: nothing to remove

    def zero(self, ptr: int, size: int) -> None:
        with primary_context(self.ordinal):
            call(cu.cuMemsetD8, ptr, 0, size, device=self.ordinal, ptr=ptr, size=size)
            call(cu.cuCtxSynchronize, device=self.ordinal)

    def synchronize(self) -> None:
        with primary_context(self.ordinal):
            call(cu.cuCtxSynchronize, device=self.ordinal)

    def is_capturing(self) -> bool:
        """Whether the calling thread's current stream on this device is being captured.

        Limitation: a capture on another thread is not seen. CUDA has no query for "any capture
        in progress" (the legacy-stream query only sees blocking streams, and torch captures on
        non-blocking ones), so a resize (``cuMemsetD8`` + ``cuCtxSynchronize``) made while
        another thread captures in global mode fails and invalidates that capture. Callers
        serialize resizes with captures (vmmkv's engine hooks resize between steps, on the
        thread that captures)."""
        with torch.cuda.device(self.ordinal):
            return torch.cuda.is_current_stream_capturing()

    def memory_in_use(self) -> int:
        with primary_context(self.ordinal):
            free, total = call(cu.cuMemGetInfo, device=self.ordinal)
        return int(total) - int(free)
