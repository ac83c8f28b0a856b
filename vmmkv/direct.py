"""The direct path of :class:`vmmkv.ReplicatedKVCache`: every rank writes its own tokens, once
quantized, into every replica through the peer mappings; a barrier then makes every rank's
writes visible to every rank.

Contract:
- Built by the cache once, after the region mapped every peer (``SymmetricRegion.mapped``); owns
  its barrier (a :class:`vmmkv.ops.DeviceBarrier` on CUDA, a bounded host barrier over the
  group's store on the host backend) and closes it in ``close`` (local, idempotent).
- ``store`` is local: no collective, no host synchronization; capture-safe on CUDA once the
  kernels are loaded. The stores of a rank become visible to its peers after ``barrier``;
  a peer past a barrier may store into this replica again at once (nothing waits for this
  rank's reads of the replica).
- ``barrier`` is collective in effect: every rank calls it for the same lane the same number of
  times. On CUDA it is a device-side system-scope barrier (capture-safe); on the host backend a
  host barrier bounded by vmmkv's timeout (not the group's), ``SymmetricRegion.host_barrier``.
- Liveness on CUDA (docs/design.md "Barrier"): the barrier's watchdog aborts its waits when
  ``_GroupLiveness`` finds a peer gone: a peer process of this host that exited (fd handles
  imply one host and PID namespace; pid and start time from the rendezvous), or a peer that
  posted in the group's store that it closed its cache or that its barrier broke (any host).
  Waits longer than ``barrier_timeout`` are aborted too. After an abandoned wait ``broken``
  holds the error every later call of the cache raises; ``close`` still works (it posts
  "closed" for the peers first, so that a peer stuck waiting for this rank is released).
- Its store-polling thread ends with ``close``, and at the latest at interpreter exit (an
  ``atexit`` hook stops and joins every one, ``_stop_watchers_at_exit``): a cache still open at
  exit (a module global) must not leave a daemon thread inside a C++ store call when the
  interpreter finalizes; CPython then ends that thread with ``pthread_exit``, whose unwinding
  through pybind11's GIL guard (a noexcept destructor) calls ``std::terminate``: the process
  aborts with "terminate called without an active exception" after a clean run.
- Slots: ``slot_mapping`` (this rank's ``T`` tokens) or, when the engine holds only the
  gathered slot mapping (``[world * T]``, rank-major), this rank's slice of it (a view).
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Any

import torch

from . import ops
from ._store import own_slots
from .ops.kv import KVTarget

__all__ = ["DirectPath"]

log = logging.getLogger(__name__)


class _HostBarrier:
    """Host-backend barrier: writes into shared host mappings are ordered by a host barrier
    over the group's store, bounded by vmmkv's timeout (not the group's)."""

    def __init__(self, region: Any) -> None:
        self._region = region

    def arrive_and_wait(self, lane: int = 0) -> None:
        self._region.host_barrier("cache barrier")  # one name: host barriers run in program order

    def close(self) -> None:
        pass


class _GroupLiveness:
    """``DeviceBarrier``'s ``liveness`` for a mapped region: pids of the peers on this host
    (read on each call), and notices in the group's store (``notify``: this rank closed or
    broke), polled by a daemon thread of its own every ``_STORE_POLL_S``, so that a store that
    hangs never stalls the barrier's watchdog. Best effort: a store that cannot be reached is
    logged once and skipped (the host timeout still holds)."""

    _STORE_POLL_S = 0.5
    _NOTIFY_WAIT_S = 2.0
    _EXIT_JOIN_S = 2.0  # at exit, the longest wait for one poll thread (a store call) to end

    def __init__(self, region: Any) -> None:
        self.rank = region.rank
        self.world = region.world_size
        peers = region.peers
        # fd handles: one host and one PID namespace, checked at the rendezvous, which also
        # took the peers' process start times (PeerMap.liveness; None for by-value handles)
        self._pids = getattr(peers, "liveness", None)
        comm = getattr(region, "_comm", None)
        self._store = getattr(comm, "_store", None)
        self._prefix = f"{getattr(comm, '_prefix', 'vmmkv')}/liveness"
        self._verdict: tuple[int, str] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._store is not None:
            self._thread = threading.Thread(
                target=self._poll, name=f"vmmkv-liveness-rank{self.rank}", daemon=True
            )
            _watchers.add(self)
            self._thread.start()

    def __call__(self) -> tuple[int | None, str] | None:
        if self._pids is not None:
            dead = self._pids()
            if dead is not None:
                return dead
        return self._verdict

    def _poll(self) -> None:
        seen, failed = 0, False
        while not self._stop.wait(self._STORE_POLL_S) and self._verdict is None:
            try:
                count = int(self._store.add(f"{self._prefix}/count", 0))
                if count <= seen:
                    continue
                seen = count
                for peer in range(self.world):
                    key = f"{self._prefix}/{peer}"
                    if peer != self.rank and self._store.check([key]):
                        why = self._store.get(key).decode(errors="replace")
                        self._verdict = (peer, f"peer rank {peer} {why}")
                        break
            except Exception as exc:  # the store's host may be gone too: not a verdict
                if not failed:
                    failed = True
                    log.warning("vmmkv: rank %d cannot read the group's store for liveness: %s",
                                self.rank, exc)  # fmt: skip

    def notify(self, why: str) -> None:
        """Tell the peers (through the store) that this rank is gone for the barrier. Waits at
        most ``_NOTIFY_WAIT_S`` for the store (a daemon thread posts it)."""
        if self._store is None:
            return

        def post() -> None:
            try:
                self._store.set(f"{self._prefix}/{self.rank}", why.encode())
                self._store.add(f"{self._prefix}/count", 1)
            except Exception as exc:
                log.warning("vmmkv: rank %d could not post %r in the group's store: %s",
                            self.rank, why, exc)  # fmt: skip

        t = threading.Thread(target=post, name=f"vmmkv-notify-rank{self.rank}", daemon=True)
        t.start()
        t.join(self._NOTIFY_WAIT_S)

    def stop(self, join_s: float = 0.0) -> None:
        """End the poll thread; with ``join_s``, wait at most that long for it to end."""
        self._stop.set()
        thread = self._thread
        if join_s > 0 and thread is not None and thread is not threading.current_thread():
            thread.join(join_s)


_watchers: weakref.WeakSet[_GroupLiveness] = weakref.WeakSet()


@atexit.register
def _stop_watchers_at_exit() -> None:
    """atexit runs before the interpreter finalizes, while daemon threads still run normally:
    stop every poll thread and wait for it to leave its store call (module docstring)."""
    for watcher in list(_watchers):
        watcher.stop(join_s=watcher._EXIT_JOIN_S)


class DirectPath:
    """Stores into every replica plus a barrier (see the module docstring)."""

    name = "direct"

    def __init__(
        self,
        region: Any,
        fence: torch.Tensor,
        lanes: int,
        barrier_timeout: float,
        barrier_trap: bool = False,
    ) -> None:
        self.rank = region.rank
        self.world_size = region.world_size
        self.device = region.device
        self.peer_bytes = 0
        self._ptr_table = region.ptr_table
        self._stores: dict[tuple[Any, ...], Any] = {}  # bindings -> ops.PreparedStore
        if self.device.type == "cuda":
            peers = region.peers
            need = lanes * 2 * self.world_size * 4
            if need > peers.signal_bytes:
                raise ValueError(
                    f"lanes={lanes} needs {need} signal bytes, more than the "
                    f"{peers.signal_bytes} of the signal region"
                )
            self._liveness: _GroupLiveness | None = _GroupLiveness(region)
            self._barrier: Any = ops.DeviceBarrier(
                peers.signal_table,
                None,
                self.rank,
                self.world_size,
                lanes,
                self.device,
                timeout_s=barrier_timeout,
                fence=fence,
                trap=barrier_trap,
                liveness=self._liveness,
            )
        else:
            self._liveness = None
            self._barrier = _HostBarrier(region)

    def target(self, geometry: dict[str, Any], **tensors: torch.Tensor) -> KVTarget:
        """The target of a bound view: every replica, own base at this rank."""
        return KVTarget(ptr_table=self._ptr_table, my_rank=self.rank, **geometry, **tensors)

    def prepare(self, bindings: tuple[Any, ...]) -> Any:
        """The prepared store (``vmmkv.ops.prepare``) of these bindings, built once."""
        store = self._stores.get(bindings)
        if store is None:
            store = ops.prepare(tuple(b.direct for b in bindings))
            self._stores[bindings] = store
        return store

    def store(self, bindings, inputs, slot_mapping, nlo, gathered) -> int:
        """Store this rank's tokens into every replica; returns the token count."""
        slots, _ = own_slots(slot_mapping, gathered, self.rank, self.world_size)
        store = self.prepare(bindings)
        store.store(inputs, slots, nlo)
        return self._count(store, slots, nlo)

    def publish(self, bindings, inputs, slot_mapping, nlo, gathered, lane: int) -> int:
        """``store`` then ``barrier(lane)``: one launch on CUDA (the ops layer's publish)."""
        slots, _ = own_slots(slot_mapping, gathered, self.rank, self.world_size)
        store = self.prepare(bindings)
        store.publish(inputs, slots, nlo, self._barrier, lane)
        return self._count(store, slots, nlo)

    def _count(self, store: Any, slots: torch.Tensor, nlo: int) -> int:
        tokens = slots.numel()
        entry = sum(t.entry_bytes for t in store.targets)
        self.peer_bytes += (tokens - nlo) * (self.world_size - 1) * entry
        return tokens

    def barrier(self, lane: int) -> None:
        self._barrier.arrive_and_wait(lane)

    @property
    def broken(self) -> Any:
        """The error of an abandoned barrier wait (``vmmkv.ops.BarrierAborted``), else None."""
        return getattr(self._barrier, "broken", None)

    def abort_waits(self, why: str) -> None:
        """Make every device barrier wait of this path, running or queued, return (closing)."""
        abort = getattr(self._barrier, "abort", None)
        if abort is not None:
            abort(why)

    def close(self) -> None:
        self._stores.clear()
        if self._liveness is not None:
            self._liveness.stop()
            err = self.broken
            self._liveness.notify(f"broke: {err.reason}" if err else "closed its cache")
        self._barrier.close()
