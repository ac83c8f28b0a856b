"""Handles by value, proven by simulation on the host backend.

Several processes of this machine act as several hosts of one NVLink domain, or as several
domains, through the test-only overrides ``VMMKV_TEST_HOST`` / ``VMMKV_TEST_NVLINK_DOMAIN``
(set per rank before anything of vmmkv runs), opted in to by-value handles (``VMMKV_FABRIC=1``)
unless a test checks the default without it. Chunks are then created with the ``shm_name``
handle type: a chunk travels as a name in ``/dev/shm`` through the group's store (no socket, no
fd), is opened by name and mapped like an fd-imported chunk, and every name is removed once the
exchange's agreement is over, on success and on every failure path, a killed exporter's too.

What every test checks afterwards: no ``/dev/shm`` name that the test's own processes linked is
left (``ShmLedger``: each process records the names it links, so other vmmkv processes running
on the machine at the same time cannot disturb the check), no fd or shared mapping of this
machinery left in a surviving rank.
What this cannot show: real CUDA fabric handles, IMEX, several real hosts (see README).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.helpers import (
    KVStep,
    ShmLedger,
    fds_not_sockets,
    kill_at,
    record_shm_exports,
    shm_ledger_left,
)
from vmmkv.alloc.host import shm_names
from vmmkv.ipc.peers import TEST_DOMAIN_ENV, TEST_HOST_ENV
from vmmkv.ipc.placement import FABRIC_ENV
from vmmkv.testing.markers import requires_gpu
from vmmkv.testing.spawn import run_world, run_world_raw

TIMEOUT = 3.0
LAYERS = 2
TOKENS = 32  # per rank and layer


@pytest.fixture
def ledger(tmp_path, monkeypatch) -> ShmLedger:
    """The /dev/shm names this test's processes link (see ``ShmLedger``)."""
    return ShmLedger(tmp_path / "shm-names").enable(monkeypatch)


def _gran() -> int:
    return os.sysconf("SC_PAGE_SIZE")


def _place(rank: int, hosts: list[str], domains: list[str] | None, fabric: str = "1") -> None:
    """Make this rank act as running on ``hosts[rank]`` in NVLink domain ``domains[rank]`` with
    ``VMMKV_FABRIC=fabric`` (by-value handles opted in by default), and record the by-value
    names it links in the test's ledger."""
    record_shm_exports()
    os.environ[TEST_HOST_ENV] = hosts[rank]
    if domains is not None:
        os.environ[TEST_DOMAIN_ENV] = domains[rank]
    os.environ[FABRIC_ENV] = fabric


def _shm_maps() -> int:
    """Shared mappings of /dev/shm files in this process (by-value chunks, own or imported)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "/dev/shm/" in line)


def _leaks(fds_before: int) -> tuple[int, int, int]:
    """(new non-socket fds, /dev/shm mappings, host reservations) of this process now."""
    from vmmkv.alloc.host import reservations

    return fds_not_sockets() - fds_before, _shm_maps(), len(reservations())


def _closed(out: dict, sr, fds0: int) -> dict:
    """Close ``sr`` once every rank is done with the replicas; ``out["leaks"]``: what this
    process still holds afterwards (``_leaks``)."""
    import torch.distributed as dist

    dist.barrier()
    sr.close()
    out["leaks"] = _leaks(fds0)
    return out


def _pattern(rank: int, n: int, salt: int):
    import torch

    g = torch.Generator().manual_seed(97 * rank + salt + 1)
    return torch.randint(1, 256, (n,), generator=g, dtype=torch.uint8)


def _region(**kw):
    from vmmkv.ipc import SymmetricRegion

    g = _gran()
    opts = dict(chunk_bytes=g, initial_bytes=2 * g, timeout=TIMEOUT)
    opts.update(kw)
    return SymmetricRegion(16 * g, "cpu", backend="host", **opts)


def _check_replicas(sr, world: int, ranges: list[tuple[int, int]], salt: int) -> list[str]:
    """Every rank wrote its own pattern into ``ranges`` of its region (then a barrier): every
    replica seen here equals its owner's pattern byte for byte. Returns the mismatches."""
    bad = []
    for r in range(world):
        view = sr.view(r, reserve=True)  # ranges of a prefix or of a block layout
        for lo, hi in ranges:
            if not bool((view[lo:hi] == _pattern(r, hi - lo, salt + lo)).all()):
                bad.append(f"rank {r} [{lo}, {hi})")
    return bad


def _write_own(sr, rank: int, ranges: list[tuple[int, int]], salt: int) -> None:
    for lo, hi in ranges:
        sr.view(rank, reserve=True)[lo:hi].copy_(_pattern(rank, hi - lo, salt + lo))


