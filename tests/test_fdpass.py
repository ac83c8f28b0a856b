"""vmmkv.ipc.fdpass: fd exchange over abstract Unix sockets, GPU-free, in spawned processes.

Ranks learn each other's pids through files in a per-test directory (no process group needed).
Every worker compares its ``/proc/self/fd`` count before and after, on success and on error.
"""

from __future__ import annotations

import fcntl
import logging
import os
import pickle
import random
import re
import resource
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from vmmkv.ipc import fdpass
from vmmkv.ipc.fdpass import FdExchangeError, exchange_fds, socket_name
from vmmkv.testing.spawn import STDERR_TAIL_LINES, run_world, run_world_raw

OK_TIMEOUT = 15.0


# ----------------------------------------------------------------------------- helpers


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _nonce() -> str:
    return uuid.uuid4().hex


def _signal(rundir: str, name: str, text: str = "") -> None:
    tmp = Path(rundir, f".{name}.{os.getpid()}")
    tmp.write_text(text)
    tmp.rename(Path(rundir, name))


def _wait_for(rundir: str, name: str, timeout: float = 10.0) -> str:
    path = Path(rundir, name)
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} did not appear in {rundir} within {timeout}s")
        time.sleep(0.01)
    return path.read_text()


def _gather_pids(rundir: str, rank: int, world: int) -> list[int]:
    _signal(rundir, f"pid{rank}", str(os.getpid()))
    return [int(_wait_for(rundir, f"pid{r}")) for r in range(world)]


def _content(src: int, dst: int, index: int, size: int = 4096) -> bytes:
    tag = f"from {src} to {dst} #{index};".encode()
    return tag + random.Random(f"{src}/{dst}/{index}").randbytes(size)


def _payload(src: int, dst: int, size: int = 64) -> bytes:
    return f"payload {src}->{dst}:".encode() + random.Random(f"p{src}/{dst}").randbytes(size)


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("vmmkv-test")
    os.write(fd, data)
    return fd


def _read_all(fd: int) -> bytes:
    return os.pread(fd, os.fstat(fd).st_size, 0)


def _close_all(fds) -> None:
    for fd in fds:
        os.close(fd)


class _Warnings(logging.Handler):
    """Collects the warnings fdpass logs in this process."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        logging.getLogger(fdpass.__name__).addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _forge(
    nonce: str,
    to_rank: int,
    *,
    claim_rank: int,
    header_nonce: str | None = None,
    with_fd: bool = True,
    timeout: float = 10.0,
) -> str:
    """Send a hand-made message to ``to_rank``; return "acked", "refused" or "never connected"."""
    header = fdpass._HEADER.pack(
        fdpass._MAGIC,
        fdpass.PROTOCOL_VERSION,
        0,
        claim_rank,
        to_rank,
        len(b"forged"),
        1 if with_fd else 0,
        (header_nonce or nonce).encode(),
    )
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        while sock.connect_ex(socket_name(nonce, to_rank)) != 0:
            if time.monotonic() > deadline:
                return "never connected"
            time.sleep(0.01)
        sock.settimeout(timeout)
        try:
            sock.sendall(header + b"forged")
            if with_fd:
                fd = _memfd(b"forged fd")
                try:
                    sock.sendmsg(
                        [fdpass._BATCH.pack(1)],
                        [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fd.to_bytes(4, sys.byteorder))],
                    )
                finally:
                    os.close(fd)
            reply = sock.recv(1)
        except (BrokenPipeError, ConnectionResetError):
            return "refused"
    return "acked" if reply else "refused"


# ----------------------------------------------------------------------------- workers


def _send_to_rank0(rank, nonce, fds, pids):
    """Send ``fds`` with this rank's payload to rank 0, expecting nothing back."""
    return exchange_fds(
        rank=rank,
        nonce=nonce,
        outgoing={0: (_payload(rank, 0), fds)},
        expect_from=[],
        pids=pids,
        timeout=OK_TIMEOUT,
    )


