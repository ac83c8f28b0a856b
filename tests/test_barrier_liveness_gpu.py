"""Barrier liveness on the GPU: no trap by default, the host watchdog's abort, lane
misuse, complete timeout records.

- A peer that sleeps 30 s before its publish never kills the waiting rank (defaults: host
  timeout 600 s, device diagnostic after 10 s): both finish byte-exact, the waiting rank's lane
  record says "passed" after ~30 s, its printf said "still waiting" then "passed".
- A peer that is alive but never arrives: the waiting rank gets BarrierAborted naming it after
  the host timeout (4 s here), its CUDA context stays usable and it closes cleanly. (A peer
  SIGKILLed before its signal: tests/test_faults.py, the replayed-step case.)
- Two launches on one lane from two streams fail loudly (the lane's busy word / epoch exchange):
  the barrier breaks with "used by two launches at once"; the same launches on one stream pass.
- Timeout records are complete for world 3 (two missing peers), 34 and 40 (waiting threads in
  two warps: the case that lost its record before) and for two lanes timing out at once; with
  the opt-in trap at world 34 the record is complete before the trap.

Two-rank tests: one process per GPU when there are two GPUs, else both processes share GPU 0.
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from vmmkv.testing.markers import requires_gpu
from vmmkv.testing.spawn import run_world

REPO = Path(__file__).resolve().parents[1]
LAYERS = 2
TOKENS = 40


def _device(rank: int, world: int) -> torch.device:
    dev = torch.device("cuda", rank if torch.cuda.device_count() >= world else 0)
    torch.cuda.set_device(dev)
    return dev


def _redirect_stdout(path: str) -> None:
    """The device printf of this process goes to fd 1: send it (and stderr) to ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _cache(device, **kw):
    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache

    chunk = 32 << 20
    return ReplicatedKVCache(dist.group.WORLD, 2 * chunk, device, chunk_bytes=chunk,
                             initial_bytes=2 * chunk, timeout=60.0, direct=True, **kw)  # fmt: skip


def _publish_step(kv) -> None:
    """Every layer but the last stored, the last one published (stores + barrier, one launch)."""
    kv_c, k_pe, k = kv.inputs
    for mla, idx in kv.bound[:-1]:
        kv.cache.store_layer(mla, idx, kv_c, k_pe, k, kv.slots)
    mla, idx = kv.bound[-1]
    kv.cache.publish_layer(mla, idx, kv_c, k_pe, k, kv.slots, lane=0)


# ---------------------------------------------------------------------------------------------
# a late peer (30 s) with the default settings


def _late_peer(rank, world, out_dir, late_s):
    import torch.distributed as dist

    from tests.helpers import KVStep

    _redirect_stdout(os.path.join(out_dir, f"rank{rank}.out"))
    os.environ.pop("VMMKV_BARRIER_TIMEOUT", None)  # the defaults under test
    os.environ.pop("VMMKV_BARRIER_TRAP", None)
    device = _device(rank, world)
    with _cache(device) as cache:
        bar = cache._path._barrier
        assert (bar.timeout_s, bar.diag_after_s, bar.trap) == (600.0, 10.0, False)
        kv = KVStep(cache, LAYERS, TOKENS)
        torch.cuda._sleep(1)  # load torch's kernels before a barrier spins
        _publish_step(kv)  # warm-up: padding only, every rank
        before = kv.poison(0, min(cache.committed_bytes, kv.buf.numel()), seed=40 + rank)
        dist.barrier()
        slots = KVStep.spread(kv.slot_range(0, kv.blocks()), world, TOKENS, seed=41)
        batches = [KVStep.batch(500 + r, slots[r]) for r in range(world)]
        kv.load(batches[rank])
        kv.sync()
        dist.barrier()  # start together
        if rank == world - 1:
            time.sleep(late_s)  # e.g. a JIT compile on this rank only
        t0 = time.monotonic()
        _publish_step(kv)
        kv.sync()
        waited = time.monotonic() - t0
        kv.check(kv.expected(before, batches), "the step with a late peer")
        time.sleep(0.3)  # the watchdog's next pass logs the passed record
        diag = bar.read_diagnostic(0)
        assert cache._path.broken is None
        stats = cache.stats()
        dist.barrier()
    return {"waited": waited, "diag": None if diag is None else vars(diag), "stats": stats}