# --------------------------------------------------------------------------------------------
# the by-value protocol end to end
# --------------------------------------------------------------------------------------------


def _prefix_cycle(rank, world, hosts, domains):
    import torch.distributed as dist

    _place(rank, hosts, domains)
    fds0 = fds_not_sockets()
    g = _gran()
    out = {}
    sr = _region()
    out["handle_type"] = sr.region.handle_type
    out["by_value"] = sr.mapped and sr.peers.by_value
    _write_own(sr, rank, [(0, 2 * g)], 1)
    dist.barrier()
    out["rendezvous"] = _check_replicas(sr, world, [(0, 2 * g)], 1)
    out["names_after_rendezvous"] = shm_ledger_left()
    dist.barrier()
    sr.resize(7 * g)
    _write_own(sr, rank, [(2 * g, 7 * g)], 2)
    dist.barrier()
    out["grow"] = _check_replicas(sr, world, [(0, 2 * g)], 1) + _check_replicas(
        sr, world, [(2 * g, 7 * g)], 2
    )
    out["mapped_after_grow"] = [sr.peers.mapped_bytes(r) for r in range(world)]
    sr.resize(3 * g)
    out["mapped_after_shrink"] = [sr.peers.mapped_bytes(r) for r in range(world)]
    out["after_shrink"] = _check_replicas(sr, world, [(0, 2 * g)], 1)
    return _closed(out, sr, fds0)


@pytest.mark.timeout(120)
def test_four_processes_as_two_hosts_of_one_domain_map_grow_and_shrink_by_value(ledger):
    g = _gran()
    out = run_world(_prefix_cycle, 4, args=(["h0", "h0", "h1", "h1"], ["d0"] * 4), timeout=100)
    for o in out:
        assert o["handle_type"] == "shm_name" and o["by_value"], o
        assert o["rendezvous"] == [] and o["grow"] == [] and o["after_shrink"] == [], o
        assert o["names_after_rendezvous"] == [], o  # removed once all mapped
        assert o["mapped_after_grow"] == [7 * g] * 4, o
        assert o["mapped_after_shrink"] == [3 * g] * 4, o
        assert o["leaks"] == (0, 0, 0), o
    assert ledger.names() and ledger.left() == [], ledger.left()


@pytest.mark.timeout(120)
def test_a_single_host_group_keeps_posix_fds_even_with_the_overrides():
    out = run_world(_prefix_cycle, 2, args=(["h0", "h0"], ["d0", "d0"]), timeout=100)
    for o in out:
        assert o["handle_type"] == "posix_fd" and not o["by_value"], o
        assert o["rendezvous"] == [] and o["grow"] == [] and o["leaks"] == (0, 0, 0), o