def _full_exchange_worker(rank, world, rundir, nonce, fds_per_peer):
    pids = _gather_pids(rundir, rank, world)
    peers = [p for p in range(world) if p != rank]
    baseline = _fd_count()
    mine = {p: [_memfd(_content(rank, p, i)) for i in range(fds_per_peer)] for p in peers}
    got = exchange_fds(
        rank=rank,
        nonce=nonce,
        outgoing={p: (_payload(rank, p), mine[p]) for p in peers},
        expect_from=peers,
        pids=pids,
        timeout=OK_TIMEOUT,
    )
    for fds in mine.values():  # exchange_fds never closes the caller's fds
        for fd in fds:
            os.fstat(fd)
    assert sorted(got) == peers
    for src, (payload, fds) in got.items():
        assert payload == _payload(src, rank)
        assert len(fds) == fds_per_peer
        for index, fd in enumerate(fds):
            assert _read_all(fd) == _content(src, rank, index)
            assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        _close_all(fds)
    for fds in mine.values():
        _close_all(fds)
    return _fd_count() - baseline


def _one_way_worker(rank, world, rundir, nonce, payload, fd_count):
    pids = _gather_pids(rundir, rank, world)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 3 * fd_count:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 3 * fd_count + 100), hard))
    baseline = _fd_count()
    if rank == 0:
        fds = [_memfd(_content(0, 1, i, size=16)) for i in range(fd_count)]
        got = exchange_fds(
            rank=0,
            nonce=nonce,
            outgoing={1: (payload, fds)},
            expect_from=[],
            pids=pids,
            timeout=OK_TIMEOUT,
        )
        assert got == {}
        _close_all(fds)
    else:
        got = exchange_fds(
            rank=1, nonce=nonce, outgoing={}, expect_from=[0], pids=pids, timeout=OK_TIMEOUT
        )
        assert list(got) == [0]
        received_payload, fds = got[0]
        assert received_payload == payload
        assert len(fds) == fd_count
        for index, fd in enumerate(fds):  # order is preserved across batches
            assert _read_all(fd) == _content(0, 1, index, size=16)
        _close_all(fds)
    return _fd_count() - baseline


def _forgery_worker(rank, world, rundir, nonce, case):
    """Rank 0 receives from rank 1 (and, for "duplicate", rank 2); a forger tries its luck."""
    pids = _gather_pids(rundir, rank, world)
    group = pids[:2] if case in ("outsider", "test process") else pids
    baseline = _fd_count()
    if rank == 0:
        warnings = _Warnings()
        expect = [1, 2] if case == "duplicate" else [1]
        got = exchange_fds(
            rank=0, nonce=nonce, outgoing={}, expect_from=expect, pids=group, timeout=OK_TIMEOUT
        )
        assert sorted(got) == expect
        for src, (payload, fds) in got.items():
            assert payload == _payload(src, 0)
            assert [_read_all(fd) for fd in fds] == [_content(src, 0, 0)]
            _close_all(fds)
        return {"leaked": _fd_count() - baseline, "warnings": warnings.messages}
    forger = {"wrong nonce": 1, "duplicate": 1, "test process": None}.get(case, 2)
    verdict = None
    if rank == forger and case != "duplicate":
        if case == "wrong nonce":
            verdict = _forge(nonce, 0, claim_rank=1, header_nonce="not" + nonce)
        elif case == "unexpected member":
            verdict = _forge(nonce, 0, claim_rank=2)
        else:  # "outsider", "impersonating member"
            verdict = _forge(nonce, 0, claim_rank=1)
        _signal(rundir, "forged")
    if rank == 1 or (rank == 2 and case == "duplicate"):
        if case == "duplicate" and rank == 2:
            _wait_for(rundir, "forged")
        elif case != "duplicate":
            _wait_for(rundir, "forged")
        fd = _memfd(_content(rank, 0, 0))
        _send_to_rank0(rank, nonce, [fd], group)
        os.close(fd)
        if case == "duplicate":  # rank 1 delivered; a second message from it must be refused
            verdict = _forge(nonce, 0, claim_rank=1)
            _signal(rundir, "forged")
    return {"leaked": _fd_count() - baseline, "verdict": verdict, "pid": os.getpid()}


def _timeout_worker(rank, world, rundir, nonce, absent, timeout):
    """Rank 0 sends to and expects from every other rank; ranks in ``absent`` never show up."""
    pids = _gather_pids(rundir, rank, world)
    if rank in absent:
        return None
    baseline = _fd_count()
    if rank != 0:
        fds = [_memfd(_content(rank, 0, i)) for i in range(5)]
        _send_to_rank0(rank, nonce, fds, pids)
        _close_all(fds)
        return {"leaked": _fd_count() - baseline}
    peers = list(range(1, world))
    fd = _memfd(b"for everyone")
    start = time.monotonic()
    try:
        exchange_fds(
            rank=0,
            nonce=nonce,
            outgoing={p: (b"", [fd]) for p in absent},
            expect_from=peers,
            pids=pids,
            timeout=timeout,
        )
    except FdExchangeError as exc:
        error = exc
    else:
        raise AssertionError("exchange_fds returned although a rank never showed up")
    elapsed = time.monotonic() - start
    os.fstat(fd)  # still the caller's
    os.close(fd)
    return {
        "leaked": _fd_count() - baseline,
        "elapsed": elapsed,
        "missing_from": error.missing_from,
        "unreachable": error.unreachable,
        "message": str(error),
    }


