"""``rendezvous()``: map every peer's region into this process (a :class:`PeerMap`).

Protocol (collective over a CPU-capable group; every step bounded by ``timeout`` and settled with
one outcome on every rank, see ``vmmkv.ipc.comm``):

1. gather a request (host, boot id, NVLink domain, PID/network namespaces, uid, pid, device
   index + UUID, capacity, chunk size, granularity, backend, handle type, committed chunks,
   protocol version, the caller's ``must_match`` settings, a random nonce) and validate it
   identically on every rank: a mismatch raises the same :class:`ConfigMismatch` everywhere,
   naming field and ranks;
2. decide whether peer mapping is possible at all: one NVLink domain (``local_location``;
   several domains never map each other, see docs/design.md "Handles by value and NVLink
   domains"); for fd handles one host (same boot id), one PID and one network namespace, one
   uid (the fd transport checks credentials); P2P access and native atomics for every pair of
   distinct devices (ranks that share a device need neither); if not,
   :class:`DirectUnsupported` on every rank, listing every reason;
3. export every committed chunk plus the barrier's signal chunk and send them over the
   exchange's transport: fds (``posix_fd``) with SCM_RIGHTS (``vmmkv.ipc.fdpass``) over
   abstract sockets named with rank 0's nonce, or values (``BY_VALUE_HANDLES``: ``fabric``,
   ``shm_name``) in one step of the group's store; a rank whose local preparation failed still
   takes part and sends an abort notice instead of handles, so its peers learn the cause at
   once;
4. import and map each peer chunk at its offset inside a ``PeerRegion`` (a reservation of the
   peer's full capacity, so growth never moves anything), then close the fd; the committed
   chunks are any chunk set (a prefix, or the chunks of a block layout's segments), and a peer
   maps exactly the chunks its owner committed;
5. build ``ptr_table`` (device int64 ``[world]``, own base in own slot), which never changes;
6. agree on success (the last step): any failure anywhere, or a peer that vanished during the
   exchange, makes every rank roll back what this call created and raise; then every rank
   removes what the exchange's by-value exports left (``release_values``), whatever happened.

Resize helpers (ipc-internal, used by ``vmmkv.ipc.symmetric`` between its collective points):
``PeerMap.exchange_new(chunks, ...)`` passes and maps a grow's new chunks (any chunk set);
``unmap_peers_from(offset)`` (prefix) and ``unmap_peers_outside(ranges)`` (chunk set: keep the
chunks overlapping ``ranges``) drop peers' chunks, trying every peer and raising the first error.

Ownership: ``PeerMap`` owns the peer mappings and the signal region, never the caller's region.
``PeerMap.close()`` is local and idempotent and unmaps peers' memory before releasing anything
of its own. ``SymmetricRegion`` (``vmmkv.ipc.symmetric``) owns a region and its ``PeerMap``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .._util import run_all
from ..alloc import Chunk, PeerRegion, VirtualRegion
from ..alloc import driver as drv
from ..alloc.fabric import boot_id
from . import fdpass
from .comm import GroupError, PeerTimeoutError, StoreComm

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

PROTOCOL_VERSION = 3

# Handle types whose chunks travel as values through the group's store (no socket, no fd).
BY_VALUE_HANDLES = ("fabric", "shm_name")

# TEST-ONLY overrides of where a rank runs (read in ``local_location`` only): its host name
# (the boot id is derived from it) and its NVLink domain. They let processes of one machine act
# as several hosts of one domain, or as several domains, to run the by-value protocol in CI.
TEST_HOST_ENV = "VMMKV_TEST_HOST"
TEST_DOMAIN_ENV = "VMMKV_TEST_NVLINK_DOMAIN"


class RendezvousError(GroupError):
    """The rendezvous or a resize failed; raised on every rank of the group."""


class RendezvousTimeout(RendezvousError, PeerTimeoutError):
    """Some ranks did not arrive at a step of the rendezvous or a resize (``missing`` names
    them); raised on every rank that got there, late ones included."""

    def __init__(self, message: str, missing: list[int]):
        PeerTimeoutError.__init__(self, message, missing)


class ExchangeLost(RendezvousError):
    """The by-value exchange timed out: ``peers_lost`` did not arrive (like
    ``fdpass.FdExchangeError`` for the fd transport)."""

    def __init__(self, message: str, peers_lost: list[int]):
        super().__init__(message)
        self.peers_lost = list(peers_lost)


class PeerAborted(RendezvousError):
    """Peers announced in the fd exchange that they cannot take part; they report their own
    cause in the agreement that follows, so receivers of the notice add no error of theirs."""


class ConfigMismatch(RendezvousError):
    """The ranks' requests disagree (capacity, chunk size, mode, ...): the caller's
    configuration differs between ranks; raised identically on every rank."""


class DirectUnsupported(RendezvousError):
    """Peer mapping is impossible for this group (several NVLink domains, several hosts with fd
    handles, no P2P between two devices, no native atomics); raised identically on every rank,
    so callers can fall back to gather-then-insert together."""


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


def _by_value(values: list[Any], verb: str) -> str:
    groups: dict[str, list[int]] = {}
    for rank, v in enumerate(values):
        groups.setdefault(repr(v), []).append(rank)
    return ", ".join(f"ranks {rk} {verb} {v}" for v, rk in groups.items())


# What fds need to travel, in the order checked: (request field, verb, what it is, why).
# PID namespaces are compared only on one host (several hosts already rule fds out).
_SAME_FOR_FDS = (
    ("host", "on", "on several hosts", "POSIX fds only reach one host; cross-host mapping needs "
     "by-value (fabric) handles inside one NVLink domain, and this region's handles are fds"),
    ("pidns", "in", "in different PID namespaces", "the fd transport identifies senders by pid"),
    ("netns", "in", "in different network namespaces", "abstract Unix sockets do not cross them"),
    ("uid", "have uid", "as different users", "the fd transport only accepts its own uid"),
)  # fmt: skip


def _host_problem(reqs: list[dict[str, Any]]) -> str:
    """'' when POSIX fds can travel between every pair of ranks (one host, one PID and one
    network namespace, one uid), else every reason, with the ranks on each side."""
    problems = []
    for field, verb, what, why in _SAME_FOR_FDS:
        if field == "host":
            values = [f"{r['host']} (boot {r['boot_id'][:8]})" for r in reqs]
        elif field == "pidns" and problems:
            continue
        else:
            values = [r[field] for r in reqs]
        if len(set(values)) > 1:
            problems.append(f"ranks run {what} ({_by_value(values, verb)}): {why}")
    return "; ".join(problems)


def _placement_problem(reqs: list[dict[str, Any]], by_value: bool) -> str:
    """'' when the ranks can map each other with this handle kind, else why not. Ranks of
    several NVLink domains never map each other directly (docs/design.md, "Handles by value
    and NVLink domains"); inside one domain by-value handles reach every rank, fds only one
    host (``_host_problem``), whatever the domains of its GPUs say."""
    if not by_value and len({r["boot_id"] for r in reqs}) == 1:
        return _host_problem(reqs)
    domains: dict[str, list[int]] = {}
    for rank, r in enumerate(reqs):
        domains.setdefault(r["domain"], []).append(rank)
    if len(domains) > 1 and any(d.startswith("nvlink:") for d in domains):
        return (
            f"ranks span {len(domains)} NVLink domains ("
            + "; ".join(f"{d}: ranks {rk}" for d, rk in domains.items())
            + "): ranks map each other only inside one domain; a group across domains is not "
            "published directly (gather-then-insert between them)"
        )
    if by_value:
        if len(domains) > 1:
            return "by-value handles need one NVLink domain, got " + "; ".join(
                f"{d}: ranks {rk}" for d, rk in domains.items()
            )
        return ""
    return _host_problem(reqs)


_domains: dict[int, str] = {}  # CUDA ordinal -> domain key, read once per process
_domains_lock = threading.Lock()


def _fabric_domain(ordinal: int) -> str:
    """The NVLink domain key of CUDA device ``ordinal`` (``vmmkv.alloc.fabric.domain_key``:
    ``nvlink:<cluster uuid>:<clique id>`` when the GPU's fabric state is completed, else
    ``host:<boot id>``); the host key when the query itself fails. Read once per process and
    device (an NVML session each time would cost every collective construction; a GPU's fabric
    registration completes before jobs start)."""
    with _domains_lock:
        if ordinal in _domains:
            return _domains[ordinal]
        try:
            from ..alloc.fabric import domain_key

            key = domain_key(ordinal)
        except Exception as exc:  # never fatal: the host is a domain of its own
            log.info("vmmkv: NVLink domain of cuda:%d unknown (%s); using the host", ordinal, exc)
            key = f"host:{boot_id()}"
        _domains[ordinal] = key
        return key


_warned_test_location: list[bool] = []  # the override is logged once per process


def local_location(ordinal: int | None) -> dict[str, str]:
    """Local: where this process runs, ``{"host", "boot_id", "domain"}``. ``domain`` is the
    NVLink domain key (CUDA device ``ordinal``; ``None``: host memory, the host's key).
    Test-only: ``VMMKV_TEST_HOST`` replaces host and boot id, ``VMMKV_TEST_NVLINK_DOMAIN``
    the domain (``nvlink:test:<value>``); read here and nowhere else."""
    sim_host = os.environ.get(TEST_HOST_ENV, "")
    sim_domain = os.environ.get(TEST_DOMAIN_ENV, "")
    if (sim_host or sim_domain) and not _warned_test_location:
        _warned_test_location.append(True)
        log.warning(
            "vmmkv: test-only location override in effect (%s=%r, %s=%r): not for production",
            TEST_HOST_ENV, sim_host, TEST_DOMAIN_ENV, sim_domain,
        )  # fmt: skip
    if sim_host:
        host = sim_host
        boot = "test-" + hashlib.sha256(sim_host.encode()).hexdigest()[:24]
    else:
        host, boot = socket.gethostname(), boot_id()
    if sim_domain:
        domain = f"nvlink:test:{sim_domain}"
    elif sim_host or ordinal is None:
        domain = f"host:{boot}"
    else:
        domain = _fabric_domain(ordinal)
    return {"host": host, "boot_id": boot, "domain": domain}


def choose_handle_type(
    comm: StoreComm, backend: str, ordinal: int | None, requested: str = "auto"
) -> str:
    """Collective: the handle type a group's regions should be created with. Every rank runs
    the first step whatever it ``requested``: ranks that asked for different handle types get
    the same :class:`ConfigMismatch` naming each rank's request (instead of steps out of
    order); when all asked for the same explicit type, that is the answer. When all asked
    ``"auto"``: several hosts
    inside one NVLink domain, every rank on the same backend: by value (``"shm_name"``, the
    simulation, on the host backend; ``"fabric"`` on CUDA when every rank's
    ``cuda.fabric_probe`` passes, a second step, since a domain key says nothing about the IMEX
    channel); otherwise ``"posix_fd"`` (one host; several domains, which fall back to gather
    anyway; several hosts whose devices cannot create fabric memory, which then fall back to
    gather too, the probes' reasons logged). ``backend``: ``"cuda"`` or ``"host"`` (anything
    else: fds). Every rank decides from gathered values only, so all take the same steps."""
    mine: list[Any] = [requested, None, None, None]
    if requested == "auto":  # an explicit request needs no location (no NVML read)
        loc = local_location(ordinal)
        mine = [requested, backend, loc["boot_id"], loc["domain"]]
    try:
        gathered = comm.all_gather(mine, "handle type")
    except GroupError as exc:
        raise as_rendezvous_error(exc) from None
    if len({q for q, *_ in gathered}) > 1:
        raise ConfigMismatch(
            f"rendezvous rejected (rank {comm.rank} of {comm.world_size}): handle_type differs "
            "between ranks: " + ", ".join(f"rank {r}: {q!r}" for r, (q, *_) in enumerate(gathered))
        )
    if requested != "auto":
        return requested
    locs = [tuple(g[1:]) for g in gathered]
    backends = {b for b, _, _ in locs}
    boots = {b for _, b, _ in locs}
    domains = {d for _, _, d in locs}
    if len(boots) == 1 or len(domains) > 1 or len(backends) > 1:
        return "posix_fd"
    if backends == {"host"}:
        return "shm_name"
    if backends != {"cuda"}:
        return "posix_fd"
    try:
        from ..alloc.cuda import fabric_probe

        ok, why = fabric_probe(ordinal) if ordinal is not None else (False, "no CUDA ordinal")
    except Exception as exc:  # a probe that cannot run says no, with why
        ok, why = False, f"fabric probe failed: {type(exc).__name__}: {exc}"
    try:
        probes = comm.all_gather([bool(ok), str(why)], "fabric probe")
    except GroupError as exc:
        raise as_rendezvous_error(exc) from None
    failing = [f"rank {r}: {w}" for r, (o, w) in enumerate(probes) if not o]
    if not failing:
        return "fabric"
    log.warning(
        "rank %d: several hosts of one NVLink domain, but fabric handles are unavailable (%s): "
        "posix_fd, so the group cannot map across hosts",
        comm.rank, "; ".join(failing),
    )  # fmt: skip
    return "posix_fd"


def _namespace_id(kind: str) -> str:
    try:
        return str(os.stat(f"/proc/self/ns/{kind}").st_ino)
    except OSError:
        return "unknown"


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
        *,
        by_value: bool = False,
    ) -> None:
        self._comm = comm
        self._by_value = by_value
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
        """Bytes of rank ``rank``'s region mapped here (own: committed), as a sum of chunks."""
        self._check_rank("mapped_bytes", rank)
        if rank == self.rank:
            return self._region.committed_bytes
        return self._peers[rank].mapped_bytes

    def mapped_chunks(self, rank: int) -> list[Chunk]:
        """The chunks of rank ``rank``'s region mapped here (own: committed), address order."""
        self._check_rank("mapped_chunks", rank)
        if rank == self.rank:
            return self._region.chunks()
        return self._peers[rank].chunks()

    # -- ipc-internal: used by vmmkv.ipc.symmetric ----------------------------------------
    def exchange_new(self, chunks: list[Chunk], nonce: str, local_error: Exception | None) -> None:
        """Between two collective points: pass the own new ``chunks`` (any chunk set, e.g. the
        chunks a block grow added to every segment) to every peer and map theirs, or, with
        ``local_error``, tell every peer this rank cannot take part (see
        ``_exchange_and_map``). ``nonce``: fresh per exchange, the same on every rank; the
        caller runs ``finish_exchange(nonce)`` after the agreement that follows, whatever
        happened. A closed PeerMap still takes part, as a rank that cannot (its error goes in
        ``local_error``), so the peers' steps stay in order."""
        if self._closed and local_error is None:
            local_error = RuntimeError(f"rank {self.rank}: PeerMap is closed")
        _exchange_and_map(
            self._comm, chunks, self._peers, self._transport(nonce),
            signal=None, signal_peers=None, local_error=local_error,
        )  # fmt: skip

    def finish_exchange(self, nonce: str) -> None:
        """Local, after an exchange's agreement (success or failure): drop what it left behind
        (by value: every exported name; fds: nothing)."""
        self._transport(nonce).finish()

    @property
    def by_value(self) -> bool:
        """True when chunks travel as values through the store (``BY_VALUE_HANDLES``)."""
        return self._by_value

    def _transport(self, nonce: str) -> _Transport:
        kind = _ValueTransport if self._by_value else _FdTransport
        return kind(self._comm, self._region, nonce, self._pids)

    def unmap_peers_from(self, offset: int) -> None:
        """Unmap every peer's chunks at or above ``offset`` (prefix: rollback of a grow,
        shrink). Every peer is tried; the first error is raised (``UnmapError``)."""
        run_all([(lambda p=p: p.unmap_from(offset)) for p in self._peers.values()])

    def unmap_peers_outside(self, ranges: list[tuple[int, int]]) -> None:
        """Unmap every peer's chunks that overlap none of ``ranges`` (chunk set: rollback of a
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

    def __enter__(self) -> PeerMap:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Transport:
    """How one exchange moves chunks between ranks; the protocol around it
    (``_exchange_and_map``: descriptions, abort notices, validation, mapping, agreement and
    rollback) is the same for both. ``export``: a committed chunk's handle to send (the
    caller ``discard``-s those it does not send); ``exchange``: send ``body`` and the handles
    to every peer, get theirs (``{peer: (body, handles)}``), raising ``FdExchangeError`` or
    :class:`ExchangeLost` (with ``peers_lost``) when peers vanished; ``map`` a received handle;
    ``release`` every received handle (mapped or not) once mapping is over; ``finish`` after
    the agreement, on every rank."""

    what = ""

    def __init__(self, comm: StoreComm, region: VirtualRegion, nonce: str, pids: list[int]) -> None:
        self.comm, self.region, self.nonce, self.pids = comm, region, nonce, pids

    def export(self, owner: VirtualRegion, chunk: Chunk) -> Any:
        raise NotImplementedError

    def discard(self, handles: list[Any]) -> None:
        pass

    def exchange(
        self, body: bytes, handles: list[Any], others: list[int], per_peer: int
    ) -> dict[int, tuple[bytes, list[Any]]]:
        """Send ``body`` and ``handles`` to every rank of ``others`` and return what each sent;
        ``per_peer``: the most handles one peer may send (its chunks and signal chunk)."""
        raise NotImplementedError

    def map(self, peer: PeerRegion, handle: Any, chunk: Chunk) -> None:
        raise NotImplementedError

    def release(self, received: dict[int, tuple[bytes, list[Any]]]) -> None:
        pass

    def finish(self) -> None:
        pass


class _FdTransport(_Transport):
    """POSIX fds over abstract Unix sockets (``vmmkv.ipc.fdpass``): one host."""

    what = "fd exchange"

    def export(self, owner: VirtualRegion, chunk: Chunk) -> int:
        return owner.export_chunk(chunk)

    def discard(self, handles: list[Any]) -> None:
        for fd in handles:
            os.close(fd)

    def exchange(
        self, body: bytes, handles: list[Any], others: list[int], per_peer: int
    ) -> dict[int, tuple[bytes, list[Any]]]:
        # The RLIMIT_NOFILE soft limit is raised for the exchange if needed, and restored by
        # ``release`` once the received fds are closed. Sized by what the peers may send, not
        # by what this rank sends: a rank that cannot take part sends nothing but must still
        # receive its peers' fds, or the truncated message would hide its own cause.
        self._restore = _raise_fd_limit((max(len(handles), per_peer) + 1) * (len(others) + 1))
        try:
            return fdpass.exchange_fds(
                rank=self.comm.rank,
                nonce=self.nonce,
                outgoing={p: (body, handles) for p in others},
                expect_from=others,
                pids=self.pids,
                timeout=self.comm.timeout,
                cancel=self.comm.pending_abort,  # a peer that gave up releases us at once
            )
        except BaseException:
            restore, self._restore = self._restore, None  # release() must not restore again
            restore()
            raise

    def map(self, peer: PeerRegion, handle: Any, chunk: Chunk) -> None:
        peer.map_fd(handle, chunk)

    def release(self, received: dict[int, tuple[bytes, list[Any]]]) -> None:
        try:
            for _, fds in received.values():
                for fd in fds:
                    os.close(fd)
        finally:
            restore, self._restore = getattr(self, "_restore", None), None
            if restore is not None:
                restore()


class _ValueTransport(_Transport):
    """By-value handles (``BY_VALUE_HANDLES``: CUDA fabric handles, the host simulation's shm
    names) through the group's store, one collective step; the exports are removed by
    ``finish`` (``release_values(nonce)``), which every rank runs after the agreement, so a
    dead exporter's names go too."""

    what = "handle exchange"

    def export(self, owner: VirtualRegion, chunk: Chunk) -> bytes:
        return owner.export_chunk_value(chunk, self.nonce)

    def exchange(
        self, body: bytes, handles: list[Any], others: list[int], per_peer: int
    ) -> dict[int, tuple[bytes, list[Any]]]:
        mine = [body.decode(), [h.hex() for h in handles]]
        try:
            got = self.comm.all_gather(mine, "by-value handle exchange")
        except PeerTimeoutError as exc:
            raise ExchangeLost(str(exc), exc.missing) from None
        except GroupError as exc:
            raise as_rendezvous_error(exc) from None
        return {p: (got[p][0].encode(), [bytes.fromhex(v) for v in got[p][1]]) for p in others}

    def map(self, peer: PeerRegion, handle: Any, chunk: Chunk) -> None:
        peer.map_value(handle, chunk)

    def finish(self) -> None:
        try:
            self.region.release_values(self.nonce)
        except Exception as exc:  # logged: the exchange's own outcome is the one raised
            log.error("rank %d: removing by-value exports failed: %s", self.comm.rank, exc)


