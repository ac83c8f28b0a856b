"""Which NVLink fabric domain a GPU belongs to, read from NVML.

Contract:
- ``fabric_info(device_index)`` reads NVML's GPU fabric info for the CUDA device
  ``device_index`` and returns a :class:`FabricInfo`. Local, never collective, no CUDA context
  work beyond the UUID lookup, not for use during stream capture.
- The CUDA ordinal is mapped to the NVML device by UUID (``driver.nvml_uuid``), never by index:
  NVML numbers GPUs in PCI order and ignores ``CUDA_VISIBLE_DEVICES``.
- "Not available" never raises: no usable CUDA device, pynvml not importable, NVML library
  missing or failing, ``NVML_ERROR_NOT_SUPPORTED``, a fabric that is not (yet) registered, a
  registration that failed. Each comes back as a ``state`` and a ``reason`` naming the device.
  Only bad arguments raise: ``TypeError`` for a non-int index, ``ValueError`` for a negative
  one or one at or past the CUDA device count.
- ``FabricInfo.usable`` is True exactly when NVML reports the registration ``completed`` with a
  success status and a non-zero cluster UUID; then ``cluster_uuid`` (canonical lowercase
  8-4-4-4-12) and ``clique_id`` are set and ``reason`` is "". Otherwise both are None and
  ``reason`` says why (a ``completed`` state whose status is an error is not usable).
- ``domain_key(device_index)`` names the memory-sharing domain of the device:
  ``"nvlink:<cluster_uuid>:<clique_id>"`` when the fabric is usable, else ``"host:<boot id>"``
  (``boot_id()``: the kernel boot id, or the host name where /proc lacks it). Two GPUs with
  equal keys are in one domain; the key says nothing about whether fabric handles are
  permitted (IMEX channel), which only a trial allocation (``cuda.fabric_probe``) shows.
- NVML is initialised and shut down around each query (NVML counts nested inits), so a
  caller's own NVML session is left as it was.
- ``nvml=`` (keyword, default: the ``pynvml`` module of nvidia-ml-py) accepts any object with
  its names ``nvmlInit``, ``nvmlShutdown``, ``nvmlDeviceGetHandleByUUID``,
  ``nvmlDeviceGetGpuFabricInfoV`` (optional), ``nvmlDeviceGetGpuFabricInfo`` and ``NVMLError``;
  tests pass a stand-in, since the real NVML needs a driver. The fabric info structs are this
  module's own, laid out as nvml.h lays them out (``nvmlGpuFabricInfo_v2_t``, and
  ``nvmlGpuFabricInfo_t`` for drivers without the versioned call): nvidia-ml-py's mirrors of
  them have differed between its releases (older ones keep the 535 header's ``char``
  cluster UUID and ``partitionId``, and read ``char`` arrays as text).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import socket
import uuid
from typing import Any

from .._util import require_int
from . import driver as drv

log = logging.getLogger(__name__)

__all__ = ["FABRIC_STATES", "FabricInfo", "boot_id", "domain_key", "fabric_info"]

# NVML_GPU_FABRIC_STATE_* values (nvml.h): 0 not supported, 1 not started, 2 in progress,
# 3 completed; written out so that an unknown value from a newer driver reads "unknown"
_STATE_NAMES = {0: "not_supported", 1: "not_started", 2: "in_progress", 3: "completed"}
FABRIC_STATES = ("completed", "in_progress", "not_started", "not_supported", "unknown")
_NVML_SUCCESS = 0
_NVML_ERROR_NOT_SUPPORTED = 3
_NVML_ERROR_FUNCTION_NOT_FOUND = 13
_NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
# the versioned call is absent (older driver) or refuses the struct version we send
_TRY_LEGACY = (_NVML_ERROR_FUNCTION_NOT_FOUND, _NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
_FABRIC_UUID_LEN = 16  # NVML_GPU_FABRIC_UUID_LEN


class _FabricInfoV1(ctypes.Structure):
    """nvml.h ``nvmlGpuFabricInfo_t`` (the legacy call's struct)."""

    _fields_ = [
        ("clusterUuid", ctypes.c_ubyte * _FABRIC_UUID_LEN),
        ("status", ctypes.c_uint),  # nvmlReturn_t
        ("cliqueId", ctypes.c_uint),
        ("state", ctypes.c_ubyte),  # nvmlGpuFabricState_t is an unsigned char
    ]


class _FabricInfoV2(ctypes.Structure):
    """nvml.h ``nvmlGpuFabricInfo_v2_t`` (the versioned call's struct), version word set."""

    _fields_ = [
        ("version", ctypes.c_uint),
        ("clusterUuid", ctypes.c_ubyte * _FABRIC_UUID_LEN),
        ("status", ctypes.c_uint),
        ("cliqueId", ctypes.c_uint),
        ("state", ctypes.c_ubyte),
        ("healthMask", ctypes.c_uint),
    ]

    def __init__(self) -> None:
        # NVML_STRUCT_VERSION(GpuFabricInfo, 2): the struct's size | (2 << 24)
        super().__init__(version=ctypes.sizeof(_FabricInfoV2) | (2 << 24))


@dataclasses.dataclass(frozen=True)
class FabricInfo:
    """One device's NVLink fabric registration as NVML reports it (see module doc)."""

    device_index: int
    state: str
    cluster_uuid: str | None
    clique_id: int | None
    status: str
    reason: str

    @property
    def usable(self) -> bool:
        return self.cluster_uuid is not None


def boot_id() -> str:
    """This kernel's boot id (/proc/sys/kernel/random/boot_id); the host name where it is absent.

    Processes with equal boot ids run on one booted host (one kernel), even across containers."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def _cuda_uuid(device_index: int) -> tuple[str | None, str]:
    """(NVML spelling of the device's UUID, "") or (None, why not). ValueError past the count."""
    if not drv.cuda_usable():
        return None, f"no usable CUDA device: {drv.why_no_cuda()}"
    n = drv.device_count()
    if device_index >= n:
        raise ValueError(f"device_index must be < the CUDA device count {n}, got {device_index}")
    try:
        return drv.nvml_uuid(device_index), ""
    except Exception as exc:
        return None, f"UUID lookup failed: {exc}"


def _status_text(nvml: Any, code: int) -> str:
    if code == _NVML_SUCCESS:
        return ""
    try:  # pynvml names the known codes without asking the library
        text = str(nvml.NVMLError(code))
    except Exception:
        text = "unknown NVML error"
    return f"{text} (NVML code {code})"


def _query(nvml: Any, handle: Any) -> _FabricInfoV1 | _FabricInfoV2:
    """The fabric info struct: the versioned call where the driver has it, else the legacy one."""
    getter = getattr(nvml, "nvmlDeviceGetGpuFabricInfoV", None)
    if getter is not None:
        info = _FabricInfoV2()
        try:
            getter(handle, ctypes.byref(info))
            return info
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) not in _TRY_LEGACY:
                raise
    legacy = _FabricInfoV1()
    nvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(legacy))
    return legacy


