"""The open-file budget of an fd exchange (``vmmkv.ipc.fdbudget``) and the exchange in rounds
(``vmmkv.ipc.exchange.exchange_and_map``), on the host backend: a DeepSeek-V3.2 cache of thousands
of chunks starts, sleeps and wakes under a low hard limit; each round carries at most the agreed
number of fds; a limit that cannot hold a step is refused before anything is committed, the same
on every rank; a failure in a late round fails every rank and leaves the group usable."""

from __future__ import annotations

import os
import resource
import sys

import pytest

from vmmkv.testing.spawn import run_world

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

KiB = 1 << 10


# --------------------------------------------------------------------------------------------
# the budget itself (pure: the limits and the open-fd count are given)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def limits(monkeypatch):
    from vmmkv.ipc import fdbudget

    state = {"soft": 1024, "hard": 4096, "open": 100}
    monkeypatch.setattr(fdbudget, "_limits", lambda: (state["soft"], state["hard"]))
    monkeypatch.setattr(fdbudget, "open_fds", lambda: state["open"])
    return state


def test_a_round_is_the_full_256_fds_when_the_hard_limit_has_room(limits):
    from vmmkv.ipc import fdbudget

    assert fdbudget.exchange_round(rank=0, world=8, device="cpu", what="grow", runs=12800) == 256
    limits["hard"] = resource.RLIM_INFINITY
    assert fdbudget.exchange_round(rank=0, world=8, device="cpu", what="grow", runs=1) == 256


def test_a_round_shrinks_to_what_the_hard_limit_leaves_and_kept_fds_count(limits):
    from vmmkv.ipc import fdbudget

    # 4096 - 100 open - 2000 kept - 16 sockets - 64 spare = 1916 free over 8 ranks: 239 each
    got = fdbudget.exchange_round(rank=0, world=8, device="cpu", what="grow", runs=2000,
                                  kept=2000)  # fmt: skip
    assert got == (4096 - 100 - 2000 - 16 - 64) // 8 == 239


def test_a_limit_that_cannot_hold_the_smallest_round_is_refused_naming_everything(limits):
    from vmmkv.ipc import fdbudget

    with pytest.raises(fdbudget.FdBudgetError) as err:
        fdbudget.exchange_round(rank=3, world=4, device="cuda:1", what="grow to 9 blocks",
                                runs=9013, kept=3900)  # fmt: skip
    msg = str(err.value)
    need = 100 + 3900 + 8 + 64 + 4 * fdbudget.MIN_ROUND
    for part in ("rank 3", "cuda:1", "grow to 9 blocks", "9013 runs", "4 ranks",
                 f"need {need}", "hard RLIMIT_NOFILE of 4096", "ulimit -Hn", "chunk_bytes"):  # fmt: skip
        assert part in msg, (part, msg)


def test_kept_fds_raise_the_soft_limit_up_to_the_hard_one_and_never_past_it(limits, monkeypatch):
    from vmmkv.ipc import fdbudget

    calls = []
    monkeypatch.setattr(fdbudget.resource, "setrlimit", lambda what, lim: calls.append(lim))
    fdbudget.keep_fds(rank=0, device="cpu", what="grow", count=500)  # 100 + 500 + 64 <= 1024
    assert calls == []
    fdbudget.keep_fds(rank=0, device="cpu", what="grow", count=2000)
    assert calls == [(100 + 2000 + 64, 4096)]
    with pytest.raises(fdbudget.FdBudgetError, match=r"rank 0 \(cpu\): grow: keeping 5000"):
        fdbudget.keep_fds(rank=0, device="cpu", what="grow", count=5000)


# --------------------------------------------------------------------------------------------
# a DeepSeek-V3.2 cache of thousands of chunks under a low hard limit (benchmarks/bench_scale)
# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world,nofile,layout", [(2, 4096, "LBNHC"), (4, 4096, "BLNHC"),
                                                 (4, 8192, "LBNHC")])  # fmt: skip
def test_a_deepseek_cache_of_thousands_of_chunks_starts_sleeps_and_wakes_under_the_limit(
    world, nofile, layout
):
    """61 layers, 48 blocks, 64 KiB chunks: 2254 chunks per rank, each rank keeping one memfd
    per own chunk (host backend) and exchanging 2254 x (world - 1) fds per grow. Before the
    exchange ran in rounds, every such grow needed world x 2254 fds at once."""
    import bench_scale

    cfg = dict(gib=0, blocks=48, layout=layout, chunk="0.0625", nofile=nofile, tokens=64,
               backend="host", timeout=120.0)  # fmt: skip
    out = run_world(bench_scale.rank_main, world, args=(cfg,), timeout=220)
    for r in out:
        assert r["chunks"] == 2254 and r["nofile"] == nofile, r
        full = 61 * 48 * (64 * 656 + 64 * 132) / (1 << 30)  # every block, page-rounded
        for step in ("start", "sleep", "wake"):
            assert r[step]["error"] == "", (step, r)
            committed = r[step]["committed_GiB"]
            assert (committed == 0) if step == "sleep" else (full <= committed < full + 1e-4)
            assert r[step]["peak_fds"] < nofile, (step, r)
        assert r["bad_bytes"] == 0, r  # two layers' stores from every rank, byte-exact
    # the wake's peak: the kept memfds plus rounds of at most 256 fds from each peer
    assert max(r["wake"]["peak_fds"] for r in out) <= 2254 + world * 256 + 2 * world + 200


# --------------------------------------------------------------------------------------------
# rounds, refusals, a failure in a late round
# --------------------------------------------------------------------------------------------


