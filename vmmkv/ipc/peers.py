"""``rendezvous()``: map every peer's region into this process; ``SymmetricRegion``: resize it
collectively.

Protocol (collective over a CPU-capable group; every step bounded by ``timeout``):

1. gather a request (host, pid, device index + UUID, capacity, chunk size, granularity, backend,
   handle type, committed chunks, protocol version, nonce) and validate it identically on every
   rank: a mismatch raises the same :class:`RendezvousError` everywhere, naming field and ranks;
2. check P2P access and native atomics for every pair of distinct devices (ranks that share a
   device need neither); every bad pair is listed;
3. export every committed chunk plus the barrier's signal chunk as fds and pass them with
   SCM_RIGHTS (``vmmkv.ipc.fdpass``) over abstract sockets named with the nonce; senders are
   checked by SO_PEERCRED against the gathered pids;
4. import and map each peer chunk at its offset inside a ``PeerRegion`` (a reservation of the
   peer's full capacity, so growth never moves anything), then close the fd;
5. publish ``ptr_table`` (device int64 ``[world]``, own base in own slot), which never changes;
6. agree on success; any failure anywhere rolls back what this call created on every rank.

Ownership: ``PeerMap`` owns the peer mappings and the signal region, never the caller's region.
``PeerMap.close()`` is local and idempotent and unmaps peers' memory before releasing anything
of its own. ``SymmetricRegion`` owns a ``VirtualRegion`` and its ``PeerMap``; its ``resize`` is
collective and refused during CUDA stream capture.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import secrets
import socket
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..alloc import Chunk, PeerRegion, VirtualRegion
from ..alloc import driver as drv
from ..alloc.region import run_all
from . import fdpass
from .comm import GroupError, StoreComm

__all__ = [
    "PROTOCOL_VERSION",
    "PeerMap",
    "DirectUnsupported",
    "RendezvousError",
    "SymmetricRegion",
    "rendezvous",
    "select_handle_type",
]

log = logging.getLogger("vmmkv.ipc")

PROTOCOL_VERSION = 1


class RendezvousError(GroupError):
    """The rendezvous or a resize failed; raised on every rank of the group."""


class DirectUnsupported(RendezvousError):
    """Peer mapping is impossible for this group (several hosts without fabric handles, no P2P
    between two devices, no native atomics); raised identically on every rank, so callers can
    fall back to gather-then-insert together."""


# --------------------------------------------------------------------------------------------
# validation of the gathered requests
# --------------------------------------------------------------------------------------------

_MUST_MATCH = (
    "protocol",
    "backend",
    "capacity_bytes",
    "chunk_bytes",
    "granularity",
    "handle_type",
    "chunks",
    "signal_bytes",
)


def _validate_requests(reqs: list[dict[str, Any]]) -> str:
    """'' if the requests agree, else one message naming every differing field and the ranks."""
    problems = []
    for field in _MUST_MATCH:
        values = [r[field] for r in reqs]
        if any(v != values[0] for v in values):
            groups: dict[str, list[int]] = {}
            for rank, v in enumerate(values):
                groups.setdefault(repr(v), []).append(rank)
            problems.append(
                f"{field} differs: " + ", ".join(f"ranks {rk} have {v}" for v, rk in groups.items())
            )
    return "; ".join(problems)


def _host_problem(reqs: list[dict[str, Any]]) -> str:
    """'' when all ranks share a host (POSIX fds reach every peer), else the layout."""
    if len({r["host"] for r in reqs}) == 1:
        return ""
    by_host: dict[str, list[int]] = {}
    for rank, r in enumerate(reqs):
        by_host.setdefault(r["host"], []).append(rank)
    return (
        "ranks span several hosts and POSIX fds only reach one host ("
        + ", ".join(f"{h}: ranks {rk}" for h, rk in by_host.items())
        + "); cross-host mapping needs fabric handles, which this version does not exchange"
    )


def _local_ordinals_by_uuid() -> dict[str, int]:
    out = {}
    for i in range(drv.device_count()):
        dev = drv.call(drv.cu.cuDeviceGet, i, device=i)
        out[bytes(drv.call(drv.cu.cuDeviceGetUuid, dev, device=i).bytes).hex()] = i
    return out


def _p2p_problems(rank: int, reqs: list[dict[str, Any]]) -> list[str]:
    """This rank's view of P2P between its device and every distinct peer device."""
    mine = reqs[rank]
    if mine["backend"] != "cuda":
        return []
    local = _local_ordinals_by_uuid()
    problems = []
    attr = drv.cu.CUdevice_P2PAttribute
    for peer, req in enumerate(reqs):
        if peer == rank or req["uuid"] == mine["uuid"]:
            continue  # several ranks may share one device
        src = local.get(mine["uuid"])
        dst = local.get(req["uuid"])
        if src is None or dst is None:
            log.info(
                "rank %d: device of rank %d is not visible here (CUDA_VISIBLE_DEVICES); "
                "P2P is checked by mapping it",
                rank,
                peer,
            )
            continue
        d_src = drv.call(drv.cu.cuDeviceGet, src, device=src)
        d_dst = drv.call(drv.cu.cuDeviceGet, dst, device=dst)
        ok = drv.call(drv.cu.cuDeviceCanAccessPeer, d_src, d_dst, rank=rank, peer=peer)
        atomics = drv.call(
            drv.cu.cuDeviceGetP2PAttribute,
            attr.CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
            d_src,
            d_dst,
            rank=rank,
            peer=peer,
        )
        if not ok:
            problems.append(f"rank {rank} (cuda:{src}) cannot access rank {peer} (cuda:{dst})")
        elif not atomics:
            problems.append(
                f"rank {rank} (cuda:{src}) -> rank {peer} (cuda:{dst}): no native atomics"
            )
    return problems


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
        nonce: str,
    ) -> None:
        self._comm = comm
        self._region = region
        self._signal = signal
        self._peers = peers
        self._signal_peers = signal_peers
        self._pids = pids
        self._nonce = nonce
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
        only the committed prefix may be touched)."""
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
        self._check_rank("mapped_bytes", rank)
        if rank == self.rank:
            return self._region.committed_bytes
        return self._peers[rank].mapped_bytes

    # -- used by SymmetricRegion -------------------------------------------------------------
    def _map_new(self, chunks: list[Chunk]) -> None:
        """Between two collective points: pass the own new ``chunks`` to every peer and map
        theirs (see ``_exchange_and_map``)."""
        _exchange_and_map(
            self._comm, self._region, chunks, self._peers, self._pids, self._nonce,
            signal=None, signal_peers=None,
        )  # fmt: skip

    def _unmap_from(self, offset: int) -> None:
        run_all([(lambda p=p: p.unmap_from(offset)) for p in self._peers.values()])

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

    def __enter__(self) -> PeerMap:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _exchange_and_map(
    comm: StoreComm,
    region: VirtualRegion,
    chunks: list[Chunk],
    peers: dict[int, PeerRegion],
    pids: list[int],
    nonce: str,
    *,
    signal: VirtualRegion | None,
    signal_peers: dict[int, PeerRegion] | None,
) -> None:
    """Send our ``chunks`` (and the signal chunk) to every peer and map theirs.

    Local work only between two collective points of the caller; on error, whatever this call
    mapped stays recorded in the PeerRegions (the caller rolls back with ``unmap_from``)."""
    others = [r for r in range(comm.world_size) if r != comm.rank]
    if not others:
        return
    _ensure_fd_headroom((len(chunks) + 1) * (len(others) + 1))
    fds: list[int] = []
    try:
        desc: dict[str, Any] = {"chunks": [[c.offset, c.size] for c in chunks]}
        for c in chunks:
            fds.append(region.export_chunk(c))
        if signal is not None:
            sig = signal.chunks()[0]
            desc["signal"] = [sig.offset, sig.size]
            fds.append(signal.export_chunk(sig))
        payload = json.dumps(desc).encode()
        received = fdpass.exchange_fds(
            rank=comm.rank,
            nonce=f"{nonce}-{comm.step}",
            outgoing={p: (payload, fds) for p in others},
            expect_from=others,
            pids=pids,
            timeout=comm.timeout,
        )
    finally:
        for fd in fds:
            os.close(fd)
    try:
        for peer in others:
            body, peer_fds = received[peer]
            pdesc = json.loads(body.decode())
            want = len(pdesc["chunks"]) + (1 if "signal" in pdesc else 0)
            if len(peer_fds) != want:
                raise RendezvousError(
                    f"rank {comm.rank}: rank {peer} sent {len(peer_fds)} fds, expected {want}"
                )
            for (off, size), fd in zip(pdesc["chunks"], peer_fds, strict=False):
                peers[peer].map_fd(fd, Chunk(off, size))
            if signal_peers is not None:
                off, size = pdesc["signal"]
                signal_peers[peer].map_fd(peer_fds[-1], Chunk(off, size))
    except drv.CudaError as exc:
        raise RendezvousError(f"rank {comm.rank}: mapping a peer chunk failed: {exc}") from exc
    finally:
        for _, peer_fds in received.values():
            for fd in peer_fds:
                os.close(fd)


def select_handle_type(device: Any, group: Any = None, *, timeout: float = 60.0) -> tuple[str, str]:
    """Collective: which shareable handle type the group should use, and why.

    Fabric handles are chosen only when the group spans several hosts AND every rank's probe
    (device attribute, NVML fabric state, trial ``cuMemCreate``) passes; otherwise POSIX fds,
    with the reason logged. Same-host groups always use POSIX fds (they reach every peer and
    need no IMEX channel). Note: this version maps peers over fabric handles nowhere yet, so a
    multi-host group then falls back to gather-then-insert (see ``DirectUnsupported``).
    """
    import torch as _torch

    from ..alloc.cuda import fabric_probe

    comm = StoreComm(group, timeout, tag="probe")
    dev = _torch.device(device) if not isinstance(device, int) else _torch.device("cuda", device)
    if dev.type == "cuda" and drv.cuda_usable():
        ok, why = fabric_probe(dev.index if dev.index is not None else 0)
    else:
        ok, why = False, f"{dev} is not a CUDA device"
    probes = comm.all_gather((socket.gethostname(), ok, why), "fabric probe")
    hosts = {h for h, _, _ in probes}
    failing = [f"rank {r}: {w}" for r, (_, o, w) in enumerate(probes) if not o]
    if len(hosts) > 1 and not failing:
        choice, reason = "fabric", ""
    elif len(hosts) == 1:
        choice, reason = (
            "posix_fd",
            "all ranks share one host"
            + (f" (fabric unavailable anyway: {'; '.join(failing)})" if failing else ""),
        )
    else:
        choice, reason = "posix_fd", "fabric unavailable: " + "; ".join(failing)
    log.info("vmmkv: handle type %s (%s)", choice, reason or "every rank can use fabric handles")
    return choice, reason


def _ensure_fd_headroom(needed: int) -> None:
    """Raise the RLIMIT_NOFILE soft limit (up to the hard one) so that ``needed`` more fds fit:
    a receiver holds every fd of an exchange until it has mapped them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = len(os.listdir("/proc/self/fd")) + needed + 64
    if soft != resource.RLIM_INFINITY and want > soft:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        log.info("vmmkv: raised RLIMIT_NOFILE soft limit %d -> %d for an fd exchange", soft, new)