def _segments_cycle(rank, world, run_bytes=None):
    import torch.distributed as dist

    _place(rank, [f"h{r}" for r in range(world)], ["d0"] * world)
    fds0 = fds_not_sockets()
    g = _gran()
    out = {}
    sr = _region(initial_bytes=0, run_bytes=run_bytes)
    # two segments, 1.5 pages per block, so that a chunk straddles two blocks
    segs = [(0, g + g // 2), (8 * g, g + g // 2)]
    sr.set_block_layout(segs, 4)

    def ranges(n):
        return [(off, off + n * blk) for off, blk in segs]

    sr.resize_blocks(3)
    _write_own(sr, rank, ranges(3), 5)
    dist.barrier()
    out["grow"] = _check_replicas(sr, world, ranges(3), 5)
    out["chunks"] = [[(c.offset, c.size) for c in sr.peers.mapped_chunks(r)] for r in range(world)]
    sr.resize_blocks(1)
    out["shrunk_chunks"] = [
        [(c.offset, c.size) for c in sr.peers.mapped_chunks(r)] for r in range(world)
    ]
    out["after_shrink"] = _check_replicas(sr, world, ranges(1), 5)
    sr.resize_blocks(2)  # regrow: new chunks by value again, blocks past 1 read zero
    out["regrown_zero"] = [
        bool((sr.view(r, reserve=True)[lo + (hi - lo) // 2 : hi] == 0).all())
        for r in range(world)
        for lo, hi in ranges(2)
    ]
    sr.resize_blocks(0)  # a sleep, then a wake of every block
    sr.resize_blocks(4)
    out["woken_chunks"] = [
        [(c.offset, c.size) for c in sr.peers.mapped_chunks(r)] for r in range(world)
    ]
    return _closed(out, sr, fds0)


@pytest.mark.timeout(120)
def test_a_segmented_layout_grows_and_shrinks_by_value_across_three_simulated_hosts(ledger):
    g = _gran()
    out = run_world(_segments_cycle, 3, timeout=100)
    # 3 blocks of 1.5 pages: pages [0, 5) of each segment; 1 block: [0, 2)
    want = [(off + i * g, g) for off in (0, 8 * g) for i in range(5)]
    shrunk = [(off + i * g, g) for off in (0, 8 * g) for i in range(2)]
    for o in out:
        assert o["grow"] == [] and o["after_shrink"] == [], o
        assert o["chunks"] == [want] * 3, o
        assert o["shrunk_chunks"] == [shrunk] * 3, o
        assert all(o["regrown_zero"]), o
        assert o["leaks"] == (0, 0, 0), o
    assert ledger.names() and ledger.left() == [], ledger.left()


def _rendezvous_by_value(rank, world):
    import torch.distributed as dist

    from vmmkv.alloc import VirtualRegion
    from vmmkv.ipc import rendezvous

    _place(rank, [f"h{r}" for r in range(world)], ["d0"] * world)
    fds0 = fds_not_sockets()
    g = _gran()
    region = VirtualRegion(8 * g, "cpu", chunk_bytes=g, backend="host", handle_type="shm_name")
    region.commit(3 * g)
    region.tensor()[: 3 * g].copy_(_pattern(rank, 3 * g, 9))
    pm = rendezvous(region, dist.group.WORLD, timeout=TIMEOUT)
    ok = all(bool((pm.view(r)[: 3 * g] == _pattern(r, 3 * g, 9)).all()) for r in range(world))
    dist.barrier()
    pm.close()
    region.close()
    del region, pm
    return ok, _leaks(fds0)


@pytest.mark.timeout(120)
def test_rendezvous_maps_shm_name_regions_of_two_simulated_hosts_byte_exact(ledger):
    assert run_world(_rendezvous_by_value, 2, timeout=100) == [(True, (0, 0, 0))] * 2
    assert ledger.names() and ledger.left() == [], ledger.left()


def _cache_publish(rank, world, hosts, domains, fabric="1"):
    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache

    _place(rank, hosts, domains, fabric)
    chunk = 1 << 16
    with ReplicatedKVCache(
        dist.group.WORLD, 8 * chunk, "cpu", chunk_bytes=chunk, initial_bytes=2 * chunk,
        timeout=TIMEOUT, backend="host",
    ) as cache:  # fmt: skip
        direct, why = cache.direct, cache.why_not_direct
        handle = cache.region.region.handle_type if direct else None
        cache.grow(4 * chunk)  # the stores below land in chunks exchanged by a grow too
        kv = KVStep(cache, LAYERS, TOKENS)
        kv.publish_checked(rank, world, TOKENS, seed=20, what="by-value publish")
        stats = cache.stats()
        dist.barrier()
    return direct, why, handle, stats["tokens_stored"], stats["out_of_range_slots"]


@pytest.mark.timeout(150)
def test_cache_stores_across_simulated_hosts_of_one_domain_are_byte_equal_to_the_reference(ledger):
    out = run_world(_cache_publish, 3, args=(["a", "a", "b"], ["d0"] * 3), timeout=130)
    for direct, why, handle, tokens, oob in out:
        assert direct, why
        assert handle == "shm_name"
        assert (tokens, oob) == (TOKENS * LAYERS, 0)
    assert ledger.names() and ledger.left() == [], ledger.left()


@pytest.mark.timeout(150)
def test_a_group_across_two_nvlink_domains_falls_back_to_gather_naming_domains_and_ranks(ledger):
    out = run_world(
        _cache_publish, 4, args=(["a", "a", "b", "b"], ["d0", "d0", "d1", "d1"]), timeout=130
    )
    for direct, why, handle, tokens, oob in out:
        assert not direct and handle is None
        assert "2 NVLink domains" in why, why
        assert "nvlink:test:d0: ranks [0, 1]" in why and "nvlink:test:d1: ranks [2, 3]" in why
        assert (tokens, oob) == (TOKENS * LAYERS, 0)  # the gather path stores the same bytes
    assert ledger.left() == [], ledger.left()


@pytest.mark.timeout(150)
def test_hosts_of_one_domain_without_the_opt_in_fall_back_to_gather_naming_the_opt_in(ledger):
    out = run_world(_cache_publish, 2, args=(["a", "b"], ["d0"] * 2, "0"), timeout=130)
    for direct, why, handle, tokens, oob in out:
        assert not direct and handle is None
        assert "several hosts" in why and f"set {FABRIC_ENV}=1 on every rank" in why, why
        assert "not run on multi-node NVLink hardware" in why, why
        assert (tokens, oob) == (TOKENS * LAYERS, 0)  # the gather path stores the same bytes
    assert ledger.names() == [], ledger.names()  # nothing was exported by value


def _require_across_hosts(rank, world):
    from vmmkv.ipc import DirectUnsupported

    _place(rank, ["a", "b"], None)  # two hosts, no NVLink domain: each host its own
    try:
        _region(peers="require").close()
    except DirectUnsupported as exc:
        return str(exc)
    return None


@pytest.mark.timeout(120)
def test_two_hosts_without_a_shared_domain_cannot_map_and_say_so_on_every_rank():
    out = run_world(_require_across_hosts, 2, timeout=100)
    assert out[0] is not None and out[0] == out[1]
    assert "several hosts" in out[0] and "ranks [0] on 'a" in out[0], out[0]
    assert "ranks [1] on 'b" in out[0] and "by-value (fabric) handles" in out[0], out[0]


def _mismatched_handle_types(rank, world):
    from vmmkv.ipc import ConfigMismatch

    fds0 = fds_not_sockets()
    try:
        _region(handle_type=("auto", "posix_fd")[rank]).close()
    except ConfigMismatch as exc:
        return str(exc).split(": ", 1)[1], _leaks(fds0)
    return None


@pytest.mark.timeout(120)
def test_ranks_creating_regions_with_different_handle_types_all_get_the_same_mismatch():
    out = run_world(_mismatched_handle_types, 2, timeout=100)
    want = "handle_type differs between ranks: rank 0: 'auto', rank 1: 'posix_fd'"
    assert out == [(want, (0, 0, 0))] * 2, out


# --------------------------------------------------------------------------------------------
# failures: an injected error at each step, a rank killed at each step
# --------------------------------------------------------------------------------------------

# point -> (owner "module:Class", attribute, raise after the real call)
INJECT = {
    "export": ("vmmkv.alloc.host:HostBackend", "export_value", False),
    "exchange": ("vmmkv.ipc.transports:_ValueTransport", "exchange", False),  # sends one short
    "import": ("vmmkv.alloc.host:HostBackend", "import_value", False),
    "map": ("vmmkv.alloc:PeerRegion", "map_value", True),
    "agreement": ("vmmkv.ipc.peers:PeerMap", "exchange_new", True),
}


def _owner(path):
    import importlib

    module, _, cls = path.partition(":")
    return getattr(importlib.import_module(module), cls)


def _inject(point):
    """Make the next call of the point's method raise on this rank; returns the undo."""
    owner, name, after = INJECT[point]
    cls = _owner(owner)
    real = getattr(cls, name)
    state = {"armed": True}

    def hook(*args, **kwargs):
        if point == "exchange":  # the first round with handles: a malformed one, one short
            self, body, handles, *rest = args
            if state["armed"] and handles:
                state["armed"] = False
                handles = handles[:-1]
            return real(self, body, handles, *rest, **kwargs)
        if state["armed"] and not after:
            state["armed"] = False
            raise RuntimeError(f"injected {point} failure")
        out = real(*args, **kwargs)
        if state["armed"]:
            state["armed"] = False
            raise RuntimeError(f"injected {point} failure")
        return out

    setattr(cls, name, hook)
    return lambda: setattr(cls, name, real)


def _injected(rank, world, point):
    import torch.distributed as dist

    from vmmkv.ipc import GroupError

    _place(rank, [f"h{r}" for r in range(world)], ["d0"] * world)
    victim = world - 1
    fds0 = fds_not_sockets()
    g = _gran()
    out = {}
    # 1. the rendezvous (the agreement point there: the table built after mapping)
    undo = None
    if rank == victim:
        undo = _inject(point) if point != "agreement" else _inject_rdzv_agreement()
    try:
        _region().close()
        out["rendezvous"] = None
    except GroupError as exc:
        out["rendezvous"] = f"{type(exc).__name__}: {exc}"
    if undo:
        undo()
    dist.barrier()
    # 2. a grow of a working group
    sr = _region()
    _write_own(sr, rank, [(0, 2 * g)], 3)
    dist.barrier()
    if rank == victim:
        undo = _inject(point)
    try:
        sr.resize(6 * g)
        out["grow"] = None
    except GroupError as exc:
        out["grow"] = f"{type(exc).__name__}: {exc}"
    if rank == victim:
        undo()
    out["after_failed_grow"] = [sr.peers.mapped_bytes(r) for r in range(world)]
    sr.resize(5 * g)  # the group is usable again
    _write_own(sr, rank, [(2 * g, 5 * g)], 4)
    dist.barrier()
    out["replicas"] = _check_replicas(sr, world, [(0, 2 * g)], 3) + _check_replicas(
        sr, world, [(2 * g, 5 * g)], 4
    )
    return _closed(out, sr, fds0)


def _inject_rdzv_agreement():
    """The rendezvous' last local step before its agreement (the PeerMap's tables) fails."""
    from vmmkv.ipc import peers

    real = peers.PeerMap.__init__

    def hook(self, *a, **k):
        peers.PeerMap.__init__ = real
        raise RuntimeError("injected agreement failure")

    peers.PeerMap.__init__ = hook
    return lambda: setattr(peers.PeerMap, "__init__", real)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("point", list(INJECT))
def test_an_error_on_one_rank_at_each_by_value_step_fails_every_rank_naming_it(point, ledger):
    g = _gran()
    world = 3
    out = run_world(_injected, world, args=(point,), timeout=130)
    for rank, o in enumerate(out):
        for step in ("rendezvous", "grow"):
            err = o[step]
            assert err is not None, (rank, step, o)
            assert "rank 2" in err or "ranks [2]" in err, (rank, step, err)
            if point == "exchange":  # every receiver names the sender of the short message
                sent = {"rendezvous": "2 handles, expected 3", "grow": "3 handles, expected 4"}
                assert f"rank 2 sent {sent[step]}" in err, (rank, step, err)
            elif rank == 2 or point != "export":
                assert "injected" in err, (rank, step, err)
        assert o["after_failed_grow"] == [2 * g] * world, o
        assert o["replicas"] == [], o
        assert o["leaks"] == (0, 0, 0), o
    assert ledger.left() == [], ledger.left()


# point -> (operation, owner, attribute, die after the real call)
KILLS = {
    "export": ("rendezvous", "vmmkv.alloc.host:HostBackend", "export_value", True),
    "exchange": ("grow", "vmmkv.ipc.transports:_ValueTransport", "exchange", False),
    "import": ("grow", "vmmkv.alloc.host:HostBackend", "import_value", False),
    "agreement": ("grow", "vmmkv.ipc.comm:StoreComm", "agree", False),
}


def _killed(rank, world, point, marker):
    import torch.distributed as dist

    from vmmkv.ipc import GroupError

    _place(rank, [f"h{r}" for r in range(world)], ["d0"] * world)
    victim = world - 1
    op, owner, name, after = KILLS[point]
    fds0 = fds_not_sockets()
    g = _gran()
    sr, error = None, None
    undo = lambda: None  # noqa: E731
    t0 = time.monotonic()
    try:
        if op == "rendezvous":
            if rank == victim:
                undo = kill_at(_owner(owner), name, after=after, marker=marker)
            t0 = time.monotonic()
            sr = _region()
        else:
            sr = _region()
            dist.barrier()
            if rank == victim:
                undo = kill_at(_owner(owner), name, after=after, marker=marker)
            t0 = time.monotonic()
            sr.resize(6 * g)
    except GroupError as exc:
        error = f"{type(exc).__name__}: {exc}"
    elapsed = time.monotonic() - t0
    undo()
    if rank == victim:
        raise AssertionError(f"rank {rank} passed its kill point {point} ({error})")
    if sr is not None:
        sr.close()
    del sr
    return error, elapsed, _leaks(fds0)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("point", list(KILLS))
def test_a_rank_killed_at_each_by_value_step_is_named_and_leaves_no_shm_names(
    point, tmp_path, ledger
):
    world = 3
    marker = tmp_path / "killed-at"
    res = run_world_raw(_killed, world, args=(point, str(marker)), timeout=120)
    victim = res[-1]
    assert victim.exitcode == -signal.SIGKILL, (victim.exitcode, victim.error)
    assert marker.read_text() == KILLS[point][2]
    for r in res[:-1]:
        assert r.ok, r.error
        error, elapsed, leaks = r.value
        assert error is not None and "ranks [2]" in error, error
        assert elapsed < TIMEOUT + 3, (elapsed, error)
        assert leaks == (0, 0, 0), leaks
    assert ledger.left() == [], ledger.left()


# --------------------------------------------------------------------------------------------
# the host backend's by-value calls, in one process
# --------------------------------------------------------------------------------------------


def test_an_shm_name_chunk_exported_by_value_shares_its_bytes_and_its_name_is_removed():
    import torch

    from vmmkv.alloc import VirtualRegion

    tag = f"t{os.getpid()}x{time.monotonic_ns() % 10**9}"  # no other process uses it
    fds0 = fds_not_sockets()
    g = _gran()
    own = VirtualRegion(4 * g, "cpu", chunk_bytes=g, backend="host", handle_type="shm_name")
    own.commit(2 * g)
    chunk = own.chunks()[1]
    value = own.export_chunk_value(chunk, tag)
    assert value.startswith(f"vmmkv-{tag}-".encode()) and len(shm_names(f"{tag}-")) == 1
    peer = own.open_peer()
    peer.map_value(value, chunk)
    own.release_values(tag)  # the mapping keeps the memory; the name goes
    assert shm_names(f"{tag}-") == []
    data = torch.randint(1, 256, (g,), dtype=torch.uint8)
    own.tensor()[g : 2 * g].copy_(data)
    assert torch.equal(peer.tensor()[g : 2 * g], data)
    peer.close()
    own.close()
    assert fds_not_sockets() == fds0 and shm_names(f"{tag}-") == []


def test_by_value_calls_refuse_bad_names_sizes_tags_and_fd_regions_before_any_system_call():
    from vmmkv.alloc import VirtualRegion
    from vmmkv.alloc.host import HostBackend

    tag = f"t{os.getpid()}x{time.monotonic_ns() % 10**9}"  # no other process uses it
    fds0 = fds_not_sockets()
    g = _gran()
    be = HostBackend("shm_name")
    with pytest.raises(ValueError, match="not a vmmkv shm name"):
        be.import_value(b"../../etc/passwd", g)
    with pytest.raises(ValueError, match="not a vmmkv shm name"):
        be.import_value(b"vmmkv-t1-0123456789abcdef/../x", g)
    with pytest.raises(TypeError, match="must be bytes"):
        be.import_value("vmmkv-t1-0123456789abcdef", g)
    with pytest.raises(OSError, match="opening vmmkv-t1-0123456789abcdef failed"):
        be.import_value(b"vmmkv-t1-0123456789abcdef", g)
    with pytest.raises(ValueError, match="tag must be"):
        be.release_values("a*")
    with pytest.raises(ValueError, match="handle types"):
        HostBackend("fabric")
    with VirtualRegion(2 * g, "cpu", chunk_bytes=g, backend="host", handle_type="shm_name") as r:
        r.commit(g)
        with pytest.raises(ValueError, match="tag must be"):
            r.export_chunk_value(r.chunks()[0], "a-b")
        value = r.export_chunk_value(r.chunks()[0], tag)
        try:
            with pytest.raises(ValueError, match=f"holds {g} bytes, expected >= {2 * g}"):
                be.import_value(value, 2 * g)
        finally:
            r.release_values(tag)
    with VirtualRegion(2 * g, "cpu", chunk_bytes=g, backend="host") as r:
        r.commit(g)
        with pytest.raises(ValueError, match="'posix_fd' has no values"):
            r.export_chunk_value(r.chunks()[0], tag)
    assert shm_names(f"{tag}-") == [] and fds_not_sockets() == fds0  # refusals keep no fd open


def _req(boot, domain, host="h"):
    return {"host": host, "boot_id": boot, "domain": domain, "pidns": "1", "netns": "1", "uid": 0}


def test_placement_one_host_keeps_fds_whatever_its_gpus_domains_say():
    from vmmkv.ipc.placement import _placement_problem

    reqs = [_req("b0", "nvlink:c:1"), _req("b0", "host:b0")]  # one GPU not registered yet
    assert _placement_problem(reqs, by_value=False) == ""


def test_placement_names_every_domain_and_its_ranks_and_needs_values_across_hosts():
    from vmmkv.ipc.placement import _placement_problem

    two = [_req("b0", "nvlink:c:1", "a"), _req("b1", "nvlink:c:2", "b"), _req("b2", "nvlink:c:1")]
    for by_value in (False, True):
        msg = _placement_problem(two, by_value)
        assert "ranks span 2 NVLink domains" in msg, msg
        assert "nvlink:c:1: ranks [0, 2]" in msg and "nvlink:c:2: ranks [1]" in msg, msg
    one = [_req("b0", "nvlink:c:1", "a"), _req("b1", "nvlink:c:1", "b")]
    assert _placement_problem(one, by_value=True) == ""
    assert "several hosts" in _placement_problem(one, by_value=False)


class _TwoRankComm:
    """Rank 0's view of a 2-rank group: ``all_gather`` returns this rank's value and rank 1's
    scripted answer for that step; the steps taken are recorded."""

    rank, world_size = 0, 2

    def __init__(self, peer: dict):
        self.peer, self.steps = peer, []

    def all_gather(self, value, what):
        self.steps.append(what)
        return [value, self.peer[what]]


HERE = {"host": "h", "boot_id": "b0", "domain": "nvlink:c:1"}


# rank 1's first request when both ranks opted in to by-value handles
PEER_IN = ["auto", "cuda", "b1", "nvlink:c:1", "1"]


@pytest.mark.parametrize(
    "backend, peer_loc, probes, want, steps",
    [
        ("cuda", PEER_IN, [(True, ""), (True, "")], "fabric", 2),
        ("cuda", PEER_IN, [(True, ""), (False, "no IMEX")], "posix_fd", 2),
        ("cuda", PEER_IN, [RuntimeError("gone"), (True, "")], "posix_fd", 2),
        ("host", ["auto", "host", "b1", "nvlink:c:1", "1"], None, "shm_name", 1),
        ("cuda", ["auto", "cuda", "b0", "nvlink:c:1", "1"], None, "posix_fd", 1),  # one host
        ("cuda", ["auto", "cuda", "b1", "nvlink:c:2", "1"], None, "posix_fd", 1),  # two domains
        ("cuda", ["auto", "host", "b1", "nvlink:c:1", "1"], None, "posix_fd", 1),  # two backends
    ],
)
def test_a_cuda_group_across_hosts_of_one_domain_takes_fabric_handles_only_if_every_probe_passes(
    monkeypatch, caplog, backend, peer_loc, probes, want, steps
):
    from vmmkv.alloc import cuda
    from vmmkv.ipc import placement

    def probe(ordinal):
        assert ordinal == 0
        if isinstance(probes[0], Exception):
            raise probes[0]
        return probes[0]

    monkeypatch.setenv(FABRIC_ENV, "1")
    monkeypatch.setattr(placement, "local_location", lambda ordinal: dict(HERE))
    monkeypatch.setattr(cuda, "fabric_probe", probe)
    comm = _TwoRankComm({"handle type": peer_loc, "fabric probe": list(probes[1]) if probes else 0})
    with caplog.at_level("WARNING", logger="vmmkv.ipc.peers"):
        assert placement.choose_handle_type(comm, backend, 0) == want
    assert comm.steps == ["handle type", "fabric probe"][:steps]
    if probes and want == "posix_fd":  # the failing ranks and their reasons are logged
        text = caplog.text
        assert ("rank 1: no IMEX" in text) or ("rank 0: fabric probe failed" in text), text


@pytest.mark.parametrize("backend", ["cuda", "host"])
@pytest.mark.parametrize(
    "mine, peer, level, named",
    [
        ("", "0", "INFO", ""),  # unset on both ranks: the default
        ("0", "0", "INFO", ""),
        ("1", "0", "WARNING", "ranks [1] did not"),  # one rank alone cannot opt the group in
        ("0", "1", "WARNING", "ranks [0] did not"),
    ],
)
def test_hosts_of_one_domain_take_by_value_handles_only_when_every_rank_opts_in(
    monkeypatch, caplog, backend, mine, peer, level, named
):
    from vmmkv.alloc import cuda
    from vmmkv.ipc import placement

    def probe(ordinal):
        raise AssertionError("without the opt-in no fabric probe runs")

    monkeypatch.setenv(FABRIC_ENV, mine)
    monkeypatch.setattr(placement, "local_location", lambda ordinal: dict(HERE))
    monkeypatch.setattr(cuda, "fabric_probe", probe)
    comm = _TwoRankComm({"handle type": ["auto", backend, "b1", "nvlink:c:1", peer]})
    with caplog.at_level("INFO", logger="vmmkv.ipc.peers"):
        assert placement.choose_handle_type(comm, backend, 0) == "posix_fd"
    assert comm.steps == ["handle type"]
    (record,) = [r for r in caplog.records if "NVLink domain" in r.getMessage()]
    text = record.getMessage()
    assert record.levelname == level, (record.levelname, text)
    assert "several hosts of one NVLink domain (nvlink:c:1)" in text, text
    assert f"set {FABRIC_ENV}=1 on every rank, or handle_type='fabric'" in text, text
    assert "gather-then-insert" in text and named in text, text


def test_an_explicit_fabric_request_needs_no_opt_in(monkeypatch):
    from vmmkv.ipc import placement

    monkeypatch.delenv(FABRIC_ENV, raising=False)
    comm = _TwoRankComm({"handle type": ["fabric", None, None, None, None]})
    assert placement.choose_handle_type(comm, "cuda", 0, "fabric") == "fabric"


def test_a_fabric_opt_in_other_than_0_or_1_fails_every_rank_naming_ranks_and_values(monkeypatch):
    from vmmkv.ipc import placement

    monkeypatch.setenv(FABRIC_ENV, "yes")
    monkeypatch.setattr(placement, "local_location", lambda ordinal: dict(HERE))
    comm = _TwoRankComm({"handle type": ["auto", "cuda", "b1", "nvlink:c:1", "invalid 'on'"]})
    with pytest.raises(ValueError, match=rf"{FABRIC_ENV} must be '0' or '1' on every rank") as e:
        placement.choose_handle_type(comm, "cuda", 0)
    assert "rank 0: 'yes'; rank 1: 'on'" in str(e.value), str(e.value)
    assert str(e.value).startswith("rank 0 of 2: choosing the handle type"), str(e.value)


def test_the_placement_problem_of_hosts_of_one_domain_names_the_opt_in_only_there():
    from vmmkv.ipc.placement import _placement_problem

    one = [_req("b0", "nvlink:c:1", "a"), _req("b1", "nvlink:c:1", "b")]
    assert f"set {FABRIC_ENV}=1 on every rank" in _placement_problem(one, by_value=False)
    apart = [_req("b0", "host:b0", "a"), _req("b1", "host:b1", "b")]  # separate hosts, no fabric
    msg = _placement_problem(apart, by_value=False)
    assert "several hosts" in msg and FABRIC_ENV not in msg, msg


@pytest.mark.parametrize(
    "mine, peer", [("auto", "posix_fd"), ("posix_fd", "auto"), ("posix_fd", "shm_name")]
)
def test_ranks_asking_for_different_handle_types_get_one_config_mismatch_naming_each(
    monkeypatch, mine, peer
):
    from vmmkv.ipc import peers, placement

    monkeypatch.setattr(placement, "local_location", lambda ordinal: dict(HERE))
    comm = _TwoRankComm({"handle type": [peer, None, None, None, None]})
    with pytest.raises(peers.ConfigMismatch, match=rf"rank 0: '{mine}', rank 1: '{peer}'"):
        placement.choose_handle_type(comm, "host", 0, mine)
    assert comm.steps == ["handle type"]


def test_ranks_asking_for_the_same_explicit_handle_type_get_it_in_one_step(monkeypatch):
    from vmmkv.ipc import placement

    def no_location(ordinal):
        raise AssertionError("an explicit handle type reads no location")

    monkeypatch.setattr(placement, "local_location", no_location)
    comm = _TwoRankComm({"handle type": ["posix_fd", None, None, None, None]})
    assert placement.choose_handle_type(comm, "cuda", 0, "posix_fd") == "posix_fd"
    assert comm.steps == ["handle type"]


# --------------------------------------------------------------------------------------------
# real fabric handles: runs only where the GPUs can create fabric memory (skips elsewhere)
# --------------------------------------------------------------------------------------------


def _fabric_pair(rank, world):
    import torch
    import torch.distributed as dist

    from vmmkv.alloc.cuda import fabric_probe
    from vmmkv.ipc import SymmetricRegion

    ordinal = rank % torch.cuda.device_count()
    torch.cuda.set_device(ordinal)
    probes = [None] * world
    dist.all_gather_object(probes, fabric_probe(ordinal))
    if not all(ok for ok, _ in probes):
        return "skip: " + "; ".join(f"rank {r}: {why}" for r, (ok, why) in enumerate(probes))
    # Two simulated hosts of one domain on one machine: the by-value path with real handles.
    _place(rank, ["h0", "h1"], ["d0", "d0"])
    n = 2 << 20
    with SymmetricRegion(
        4 * n, f"cuda:{ordinal}", dist.group.WORLD, chunk_bytes=n, initial_bytes=n,
        backend="cuda", timeout=30.0,
    ) as sr:  # fmt: skip
        assert sr.region.handle_type == "fabric" and sr.peers.by_value
        sr.view(rank)[:n].copy_(_pattern(rank, n, 1).to(sr.device))
        torch.cuda.synchronize()
        dist.barrier()
        same = [bool((sr.view(r)[:n].cpu() == _pattern(r, n, 1)).all()) for r in range(world)]
        dist.barrier()
    return same


@requires_gpu
@pytest.mark.timeout(180)
def test_real_fabric_handles_map_two_simulated_hosts_where_the_gpus_support_them():
    out = run_world(_fabric_pair, 2, timeout=150)
    if isinstance(out[0], str):
        pytest.skip(out[0])
    assert out == [[True, True]] * 2, out
