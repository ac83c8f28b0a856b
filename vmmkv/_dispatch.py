"""The store dispatch of :class:`vmmkv.ReplicatedKVCache`: which path a store, ``publish_layer``
or ``barrier`` goes to, the lanes, the host-side counters, and the paths' teardown.

``StoreDispatch`` owns the cache's two paths once they are built (the gather path, always; the
direct path when every rank mapped every peer): it picks one per call (``mode``: None for the
cache's own, ``"gather"`` or ``"direct"``), checks the bindings' kinds and the lane, and counts
the tokens stored and the barriers passed. ``close`` closes both paths (local, every step run
even if one fails); the region under them is the cache's to close, after them.

- Collective as the path is: the gather stores all-gather over the group; the direct stores are
  local, ``publish``/``barrier`` collective in effect (every rank, same lane, same count).
- Capture-safe as the path is (host-side checks and counters only, no synchronization here),
  except ``sync`` (a device synchronization: teardown only).
- No lock: the stores come from the engine's thread, in program order.
"""

from __future__ import annotations

from typing import Any

import torch

from ._store import check_kinds
from ._util import run_all
from ._views import Binding

__all__ = ["StoreDispatch"]


class StoreDispatch:
    """The paths of one cache and the calls that go to them (see the module docstring).
    ``why_not_direct``: the reason named when ``mode="direct"`` is asked of a gather cache."""

    def __init__(
        self, gather: Any, direct: Any, *, lanes: int, rank: int, device: torch.device,
        why_not_direct: str,
    ) -> None:  # fmt: skip
        self.gather, self.direct = gather, direct
        self.default = direct or gather
        self.paths = (gather, direct) if direct else (gather,)
        self.lanes, self.rank, self.device = lanes, rank, device
        self._why_not_direct = why_not_direct
        self.tokens = 0  # T per store call, both paths alike (stats()["tokens_stored"])
        self.barriers = 0

    def store(self, bindings, inputs, slot_mapping, nlo, mode, gathered) -> None:
        path = self._select(mode)
        check_kinds(bindings, Binding)
        self.tokens += path.store(bindings, inputs, slot_mapping, nlo, gathered)

    def publish(self, bindings, inputs, slot_mapping, nlo, mode, gathered, lane) -> None:
        """``store`` then the barrier of ``lane`` (the gather path has none to wait for)."""
        path = self._select(mode)
        self.check_lane(lane)
        check_kinds(bindings, Binding)
        self.tokens += path.publish(bindings, inputs, slot_mapping, nlo, gathered, lane)
        if path is self.direct:
            self.barriers += 1

    def barrier(self, lane: int) -> None:
        self.check_lane(lane)
        if self.direct is None:
            return
        self.direct.barrier(lane)
        self.barriers += 1

    def _select(self, mode: str | None) -> Any:
        if mode is None:
            return self.default
        if mode == "gather":
            return self.gather
        if mode == "direct":
            if self.direct is None:
                raise RuntimeError(
                    f"rank {self.rank}: direct mode unavailable: {self._why_not_direct}"
                )
            return self.direct
        raise ValueError(f"mode must be None, 'direct' or 'gather', got {mode!r}")

    def check_lane(self, lane: Any) -> None:
        if isinstance(lane, bool) or not isinstance(lane, int) or not 0 <= lane < self.lanes:
            raise ValueError(f"lane must be an int in [0, {self.lanes}), got {lane!r}")

    @property
    def peer_bytes(self) -> int:
        """Entry bytes the direct stores sent to peers (0 without a direct path)."""
        return self.direct.peer_bytes if self.direct else 0

    @property
    def broken(self) -> Any:
        """The error of an abandoned barrier wait (``vmmkv.ops.BarrierAborted``), else None."""
        return self.direct.broken if self.direct else None

    def raise_broken(self, call: str) -> None:
        """Raise the abandoned wait's error, naming ``call`` (the public call that found it)."""
        self.direct._barrier.check(call)

    # -- teardown (ReplicatedKVCache.close runs these in order, then closes the region) -------
    def abort_waits(self) -> None:
        """Make every barrier wait of the direct path, running or queued, return."""
        if self.direct is not None:
            self.direct.abort_waits(f"rank {self.rank} closed its cache")

    def sync(self) -> None:
        """Wait for this rank's device work: a barrier still in flight writes into the
        host-mapped control page that closing the direct path frees."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        run_all([path.close for path in self.paths])