@requires_gpu
@pytest.mark.timeout(300)
def test_a_peer_that_sleeps_30_s_before_its_publish_never_kills_the_waiting_rank(tmp_path):
    late_s = 30.0
    results = run_world(_late_peer, 2, args=(str(tmp_path), late_s), timeout=240)
    waiter, late = results
    assert waiter["waited"] > late_s - 2, waiter  # its kernel really waited for the peer
    diag = waiter["diag"]
    assert diag is not None, waiter
    assert (diag["state"], diag["rank"], diag["missing_peer"], diag["lane"]) == (
        "passed", 0, 1, 0
    ), diag  # fmt: skip
    assert late_s - 3 < diag["waited_s"] < late_s + 10, diag
    assert diag["diag_after_s"] == pytest.approx(10.0), diag
    assert late["diag"] is None, late  # the late rank never waited long
    out = (tmp_path / "rank0.out").read_text()
    assert re.search(r"rank 0 lane 0 epoch 2: still waiting for peer 1 after 1\d\.\d+ s", out), out
    assert re.search(r"rank 0 lane 0 epoch 2: peer 1 arrived, passed after \d\d\.\d+ s", out), out
    assert "trap" not in out
    for r in results:
        assert r["stats"]["barriers"] == 2, r


# ---------------------------------------------------------------------------------------------
# a live peer that never arrives: the host timeout


def _absent_peer(rank, world, out_dir, timeout_s):
    import torch.distributed as dist

    from tests.helpers import KVStep
    from vmmkv.ops import BarrierAborted

    _redirect_stdout(os.path.join(out_dir, f"rank{rank}.out"))
    device = _device(rank, world)
    result: dict = {}
    cache = _cache(device, barrier_timeout=timeout_s)
    kv = KVStep(cache, LAYERS, TOKENS)
    torch.cuda._sleep(1)
    _publish_step(kv)  # warm-up, every rank
    kv.sync()
    dist.barrier()
    if rank == 0:
        kv.load(KVStep.batch(7, torch.arange(TOKENS)))
        t0 = time.monotonic()
        _publish_step(kv)  # rank 1 never publishes this step
        torch.cuda.synchronize(device)  # returns once the watchdog aborted the wait
        error = None
        while error is None and time.monotonic() - t0 < timeout_s + 30:
            try:
                cache.stats()
                time.sleep(0.02)
            except BarrierAborted as exc:
                error = exc
        result["elapsed"] = time.monotonic() - t0
        result["error"] = str(error)
        result["peer"] = getattr(error, "peer", None)
        result["diag"] = str(cache._path._barrier.read_diagnostic(0))
        with pytest.raises(BarrierAborted, match="ReplicatedKVCache.store_layer"):
            _publish_step(kv)  # its first call, a store, raises already
        mla, idx = kv.bound[-1]
        with pytest.raises(BarrierAborted, match="ReplicatedKVCache.publish_layer"):
            cache.publish_layer(mla, idx, *kv.inputs, kv.slots)
        x = torch.arange(1000, device=device, dtype=torch.float32)
        result["context_ok"] = float(x.sum().item()) == 499500.0  # the context is usable
    dist.barrier()  # rank 1 waited here, alive, the whole time
    torch.cuda.synchronize(device)
    free_before = torch.cuda.mem_get_info(device)[0]
    cache.close()
    del kv, cache
    gc.collect()
    dist.barrier()  # both closed: no peer mapping holds a region any more
    torch.cuda.synchronize(device)
    result["freed"] = torch.cuda.mem_get_info(device)[0] - free_before
    return result


@requires_gpu
@pytest.mark.timeout(300)
def test_a_live_peer_that_never_arrives_is_named_after_the_host_timeout_and_close_works(
    tmp_path,
):
    timeout_s = 4.0
    res, _ = run_world(_absent_peer, 2, args=(str(tmp_path), timeout_s), timeout=200)
    assert res["peer"] == 1, res
    assert timeout_s - 0.5 < res["elapsed"] < timeout_s + 5, res
    err = res["error"]
    for want in (
        "rank 0 (cuda:",
        "ReplicatedKVCache.stats: vmmkv barrier aborted (lane 0 epoch 2",
        "waiting for peer rank 1",
        "did not arrive within the barrier timeout of 4 s",
    ):
        assert want in err, err  # fmt: skip
    assert "state=aborted" in res["diag"] and "missing peer=1" in res["diag"], res
    assert res["context_ok"], res
    assert res["freed"] >= 2 * (32 << 20), res  # its region went back to the device
    out = (tmp_path / "rank0.out").read_text()
    assert "rank 0 lane 0 epoch 2: aborted after" in out, out