def _refused_sender_worker(rank, world, rundir, nonce):
    """Rank 0 expects only rank 2; rank 1 sends anyway and must learn of the refusal early."""
    pids = _gather_pids(rundir, rank, world)
    baseline = _fd_count()
    if rank == 0:
        got = exchange_fds(
            rank=0, nonce=nonce, outgoing={}, expect_from=[2], pids=pids, timeout=OK_TIMEOUT
        )
        _close_all(got[2][1])
        return {"leaked": _fd_count() - baseline, "payload": got[2][0]}
    if rank == 2:
        _wait_for(rundir, "rank1-done")
    fd = _memfd(_content(rank, 0, 0))
    start = time.monotonic()
    try:
        _send_to_rank0(rank, nonce, [fd], pids)
        outcome = {"error": None}
    except FdExchangeError as exc:
        outcome = {"error": str(exc), "unreachable": exc.unreachable}
    outcome["elapsed"] = time.monotonic() - start
    os.close(fd)
    if rank == 1:
        _signal(rundir, "rank1-done")
    outcome["leaked"] = _fd_count() - baseline
    return outcome


def _nonce_mismatch_worker(rank, world, rundir, nonce):
    pids = _gather_pids(rundir, rank, world)
    baseline = _fd_count()
    fd = _memfd(b"x")
    try:
        exchange_fds(
            rank=rank,
            nonce=f"{nonce}-{rank}",
            outgoing={1 - rank: (b"hi", [fd])},
            expect_from=[1 - rank],
            pids=pids,
            timeout=1.0,
        )
    except FdExchangeError as exc:
        result = {"missing_from": exc.missing_from, "unreachable": exc.unreachable}
    else:
        result = {"missing_from": None}
    os.close(fd)
    result["leaked"] = _fd_count() - baseline
    return result


def _silent_member_worker(rank, world, rundir, nonce):
    pids = _gather_pids(rundir, rank, world)
    if rank == 2:  # a member that connects and never says a word
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            deadline = time.monotonic() + 10
            while sock.connect_ex(socket_name(nonce, 0)) != 0:
                assert time.monotonic() < deadline, "rank 0 never listened"
                time.sleep(0.01)
            _signal(rundir, "silent-connected")
            sock.settimeout(OK_TIMEOUT)
            return {"closed_by_receiver": sock.recv(1) == b""}
    baseline = _fd_count()
    if rank == 1:
        _wait_for(rundir, "silent-connected")
        exchange_fds(
            rank=1,
            nonce=nonce,
            outgoing={0: (b"real", [])},
            expect_from=[],
            pids=pids,
            timeout=OK_TIMEOUT,
        )
        return {"leaked": _fd_count() - baseline}
    got = exchange_fds(
        rank=0, nonce=nonce, outgoing={}, expect_from=[1], pids=pids, timeout=OK_TIMEOUT
    )
    assert got == {1: (b"real", [])}
    return {"leaked": _fd_count() - baseline}


def _fd_starved_worker(rank, world, rundir, nonce):
    """Rank 1 has room for fewer fds than rank 0 sends."""
    pids = _gather_pids(rundir, rank, world)
    baseline = _fd_count()
    try:
        if rank == 0:
            fds = [_memfd(b"x") for _ in range(300)]
            try:
                exchange_fds(
                    rank=0,
                    nonce=nonce,
                    outgoing={1: (b"", fds)},
                    expect_from=[],
                    pids=pids,
                    timeout=OK_TIMEOUT,
                )
            finally:
                _close_all(fds)
        else:
            _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (baseline + 100, hard))
            exchange_fds(
                rank=1, nonce=nonce, outgoing={}, expect_from=[0], pids=pids, timeout=OK_TIMEOUT
            )
    except FdExchangeError as exc:
        return {"error": str(exc), "leaked": _fd_count() - baseline}
    return {"error": None, "leaked": _fd_count() - baseline}


