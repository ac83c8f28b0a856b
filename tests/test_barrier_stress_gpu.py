"""A publish stress with teeth.

Two ranks in two processes (one per GPU when there are two GPUs, else sharing GPU 0), over a
real ``SymmetricRegion`` (peer mappings) with a ``DeviceBarrier`` and a prepared rows store of
656-byte entries. The kernels are built with the test-only lag hook (``VMMKV_TEST_DEFINES=
VMMKV_TEST_LAG_NS=...``): in every fused publish, warp 7 of one CTA (picked from the epoch)
spins 0.5x-2x that long before its stores.

Round k, the same schedule on every rank (one seeded generator): T from {1, 3, 8, 9, 64, 1000,
4000, 16384} (the one-CTA path, two CTAs, a full and a capped grid), lane k % 2, the fused
publish 70 % of the time (else store + stand-alone barrier), a random skew
(``torch.cuda._sleep``) on one rank. Rows are a function of (round, rank, token, byte), never
zero; slots are a permutation inside slot set k % 2 of the rank (a round never overwrites rows
a peer may still check). After its barrier every rank compares, in kernels on its stream, its
replica at each peer's slots with that peer's rows recomputed, and counts mismatches on the
device. Then graphs of STEPS steps each (counter += 1; publish or store + barrier, lanes
alternating, T cycling, captured skew on some steps; check) are replayed with random eager skew
and eager barriers in between, for >= 10^5 replayed steps.

Pass: zero mismatches, every rank's epochs equal to the barrier count per lane, arrivals 0, no
record, not broken. ``test_..._catches_the_missing_presync`` runs the same stress on
``tests/mutants/mutant_no_presync.patch`` (no __syncthreads between a CTA's stores and its
arrival) and requires mismatches: the test's teeth. The relaxed-fence mutants
(``mutant_relaxed``, ``mutant_no_cta_fence``) are run and their outcome recorded (what the
hardware showed; the model requires the fences either way). Mutants are applied to a copy of
csrc/ (``VMMKV_CSRC_DIR``), never to the tree. Outcomes go to ``$OUT/stress-*.json`` when OUT
is set. Scale with VMMKV_STRESS_ROUNDS / VMMKV_STRESS_REPLAYS.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch

from vmmkv.testing.markers import requires_gpu
from vmmkv.testing.spawn import run_world

REPO = Path(__file__).resolve().parents[1]
MUTANTS = Path(__file__).resolve().parent / "mutants"
E = 656  # entry bytes (an fp8_ds_mla entry's size)
BS = 16
CAP = 16384  # tokens per (slot set, rank)
TS = (1, 3, 8, 9, 64, 1000, 4000, CAP)
STEPS = 100  # steps per captured graph
GRAPH_TS = (1, 9, 64, 1000, 3, 4000, 1, 8)
LAG_NS = 50_000


def apply_patch(patch: Path, root: Path) -> None:
    """Apply a unified diff (``a/csrc/...`` paths) to the tree under ``root``, hunk by hunk:
    each hunk's old lines must occur exactly once in the file (offsets do not matter)."""
    lines = patch.read_text().splitlines()
    i, target = 0, None
    while i < len(lines):
        line = lines[i]
        if line.startswith("+++ "):
            target = root / line[4:].split("\t")[0].split("/", 1)[1]
        elif line.startswith("@@"):
            old, new = [], []
            i += 1
            while i < len(lines) and not lines[i].startswith(("@@", "--- ")):
                tag, body = lines[i][:1], lines[i][1:]
                if tag in (" ", ""):
                    old.append(body)
                    new.append(body)
                elif tag == "-":
                    old.append(body)
                elif tag == "+":
                    new.append(body)
                i += 1
            text = target.read_text()
            a, b = "\n".join(old) + "\n", "\n".join(new) + "\n"
            if text.count(a) != 1:
                raise ValueError(f"{patch.name}: a hunk does not apply once to {target}")
            target.write_text(text.replace(a, b))
            continue
        i += 1


