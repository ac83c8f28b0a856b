"""The collective protocols end every step with one outcome on every rank (review 2026-11-30,
F1-F4, F6, F7, F12, F14, F15): late ranks, local failures before or inside the fd exchange,
skewed namespaces, mismatched modes and foreign PID namespaces. Host backend, spawned ranks.

After every injected failure the group either all succeeded or all raised, and a following
resize works on every rank (unless the protocol says the object is unusable, as after a failed
shrink, in which case every rank says so).
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tests.helpers import fail_peer_mapping_on
from vmmkv.testing.spawn import run_world, world_store

TIMEOUT = 3.0


def _gran() -> int:
    return os.sysconf("SC_PAGE_SIZE")


def _region(**kw):
    from vmmkv.ipc import SymmetricRegion

    g = _gran()
    opts = dict(chunk_bytes=g, initial_bytes=2 * g, timeout=TIMEOUT)
    opts.update(kw)
    return SymmetricRegion(16 * g, "cpu", backend="host", **opts)


def _outcome(fn):
    """('ok', value) or ('raised', 'Type: message')."""
    try:
        return ("ok", fn())
    except Exception as exc:
        return ("raised", f"{type(exc).__name__}: {exc}")


def _fill_own(sr, rank):
    g = _gran()
    sr.view(rank)[: 2 * g].fill_(rank + 1)


def _replicas_intact(sr, world, kept):
    import torch

    return all(
        torch.equal(sr.view(r)[:kept], torch.full((kept,), r + 1, dtype=torch.uint8))
        for r in range(world)
    )


def _regrow_and_close(sr, world):
    """After an injected failure: grow to 8 granules again (its outcome), check that every rank's
    first 2 granules (filled by ``_fill_own``) are intact in every replica, then close."""
    g = _gran()
    second = _outcome(lambda: sr.resize(8 * g))
    intact = _replicas_intact(sr, world, 2 * g)
    sr.close()
    return second, intact


def _assert_failed_on_the_last_rank_then_usable(first, second, intact, world, cause):
    """One rank's outcomes of a grow that failed on the last rank (``cause``) and of the regrow
    after it (``_regrow_and_close``): the failure named that rank and its cause on this rank
    too; the regrow to 8 granules succeeded, every rank's rows intact in every replica."""
    assert first[0] == "raised", first
    assert f"ranks [{world - 1}]" in first[1] and cause in first[1], first
    assert second == ("ok", 8 * _gran()), second
    assert intact


def _stall_once(cls, name, rank_to_stall, rank, seconds):
    """Make ``cls.name`` sleep ``seconds`` once on ``rank_to_stall`` (a preempted rank)."""
    real = getattr(cls, name)
    state = {"done": rank != rank_to_stall}

    def slow(self, *a, **k):
        if not state["done"]:
            state["done"] = True
            time.sleep(seconds)
        return real(self, *a, **k)

    setattr(cls, name, slow)
    return lambda: setattr(cls, name, real)


# --------------------------------------------------------------------------------------------
# a late rank adopts the abort of its peers
# --------------------------------------------------------------------------------------------


def _late_at_grow_agreement(rank, world):
    from vmmkv.alloc import PeerRegion

    g = _gran()
    sr = _region()
    _fill_own(sr, rank)
    undo = _stall_once(PeerRegion, "map_fd", world - 1, rank, TIMEOUT + 2)
    try:
        first = _outcome(lambda: sr.resize(8 * g))
    finally:
        undo()
    state = (sr.committed_bytes, int(sr.committed_table.item()))
    mapped = [sr.peers.mapped_bytes(r) for r in range(world)]
    time.sleep(TIMEOUT)  # the late rank raises ~2 s after the others
    second, intact = _regrow_and_close(sr, world)
    return first, state, mapped, second, intact


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_late_at_the_last_grow_agreement_rolls_back_like_its_peers(world):
    g = _gran()
    out = run_world(_late_at_grow_agreement, world, timeout=60)
    for rank, (first, state, mapped, second, intact) in enumerate(out):
        _assert_failed_on_the_last_rank_then_usable(first, second, intact, world, "did not arrive")
        assert state == (2 * g, 2 * g), (rank, state)  # the late rank kept nothing either
        assert mapped == [2 * g] * world, (rank, mapped)


