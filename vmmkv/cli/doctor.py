"""``python -m vmmkv doctor``: what this machine offers vmmkv, and whether direct mode can work.

Local, read-only: checks vmmkv's environment variables first (the library's and the vLLM
plugin's: a wrong value exits 2, one line per error, as ``demo`` does) and reports those that
are set; then queries versions, device attributes, P2P (driver and NVML), a trial fabric
allocation (released at once), NVML's fabric registration of each GPU (state, cluster UUID,
clique id: ``alloc.fabric.fabric_info``), and the socket features the rendezvous needs. Returns
a report dict; ``main`` prints it and exits non-zero with the reasons when direct mode cannot
work (an unusable fabric is no such reason: one host shares memory through POSIX fds).
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import struct
import sys
from typing import Any

from .. import _env
from ..alloc import driver as drv
from ..alloc.fabric import FabricInfo, fabric_info
from . import banner, checks, tool_parser


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "platform": platform.platform()}
    try:
        import torch

        out["torch"] = torch.__version__
        out["torch_cuda"] = str(torch.version.cuda)
    except Exception as exc:
        out["torch"] = f"unavailable: {exc}"
    try:
        import cuda.bindings

        out["cuda-python (cuda.bindings)"] = cuda.bindings.__version__
    except Exception as exc:
        out["cuda-python (cuda.bindings)"] = f"unavailable: {exc}"
    try:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
        out["nvrtc"] = f"{major}.{minor}" if err == nvrtc.nvrtcResult.NVRTC_SUCCESS else str(err)
    except Exception as exc:
        out["nvrtc"] = f"unavailable: {exc}"
    if drv.cuda_usable():
        v = int(drv.call(drv.cu.cuDriverGetVersion))
        out["cuda driver API"] = f"{v // 1000}.{(v % 1000) // 10}"
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            d = pynvml.nvmlSystemGetDriverVersion()
            out["nvidia driver"] = d.decode() if isinstance(d, bytes) else str(d)
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:
        out["nvidia driver"] = f"NVML unavailable: {type(exc).__name__}"
    return out


def _sockets() -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(b"\0vmmkv-doctor-%d" % os.getpid())
            out["abstract_unix_sockets"] = True
        finally:
            s.close()
    except OSError as exc:
        out["abstract_unix_sockets"] = f"no: {exc}"
    try:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            raw = a.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            pid = struct.unpack("3i", raw)[0]
            out["so_peercred"] = pid == os.getpid() or f"no: got pid {pid}"
        finally:
            a.close()
            b.close()
    except (OSError, AttributeError) as exc:
        out["so_peercred"] = f"no: {exc}"
    return out


def _nvml_p2p(n: int) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:
        return {"error": f"NVML unavailable: {exc}"}
    try:
        from ..alloc.cuda import nvml_uuid

        handles = [pynvml.nvmlDeviceGetHandleByUUID(nvml_uuid(i)) for i in range(n)]
        for i in range(n):
            links = 0
            for link in range(18):
                try:
                    links += pynvml.nvmlDeviceGetNvLinkState(handles[i], link) == 1
                except Exception:
                    break
            out[f"gpu{i}_nvlinks_up"] = str(links)
            for j in range(n):
                if i == j:
                    continue
                st = pynvml.nvmlDeviceGetP2PStatus(
                    handles[i], handles[j], pynvml.NVML_P2P_CAPS_INDEX_NVLINK
                )
                out[f"{i}->{j} nvlink_p2p"] = "ok" if st == pynvml.NVML_P2P_STATUS_OK else str(st)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        pynvml.nvmlShutdown()
    return out


def _fabric_lines(fi: FabricInfo) -> dict[str, Any]:
    """The doctor's lines for one GPU's NVLink fabric registration; the reason when unusable."""
    out: dict[str, Any] = {
        "fabric_state": fi.state,
        "fabric_cluster_uuid": fi.cluster_uuid if fi.usable else "-",
        "fabric_clique_id": fi.clique_id if fi.usable else "-",
    }
    if not fi.usable:
        out["fabric_reason"] = fi.reason
    return out


def _gpus() -> tuple[list[dict[str, Any]], dict[str, Any], list[str]]:
    from ..alloc.cuda import CudaBackend, fabric_probe

    n = drv.device_count()
    gpus, problems = [], []
    cu = drv.cu
    for i in range(n):
        dev = drv.call(cu.cuDeviceGet, i)
        name = drv.call(cu.cuDeviceGetName, 256, dev).split(b"\0")[0].decode()

        def attr(a, dev=dev):
            return int(drv.call(cu.cuDeviceGetAttribute, getattr(cu.CUdevice_attribute, a), dev))

        info: dict[str, Any] = {
            "index": i,
            "name": name,
            "compute_capability": f"{attr('CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR')}."
            f"{attr('CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR')}",
            "vmm": bool(attr("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED")),
            "posix_fd": bool(
                attr("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED")
            ),
            "multicast (never used)": bool(attr("CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED")),
        }
        ok, why = fabric_probe(i)
        info["fabric"] = True if ok else f"no: {why}"
        info.update(_fabric_lines(fabric_info(i)))
        if info["vmm"] and info["posix_fd"]:
            info["granularity"] = CudaBackend(i).granularity
        else:
            problems.append(f"GPU {i} lacks VMM or POSIX fd export")
        gpus.append(info)
    p2p: dict[str, Any] = {}
    attr_atomic = cu.CUdevice_P2PAttribute.CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            di, dj = drv.call(cu.cuDeviceGet, i), drv.call(cu.cuDeviceGet, j)
            access = bool(drv.call(cu.cuDeviceCanAccessPeer, di, dj))
            atomics = bool(drv.call(cu.cuDeviceGetP2PAttribute, attr_atomic, di, dj))
            p2p[f"{i}->{j}"] = f"access={access} native_atomics={atomics}"
            if not (access and atomics):
                problems.append(f"GPU {i} -> GPU {j}: access={access}, native atomics={atomics}")
    if n > 1:
        p2p.update(_nvml_p2p(n))
    return gpus, p2p, problems


def report() -> dict[str, Any]:
    rep: dict[str, Any] = {"versions": _versions(), "sockets": _sockets()}
    rep["environment"] = _env.set_variables()
    problems: list[str] = []
    for k, v in rep["sockets"].items():
        if v is not True:
            problems.append(f"{k}: {v}")
    if drv.cuda_usable():
        rep["gpus"], rep["p2p"], gpu_problems = _gpus()
        problems += gpu_problems
        rep["backend"] = "cuda"
    else:
        rep["backend"] = "host"
        rep["note"] = (
            f"host backend only (no usable CUDA device: {drv.why_no_cuda()}); direct "
            "publication works through shared host memory"
        )
    rep["direct_possible"] = not problems
    rep["problems"] = problems
    return rep


def _print(rep: dict[str, Any]) -> None:
    banner("doctor", f"what {platform.node() or 'this machine'} offers vmmkv")

    def section(title: str, d: dict[str, Any]) -> None:
        print(f"{title}:")
        for k, v in d.items():
            print(f"  {k:<32} {v}")

    section("versions", rep["versions"])
    section("sockets", rep["sockets"])
    if rep["environment"]:
        section("environment (vmmkv's variables that are set)", rep["environment"])
    else:
        print("environment: none of vmmkv's variables is set")
    for g in rep.get("gpus", []):
        section(f"gpu {g['index']}", {k: v for k, v in g.items() if k != "index"})
    if rep.get("p2p"):
        section("p2p", rep["p2p"])
    print(f"backend: {rep['backend']}")
    if "note" in rep:
        print(f"note: {rep['note']}")
    if rep["direct_possible"]:
        print("verdict: direct publication can work here")
    else:
        print("verdict: direct publication can NOT work here:")
        for p in rep["problems"]:
            print(f"  - {p}")


def parser() -> argparse.ArgumentParser:
    return tool_parser("doctor", __doc__)


def main(argv: list[str] | None = None) -> int:
    parser().parse_args(argv)  # no options; --help prints the description and exits 0
    errors = checks.environment()
    if errors:
        return checks.refuse("doctor", errors)
    rep = report()
    _print(rep)
    sys.stdout.flush()
    return 0 if rep["direct_possible"] else 1
