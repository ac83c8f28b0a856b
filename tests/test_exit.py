"""Exit without close (engines crash): a rank that exits with its cache still open.

Host backend (memfd regions; CI), two ranks over a gloo group on loopback, each a plain
``python -c`` process started here (not the spawner's child loop), so that the victim's exit is
a real one: rank 1 builds a ``ReplicatedKVCache`` with rank 0, publishes one step, then exits
with the cache open:
- ``return``: its function returns (the cache goes with the frame) and the interpreter exits
  normally;
- ``global``: a module global still holds the cache at interpreter shutdown (``sys.exit(0)``);
- ``os._exit``: no Python teardown at all.

What must hold:
- the victim's process is gone within a few seconds (no hang at exit), exit status 0, and its
  stderr holds no traceback, "Exception ignored", warning or error line;
- the survivor (rank 0) still reads its own replica byte-exact after the victim is gone, its
  ``close()`` returns promptly, and afterwards its fds, memfds, memfd mappings and host
  reservations are back to the baseline it took after a warm-up of its own (a one-rank cache
  cycle and an import of its own chunks; ``tests.test_faults``); the victim's memfds, mapped by
  the survivor until then (checked: by inode in ``/proc/self/maps``), are no longer mapped, so
  the kernel can free them;
- the survivor exits cleanly too (status 0, no noise).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from vmmkv.testing.spawn import free_port

EXIT_LIMIT = 5.0  # seconds from the victim's last collective to its process being gone
CLOSE_LIMIT = 2.0  # the survivor's close()

_RANK = textwrap.dedent(
    """
    import sys
    from tests.test_exit import _rank_main
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
    """
)
_HELD = []  # the victim's cache at interpreter shutdown ("global")


def _memfd_inodes() -> set[int]:
    """Inodes of the memfds this process maps now (from /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return {int(line.split()[4]) for line in f if "memfd:" in line}


def _own_memfd_inodes() -> set[int]:
    """Inodes of the memfds this process holds open (its own chunks)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:"):
                out.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except OSError:  # the fd of the listing itself, closed meanwhile
            pass
    return out


def _rank_main(rank: int, port: int, how: str) -> None:
    """One rank's process: warm-up and baseline (survivor), a cache and one published step,
    then the victim exits ``how`` with its cache open and the survivor checks and reports."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from tests.helpers import KVStep, process_gone
    from tests.test_faults import LAYERS, _cache, _resources, _warm_up_alone

    dist.init_process_group(
        "gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
        timeout=timedelta(seconds=30),
    )  # fmt: skip
    world, device = 2, torch.device("cpu")
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    solo = [dist.new_group([r], backend="gloo") for r in range(world)]  # collective
    baseline = None
    if rank == 0:
        _warm_up_alone("host", device, [], solo[0])
        baseline = _resources("host", device, [])
    dist.barrier()
    cache = _cache("host", device, 2)
    assert cache.direct, cache.why_not_direct
    kv = KVStep(cache, LAYERS, 32)
    before = kv.poison(0, cache.committed_bytes, seed=30 + rank)
    dist.barrier()  # nobody writes into a replica before its owner poisoned it
    slots = KVStep.spread(kv.slot_range(0, kv.blocks()), world, 32, seed=31)
    batches = [KVStep.batch(400 * (r + 1), slots[r]) for r in range(world)]
    kv.load(batches[rank])
    kv.step()
    want = kv.expected(before, batches)
    kv.check(want, "publish with every rank alive")
    inodes = [None] * world
    dist.all_gather_object(inodes, sorted(_own_memfd_inodes()))
    live = _resources("host", device, []) if rank == 0 else None
    dist.barrier()  # the last collective: the victim exits now, its cache open
    if rank == 1:
        if how == "os._exit":
            os._exit(0)
        if how == "global":
            _HELD.append((cache, kv))
            sys.exit(0)
        return  # "return": the cache goes with this frame, then the interpreter exits
    t0 = time.monotonic()
    gone = process_gone(pids[1], 30.0)
    exit_s = time.monotonic() - t0
    victim = set(inodes[1])
    maps_before = len(victim & _memfd_inodes())
    kv.check(want, "own replica after the peer exited")
    t1 = time.monotonic()
    cache.close()
    close_s = time.monotonic() - t1
    del cache, kv  # their views of the region keep the (address) reservation until they go
    after = _resources("host", device, [])
    res = {
        "victim_gone": gone, "exit_s": exit_s, "victim_inodes": len(victim),
        "victim_maps_before": maps_before, "victim_maps_after": len(victim & _memfd_inodes()),
        "close_s": close_s, "baseline": baseline, "live": live,
        "after": after,
    }  # fmt: skip
    print("RESULT " + json.dumps(res), flush=True)
    dist.destroy_process_group()


# noise a clean exit never prints: lower-cased substrings of a stderr line, and the prefix of
# torch's C++ warning/error log lines ("[W1130 12:00:00 ...]")
_NOISE = ("traceback", "exception ignored", "error", "warning", "cuda", "leak", "segmentation")
_CXX_LOG = re.compile(r"^\[[WEF]\d")


def _noise(stderr: str) -> list[str]:
    return [
        line
        for line in stderr.splitlines()
        if any(w in line.lower() for w in _NOISE) or _CXX_LOG.match(line)
    ]


def _run_pair(how: str, timeout: float = 90.0):
    """Start rank 0 (survivor) and rank 1 (victim, exiting ``how``); returns their
    (returncode, stdout, stderr), killing both if either overruns ``timeout``."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("VMMKV_DIRECT", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(rank), str(port), how],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        for rank in range(2)
    ]
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, o.decode(), e.decode()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["return", "global", "os._exit"])
def test_a_rank_exiting_with_an_open_cache_neither_hangs_nor_leaks_into_the_survivor(how):
    (rc0, out0, err0), (rc1, out1, err1) = _run_pair(how)
    assert rc1 == 0, (rc1, out1, err1)
    assert _noise(err1) == [], err1
    assert rc0 == 0, (rc0, out0, err0)
    assert _noise(err0) == [], err0
    lines = [line for line in out0.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, out0
    res = json.loads(lines[0][len("RESULT ") :])
    assert res["victim_gone"], res
    assert res["exit_s"] < EXIT_LIMIT, res
    # the survivor mapped the victim's memfds until its close, and not after
    assert res["victim_inodes"] > 0, res
    assert res["victim_maps_before"] > 0, res
    assert res["victim_maps_after"] == 0, res
    # (the survivor read its own replica byte-exact after the victim was gone: else rc0 != 0)
    assert res["close_s"] < CLOSE_LIMIT, res
    base, after = res["baseline"], res["after"]
    for key in ("not_sockets", "memfds", "memfd_maps", "reservations"):
        assert after[key] == base[key], (key, base, after)
    assert after["fds"] <= base["fds"], (base, after)
    # the live cache held more than the baseline (the check above can fail)
    assert res["live"]["memfd_maps"] > base["memfd_maps"], res
