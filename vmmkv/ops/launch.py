"""Kernel parameter packing and ``cuLaunchKernel`` on torch's current stream.

Contract:
- :class:`Kernel` knows one entry point's parameter layout; ``launch`` packs the values into a
  per-thread buffer (threads never share one) and launches on torch's current stream of the
  device. The driver copies the parameters during the call, so the buffer is reused right away.
- Launching is capture-safe (CUDA-graph capture records the launch with its parameters); the
  first launch on a device compiles/loads the kernels (vmmkv.ops.build), which is not, so warm
  up before capturing (``warm_up(device)``).
- Kernels run under the device's primary context (the one torch uses); when another context is
  current on the calling thread, the launch switches to the primary one and back.
- Nothing here validates user tensors; vmmkv.ops.kv and vmmkv.ops.barrier do, before launching.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from collections.abc import Mapping
from typing import Any

import torch

from vmmkv import _env
from vmmkv.alloc import driver
from vmmkv.ops import build
from vmmkv.ops.formats import STORE_KINDS

__all__ = [
    "BARRIER_ARGS",
    "KVDEST",
    "Kernel",
    "PUBLISHES",
    "PreparedLaunch",
    "STORES",
    "device_ordinal",
    "lookup_handle",
    "resident_grid",
    "warm_up",
]

# Host mirror of csrc/vmmkv_common.cuh `struct KVDest` (80 bytes, 8-byte aligned):
# ptr_table, committed_bytes, error_counter, offset_bytes, block_stride, entry_stride,
# block_extent, num_blocks, block_size, num_dest, my_rank, reserved.
KVDEST = struct.Struct("<QQQqqqqqiiii")
assert KVDEST.size == 80

# Host mirror of csrc/barrier.cuh `struct BarrierArgs` (64 bytes, 8-byte aligned):
# sig_table, epochs, arrivals, lane_state, ctrl, diag_ns, lane, rank, world, flags.
BARRIER_ARGS = struct.Struct("<QQQQQqiiii")
assert BARRIER_ARGS.size == 64

# code -> (struct format, size, alignment). "D" is a KVDest, "B" a BarrierArgs, by value.
_PARAM = {
    "Q": ("Q", 8, 8),  # pointer
    "q": ("q", 8, 8),  # int64
    "i": ("i", 4, 4),  # int32
    "D": ("80s", 80, 8),
    "B": ("64s", 64, 8),
}


class Kernel:
    """One ``extern "C"`` entry point with a fixed parameter layout (a string of codes)."""

    __slots__ = ("name", "layout", "_struct", "_offsets", "_formats", "_local")

    def __init__(self, name: str, layout: str):
        fmt = ["<"]
        offsets = []
        formats = []  # per parameter: its format, preceded by the padding before it
        pos = 0
        for code in layout:
            f, size, align = _PARAM[code]
            pad = -pos % align
            if pad:
                fmt.append(f"{pad}x")
                pos += pad
            offsets.append(pos)
            formats.append((f"{pad}x" if pad else "", f))
            fmt.append(f)
            pos += size
        self.name = name
        self.layout = layout
        self._struct = struct.Struct("".join(fmt))
        self._offsets = tuple(offsets)
        self._formats = tuple(formats)
        self._local = threading.local()

    def _buffers(self) -> tuple[Any, int]:
        """This thread's parameter buffer and the address of its pointer array."""
        state = getattr(self._local, "state", None)
        if state is None:
            buf = ctypes.create_string_buffer(self._struct.size)
            base = ctypes.addressof(buf)
            ptrs = (ctypes.c_void_p * len(self._offsets))(*(base + o for o in self._offsets))
            state = self._local.state = (buf, ptrs, ctypes.addressof(ptrs))
        return state[0], state[2]

    def launch(self, ordinal: int, grid: int, block: int, *values: Any) -> None:
        """Launch ``grid`` CTAs of ``block`` threads on the current stream of device ``ordinal``."""
        buf, params = self._buffers()
        self._struct.pack_into(buf, 0, *values)
        loaded = build.load_module(ordinal)
        fn = loaded.functions[self.name]
        stream = _current_stream(ordinal)
        cu = driver.cu
        err, current = cu.cuCtxGetCurrent()
        if err == cu.CUresult.CUDA_SUCCESS and int(current) == loaded.context:
            (err,) = cu.cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, 0, stream, params, 0)
            if err != cu.CUresult.CUDA_SUCCESS:
                raise driver.CudaError(
                    "cuLaunchKernel", err, getattr(err, "name", str(err)),
                    {"kernel": self.name, "device": ordinal, "grid": grid, "block": block},
                )  # fmt: skip
            return
        with driver.primary_context(ordinal):
            driver.call(
                cu.cuLaunchKernel, fn, grid, 1, 1, block, 1, 1, 0, stream, params, 0,
                kernel=self.name, device=ordinal,
            )  # fmt: skip