def rendezvous(region: VirtualRegion, group: Any = None, *, timeout: float = 60.0) -> PeerMap:
    """Collective: map every group member's region into this process. See module docstring."""
    if not isinstance(region, VirtualRegion):
        raise TypeError(f"rendezvous: region must be a VirtualRegion, got {type(region)}")
    if region.closed:
        raise ValueError("rendezvous: region is closed")
    comm = StoreComm(group, timeout)
    return _rendezvous(comm, region)


def _rendezvous(comm: StoreComm, region: VirtualRegion, map_peers: bool = True) -> PeerMap | None:
    rank, world = comm.rank, comm.world_size
    req = {
        "protocol": PROTOCOL_VERSION,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "backend": region.backend,
        "device": str(region.device),
        "uuid": region.device_uuid(),
        "capacity_bytes": region.capacity_bytes,
        "chunk_bytes": region.chunk_bytes,
        "granularity": region.granularity,
        "handle_type": region.handle_type,
        "chunks": [[c.offset, c.size] for c in region.chunks()],
        "signal_bytes": region.granularity,
        "nonce": secrets.token_hex(8),
    }
    reqs = comm.all_gather(req, "rendezvous request")
    problem = _validate_requests(reqs)
    if problem:
        raise RendezvousError(f"rendezvous rejected (rank {rank} of {world}): {problem}")
    if not map_peers:
        return None
    problem = _host_problem(reqs)
    if problem:
        raise DirectUnsupported(f"peer mapping impossible: {problem}")
    problems: list[str] = []
    try:
        problems = _p2p_problems(rank, reqs)
    except drv.CudaError as exc:
        problems = [f"rank {rank}: P2P query failed: {exc}"]
    all_problems = [p for ps in comm.all_gather(problems, "P2P check") for p in ps]
    if all_problems:
        raise DirectUnsupported(
            "peer mapping impossible: P2P not usable: " + "; ".join(all_problems)
        )

    pids = [r["pid"] for r in reqs]
    nonce = reqs[0]["nonce"]
    created: list[Any] = []  # rolled back (closed) on failure, in reverse order
    error: BaseException | None = None
    peers: dict[int, PeerRegion] = {}
    signal_peers: dict[int, PeerRegion] = {}
    signal = None
    try:
        signal = VirtualRegion(
            region.granularity,
            region.device,
            backend=region.backend,
            handle_type=region.handle_type,
        )
        created.append(signal)
        signal.commit(signal.capacity_bytes)  # zeroed before anyone sees it
        for r in range(world):
            if r != rank:
                peers[r] = region.open_peer()
                created.append(peers[r])
                signal_peers[r] = signal.open_peer()
                created.append(signal_peers[r])
        _exchange_and_map(
            comm,
            region,
            region.chunks(),
            peers,
            pids,
            nonce,
            signal=signal,
            signal_peers=signal_peers,
        )
        pm = PeerMap(comm, region, signal, peers, signal_peers, pids, nonce)
    except RendezvousError as exc:  # a local failure (e.g. mapping): the others must learn it
        error = exc
    except (GroupError, fdpass.FdExchangeError) as exc:  # a peer is gone: no agreement possible
        _rollback(created)
        raise RendezvousError(f"rendezvous failed: {exc}") from exc
    except BaseException as exc:
        error = exc
    try:
        comm.agree(error, "rendezvous")
    except GroupError as exc:
        _rollback(created)
        raise RendezvousError(str(exc)) from error
    return pm