def _exchange_and_map(
    comm: StoreComm,
    chunks: list[Chunk],
    peers: dict[int, PeerRegion],
    transport: _Transport,
    *,
    signal: VirtualRegion | None,
    signal_peers: dict[int, PeerRegion] | None,
    local_error: Exception | None = None,
) -> None:
    """Send our ``chunks`` (and the signal chunk) to every peer and map theirs, over
    ``transport`` (fds over sockets or values over the store: the same protocol).

    Local work only, between two collective points of the caller; the caller always goes on to
    the agreement that follows (and then ``transport.finish()``). A rank that cannot take part
    (``local_error``, or an export that fails here) still runs the exchange with an abort
    notice and no handles, so its peers fail fast with its cause; it then raises
    :class:`RendezvousError`, and so does every peer that received a notice. Transport failures
    (a peer vanished) raise ``FdExchangeError`` / :class:`ExchangeLost`. On error, whatever
    this call mapped stays recorded in the PeerRegions (the caller rolls back with
    ``unmap_from`` or ``unmap_outside``)."""
    others = [r for r in range(comm.world_size) if r != comm.rank]
    if not others:
        if local_error is not None:
            raise RendezvousError(f"rank {comm.rank}: {local_error}") from local_error
        return
    region = transport.region
    what = transport.what
    received: dict[int, tuple[bytes, list[Any]]] = {}
    try:
        handles: list[Any] = []
        try:
            desc: dict[str, Any] = {}
            if local_error is None:
                try:
                    desc["chunks"] = [[c.offset, c.size] for c in chunks]
                    for c in chunks:
                        handles.append(transport.export(region, c))
                    if signal is not None:
                        sig = signal.chunks()[0]
                        desc["signal"] = [sig.offset, sig.size]
                        handles.append(transport.export(signal, sig))
                except Exception as exc:
                    local_error = exc
            if local_error is not None:
                transport.discard(handles)
                handles = []
                desc = {"abort": repr(local_error)}
            per_peer = len(chunks) + (1 if signal is not None else 0)
            received = transport.exchange(json.dumps(desc).encode(), handles, others, per_peer)
        finally:
            transport.discard(handles)
        if local_error is not None:
            raise RendezvousError(
                f"rank {comm.rank}: could not take part in the {what}: {local_error!r}"
            ) from local_error
        descs = {peer: json.loads(body.decode()) for peer, (body, _) in received.items()}
        aborted = {peer: d["abort"] for peer, d in descs.items() if "abort" in d}
        if aborted:
            raise PeerAborted(
                f"rank {comm.rank}: peers could not take part in the {what}: "
                + "; ".join(f"rank {p}: {why}" for p, why in sorted(aborted.items()))
            )
        for peer in others:
            pdesc, peer_handles = descs[peer], received[peer][1]
            want = len(pdesc["chunks"]) + (1 if "signal" in pdesc else 0)
            if len(peer_handles) != want:
                raise RendezvousError(
                    f"rank {comm.rank}: rank {peer} sent {len(peer_handles)} handles, "
                    f"expected {want}"
                )
            todo = [(peers[peer], h, Chunk(off, size)) for (off, size), h in zip(
                pdesc["chunks"], peer_handles, strict=False
            )]  # fmt: skip
            if signal_peers is not None:
                off, size = pdesc["signal"]
                todo.append((signal_peers[peer], peer_handles[-1], Chunk(off, size)))
            for target, handle, chunk in todo:
                try:
                    transport.map(target, handle, chunk)
                except (drv.CudaError, OSError, ValueError) as exc:
                    raise RendezvousError(
                        f"rank {comm.rank} ({region.device}): mapping a chunk of rank {peer} "
                        f"({chunk}, {region.handle_type}) failed: {exc}"
                    ) from exc
    finally:
        transport.release(received)


