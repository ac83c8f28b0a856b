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
from typing import Any

import torch

from vmmkv.alloc import driver
from vmmkv.ops import build

__all__ = ["KVDEST", "Kernel", "device_ordinal", "warm_up"]

# Host mirror of csrc/vmmkv_common.cuh `struct KVDest` (80 bytes, 8-byte aligned):
# ptr_table, committed_bytes, error_counter, offset_bytes, block_stride, entry_stride,
# block_extent, num_blocks, block_size, num_dest, my_rank, reserved.
KVDEST = struct.Struct("<QQQqqqqqiiii")
assert KVDEST.size == 80

# code -> (struct format, size, alignment). "D" is a KVDest passed by value.
_PARAM = {
    "Q": ("Q", 8, 8),  # pointer
    "q": ("q", 8, 8),  # int64
    "i": ("i", 4, 4),  # int32
    "D": ("80s", 80, 8),
}


class Kernel:
    """One ``extern "C"`` entry point with a fixed parameter layout (a string of codes)."""

    __slots__ = ("name", "_struct", "_offsets", "_local")

    def __init__(self, name: str, layout: str):
        fmt = ["<"]
        offsets = []
        pos = 0
        for code in layout:
            f, size, align = _PARAM[code]
            pad = -pos % align
            if pad:
                fmt.append(f"{pad}x")
                pos += pad
            offsets.append(pos)
            fmt.append(f)
            pos += size
        self.name = name
        self._struct = struct.Struct("".join(fmt))
        self._offsets = tuple(offsets)
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


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(ordinal: int) -> int:
    if _raw_stream is not None:  # skips building a torch.cuda.Stream object per launch
        return _raw_stream(ordinal)
    return torch.cuda.current_stream(ordinal).cuda_stream


def device_ordinal(device: torch.device) -> int:
    if device.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


def warm_up(device: torch.device | int) -> None:
    """Compile/load the kernels for ``device`` now (do it before CUDA-graph capture)."""
    ordinal = device if isinstance(device, int) else device_ordinal(torch.device(device))
    build.load_module(ordinal)


STORE_DS_MLA = Kernel("vmmkv_store_ds_mla", "DQqQqQiqq")
STORE_INDEXER_K = Kernel("vmmkv_store_indexer_k", "DQqQiqqi")
STORE_LAYER = Kernel("vmmkv_store_layer", "DDQqQqQqQiqqi")
PUBLISH_ROWS = Kernel("vmmkv_publish_rows", "DQqqQiqqi")
BARRIER = Kernel("vmmkv_barrier", "QQiiiqQ")