def _late_at_rendezvous(rank, world):
    from vmmkv.alloc import PeerRegion

    undo = _stall_once(PeerRegion, "map_fd", 1, rank, TIMEOUT + 2)
    try:
        first = _outcome(lambda: _region().close())
    finally:
        undo()
    time.sleep(TIMEOUT)
    second = _outcome(lambda: _region().close())
    return first, second


@pytest.mark.timeout(90)
def test_a_rank_late_at_the_rendezvous_agreement_raises_like_its_peer_and_both_retry():
    out = run_world(_late_at_rendezvous, 2, timeout=60)
    for first, second in out:
        assert first[0] == "raised" and "ranks [1]" in first[1], out
        assert second == ("ok", None), out


def _late_at_shrink_agreement(rank, world):
    from vmmkv.alloc import PeerRegion

    g = _gran()
    sr = _region(initial_bytes=8 * g)
    undo = _stall_once(PeerRegion, "unmap_from", 1, rank, TIMEOUT + 2)
    try:
        first = _outcome(lambda: sr.resize(2 * g))
    finally:
        undo()
    time.sleep(TIMEOUT)
    second = _outcome(lambda: sr.resize(4 * g))
    bound = int(sr.committed_table.item())
    sr.close()
    return first, second, bound


@pytest.mark.timeout(90)
def test_a_rank_late_at_the_shrink_agreement_fails_on_every_rank_and_both_refuse_more():
    g = _gran()
    out = run_world(_late_at_shrink_agreement, 2, timeout=60)
    for first, second, bound in out:
        assert first[0] == "raised" and "ranks [1]" in first[1], out
        assert second[0] == "raised" and "unusable after a failed shrink" in second[1], out
        assert bound == 2 * g  # the lowered bound stays: nothing writes beyond it


def _store_comm_late(rank, world):
    import torch.distributed as dist

    from vmmkv.ipc.comm import StoreComm

    comm = StoreComm(dist.group.WORLD, TIMEOUT)
    if rank == 1:
        time.sleep(TIMEOUT + 1.5)
    first = _outcome(lambda: comm.all_gather(rank, "step a"))
    if rank == 0:
        time.sleep(2.0)
    second = _outcome(lambda: comm.all_gather(rank * 10, "step b"))
    return first, second


@pytest.mark.timeout(60)
def test_a_late_rank_reads_the_abort_of_the_step_and_the_next_step_lines_up():
    out = run_world(_store_comm_late, 2, timeout=40)
    for first, second in out:
        assert first[0] == "raised" and "PeerTimeoutError" in first[1] and "[1]" in first[1]
        assert second == ("ok", [0, 10])


def _abort_releases(rank, world):
    import torch.distributed as dist

    from vmmkv.ipc.comm import StoreComm

    comm = StoreComm(dist.group.WORLD, 30)
    t0 = time.monotonic()
    if rank == 0:
        res = _outcome(lambda: comm.all_gather(None, "x", abort="my exchange timed out"))
    else:
        res = _outcome(lambda: comm.all_gather(None, "x"))
    return res, time.monotonic() - t0, _outcome(lambda: comm.barrier("after"))


@pytest.mark.timeout(60)
def test_an_aborted_step_releases_every_waiting_rank_at_once_with_the_reason():
    out = run_world(_abort_releases, 3, timeout=40)
    for res, elapsed, after in out:
        assert res[0] == "raised" and "StepAborted" in res[1]
        assert "aborted by rank 0: my exchange timed out" in res[1]
        assert elapsed < 5, elapsed  # the timeout is 30 s
        assert after == ("ok", None)


# --------------------------------------------------------------------------------------------
# local failures before or inside the exchange join the agreement
# --------------------------------------------------------------------------------------------


