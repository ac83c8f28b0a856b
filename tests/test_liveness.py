"""The barrier's liveness sources, without a GPU: peer pids on this host, and the notices ranks
post in the group's store when they close their cache or their barrier breaks."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from types import SimpleNamespace

from vmmkv.direct import _GroupLiveness
from vmmkv.ops.barrier import pid_liveness


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
