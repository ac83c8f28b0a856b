"""``rendezvous()``: map every peer's region into this process (a :class:`PeerMap`).

Protocol (collective over a CPU-capable group; every step bounded by ``timeout`` and settled with
one outcome on every rank, see ``vmmkv.ipc.comm``):

1. gather a request (host, boot id, NVLink domain, PID/network namespaces, uid, pid, device
   index + UUID, capacity, chunk size, run grid, granularity, backend, handle type, committed
   runs, protocol version, the caller's ``must_match`` settings, a random nonce) and validate it
   identically on every rank: a mismatch raises the same :class:`ConfigMismatch` everywhere,
   naming field and ranks;
2. decide whether peer mapping is possible at all (``vmmkv.ipc.placement``): one NVLink
   domain (``local_location``; several domains never map each other, see docs/design.md
   "Handles by value and NVLink domains"); for fd handles one host (same boot id), one PID and
   one network namespace, one uid (the fd transport checks credentials); P2P access and native
   atomics for every pair of distinct devices (ranks that share a device need neither); if
   not, :class:`DirectUnsupported` on every rank, listing every reason;
3. export every committed run (one handle per run, with its offset and size, whatever its
   size) plus the barrier's signal chunk and send them over the exchange's transport
   (``vmmkv.ipc.transports``): fds (``posix_fd``) with SCM_RIGHTS
   (``vmmkv.ipc.fdpass``) over abstract sockets named with rank 0's nonce, or values
   (``BY_VALUE_HANDLES``: ``fabric``, ``shm_name``) in one step of the group's store; a rank
   whose local preparation failed still takes part and sends an abort notice instead of
   handles, so its peers learn the cause at once;
4. import and map each peer run at its offset inside a ``PeerRegion`` (a reservation of the
   peer's full capacity, so growth never moves anything), then close the fd; the committed
   runs cover any chunk set (a prefix, or the chunks of a block layout's segments), and a peer
   maps exactly the runs its owner committed;
5. build ``ptr_table`` (device int64 ``[world]``, own base in own slot), which never changes;
6. agree on success (the last step): any failure anywhere, or a peer that vanished during the
   exchange, makes every rank roll back what this call created and raise; then every rank
   removes what the exchange's by-value exports left (``release_values``), whatever happened.

Resize helpers (ipc-internal, used by ``vmmkv.ipc.resize`` between its collective points):
``PeerMap.exchange_new(runs, ...)`` passes and maps a grow's new runs (any set of runs);
``unmap_peers_from(offset)`` (prefix) and ``unmap_peers_outside(ranges)`` (a set: keep the runs
overlapping ``ranges``) drop peers' runs whole, by the rule the owner decommits with, trying
every peer and raising the first error. The exchange itself is ``vmmkv.ipc.exchange``.

Ownership: ``PeerMap`` owns the peer mappings and the signal region, never the caller's region.
``PeerMap.close()`` is local and idempotent and unmaps peers' memory before releasing anything
of its own. ``SymmetricRegion`` (``vmmkv.ipc.symmetric``) owns a region and its ``PeerMap``.

The errors (``vmmkv.ipc.errors``), the placement and handle-type names and
``BY_VALUE_HANDLES`` are importable from here too.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .._util import pid_liveness, run_all
from ..alloc import Chunk, PeerRegion, VirtualRegion
from ..alloc import driver as drv
from .comm import GroupError, StoreComm
from .errors import (
    ConfigMismatch,
    DirectUnsupported,
    RendezvousError,
    RendezvousTimeout,
    as_rendezvous_error,
)
from .exchange import exchange_and_map, exchange_then_agree
from .placement import (
    TEST_DOMAIN_ENV,
    TEST_HOST_ENV,
    _by_value,
    _namespace_id,
    _p2p_problems,
    _placement_problem,
    choose_handle_type,
    local_location,
    select_handle_type,
)
from .transports import BY_VALUE_HANDLES, _FdTransport, _Transport, _ValueTransport

__all__ = [
    "PROTOCOL_VERSION",
    "ConfigMismatch",
    "DirectUnsupported",
    "PeerMap",
    "RendezvousError",
    "RendezvousTimeout",
    "rendezvous",
    "select_handle_type",
    "BY_VALUE_HANDLES",
    "TEST_DOMAIN_ENV",
    "TEST_HOST_ENV",
    "choose_handle_type",
    "local_location",
]

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 4  # 4: runs of any size, one handle each; run_bytes in the request


# --------------------------------------------------------------------------------------------
# validation of the gathered requests
# --------------------------------------------------------------------------------------------

_MUST_MATCH = (
    "protocol",
    "backend",
    "capacity_bytes",
    "chunk_bytes",
    "run_bytes",
    "granularity",
    "handle_type",
    "chunks",
    "signal_bytes",
)


def _validate_requests(reqs: list[dict[str, Any]]) -> str:
    """'' if the requests agree, else one message naming every differing field and the ranks."""
    problems = []
    fields = [(f, lambda r, f=f: r[f]) for f in _MUST_MATCH]
    keys = sorted({k for r in reqs for k in r["must_match"]})
    fields += [(k, lambda r, k=k: r["must_match"].get(k, "<unset>")) for k in keys]
    for field, get in fields:
        values = [get(r) for r in reqs]
        if any(v != values[0] for v in values):
            problems.append(f"{field} differs: " + _by_value(values, "have"))
    pids = [r["pid"] for r in reqs]
    hosts = [(r["boot_id"], r["pidns"]) for r in reqs]
    if len(set(zip(pids, hosts, strict=True))) != len(pids):
        problems.append("two ranks are the same process: " + _by_value(pids, "have pid"))
    return "; ".join(problems)


# --------------------------------------------------------------------------------------------
# PeerMap
# --------------------------------------------------------------------------------------------


class PeerMap:
    """Every rank's region mapped into this process (see module docstring).

    ``ptrs[r]`` is rank r's region base in this address space (own slot: the own region);
    ``ptr_table`` is the same as a device int64 tensor, fixed for the object's life;
    ``signal_ptrs`` / ``signal_table`` likewise for the barrier's signal regions.
    """

    def __init__(
        self,
        comm: StoreComm,
        region: VirtualRegion,
        signal: VirtualRegion,
        peers: dict[int, PeerRegion],
        signal_peers: dict[int, PeerRegion],
        pids: list[int],
        *,
        by_value: bool = False,
        liveness: Callable[[], tuple[int, str] | None] | None = None,
    ) -> None:
        self._comm = comm
        self._by_value = by_value
        # fd handles (one host, one PID namespace): ``(peer, why)`` once a peer's process is
        # gone, from start times read at the rendezvous (``_util.pid_liveness``); used by the
        # fd exchanges of later grows and by the device barrier's watchdog. None by value.
        self.liveness = liveness
        self._region = region
        self._signal = signal
        self._peers = peers
        self._signal_peers = signal_peers
        self._pids = pids
        self._closed = False
        self._lock = threading.Lock()
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.group = comm.group
        self.ptrs = [
            region.base_ptr if r == self.rank else peers[r].base_ptr for r in range(self.world_size)
        ]
        self.signal_ptrs = [
            signal.base_ptr if r == self.rank else signal_peers[r].base_ptr
            for r in range(self.world_size)
        ]
        self.ptr_table = torch.tensor(self.ptrs, dtype=torch.int64, device=region.device)
        self.signal_table = torch.tensor(self.signal_ptrs, dtype=torch.int64, device=region.device)

    @property
    def device(self) -> torch.device:
        return self._region.device

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def signal_bytes(self) -> int:
        return self._signal.capacity_bytes

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: PeerMap is closed")

    def _check_rank(self, what: str, rank: Any) -> None:
        self._check_open()
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"{what}: rank must be in [0, {self.world_size}), got {rank!r}")

    def view(self, rank: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """1-D tensor over rank ``rank``'s region through the local mapping (full capacity;
        only committed chunks may be touched)."""
        self._check_rank("view", rank)
        if rank == self.rank:
            return self._region.tensor(dtype)
        return self._peers[rank].tensor(dtype)

    def signal_view(self, rank: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """Rank ``rank``'s barrier signal region through the local mapping."""
        self._check_rank("signal_view", rank)
        if rank == self.rank:
            return self._signal.tensor(dtype)
        return self._signal_peers[rank].tensor(dtype)

    def mapped_bytes(self, rank: int) -> int:
        """Bytes of rank ``rank``'s region mapped here (own: committed), as a sum of runs."""
        self._check_rank("mapped_bytes", rank)
        if rank == self.rank:
            return self._region.committed_bytes
        return self._peers[rank].mapped_bytes

    def mapped_chunks(self, rank: int) -> list[Chunk]:
        """The runs of rank ``rank``'s region mapped here (own: committed), address order."""
        self._check_rank("mapped_chunks", rank)
        if rank == self.rank:
            return self._region.chunks()
        return self._peers[rank].chunks()

    # -- ipc-internal: used by vmmkv.ipc.resize -------------------------------------------
    def exchange_new(
        self, chunks: list[Chunk], nonce: str, local_error: Exception | None, deadline: float
    ) -> None:
        """Between two collective points: pass the own new runs ``chunks`` (e.g. the runs a
        block grow added to every segment) to every peer and map theirs, or, with
        ``local_error``, tell every peer this rank cannot take part (see
        ``exchange.exchange_and_map``). ``nonce``: fresh per exchange, the same on every rank;
        ``deadline``: the step's (``exchange_then_agree``), which the exchange ends before. The
        caller runs ``finish_exchange(nonce)`` after the agreement that follows, whatever
        happened. A closed PeerMap still takes part, as a rank that cannot (its error goes in
        ``local_error``), so the peers' steps stay in order."""
        if self._closed and local_error is None:
            local_error = RuntimeError(f"rank {self.rank}: PeerMap is closed")
        exchange_and_map(
            self._comm, chunks, self._peers, self._transport(nonce, deadline),
            signal=None, signal_peers=None, local_error=local_error,
        )  # fmt: skip

    def finish_exchange(self, nonce: str) -> None:
        """Local, after an exchange's agreement (success or failure): drop what it left behind
        (by value: every exported name; fds: nothing)."""
        self._transport(nonce, None).finish()

    @property
    def by_value(self) -> bool:
        """True when runs travel as values through the store (``BY_VALUE_HANDLES``)."""
        return self._by_value

    def _transport(self, nonce: str, deadline: float | None) -> _Transport:
        kind = _ValueTransport if self._by_value else _FdTransport
        return kind(
            self._comm, self._region, nonce, self._pids,
            deadline=deadline, liveness=self.liveness,
        )  # fmt: skip

    def unmap_peers_from(self, offset: int) -> None:
        """Unmap every peer's runs that start at or above ``offset`` (prefix: rollback of a grow,
        shrink). Every peer is tried; the first error is raised (``UnmapError``)."""
        run_all([(lambda p=p: p.unmap_from(offset)) for p in self._peers.values()])

    def unmap_peers_outside(self, ranges: list[tuple[int, int]]) -> None:
        """Unmap every peer's runs that overlap none of ``ranges`` (a set: rollback of a
        block grow, block shrink). Every peer is tried; the first error is raised."""
        run_all([(lambda p=p: p.unmap_outside(ranges)) for p in self._peers.values()])

    def close(self) -> None:
        """Local and idempotent: unmap every peer mapping, then release the signal region."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        steps: list[Callable[[], None]] = []
        if not drv.finalizing():
            steps.append(self._region.synchronize if not self._region.closed else lambda: None)
        steps += [p.close for p in self._signal_peers.values()]
        steps += [p.close for p in self._peers.values()]
        steps.append(self._signal.close)
        run_all(steps)
        self.group = None  # a closed map keeps no process group alive (StoreComm.release_group)

    def __enter__(self) -> PeerMap:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def rendezvous(
    region: VirtualRegion,
    group: Any = None,
    *,
    timeout: float = 60.0,
    must_match: dict[str, Any] | None = None,
) -> PeerMap:
    """Collective: map every group member's region into this process. See module docstring.
    ``must_match``: extra JSON-serializable settings that must be equal on every rank."""
    if not isinstance(region, VirtualRegion):
        raise TypeError(f"rendezvous: region must be a VirtualRegion, got {type(region)}")
    if region.closed:
        raise ValueError("rendezvous: region is closed")
    comm = StoreComm(group, timeout)
    reqs = gather_requests(comm, region, must_match, local_error=None)
    return map_peers(comm, region, reqs)


def gather_requests(
    comm: StoreComm,
    region: VirtualRegion | None,
    must_match: dict[str, Any] | None,
    local_error: BaseException | None,
) -> list[dict[str, Any]]:
    """Collective: every rank's request, validated identically on every rank. A rank with a
    ``local_error`` (e.g. a failed initial commit) still joins the step; every rank then
    raises, the others naming it. Raises :class:`ConfigMismatch` when the requests disagree."""
    if must_match is not None and not isinstance(must_match, dict):
        raise TypeError(f"must_match must be a dict or None, got {type(must_match).__name__}")
    ordinal = None
    if region is not None and region.device.type == "cuda":
        ordinal = region.device.index
    loc = local_location(ordinal)
    req: dict[str, Any] = {
        "protocol": PROTOCOL_VERSION,
        "host": loc["host"],
        "boot_id": loc["boot_id"],
        "domain": loc["domain"],
        "pidns": _namespace_id("pid"),
        "netns": _namespace_id("net"),
        "uid": os.getuid(),
        "pid": os.getpid(),
        "must_match": dict(must_match or {}),
        "nonce": secrets.token_hex(16),
        "error": None if local_error is None else repr(local_error),
    }
    if region is not None:  # None when creating it failed: the request carries the error
        req.update(
            backend=region.backend,
            device=str(region.device),
            uuid=region.device_uuid(),
            capacity_bytes=region.capacity_bytes,
            chunk_bytes=region.chunk_bytes,
            run_bytes=region.run_bytes,
            granularity=region.granularity,
            handle_type=region.handle_type,
            chunks=[[c.offset, c.size] for c in region.chunks()],
            signal_bytes=region.granularity,
        )
    try:
        reqs = comm.all_gather(req, "rendezvous request")
    except GroupError as exc:
        raise as_rendezvous_error(exc) from local_error
    failed = {r: q["error"] for r, q in enumerate(reqs) if q["error"] is not None}
    if failed:
        raise RendezvousError(
            f"rank {comm.rank}: setting up failed on group ranks {sorted(failed)}: "
            + "; ".join(f"rank {r}: {e}" for r, e in failed.items())
        ) from local_error
    problem = _validate_requests(reqs)
    if problem:
        raise ConfigMismatch(
            f"rendezvous rejected (rank {comm.rank} of {comm.world_size}): {problem}"
        )
    return reqs


def map_peers(comm: StoreComm, region: VirtualRegion, reqs: list[dict[str, Any]]) -> PeerMap:
    """Collective, after :func:`gather_requests`: steps 2-6 of the module docstring. Raises
    :class:`DirectUnsupported` when mapping is impossible, :class:`RendezvousError` (every
    rank) when it failed; nothing created here survives a failure."""
    rank, world = comm.rank, comm.world_size
    deadline = time.monotonic() + comm.timeout
    by_value = region.handle_type in BY_VALUE_HANDLES
    placement = _placement_problem(reqs, by_value)
    problems = [placement] if placement else []
    if not problems:
        try:
            problems = _p2p_problems(rank, reqs)
        except drv.CudaError as exc:
            problems = [f"rank {rank}: P2P query failed: {exc}"]
    try:
        gathered = comm.all_gather(problems, "P2P check")
    except GroupError as exc:
        raise as_rendezvous_error(exc) from None
    all_problems = list(dict.fromkeys(p for ps in gathered for p in ps))
    if all_problems:
        raise DirectUnsupported("peer mapping impossible: " + "; ".join(all_problems))

    pids = [r["pid"] for r in reqs]
    # every peer posted its request just now: its process start time is read while it lives
    liveness = None if by_value else pid_liveness(pids, rank)
    created: list[Any] = []  # rolled back (closed) on failure, in reverse order
    peers: dict[int, PeerRegion] = {}
    signal_peers: dict[int, PeerRegion] = {}
    signal: VirtualRegion | None = None
    local_error: Exception | None = None
    try:
        signal = VirtualRegion(
            region.granularity, region.device, backend=region.backend,
            handle_type=region.handle_type,
        )  # fmt: skip
        created.append(signal)
        signal.commit(signal.capacity_bytes)  # zeroed before anyone sees it
        for r in range(world):
            if r != rank:
                peers[r] = region.open_peer()
                created.append(peers[r])
                signal_peers[r] = signal.open_peer()
                created.append(signal_peers[r])
    except Exception as exc:
        local_error = exc
    pm: list[PeerMap] = []

    kind = _ValueTransport if by_value else _FdTransport
    transport = kind(comm, region, reqs[0]["nonce"], pids, deadline=deadline, liveness=liveness)

    def exchange(error: Exception | None) -> None:
        exchange_and_map(
            comm, region.chunks(), peers, transport,
            signal=signal, signal_peers=signal_peers, local_error=error,
        )  # fmt: skip
        # Device tables are local setup: built before the last agreement, so that a failure
        # here fails every rank (nothing local happens after the agreement).
        pm.append(PeerMap(
            comm, region, signal, peers, signal_peers, pids,
            by_value=by_value, liveness=liveness,
        ))  # fmt: skip

    try:
        exchange_then_agree(
            comm, "rendezvous", exchange, local_error, deadline, finish=transport.finish
        )
    except BaseException:
        _rollback(created)
        raise
    return pm[0]


def _rollback(created: list[Any]) -> None:
    for obj in reversed(created):
        try:
            obj.close()
        except Exception as exc:
            log.error("vmmkv rollback: close of %r failed: %s", obj, exc)