def _export_fails(rank, world):
    g = _gran()
    sr = _region(timeout=10.0)
    _fill_own(sr, rank)
    if rank == world - 1:
        real = sr.region.export_chunk

        def emfile(chunk):
            raise OSError(errno.EMFILE, "Too many open files (injected)")

        sr.region.export_chunk = emfile
    t0 = time.monotonic()
    first = _outcome(lambda: sr.resize(8 * g))
    elapsed = time.monotonic() - t0
    if rank == world - 1:
        sr.region.export_chunk = real
    state = (sr.committed_bytes, [sr.peers.mapped_bytes(r) for r in range(world)])
    second, intact = _regrow_and_close(sr, world)
    return first, elapsed, state, second, intact


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, 3])
def test_an_export_failure_on_one_rank_fails_every_rank_fast_naming_it(world):
    g = _gran()
    out = run_world(_export_fails, world, timeout=60)
    for first, elapsed, state, second, intact in out:
        cause = "Too many open files (injected)"
        _assert_failed_on_the_last_rank_then_usable(first, second, intact, world, cause)
        assert elapsed < 5, elapsed  # the timeout is 10 s: nobody waited for it
        assert state == (2 * g, [2 * g] * world)


def _socket_fails(rank, world):
    g = _gran()
    sr = _region(timeout=10.0)
    if rank == 1:
        real = socket.socket
        calls = {"n": 0}

        class Flaky(real):
            def __init__(self, *a, **k):
                calls["n"] += 1
                if calls["n"] == 2:  # the first outgoing connection of the next exchange
                    raise OSError(errno.EMFILE, "Too many open files (injected)")
                super().__init__(*a, **k)

        socket.socket = Flaky
    first = _outcome(lambda: sr.resize(8 * g))
    if rank == 1:
        socket.socket = real
    second = _outcome(lambda: sr.resize(8 * g))
    sr.close()
    return first, second


@pytest.mark.timeout(90)
def test_a_local_socket_error_in_the_exchange_fails_every_rank_and_the_group_stays_usable():
    g = _gran()
    out = run_world(_socket_fails, 2, timeout=60)
    for first, second in out:
        assert first[0] == "raised" and "Too many open files (injected)" in first[1], out
        assert second == ("ok", 8 * g), out


def test_exchange_fds_reports_a_local_socket_failure_as_fd_exchange_error(monkeypatch):
    from vmmkv.ipc import fdpass

    real = socket.socket
    calls = {"n": 0}

    class Flaky(real):
        def __init__(self, *a, **k):
            calls["n"] += 1
            if calls["n"] == 2:  # 1st: the listener, 2nd: the first outgoing connection
                raise OSError(errno.EMFILE, "Too many open files")
            super().__init__(*a, **k)

    monkeypatch.setattr(socket, "socket", Flaky)
    fd = os.memfd_create("x")
    try:
        with pytest.raises(fdpass.FdExchangeError, match="failed locally.*Too many open files"):
            fdpass.exchange_fds(
                rank=0, nonce="r10", outgoing={1: (b"", [fd])}, expect_from=[],
                pids=[os.getpid(), 1], timeout=2,
            )  # fmt: skip
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------
# namespaces cannot skew
# --------------------------------------------------------------------------------------------


def _early_failure_then_retry(rank, world):
    g = _gran()
    results = []
    for attempt in range(2):
        if attempt == 0 and rank == 1:  # e.g. a malformed setting on one node, fixed later
            results.append(("raised", "ValueError: before any collective"))
            time.sleep(TIMEOUT + 1.5)
            continue
        results.append(_outcome(lambda: _region().close()))
    with _region() as sr:
        results.append(_outcome(lambda: sr.resize(4 * g)))
    return results


@pytest.mark.timeout(90)
def test_a_rank_that_failed_before_any_collective_does_not_skew_the_next_attempt():
    g = _gran()
    out = run_world(_early_failure_then_retry, 2, timeout=60)
    assert out[0][0][0] == "raised" and "ranks [1]" in out[0][0][1], out
    for results in out:
        assert results[1] == ("ok", None), out
        assert results[2] == ("ok", 4 * g), out


# --------------------------------------------------------------------------------------------
# mode and settings agreed once; auto falls back together
# --------------------------------------------------------------------------------------------


def _mode_mismatch(rank, world, field):
    t0 = time.monotonic()
    kw = {"peers": "off" if rank == 0 else "auto"}
    if field == "must_match":
        kw = {"must_match": {"lanes": rank + 1}}
    res = _outcome(lambda: _region(timeout=10.0, **kw).close())
    return res, time.monotonic() - t0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("field", ["peers", "must_match"])
