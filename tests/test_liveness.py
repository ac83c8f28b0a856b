"""The barrier's liveness sources, without a GPU: peer pids on this host, and the notices ranks
post in the group's store when they close their cache or their barrier breaks."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from types import SimpleNamespace

from vmmkv._util import pid_liveness
from vmmkv.direct import _GroupLiveness


def test_a_peer_process_that_exits_is_named_zombie_or_reaped():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        check = pid_liveness([12345678, proc.pid, 0], rank=0)  # rank 2's pid: unreadable, unwatched
        assert check() is None
        proc.kill()
        deadline = time.monotonic() + 10
        while check() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert check() == (1, f"peer rank 1's process (pid {proc.pid}) is gone")  # a zombie
        proc.wait()
        assert check() == (1, f"peer rank 1's process (pid {proc.pid}) is gone")  # reaped
    finally:
        proc.kill()
        proc.wait()


class _FakeStore:
    """The part of a torch.distributed store the liveness uses, thread-safe."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def add(self, key, n):
        with self.lock:
            v = int(self.data.get(key, b"0")) + n
            self.data[key] = str(v).encode()
            return v

    def check(self, keys):
        with self.lock:
            return all(k in self.data for k in keys)

    def get(self, key):
        with self.lock:
            return self.data[key]

    def set(self, key, value):
        with self.lock:
            self.data[key] = value


def _region(rank, store):
    comm = SimpleNamespace(_store=store, _prefix="vmmkv/rdzv/abc")
    peers = SimpleNamespace(by_value=True)  # fabric handles: no pids (other hosts)
    return SimpleNamespace(rank=rank, world_size=3, peers=peers, _comm=comm)


def test_a_peer_that_closed_or_broke_is_named_through_the_store():
    store = _FakeStore()
    watchers = [_GroupLiveness(_region(r, store)) for r in range(3)]
    try:
        assert all(w() is None for w in watchers)
        watchers[2].notify("broke: peer rank 0 did not arrive within the barrier timeout of 4 s")
        deadline = time.monotonic() + 5
        while (watchers[0]() is None or watchers[1]() is None) and time.monotonic() < deadline:
            time.sleep(0.02)
        for w in watchers[:2]:
            assert w() == (2, "peer rank 2 broke: peer rank 0 did not arrive within the barrier "
                              "timeout of 4 s")  # fmt: skip
        assert watchers[2]() is None  # its own notice is not a verdict on anyone
    finally:
        for w in watchers:
            w.stop()


def _watch_a_peer_that_exits(rank, world):
    """A real rendezvous (host backend, fd handles); rank 1 then exits; rank 0's barrier
    liveness, built from the region as the direct path builds it, names rank 1."""
    import os

    import torch.distributed as dist

    from vmmkv.alloc import make_backend
    from vmmkv.ipc import SymmetricRegion

    g = make_backend("cpu", "host").granularity
    with SymmetricRegion(4 * g, "cpu", backend="host", chunk_bytes=g, initial_bytes=g) as region:
        assert region.peers is not None and region.peers.liveness is not None
        watcher = _GroupLiveness(region)
        try:
            assert watcher() is None
            dist.barrier()
            if rank == 1:
                os._exit(0)
            deadline = time.monotonic() + 10
            while watcher() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            return watcher()
        finally:
            watcher.stop()


def test_the_rendezvous_gives_the_barrier_a_liveness_that_names_a_peer_that_exited():
    from vmmkv.testing.spawn import run_world_raw

    res = run_world_raw(_watch_a_peer_that_exits, 2, timeout=60)
    assert res[1].exitcode == 0, res[1].error
    assert res[0].ok, res[0].error
    peer, why = res[0].value
    assert peer == 1 and "peer rank 1's process" in why and "is gone" in why, res[0].value


_EXIT_SCRIPT = """
import sys
from tests.test_liveness import _exit_with_a_watcher_open
_exit_with_a_watcher_open(int(sys.argv[1]), int(sys.argv[2]))
"""
_HELD = []  # the victim's region and watcher at interpreter shutdown


def _exit_with_a_watcher_open(rank, port):
    """A real rendezvous; the watcher's thread polls the group's store without a pause, so that
    it is nearly always inside a C++ store call. Rank 1 destroys its group and exits with the
    region and the watcher held by a module global; rank 0 and the store (hosted by the test's
    process) outlive it."""
    import os
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from vmmkv.alloc import make_backend
    from vmmkv.ipc import SymmetricRegion

    dist.init_process_group(
        "gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
        timeout=timedelta(seconds=30),
    )  # fmt: skip
    _GroupLiveness._STORE_POLL_S = 0.0
    g = make_backend("cpu", "host").granularity
    region = SymmetricRegion(4 * g, "cpu", backend="host", chunk_bytes=g, initial_bytes=g)
    _HELD.append((region, _GroupLiveness(region)))
    dist.barrier()
    if rank == 0:
        time.sleep(3)  # the peer outlives the victim's exit
        os._exit(0)
    dist.destroy_process_group()
    time.sleep(0.2)  # the thread is in its store calls by now
    sys.exit(0)


def test_a_process_exiting_with_a_watcher_open_exits_cleanly():
    """Before the atexit hook (``direct._stop_watchers_at_exit``) this aborted every time
    (10 of 10 here: "terminate called without an active exception", the poll thread ended
    inside a C++ store call by the interpreter's finalization)."""
    from tests.helpers import run_rank_scripts, stderr_noise
    from vmmkv.testing.spawn import world_store

    for _ in range(3):
        with world_store() as store:
            runs = run_rank_scripts(_EXIT_SCRIPT, 2, args=(store.port,), env=store.env, timeout=60)
        victim = runs[1]
        assert victim.returncode == 0, victim
        assert stderr_noise(victim.stderr) == [], victim.stderr