# ----------------------------------------------------------------------------- exchanges


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_receives_each_peers_memfds_and_payload_intact(tmp_path, world):
    leaked = run_world(
        _full_exchange_worker, world, args=(str(tmp_path), _nonce(), 3), init_group=False
    )
    assert leaked == [0] * world


@pytest.mark.timeout(30)
@pytest.mark.parametrize("payload", [b"hello", b""], ids=["payload", "empty-payload"])
def test_a_message_without_fds_delivers_its_payload_alone(tmp_path, payload):
    leaked = run_world(
        _one_way_worker, 2, args=(str(tmp_path), _nonce(), payload, 0), init_group=False
    )
    assert leaked == [0, 0]


@pytest.mark.timeout(30)
def test_seven_hundred_fds_and_a_large_payload_arrive_in_order_in_batches(tmp_path):
    payload = random.Random(7).randbytes(3 << 20)
    leaked = run_world(
        _one_way_worker, 2, args=(str(tmp_path), _nonce(), payload, 700), init_group=False
    )
    assert leaked == [0, 0]


# ----------------------------------------------------------------------------- refusals


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "case", ["outsider", "impersonating member", "unexpected member", "wrong nonce", "duplicate"]
)
def test_forged_connections_are_refused_while_the_real_sender_gets_through(tmp_path, case):
    results = run_world(_forgery_worker, 3, args=(str(tmp_path), _nonce(), case), init_group=False)
    receiver = results[0]
    assert receiver["leaked"] == 0
    forger = results[1] if case in ("wrong nonce", "duplicate") else results[2]
    assert forger["verdict"] == "refused"
    assert all(r["leaked"] == 0 for r in results[1:])
    assert any(str(forger["pid"]) in message for message in receiver["warnings"]), receiver[
        "warnings"
    ]


@pytest.mark.timeout(30)
def test_a_connection_from_the_test_process_is_refused_while_the_exchange_completes(tmp_path):
    nonce = _nonce()
    verdict: list[str] = []

    def intrude() -> None:
        verdict.append(_forge(nonce, 0, claim_rank=1))
        _signal(str(tmp_path), "forged")

    intruder = threading.Thread(target=intrude)
    intruder.start()
    try:
        results = run_world(
            _forgery_worker, 2, args=(str(tmp_path), nonce, "test process"), init_group=False
        )
    finally:
        intruder.join(15)
    assert verdict == ["refused"]
    assert [r["leaked"] for r in results] == [0, 0]
    assert any(f"pid {os.getpid()}" in message for message in results[0]["warnings"])


@pytest.mark.timeout(30)
def test_a_sender_the_receiver_does_not_expect_is_refused_and_fails_before_the_deadline(
    tmp_path,
):
    results = run_world(_refused_sender_worker, 3, args=(str(tmp_path), _nonce()), init_group=False)
    assert results[0] == {"leaked": 0, "payload": _payload(2, 0)}
    refused = results[1]
    assert refused["unreachable"] == [0]
    assert "refused" in refused["error"]
    assert refused["elapsed"] < OK_TIMEOUT / 2
    assert refused["leaked"] == 0
    assert results[2]["error"] is None and results[2]["leaked"] == 0


@pytest.mark.timeout(30)
def test_a_silent_connection_from_a_member_does_not_block_the_exchange(tmp_path):
    results = run_world(_silent_member_worker, 3, args=(str(tmp_path), _nonce()), init_group=False)
    assert results == [{"leaked": 0}, {"leaked": 0}, {"closed_by_receiver": True}]


@pytest.mark.timeout(30)
def test_a_receiver_without_room_for_the_fds_fails_fast_naming_the_limit_and_leaks_nothing(
    tmp_path,
):
    start = time.monotonic()
    results = run_world(_fd_starved_worker, 2, args=(str(tmp_path), _nonce()), init_group=False)
    assert time.monotonic() - start < OK_TIMEOUT
    assert "RLIMIT_NOFILE" in results[1]["error"] and results[1]["leaked"] == 0
    assert "refused the message" in results[0]["error"] and results[0]["leaked"] == 0


# ----------------------------------------------------------------------------- timeouts


