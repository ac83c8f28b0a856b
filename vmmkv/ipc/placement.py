"""Where the ranks of a group run and whether they can map each other: step 2 of the
rendezvous (``vmmkv.ipc.peers``) and the choice of a group's handle type.

- ``local_location(ordinal)``: local; this process's host, boot id and NVLink domain key
  (``vmmkv.alloc.fabric.domain_key``, read once per process and device). The TEST-ONLY
  overrides ``VMMKV_TEST_HOST`` and ``VMMKV_TEST_NVLINK_DOMAIN`` are read there and nowhere
  else.
- ``choose_handle_type`` and ``select_handle_type``: collective over a CPU-capable group;
  every rank runs every step and decides from gathered values only (``select_handle_type`` is
  a diagnostic with a trial allocation).
- By-value handles across the hosts of one NVLink domain are opt-in: ``"auto"`` picks them only
  when every rank sets ``VMMKV_FABRIC=1`` (``FABRIC_ENV``; or asks for ``handle_type="fabric"``
  explicitly), because the CUDA fabric path has not run on multi-node NVLink hardware. Without
  it such a group takes POSIX fds, which cannot map across hosts, so it falls back to
  gather-then-insert, the reason logged at INFO and carried in the placement problem. The host
  backend's simulation (``"shm_name"``) follows the same opt-in, so that it runs the same
  decision.
- ``_placement_problem`` and ``_host_problem`` (on the gathered requests) and
  ``_p2p_problems`` (this rank's driver view of P2P access and native atomics): local; the
  rendezvous gathers their answers so that every rank raises the same
  ``DirectUnsupported``. Ranks of several NVLink domains never map each other
  (docs/design.md, "Handles by value and NVLink domains"); inside one domain by-value handles
  reach every rank, POSIX fds only one host (one PID and one network namespace, one uid).

Creates nothing that outlives a call (``cuda.fabric_probe`` releases its trial allocation).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
from typing import Any

from .. import _env
from ..alloc import driver as drv
from ..alloc.fabric import boot_id
from .comm import GroupError, StoreComm
from .errors import ConfigMismatch, as_rendezvous_error

__all__ = [
    "FABRIC_ENV",
    "TEST_DOMAIN_ENV",
    "TEST_HOST_ENV",
    "choose_handle_type",
    "local_location",
    "select_handle_type",
]

# the rendezvous and its parts log under one name, the module they were split from
log = logging.getLogger("vmmkv.ipc.peers")

# TEST-ONLY overrides of where a rank runs (read in ``local_location`` only): its host name
# (the boot id is derived from it) and its NVLink domain. They let processes of one machine act
# as several hosts of one domain, or as several domains, to run the by-value protocol in CI.
TEST_HOST_ENV = "VMMKV_TEST_HOST"
TEST_DOMAIN_ENV = "VMMKV_TEST_NVLINK_DOMAIN"
# '1' lets "auto" pick by-value handles across the hosts of one NVLink domain (module docstring)
FABRIC_ENV = _env.FABRIC
NOT_OPTED_IN = (
    "by-value (CUDA fabric) handles across hosts are opt-in, since that path has not run on "
    f"multi-node NVLink hardware: set {FABRIC_ENV}=1 on every rank, or handle_type='fabric'"
)


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
    problem = _host_problem(reqs)
    if problem and len(domains) == 1 and next(iter(domains)).startswith("nvlink:"):
        problem += f"; {NOT_OPTED_IN}"  # hosts of one domain take fds unless opted in
    return problem


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


def fabric_opt_in() -> str:
    """Local: this process's ``VMMKV_FABRIC``: ``"1"`` (opted in), ``"0"`` (unset, empty or
    '0'), or ``"invalid <value>"``."""
    try:
        return "1" if _env.fabric() else "0"
    except ValueError:
        return f"invalid {os.environ[FABRIC_ENV].strip()!r}"


def choose_handle_type(
    comm: StoreComm, backend: str, ordinal: int | None, requested: str = "auto"
) -> str:
    """Collective: the handle type a group's regions should be created with. Every rank runs
    the first step whatever it ``requested``: ranks that asked for different handle types get
    the same :class:`ConfigMismatch` naming each rank's request (instead of steps out of
    order); when all asked for the same explicit type, that is the answer. When all asked
    ``"auto"``: several hosts inside one NVLink domain, every rank on the same backend and every
    rank opted in (``VMMKV_FABRIC=1``, :func:`fabric_opt_in`): by value (``"shm_name"``, the
    simulation, on the host backend; ``"fabric"`` on CUDA when every rank's
    ``cuda.fabric_probe`` passes, a second step, since a domain key says nothing about the IMEX
    channel); otherwise ``"posix_fd"`` (one host; several domains, which fall back to gather
    anyway; several hosts without the opt-in, or whose devices cannot create fabric memory,
    which then fall back to gather too, the reason logged). ``backend``: ``"cuda"`` or
    ``"host"`` (anything else: fds). Every rank decides from gathered values only, so all take
    the same steps; a ``VMMKV_FABRIC`` other than '0' or '1' on any rank raises the same
    ValueError on every rank, naming the ranks and values."""
    mine: list[Any] = [requested, None, None, None, None]
    if requested == "auto":  # an explicit request needs no location (no NVML read)
        loc = local_location(ordinal)
        mine = [requested, backend, loc["boot_id"], loc["domain"], fabric_opt_in()]
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
    opts = [g[4] for g in gathered]
    bad = [
        f"rank {r}: {o.removeprefix('invalid ')}" for r, o in enumerate(opts) if o not in ("0", "1")
    ]
    if bad:
        raise ValueError(
            f"rank {comm.rank} of {comm.world_size}: choosing the handle type: {FABRIC_ENV} must "
            f"be '0' or '1' on every rank ({'; '.join(bad)}); '1' opts in to by-value handles "
            "across the hosts of one NVLink domain"
        )
    locs = [tuple(g[1:4]) for g in gathered]
    backends = {b for b, _, _ in locs}
    boots = {b for _, b, _ in locs}
    domains = {d for _, _, d in locs}
    if len(boots) == 1 or len(domains) > 1 or len(backends) > 1:
        return "posix_fd"
    if set(opts) != {"1"}:
        mixed = "1" in opts
        log.log(
            logging.WARNING if mixed else logging.INFO,
            "rank %d: several hosts of one NVLink domain (%s), but %s%s: posix_fd, so the group "
            "cannot map across hosts (gather-then-insert between them)",
            comm.rank, next(iter(domains)), NOT_OPTED_IN,
            f" (ranks {[r for r, o in enumerate(opts) if o != '1']} did not)" if mixed else "",
        )  # fmt: skip
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


def select_handle_type(device: Any, group: Any = None, *, timeout: float = 60.0) -> tuple[str, str]:
    """Collective: which shareable handle type the group should use, and why.

    Fabric handles are chosen only when the group spans several hosts AND every rank opted in
    (``VMMKV_FABRIC=1``) AND every rank's probe (device attribute, NVML fabric state, trial
    ``cuMemCreate``) passes; otherwise POSIX fds, with the reason logged. Same-host groups
    always use POSIX fds (they reach every peer and need no IMEX channel). A diagnostic with the trial allocation; ``SymmetricRegion`` decides
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
    probes = comm.all_gather((socket.gethostname(), ok, why, fabric_opt_in()), "fabric probe")
    hosts = {h for h, *_ in probes}
    failing = [f"rank {r}: {w}" for r, (_, o, w, _) in enumerate(probes) if not o]
    opted_in = all(opt == "1" for *_, opt in probes)
    if len(hosts) > 1 and not failing and opted_in:
        choice, reason = "fabric", ""
    elif len(hosts) > 1 and not opted_in:
        choice, reason = "posix_fd", NOT_OPTED_IN
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