def _rollback(created: list[Any]) -> None:
    for obj in reversed(created):
        try:
            obj.close()
        except Exception as exc:
            log.error("vmmkv rollback: close of %r failed: %s", obj, exc)


# --------------------------------------------------------------------------------------------
# SymmetricRegion: the region + its peer map, resized collectively
# --------------------------------------------------------------------------------------------


class SymmetricRegion:
    """Every rank owns a ``VirtualRegion`` of the same capacity, mapped by every other rank.

    Collective: the constructor, ``resize``. Local: ``close``, views, properties.
    ``committed_table`` is a device int64 ``[1]`` tensor holding the committed size that every
    rank's region has; kernels read it as their bound, so growth after CUDA-graph capture needs
    no new kernel arguments.
    """

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
        map_peers: bool = True,
    ) -> None:
        self._comm = StoreComm(group, timeout)
        self.region = VirtualRegion(
            capacity_bytes, device, chunk_bytes=chunk_bytes, backend=backend
        )
        self._closed = False
        self._broken = ""  # set when a failed shrink left the mappings inconsistent
        self._lock = threading.Lock()
        try:
            error = None
            try:
                self.region.commit(initial_bytes)
            except BaseException as exc:
                error = exc
            self._comm.agree(error, "initial commit")
            self.peers = _rendezvous(self._comm, self.region, map_peers)
            self.local_table = torch.tensor(
                [self.region.base_ptr], dtype=torch.int64, device=self.region.device
            )
            self.committed_table = torch.full(
                (1,), self.region.committed_bytes, dtype=torch.int64, device=self.region.device
            )
        except BaseException:
            peers = getattr(self, "peers", None)
            run_all(([peers.close] if peers is not None else []) + [self.region.close])
            raise

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
    def device(self) -> torch.device:
        return self.region.device

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
        if self.peers is None:
            raise RuntimeError(f"rank {self.rank}: peers are not mapped (map_peers=False)")
        return self.peers.ptr_table

    def view(self, rank: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        if rank == self.rank:
            return self.region.tensor(dtype)
        if self.peers is None:
            raise RuntimeError(f"rank {self.rank}: peers are not mapped (map_peers=False)")
        return self.peers.view(rank, dtype)

    # -- collective resize -----------------------------------------------------------------
    def resize(self, committed_bytes: int, *, direction: str | None = None) -> int:
        """Collective: grow or shrink every rank's committed prefix to ``committed_bytes``
        (rounded up to chunks). Returns the new committed size.

        Every rank's request (and whatever is wrong with it: type, range, a stream capture in
        progress, a ``direction`` of ``"grow"``/``"shrink"`` that the size contradicts) is
        gathered first, so a bad request raises on every rank: the offending rank raises
        TypeError/ValueError/RuntimeError, the others RendezvousError naming it. A failed grow
        leaves every rank at the old size and the group usable."""
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: SymmetricRegion is closed")
        problem, kind = self._resize_problem(committed_bytes, direction)
        with self._lock:
            request = (None if problem else committed_bytes, problem)
            reqs = self._comm.all_gather(request, "resize request")
            problems = {r: p for r, (_, p) in enumerate(reqs) if p}
            if problems:
                msg = "resize rejected: " + "; ".join(f"rank {r}: {p}" for r, p in problems.items())
                raise (kind if problem else RendezvousError)(msg)
            sizes = [size for size, _ in reqs]
            if any(size != sizes[0] for size in sizes):
                raise RendezvousError(
                    "resize: the target size must be identical on all ranks, got "
                    + ", ".join(f"rank {r}: {size}" for r, size in enumerate(sizes))
                )
            target = self.region.round_up(committed_bytes)
            current = self.region.committed_bytes
            if target > current:
                self._grow(current, committed_bytes)
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

    def _grow(self, current: int, nbytes: int) -> None:
        added: list[Chunk] = []
        error = None
        try:
            added = self.region.commit(nbytes)
        except BaseException as exc:
            error = exc
        try:
            self._comm.agree(error, f"grow to {nbytes} bytes (local commit)")
        except GroupError:
            self._release_local(current)
            raise
        if self.peers is None:
            self._set_committed(self.region.committed_bytes)
            return
        error = None
        try:
            self.peers._map_new(added)
        except RendezvousError as exc:  # a local failure (e.g. mapping): tell the others
            error = exc
        except (GroupError, fdpass.FdExchangeError) as exc:  # a peer vanished: no agreement
            self._release_local(current)
            raise RendezvousError(
                f"rank {self.rank}: grow to {nbytes} bytes failed exchanging chunks: {exc}"
            ) from exc
        except BaseException as exc:
            error = exc
        try:
            self._comm.agree(error, f"grow to {nbytes} bytes (peer mapping)")
        except GroupError:
            self._release_local(current)
            raise
        self._set_committed(self.region.committed_bytes)

    def _release_local(self, current: int) -> None:
        """Roll a failed grow back to ``current``: peers' new chunks first, then our own. Errors
        are logged, not raised: the grow's own error is the one the caller raises."""
        steps = [lambda: self.region.decommit(current)]
        if self.peers is not None:
            steps.insert(0, lambda: self.peers._unmap_from(current))
        try:
            run_all(steps)
        except Exception as exc:
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
                    self.peers._unmap_from(target)
            except BaseException as exc:
                error = exc
            self._comm.agree(error, "shrink: peers unmapped")
            self.region.decommit(target)
        except BaseException as exc:
            self._broken = f"a failed shrink to {target} bytes ({exc})"
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
