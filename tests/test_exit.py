"""Exit without close (engines crash): a rank that exits with its cache still open.

Two ranks over a gloo group on loopback, each a plain ``python -c`` interpreter
(``tests.helpers.run_rank_scripts``, not the spawner's child loop), so that the victim's exit is
a real one and its stderr its own: rank 1 builds a ``ReplicatedKVCache`` with rank 0, publishes
one step, then exits with the cache open:
- ``return``: its function returns (the cache goes with the frame) and the interpreter exits
  normally;
- ``global``: a module global still holds the cache at interpreter shutdown (``sys.exit(0)``),
  and the process lives on for 0.3 s after every other atexit hook (the rank script registers
  that sleep before anything else, and atexit runs hooks last-in first-out): as it does when an
  engine has exit work of its own. Threads vmmkv left running (the barrier watchdog reads its
  control page every 50 ms) must find their memory intact: weakref.finalize's exit hook, which
  runs before the sleep, once freed that page under the watchdog (a SIGSEGV at exit, on CUDA);
- ``os._exit``: no Python teardown at all.
In the first two the victim destroys its process group first, as the spawner's child loop does:
a gloo group left alive to interpreter shutdown makes torch's own teardown abort the process now
and then ("terminate called without an active exception" from a gloo C++ thread; 14 of 80 exits
of a script with torch and gloo only, no vmmkv), which is not what is tested here.

The scenario is written once (``_rank_main``, ``_exit_case``) for both backends: the host backend
here (memfd regions; CI), CUDA in ``tests/test_exit_gpu.py``. Devices, warm-up, baseline and the
release check are the fault suite's (``tests.test_faults``: ``_start``, ``_finish``,
``_assert_released``).

What must hold:
- the victim's process is gone within a few seconds (no hang at exit), exit status 0, and its
  stderr holds no traceback, "Exception ignored", warning or error line
  (``tests.helpers.stderr_noise``);
- the survivor (rank 0) still reads its own replica byte-exact after the victim is gone, and
  the victim's replica through its mapping too (the dead rank's chunks live as long as a mapping
  does); its ``close()`` returns promptly, and afterwards its fds, memfds, memfd mappings and
  host reservations (on CUDA also the device memory) are back to the baseline it took after a
  warm-up of its own (the fault suite's, plus the same kind of read of a peer's chunks); on the
  host backend the victim's memfds, mapped by the survivor until then (checked: by inode in
  ``/proc/self/maps``), are no longer mapped, so the kernel can free them;
- the survivor exits cleanly too (status 0, no noise).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time

import pytest

WORLD = 2
VICTIM = WORLD - 1  # the fault suite's victim (rank 0 hosts the group's store)
HOWS = ["return", "global", "os._exit"]
EXIT_LIMIT = {"host": 5.0, "cuda": 10.0}  # seconds from the victim's last collective to its end
CLOSE_LIMIT = 2.0  # the survivor's close()
RUN_LIMIT = {"host": 90.0, "cuda": 60.0}  # the whole pair, start to reaped (then killed)
SEED = 30  # rank r poisons its replica with random_bytes(seed=SEED + r)

_RANK = textwrap.dedent(
    """
    import sys
    if sys.argv[3] == "global":
        import atexit, time
        atexit.register(time.sleep, 0.3)  # first: it runs last (module docstring)
    from tests.test_exit import _rank_main
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
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


def _replica(view, n: int):
    """A host copy of the first ``n`` bytes of a replica view: copied on its device first (a
    peer's bytes travel device to device, as the stores' do), then to the host."""
    return view[:n].clone().to("cpu")


def _warm_up_peer_read(backend, device, ordinals) -> None:
    """The survivor's one access that the fault suite's warm-up lacks, done alone before the
    baseline: reading a peer's chunks through a mapping (``_replica``), chunks made on every
    device used, so that whatever the driver sets up for such copies is in the baseline."""
    import torch

    from tests.helpers import commit_random, map_all_chunks
    from tests.test_faults import _chunk
    from vmmkv._util import run_all
    from vmmkv.alloc import VirtualRegion

    chunk = _chunk(backend, device)
    for other in ordinals or ["cpu"]:
        where = "cpu" if backend == "host" else f"cuda:{other}"
        src = VirtualRegion(chunk, where, chunk_bytes=chunk, backend=backend)
        own = VirtualRegion(chunk, device, chunk_bytes=chunk, backend=backend)
        peer = own.open_peer()
        try:
            data = commit_random(src, chunk, seed=7).to("cpu", copy=True)
            map_all_chunks(src, peer)
            got = _replica(peer.tensor(), chunk)
        finally:
            run_all([peer.close, own.close, src.close])
        assert torch.equal(got, data), f"warm-up: chunks of {where} read wrong through a mapping"