# ---------------------------------------------------------------------------------------------
# one process, ranks as barrier objects (the kernels do not care which process signals)


def _signals(world: int, lanes: int, dev) -> tuple[list[torch.Tensor], torch.Tensor]:
    sigs = [torch.zeros(lanes * 2 * world, dtype=torch.int32, device=dev) for _ in range(world)]
    table = torch.tensor([s.data_ptr() for s in sigs], dtype=torch.int64, device=dev)
    return sigs, table


def _rows_target(dev, tokens: int, world_dests: int = 1):
    """A rows target of 656-byte entries in one local region (the publish's stores go there)."""
    from vmmkv.ops.kv import KVTarget

    nb, bs, e = max(4, tokens // 16 + 2), 16, 656
    region = torch.zeros(nb * bs * e, dtype=torch.uint8, device=dev)
    table = torch.tensor([region.data_ptr()], dtype=torch.int64, device=dev)
    target = KVTarget(
        "rows", table, 0, 0, nb, bs, bs * e, e, e,
        torch.tensor([region.numel()], dtype=torch.int64, device=dev),
        torch.zeros(1, dtype=torch.int32, device=dev), region,
    )  # fmt: skip
    rows = torch.randint(1, 255, (tokens, e), dtype=torch.uint8, device=dev)
    slots = torch.randperm(nb * bs, device=dev)[:tokens]
    return target, rows, slots


def _wait_broken(bar, limit_s: float):
    deadline = time.monotonic() + limit_s
    while bar.broken is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return bar.broken


@requires_gpu
@pytest.mark.parametrize("same_stream", [False, True], ids=["two-streams", "one-stream"])
def test_two_launches_on_one_lane_from_two_streams_fail_loudly(same_stream, capfd):
    from vmmkv.ops import DeviceBarrier, prepare, warm_up

    dev = torch.device("cuda", torch.cuda.current_device())
    warm_up(dev)
    world, tokens = 2, 64  # 8 CTAs: both grids resident at once
    sigs, table = _signals(world, 1, dev)
    bars = [
        DeviceBarrier(table, None, r, world, 1, dev, timeout_s=3.0, diag_after_s=0.5)
        for r in range(world)
    ]
    target, rows, slots = _rows_target(dev, tokens)
    pub = prepare((target,))
    gate, s0, s1, s2 = (torch.cuda.Stream(dev) for _ in range(4))
    torch.cuda._sleep(1)
    torch.cuda.synchronize()
    with torch.cuda.stream(gate):
        torch.cuda._sleep(20_000_000)  # both launches become ready at the same moment
        ready = torch.cuda.Event()
        ready.record()
    for s in (s0, s1):
        s.wait_event(ready)
    with torch.cuda.stream(s0):  # rank 0: two publishes on lane 0...
        pub.publish((rows,), slots, 0, bars[0], 0)
    with torch.cuda.stream(s0 if same_stream else s1):  # ...the second on another stream
        pub.publish((rows,), slots, 0, bars[0], 0)
    with torch.cuda.stream(s2):  # rank 1: its two barriers, in order
        torch.cuda._sleep(40_000_000)
        bars[1].arrive_and_wait(0)
        bars[1].arrive_and_wait(0)
    torch.cuda.synchronize()  # never hangs: aborted waits return
    if same_stream:
        assert [b.epochs.tolist() for b in bars] == [[2], [2]]
        assert all(b.broken is None and b.read_diagnostic() is None for b in bars)
    else:
        err = _wait_broken(bars[0], 2.0)
        assert err is not None, "the second launch on the lane went unnoticed"
        msg = str(err)
        assert "rank 0 (cuda:" in msg and "lane 0 was used by two launches at once" in msg, msg
        assert err.lane == 0, msg
        with pytest.raises(Exception, match="used by two launches at once"):
            bars[0].arrive_and_wait(0)
        out = capfd.readouterr().out
        assert "rank 0 lane 0 used by two launches at once" in out, out
    for b in bars:
        b.close()


@requires_gpu
@pytest.mark.parametrize("world", [3, 34, 40])
def test_timeout_records_are_complete_for_any_world_and_two_lanes_at_once(world, capfd):
    """Rank 0 of ``world`` ranks whose peers never arrive, lane 0 by the stand-alone barrier and
    lane 1 by a fused publish at the same time: each lane gets its own complete record (first
    "waiting" after the diagnostic delay, then "aborted" after the host timeout), one printf
    line each, and the waits return without a trap."""
    from vmmkv.ops import DeviceBarrier, prepare, warm_up

    dev = torch.device("cuda", torch.cuda.current_device())
    warm_up(dev)
    sigs, table = _signals(world, 2, dev)
    bar = DeviceBarrier(table, None, 0, world, 2, dev, timeout_s=1.5, diag_after_s=0.2)
    target, rows, slots = _rows_target(dev, 64)
    pub = prepare((target,))
    a, b = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    torch.cuda._sleep(1)
    torch.cuda.synchronize()
    t0 = time.monotonic()
    with torch.cuda.stream(a):
        bar.arrive_and_wait(0)
    with torch.cuda.stream(b):
        pub.publish((rows,), slots, 0, bar, 1)
    seen_waiting = set()
    while time.monotonic() - t0 < 1.2:
        for lane in (0, 1):
            rec = bar.read_diagnostic(lane)
            if rec is not None and rec.state == "waiting":
                seen_waiting.add(lane)
        time.sleep(0.02)
    assert seen_waiting == {0, 1}, seen_waiting
    torch.cuda.synchronize()  # the watchdog aborts both waits after 1.5 s
    elapsed = time.monotonic() - t0
    assert 1.4 < elapsed < 4.0, elapsed
    assert _wait_broken(bar, 2.0) is not None
    for lane in (0, 1):
        rec = bar.read_diagnostic(lane)
        assert rec is not None, lane
        assert (rec.state, rec.lane, rec.rank, rec.epoch, rec.world, rec.observed) == (
            "aborted", lane, 0, 1, world, 0
        ), rec  # fmt: skip
        assert 1 <= rec.missing_peer < world, rec
        assert 1.4 < rec.waited_s < 4.0 and rec.diag_after_s == pytest.approx(0.2), rec
    out = capfd.readouterr().out
    for lane in (0, 1):
        assert len(re.findall(rf"rank 0 lane {lane} epoch 1: still waiting for peer", out)) == 1
        assert len(re.findall(rf"rank 0 lane {lane} epoch 1: aborted after", out)) == 1, out
    assert "trap" not in out
    assert bar.epochs.tolist() == [1, 1] and bar.arrivals.tolist() == [0, 0]
    bar.close()


_TRAP_SCRIPT = """
import os, sys, torch
from vmmkv.ops import DeviceBarrier
W = int(sys.argv[1])
dev = torch.device("cuda", 0)
sigs = [torch.zeros(2 * W, dtype=torch.int32, device=dev) for _ in range(W)]
table = torch.tensor([s.data_ptr() for s in sigs], dtype=torch.int64, device=dev)
bar = DeviceBarrier(table, None, 0, W, 1, dev, timeout_s=0.3, trap=True)
bar.arrive_and_wait(0)
try:
    torch.cuda.synchronize()
    print("SYNCHRONIZE-RETURNED", flush=True)
except Exception as exc:
    print("SYNCHRONIZE-FAILED", type(exc).__name__, flush=True)
print("DIAG", bar.read_diagnostic(0), flush=True)
os._exit(3)
"""


@requires_gpu
@pytest.mark.parametrize("world", [2, 34])
def test_with_the_opt_in_trap_the_record_is_complete_before_the_trap(world):
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_TRAP_SCRIPT), str(world)], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 3 and "SYNCHRONIZE-FAILED" in out, out
    assert re.search(
        rf"DIAG vmmkv barrier timeout: lane=0 rank=0 missing peer=\d+ epoch=1 observed=0 "
        rf"world={world} state=trapped", out
    ), out  # fmt: skip
    # one reporter (the printf buffer may be lost with the trapped context, the record is not)
    assert len(re.findall(r"vmmkv barrier timeout: lane=0 rank=0 .*: trapping", out)) <= 1, out