def _build_env(tmp: Path, mutant: str | None, lag_ns: int) -> dict[str, str]:
    # one kernel cache for every stress build: the key covers the sources and the defines
    cache = Path(tempfile.gettempdir()) / f"vmmkv-stress-kernels-{os.getuid()}"
    env = {"VMMKV_CACHE_DIR": str(cache), "CUDA_MODULE_LOADING": "EAGER"}
    if lag_ns:
        env["VMMKV_TEST_DEFINES"] = f"VMMKV_TEST_LAG_NS={lag_ns}"
    if mutant:
        src = tmp / "src"
        shutil.rmtree(src, ignore_errors=True)
        shutil.copytree(REPO / "csrc", src / "csrc")
        apply_patch(MUTANTS / f"{mutant}.patch", src)
        env["VMMKV_CSRC_DIR"] = str(src / "csrc")
    return env


class _Rank:
    """One rank's state: its replica (``region``, a uint8 view of ``nslots`` entries), the table
    of every rank's replica base, its barrier, its prepared rows store and device counters."""

    def __init__(self, rank, world, dev, ptr_table, committed, region, sig_table, stream):
        from vmmkv.ops import DeviceBarrier, KVTarget, prepare

        nslots = 2 * world * CAP
        self.rank, self.world, self.dev, self.stream = rank, world, dev, stream
        self.err = torch.zeros(1, dtype=torch.int32, device=dev)
        target = KVTarget(
            kind="rows", ptr_table=ptr_table, my_rank=rank, offset_bytes=0,
            num_blocks=nslots // BS, block_size=BS, block_stride=BS * E, entry_stride=E,
            entry_bytes=E, committed_bytes=committed, error_counter=self.err, cache=region,
        )  # fmt: skip
        self.bar = DeviceBarrier(sig_table, None, rank, world, 2, dev, timeout_s=120.0,
                                 fence=region)  # fmt: skip
        self.pub = prepare((target,))
        self.region = region
        self.table = region[: nslots * E].view(nslots, E)
        self.ar = torch.arange(CAP, device=dev, dtype=torch.int64)
        self.aj = torch.arange(E, device=dev, dtype=torch.int64)
        self.bad = torch.zeros((), dtype=torch.int64, device=dev)
        self.checked = torch.zeros((), dtype=torch.int64, device=dev)
        self.lanes = [0, 0]
        self.graph = self.counter = None

    def gen(self, k, r, t):
        """Rank ``r``'s rows and slots of round ``k`` (an int, or a 0-dim device tensor)."""
        i = self.ar[:t, None]
        rows = ((k * 131 + r * 17 + i * 7 + self.aj[None, :] * 3) % 251 + 1).to(torch.uint8)
        slots = ((k % 2) * self.world + r) * CAP + (self.ar[:t] * 7919 + k * 13) % CAP
        return rows, slots

    def step(self, k, t, lane, fused):
        rows, slots = self.gen(k, self.rank, t)
        if fused:
            self.pub.publish((rows,), slots, 0, self.bar, lane)
        else:
            self.pub.store((rows,), slots, 0)
            self.bar.arrive_and_wait(lane)
        self.lanes[lane] += 1
        for p in range(self.world):
            if p != self.rank:
                want, at = self.gen(k, p, t)
                self.bad.add_((self.table[at] != want).any(1).sum())
                self.checked.add_(t)

    def warm(self):
        """Load every kernel the loop uses before any barrier spins (lazy loading would wait)."""
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(1)
            for k in (0, torch.zeros((), dtype=torch.int64, device=self.dev)):
                rows, slots = self.gen(k, self.rank, CAP)
                self.bad.add_((self.table[slots] != rows).any(1).sum() * 0)
            self.region.fill_(0)

    def capture(self, counter):
        # the graph reads and increments ``counter`` at every replay: keep it alive (a freed
        # counter's memory would be handed to the next rank's counter, which both graphs would
        # then advance: every step's expected rows wrong on both ranks)
        self.counter = counter
        before = list(self.lanes)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.stream):
            with torch.cuda.graph(self.graph, stream=self.stream):
                for s in range(STEPS):
                    counter.add_(1)
                    if (s + self.rank) % 7 == 0:
                        torch.cuda._sleep(20_000)  # captured skew, different per rank
                    self.step(counter, GRAPH_TS[s % len(GRAPH_TS)], s % 2, (s // 2) % 2 == 0)
        self.per_replay = [self.lanes[i] - before[i] for i in (0, 1)]
        self.lanes[:] = before

    def result(self) -> dict:
        from vmmkv.ops import build

        opts = build.compile_options("sm_90", None)
        return {
            "rank": self.rank, "device": str(self.dev), "epochs": self.bar.epochs.tolist(),
            "expected_epochs": list(self.lanes), "arrivals": self.bar.arrivals.tolist(),
            "diag": str(self.bar.read_diagnostic()), "broken": str(self.bar.broken),
            "out_of_range": int(self.err.item()),
            "test_defines": [o for o in opts if o.startswith("-DVMMKV_TEST")],
            "csrc": os.environ.get("VMMKV_CSRC_DIR", "checkout"),
        }  # fmt: skip


def _drive(ranks: list[_Rank], world: int, cfg: dict, host_barrier) -> dict:
    """The rounds, then the graph replays, of the ranks this process runs (all of them in one
    process, or its own); every process draws the same schedule."""
    rng = random.Random(cfg["seed"])
    shuffle = random.Random(cfg["seed"] + 1)  # launch order across ranks of one process
    for r in ranks:
        r.warm()
    torch.cuda.synchronize()
    host_barrier()
    t0 = time.monotonic()
    for k in range(cfg["rounds"]):
        t, lane, fused = rng.choice(TS), k % 2, rng.random() < 0.7
        late, cycles = rng.randrange(world + 1), rng.choice((0, 2_000, 200_000, 2_000_000))
        for r in shuffle.sample(ranks, len(ranks)):
            with torch.cuda.stream(r.stream):
                if late == r.rank and cycles:
                    torch.cuda._sleep(cycles)
                r.step(k, t, lane, fused)
    torch.cuda.synchronize()
    out = {"eager": {"rounds": cfg["rounds"], "seconds": round(time.monotonic() - t0, 2),
                     "bad": sum(int(r.bad) for r in ranks),
                     "checked": sum(int(r.checked) for r in ranks)}, "graphs": None}  # fmt: skip
    replays = cfg["replays"]
    if replays:
        for r in ranks:
            r.bad.zero_()
            r.checked.zero_()
            r.capture(torch.full((), cfg["rounds"] + 10, dtype=torch.int64, device=r.dev))
        torch.cuda.synchronize()
        host_barrier()
        t0 = time.monotonic()
        for n in range(replays):
            late, cycles = rng.randrange(world + 1), rng.choice((0, 5_000, 100_000))
            for r in shuffle.sample(ranks, len(ranks)):
                with torch.cuda.stream(r.stream):
                    if late == r.rank and cycles:
                        torch.cuda._sleep(cycles)
                    r.graph.replay()
                    r.lanes[0] += r.per_replay[0]
                    r.lanes[1] += r.per_replay[1]
                    if n % 10 == 0:  # eager barriers between replays
                        r.bar.arrive_and_wait(n % 20 // 10)
                        r.lanes[n % 20 // 10] += 1
        torch.cuda.synchronize()
        out["graphs"] = {"replays": replays, "steps": replays * STEPS,
                         "seconds": round(time.monotonic() - t0, 2),
                         "bad": sum(int(r.bad) for r in ranks),
                         "checked": sum(int(r.checked) for r in ranks)}  # fmt: skip
    out["ranks"] = [r.result() for r in ranks]
    return out


def _one_process(rank: int, world: int, ranks_world: int, cfg: dict) -> dict:
    """``ranks_world`` ranks in this one process on one GPU, each on its own stream (their
    kernels run concurrently: what lets a lagged warp show on one GPU)."""
    from vmmkv.ops import warm_up

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    warm_up(dev)
    nslots = 2 * ranks_world * CAP
    regions = [torch.zeros(nslots * E, dtype=torch.uint8, device=dev) for _ in range(ranks_world)]
    ptrs = torch.tensor([x.data_ptr() for x in regions], dtype=torch.int64, device=dev)
    committed = torch.tensor([nslots * E], dtype=torch.int64, device=dev)
    sigs = [torch.zeros(2 * 2 * ranks_world, dtype=torch.int32, device=dev)
            for _ in range(ranks_world)]  # fmt: skip
    sig_table = torch.tensor([x.data_ptr() for x in sigs], dtype=torch.int64, device=dev)
    ranks = [
        _Rank(r, ranks_world, dev, ptrs, committed, regions[r], sig_table, torch.cuda.Stream(dev))
        for r in range(ranks_world)
    ]
    out = _drive(ranks, ranks_world, cfg, lambda: None)
    for r in ranks:
        r.graph = None
        r.bar.close()
    return out


def _own_process(rank: int, world: int, cfg: dict) -> dict:
    """This process is rank ``rank``: a real SymmetricRegion (peer mappings), one GPU per rank
    when there are enough, else all on GPU 0 (time-sliced between the processes)."""
    import torch.distributed as dist

    from vmmkv.ipc import SymmetricRegion
    from vmmkv.ops import warm_up

    dev = torch.device("cuda", rank if torch.cuda.device_count() >= world else 0)
    torch.cuda.set_device(dev)
    nslots = 2 * world * CAP
    region_bytes = -(-nslots * E // (2 << 20)) * (2 << 20)
    sr = SymmetricRegion(region_bytes, dev, initial_bytes=region_bytes, backend="cuda")
    try:
        warm_up(dev)
        me = _Rank(rank, world, dev, sr.peers.ptr_table, sr.committed_table, sr.region.tensor(),
                   sr.peers.signal_table, torch.cuda.Stream(dev))  # fmt: skip
        out = _drive([me], world, cfg, dist.barrier)
        torch.cuda.synchronize()
        dist.barrier()  # nobody unmaps while a peer may still read
        me.graph = None
        me.bar.close()
        return out
    finally:
        sr.close()


def run_stress(tmp: Path, mutant: str | None, rounds: int, replays: int, *,
               processes: bool, lag_ns: int = LAG_NS, seed: int = 1) -> dict:  # fmt: skip
    """The stress: two ranks in one process (``processes=False``, GPU 0) or in two processes.
    Writes ``$OUT/stress-<mutant>-<mode>.json`` when OUT is set; prints one summary line."""
    env = _build_env(tmp, mutant, lag_ns)
    cfg = {"rounds": rounds, "replays": replays, "seed": seed}
    mode = "processes" if processes else "one-process"
    if processes:
        per_rank = run_world(_own_process, 2, args=(cfg,), timeout=540, env=env)
        result = {
            "eager": {k: sum(p["eager"][k] for p in per_rank) for k in ("bad", "checked")},
            "graphs": None if not replays else
            {**{k: sum(p["graphs"][k] for p in per_rank) for k in ("bad", "checked")},
             "steps": per_rank[0]["graphs"]["steps"]},  # each rank replays the same steps
            "ranks": [p["ranks"][0] for p in per_rank],
            "seconds": [(p["eager"]["seconds"], (p["graphs"] or {}).get("seconds"))
                        for p in per_rank],
        }  # fmt: skip
        result["eager"]["rounds"] = rounds
    else:
        (result,) = run_world(_one_process, 1, args=(2, cfg), timeout=540, env=env,
                              init_group=False)  # fmt: skip
    result["mode"], result["mutant"] = mode, mutant or "real-kernels"
    out = os.environ.get("OUT")
    if out:
        Path(out, f"stress-{mutant or 'real'}-{mode}.json").write_text(json.dumps(result, indent=1))
    g = result["graphs"] or {}
    print(
        f"STRESS {mutant or 'real-kernels'} {mode}: eager {result['eager']['bad']} stale of "
        f"{result['eager']['checked']} rows checked in {rounds} rounds; graphs {g.get('bad')} "
        f"stale of {g.get('checked')} rows in {g.get('steps')} replayed steps; epochs "
        f"{[r['epochs'] for r in result['ranks']]}",
        flush=True,
    )
    return result


def _total_bad(result: dict) -> int:
    return result["eager"]["bad"] + ((result["graphs"] or {}).get("bad") or 0)


def _check_protocol(result: dict) -> None:
    for r in result["ranks"]:
        assert r["epochs"] == r["expected_epochs"], r
        assert r["arrivals"] == [0, 0] and r["out_of_range"] == 0, r
        assert r["diag"] == "None" and r["broken"] == "None", r
    assert result["ranks"][0]["epochs"] == result["ranks"][1]["epochs"]


def _rounds(default: int) -> int:
    return int(os.environ.get("VMMKV_STRESS_ROUNDS", default))


def _replays(default: int) -> int:
    return int(os.environ.get("VMMKV_STRESS_REPLAYS", default))


def test_the_mutant_patches_apply_to_a_copy_of_csrc_only(tmp_path):
    before = {p.name: p.read_text() for p in (REPO / "csrc").iterdir()}
    for patch in sorted(MUTANTS.glob("*.patch")):
        env = _build_env(tmp_path, patch.stem, 0)
        text = Path(env["VMMKV_CSRC_DIR"], "barrier.cuh").read_text()
        assert text != before["barrier.cuh"], patch.name
    assert {p.name: p.read_text() for p in (REPO / "csrc").iterdir()} == before


def _two_gpus() -> bool:
    return torch.cuda.device_count() >= 2


@requires_gpu
@pytest.mark.timeout(600)
def test_the_publish_stress_passes_on_the_real_kernels_with_the_lag_two_ranks_in_one_process(
    tmp_path,
):
    """Two ranks, two streams, one GPU: >= 10^5 graph-replayed steps in seconds."""
    result = run_stress(tmp_path, None, _rounds(2000), _replays(1000), processes=False)
    for r in result["ranks"]:
        assert r["test_defines"] == [f"-DVMMKV_TEST_LAG_NS={LAG_NS}"], r
    assert result["eager"]["bad"] == 0 and result["eager"]["checked"] > 0, result
    assert result["graphs"]["bad"] == 0 and result["graphs"]["steps"] >= 10**5, result
    assert result["graphs"]["checked"] > 0, result
    _check_protocol(result)


@requires_gpu
@pytest.mark.timeout(600)
def test_the_publish_stress_passes_on_the_real_kernels_with_the_lag_one_process_per_rank(
    tmp_path,
):
    """Real peer mappings (one process per GPU on two GPUs: the NVLink case; on one GPU the two
    processes are time-sliced, about 2 ms a barrier, so fewer rounds and replays there)."""
    full = _two_gpus()
    rounds = _rounds(2000 if full else 300)
    replays = _replays(1000) if full else 10
    result = run_stress(tmp_path, None, rounds, replays, processes=True)
    assert result["eager"]["bad"] == 0 and result["eager"]["checked"] > 0, result
    assert result["graphs"]["bad"] == 0 and result["graphs"]["steps"] == replays * STEPS, result
    _check_protocol(result)


@requires_gpu
@pytest.mark.timeout(600)
def test_the_publish_stress_catches_the_missing_presync_with_the_lag(tmp_path):
    """Two ranks in one process (their kernels overlap on one GPU); on two GPUs also one
    process per GPU (reported, and required to catch it too)."""
    result = run_stress(tmp_path, "mutant_no_presync", _rounds(2000), 0, processes=False)
    assert _total_bad(result) > 0, "the stress did not see the missing __syncthreads"
    for r in result["ranks"]:
        assert r["epochs"] == r["expected_epochs"], r  # stale rows, not a broken protocol
    if _two_gpus():
        result = run_stress(tmp_path, "mutant_no_presync", _rounds(2000), 0, processes=True)
        assert _total_bad(result) > 0, "across two GPUs the stress missed the missing presync"


@requires_gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mutant", ["mutant_relaxed", "mutant_no_cta_fence"])
def test_the_relaxed_fence_mutants_are_run_and_their_outcome_recorded(tmp_path, mutant):
    """No assertion on the stale rows: this records what the hardware showed (the PTX model
    requires the fences whatever it shows). One process per GPU on two GPUs (stores travel over
    NVLink), else two ranks in one process."""
    result = run_stress(tmp_path, mutant, _rounds(1500), _replays(300), processes=_two_gpus())
    print(f"OUTCOME {mutant} ({result['mode']}): {_total_bad(result)} stale rows", flush=True)
    for r in result["ranks"]:
        assert r["epochs"] == r["expected_epochs"], r