def _rank_main(rank: int, port: int, how: str, backend: str) -> None:
    """One rank's process: warm-up and baseline (survivor), a cache and one published step,
    then the victim exits ``how`` with its cache open and the survivor checks and reports."""
    from datetime import timedelta

    import torch.distributed as dist

    from tests.helpers import KVStep, device_memory_in_use, process_gone, random_bytes
    from tests.test_faults import LAYERS, _cache, _device, _finish, _ordinals, _resources, _start

    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD, init_method=f"tcp://127.0.0.1:{port}",
        timeout=timedelta(seconds=30),
    )  # fmt: skip
    if rank != VICTIM:  # before the baseline _start takes
        _warm_up_peer_read(backend, _device(backend, rank, WORLD), _ordinals(backend, WORLD))
    device, ordinals, pids, baseline = _start(rank, WORLD, backend)
    cache = _cache(backend, device, 2)
    assert cache.direct, cache.why_not_direct
    kv = KVStep(cache, LAYERS, 32)
    before = kv.poison(0, cache.committed_bytes, seed=SEED + rank)
    dist.barrier()  # nobody writes into a replica before its owner poisoned it
    slots = KVStep.spread(kv.slot_range(0, kv.blocks()), WORLD, 32, seed=31)
    batches = [KVStep.batch(400 * (r + 1), slots[r]) for r in range(WORLD)]
    kv.load(batches[rank])
    kv.step()
    want = kv.expected(before, batches)
    kv.check(want, "publish with every rank alive")
    inodes = [None] * WORLD
    dist.all_gather_object(inodes, sorted(_own_memfd_inodes()) if backend == "host" else [])
    live = _resources(backend, device, []) if rank != VICTIM else None
    dist.barrier()  # the last collective: the victim exits now, its cache open
    if rank == VICTIM:
        if how == "os._exit":
            os._exit(0)
        dist.destroy_process_group()  # the group (not the cache) goes first: module docstring
        if how == "global":
            _HELD.append((cache, kv))
            sys.exit(0)
        return  # "return": the cache goes with this frame, then the interpreter exits
    t0 = time.monotonic()
    gone = process_gone(pids[VICTIM], 2 * EXIT_LIMIT[backend])  # bounded: a hang fails
    exit_s = time.monotonic() - t0
    victim = set(inodes[VICTIM])
    maps_before = len(victim & _memfd_inodes())
    kv.check(want, "own replica after the peer exited")
    # the victim's replica, read through this rank's mapping of its (now orphaned) chunks
    peer_want = kv.expected(random_bytes(cache.committed_bytes, SEED + VICTIM), batches)
    peer_got = _replica(cache.region.view(VICTIM), peer_want.numel())
    peer_bad = int((peer_got != peer_want).sum())
    # device memory while this rank alone holds the victim's chunks (mapped) and its own
    held = device_memory_in_use(ordinals) if ordinals else None
    t1 = time.monotonic()
    cache.close()
    close_s = time.monotonic() - t1
    del cache, kv  # their views of the region keep the (address) reservation until they go
    _, after = _finish(backend, device, ordinals, pids, baseline)
    res = {
        "victim_gone": gone, "exit_s": exit_s, "victim_inodes": len(victim),
        "victim_maps_before": maps_before, "victim_maps_after": len(victim & _memfd_inodes()),
        "peer_checked": peer_want.numel(), "peer_bad_bytes": peer_bad, "held": held,
        "close_s": close_s, "committed": int(before.numel()), "ordinals": ordinals,
        "baseline": baseline, "live": live, "after": after,
    }  # fmt: skip
    print("RESULT " + json.dumps(res), flush=True)
    dist.destroy_process_group()


def _exit_case(how: str, backend: str) -> dict:
    """Run the pair (victim exiting ``how``); assert what holds on every backend; return the
    survivor's report for the backend's own checks."""
    from tests.helpers import run_rank_scripts, stderr_noise
    from tests.test_faults import _assert_released
    from vmmkv.testing.spawn import world_store

    with world_store() as store:
        runs = run_rank_scripts(
            _RANK, WORLD, args=(store.port, how, backend), env=store.env,
            timeout=RUN_LIMIT[backend],
        )  # fmt: skip
    (rc0, out0, err0), (rc1, out1, err1) = runs
    assert rc1 == 0, ("victim", rc1, out1, err1)  # None: still running at the limit (a hang)
    assert stderr_noise(err1) == [], err1
    assert rc0 == 0, ("survivor", rc0, out0, err0)
    assert stderr_noise(err0) == [], err0
    lines = [line for line in out0.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, out0
    res = json.loads(lines[0][len("RESULT ") :])
    assert res["victim_gone"], res
    assert res["exit_s"] < EXIT_LIMIT[backend], res
    # (the survivor read its own replica byte-exact after the victim was gone: else rc0 != 0)
    assert res["peer_checked"] > 0 and res["peer_bad_bytes"] == 0, res
    assert res["close_s"] < CLOSE_LIMIT, res
    _assert_released(backend, res["baseline"], res["after"], how)
    return res


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", HOWS)
def test_a_rank_exiting_with_an_open_cache_neither_hangs_nor_leaks_into_the_survivor(how):
    res = _exit_case(how, "host")
    # the survivor mapped the victim's memfds until its close, and not after
    assert res["victim_inodes"] > 0, res
    assert res["victim_maps_before"] > 0, res
    assert res["victim_maps_after"] == 0, res
    # the live cache held more than the baseline (the release check can fail)
    assert res["live"]["memfd_maps"] > res["baseline"]["memfd_maps"], res


def _held_at_exit(rank, world, what):
    """A cache, or only a view of it, held at interpreter exit by a vmmkv module global (where
    the vLLM plugin keeps its active cache): vLLM's layers keep their KV views until the worker
    exits, and the last collection may clear the module dict that held the DLPack deleter
    before the views die."""
    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache
    from vmmkv.integrations.vllm._state import _STATE

    cache = ReplicatedKVCache(dist.group.WORLD, 1 << 20, "cpu", initial_bytes=1 << 20,
                              backend="host", timeout=20)  # fmt: skip
    view = cache.allocate(4096)
    view.fill_(rank + 1)
    _STATE.active = view if what == "view" else cache
    dist.barrier()
    return int(view.sum())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("what", ["view", "cache"])
def test_a_view_alive_in_a_vmmkv_module_global_at_exit_does_not_crash_the_interpreter(what):
    from vmmkv.testing.spawn import run_world_raw

    runs = run_world_raw(_held_at_exit, WORLD, args=(what,), timeout=120)
    assert [(r.ok, r.exitcode) for r in runs] == [(True, 0)] * WORLD, runs
    assert [r.value for r in runs] == [4096 * (r + 1) for r in range(WORLD)], runs
