"""NVLink fabric domain info (vmmkv.alloc.fabric) without a GPU.

The real NVML needs a driver, so the NVML answers are played by ``FakeNvml``: it replaces only
the four calls ``fabric_info`` makes (init, shutdown, handle by UUID, fabric info) and fills the
real nvidia-ml-py structs; errors and their texts are the real pynvml ones. The paths where NVML
or CUDA is absent run against the real libraries of this CPU machine.
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


class FakeNvml:
    NVMLError = pynvml.NVMLError
    c_nvmlGpuFabricInfoV_t = pynvml.c_nvmlGpuFabricInfoV_t
    c_nvmlGpuFabricInfo_t = pynvml.c_nvmlGpuFabricInfo_t

    def __init__(self, state=3, status=0, cluster=CLUSTER.bytes, clique=7, error=None, v=None):
        self.answer = (state, status, cluster, clique)
        self.error, self.v = error, v
        self.open, self.uuids, self.calls = 0, [], []

    def nvmlInit(self):
        self.open += 1

    def nvmlShutdown(self):
        self.open -= 1

    def nvmlDeviceGetHandleByUUID(self, u):
        self.uuids.append(u)
        return ("handle", u)

    def _fill(self, ref):
        assert self.open == 1, "queried outside an NVML session"
        if self.error is not None:
            raise pynvml.NVMLError(self.error)
        info = ref._obj
        info.state, info.status, raw, info.cliqueId = self.answer
        ctypes.memmove(info.clusterUuid, raw, len(raw))

    def nvmlDeviceGetGpuFabricInfoV(self, handle, ref):
        self.calls.append(("V", type(ref._obj).__name__))
        if self.v is not None:  # the versioned call refused with this NVML error
            raise pynvml.NVMLError(self.v)
        self._fill(ref)

    def nvmlDeviceGetGpuFabricInfo(self, handle, ref):
        self.calls.append(("legacy", type(ref._obj).__name__))
        self._fill(ref)


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


def test_the_real_nvml_library_missing_is_state_unknown_not_an_error(one_gpu):
    info = fabric_info(0)  # the real pynvml: this machine has no libnvidia-ml
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
    assert nvml.calls == [("V", "c_nvmlGpuFabricInfo_v2_t")]
    assert domain_key(0, nvml=FakeNvml(clique=7)) == f"nvlink:{CLUSTER}:7"
    assert domain_key(0, nvml=FakeNvml(clique=8)) != domain_key(0, nvml=nvml)


@pytest.mark.parametrize(
    "refusal", [pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH]
)
def test_a_driver_without_the_versioned_call_is_read_through_the_legacy_one(one_gpu, refusal):
    nvml = FakeNvml(clique=3, v=refusal)
    assert fabric_info(0, nvml=nvml) == FabricInfo(0, "completed", str(CLUSTER), 3, "", "")
    assert [c[0] for c in nvml.calls] == ["V", "legacy"] and nvml.open == 0
    assert nvml.calls[1][1] == "c_nvmlGpuFabricInfo_t"


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
