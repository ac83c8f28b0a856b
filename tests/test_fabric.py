"""NVLink fabric domain info (vmmkv.alloc.fabric) without a GPU, and whatever NVML is there.

The NVML answers are played by ``FakeNvml``: it replaces the calls ``fabric_info`` makes (init,
shutdown, handle by UUID, the two fabric info calls) and, like the C library, writes the answer
into the caller's memory at the offsets nvml.h gives (written out here, independently of
vmmkv's and nvidia-ml-py's structs), after poisoning every byte of it; errors and their texts
are the real pynvml ones. The CUDA side of the lookup is injected too (``one_gpu``), so these
tests read the same on a CPU box and on a GPU box with a real driver and NVML; the two that
check the real libraries' absence skip where those are present.
"""

from __future__ import annotations

import ctypes
import re
import sys
import uuid

import pynvml
import pytest

from vmmkv.alloc import driver, fabric
from vmmkv.alloc.fabric import FABRIC_STATES, FabricInfo, boot_id, domain_key, fabric_info

DEV_UUID = "GPU-0badc0de-1234-5678-9abc-def012345678"
CLUSTER = uuid.UUID("3f1c2b4a-5d6e-4f70-8192-a3b4c5d6e7f8")

# nvml.h: nvmlGpuFabricInfo_v2_t {version; clusterUuid[16]; status; cliqueId; state (uchar);
# healthMask} and nvmlGpuFabricInfo_t {clusterUuid[16]; status; cliqueId; state (uchar)}:
# (size, version word, offsets of clusterUuid, status, cliqueId, state)
V2_LAYOUT = (36, 0x02000024, 4, 20, 24, 28)
LEGACY_LAYOUT = (28, None, 0, 16, 20, 24)
POISON = 0xAB


def _nvml_library_loads() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


class FakeNvml:
    NVMLError = pynvml.NVMLError

    def __init__(
        self, state=3, status=0, cluster=CLUSTER.bytes, clique=7, error=None, v=None, init=None
    ):
        self.answer = (state, status, cluster, clique)
        self.error, self.v, self.init = error, v, init
        self.open, self.uuids, self.calls = 0, [], []

    def nvmlInit(self):
        if self.init is not None:  # the library refused to start with this NVML error
            raise pynvml.NVMLError(self.init)
        self.open += 1

    def nvmlShutdown(self):
        self.open -= 1

    def nvmlDeviceGetHandleByUUID(self, u):
        self.uuids.append(u)
        return ("handle", u)

    def _fill(self, ref, layout):
        """Check the caller's buffer as the library would, then write the answer at nvml.h's
        offsets over poisoned memory (padding included)."""
        size, version, o_uuid, o_status, o_clique, o_state = layout
        assert self.open == 1, "queried outside an NVML session"
        addr, room = ctypes.addressof(ref._obj), ctypes.sizeof(ref._obj)
        assert room >= size, f"a {room}-byte buffer for a {size}-byte struct"
        if version is not None:
            assert ctypes.c_uint.from_address(addr).value == version, "wrong struct version"
        if self.error is not None:
            raise pynvml.NVMLError(self.error)
        state, status, raw, clique = self.answer
        head = 0 if version is None else 4  # the version word is the caller's
        ctypes.memset(addr + head, POISON, size - head)
        ctypes.memmove(addr + o_uuid, raw, len(raw))
        ctypes.c_uint.from_address(addr + o_status).value = status
        ctypes.c_uint.from_address(addr + o_clique).value = clique
        ctypes.c_ubyte.from_address(addr + o_state).value = state

    def nvmlDeviceGetGpuFabricInfoV(self, handle, ref):
        self.calls.append(("V", ctypes.sizeof(ref._obj)))
        if self.v is not None:  # the versioned call refused with this NVML error
            raise pynvml.NVMLError(self.v)
        self._fill(ref, V2_LAYOUT)

    def nvmlDeviceGetGpuFabricInfo(self, handle, ref):
        self.calls.append(("legacy", ctypes.sizeof(ref._obj)))
        self._fill(ref, LEGACY_LAYOUT)


@pytest.fixture
def one_gpu(monkeypatch):
    """CUDA device 0 maps to the NVML device DEV_UUID (the CUDA side of the lookup)."""
    monkeypatch.setattr(fabric, "_cuda_uuid", lambda i: (DEV_UUID, ""))


def test_boot_id_is_the_kernel_boot_id():
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert boot_id() == f.read().strip() != ""


@pytest.mark.skipif(driver.cuda_usable(), reason="checks the machine without a CUDA driver")
def test_without_cuda_the_state_is_unknown_with_the_reason_and_the_key_is_the_host():
    info = fabric_info(0)
    assert (info.state, info.cluster_uuid, info.clique_id, info.usable) == (
        "unknown",
        None,
        None,
        False,
    )
    assert info.reason.startswith("device 0: no usable CUDA device"), info.reason
    assert domain_key(0) == f"host:{boot_id()}"