class PreparedLaunch:
    """One launch site of one kernel with its own parameter buffer (e.g. a PreparedStore's).

    The leading parameters that never change (``fixed``, e.g. the packed destinations) are
    packed once; ``launch(grid, *rest)`` packs the others in place with one precompiled
    ``struct`` and calls ``cuLaunchKernel`` on torch's current stream of the device: no
    allocation beyond Python's argument tuple, no dictionary lookup, no context query.
    The kernel handle is resolved here (``build.load_module``: compiles and loads on the first
    use of a device, so make these objects before CUDA-graph capture). Not thread-safe: calls
    on one object must not overlap (the driver copies the parameters during the call, so
    consecutive calls reuse the buffer). When the launch fails because another context (or
    none) is current on the thread, it is retried once under the device's primary context.
    ``api``: ``"bindings"`` (cuda.bindings, the default) or ``"ctypes"`` (libcuda's
    ``cuLaunchKernel`` through ctypes; same call, measured by benchmarks/bench_store.py);
    ``VMMKV_LAUNCH_API`` sets the default.
    """

    __slots__ = (
        "kernel", "ordinal", "block", "api", "_buf", "_ptrs", "_params", "_pack", "_offset",
        "_fn", "_fn_int", "_call",
    )  # fmt: skip

    def __init__(
        self, kernel: Kernel, ordinal: int, block: int, fixed: tuple = (), api: str | None = None
    ):
        api = api or _env.launch_api()
        if api not in ("bindings", "ctypes"):
            raise ValueError(f"api must be 'bindings' or 'ctypes', got {api!r}")
        n = len(kernel._offsets)
        if len(fixed) > n:
            raise ValueError(f"{kernel.name}: {len(fixed)} fixed values for {n} parameters")
        self.kernel = kernel
        self.ordinal = ordinal
        self.block = block
        self.api = api
        self._buf = ctypes.create_string_buffer(kernel._struct.size)
        base = ctypes.addressof(self._buf)
        self._ptrs = (ctypes.c_void_p * n)(*(base + o for o in kernel._offsets))
        self._params = ctypes.addressof(self._ptrs)
        k = len(fixed)
        if k:
            head = "<" + "".join(pad + f for pad, f in kernel._formats[:k])
            struct.pack_into(head, self._buf, 0, *fixed)
        if k < n:
            rest = kernel._formats[k + 1 :]
            tail = "<" + kernel._formats[k][1] + "".join(pad + f for pad, f in rest)
            self._pack = struct.Struct(tail).pack_into
            self._offset = kernel._offsets[k]
        else:  # nothing left to pack per call
            self._pack, self._offset = None, 0
        self._fn = build.load_module(ordinal).function(kernel.name)
        self._fn_int = int(self._fn) if api == "ctypes" else 0
        self._call = _ctypes_launch() if api == "ctypes" else None

    def launch(self, grid: int, *values: Any) -> None:
        """Pack ``values`` (the parameters after the fixed ones) and launch ``grid`` CTAs."""
        if values:
            self._pack(self._buf, self._offset, *values)
        stream = stream_handle(self.ordinal)
        if self._call is None:
            (err,) = _cu_launch(self._fn, grid, 1, 1, self.block, 1, 1, 0, stream, self._params, 0)
            if err != _CU_SUCCESS:
                self._retry(int(err), grid, stream)
        else:
            err = self._call(
                self._fn_int, grid, 1, 1, self.block, 1, 1, 0, stream, self._params, None
            )
            if err:
                self._retry(err, grid, stream)

    def _retry(self, code: int, grid: int, stream: int) -> None:
        context = {"kernel": self.kernel.name, "device": self.ordinal, "grid": grid}
        if code not in _NOT_THIS_CONTEXT:
            err = driver.cu.CUresult(code)
            raise driver.CudaError("cuLaunchKernel", err, getattr(err, "name", str(err)), context)
        with driver.primary_context(self.ordinal):
            driver.call(
                driver.cu.cuLaunchKernel, self._fn, grid, 1, 1, self.block, 1, 1, 0, stream,
                self._params, 0, **context,
            )  # fmt: skip


