"""Fabric handles on a GPU box that does not permit fabric memory (no IMEX channel, no NVLink
fabric registration), such as the lent single-host H200s.

Ground truth comes from outside vmmkv: a raw ``cuMemCreate`` of one granule with a fabric handle
(``_trial_fabric_create``, refused there with CUDA_ERROR_NOT_PERMITTED) and a raw NVML read of
the fabric state (``_nvml_fabric_state``, by the device UUID). On such a box the probe must say
no and why, ``fabric_info`` must report the state NVML reports with no cluster, the domain key
must be the host's, and a one-rank group must pick POSIX fds. A device that does permit fabric
memory is not the box these tests are for: they skip there, saying so.
"""

from __future__ import annotations

import ctypes

import pynvml
import pytest

from vmmkv.alloc import driver
from vmmkv.testing.markers import requires_gpu
from vmmkv.testing.spawn import run_world


def _devices() -> list[int]:
    return list(range(driver.device_count()))


def _trial_fabric_create(i: int) -> str | None:
    """The CUresult name refusing one granule of fabric-shareable memory on device i; None if
    the driver created it (then it is released at once)."""
    cu = driver.cu
    with driver.primary_context(i):
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = i
        prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
        flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        try:
            gran = driver.call(cu.cuMemGetAllocationGranularity, prop, flag, device=i)
            handle = driver.call(cu.cuMemCreate, gran, prop, 0, device=i)
        except driver.CudaError as exc:
            return getattr(exc.code, "name", str(exc))
        driver.call(cu.cuMemRelease, handle, device=i)
        return None


def _skip_unless_refused(i: int) -> str:
    refused = _trial_fabric_create(i)
    if refused is None:
        pytest.skip(f"device {i} permits fabric memory; these tests are for boxes that refuse it")
    return refused


def _pci(bus_id: bytes | str) -> tuple[int, int, str]:
    """(bus, device, function) of a PCI id, whatever width the domain is written in."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    _, bus, devfn = text.split("\0")[0].strip().lower().split(":")
    dev, fn = devfn.split(".")
    return int(bus, 16), int(dev, 16), fn


def _nvml_fabric_state(uuid: str) -> tuple[str, tuple[int, int, str]]:
    """NVML's fabric state name for the GPU with this UUID, and that GPU's PCI location. The
    fabric info lands in a raw buffer read at nvml.h's offsets (the state is an unsigned char at
    byte 24 of ``nvmlGpuFabricInfo_t``, 28 of ``nvmlGpuFabricInfo_v2_t``): nvidia-ml-py's own
    mirrors of those structs have differed between its releases."""
    names = {
        pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED: "not_supported",
        pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED: "not_started",
        pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS: "in_progress",
        pynvml.NVML_GPU_FABRIC_STATE_COMPLETED: "completed",
    }
    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        pci = _pci(pynvml.nvmlDeviceGetPciInfo(h).busId)
        buf = (ctypes.c_ubyte * 64)()
        try:
            try:
                pynvml.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(buf))
                state = buf[24]
            except pynvml.NVMLError_FunctionNotFound:  # a driver without the legacy call
                ctypes.c_uint.from_buffer(buf).value = 36 | (2 << 24)  # nvmlGpuFabricInfo_v2
                pynvml.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(buf))
                state = buf[28]
        except pynvml.NVMLError_NotSupported:
            return "not_supported", pci
        return names.get(state, "unknown"), pci
    finally:
        pynvml.nvmlShutdown()


@requires_gpu
@pytest.mark.timeout(60)
def test_the_fabric_probe_says_no_and_names_the_cause_where_fabric_memory_is_refused():
    from vmmkv.alloc.cuda import fabric_probe

    for i in _devices():
        refused = _skip_unless_refused(i)
        ok, why = fabric_probe(i)
        assert ok is False, f"device {i}: the probe claims fabric works, the driver said {refused}"
        assert why.startswith(f"device {i}"), why
        causes = ("HANDLE_TYPE_FABRIC_SUPPORTED", "NVML", refused)
        assert any(c in why for c in causes), (why, refused)


@requires_gpu
@pytest.mark.timeout(60)
def test_fabric_info_of_every_gpu_reports_nvmls_state_no_cluster_and_why():
    from vmmkv.alloc.cuda import nvml_uuid
    from vmmkv.alloc.fabric import FABRIC_STATES, fabric_info

    for i in _devices():
        _skip_unless_refused(i)
        uuid = nvml_uuid(i)
        nvml_state, nvml_pci = _nvml_fabric_state(uuid)
        # the UUID names the same GPU for CUDA and NVML, whatever CUDA_VISIBLE_DEVICES says
        cu = driver.cu
        cuda_pci = _pci(driver.call(cu.cuDeviceGetPCIBusId, 32, driver.call(cu.cuDeviceGet, i)))
        assert cuda_pci == nvml_pci, (i, uuid, cuda_pci, nvml_pci)
        info = fabric_info(i)
        assert info.device_index == i and info.state in FABRIC_STATES
        # the 2x H200 machines report "completed" (the node's NVSwitch fabric is registered)
        # with a zero cluster UUID: no cluster, so no usable domain, whatever the state
        assert info.state == nvml_state, (info, nvml_state)
        assert (info.cluster_uuid, info.clique_id, info.usable) == (None, None, False), info
        prefix = f"device {i} ({uuid}): "
        assert info.reason.startswith(prefix) and info.reason[len(prefix) :].strip(), info


@requires_gpu
@pytest.mark.timeout(60)
def test_the_domain_key_of_every_gpu_is_the_hosts_boot_id():
    from vmmkv.alloc.fabric import domain_key

    with open("/proc/sys/kernel/random/boot_id") as f:
        host = f"host:{f.read().strip()}"
    for i in _devices():
        _skip_unless_refused(i)
        assert domain_key(i) == host


def _select(rank, world):
    import torch.distributed as dist

    from vmmkv.ipc.peers import select_handle_type

    return select_handle_type("cuda:0", dist.group.WORLD, timeout=30)


@requires_gpu
@pytest.mark.timeout(90)
def test_a_one_rank_group_picks_posix_fds_and_says_why():
    _skip_unless_refused(0)
    [(choice, why)] = run_world(_select, 1, timeout=60)
    assert choice == "posix_fd" and why.strip(), (choice, why)