def _unusable(device_index: int, state: str, status: str, reason: str) -> FabricInfo:
    """A registration with no cluster; ``reason`` (naming the device) says why."""
    return FabricInfo(device_index, state, None, None, status, reason)


def _interpret(
    device_index: int, where: str, info: _FabricInfoV1 | _FabricInfoV2, nvml: Any
) -> FabricInfo:
    state = _STATE_NAMES.get(int(info.state), "unknown")
    status = _status_text(nvml, int(info.status)) if state == "completed" else ""
    if state != "completed":
        reason = {
            "not_supported": "NVML reports no NVLink fabric for this GPU (state not_supported)",
            "not_started": "NVML: the fabric registration has not started (state not_started)",
            "in_progress": "NVML: the fabric registration is still in progress (state in_progress)",
        }.get(state, f"NVML reports an unknown fabric state {int(info.state)}")
        return _unusable(device_index, state, status, f"{where}: {reason}")
    if status:
        why = f"NVML: the fabric registration completed with an error: {status}"
        return _unusable(device_index, state, status, f"{where}: {why}")
    raw = bytes(info.clusterUuid)
    if not any(raw):
        why = "NVML reports a completed fabric with a zero cluster UUID"
        return _unusable(device_index, state, status, f"{where}: {why}")
    return FabricInfo(device_index, state, str(uuid.UUID(bytes=raw)), int(info.cliqueId), "", "")


def fabric_info(device_index: int, *, nvml: Any = None) -> FabricInfo:
    """The NVLink fabric registration of CUDA device ``device_index`` (see module doc). Local."""
    require_int("device_index", device_index, lo=0)
    dev_uuid, why = _cuda_uuid(device_index)
    where = f"device {device_index}" + (f" ({dev_uuid})" if dev_uuid else "")
    if dev_uuid is None:
        return _unusable(device_index, "unknown", "", f"{where}: {why}")
    if nvml is None:
        try:
            import pynvml as nvml
        except Exception as exc:
            why = f"pynvml (nvidia-ml-py) is not importable: {exc}"
            return _unusable(device_index, "unknown", "", f"{where}: {why}")
    try:
        nvml.nvmlInit()
    except Exception as exc:
        why = f"NVML unavailable: {type(exc).__name__}: {exc}"
        return _unusable(device_index, "unknown", str(exc), f"{where}: {why}")
    try:
        handle = nvml.nvmlDeviceGetHandleByUUID(dev_uuid)
        return _interpret(device_index, where, _query(nvml, handle), nvml)
    except Exception as exc:
        if getattr(exc, "value", None) == _NVML_ERROR_NOT_SUPPORTED:
            why = f"NVML has no GPU fabric info for this device ({exc})"
            return _unusable(device_index, "not_supported", str(exc), f"{where}: {why}")
        why = f"NVML fabric query failed: {type(exc).__name__}: {exc}"
        return _unusable(device_index, "unknown", str(exc), f"{where}: {why}")
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception as exc:  # the answer is already read; a failed shutdown changes nothing
            log.debug("vmmkv: nvmlShutdown failed after the fabric query: %s", exc)


def domain_key(device_index: int, *, nvml: Any = None) -> str:
    """``"nvlink:<cluster_uuid>:<clique_id>"`` for a usable fabric, else ``"host:<boot id>"``."""
    info = fabric_info(device_index, nvml=nvml)
    if info.usable:
        return f"nvlink:{info.cluster_uuid}:{info.clique_id}"
    return f"host:{boot_id()}"