# CUresult codes a launch may get while another context (or none) is current: INVALID_VALUE,
# INVALID_DEVICE, INVALID_CONTEXT, INVALID_HANDLE, CONTEXT_IS_DESTROYED. A failed launch
# launched nothing, so retrying it under the primary context is safe; a real error repeats.
_NOT_THIS_CONTEXT = frozenset((1, 101, 201, 400, 709))
_cu_launch = getattr(driver.cu, "cuLaunchKernel", None)
_CU_SUCCESS = driver.cu.CUresult.CUDA_SUCCESS if driver.cu is not None else 0
_ctypes_fn: Any = None


def _ctypes_launch() -> Any:
    """libcuda's cuLaunchKernel through ctypes (the legacy-default-stream entry point, as
    cuda.bindings resolves it by default)."""
    global _ctypes_fn
    if _ctypes_fn is None:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
        u = ctypes.c_uint
        fn.argtypes = [ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p]  # fmt: skip
        fn.restype = ctypes.c_int
        _ctypes_fn = fn
    return _ctypes_fn


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(ordinal: int) -> int:
    if _raw_stream is not None:  # skips building a torch.cuda.Stream object per launch
        return _raw_stream(ordinal)
    return torch.cuda.current_stream(ordinal).cuda_stream


# The current stream's handle on a device ordinal: what PreparedLaunch.launch launches on and
# what the gather fallback keys its staging by. torch's accessor itself where it exists (one
# call less; torch.cuda.current_stream builds a Stream object: 2.9 µs against 0.1 µs per call on
# the H200 host, benchmarks/results/2026-12-02-h200-gather-host-cost/plans-v1/profile.log).
stream_handle = _raw_stream if _raw_stream is not None else _current_stream


def device_ordinal(device: torch.device) -> int:
    if device.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


def lookup_handle(live: Mapping[int, Any], handle: int, what: str, traced: str) -> Any:
    """The object ``live`` holds under ``handle``: the custom ops name a barrier or a prepared
    store by an int handle (a graph constant), registered in a weak dictionary by its module.
    RuntimeError when it is gone (``what``: the handle's kind, ``traced``: the object's)."""
    obj = live.get(handle)
    if obj is None:
        raise RuntimeError(
            f"vmmkv: {what} handle {handle} no longer exists (the {traced} a compiled graph was "
            f"traced with was garbage collected)"
        )
    return obj


_resident: dict[tuple[int, int, tuple[Kernel, ...]], int] = {}


def resident_grid(kernels: tuple[Kernel, ...], ordinal: int, block: int) -> int:
    """How many CTAs of ``block`` threads of every one of ``kernels`` device ``ordinal`` keeps
    resident at once: its SM count times the smallest of the kernels' occupancies (the driver's
    ``cuOccupancyMaxActiveBlocksPerMultiprocessor``, at least 1). The stores cap their grid here:
    their token loops are grid-stride, so one wave of CTAs that stay resident covers any token
    count, and a publish's per-CTA release fence and arrival happen once per resident CTA instead
    of once per 8 tokens. Cached per (device, block, kernels). A new key asks the driver (host
    queries, no stream work, so also during CUDA-graph capture); it loads the kernels first if
    nothing launched on the device yet, as a launch would (``warm_up`` does that beforehand)."""
    key = (ordinal, block, kernels)  # Kernel objects hash by identity: no per-call name walk
    hit = _resident.get(key)
    if hit is not None:
        return hit
    loaded = build.load_module(ordinal)
    occupancy = driver.cu.cuOccupancyMaxActiveBlocksPerMultiprocessor
    with driver.primary_context(ordinal):
        per_sm = [
            driver.call(occupancy, loaded.function(k.name), block, 0, kernel=k.name, device=ordinal)
            for k in kernels
        ]
    sms = torch.cuda.get_device_properties(ordinal).multi_processor_count
    _resident[key] = cap = max(1, int(sms) * max(1, min(int(n) for n in per_sm)))
    return cap


def warm_up(device: torch.device | int) -> None:
    """Compile/load the kernels for ``device`` now (do it before CUDA-graph capture)."""
    ordinal = device if isinstance(device, int) else device_ordinal(torch.device(device))
    build.load_module(ordinal)