def _region(chunks, chunk=4 * KiB, initial=0):
    import torch.distributed as dist

    from vmmkv.ipc import SymmetricRegion

    return SymmetricRegion(chunks * chunk, "cpu", dist.group.WORLD, chunk_bytes=chunk,
                           initial_bytes=initial, backend="host", timeout=30)  # fmt: skip


def _rounds(rank, world, chunks, round_fds):
    """Grow 0 -> ``chunks`` chunks with rounds of ``round_fds``; what each round carried."""
    from vmmkv.ipc import fdbudget, transports

    fdbudget.ROUND = round_fds
    seen = []
    real = transports._FdTransport.exchange

    def spy(self, body, handles, others, per_peer, *, round_no):
        got = real(self, body, handles, others, per_peer, round_no=round_no)
        seen.append((round_no, len(handles), [len(got[p][1]) for p in sorted(got)]))
        return got

    transports._FdTransport.exchange = spy
    with _region(chunks) as sr:
        seen.clear()  # the rendezvous' own rounds (one signal chunk)
        sr.resize(chunks * 4 * KiB)
        filled = [sr.peers.mapped_bytes(r) for r in range(world)]
    return seen, filled


def test_an_exchange_sends_at_most_one_round_of_fds_per_peer_at_a_time():
    out = run_world(_rounds, 3, args=(50, 8), timeout=60)
    for seen, filled in out:
        assert filled == [50 * 4 * KiB] * 3
        # round 0: descriptions only; then ceil(50 / 8) = 7 rounds of 8, 8, ..., 2 fds each way
        assert [r for r, _, _ in seen] == list(range(8))
        assert seen[0][1:] == (0, [0, 0])
        sizes = [8] * 6 + [2]
        assert [(n, got) for _, n, got in seen[1:]] == [(s, [s, s]) for s in sizes]


def _refused_at_setup(rank, world, chunks, nofile):
    from vmmkv.ipc import RendezvousError

    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    try:
        _region(chunks)
    except RendezvousError as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


def test_a_hard_limit_that_cannot_hold_a_full_grow_is_refused_at_setup_on_every_rank():
    """Host backend: 3000 chunks keep 3000 memfds once committed; a hard limit of 2048 refuses
    the region before anything is committed, every rank naming the cause."""
    out = run_world(_refused_at_setup, 2, args=(3000, 2048), timeout=60)
    for kind, msg in out:
        assert kind in ("RendezvousError", "RendezvousValueError"), (kind, msg)
        assert "FdBudgetError" in msg or "hard RLIMIT_NOFILE of 2048" in msg, msg
        assert "3000 runs" in msg and "ulimit -Hn" in msg, msg


def _refused_at_grow(rank, world):
    from vmmkv.alloc import host
    from vmmkv.ipc import RendezvousError

    with _region(3000, initial=8 * 4 * KiB) as sr:
        before = len(os.listdir("/proc/self/fd"))
        # lowered after setup (e.g. by the engine): 300 more kept fds cannot fit any more
        resource.setrlimit(resource.RLIMIT_NOFILE, (before + 200, before + 200))
        try:
            sr.resize(308 * 4 * KiB)
            err = "no error"
        except RendezvousError as exc:
            err = str(exc)
        after = (sr.committed_bytes, [sr.peers.mapped_bytes(r) for r in range(world)])
        reservations = len(host.reservations())
        sr.resize(100 * 4 * KiB)  # a grow that fits still works afterwards
        grown = sr.committed_bytes
    return err, after, grown, reservations


def test_a_grow_past_the_hard_limit_is_refused_before_committing_and_the_next_one_works():
    out = run_world(_refused_at_grow, 2, timeout=60)
    for err, (committed, mapped), grown, _ in out:
        assert "keeping 300 more open files" in err or "300 runs" in err, err
        assert "rank 0" in err or "rank 1" in err
        assert committed == 8 * 4 * KiB and mapped == [8 * 4 * KiB] * 2
        assert grown == 100 * 4 * KiB


def _late_failure(rank, world):
    """Rounds of 4 fds; rank 1's 10th peer mapping fails (the second of four rounds)."""
    from vmmkv.alloc import PeerRegion
    from vmmkv.ipc import RendezvousError, fdbudget

    fdbudget.ROUND = 4
    with _region(20, initial=4 * 4 * KiB) as sr:
        fds0 = len(os.listdir("/proc/self/fd"))
        real, calls = PeerRegion.map_fd, []

        def failing(self, fd, chunk):
            calls.append(chunk)
            if rank == 1 and len(calls) == 10:
                raise OSError(28, "injected mapping failure")
            return real(self, fd, chunk)

        PeerRegion.map_fd = failing
        try:
            sr.resize(20 * 4 * KiB)
            err = "no error"
        except RendezvousError as exc:
            err = str(exc)
        PeerRegion.map_fd = real
        state = (sr.committed_bytes, [sr.peers.mapped_bytes(r) for r in range(world)])
        leaked = len(os.listdir("/proc/self/fd")) - fds0
        sr.resize(20 * 4 * KiB)  # the group is usable again
        return err, state, leaked, [sr.peers.mapped_bytes(r) for r in range(world)]


def test_a_mapping_failure_in_a_late_round_fails_every_rank_and_rolls_back():
    out = run_world(_late_failure, 3, timeout=60)
    for rank, (err, state, leaked, regrown) in enumerate(out):
        assert "rank 1" in err and "injected mapping failure" in err, (rank, err)
        assert state == (4 * 4 * KiB, [4 * 4 * KiB] * 3), (rank, state)
        assert leaked == 0, (rank, leaked)
        assert regrown == [20 * 4 * KiB] * 3, (rank, regrown)
