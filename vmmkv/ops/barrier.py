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
- Liveness (docs/design.md "Barrier"): a wait never traps by default. ``timeout_s`` is the
  HOST timeout: a wait longer than that is aborted by the watchdog. After ``diag_after_s``
  (default ``min(10, timeout_s)``) the kernel writes a diagnostic record for its lane into
  host-mapped memory (rank, lane, missing peer, epoch, observed value, how long), prints it once
  and keeps waiting; if the peer then arrives, the record says "passed" and a warning is logged.
  Every ~1000 spins (never on the fast path) the wait reads the host-mapped abort word; a
  watchdog thread of this process sets it when ``liveness()`` names a dead peer (the cache
  passes one that checks the peers' pids and the group's store), when a record has been
  waiting for ``timeout_s``, or on ``abort()``. The kernel then returns, the CUDA context stays
  usable, and once a wait was abandoned every later ``arrive_and_wait``/publish/``check`` raises
  :class:`BarrierAborted` naming the rank, the peer, the lane, the device and the call.
  ``trap=True`` (opt-in, the old behaviour) traps after ``timeout_s`` on the device instead:
  the record is complete before any thread traps, the CUDA context is then unusable and the
  process should exit. ``read_diagnostic()`` reads the records from host memory (no CUDA call,
  works after a trap).