STORE_DS_MLA = Kernel("vmmkv_store_ds_mla", "DQqQqQiqq")
STORE_INDEXER_K = Kernel("vmmkv_store_indexer_k", "DQqQiqqi")
STORE_LAYER = Kernel("vmmkv_store_layer", "DDQqQqQqQiqqi")
PUBLISH_ROWS = Kernel("vmmkv_publish_rows", "DQqqQiqqi")
BARRIER = Kernel("vmmkv_barrier", "B")
NOOP = Kernel("vmmkv_noop", "")
# the stores above, then the barrier in the same launch (csrc/kv_store.cu, barrier.cuh)
STORE_DS_MLA_BARRIER = Kernel("vmmkv_store_ds_mla_barrier", "DQqQqQiqqB")
STORE_INDEXER_K_BARRIER = Kernel("vmmkv_store_indexer_k_barrier", "DQqQiqqiB")
STORE_LAYER_BARRIER = Kernel("vmmkv_store_layer_barrier", "DDQqQqQqQiqqiB")
PUBLISH_ROWS_BARRIER = Kernel("vmmkv_publish_rows_barrier", "DQqqQiqqiB")
# the indexer_k_mxfp8 variants: the same parameters as their indexer_k twins
STORE_INDEXER_K_MXFP8 = Kernel("vmmkv_store_indexer_k_mxfp8", STORE_INDEXER_K.layout)
STORE_LAYER_MXFP8 = Kernel("vmmkv_store_layer_mxfp8", STORE_LAYER.layout)
STORE_INDEXER_K_MXFP8_BARRIER = Kernel(
    "vmmkv_store_indexer_k_mxfp8_barrier", STORE_INDEXER_K_BARRIER.layout
)
STORE_LAYER_MXFP8_BARRIER = Kernel("vmmkv_store_layer_mxfp8_barrier", STORE_LAYER_BARRIER.layout)
# the fp8_ds_mla_ue8m0 variants: the same parameters as their fp8_ds_mla twins
STORE_DS_MLA_UE8M0 = Kernel("vmmkv_store_ds_mla_ue8m0", STORE_DS_MLA.layout)
STORE_LAYER_UE8M0 = Kernel("vmmkv_store_layer_ue8m0", STORE_LAYER.layout)
STORE_LAYER_UE8M0_MXFP8 = Kernel("vmmkv_store_layer_ue8m0_mxfp8", STORE_LAYER.layout)
STORE_DS_MLA_UE8M0_BARRIER = Kernel("vmmkv_store_ds_mla_ue8m0_barrier", STORE_DS_MLA_BARRIER.layout)
STORE_LAYER_UE8M0_BARRIER = Kernel("vmmkv_store_layer_ue8m0_barrier", STORE_LAYER_BARRIER.layout)
STORE_LAYER_UE8M0_MXFP8_BARRIER = Kernel(
    "vmmkv_store_layer_ue8m0_mxfp8_barrier", STORE_LAYER_BARRIER.layout
)

# The kernels of each store call (its targets' kinds, vmmkv.ops.formats.STORE_KINDS): the one
# that stores (STORES), and the one that stores and then runs the barrier in the same launch
# (PUBLISHES). Each scale rule has its own compile-time kernel variant (csrc/kv_store.cu), so
# the kinds pick it once, here.
_STORE_AND_PUBLISH: dict[tuple[str, ...], tuple[Kernel, Kernel]] = {
    ("fp8_ds_mla",): (STORE_DS_MLA, STORE_DS_MLA_BARRIER),
    ("indexer_k",): (STORE_INDEXER_K, STORE_INDEXER_K_BARRIER),
    ("rows",): (PUBLISH_ROWS, PUBLISH_ROWS_BARRIER),
    ("fp8_ds_mla", "indexer_k"): (STORE_LAYER, STORE_LAYER_BARRIER),
    ("indexer_k_mxfp8",): (STORE_INDEXER_K_MXFP8, STORE_INDEXER_K_MXFP8_BARRIER),
    ("fp8_ds_mla", "indexer_k_mxfp8"): (STORE_LAYER_MXFP8, STORE_LAYER_MXFP8_BARRIER),
    ("fp8_ds_mla_ue8m0",): (STORE_DS_MLA_UE8M0, STORE_DS_MLA_UE8M0_BARRIER),
    ("fp8_ds_mla_ue8m0", "indexer_k"): (STORE_LAYER_UE8M0, STORE_LAYER_UE8M0_BARRIER),
    ("fp8_ds_mla_ue8m0", "indexer_k_mxfp8"): (
        STORE_LAYER_UE8M0_MXFP8,
        STORE_LAYER_UE8M0_MXFP8_BARRIER,
    ),
}
STORES: dict[tuple[str, ...], Kernel] = {k: s for k, (s, _) in _STORE_AND_PUBLISH.items()}
PUBLISHES: dict[tuple[str, ...], Kernel] = {k: p for k, (_, p) in _STORE_AND_PUBLISH.items()}
assert list(STORES) == list(PUBLISHES) == list(STORE_KINDS)
