"""The host side of :class:`~vmmkv.ops.barrier.DeviceBarrier` (docs/design.md, "Barrier",
"Liveness"): its host-mapped control page, the errors it raises, and the watchdog thread that
aborts waits. Nothing here launches a kernel; the launches are ``vmmkv.ops.barrier``'s.

Contract:
- :class:`BarrierControl` is the base class of ``DeviceBarrier``, which validates every
  argument, calls ``BarrierControl.__init__`` once its device tensors exist and
  ``_start_watch()`` once it is complete. The control page is one ``cuMemHostAlloc``
  (``DEVICEMAP | PORTABLE``), zeroed: the abort word and the lane-misuse header (64 bytes,
  ``BarrierCtrl`` in csrc/barrier.cuh), then one diagnostic record per lane (``BarrierDiag``).
  The kernels reach it through ``_diag_dev_ptr``, packed once into every lane's
  ``BarrierArgs``, so captured graphs replay unchanged.
- Local: no call here is collective, and none makes a CUDA call except the page's allocation
  and free. ``abort``, ``check``, ``broken`` and ``read_diagnostic`` read or write host memory
  only, so they are capture-safe, and ``read_diagnostic`` works after a trap. The watchdog
  thread and the owner's threads share the object: the page lock keeps the watchdog's reads
  and ``close()``'s free apart, and ``abort`` may be called from any thread.
- Liveness: a wait never traps by default. ``timeout_s`` is the HOST timeout: a wait longer
  than that is aborted by the watchdog. After ``diag_after_s`` (default ``min(10,
  timeout_s)``) the kernel writes a diagnostic record for its lane (rank, lane, missing peer,
  epoch, observed value, how long), prints it once and keeps waiting; if the peer then
  arrives, the record says "passed" and a warning is logged. Every ~1000 spins (never on the
  fast path) the wait reads the abort word; the watchdog (one daemon thread per process,
  every ``_WATCH_INTERVAL_S``) sets it when ``liveness()`` names a dead peer (the cache passes
  one that checks the peers' pids and the group's store), when a record has been waiting for
  ``timeout_s``, or on ``abort()``. The kernel then returns, the CUDA context stays usable, and
  once a wait was abandoned every later launch and ``check`` raises :class:`BarrierAborted`
  naming the rank, the peer, the lane, the device and the call. ``trap=True`` (opt-in) traps
  after ``timeout_s`` on the device instead: the record is complete before any thread traps,
  the CUDA context is then unusable and the process should exit.
- Lane misuse: a launch that finds its lane in use by another launch writes the lane and epoch
  to the page header and sets the abort word itself; the watchdog then breaks the barrier
  ("used by two launches at once") and tells the peers through ``liveness.notify``.
- ``close()`` frees the control page (idempotent, local, skipped while the interpreter
  finalizes); the owner calls it when no barrier launched by this object can still run (the
  cache synchronizes first; after an abort every wait returns, so that synchronize returns).
  A barrier garbage collected without ``close()`` queues its page, freed by the next barrier's
  construction or any ``close()``: the collector may run while another stream captures a CUDA
  graph, and a free then would invalidate that capture. Not at interpreter exit: the watchdog
  thread may still read the page then, and the process exit returns it.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vmmkv.alloc import driver

__all__ = ["BarrierAborted", "BarrierControl", "BarrierTimeout", "check_settings"]

# DeviceBarrier's one logger, whichever of its modules logs
_log = logging.getLogger("vmmkv.ops.barrier")

# Mirrors of csrc/barrier.cuh (the control page and its records)
_DIAG_MAGIC = 0x564D4D42  # kDiagMagic
_STATES = {1: "waiting", 2: "passed", 3: "aborted", 4: "trapped"}  # kDiag*
_ABORT_BY_HOST = 1  # kAbortByHost
_CTRL_HEADER_BYTES = 64  # BarrierCtrl before its records
_DIAG_BYTES = 64  # sizeof(BarrierDiag)

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


def check_settings(timeout_s: object, diag_after_s: object, trap: object, liveness: object) -> None:
    """ValueError/TypeError for a host setting ``BarrierControl`` cannot take: timeouts that
    are not finite numbers > 0 (``diag_after_s`` may be None), a ``trap`` that is not a bool, a
    ``liveness`` that is neither callable nor None."""
    for name, v in (("timeout_s", timeout_s), ("diag_after_s", diag_after_s)):
        if v is None and name == "diag_after_s":
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    if not isinstance(trap, bool):
        raise TypeError(f"trap must be a bool, got {trap!r}")
    if liveness is not None and not callable(liveness):
        raise TypeError(f"liveness must be callable or None, got {type(liveness).__name__}")


def _free_host(host_ptr: int, ordinal: int) -> None:
    if driver.finalizing():
        return
    with driver.primary_context(ordinal):
        driver.call(driver.cu.cuMemFreeHost, host_ptr, device=ordinal)


# Control pages of barriers dropped without close(), freed at the next safe point. The garbage
# collector runs whenever Python allocates, on any thread, e.g. while another stream captures a
# CUDA graph: a cuMemFreeHost then is refused and invalidates that capture (seen on an H200:
# a dropped barrier's cycle collected inside torch.cuda.graph). So a collected barrier only
# queues its page; the next barrier's construction or any close() frees the queue (neither is
# capture-safe anyway), and the process exit returns what is left.
_dropped: collections.deque[tuple[int, int]] = collections.deque()  # appends and pops: atomic


def _free_host_at_gc(host_ptr: int, ordinal: int) -> None:
    _dropped.append((host_ptr, ordinal))  # no lock: the collector may run inside any lock


def _free_dropped() -> None:
    while True:
        try:
            host_ptr, ordinal = _dropped.popleft()
        except IndexError:
            return
        # nobody to raise to for another object's page (e.g. the context died after a trap)
        try:
            _free_host(host_ptr, ordinal)
        except driver.CudaError as exc:
            _log.warning("vmmkv DeviceBarrier: freeing a dropped control page failed: %s", exc)


# A full memory barrier between the host's reads of a record (the device writes it as a
# seqlock; on Arm hosts plain loads may reorder): acquiring and releasing a lock fences.
_order = threading.Lock()


def _fence() -> None:
    with _order:
        pass


class BarrierControl:
    """The host side of a barrier among ``world`` ranks on ``device`` (see the module
    docstring): the control page, the abort word, the records, the error state and the
    watchdog's pass. ``timeout_s``: the host timeout (``trap=True``: the device traps after it
    instead). ``diag_after_s``: the device diagnostic's delay (default ``min(10, timeout_s)``;
    ``trap=True``: ``timeout_s``). ``liveness``: called by the watchdog about twice a second;
    returns None while every peer is alive, else ``(peer, why)``: the waits are then aborted.
    Arguments are checked by the subclass (``check_settings``) before anything is allocated."""

    def __init__(
        self,
        rank: int,
        lanes: int,
        device: torch.device,
        ordinal: int,
        timeout_s: float,
        diag_after_s: float | None,
        trap: bool,
        liveness: Callable[[], tuple[int | None, str] | None] | None,
    ):
        self.rank = rank
        self.lanes = lanes
        self.device = device
        self.ordinal = ordinal
        self.timeout_s = float(timeout_s)
        self.trap = trap
        # trap: the device's timeout is the trap; otherwise its diagnostic comes first
        self.diag_after_s = (
            self.timeout_s
            if trap
            else min(
                self.timeout_s,
                DEFAULT_DIAG_AFTER_S if diag_after_s is None else float(diag_after_s),
            )
        )
        _free_dropped()
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

    def _start_watch(self) -> None:
        """Hand the object to the watchdog thread (the subclass, once it is complete)."""
        _watchdog.add(self)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def broken(self) -> BarrierAborted | None:
        """The error every call raises once a wait of this barrier was abandoned, else None."""
        return self._error

    def check(self, call: str = "check") -> None:
        """Raise :class:`BarrierAborted` (naming ``call``) once this barrier is broken."""
        err = self._error
        if err is not None:
            raise BarrierAborted(
                err.rank, err.device, call, err.lane, err.epoch, err.peer, err.reason
            ) from err

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

    # -- the control page --------------------------------------------------------------------
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

    # -- the watchdog's pass -----------------------------------------------------------------
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
        _free_dropped()
        if self._free.detach() is not None:
            _free_host(self._host_ptr, self.ordinal)


class _Watchdog:
    """One daemon thread per process that calls ``_watch`` of every open barrier every
    ``_WATCH_INTERVAL_S``; it exits when none is left (the next one starts it again)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._barriers: weakref.WeakSet[BarrierControl] = weakref.WeakSet()
        self._thread: threading.Thread | None = None

    def add(self, bar: BarrierControl) -> None:
        with self._lock:
            self._barriers.add(bar)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="vmmkv-barrier-watchdog", daemon=True
                )
                self._thread.start()

    def discard(self, bar: BarrierControl) -> None:
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