- Lane misuse: every launch marks its lane busy (CTA 0, at entry) and the barrier CTA checks
  that the lane's epoch did not move under it; a launch that finds the lane in use by another
  launch (two streams without ordering between them) reports it in the control page and aborts
  every wait of this object; the barrier is then broken (:class:`BarrierAborted`, "used by two
  launches at once").
- ``close()`` frees the host-mapped control page (idempotent, local, skipped while the
  interpreter finalizes); call it when no barrier launched by this object can still run (the
  cache synchronizes first; after an abort every wait returns, so that synchronize returns).
  The memory is also freed when the object is garbage collected, but not at interpreter exit:
  the watchdog thread may still read it then, and the process exit returns it.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vmmkv.alloc import driver
from vmmkv.ops import launch as _launch

__all__ = ["BarrierAborted", "BarrierTimeout", "DeviceBarrier"]

_log = logging.getLogger(__name__)

# Mirrors of csrc/barrier.cuh
_DIAG_MAGIC = 0x564D4D42  # kDiagMagic
_STATES = {1: "waiting", 2: "passed", 3: "aborted", 4: "trapped"}  # kDiag*
_FLAG_TRAP = 1  # kFlagTrap
_ABORT_BY_HOST = 1  # kAbortByHost
_LANE_STATE_WORDS = 4  # kLaneStateWords
_CTRL_HEADER_BYTES = 64  # BarrierCtrl before its records
_DIAG_BYTES = 64  # sizeof(BarrierDiag)
_MAX_THREADS = 1024

# Defaults (docs/design.md "Barrier")
DEFAULT_TIMEOUT_S = 600.0  # the host timeout: a wait this long is aborted
DEFAULT_DIAG_AFTER_S = 10.0  # the device diagnostic (never later than the host timeout)
_WATCH_INTERVAL_S = 0.05  # the watchdog's period (records, abort); liveness() every _LIVE_S
_LIVE_S = 0.5


@dataclass(frozen=True)
class BarrierTimeout:
    """One lane's record, as the barrier kernel wrote it: ``state`` is ``"waiting"`` (still
    waiting for ``missing_peer`` after the diagnostic delay), ``"passed"`` (that wait ended
    normally after ``waited_s``), ``"aborted"`` (it returned on the abort word) or
    ``"trapped"`` (``trap=True``: the kernel trapped)."""

    lane: int
    rank: int
    missing_peer: int
    epoch: int
    observed: int
    world: int
    state: str = "waiting"
    waited_s: float = 0.0
    diag_after_s: float = 0.0

    def __str__(self) -> str:
        return (
            f"vmmkv barrier timeout: lane={self.lane} rank={self.rank} "
            f"missing peer={self.missing_peer} epoch={self.epoch} observed={self.observed} "
            f"world={self.world} state={self.state} waited={self.waited_s:.3f}s"
        )


class BarrierAborted(RuntimeError):
    """A wait of this barrier was abandoned (a peer is gone, the host timeout passed, the lane
    was used by two launches at once, or ``abort()``): the barrier and the cache over it are
    broken. Names the rank, the peer (None when unknown), the lane, the epoch, the device, the
    call that raised and why. The CUDA context is still usable: close the cache."""

    def __init__(self, rank: int, device: object, call: str, lane: int | None,
                 epoch: int | None, peer: int | None, reason: str):  # fmt: skip
        self.rank, self.device, self.call = rank, device, call
        self.lane, self.epoch, self.peer, self.reason = lane, epoch, peer, reason
        where = f"lane {lane}" if lane is not None else "a lane"
        if epoch is not None:
            where += f" epoch {epoch}"
        whom = f"peer rank {peer}" if peer is not None else "its peers"
        super().__init__(
            f"rank {rank} ({device}): {call}: vmmkv barrier aborted ({where}, waiting for "
            f"{whom}): {reason}. The barrier and the cache over it are broken: close them (the "
            f"CUDA context stays usable)."
        )


def _free_host(host_ptr: int, ordinal: int) -> None:
    if driver.finalizing():
        return
    with driver.primary_context(ordinal):
        driver.call(driver.cu.cuMemFreeHost, host_ptr, device=ordinal)


def _free_host_at_gc(host_ptr: int, ordinal: int) -> None:
    # garbage collection has nobody to raise to (e.g. the context died after a barrier trap)
    try:
        _free_host(host_ptr, ordinal)
    except driver.CudaError as exc:
        _log.warning("vmmkv DeviceBarrier: freeing its control page failed: %s", exc)


# A full memory barrier between the host's reads of a record (the device writes it as a
# seqlock; on Arm hosts plain loads may reorder): acquiring and releasing a lock fences.
_order = threading.Lock()


def _fence() -> None:
    with _order:
        pass


class DeviceBarrier:
    """Barrier among ``world`` ranks over mapped signal regions; see the module docstring.

    ``timeout_s``: the host timeout (default 600 s): a wait that long is aborted (``trap=True``:
    the device traps after it instead). ``diag_after_s``: the device diagnostic's delay
    (default ``min(10, timeout_s)``). ``liveness``: called by the watchdog about twice a second;
    returns None while every peer is alive, else ``(peer, why)``: the barrier's waits are then
    aborted. ``name``: how errors call the object's calls (e.g. ``"ReplicatedKVCache"``)."""

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
        for name, v in (("timeout_s", timeout_s), ("diag_after_s", diag_after_s)):
            if v is None and name == "diag_after_s":
                continue
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not math.isfinite(v)
                or v <= 0
            ):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        if not isinstance(trap, bool):
            raise TypeError(f"trap must be a bool, got {trap!r}")
        if liveness is not None and not callable(liveness):
            raise TypeError(f"liveness must be callable or None, got {type(liveness).__name__}")
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
        self.timeout_s = float(timeout_s)
        self.trap = trap
        # trap: the device's timeout is the trap; otherwise its diagnostic comes first
        diag = (
            self.timeout_s
            if trap
            else min(
                self.timeout_s,
                DEFAULT_DIAG_AFTER_S if diag_after_s is None else float(diag_after_s),
            )
        )
        self.diag_after_s = diag
        self.timeout_ns = min(int(diag * 1e9), 2**63 - 1)  # the device's (BarrierArgs.diag_ns)
        self.fence = [fence] if isinstance(fence, torch.Tensor) else list(fence)
        for t in self.fence:
            if not isinstance(t, torch.Tensor) or t.device != dev:
                raise ValueError(f"fence must hold tensors on {dev}, got {t!r:.80}")
        self._fence_ptrs = [t.data_ptr() for t in self.fence]
        self._threads = min(_MAX_THREADS, 32 * -(-world // 32))
        self.arrivals = torch.zeros(lanes, dtype=torch.int32, device=dev)
        # busy word, record claim and record sequence of each lane (csrc/barrier.cuh)
        self.lane_state = torch.zeros(lanes, _LANE_STATE_WORDS, dtype=torch.int32, device=dev)

        flags = driver.cu.CU_MEMHOSTALLOC_DEVICEMAP | driver.cu.CU_MEMHOSTALLOC_PORTABLE
        nbytes = _CTRL_HEADER_BYTES + _DIAG_BYTES * lanes
        with driver.primary_context(ordinal):
            host_ptr = int(driver.call(driver.cu.cuMemHostAlloc, nbytes, flags, device=ordinal))
            try:
                ctypes.memset(host_ptr, 0, nbytes)
                dev_ptr = driver.call(driver.cu.cuMemHostGetDevicePointer, host_ptr, 0)
            except BaseException:
                driver.call(driver.cu.cuMemFreeHost, host_ptr, device=ordinal)
                raise
        self._host_ptr = host_ptr
        self._abort_word = ctypes.c_int32.from_address(host_ptr)
        self._diag_dev_ptr = int(dev_ptr)  # the control page, as the kernels see it
        self._closed = False
        self._error: BarrierAborted | None = None
        self._blocked = False  # closed or broken: the launch paths' one check
        self._abort_reason: tuple[int | None, str] | None = None
        self._liveness = liveness
        self._notify = ""  # why the peers should be told (the watchdog posts it, unlocked)
        # the control page is read by the watchdog thread and freed by close(): never both
        self._page_lock = threading.RLock()
        self._next_live = 0.0
        self._waiting: dict[int, tuple[int, int, float]] = {}  # lane -> (epoch, seq, first seen)
        self._logged: set[tuple[int, int, int]] = set()
        self._free = weakref.finalize(self, _free_host_at_gc, host_ptr, ordinal)
        # Not at exit. weakref.finalize runs its finalizers from an atexit hook, and there the
        # object is still reachable: the watchdog thread (a daemon, it keeps running through
        # the exit) still reads the page every _WATCH_INTERVAL_S, and freeing it under the
        # watchdog made the read a SIGSEGV (a cache held by a module global at exit, on the
        # GPU). The process exit returns the memory.
        self._free.atexit = False
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
        _watchdog.add(self)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def broken(self) -> BarrierAborted | None:
        """The error every call raises once a wait of this barrier was abandoned, else None."""
        return self._error

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

    def check(self, call: str = "check") -> None:
        """Raise :class:`BarrierAborted` (naming ``call``) once this barrier is broken."""
        err = self._error
        if err is not None:
            raise BarrierAborted(
                err.rank, err.device, call, err.lane, err.epoch, err.peer, err.reason
            ) from err

    def barrier_args(self, lane: int) -> bytes:
        """The packed ``BarrierArgs`` (csrc/barrier.cuh) of ``lane``, for the store kernels that
        end with this barrier. Raises like ``arrive_and_wait`` for a bad lane or a closed or
        broken barrier."""
        self._check_lane(lane, "publish")
        return self._args[lane]

    # -- liveness ------------------------------------------------------------------------------
    def abort(self, reason: str, peer: int | None = None) -> None:
        """Set the abort word: every wait of this barrier, now or later, returns at its next
        check (within about a millisecond) instead of waiting; the barrier is broken once one
        did (or at once when ``peer`` is None and nothing waits: see ``_watch``). Local,
        idempotent, thread-safe (the watchdog calls it); no CUDA call."""
        with self._page_lock:
            if self._closed:
                return
            if self._abort_reason is None:
                self._abort_reason = (peer, str(reason))
            self._abort_word.value = _ABORT_BY_HOST

    def _records(self) -> list[BarrierTimeout | None]:
        out = []
        for lane in range(self.lanes):
            rec = self._read_record(lane)
            out.append(None if rec is None else rec[0])
        return out

    def _read_record(self, lane: int) -> tuple[BarrierTimeout, int] | None:
        """Lane ``lane``'s record and its sequence number, or None (none yet, or being
        written: the next read gets it). The device writes it as a seqlock."""
        addr = self._host_ptr + _CTRL_HEADER_BYTES + _DIAG_BYTES * lane
        seq_word = ctypes.c_int32.from_address(addr)
        seq = seq_word.value
        if seq <= 0 or seq & 1:
            return None
        _fence()
        w = (ctypes.c_int32 * 16).from_buffer_copy((ctypes.c_char * _DIAG_BYTES).from_address(addr))
        _fence()
        if seq_word.value != seq or w[12] != _DIAG_MAGIC:
            return None
        waited = (w[8] & 0xFFFFFFFF) | (w[9] << 32)
        diag = (w[10] & 0xFFFFFFFF) | (w[11] << 32)
        rec = BarrierTimeout(
            lane=w[2], rank=w[3], missing_peer=w[4], epoch=w[5], observed=w[6], world=w[7],
            state=_STATES.get(w[1], f"state {w[1]}"), waited_s=waited * 1e-9,
            diag_after_s=diag * 1e-9,
        )  # fmt: skip
        return rec, seq

    def read_diagnostic(self, lane: int | None = None) -> BarrierTimeout | None:
        """The record of ``lane`` (None: the first lane that has one) as the kernel last wrote
        it, or None (no late wait, or closed). Reads host memory only."""
        if self.closed:
            return None
        lanes = range(self.lanes) if lane is None else (lane,)
        for ln in lanes:
            rec = self._read_record(ln)
            if rec is not None:
                return rec[0]
        return None

    def _header(self) -> tuple[int, int, int, int]:
        h = (ctypes.c_int32 * 4).from_address(self._host_ptr)
        busy_lane, epoch, found = h[1], h[2], h[3]
        _fence()
        return h[0], busy_lane, epoch, found

    def _fail(self, lane: int | None, epoch: int | None, peer: int | None, reason: str) -> None:
        if self._error is None:
            self._error = BarrierAborted(self.rank, self.device, "watchdog", lane, epoch, peer,
                                         reason)  # fmt: skip
            self._blocked = True
            _log.error("%s", self._error)
            self.abort(reason, peer)
            self._notify = f"broke: {reason}"

    def _watch(self, now: float) -> None:
        """One watchdog pass (the watchdog thread; tests may call it): lane misuse, records
        (log late waits; abort one waiting past ``timeout_s``; break on an abandoned wait),
        then ``liveness()`` about twice a second (outside the page lock: it may ask a store)."""
        with self._page_lock:
            if not self._closed and self._error is None:
                self._watch_page(now)
        notify = getattr(self._liveness, "notify", None)
        if self._notify and notify is not None:  # tell the group's peers: they stop waiting
            why, self._notify = self._notify, ""
            notify(why)
        if (
            self._error is None
            and not self._closed
            and self._liveness is not None
            and now >= self._next_live
        ):
            self._next_live = now + _LIVE_S
            dead = self._liveness()
            if dead is not None:
                self.abort(dead[1], dead[0])

    def _watch_page(self, now: float) -> None:
        abort, busy_lane, busy_epoch, busy_found = self._header()
        if busy_lane:
            self._fail(busy_lane - 1, busy_epoch, None,
                       f"lane {busy_lane - 1} was used by two launches at once (found "
                       f"{busy_found}): a lane must be used by one stream at a time")  # fmt: skip
            return
        for lane in range(self.lanes):
            got = self._read_record(lane)
            if got is None:
                continue
            rec, seq = got
            key = (lane, seq, rec.epoch)
            if rec.state == "aborted":
                peer, why = self._abort_reason or (rec.missing_peer, "aborted")
                if peer is None:
                    peer = rec.missing_peer
                self._fail(lane, rec.epoch, peer,
                           f"{why} (the kernel waited {rec.waited_s:.3f} s for peer "
                           f"{rec.missing_peer}, its slot at {rec.observed})")  # fmt: skip
                return
            if rec.state == "waiting":
                first = self._waiting.get(lane)
                if first is None or first[:2] != (rec.epoch, seq):
                    first = self._waiting[lane] = (rec.epoch, seq, now)
                if key not in self._logged:
                    self._logged.add(key)
                    _log.warning(
                        "vmmkv barrier: rank %d (%s) lane %d epoch %d still waiting for peer %d "
                        "after %.1f s; aborting after %.0f s", self.rank, self.device, lane,
                        rec.epoch, rec.missing_peer, rec.waited_s, self.timeout_s,
                    )  # fmt: skip
                if not self.trap and rec.waited_s + (now - first[2]) >= self.timeout_s:
                    self.abort(
                        f"peer rank {rec.missing_peer} did not arrive within the barrier "
                        f"timeout of {self.timeout_s:g} s (VMMKV_BARRIER_TIMEOUT)",
                        rec.missing_peer,
                    )
            elif rec.state == "passed" and key not in self._logged:
                self._logged.add(key)
                self._waiting.pop(lane, None)
                _log.warning(
                    "vmmkv barrier: rank %d (%s) lane %d epoch %d waited %.1f s for peer %d, "
                    "then passed", self.rank, self.device, lane, rec.epoch, rec.waited_s,
                    rec.missing_peer,
                )  # fmt: skip

    def close(self) -> None:
        """Free the host-mapped control page. Idempotent; raises CudaError if the free fails
        (the memory is then left to process exit)."""
        with self._page_lock:
            self._closed = True
            self._blocked = True
        _watchdog.discard(self)
        if self._free.detach() is not None:
            _free_host(self._host_ptr, self.ordinal)


class _Watchdog:
    """One daemon thread per process that calls ``_watch`` of every open DeviceBarrier every
    ``_WATCH_INTERVAL_S``; it exits when none is left (the next one starts it again)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._barriers: weakref.WeakSet[DeviceBarrier] = weakref.WeakSet()
        self._thread: threading.Thread | None = None

    def add(self, bar: DeviceBarrier) -> None:
        with self._lock:
            self._barriers.add(bar)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="vmmkv-barrier-watchdog", daemon=True
                )
                self._thread.start()

    def discard(self, bar: DeviceBarrier) -> None:
        with self._lock:
            self._barriers.discard(bar)

    def _run(self) -> None:
        while True:
            time.sleep(_WATCH_INTERVAL_S)
            with self._lock:
                bars = list(self._barriers)
                if not bars:
                    self._thread = None
                    return
            now = time.monotonic()
            for bar in bars:
                try:
                    bar._watch(now)
                except Exception:  # never let one barrier's failure stop the others' watch
                    _log.exception("vmmkv barrier watchdog: rank %d (%s)", bar.rank, bar.device)
            del bars


_watchdog = _Watchdog()


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
