"""``SymmetricRegion``: every rank's ``VirtualRegion`` of one capacity, mapped by every other
rank, resized collectively.

Contract:
- Collective (every rank of the group, same order of calls): the constructor, ``resize``,
  ``agree``, ``host_barrier``. Each ends with one outcome on every rank (``vmmkv.ipc.comm``):
  all ranks succeed, or all raise. Local: ``close`` (idempotent; a peer may be dead), views and
  properties.
- ``peers`` selects peer mapping: ``"require"`` maps every peer or raises on every rank
  (:class:`DirectUnsupported` when impossible); ``"auto"`` tries, and on any failure that is not
  the caller's (mapping impossible, an fd exchange or a mapping failed, ranks in different PID
  namespaces) every rank falls back together to an unmapped region, ``why_not_mapped`` saying
  why (identical on every rank); ``"off"`` never maps. Timeouts (a rank missing) and
  configuration mismatches (:class:`ConfigMismatch`) always raise.
- ``must_match``: per-rank settings of the caller that must be equal on every rank; gathered
  with the first request, a mismatch raises the same error on every rank.
- ``resize`` is refused during CUDA stream capture on the calling thread (a capture running on
  another thread cannot be seen: do not resize while another thread captures). A failed grow leaves every rank at the old
  size and the group usable; a failed shrink leaves the bound lowered and the object refusing
  further resizes (some ranks may have unmapped their peers' chunks).
- ``committed_table`` (device int64 ``[1]``) holds the committed size every rank's region has;
  kernels read it as their bound, so growth after CUDA-graph capture needs no new arguments.

Ownership: a ``SymmetricRegion`` owns its ``VirtualRegion`` and its ``PeerMap``; ``close`` unmaps
peers' memory first, then releases the own region.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any

import torch

from .._util import run_all
from ..alloc import Chunk, VirtualRegion
from .comm import GroupError, PeerTimeoutError, StoreComm
from .peers import (
    ConfigMismatch,
    PeerMap,
    RendezvousError,
    as_rendezvous_error,
    exchange_then_agree,
    gather_requests,
    map_peers,
)

__all__ = ["PEER_MODES", "SymmetricRegion"]

log = logging.getLogger(__name__)

PEER_MODES = ("require", "auto", "off")


class SymmetricRegion:
    """See the module docstring."""

    def __init__(
        self,
        capacity_bytes: int,
        device: Any = None,
        group: Any = None,
        *,
        chunk_bytes: int | None = None,
        initial_bytes: int = 0,
        backend: str = "auto",
        timeout: float = 60.0,
        peers: str = "require",
        must_match: dict[str, Any] | None = None,
    ) -> None:
        if peers not in PEER_MODES:
            raise ValueError(f"peers must be one of {PEER_MODES}, got {peers!r}")
        self._comm = StoreComm(group, timeout)
        self._closed = False
        self._broken = ""  # set when a failed shrink left the mappings inconsistent
        self._lock = threading.Lock()
        self.peers: PeerMap | None = None
        self.why_not_mapped = "peer mapping off" if peers == "off" else ""
        # The region is created after the StoreComm so that every rank runs the same steps
        # whatever fails locally: a local error travels in the first request.
        self.region: VirtualRegion | None = None
        error: BaseException | None = None
        try:
            self.region = VirtualRegion(
                capacity_bytes, device, chunk_bytes=chunk_bytes, backend=backend
            )
            self.region.commit(initial_bytes)
            # Local device tables before the last agreement (nothing local happens after it).
            self.local_table = torch.tensor(
                [self.region.base_ptr], dtype=torch.int64, device=self.region.device
            )
            self.committed_table = torch.full(
                (1,), self.region.committed_bytes, dtype=torch.int64, device=self.region.device
            )
        except Exception as exc:
            error = exc
        try:
            match = {"peers": peers, **(must_match or {})}
            reqs = gather_requests(self._comm, self.region, match, error)  # type: ignore[arg-type]
            if peers != "off":
                self.peers = self._map(reqs, peers)
        except BaseException:
            if self.region is not None:
                self.region.close()
            raise

    def _map(self, reqs: list[dict[str, Any]], mode: str) -> PeerMap | None:
        try:
            return map_peers(self._comm, self.region, reqs)
        except (PeerTimeoutError, ConfigMismatch):
            raise
        except RendezvousError as exc:
            if mode == "require":
                raise
            self.why_not_mapped = str(exc)
            return None

    # -- properties ------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def world_size(self) -> int:
        return self._comm.world_size

    @property
    def group(self) -> Any:
        return self._comm.group

    @property
    def timeout(self) -> float:
        return self._comm.timeout

    @property
    def device(self) -> torch.device:
        return self.region.device

    @property
    def backend(self) -> str:
        return self.region.backend

    @property
    def base_ptr(self) -> int:
        return self.region.base_ptr

    @property
    def chunk_bytes(self) -> int:
        return self.region.chunk_bytes

    @property
    def committed_bytes(self) -> int:
        return self.region.committed_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.region.capacity_bytes

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def mapped(self) -> bool:
        """True when every peer's region is mapped here (``peers`` is a PeerMap)."""
        return self.peers is not None

    @property
    def ptr_table(self) -> torch.Tensor:
        """Device int64 ``[world]`` of every rank's base here (needs ``mapped``)."""
        return self._peer_map().ptr_table

    def _peer_map(self) -> PeerMap:
        if self.peers is None:
            raise RuntimeError(
                f"rank {self.rank}: peers are not mapped ({self.why_not_mapped or 'peers=off'})"
            )
        return self.peers

    def view(self, rank: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        if rank == self.rank:
            return self.region.tensor(dtype)
        return self._peer_map().view(rank, dtype)

    # -- collective helpers for the layers above -------------------------------------------
    def agree(self, error: BaseException | None, what: str) -> None:
        """Collective: raises the same :class:`GroupError` on every rank if any rank passes
        an error (e.g. the cache's local setup after construction)."""
        self._check_open()
        self._comm.agree(error, what)

    def host_barrier(self, what: str = "host barrier") -> None:
        """Collective host barrier bounded by this object's timeout (not the group's)."""
        self._check_open()
        self._comm.barrier(what)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: SymmetricRegion is closed")

    # -- collective resize -----------------------------------------------------------------
    def resize(self, committed_bytes: int, *, direction: str | None = None) -> int:
        """Collective: grow or shrink every rank's committed prefix to ``committed_bytes``
        (rounded up to chunks). Returns the new committed size.

        Every rank's request (and whatever is wrong with it: type, range, a stream capture in
        progress, a ``direction`` of ``"grow"``/``"shrink"`` that the size contradicts) is
        gathered first, so a bad request raises on every rank: the offending rank raises
        TypeError/ValueError/RuntimeError, the others RendezvousError naming it. A failed grow
        leaves every rank at the old size and the group usable."""
        self._check_open()
        problem, kind = self._resize_problem(committed_bytes, direction)
        with self._lock:
            # A fresh nonce per exchange names its sockets: unpredictable before this step.
            request = (None if problem else committed_bytes, problem, secrets.token_hex(16))
            try:
                reqs = self._comm.all_gather(request, "resize request")
            except GroupError as exc:
                raise as_rendezvous_error(exc) from None
            problems = {r: p for r, (_, p, _) in enumerate(reqs) if p}
            if problems:
                msg = "resize rejected: " + "; ".join(f"rank {r}: {p}" for r, p in problems.items())
                raise (kind if problem else RendezvousError)(msg)
            sizes = [size for size, _, _ in reqs]
            if any(size != sizes[0] for size in sizes):
                raise RendezvousError(
                    "resize: the target size must be identical on all ranks, got "
                    + ", ".join(f"rank {r}: {size}" for r, size in enumerate(sizes))
                )
            target = self.region.round_up(committed_bytes)
            current = self.region.committed_bytes
            if target > current:
                self._grow(current, committed_bytes, reqs[0][2])
            elif target < current:
                self._shrink(target)
            return self.region.committed_bytes

    def _resize_problem(self, nbytes: Any, direction: str | None) -> tuple[str, type]:
        """('', None) when this rank's resize request is valid, else (reason, exception type)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            return f"committed_bytes must be an int, got {type(nbytes).__name__}", TypeError
        if not 0 <= nbytes <= self.capacity_bytes:
            return f"committed_bytes={nbytes} outside [0, {self.capacity_bytes}]", ValueError
        if direction not in (None, "grow", "shrink"):
            return f"direction must be None, 'grow' or 'shrink', got {direction!r}", ValueError
        current = self.region.committed_bytes
        if direction == "grow" and nbytes < current:
            return f"grow to {nbytes} is below the committed {current}; use shrink", ValueError
        if direction == "shrink" and nbytes > current:
            return f"shrink to {nbytes} is above the committed {current}; use grow", ValueError
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return "refused during CUDA stream capture (resize before or after)", RuntimeError
        if self._broken:
            return f"unusable after {self._broken}; close it", RuntimeError
        return "", type(None)

    def _grow(self, current: int, nbytes: int, nonce: str) -> None:
        deadline = time.monotonic() + self.timeout
        added: list[Chunk] = []
        error: Exception | None = None
        try:
            added = self.region.commit(nbytes)
        except Exception as exc:
            error = exc
        try:
            if self.peers is None:
                self._comm.agree(error, f"grow to {nbytes} bytes (local commit)")
            else:
                peers = self.peers
                exchange_then_agree(
                    self._comm,
                    f"grow to {nbytes} bytes (peer mapping)",
                    lambda err: peers.exchange_new(added, nonce, err),
                    error,
                    deadline,
                )
        except GroupError as exc:
            self._release_local(current)
            raise as_rendezvous_error(exc) from error
        self._set_committed(self.region.committed_bytes)

    def _release_local(self, current: int) -> None:
        """Roll a failed grow back to ``current``: peers' new chunks first, then our own. Errors
        are logged, not raised: the grow's own error is the one the caller raises."""
        steps = [lambda: self.region.decommit(current)]
        if self.peers is not None:
            steps.insert(0, lambda: self.peers.unmap_peers_from(current))
        try:
            run_all(steps)
        except Exception as exc:
            # Chunks that stayed mapped stay on the books (no hole), but the next grow would
            # find them in its way: refuse further resizes, as after a failed shrink.
            self._broken = f"a failed grow rollback ({exc})"
            log.error("rank %d: rolling back a failed grow: %s", self.rank, exc)

    def _shrink(self, target: int) -> None:
        # Kernels stop writing past target from here on. If anything below fails, the bound
        # stays lowered (writes beyond it are skipped and counted, never faulting) and the
        # object refuses further resizes: some ranks may have unmapped their peers' chunks.
        self._set_committed(target)
        try:
            self.region.synchronize()
            self._comm.barrier("shrink: all ranks idle")
            error = None
            try:
                if self.peers is not None:
                    self.peers.unmap_peers_from(target)
            except Exception as exc:
                error = exc
            self._comm.agree(error, "shrink: peers unmapped")
            self.region.decommit(target)
        except BaseException as exc:
            self._broken = f"a failed shrink to {target} bytes ({exc})"
            if isinstance(exc, GroupError):
                raise as_rendezvous_error(exc) from exc
            raise

    def _set_committed(self, nbytes: int) -> None:
        self.committed_table.fill_(nbytes)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        """Local and idempotent: peers' mappings go first, then the own region."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        run_all([self.peers.close if self.peers else lambda: None, self.region.close])

    def __enter__(self) -> SymmetricRegion:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