def test_mismatched_modes_raise_the_same_error_on_every_rank_at_once(field):
    out = run_world(_mode_mismatch, 2, args=(field,), timeout=40)
    key = "peers" if field == "peers" else "lanes"
    msgs = [res[1].split("): ", 1)[1] for res, _ in out]
    for res, elapsed in out:
        assert res[0] == "raised" and res[1].startswith("ConfigMismatch"), out
        assert f"{key} differs" in res[1] and "ranks [0]" in res[1] and "ranks [1]" in res[1]
        assert elapsed < 5
    assert msgs[0] == msgs[1]


def _mapping_fails_auto(rank, world, mode):
    undo = fail_peer_mapping_on(1, rank)
    try:
        res = _outcome(lambda: _region(peers=mode))
    finally:
        undo()
    if res[0] == "raised":
        return res
    sr = res[1]
    g = _gran()
    out = ("ok", sr.mapped, sr.why_not_mapped, sr.resize(6 * g))
    sr.close()
    return out


@pytest.mark.timeout(60)
def test_auto_mode_falls_back_together_when_a_peer_mapping_fails():
    g = _gran()
    out = run_world(_mapping_fails_auto, 2, args=("auto",), timeout=40)
    for res in out:
        assert res[0] == "ok" and res[1] is False, out
        assert "injected mapping failure" in res[2] and "ranks [1]" in res[2], out
        assert res[3] == 6 * g
    assert out[0][2] == out[1][2]


@pytest.mark.timeout(60)
def test_require_mode_raises_on_every_rank_when_a_peer_mapping_fails():
    out = run_world(_mapping_fails_auto, 2, args=("require",), timeout=40)
    for res in out:
        assert res[0] == "raised" and "injected mapping failure" in res[1], out


_PIDNS_RANK = textwrap.dedent(
    """
    import json, os, sys, time
    from datetime import timedelta
    import torch.distributed as dist
    rank, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            init_method=f"tcp://127.0.0.1:{port}", timeout=timedelta(seconds=30))
    from vmmkv.ipc import SymmetricRegion
    g = os.sysconf("SC_PAGE_SIZE")
    dist.barrier()  # both ranks started and imported: time the region's setup only
    t0 = time.monotonic()
    try:
        sr = SymmetricRegion(8 * g, "cpu", backend="host", chunk_bytes=g, initial_bytes=g,
                             timeout=20, peers=mode)
        out = ["ok", sr.mapped, sr.why_not_mapped]
        sr.close()
    except Exception as exc:
        out = ["raised", type(exc).__name__, str(exc)]
    print(json.dumps(out + [time.monotonic() - t0]), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    """
)


def _unshare_pid_works() -> str:
    if shutil.which("unshare") is None:
        return "no unshare binary"
    res = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, timeout=10)
    return "" if res.returncode == 0 else f"unshare --pid refused: {res.stderr.decode()[:200]}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["auto", "require"])
