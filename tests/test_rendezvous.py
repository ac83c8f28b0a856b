"""rendezvous() / SymmetricRegion: peer mappings, collective resize, failure semantics.

Every scenario runs in spawned processes with a gloo group (vmmkv/testing/spawn.py). On the host
backend (CI) the mappings are real shared memfd mappings; with marker ``gpu`` the same scenarios
run with N processes sharing the one GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.helpers import fail_peer_mapping_on
from vmmkv.testing.spawn import capture_logs, run_world, run_world_raw, world_store

CASES = [
    pytest.param("host", 2, id="host-2"),
    pytest.param("host", 4, id="host-4"),
    pytest.param("cuda", 2, id="cuda-2", marks=pytest.mark.gpu),
    pytest.param("cuda", 4, id="cuda-4", marks=pytest.mark.gpu),
]


def _device(backend):
    return "cpu" if backend == "host" else "cuda:0"


def _gran(backend):
    from vmmkv.alloc import make_backend

    return make_backend(_device(backend), backend).granularity


def _fds():
    return len(os.listdir("/proc/self/fd"))


def _maps():
    """What vmmkv could leak on the host backend: memfd mappings, and reservations still held
    (the backend's own record; /proc/self/maps lines merge and also hold malloc arenas)."""
    from vmmkv.alloc.host import reservations

    with open("/proc/self/maps") as f:
        memfd = sum(1 for line in f if "memfd:" in line)
    return memfd, len(reservations())


def _memfds():
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        except OSError:
            pass
    return n


def _pattern(writer, target, n, device, salt=0):
    import torch

    g = torch.Generator().manual_seed(1000 * writer + 10 * target + salt + 1)
    return torch.randint(1, 256, (n,), generator=g, dtype=torch.uint8).to(device)


def _write_all_check_own(sr, base, n, salt):
    """Every rank writes a rank-tagged pattern at slot [base + writer*n] of every region
    (its own and every peer's), barrier, then checks its own region holds every writer's."""
    import torch
    import torch.distributed as dist

    me, world = sr.rank, sr.world_size
    for target in range(world):
        view = sr.view(target)
        view[base + me * n : base + (me + 1) * n].copy_(_pattern(me, target, n, sr.device, salt))
    if sr.device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier(sr.group)
    own = sr.view(me)
    for writer in range(world):
        got = own[base + writer * n : base + (writer + 1) * n]
        want = _pattern(writer, me, n, sr.device, salt)
        assert torch.equal(got, want), f"rank {me}: bytes from rank {writer} wrong at {base}"


def _lifecycle(rank, world, backend):
    import torch
    import torch.distributed as dist

    from vmmkv.ipc import SymmetricRegion

    g = _gran(backend)
    chunk = 2 * g
    # warm-up cycle: torch's and the driver's own first-use fds (CUDA: uvm, caps, ...) are
    # opened here, so the count below measures what vmmkv keeps
    warm = SymmetricRegion(2 * chunk, _device(backend), chunk_bytes=chunk, backend=backend)
    warm.resize(2 * chunk)
    _write_all_check_own(warm, 0, 64, salt=0)
    warm.close()
    fds0 = _fds()
    sr = SymmetricRegion(
        16 * chunk, _device(backend), chunk_bytes=chunk, initial_bytes=2 * chunk, backend=backend
    )
    base_ptrs = list(sr.peers.ptrs)
    table = sr.peers.ptr_table
    assert table.dtype == torch.int64 and table.tolist() == base_ptrs
    assert base_ptrs[rank] == sr.region.base_ptr
    assert sr.committed_bytes == 2 * chunk and int(sr.committed_table.item()) == 2 * chunk
    n = 1000
    _write_all_check_own(sr, 0, n, salt=1)
    # grow: the new chunks of every peer are mapped; writes there land
    assert sr.resize(6 * chunk) == 6 * chunk
    assert int(sr.committed_table.item()) == 6 * chunk
    assert all(sr.peers.mapped_bytes(r) == 6 * chunk for r in range(world))
    _write_all_check_own(sr, 5 * chunk, n, salt=2)
    _write_all_check_own(sr, 0, n, salt=1)  # old data untouched by growth
    # shrink, then regrow: new physical memory at the same addresses, zeroed
    assert sr.resize(3 * chunk + 1) == 4 * chunk  # rounded up to whole chunks
    assert all(sr.peers.mapped_bytes(r) == 4 * chunk for r in range(world))
    assert sr.resize(8 * chunk) == 8 * chunk
    assert sr.peers.ptrs == base_ptrs and sr.peers.ptr_table is table
    own = sr.view(rank)
    assert int(own[4 * chunk : 8 * chunk].count_nonzero()) == 0
    dist.barrier(sr.group)  # nobody writes into the regrown chunks before all checked zeros
    _write_all_check_own(sr, 7 * chunk, n, salt=3)
    sr.close()
    sr.close()
    assert _fds() == fds0, f"rank {rank}: fd count {fds0} -> {_fds()}"
    return base_ptrs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend,world", CASES)
def test_every_rank_writes_every_peer_and_resize_keeps_addresses(backend, world):
    ptrs = run_world(_lifecycle, world, args=(backend,), timeout=90)
    # each process mapped every peer somewhere of its own; own slots are own regions
    assert all(len(p) == world for p in ptrs)


def _memory_baseline(rank, world):
    import torch
    import torch.distributed as dist

    from vmmkv.alloc import VirtualRegion
    from vmmkv.ipc import SymmetricRegion

    g = _gran("cuda")

    def settled_memory_in_use():
        """Device memory in use once every rank has released what it freed (synchronize, empty
        torch's cache, barrier: nobody measures before everyone released)."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        dist.barrier()
        probe = VirtualRegion(g, "cuda:0", backend="cuda")
        used = probe.memory_in_use()
        probe.close()
        return used

    # warm-up cycle: CUDA context, torch's allocator and lazily loaded modules on every rank
    warm = SymmetricRegion(4 * g, "cuda:0", chunk_bytes=2 * g, initial_bytes=4 * g, backend="cuda")
    warm.close()
    before = settled_memory_in_use()  # every rank is warm before anyone measures
    dist.barrier()  # nobody allocates before everyone measured
    fds0 = _fds()
    sr = SymmetricRegion(32 * g, "cuda:0", chunk_bytes=4 * g, initial_bytes=16 * g, backend="cuda")
    sr.resize(32 * g)
    sr.close()
    after = settled_memory_in_use()  # every rank has released before anyone measures
    return before, after, fds0, _fds()


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_device_memory_and_fds_return_to_baseline_after_close_on_every_rank():
    out = run_world(_memory_baseline, 2, timeout=90)
    g = _gran("cuda")
    for before, after, fds0, fds1 in out:
        assert fds1 == fds0
        # other ranks' allocations count too (shared GPU): after everyone closed, back to start
        assert after - before < 2 * g, (before, after)


def _absent(rank, world, absent_rank, timeout):
    from vmmkv.ipc import GroupError, SymmetricRegion

    if rank == absent_rank:
        time.sleep(timeout + 6)  # never joins
        return "absent"
    g = _gran("host")
    fds0, maps0 = _memfds(), _maps()  # store sockets may reconnect: count what vmmkv owns
    t0 = time.monotonic()
    try:
        SymmetricRegion(8 * g, "cpu", backend="host", initial_bytes=4 * g, timeout=timeout)
    except GroupError as exc:
        elapsed = time.monotonic() - t0
        return str(exc), elapsed, fds0, _memfds(), maps0, _maps()
    raise AssertionError("rendezvous succeeded without a rank")


@pytest.mark.timeout(60)
def test_a_rank_that_never_joins_is_named_within_the_timeout_and_nothing_leaks():
    timeout = 3.0
    # The absent rank is rank 0, the host of the group's store: the store then outlives the
    # survivors' error handling (a store host that exits first would take the evidence along).
    res = run_world_raw(_absent, 3, args=(0, timeout), timeout=30)
    for r in res[1:]:
        assert r.ok, r.error
        msg, elapsed, fds0, fds1, maps0, maps1 = r.value
        assert "ranks [0]" in msg and "did not arrive" in msg
        assert elapsed < timeout + 3
        assert fds1 == fds0 and maps1 == maps0


def _dies_mid_exchange(rank, world):
    from vmmkv.ipc import RendezvousError, SymmetricRegion, fdpass

    if rank == 1:
        real = fdpass.exchange_fds

        def die(**kw):
            os._exit(17)

        fdpass.exchange_fds = die
    g = _gran("host")
    fds0, maps0 = _memfds(), _maps()
    try:
        SymmetricRegion(8 * g, "cpu", backend="host", initial_bytes=4 * g, timeout=4)
    except RendezvousError as exc:
        return str(exc), fds0, _memfds(), maps0, _maps()
    finally:
        if rank == 1:
            fdpass.exchange_fds = real
    raise AssertionError("survived a dead peer")


@pytest.mark.timeout(60)
def test_survivors_of_a_rank_killed_mid_exchange_raise_and_release_everything():
    res = run_world_raw(_dies_mid_exchange, 3, timeout=40)
    assert res[1].exitcode == 17
    for r in (res[0], res[2]):
        assert r.ok, r.error
        msg, fds0, fds1, maps0, maps1 = r.value
        assert "1" in msg
        assert fds1 == fds0 and maps1 == maps0


def _mismatch(rank, world, field):
    from vmmkv.ipc import RendezvousError, SymmetricRegion

    g = _gran("host")
    cap, chunk = 8 * g, 2 * g
    if field == "capacity" and rank == 1:
        cap = 16 * g
    if field == "chunk" and rank == 0:
        chunk = 4 * g
    try:
        SymmetricRegion(cap, "cpu", backend="host", chunk_bytes=chunk, timeout=10)
    except RendezvousError as exc:
        return str(exc)
    raise AssertionError("mismatch accepted")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("field,name", [("capacity", "capacity_bytes"), ("chunk", "chunk_bytes")])
def test_mismatched_requests_raise_the_same_error_on_every_rank(field, name):
    msgs = run_world(_mismatch, 3, args=(field,), timeout=40)
    assert len(set(m.split("(rank ")[1].split(")", 1)[1] for m in msgs)) == 1, msgs
    assert name in msgs[0] and "ranks [" in msgs[0]


def _check_rolled_back_and_regrows(sr, world, kept, regrow):
    """After a failed grow: every rank is back at ``kept`` bytes (own and peers' mappings), a
    later grow succeeds (the group is still in step), and the kept bytes (rank r wrote r + 1
    into its first ``kept`` bytes) are intact in every replica."""
    import torch

    assert sr.committed_bytes == kept
    assert all(sr.peers.mapped_bytes(r) == kept for r in range(world))
    assert sr.resize(regrow) == regrow
    for r in range(world):
        assert torch.equal(sr.view(r)[:kept], torch.full((kept,), r + 1, dtype=torch.uint8))


def _region_with_kept_bytes(rank):
    """A host SymmetricRegion of 16 granules with 2 committed, rank r's own 2 filled with r + 1
    (what ``_check_rolled_back_and_regrows`` later expects intact); returns (granularity, it)."""
    from vmmkv.ipc import SymmetricRegion

    g = _gran("host")
    sr = SymmetricRegion(16 * g, "cpu", backend="host", chunk_bytes=g, initial_bytes=2 * g)
    sr.view(rank)[: 2 * g].fill_(rank + 1)
    return g, sr


def _grow_fails_then_recovers(sr, world, kept, grow, undo, what):
    """Grow to ``grow`` with a fault injected (``undo`` removes it, whatever happens): the grow
    must raise GroupError on this rank; then the group is rolled back to ``kept`` and regrows.
    Closes ``sr``; returns the error message."""
    from vmmkv.ipc import GroupError

    try:
        sr.resize(grow)
    except GroupError as exc:
        msg = str(exc)
    else:
        raise AssertionError(f"grow succeeded despite the injected {what}")
    finally:
        undo()
    _check_rolled_back_and_regrows(sr, world, kept, grow)
    sr.close()
    return msg


def _every_rank_names_the_fault(worker, world, timeout, fault, culprit):
    """Run ``worker`` (a failed grow returning its message) on ``world`` ranks: every rank's
    message names the injected ``fault`` and the rank ``culprit`` it happened on."""
    msgs = run_world(worker, world, timeout=timeout)
    assert all(fault in m and f"ranks [{culprit}]" in m for m in msgs), msgs


def _injected_oom(rank, world):
    g, sr = _region_with_kept_bytes(rank)
    backend = sr.region._backend
    real = backend.create
    calls = {"n": 0}

    def flaky(size):
        calls["n"] += 1
        if rank == world - 1 and calls["n"] == 3:
            raise MemoryError("injected out of memory")
        return real(size)

    backend.create = flaky
    msg = _grow_fails_then_recovers(
        sr, world, 2 * g, 8 * g, lambda: setattr(backend, "create", real), "failure"
    )
    sr.close()  # a second close is a no-op
    return msg


@pytest.mark.timeout(60)
def test_an_injected_oom_during_grow_rolls_back_every_rank_and_a_later_grow_succeeds():
    _every_rank_names_the_fault(_injected_oom, 3, 40, "injected out of memory", culprit=2)


def _message_of(call, error, what):
    """The message of the ``error`` that ``call()`` must raise; AssertionError "<what> accepted"
    when it returns instead."""
    try:
        call()
    except error as exc:
        return str(exc)
    raise AssertionError(f"{what} accepted")


def _resize_mismatch(rank, world):
    from vmmkv.ipc import RendezvousError, SymmetricRegion

    g = _gran("host")
    with SymmetricRegion(8 * g, "cpu", backend="host", chunk_bytes=g) as sr:
        return _message_of(lambda: sr.resize((rank + 1) * g), RendezvousError, "unequal resize")


@pytest.mark.timeout(60)
def test_resize_targets_must_be_identical_on_all_ranks():
    msgs = run_world(_resize_mismatch, 2, timeout=30)
    assert msgs[0] == msgs[1] and "identical" in msgs[0]


def _subgroups(rank, world):
    import torch
    import torch.distributed as dist

    from vmmkv.ipc import SymmetricRegion

    pcp, tp = 2, 2
    layout = torch.arange(world).reshape(-1, pcp, tp)
    mine = None
    for d in range(layout.shape[0]):
        for t in range(tp):
            ranks = layout[d, :, t].tolist()
            grp = dist.new_group(ranks, backend="gloo")
            if rank in ranks:
                mine, my_ranks = grp, ranks
    g = _gran("host")
    with SymmetricRegion(4 * g, "cpu", mine, backend="host", initial_bytes=4 * g) as sr:
        assert sr.world_size == 2
        peer = my_ranks[1 - sr.rank]
        sr.view(1 - sr.rank)[:64].fill_(rank + 1)  # tag with the global rank
        dist.barrier(mine)
        got = sr.view(sr.rank)[:64].unique().tolist()
        dist.barrier(mine)
    # Rank 0 hosts the store that both subgroups query: it must not exit (and take the store
    # with it) while the other subgroup is still in its rendezvous (a CI run saw "Broken pipe").
    dist.barrier()
    return my_ranks, peer, got


@pytest.mark.timeout(60)
def test_tp2_pcp2_subgroups_rendezvous_independently_and_never_cross():
    out = run_world(_subgroups, 4, timeout=40)
    groups = {tuple(o[0]) for o in out}
    assert groups == {(0, 2), (1, 3)}
    for rank, (_, peer, got) in enumerate(out):
        assert got == [peer + 1], (rank, peer, got)


def _reject_nccl_like(rank, world):
    from unittest import mock

    from vmmkv.ipc import SymmetricRegion

    with mock.patch("torch.distributed.get_backend", return_value="nccl"):
        return _message_of(
            lambda: SymmetricRegion(1 << 20, "cpu", backend="host"), ValueError, "nccl group"
        )


@pytest.mark.timeout(60)
def test_an_nccl_group_is_rejected_with_advice_to_pass_the_cpu_group():
    msgs = run_world(_reject_nccl_like, 1, timeout=30)
    assert "CPU group" in msgs[0] and "nccl" in msgs[0]


@pytest.mark.timeout(60)
def test_close_at_interpreter_exit_is_clean():
    script = textwrap.dedent(
        """
        import atexit, os, torch.distributed as dist
        dist.init_process_group("gloo", rank=0, world_size=1, init_method="env://")
        from vmmkv.ipc import SymmetricRegion
        sr = SymmetricRegion(1 << 22, "cpu", backend="host", initial_bytes=1 << 21)
        leaked = SymmetricRegion(1 << 22, "cpu", backend="host", initial_bytes=1 << 21)
        atexit.register(sr.close)
        print("ok", flush=True)
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with world_store() as store:  # env:// reads its address from store.env
        proc = subprocess.run(
            [sys.executable, "-c", script],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=50,
            env={**os.environ, "PYTHONPATH": root, **store.env},
        )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
    assert "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr


def _graph_through_ptr_table(rank, world):
    import torch
    import torch.distributed as dist

    from vmmkv import ops
    from vmmkv.ipc import SymmetricRegion
    from vmmkv.ops.kv import KVTarget

    chunk = _gran("cuda")
    row = 1024
    sr = SymmetricRegion(
        4 * chunk, "cuda:0", chunk_bytes=chunk, initial_bytes=chunk, backend="cuda"
    )
    err = torch.zeros(1, dtype=torch.int32, device="cuda:0")
    target = KVTarget(
        kind="rows", ptr_table=sr.ptr_table, my_rank=rank, offset_bytes=0,
        num_blocks=4 * chunk // row, block_size=1, block_stride=row, entry_stride=row,
        entry_bytes=row, committed_bytes=sr.committed_table, error_counter=err,
        cache=sr.view(rank, reserve=True),  # the whole region: slots beyond the commit
    )  # fmt: skip
    bar = ops.DeviceBarrier(sr.peers.signal_table, None, rank, world, 1, "cuda:0")
    first = chunk // row  # the first slot of the second, not yet committed, chunk
    slots = torch.arange(4, device="cuda:0") + first + 4 * rank
    rows = _pattern(rank, 99, 4 * row, "cuda:0").view(4, row)
    ops.warm_up(0)
    bar.arrive_and_wait(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        graph.capture_begin()
        ops.publish_rows(target, rows, slots)
        bar.arrive_and_wait(0)
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(s)

    def check(what):
        own = sr.view(rank)
        for w in range(world):
            got = own[(first + 4 * w) * row : (first + 4 * w + 4) * row]
            want = _pattern(w, 99, 4 * row, "cuda:0")
            assert torch.equal(got, want), f"rank {rank}: {what}: rows of rank {w} wrong"

    sr.resize(2 * chunk)  # grow after capture: the graph's target chunk is now mapped everywhere
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    check("replay after grow")
    sr.resize(chunk)
    sr.resize(2 * chunk)  # new physical memory at the same addresses
    assert int(sr.view(rank)[chunk : 2 * chunk].count_nonzero()) == 0
    dist.barrier()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    check("replay after shrink and regrow")
    assert int(err.item()) == 0
    del graph
    bar.close()
    sr.close()
    return True


@pytest.mark.gpu
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 4])
def test_a_graph_writing_through_ptr_table_replays_into_chunks_grown_after_capture(world):
    assert run_world(_graph_through_ptr_table, world, timeout=150) == [True] * world


def _fabric_probe(rank, world):

    from vmmkv.ipc.peers import select_handle_type

    records = capture_logs()
    import torch.distributed as dist

    return select_handle_type("cuda:0", dist.group.WORLD), records


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_the_fabric_probe_falls_back_to_posix_fds_and_logs_why():
    out = run_world(_fabric_probe, 2, timeout=100)
    for (choice, why), records in out:
        assert choice == "posix_fd"
        assert any("posix_fd" in r and why in r for r in records), (why, records)
        # the lent H200s have no IMEX channel: the trial create is refused, and the reason says so
        assert "fabric unavailable anyway" in why and "rank 0" in why and "rank 1" in why, why


def _mapping_fails_on_one_rank(rank, world):
    g, sr = _region_with_kept_bytes(rank)
    undo = fail_peer_mapping_on(1, rank)
    return _grow_fails_then_recovers(sr, world, 2 * g, 6 * g, undo, "mapping failure")


@pytest.mark.timeout(60)
def test_a_peer_mapping_failure_on_one_rank_rolls_back_every_rank_and_keeps_them_in_step():
    _every_rank_names_the_fault(
        _mapping_fails_on_one_rank, 3, 45, "injected mapping failure", culprit=1
    )


def _bad_request_on_one_rank(rank, world):
    from vmmkv.ipc import RendezvousError, SymmetricRegion

    g = _gran("host")
    out = []
    with SymmetricRegion(8 * g, "cpu", backend="host", chunk_bytes=g, timeout=10) as sr:
        for bad in (16 * g, "4096"):
            try:
                sr.resize(bad if rank == 1 else 2 * g)
            except (RendezvousError, TypeError, ValueError) as exc:
                out.append(f"{type(exc).__name__}: {exc}")
        try:
            sr.resize(2 * g, direction="shrink" if rank == 0 else None)
        except (RendezvousError, ValueError) as exc:
            out.append(f"{type(exc).__name__}: {exc}")
        assert sr.resize(2 * g) == 2 * g  # nobody was left waiting: still in step
    return out


@pytest.mark.timeout(60)
def test_an_invalid_resize_on_one_rank_raises_on_every_rank_without_waiting():
    t0 = time.monotonic()
    out = run_world(_bad_request_on_one_rank, 2, timeout=45)
    assert time.monotonic() - t0 < 40
    assert out[1][0].startswith("ValueError") and "outside" in out[1][0]
    assert out[0][0].startswith("RendezvousError") and "rank 1" in out[0][0]
    assert out[1][1].startswith("TypeError") and out[0][1].startswith("RendezvousError")
    assert out[0][2].startswith("ValueError") and "use grow" in out[0][2]
    assert out[1][2].startswith("RendezvousError") and "rank 0" in out[1][2]


def _out_of_step(rank, world):
    import torch.distributed as dist

    from vmmkv.ipc.comm import GroupError, StoreComm

    comm = StoreComm(dist.group.WORLD, 10)
    msgs = []
    for what in (f"step {rank}", "next"):
        try:
            comm.barrier(what)
        except GroupError as exc:
            msgs.append(str(exc))
    return msgs


@pytest.mark.timeout(60)
def test_ranks_at_different_collective_steps_are_detected_and_the_object_refuses_more():
    out = run_world(_out_of_step, 2, timeout=45)
    for msgs in out:
        assert "out of step" in msgs[0] and "'step 0'" in msgs[0] and "'step 1'" in msgs[0]
        assert "refused" in msgs[1]