@pytest.mark.timeout(30)
def test_a_rank_that_never_shows_up_raises_fd_exchange_error_naming_it_within_the_timeout(
    tmp_path,
):
    nonce = _nonce()
    timeout = 1.5
    results = run_world(
        _timeout_worker, 2, args=(str(tmp_path), nonce, (1,), timeout), init_group=False
    )
    outcome = results[0]
    assert outcome["missing_from"] == [1]
    assert outcome["unreachable"] == [1]
    assert timeout - 0.05 <= outcome["elapsed"] < timeout + 1.0
    assert "rank 0" in outcome["message"] and nonce in outcome["message"]
    assert "timed out" in outcome["message"]
    assert outcome["leaked"] == 0


def _dead_peer_worker(rank, world, rundir, nonce, watch, timeout):
    """Rank 1 dies (exits) once rank 0 watches its process, without ever exchanging; rank 0
    exchanges with it, with ``pid_liveness`` when ``watch``."""
    from vmmkv._util import pid_liveness

    pids = _gather_pids(rundir, rank, world)
    if rank == 1:
        _wait_for(rundir, "watching")
        os._exit(0)
    liveness = pid_liveness(pids, rank) if watch else None
    _signal(rundir, "watching")
    baseline = _fd_count()
    fd = _memfd(b"for rank 1")
    start = time.monotonic()
    with pytest.raises(FdExchangeError) as info:
        exchange_fds(
            rank=0, nonce=nonce, outgoing={1: (b"", [fd])}, expect_from=[1], pids=pids,
            timeout=timeout, liveness=liveness,
        )  # fmt: skip
    elapsed = time.monotonic() - start
    os.close(fd)
    exc = info.value
    return {
        "elapsed": elapsed, "message": str(exc), "peers_lost": exc.peers_lost,
        "missing_from": exc.missing_from, "leaked": _fd_count() - baseline,
    }  # fmt: skip


@pytest.mark.timeout(60)
@pytest.mark.parametrize("watch", [True, False], ids=["liveness", "no-liveness"])
def test_a_peer_whose_process_is_gone_ends_the_exchange_at_once_with_liveness(tmp_path, watch):
    """With ``liveness`` the exchange ends within a poll or two of the peer's exit, naming it;
    without, only its timeout ends it (the contrast shows what the check buys)."""
    timeout = 8.0
    res = run_world_raw(
        _dead_peer_worker, 2, args=(str(tmp_path), _nonce(), watch, timeout), init_group=False
    )
    assert res[1].exitcode == 0, res[1].error
    assert res[0].ok, res[0].error
    out = res[0].value
    assert out["peers_lost"] == [1] and out["missing_from"] == [1], out
    assert out["leaked"] == 0, out
    if watch:
        assert out["elapsed"] < 2.0, out
        assert "lost a peer (peer rank 1's process" in out["message"], out
    else:
        assert out["elapsed"] >= timeout - 0.05, out
        assert "timed out" in out["message"], out


@pytest.mark.timeout(30)
def test_fds_received_before_a_timeout_are_closed_and_the_delivering_peer_succeeds(tmp_path):
    results = run_world(
        _timeout_worker, 3, args=(str(tmp_path), _nonce(), (2,), 2.0), init_group=False
    )
    outcome = results[0]
    assert outcome["missing_from"] == [2]
    assert outcome["unreachable"] == [2]
    assert outcome["leaked"] == 0  # the 5 fds from rank 1 were closed before raising
    assert results[1] == {"leaked": 0}


@pytest.mark.timeout(30)
def test_peers_using_different_nonces_never_meet_and_both_time_out(tmp_path):
    results = run_world(_nonce_mismatch_worker, 2, args=(str(tmp_path), _nonce()), init_group=False)
    assert results[0] == {"missing_from": [1], "unreachable": [1], "leaked": 0}
    assert results[1] == {"missing_from": [0], "unreachable": [0], "leaked": 0}


@pytest.mark.timeout(20)
def test_a_second_exchange_on_the_same_nonce_and_rank_fails_at_once():
    nonce = _nonce()
    pids = [os.getpid(), os.getpid()]
    first: list[BaseException] = []

    def hold_the_name() -> None:
        try:
            exchange_fds(rank=0, nonce=nonce, outgoing={}, expect_from=[1], pids=pids, timeout=1.0)
        except FdExchangeError as exc:
            first.append(exc)

    baseline = _fd_count()
    holder = threading.Thread(target=hold_the_name)
    holder.start()
    deadline = time.monotonic() + 5
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:  # wait until the first exchange listens (a member pid, so it is not logged)
        while probe.connect_ex(socket_name(nonce, 0)) != 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        probe.close()
    start = time.monotonic()
    with pytest.raises(FdExchangeError, match="could not listen") as info:
        exchange_fds(rank=0, nonce=nonce, outgoing={}, expect_from=[1], pids=pids, timeout=5.0)
    assert time.monotonic() - start < 0.5
    assert info.value.missing_from == [1]
    holder.join(10)
    assert len(first) == 1 and first[0].missing_from == [1]
    assert _fd_count() == baseline