def test_ranks_in_different_pid_namespaces_are_detected_up_front(mode):
    why = _unshare_pid_works()
    if why:
        pytest.skip(f"needs a new PID namespace: {why}")
    path = os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")
    cmd = [sys.executable, "-c", _PIDNS_RANK]
    with world_store() as store:
        env = dict(os.environ, PYTHONPATH=path, **store.env)
        port = str(store.port)
        procs = [
            subprocess.Popen(cmd + ["0", port, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env),
            subprocess.Popen(
                ["unshare", "--pid", "--fork"] + cmd + ["1", port, mode],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
            ),
        ]  # fmt: skip
        runs = [(p.communicate(timeout=100), p.returncode) for p in procs]
    import json

    from tests.helpers import last_line

    outs = [last_line(r, rc, out, err) for r, ((out, err), rc) in enumerate(runs)]
    results = [json.loads(o) for o in outs]
    for res in results:
        if mode == "auto":
            assert res[0] == "ok" and res[1] is False, results
            assert "different PID namespaces" in res[2], results
        else:
            assert res[0] == "raised" and res[1] == "DirectUnsupported", results
            assert "different PID namespaces" in res[2], results
    # detected, not timed out: each rank's setup (after start-up and imports, which a loaded
    # machine stretches) ends before the region's timeout of 20 s
    assert all(res[3] < 20 for res in results), results


# --------------------------------------------------------------------------------------------
# exchange names are fresh per exchange; a squatter is named
# --------------------------------------------------------------------------------------------


def _nonces(rank, world):
    from vmmkv.ipc import fdpass

    seen = []
    real = fdpass.exchange_fds

    def spy(**kw):
        seen.append(kw["nonce"])
        return real(**kw)

    fdpass.exchange_fds = spy
    g = _gran()
    with _region() as sr:
        sr.resize(4 * g)
        sr.resize(6 * g)
    fdpass.exchange_fds = real
    return seen


def test_every_exchange_uses_a_fresh_unpredictable_socket_name():
    out = run_world(_nonces, 2, timeout=40)
    # rendezvous, two grows; each in two rounds (descriptions, then one round of handles)
    assert out[0] == out[1] and len(out[0]) == 6 and len(set(out[0])) == 6
    fresh = [n.rsplit("-", 1) for n in out[0]]
    assert [r for _, r in fresh] == ["0", "1"] * 3
    assert len({n for n, _ in fresh}) == 3  # one fresh nonce per exchange
    assert all(len(n) >= 32 for n, _ in fresh)  # 128 random bits, nothing derived from a step


def test_a_squatted_socket_name_fails_at_once_naming_the_squatter():
    from vmmkv.ipc import fdpass

    nonce = "squatted0123"
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(fdpass.socket_name(nonce, 0))
    squatter.listen(1)
    try:
        t0 = time.monotonic()
        with pytest.raises(fdpass.FdExchangeError, match=f"held by pids \\[{os.getpid()}\\]"):
            fdpass.exchange_fds(
                rank=0, nonce=nonce, outgoing={}, expect_from=[1],
                pids=[os.getpid(), 1], timeout=5,
            )  # fmt: skip
        assert time.monotonic() - t0 < 1
    finally:
        squatter.close()


# --------------------------------------------------------------------------------------------
# F12, F14, F15
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a sender as another uid")
def test_a_sender_of_another_uid_is_refused_even_with_a_member_pid():
    from vmmkv.ipc import fdpass

    nonce = "uidcheck01"
    child_pid = os.fork()
    if child_pid == 0:  # the sender: a group member's pid, another user
        try:
            os.setgid(65534)
            os.setuid(65534)
            fd = os.memfd_create("x") if hasattr(os, "memfd_create") else os.open("/", 0)
            fdpass.exchange_fds(
                rank=1, nonce=nonce, outgoing={0: (b"hi", [fd])}, expect_from=[],
                pids=[os.getppid(), os.getpid()], timeout=3,
            )  # fmt: skip
        except BaseException:
            pass
        os._exit(0)
    try:
        with pytest.raises(
            fdpass.FdExchangeError, match="still expecting messages from ranks \\[1\\]"
        ):
            fdpass.exchange_fds(
                rank=0, nonce=nonce, outgoing={}, expect_from=[1],
                pids=[os.getpid(), child_pid], timeout=2,
            )  # fmt: skip
    finally:
        os.waitpid(child_pid, 0)


def test_the_fd_limit_is_raised_for_an_exchange_and_restored_after():
    import resource

    from vmmkv.ipc.transports import _raise_fd_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < soft + 256:
        pytest.skip(f"hard limit {hard} leaves no room above the soft limit {soft}")
    restore = _raise_fd_limit(soft + 128)
    try:
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] > soft
    finally:
        restore()
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (soft, hard)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), True, 0, -1.0, "3"])
def test_store_comm_rejects_timeouts_that_are_not_finite_positive_numbers(bad):
    from vmmkv.ipc.comm import StoreComm

    with pytest.raises((TypeError, ValueError), match="timeout"):
        StoreComm(None, bad)


def test_a_request_naming_the_same_process_twice_is_rejected():
    from vmmkv.ipc.peers import _validate_requests

    base = {
        "protocol": 2, "backend": "host", "capacity_bytes": 1, "chunk_bytes": 1, "run_bytes": 1,
        "granularity": 1, "handle_type": "posix_fd", "chunks": [], "signal_bytes": 1,
        "must_match": {}, "pid": 42, "boot_id": "b", "pidns": "1",
    }  # fmt: skip
    assert "same process" in _validate_requests([dict(base), dict(base)])
    assert _validate_requests([dict(base), dict(base, pid=43)]) == ""
