"""The direct path of :class:`vmmkv.ReplicatedKVCache`: every rank writes its own tokens, once
quantized, into every replica through the peer mappings; a barrier then makes every rank's
writes visible to every rank.

Contract:
- Built by the cache once, after the region mapped every peer (``SymmetricRegion.mapped``); owns
  its barrier (a :class:`vmmkv.ops.DeviceBarrier` on CUDA, a bounded host barrier over the
  group's store on the host backend) and closes it in ``close`` (local, idempotent).
- ``store`` is local: no collective, no host synchronization; capture-safe on CUDA once the
  kernels are loaded. The stores of a rank become visible to its peers after ``barrier``.
- ``barrier`` is collective in effect: every rank calls it for the same lane the same number of
  times. On CUDA it is a device-side system-scope barrier (capture-safe); on the host backend a
  host barrier bounded by vmmkv's timeout (not the group's), ``SymmetricRegion.host_barrier``.
- Slots: ``slot_mapping`` (this rank's ``T`` tokens) or, when the engine holds only the
  gathered slot mapping (``[world * T]``, rank-major), this rank's slice of it (a view).
"""

from __future__ import annotations

import logging
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


class DirectPath:
    """Stores into every replica plus a barrier (see the module docstring)."""

    name = "direct"

    def __init__(
        self,
        region: Any,
        fence: torch.Tensor,
        lanes: int,
        barrier_timeout: float,
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
            self._barrier: Any = ops.DeviceBarrier(
                peers.signal_table,
                None,
                self.rank,
                self.world_size,
                lanes,
                self.device,
                timeout_s=barrier_timeout,
                fence=fence,
            )
        else:
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

    def close(self) -> None:
        self._stores.clear()
        self._barrier.close()