# ----------------------------------------------------------------------------- validation


def _valid_kwargs(**overrides):
    kwargs = dict(
        rank=0,
        nonce="abc",
        outgoing={},
        expect_from=[],
        pids=[os.getpid(), 1],
        timeout=1.0,
    )
    kwargs.update(overrides)
    return kwargs


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "overrides, error, words",
    [
        (dict(rank=-1), ValueError, "rank"),
        (dict(rank=True), TypeError, "rank"),
        (dict(rank="0"), TypeError, "rank"),
        (dict(nonce=""), ValueError, "nonce"),
        (dict(nonce="a b"), ValueError, "nonce"),
        (dict(nonce="x" * 65), ValueError, "nonce"),
        (dict(nonce=b"abc"), TypeError, "nonce"),
        (dict(timeout=0), ValueError, "timeout"),
        (dict(timeout=-1.0), ValueError, "timeout"),
        (dict(timeout=float("nan")), ValueError, "timeout"),
        (dict(timeout=float("inf")), ValueError, "timeout"),
        (dict(timeout="1"), TypeError, "timeout"),
        (dict(pids=[os.getpid()], expect_from=[1]), ValueError, "pids has only 1"),
        (dict(rank=2), ValueError, "pids has 2 entries"),
        (dict(pids=[os.getpid() + 1, 1]), ValueError, "this process's pid"),
        (dict(pids=[os.getpid(), 0]), ValueError, "pids[1]"),
        (dict(pids=[os.getpid(), "1"]), TypeError, "pids[1]"),
        (dict(pids="12"), TypeError, "pids"),
        (dict(outgoing={0: (b"", [])}), ValueError, "own rank"),
        (dict(expect_from=[0]), ValueError, "own rank"),
        (dict(expect_from=[1, 1]), ValueError, "twice"),
        (dict(expect_from=[5]), ValueError, "pids has only 2"),
        (dict(expect_from=1), TypeError, "expect_from"),
        (dict(outgoing=[(1, (b"", []))]), TypeError, "mapping"),
        (dict(outgoing={1: b""}), TypeError, "pair"),
        (dict(outgoing={1: ("text", [])}), TypeError, "payload must be bytes"),
        (dict(outgoing={1: (b"", 3)}), TypeError, "sequence of ints"),
        (dict(outgoing={1: (b"", ["3"])}), TypeError, "fds must be ints"),
        (dict(outgoing={1: (b"", [987654])}), ValueError, "fd 987654 is not an open"),
        (dict(cancel=3), TypeError, "cancel must be callable"),
        (dict(liveness="pids"), TypeError, "liveness must be callable"),
        (dict(on_error="log"), TypeError, "on_error must be callable"),
    ],
)
def test_bad_arguments_are_rejected_with_the_value_before_any_socket_exists(
    overrides, error, words
):
    baseline = _fd_count()
    with pytest.raises(error, match=re.escape(words)):
        exchange_fds(**_valid_kwargs(**overrides))
    assert _fd_count() == baseline


def test_an_exchange_with_nothing_to_send_or_receive_returns_an_empty_dict():
    assert exchange_fds(**_valid_kwargs()) == {}