@pytest.mark.parametrize("bad", ["0", 1.0, True, None])
def test_a_device_index_that_is_not_an_int_is_a_type_error(bad):
    with pytest.raises(TypeError, match="device_index must be an int"):
        fabric_info(bad)
    with pytest.raises(TypeError, match="device_index must be an int"):
        domain_key(bad)


def test_a_negative_device_index_is_a_value_error():
    with pytest.raises(ValueError, match="device_index must be >= 0, got -1"):
        fabric_info(-1)


def test_a_device_index_past_the_cuda_count_is_a_value_error(monkeypatch):
    monkeypatch.setattr(driver, "cuda_usable", lambda: True)
    monkeypatch.setattr(driver, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="< the CUDA device count 2, got 2"):
        fabric_info(2, nvml=FakeNvml())


def test_nvml_that_cannot_start_is_state_unknown_not_an_error(one_gpu):
    nvml = FakeNvml(init=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    info = fabric_info(0, nvml=nvml)
    assert (info.state, info.cluster_uuid, info.clique_id) == ("unknown", None, None)
    assert info.reason.startswith(f"device 0 ({DEV_UUID}): NVML unavailable"), info.reason
    assert "Library Not Found" in info.status and nvml.open == 0 and nvml.calls == []
    nvml = FakeNvml(init=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    assert domain_key(0, nvml=nvml) == f"host:{boot_id()}"


@pytest.mark.skipif(_nvml_library_loads(), reason="checks a machine without libnvidia-ml")
def test_the_real_nvml_library_missing_is_state_unknown_not_an_error(one_gpu):
    info = fabric_info(0)  # the real pynvml, which finds no libnvidia-ml here
    assert (info.state, info.cluster_uuid, info.clique_id) == ("unknown", None, None)
    assert info.reason.startswith(f"device 0 ({DEV_UUID}): NVML unavailable"), info.reason
    assert "Library Not Found" in info.status
    assert domain_key(0) == f"host:{boot_id()}"


def test_pynvml_not_importable_is_state_unknown_with_the_reason(one_gpu, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    info = fabric_info(0)
    assert info.state == "unknown" and not info.usable
    assert "pynvml (nvidia-ml-py) is not importable" in info.reason, info.reason


def test_a_completed_fabric_gives_the_canonical_cluster_uuid_clique_and_nvlink_key(one_gpu):
    nvml = FakeNvml(state=pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, clique=7)
    info = fabric_info(0, nvml=nvml)
    assert info == FabricInfo(0, "completed", str(CLUSTER), 7, "", "")
    assert info.usable and re.fullmatch(
        r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", info.cluster_uuid
    )
    # looked up by the CUDA device's UUID, through the versioned call, and NVML closed again
    assert nvml.uuids == [DEV_UUID] and nvml.open == 0
    assert nvml.calls == [("V", V2_LAYOUT[0])]
    assert domain_key(0, nvml=FakeNvml(clique=7)) == f"nvlink:{CLUSTER}:7"
    assert domain_key(0, nvml=FakeNvml(clique=8)) != domain_key(0, nvml=nvml)


@pytest.mark.parametrize(
    "refusal", [pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH]
)
def test_a_driver_without_the_versioned_call_is_read_through_the_legacy_one(one_gpu, refusal):
    nvml = FakeNvml(clique=3, v=refusal)
    assert fabric_info(0, nvml=nvml) == FabricInfo(0, "completed", str(CLUSTER), 3, "", "")
    assert nvml.calls == [("V", V2_LAYOUT[0]), ("legacy", LEGACY_LAYOUT[0])] and nvml.open == 0


@pytest.mark.parametrize(
    "code, state, words",
    [
        (pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, "not_supported", "no NVLink fabric"),
        (pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED, "not_started", "has not started"),
        (pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS, "in_progress", "still in progress"),
        (99, "unknown", "unknown fabric state 99"),
    ],
)
def test_a_fabric_that_is_not_completed_has_no_cluster_and_says_why(one_gpu, code, state, words):
    nvml = FakeNvml(state=code)
    info = fabric_info(0, nvml=nvml)
    assert state in FABRIC_STATES
    assert (info.state, info.cluster_uuid, info.clique_id, info.usable) == (
        state,
        None,
        None,
        False,
    )
    assert info.reason.startswith(f"device 0 ({DEV_UUID}): ") and words in info.reason
    assert nvml.open == 0
    assert domain_key(0, nvml=FakeNvml(state=code)) == f"host:{boot_id()}"


def test_nvml_not_supported_error_is_the_not_supported_state(one_gpu):
    nvml = FakeNvml(error=pynvml.NVML_ERROR_NOT_SUPPORTED)
    info = fabric_info(0, nvml=nvml)
    assert (info.state, info.cluster_uuid, info.status) == ("not_supported", None, "Not Supported")
    assert "no GPU fabric info for this device" in info.reason and nvml.open == 0


def test_another_nvml_error_is_state_unknown_naming_the_error(one_gpu):
    nvml = FakeNvml(error=pynvml.NVML_ERROR_GPU_IS_LOST)
    info = fabric_info(0, nvml=nvml)
    assert info.state == "unknown" and not info.usable and nvml.open == 0
    assert "NVML fabric query failed: NVMLError_GpuIsLost: GPU is lost" in info.reason


def test_a_completed_registration_with_an_error_status_is_not_usable(one_gpu):
    info = fabric_info(0, nvml=FakeNvml(status=pynvml.NVML_ERROR_NO_PERMISSION))
    assert (info.state, info.cluster_uuid, info.clique_id) == ("completed", None, None)
    assert info.status == f"Insufficient Permissions (NVML code {pynvml.NVML_ERROR_NO_PERMISSION})"
    assert "completed with an error: Insufficient Permissions" in info.reason
    assert domain_key(0, nvml=FakeNvml(status=pynvml.NVML_ERROR_NO_PERMISSION)).startswith("host:")


def test_a_completed_fabric_with_a_zero_cluster_uuid_is_not_usable(one_gpu):
    info = fabric_info(0, nvml=FakeNvml(cluster=bytes(16)))
    assert not info.usable and "zero cluster UUID" in info.reason


@pytest.mark.parametrize(
    "answer, passes",
    [
        (dict(), True),
        (dict(cluster=bytes(16)), True),  # no domain key, but the trial create decides
        (dict(status=pynvml.NVML_ERROR_NO_PERMISSION), False),
        (dict(state=pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED), False),
        (dict(state=pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS), False),
        (dict(error=pynvml.NVML_ERROR_GPU_IS_LOST), False),
    ],
)
def test_the_fabric_probes_nvml_gate_passes_a_completed_registration_with_a_success_status(
    one_gpu, monkeypatch, answer, passes
):
    from vmmkv.alloc.cuda import _nvml_fabric_state

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(**answer))  # what fabric_info imports
    why = _nvml_fabric_state(0)
    expected = fabric_info(0, nvml=FakeNvml(**answer))
    assert why == ("" if passes else expected.reason), (why, expected)
    assert passes or why.startswith(f"device 0 ({DEV_UUID}): NVML"), why


# CudaBackend's by-value calls, with the driver calls recorded (no GPU needed)


@pytest.fixture
def fabric_backend(monkeypatch):
    """A CudaBackend for device 0 with fabric handles whose driver calls are recorded; the
    import reads the 64 bytes at the address it is given, as the driver does."""
    import contextlib

    from vmmkv.alloc import cuda

    be = object.__new__(cuda.CudaBackend)
    be.ordinal, be.handle_type = 0, "fabric"
    calls, exported = [], cuda.cu.CUmemFabricHandle()
    exported.data = bytes(range(100, 164))

    def call(fn, *args, **ctx):
        if fn is cuda.cu.cuMemImportFromShareableHandle:
            addr, kind = args
            calls.append(("import", ctypes.string_at(addr, 64), kind, ctx))
            return "imported"
        calls.append((fn, args, ctx))
        return {cuda.cu.cuMemRetainAllocationHandle: "retained"}.get(fn, exported)

    monkeypatch.setattr(cuda, "primary_context", lambda i: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "call", call)
    return be, calls, cuda.cu


def test_a_cuda_fabric_handle_is_imported_from_the_64_bytes_at_the_address_passed(
    fabric_backend,
):
    be, calls, cu = fabric_backend
    value = bytes((7 * i + 3) % 256 for i in range(64))
    assert be.import_value(value, 1 << 21) == "imported"
    [(what, read, kind, ctx)] = calls
    fabric = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
    assert (what, read, kind, ctx) == ("import", value, fabric, {"device": 0, "size": 1 << 21})


def test_a_cuda_fabric_export_is_the_drivers_64_bytes_and_releases_the_retained_handle(
    fabric_backend,
):
    be, calls, cu = fabric_backend
    assert be.export_value(0x7000_0000, 1 << 21, tag="t") == bytes(range(100, 164))
    fns = [c[0] for c in calls]
    assert fns == [cu.cuMemRetainAllocationHandle, cu.cuMemExportToShareableHandle, cu.cuMemRelease]
    assert calls[2][1] == ("retained",) and calls[2][2]["device"] == 0


def test_cuda_by_value_calls_refuse_bad_values_and_fd_backends_naming_the_device(fabric_backend):
    be, calls, _ = fabric_backend
    with pytest.raises(TypeError, match="value must be bytes, got str"):
        be.import_value("x" * 64, 1)
    with pytest.raises(ValueError, match="64-byte fabric handle, got 63 bytes"):
        be.import_value(bytes(63), 1)
    be.handle_type = "posix_fd"
    with pytest.raises(ValueError, match="device 0: handle type 'posix_fd' has no values"):
        be.export_value(0, 1)
    with pytest.raises(ValueError, match="device 0: handle type 'posix_fd' has no values"):
        be.import_value(bytes(64), 1)
    assert calls == []