def exchange_then_agree(
    comm: StoreComm,
    what: str,
    exchange: Callable[[Exception | None], None],
    local_error: Exception | None,
    deadline: float,
    finish: Callable[[], None] | None = None,
) -> None:
    """Run ``exchange(local_error)`` then the step's agreement, then ``finish()`` (e.g.
    removing by-value exports), on every rank whatever happened: local failures become the
    agreed error (every rank raises naming the cause); a transport failure (a peer vanished)
    settles the agreement at once as a timeout naming the lost ranks, so no rank waits a second
    timeout (and ``peers="auto"`` does not fall back over a dead peer). The agreement waits at
    most until ``deadline`` (at least one second). Raises :class:`RendezvousError`
    (:class:`RendezvousTimeout` for missing ranks)."""
    error: BaseException | None = local_error
    abort, lost = None, []
    try:
        try:
            exchange(local_error)
        except (fdpass.FdExchangeError, ExchangeLost) as exc:  # a timeout naming lost peers
            abort, lost = str(exc), exc.peers_lost
        except PeerAborted:
            pass  # the aborting ranks name their cause in the agreement, which then fails
        except Exception as exc:
            error = exc
        try:
            comm.agree(
                error, what, abort=abort, missing=lost,
                timeout=max(1.0, deadline - time.monotonic()),
            )  # fmt: skip
        except GroupError as exc:
            raise as_rendezvous_error(exc) from error
    finally:
        if finish is not None:
            finish()


