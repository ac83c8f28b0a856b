"""What a failed collective says (host backend, spawned ranks, no GPU): the step that failed and
the rank it failed on, never a symptom seen later. A peer found dead during a grow's fd exchange
is reported lost, with the time the survivor took to find it (``tests.test_faults._killed_at``
kills it there), not as late by the whole timeout; an out-of-memory at one rank's local commit
names the local commit and that rank, not the fd exchange the rank then sat out."""

from __future__ import annotations

import re
import signal

import pytest

from tests.test_faults import POINTS, TIMEOUT, _killed_at
from vmmkv.testing.spawn import run_world, run_world_raw

CHUNK = 4096


def _oom_at_commit(rank, world):
    import torch.distributed as dist

    from vmmkv.alloc.host import HostError
    from vmmkv.ipc import GroupError, SymmetricRegion

    sr = SymmetricRegion(8 * CHUNK, "cpu", dist.group.WORLD, chunk_bytes=CHUNK, backend="host",
                         timeout=20)  # fmt: skip
    try:
        sr.resize(2 * CHUNK)
        if rank == world - 1:  # the next chunk this rank creates: out of memory
            backend = sr.region._backend

            def create(size):
                raise HostError(12, "injected out of memory")

            backend.create = create
        try:
            sr.resize(4 * CHUNK)
        except GroupError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None
    finally:
        sr.close()


@pytest.mark.timeout(120)
def test_an_out_of_memory_at_one_ranks_commit_names_the_local_commit_not_the_fd_exchange():
    out = run_world(_oom_at_commit, 2, timeout=90)
    for rank, error in enumerate(out):
        assert error is not None, rank
        assert "rank 1" in error and "local commit" in error, (rank, error)
        assert "injected out of memory" in error, (rank, error)
        assert "fd exchange" not in error, (rank, error)


@pytest.mark.timeout(120)
def test_a_peer_found_dead_in_the_exchange_is_reported_lost_with_the_time_taken(tmp_path):
    point = "grow-during-exchange"
    marker = tmp_path / "killed-at"
    res = run_world_raw(_killed_at, 2, args=("host", point, str(marker)), timeout=90)
    assert res[1].exitcode == -signal.SIGKILL, (res[1].exitcode, res[1].error)
    assert marker.read_text() == POINTS[point][2]
    assert res[0].ok, res[0].error
    error, elapsed = res[0].value[:2]
    assert elapsed < TIMEOUT["host"] / 2, (elapsed, error)  # found at once, not timed out
    assert "ranks [1]" in error and "did not arrive within" not in error, error
    found = re.search(r"lost (\d+\.\d+) s into the step", error)
    assert found is not None and float(found[1]) <= elapsed + 0.05, (elapsed, error)
