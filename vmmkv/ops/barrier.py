"""Device-side system-scope barrier (docs/design.md, "Barrier"; kernel in csrc/barrier.cu).

Contract:
- ``sig_table``: int64 [world] device tensor of signal-region base addresses, own region at
  ``rank`` (peers' regions mapped into this process). Each region holds int32
  ``[lanes][2][world]``, zero-initialised before the first barrier, owned and kept alive by the
  caller. ``epochs``: int32 [lanes] in local device memory (allocated zeroed when None); every
  rank's epochs of a lane must start equal. A lane is used by one stream at a time.
- ``fence``: the tensor (or tensors) that torch.compile must not move reads or writes across
  the barrier: the custom op declares it mutated, which also keeps the barrier from being
  dropped. CONTRACT with the engine-facing cache: ``fence`` is the one uint8 tensor over the
  whole own region (``SymmetricRegion.region.tensor()``, made once), the same tensor every
  ``KVTarget.cache`` is and every cache view the model reads is a view of (torch.compile
  tracks aliasing by storage: a second ``region.tensor()`` call is a different storage). Then
  store -> barrier -> any read of a cache view stay in that order in a compiled graph.
  Optional: without it (eager mode relies on stream order alone) a compiled graph may move
  cache reads across the barrier; a warning is logged when such a barrier is compiled.
- ``arrivals``: int32 [lanes] in local device memory, allocated zeroed here: the CTA counter of
  the store kernels that end with the barrier (``vmmkv.ops.prepare(...).publish`` and
  ``vmmkv.ops.publish_layer``); they use the same epochs, signal slots, timeout and diagnostic,
  so stand-alone and fused barriers mix freely on one lane.
- ``arrive_and_wait(lane)`` launches one CTA on torch's current stream: it publishes this rank's
  arrival with a system-scope release and waits (acquire) for every rank. Each lane launches
  through its own ``vmmkv.ops.launch.PreparedLaunch`` (every parameter packed at its first use,
  nothing packed per call). Stores issued earlier
  on the stream are visible to every peer once all ranks passed. Capture-safe (the epoch
  advances on the device, so replays need no host update) once the kernels are loaded (the first
  barrier or ``vmmkv.ops.launch.warm_up`` before capture). Collective in effect: every rank must
  call it for the same lane the same number of times.
- While a barrier spins, a kernel this process launches for the first time may wait for it:
  CUDA's lazy module loading (the default) can need the context idle to load a module. Load
  such kernels before (vmmkv's own are loaded whole by ``vmmkv.ops.launch.warm_up``).
- A peer missing for ``timeout_s`` makes the kernel write a diagnostic to host-mapped memory,
  printf it and ``__trap()``: the CUDA context is then unusable and the process should exit.
  ``read_diagnostic()`` reads that record from host memory (no CUDA call, works after the trap).
- ``close()`` frees the host-mapped diagnostic memory (idempotent, local, skipped while the
  interpreter finalizes); call it when no barrier launched by this object can still run. The
  memory is also freed when the object is garbage collected.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vmmkv.alloc import driver
from vmmkv.ops import launch as _launch

__all__ = ["BarrierTimeout", "DeviceBarrier"]

_log = logging.getLogger(__name__)

_DIAG_MAGIC = 0x564D4D42  # csrc/barrier.cu kDiagMagic
_DIAG_WORDS = 8  # magic, lane, rank, missing_peer, epoch, observed, world, reserved
_MAX_THREADS = 1024


@dataclass(frozen=True)
class BarrierTimeout:
    """What a timed-out barrier kernel reported before trapping."""

    lane: int
    rank: int
    missing_peer: int
    epoch: int
    observed: int
    world: int

    def __str__(self) -> str:
        return (
            f"vmmkv barrier timeout: lane={self.lane} rank={self.rank} "
            f"missing peer={self.missing_peer} epoch={self.epoch} observed={self.observed} "
            f"world={self.world}"
        )


def _free_host(host_ptr: int, ordinal: int) -> None:
    if driver.finalizing():
        return
    with driver.primary_context(ordinal):
        driver.call(driver.cu.cuMemFreeHost, host_ptr, device=ordinal)


def _free_host_at_gc(host_ptr: int, ordinal: int) -> None:
    # garbage collection has nobody to raise to (e.g. the context died after a barrier timeout)
    try:
        _free_host(host_ptr, ordinal)
    except driver.CudaError as exc:
        _log.warning("vmmkv DeviceBarrier: freeing its diagnostic memory failed: %s", exc)


class DeviceBarrier:
    """Barrier among ``world`` ranks over mapped signal regions; see the module docstring."""

    def __init__(
        self,
        sig_table: torch.Tensor,
        epochs: torch.Tensor | None,
        rank: int,
        world: int,
        lanes: int,
        device: torch.device | int | str,
        timeout_s: float = 10.0,
        fence: torch.Tensor | Sequence[torch.Tensor] = (),
    ):
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {dev}")
        for name, v, lo in (("world", world, 1), ("lanes", lanes, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise ValueError(f"rank must be an int in [0, {world}), got {rank!r}")
        if (
            not isinstance(timeout_s, (int, float))
            or not math.isfinite(timeout_s)
            or timeout_s <= 0
        ):
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
        if not isinstance(sig_table, torch.Tensor):
            raise TypeError(f"sig_table must be a torch.Tensor, got {type(sig_table).__name__}")
        if sig_table.dtype != torch.int64 or sig_table.shape != (world,):
            raise ValueError(
                f"sig_table must be int64 [{world}], got {sig_table.dtype} {list(sig_table.shape)}"
            )
        ordinal = _launch.device_ordinal(dev)
        dev = torch.device("cuda", ordinal)
        if sig_table.device != dev or not sig_table.is_contiguous():
            raise ValueError(f"sig_table must be contiguous on {dev}, got {sig_table.device}")
        if epochs is None:
            epochs = torch.zeros(lanes, dtype=torch.int32, device=dev)
        elif not isinstance(epochs, torch.Tensor):
            raise TypeError(f"epochs must be a torch.Tensor or None, got {type(epochs).__name__}")
        elif epochs.dtype != torch.int32 or epochs.shape != (lanes,) or epochs.device != dev:
            raise ValueError(
                f"epochs must be int32 [{lanes}] on {dev}, got {epochs.dtype} "
                f"{list(epochs.shape)} on {epochs.device}"
            )
        elif not epochs.is_contiguous():
            raise ValueError("epochs must be contiguous")
        self.sig_table = sig_table
        self.epochs = epochs
        self.rank = rank
        self.world = world
        self.lanes = lanes
        self.device = dev
        self.ordinal = ordinal
        self.timeout_ns = min(int(timeout_s * 1e9), 2**63 - 1)
        self.fence = [fence] if isinstance(fence, torch.Tensor) else list(fence)
        for t in self.fence:
            if not isinstance(t, torch.Tensor) or t.device != dev:
                raise ValueError(f"fence must hold tensors on {dev}, got {t!r:.80}")
        self._fence_ptrs = [t.data_ptr() for t in self.fence]
        self._threads = min(_MAX_THREADS, 32 * -(-world // 32))
        self.arrivals = torch.zeros(lanes, dtype=torch.int32, device=dev)

        flags = driver.cu.CU_MEMHOSTALLOC_DEVICEMAP | driver.cu.CU_MEMHOSTALLOC_PORTABLE
        nbytes = 4 * _DIAG_WORDS
        with driver.primary_context(ordinal):
            host_ptr = int(driver.call(driver.cu.cuMemHostAlloc, nbytes, flags, device=ordinal))
            try:
                ctypes.memset(host_ptr, 0, nbytes)
                dev_ptr = driver.call(driver.cu.cuMemHostGetDevicePointer, host_ptr, 0)
            except BaseException:
                driver.call(driver.cu.cuMemFreeHost, host_ptr, device=ordinal)
                raise
        self._host_ptr = host_ptr
        self._diag_dev_ptr = int(dev_ptr)
        self._closed = False
        self._free = weakref.finalize(self, _free_host_at_gc, host_ptr, ordinal)
        # the BarrierArgs of each lane, packed once for the store kernels that end with it
        self._args = tuple(
            _launch.BARRIER_ARGS.pack(
                sig_table.data_ptr(), epochs.data_ptr(), self.arrivals.data_ptr(),
                self._diag_dev_ptr, self.timeout_ns, lane, rank, world, 0,
            )
            for lane in range(lanes)
        )  # fmt: skip
        # the prepared launch of each lane's stand-alone barrier, made on its first use
        self._launches: list[_launch.PreparedLaunch | None] = [None] * lanes
        self.handle = _register(self)
        # the zeroed epochs/arrivals must be in place before a kernel on any stream reads them
        torch.cuda.current_stream(dev).synchronize()

    @property
    def closed(self) -> bool:
        return self._closed

    def arrive_and_wait(self, lane: int = 0) -> None:
        """Launch the barrier for ``lane`` on the current stream (see the module docstring)."""
        if type(lane) is not int or not 0 <= lane < self.lanes or self._closed:
            self._check_lane(lane)
        if torch.compiler.is_compiling():
            if not self.fence:
                _warn_unfenced()
            torch.ops.vmmkv.barrier(
                self.epochs, self.fence, self.sig_table, lane, self.rank, self.world,
                self.timeout_ns, self._diag_dev_ptr, self._fence_ptrs,
            )  # fmt: skip
            return
        launch = self._launches[lane]
        if launch is None:
            launch = self._launches[lane] = self._lane_launch(lane)
        launch.launch(1)

    def _lane_launch(self, lane: int) -> _launch.PreparedLaunch:
        """The barrier kernel of ``lane`` with every parameter packed once (its own buffer:
        nothing is packed per call, so launches from several threads cannot mix parameters).
        Loads the kernels on first use, as any launch does."""
        fixed = (
            self.sig_table.data_ptr(), self.epochs.data_ptr(), lane, self.rank, self.world,
            self.timeout_ns, self._diag_dev_ptr,
        )  # fmt: skip
        return _launch.PreparedLaunch(_launch.BARRIER, self.ordinal, self._threads, fixed)

    def _check_lane(self, lane: object) -> None:
        """ValueError for a lane out of range (or not an int), RuntimeError once closed."""
        if isinstance(lane, bool) or not isinstance(lane, int) or not 0 <= lane < self.lanes:
            raise ValueError(f"lane must be an int in [0, {self.lanes}), got {lane!r}")
        if self._closed:
            raise RuntimeError("DeviceBarrier is closed")

    def barrier_args(self, lane: int) -> bytes:
        """The packed ``BarrierArgs`` (csrc/barrier.cuh) of ``lane``, for the store kernels that
        end with this barrier. Raises like ``arrive_and_wait`` for a bad lane or a closed
        barrier."""
        self._check_lane(lane)
        return self._args[lane]

    def read_diagnostic(self) -> BarrierTimeout | None:
        """The record a timed-out barrier wrote, or None (no timeout, or closed)."""
        if self.closed:
            return None
        words = (ctypes.c_int32 * _DIAG_WORDS).from_address(self._host_ptr)
        if words[0] != _DIAG_MAGIC:
            return None
        return BarrierTimeout(*(int(w) for w in words[1:7]))

    def close(self) -> None:
        """Free the host-mapped diagnostic memory. Idempotent; raises CudaError if the free
        fails (the memory is then left to process exit)."""
        self._closed = True
        if self._free.detach() is not None:
            _free_host(self._host_ptr, self.ordinal)


_barriers: weakref.WeakValueDictionary[int, DeviceBarrier] = weakref.WeakValueDictionary()
_next_handle = itertools.count(1)
_unfenced_warned = False


def _register(bar: DeviceBarrier) -> int:
    handle = next(_next_handle)
    _barriers[handle] = bar
    return handle


def lookup(handle: int) -> DeviceBarrier:
    """The live barrier of ``handle`` (custom ops name barriers by handle, a graph constant)."""
    return _launch.lookup_handle(_barriers, handle, "DeviceBarrier", "barrier")


def _warn_unfenced() -> None:
    global _unfenced_warned
    if not _unfenced_warned:
        _unfenced_warned = True
        _log.warning(
            "vmmkv: torch.compile traced a DeviceBarrier without fence: cache reads may be "
            "moved across it. Pass fence=<the region tensor every cache view comes from>."
        )


# ---------------------------------------------------------------------------------------------
# torch.library custom op (torch.compile path; also callable directly, eager or under capture)


@torch.library.custom_op("vmmkv::barrier", mutates_args=("epochs", "fence"))
def _op_barrier(
    epochs: torch.Tensor,
    fence: list[torch.Tensor],
    sig_table: torch.Tensor,
    lane: int,
    rank: int,
    world: int,
    timeout_ns: int,
    diag_ptr: int,
    fence_ptrs: list[int],
) -> None:
    """``fence`` is declared mutated only to keep torch.compile from moving reads of those
    tensors across the barrier; ``fence_ptrs`` are their addresses when the barrier was made."""
    if [t.data_ptr() for t in fence] != list(fence_ptrs):
        raise RuntimeError(
            "vmmkv::barrier got fence tensors at other addresses than the barrier was built with: "
            "torch.compile replaced them by copies, whose write-back would undo peers' stores. "
            "Pass caches as graph inputs or module buffers."
        )
    if epochs.dtype != torch.int32 or epochs.dim() != 1 or not 0 <= lane < epochs.numel():
        raise ValueError(
            f"epochs must be int32 [lanes] with lane in range, got {epochs.dtype} "
            f"{list(epochs.shape)} and lane {lane}"
        )
    if sig_table.dtype != torch.int64 or sig_table.shape != (world,) or not 0 <= rank < world:
        raise ValueError(
            f"sig_table must be int64 [{world}] and rank in [0, {world}), got {sig_table.dtype} "
            f"{list(sig_table.shape)} and rank {rank}"
        )
    if epochs.device != sig_table.device:
        raise ValueError(f"epochs on {epochs.device} but sig_table on {sig_table.device}")
    ordinal = _launch.device_ordinal(epochs.device)
    _launch.BARRIER.launch(
        ordinal, 1, min(_MAX_THREADS, 32 * -(-world // 32)), sig_table.data_ptr(),
        epochs.data_ptr(), lane, rank, world, timeout_ns, diag_ptr,
    )  # fmt: skip


@_op_barrier.register_fake
def _(epochs, fence, sig_table, lane, rank, world, timeout_ns, diag_ptr, fence_ptrs):
    return None