def as_rendezvous_error(exc: GroupError) -> RendezvousError:
    """The rendezvous/resize flavour of a collective failure (timeouts keep ``missing``)."""
    if isinstance(exc, RendezvousError):
        return exc
    if isinstance(exc, PeerTimeoutError):
        return RendezvousTimeout(str(exc), exc.missing)
    return RendezvousError(str(exc))


def select_handle_type(device: Any, group: Any = None, *, timeout: float = 60.0) -> tuple[str, str]:
    """Collective: which shareable handle type the group should use, and why.

    Fabric handles are chosen only when the group spans several hosts AND every rank's probe
    (device attribute, NVML fabric state, trial ``cuMemCreate``) passes; otherwise POSIX fds,
    with the reason logged. Same-host groups always use POSIX fds (they reach every peer and
    need no IMEX channel). A diagnostic with the trial allocation; ``SymmetricRegion`` decides
    by NVLink domain (:func:`choose_handle_type`), and ranks of several domains fall back to
    gather-then-insert whatever this says.
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


def _raise_fd_limit(needed: int) -> Callable[[], None]:
    """Raise the RLIMIT_NOFILE soft limit (up to the hard one) so that ``needed`` more fds fit
    (a receiver holds every fd of an exchange until it has mapped them); returns the undo,
    which restores the caller's limit once those fds are closed (select() users of the
    process keep their FD_SETSIZE world)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = len(os.listdir("/proc/self/fd")) + needed + 64
    if soft == resource.RLIM_INFINITY or want <= soft:
        return lambda: None
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    log.info("vmmkv: RLIMIT_NOFILE soft limit %d -> %d for an fd exchange", soft, new)

    def restore() -> None:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        except (OSError, ValueError) as exc:
            log.warning("vmmkv: could not restore RLIMIT_NOFILE to %d: %s", soft, exc)

    return restore


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
    transport = kind(comm, region, reqs[0]["nonce"], pids)

    def exchange(error: Exception | None) -> None:
        _exchange_and_map(
            comm, region.chunks(), peers, transport,
            signal=signal, signal_peers=signal_peers, local_error=error,
        )  # fmt: skip
        # Device tables are local setup: built before the last agreement, so that a failure
        # here fails every rank (nothing local happens after the agreement).
        pm.append(PeerMap(comm, region, signal, peers, signal_peers, pids, by_value=by_value))

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