def _bound(name: bytes) -> bool:
    """True while some socket of this host holds the abstract ``name``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.bind(name)
        return False
    except OSError:
        return True
    finally:
        probe.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("raises", [False, True], ids=["returns", "raises"])
def test_on_error_sees_the_error_while_the_sockets_are_still_open(raises, caplog):
    """``on_error`` runs with the error about to be raised before anything closes (the
    listener's name is still bound), once; what it raises is logged and the exchange's own
    error still leaves; afterwards the name is free and no fd is left."""
    nonce, seen = _nonce(), []
    name = socket_name(nonce, 0)

    def on_error(exc):
        seen.append((exc, _bound(name)))
        if raises:
            raise RuntimeError("on_error broke")

    baseline = _fd_count()
    fd = _memfd(b"never delivered")
    with caplog.at_level(logging.ERROR, logger="vmmkv.ipc.fdpass"):
        with pytest.raises(FdExchangeError, match="timed out") as info:
            exchange_fds(**_valid_kwargs(
                nonce=nonce, outgoing={1: (b"x", [fd])}, expect_from=[1], timeout=0.3,
                on_error=on_error,
            ))  # fmt: skip
    os.close(fd)
    assert [(exc is info.value, bound) for exc, bound in seen] == [(True, True)]
    assert not _bound(name)
    assert _fd_count() == baseline
    assert ("on_error broke" in caplog.text) == raises, caplog.text


def test_socket_name_is_an_abstract_address_with_nonce_and_rank():
    assert socket_name("run_1-A", 3) == b"\0vmmkv-run_1-A-3"
    with pytest.raises(ValueError, match="nonce"):
        socket_name("a/b", 0)
    with pytest.raises(ValueError, match="rank"):
        socket_name("abc", -1)


def test_exchange_refuses_to_run_off_linux(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(RuntimeError, match="needs Linux"):
        exchange_fds(**_valid_kwargs())


def test_fd_exchange_error_keeps_its_ranks_across_pickling():
    error = FdExchangeError("boom", missing_from=[3, 1], unreachable=[2])
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.missing_from, copy.unreachable) == ("boom", [1, 3], [2])


# ----------------------------------------------------------------------------- the harness


def _harness_worker(rank, world, mode):
    if mode == "raise" and rank == 1:
        raise ValueError("rank 1 gives up")
    if mode == "exit" and rank == 1:
        os._exit(7)
    if mode == "hang" and rank == 1:
        time.sleep(120)
    if mode == "segv" and rank == 1:
        import signal

        print("rank 1: about to crash", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    if mode == "env":
        return os.environ.get("VMMKV_TEST_FLAG")
    return rank * 10


@pytest.mark.timeout(30)
def test_harness_returns_each_ranks_value_in_rank_order_with_env_applied():
    assert run_world(_harness_worker, 2, args=("ok",), init_group=False) == [0, 10]
    assert run_world(
        _harness_worker, 2, args=("env",), init_group=False, env={"VMMKV_TEST_FLAG": "on"}
    ) == ["on", "on"]


@pytest.mark.timeout(30)
def test_harness_reports_a_raising_rank_with_its_traceback():
    raised = run_world_raw(_harness_worker, 2, args=("raise",), init_group=False)
    assert raised[0].ok and raised[0].value == 0
    assert not raised[1].ok and "ValueError: rank 1 gives up" in raised[1].error
    with pytest.raises(AssertionError, match="rank 1 gives up"):
        run_world(_harness_worker, 2, args=("raise",), init_group=False)


@pytest.mark.timeout(30)
def test_harness_reports_a_rank_that_dies_with_its_exit_code():
    exited = run_world_raw(_harness_worker, 2, args=("exit",), init_group=False)
    assert exited[0].ok
    assert not exited[1].ok and exited[1].exitcode == 7
    assert exited[1].error.startswith("exited with code 7 without a result"), exited[1].error


@pytest.mark.timeout(30)
def test_harness_names_the_signal_that_killed_a_rank_and_shows_its_last_stderr_lines():
    crashed = run_world_raw(_harness_worker, 2, args=("segv",), init_group=False)
    assert crashed[0].ok
    victim = crashed[1]
    assert not victim.ok and victim.exitcode == -signal.SIGSEGV
    assert "killed by SIGSEGV" in victim.error and "without a result" in victim.error
    assert "rank 1: about to crash" in victim.error, victim.error
    assert "rank 1: about to crash" in victim.stderr_tail
    assert len(victim.stderr_tail.splitlines()) <= STDERR_TAIL_LINES
    with pytest.raises(AssertionError, match="SIGSEGV"):
        run_world(_harness_worker, 2, args=("segv",), init_group=False)


@pytest.mark.timeout(30)
def test_harness_kills_a_rank_that_outlives_the_timeout():
    start = time.monotonic()
    hung = run_world_raw(_harness_worker, 2, args=("hang",), init_group=False, timeout=10)
    assert time.monotonic() - start < 10 + 5
    assert hung[0].ok
    assert not hung[1].ok and hung[1].error.startswith("timed out after 10s"), hung[1].error
    assert hung[1].exitcode is not None  # reaped, not left behind
