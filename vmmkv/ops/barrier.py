"""Device-side system-scope barrier (docs/design.md, "Barrier"; kernel in csrc/barrier.cu): the
launches. The host side (control page, liveness, watchdog, errors, ``close``) is the base class
:class:`~vmmkv.ops.barrier_control.BarrierControl`; its module docstring holds that contract.

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
- Liveness and lane misuse (the base class): a wait never traps by default; a dead peer, the
  host timeout, ``abort()`` or a lane used by two launches at once (two streams without
  ordering between them; every launch marks its lane busy and the barrier CTA checks that the
  lane's epoch did not move under it) make every wait of this object return, and every later
  ``arrive_and_wait``/publish/``check`` then raises :class:`BarrierAborted`.
- ``close()`` (the base class) frees the host-mapped control page; the owner calls it when no
  barrier launched by this object can still run. The device tensors made here (``epochs`` when
  None was passed, ``arrivals``, ``lane_state``) are torch's and go with the object.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Callable, Sequence

import torch

from vmmkv.ops import launch as _launch
from vmmkv.ops.barrier_control import (
    DEFAULT_TIMEOUT_S,
    BarrierAborted,
    BarrierControl,
    BarrierTimeout,
    check_settings,
)

__all__ = ["BarrierAborted", "BarrierTimeout", "DeviceBarrier"]

_log = logging.getLogger(__name__)

# Mirrors of csrc/barrier.cuh (the launch's side; the control page's are barrier_control's)
_FLAG_TRAP = 1  # kFlagTrap
_LANE_STATE_WORDS = 4  # kLaneStateWords
_MAX_THREADS = 1024


class DeviceBarrier(BarrierControl):
    """Barrier among ``world`` ranks over mapped signal regions; see the module docstring.

    ``timeout_s``: the host timeout (default 600 s): a wait that long is aborted (``trap=True``:
    the device traps after it instead). ``diag_after_s``: the device diagnostic's delay
    (default ``min(10, timeout_s)``). ``liveness``: called by the watchdog about twice a second;
    returns None while every peer is alive, else ``(peer, why)``: the barrier's waits are then
    aborted."""

    def __init__(
        self,
        sig_table: torch.Tensor,
        epochs: torch.Tensor | None,
        rank: int,
        world: int,
        lanes: int,
        device: torch.device | int | str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        fence: torch.Tensor | Sequence[torch.Tensor] = (),
        *,
        diag_after_s: float | None = None,
        trap: bool = False,
        liveness: Callable[[], tuple[int | None, str] | None] | None = None,
    ):
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {dev}")
        for name, v, lo in (("world", world, 1), ("lanes", lanes, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise ValueError(f"rank must be an int in [0, {world}), got {rank!r}")
        check_settings(timeout_s, diag_after_s, trap, liveness)
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
        self.fence = [fence] if isinstance(fence, torch.Tensor) else list(fence)
        for t in self.fence:
            if not isinstance(t, torch.Tensor) or t.device != dev:
                raise ValueError(f"fence must hold tensors on {dev}, got {t!r:.80}")
        self._fence_ptrs = [t.data_ptr() for t in self.fence]
        self.sig_table = sig_table
        self.epochs = epochs
        self.world = world
        self._threads = min(_MAX_THREADS, 32 * -(-world // 32))
        self.arrivals = torch.zeros(lanes, dtype=torch.int32, device=dev)
        # busy word, record claim and record sequence of each lane (csrc/barrier.cuh)
        self.lane_state = torch.zeros(lanes, _LANE_STATE_WORDS, dtype=torch.int32, device=dev)
        # the control page, the liveness state and the settings (rank, lanes, device, timeouts)
        super().__init__(rank, lanes, dev, ordinal, timeout_s, diag_after_s, trap, liveness)
        # the device's (BarrierArgs.diag_ns)
        self.timeout_ns = min(int(self.diag_after_s * 1e9), 2**63 - 1)
        self._flags = _FLAG_TRAP if trap else 0
        # the BarrierArgs of each lane, packed once (the stand-alone barrier takes them too)
        self._args = tuple(
            _launch.BARRIER_ARGS.pack(
                sig_table.data_ptr(), epochs.data_ptr(), self.arrivals.data_ptr(),
                self.lane_state.data_ptr(), self._diag_dev_ptr, self.timeout_ns, lane, rank,
                world, self._flags,
            )
            for lane in range(lanes)
        )  # fmt: skip
        # the prepared launch of each lane's stand-alone barrier, made on its first use
        self._launches: list[_launch.PreparedLaunch | None] = [None] * lanes
        self.handle = _register(self)
        # the zeroed epochs/arrivals must be in place before a kernel on any stream reads them
        torch.cuda.current_stream(dev).synchronize()
        self._start_watch()

    def arrive_and_wait(self, lane: int = 0) -> None:
        """Launch the barrier for ``lane`` on the current stream (see the module docstring)."""
        if type(lane) is not int or not 0 <= lane < self.lanes or self._blocked:
            self._check_lane(lane, "arrive_and_wait")
        if torch.compiler.is_compiling():
            if not self.fence:
                _warn_unfenced()
            torch.ops.vmmkv.barrier(self.epochs, self.fence, self.handle, lane, self._fence_ptrs)
            return
        launch = self._launches[lane]
        if launch is None:
            launch = self._launches[lane] = self._lane_launch(lane)
        launch.launch(1)

    def _lane_launch(self, lane: int) -> _launch.PreparedLaunch:
        """The barrier kernel of ``lane`` with its parameter packed once (its own buffer:
        nothing is packed per call, so launches from several threads cannot mix parameters).
        Loads the kernels on first use, as any launch does."""
        return _launch.PreparedLaunch(
            _launch.BARRIER, self.ordinal, self._threads, (self._args[lane],)
        )

    def _check_lane(self, lane: object, call: str = "barrier") -> None:
        """ValueError for a lane out of range (or not an int), RuntimeError once closed,
        BarrierAborted once broken."""
        if isinstance(lane, bool) or not isinstance(lane, int) or not 0 <= lane < self.lanes:
            raise ValueError(f"lane must be an int in [0, {self.lanes}), got {lane!r}")
        if self._closed:
            raise RuntimeError("DeviceBarrier is closed")
        self.check(call)

    def barrier_args(self, lane: int) -> bytes:
        """The packed ``BarrierArgs`` (csrc/barrier.cuh) of ``lane``, for the store kernels that
        end with this barrier. Raises like ``arrive_and_wait`` for a bad lane or a closed or
        broken barrier."""
        self._check_lane(lane, "publish")
        return self._args[lane]


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
    handle: int,
    lane: int,
    fence_ptrs: list[int],
) -> None:
    """The barrier ``handle`` names (``DeviceBarrier.handle``) on ``lane``. ``fence`` is
    declared mutated only to keep torch.compile from moving reads of those tensors across the
    barrier; ``fence_ptrs`` are their addresses when the barrier was made."""
    if [t.data_ptr() for t in fence] != list(fence_ptrs):
        raise RuntimeError(
            "vmmkv::barrier got fence tensors at other addresses than the barrier was built with: "
            "torch.compile replaced them by copies, whose write-back would undo peers' stores. "
            "Pass caches as graph inputs or module buffers."
        )
    bar = lookup(handle)
    if epochs.data_ptr() != bar.epochs.data_ptr():
        raise RuntimeError("vmmkv::barrier got epochs other than its barrier's (a copy?)")
    bar._check_lane(lane, "arrive_and_wait")
    launch = bar._launches[lane]
    if launch is None:
        launch = bar._launches[lane] = bar._lane_launch(lane)
    launch.launch(1)


@_op_barrier.register_fake
def _(epochs, fence, handle, lane, fence_ptrs):
    return None
