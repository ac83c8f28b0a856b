"""Runs: one physical allocation per stretch of new chunks of each range a commit is given.

- Geometry (pure): each range gets runs of its own, cut at the run grid, skipping what is
  mapped; DeepSeek-V3.2's layer-major cache, padded as vLLM 0.34 pads it, commits its first
  8500 blocks in 122 runs of exactly vLLM's estimate (12,566 in runs of one 2 MiB chunk).
- Elastic releases (host regions, hypothesis): runs cut at a grid of chunks never keep more
  memory than a region whose chunks are that grid keeps, after any sequence of block sets.
- The region (host backend, one process): one ``create`` and one memfd per run; a shrink that
  ends inside a run keeps the run whole with its bytes; a regrow zeroes only what joins; a
  peer region maps the runs and drops them by the owner's rule; a model check of runs and
  bytes against a per-chunk model written independently of the region's interval arithmetic.
- The group (spawned ranks, host backend, gloo): DeepSeek-V3.2's 122 layer segments exchange
  one handle per run (122 at the null block, at the extend and at the wake), every peer maps
  its owner's runs and reads its bytes; the block-growth scenario of ``tests/test_segments.py``
  (stores from every rank, a CPU oracle of every replica, a grow failing at a run's creation or
  at a peer's mapping rolled back on every rank) with runs of two chunks and with uncut runs;
  by-value handles (the host simulation of fabric handles) across three simulated hosts; a peer
  killed at a step of a grow, a shrink or a close, named by the survivors, which release
  everything (``tests/test_faults.py``'s scenario with runs).
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import fd_count, map_all_chunks, random_bytes
from tests.test_alloc_unmap import _mapped_offsets
from tests.test_segments import _RANGE_OPS
from vmmkv import _blockset as blockset
from vmmkv.alloc import Chunk, VirtualRegion
from vmmkv.alloc.geometry import covering_chunks, plan_runs
from vmmkv.ops.formats import INDEXER_ENTRY_BYTES, MLA_ENTRY_BYTES
from vmmkv.testing.markers import requires_gpu
from vmmkv.testing.spawn import run_world, run_world_raw

BS = 64
MLA_PAGE, IDX_PAGE = BS * MLA_ENTRY_BYTES, BS * INDEXER_ENTRY_BYTES  # 41,984 and 8,448 bytes
GRANULE = 2 << 20  # CUDA's granule, and vLLM's padding of layer-major segments


def _g() -> int:
    return os.sysconf("SC_PAGE_SIZE")


def _up(x: int, m: int) -> int:
    return -(-x // m) * m


def vllm_lbnhc(layers: int, capacity: int, granule: int = GRANULE) -> tuple[list, int]:
    """(segments, bytes) of DeepSeek-V3.2's LBNHC cache of ``capacity`` blocks as vLLM 0.34
    lays it out under its extensible cache: every layer's indexer region, then every layer's
    MLA region, each starting on the granule (``pad_kv_cache_segments``)."""
    segs, off = [], 0
    for page in (IDX_PAGE,) * layers + (MLA_PAGE,) * layers:
        segs.append((off, page))
        off += _up(capacity * page, granule)
    return segs, off


def _ranges(segs, blocks):
    return [(off, off + blocks * page) for off, page in segs]


# --------------------------------------------------------------------------------------------
# geometry
# --------------------------------------------------------------------------------------------


def test_each_range_gets_runs_of_its_own_cut_at_the_run_grid_skipping_what_is_mapped():
    g = 4096
    ranges = [(0, 5 * g + 1), (5 * g + 1, 7 * g), (20 * g, 20 * g), (9 * g, 13 * g)]
    runs = plan_runs(ranges, [Chunk(2 * g, g)], g, 4 * g, 32 * g)
    # the first range: chunks 0-5 without the mapped 2, cut at 4g; the second: chunk 6 only
    # (5 is the first range's); the empty range: nothing; the last: 9-12, cut at 12g
    assert runs == [
        Chunk(0, 2 * g), Chunk(3 * g, g), Chunk(4 * g, 2 * g), Chunk(6 * g, g),
        Chunk(9 * g, 3 * g), Chunk(12 * g, g),
    ]  # fmt: skip
    # runs of one chunk: the grid's own chunks
    assert plan_runs([(g, 3 * g)], [], g, g, 8 * g) == [Chunk(g, g), Chunk(2 * g, g)]
    # the last run is cut at the capacity, which need not be a multiple of the chunk
    assert plan_runs([(0, 10 * g)], [], 4 * g, 8 * g, 10 * g) == [
        Chunk(0, 8 * g),
        Chunk(8 * g, 2 * g),
    ]
    with pytest.raises(ValueError, match="not a multiple of chunk_bytes"):
        plan_runs([(0, g)], [], 2 * g, 3 * g, 8 * g)
    with pytest.raises(ValueError, match=r"ranges\[0\] = \(0, 9\) is not inside"):
        plan_runs([(0, 9)], [], 1, 1, 8)


def test_a_first_commit_of_deepseek_v32s_layer_major_cache_is_122_runs_of_vllms_estimate():
    """9000 blocks reserved, 8500 committed (the extend of bench_extensible_gpu): the runs are
    one per layer segment and their bytes are vLLM's ``physical_bytes_for`` (each segment's
    blocks rounded up to the granule); in runs of one granule the same commit is 12,566."""
    segs, size = vllm_lbnhc(61, 9000)
    estimate = sum(_up(8500 * page, GRANULE) for _, page in segs)
    runs = plan_runs(_ranges(segs, 8500), [], GRANULE, size, size)
    assert len(runs) == 122 and sum(c.size for c in runs) == estimate == 26_352_812_032
    assert len(plan_runs(_ranges(segs, 8500), [], GRANULE, GRANULE, size)) == 12_566
    # vLLM's order: the null block at allocation, then the extend: 122 runs each time
    first = plan_runs(_ranges(segs, 1), [], GRANULE, size, size)
    assert len(first) == 122
    assert len(plan_runs(_ranges(segs, 8500), first, GRANULE, size, size)) == 122


# --------------------------------------------------------------------------------------------
# elastic releases: runs cut at a grid keep no more than that grid of chunks
# --------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_RANGE_OPS)
def test_runs_cut_at_the_elastic_grid_never_keep_more_than_that_grid_of_chunks(ops):
    """One block-major segment (blocks of 3 pages and a bit, 17 bytes in), moved through block
    sets as the resize protocol moves it (a grow to the union, then the release): a region of
    page chunks in runs cut at 8 pages (elastic mode's 64 MiB over 2 MiB granules, scaled) and a
    region of 8-page chunks (the grid) follow the same sets. After every step the runs' bytes
    lie inside the grid's, cover every block of the set, and each run lies in one grid cell."""
    g = _g()
    grid, block, seg = 8 * g, 3 * g + 123, 17
    cap = _up(seg + 40 * block, grid)
    with (
        VirtualRegion(cap, backend="host", chunk_bytes=g, run_bytes=grid) as runs,
        VirtualRegion(cap, backend="host", chunk_bytes=grid) as cells,
    ):
        held: blockset.BlockSet = ()
        for _, spec in ops:  # each step's block set: (start, count) intervals within 40 blocks
            target = blockset.block_set([(a, min(a + n, 40)) for a, n in spec], 40)
            for r in (runs, cells):
                r.commit_ranges([(seg + a * block, seg + b * block) for a, b in
                                 blockset.union(held, target)])  # fmt: skip
                r.decommit_outside([(seg + a * block, seg + b * block) for a, b in target])
            held = target
            kept = [(c.offset, c.offset + c.size) for c in runs.chunks()]
            assert runs.committed_bytes <= cells.committed_bytes
            assert sum(hi - lo for lo, hi in cells.mapped_parts(kept)) == runs.committed_bytes
            assert all(runs.covers(seg + a * block, seg + b * block) for a, b in held)
            assert all(c.offset // grid == (c.offset + c.size - 1) // grid for c in runs.chunks())


# --------------------------------------------------------------------------------------------
# the region, one process
# --------------------------------------------------------------------------------------------


def test_a_commit_creates_one_allocation_per_run_and_a_shrink_inside_a_run_keeps_it_whole():
    g = _g()
    before = fd_count()
    with VirtualRegion(16 * g, backend="host", chunk_bytes=g, run_bytes=16 * g) as r:
        backend = r._backend
        real, sizes = backend.create, []
        backend.create = lambda size: sizes.append(size) or real(size)
        added = r.commit_ranges([(10, 3 * g + 5), (8 * g, 10 * g)])
        assert added == [Chunk(0, 4 * g), Chunk(8 * g, 2 * g)] == r.chunks()
        assert sizes == [4 * g, 2 * g] and fd_count() == before + 2  # one memfd per run
        t = r.tensor()
        assert int(t[: 4 * g].count_nonzero()) == 0 and int(t[8 * g : 10 * g].count_nonzero()) == 0
        data = random_bytes(4 * g, 1)
        t[: 4 * g].copy_(data)
        # a release that keeps one byte of a run keeps the whole run, bytes included
        assert r.decommit_outside([(0, 1)]) == [Chunk(8 * g, 2 * g)]
        assert r.chunks() == [Chunk(0, 4 * g)] and torch.equal(t[: 4 * g], data)
        assert _mapped_offsets(r.base_ptr, 16 * g, g) == {0, 1, 2, 3}
        # what a run holds is not committed again; the prefix API adds one run past it
        assert r.plan_runs([(0, 6 * g)]) == [Chunk(4 * g, 2 * g)]
        assert r.commit(6 * g) == [Chunk(4 * g, 2 * g)] and sizes == [4 * g, 2 * g, 2 * g]
        assert r.mapped_parts([(3 * g, 5 * g), (7 * g, 9 * g)]) == [(3 * g, 5 * g)]
        assert r.covers(0, 6 * g) and not r.covers(5 * g, 7 * g) and r.covers(9, 9)
        with r.open_peer() as peer:
            map_all_chunks(r, peer)
            assert torch.equal(peer.tensor()[: 4 * g], data)
            # the owner's rule on both sides: a run stays while a range needs a byte of it
            assert peer.unmap_outside([(g, g + 1)]) == [Chunk(4 * g, 2 * g)]
            assert r.decommit(g + 1) == [Chunk(4 * g, 2 * g)]
            assert peer.chunks() == r.chunks() == [Chunk(0, 4 * g)]
        assert fd_count() == before + 1
    assert fd_count() == before
    with pytest.raises(ValueError, match="run_bytes=3 is not a multiple of chunk_bytes"):
        VirtualRegion(4 * g, backend="host", chunk_bytes=g, run_bytes=3)


def _model_commit(runs, ranges, chunk, run, capacity):
    """The runs a commit adds, by a per-chunk loop (the oracle of ``plan_runs``)."""
    held = {
        k for c in runs for k in range(c.offset // chunk, _up(c.offset + c.size, chunk) // chunk)
    }
    new = []
    for start, end in ranges:
        cur = None
        for k in range(start // chunk, _up(end, chunk) // chunk if end > start else start // chunk):
            if k in held:
                cur = None
                continue
            held.add(k)
            lo, hi = k * chunk, min((k + 1) * chunk, capacity)
            if cur is not None and cur[1] == lo and lo % run:
                cur[1] = hi
            else:
                cur = [lo, hi]
                new.append(cur)
    return [Chunk(lo, hi - lo) for lo, hi in new]


def _model_keep(runs, ranges):
    return [
        c for c in runs if any(a < b and a < c.offset + c.size and c.offset < b for a, b in ranges)
    ]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_RANGE_OPS, run=st.sampled_from([1, 3, 16]))
def test_runs_and_bytes_follow_a_per_chunk_model_through_commits_releases_and_writes(ops, run):
    """``test_segments``' operations (ranges in quarter pages) on page chunks in runs cut at
    ``run`` pages (1: a run per chunk): the runs a per-chunk model predicts, new runs reading
    zero, kept runs keeping their bytes, released runs gone."""
    g = _g()
    quarter, cap = g // 4, 11 * g
    model = torch.zeros(cap, dtype=torch.uint8)
    runs: list[Chunk] = []
    with VirtualRegion(cap, backend="host", chunk_bytes=g, run_bytes=run * g) as r:
        t = r.tensor()
        for step, (op, spec) in enumerate(ops):
            ranges = [(min(a * quarter, cap), min((a + n) * quarter, cap)) for a, n in spec]
            if op == "write":
                for lo, hi in r.mapped_parts(ranges):
                    data = random_bytes(hi - lo, step)
                    t[lo:hi].copy_(data)
                    model[lo:hi] = data
            elif op == "commit":
                new = _model_commit(runs, ranges, g, run * g, cap)
                assert r.commit_ranges(ranges) == sorted(new, key=lambda c: c.offset)
                runs = sorted(runs + new, key=lambda c: c.offset)
                for c in new:
                    model[c.offset : c.offset + c.size] = 0
            else:
                kept = _model_keep(runs, ranges)
                assert r.decommit_outside(ranges) == [c for c in runs if c not in kept]
                runs = kept
            assert r.chunks() == runs
            for c in runs:
                assert torch.equal(
                    t[c.offset : c.offset + c.size], model[c.offset : c.offset + c.size]
                )


# --------------------------------------------------------------------------------------------
# the group: DeepSeek-V3.2's layer-major cache, one handle per run
# --------------------------------------------------------------------------------------------

DS_CAPACITY, DS_EXTEND = 16, 12  # blocks reserved, blocks of the extend


def _pattern(rank, n, salt):
    gen = torch.Generator().manual_seed(1009 * rank + salt)
    return torch.randint(1, 256, (n,), generator=gen, dtype=torch.uint8)


def _deepseek_handles(rank, world):
    """vLLM's order over 61 layers' 122 segments (padded onto 2 MiB), page chunks in uncut
    runs: the null block, the extend, a sleep and a wake. Per step: the handles this rank
    exported, its runs, whether every peer maps exactly its owner's runs, and whether every
    replica read here holds its owner's bytes (written after the extend; zero after the wake)."""
    import torch.distributed as dist

    from vmmkv.ipc import SymmetricRegion, transports

    segs, size = vllm_lbnhc(61, DS_CAPACITY)
    exported = []
    real = transports._FdTransport.export
    transports._FdTransport.export = lambda self, owner, c: (
        exported.append(c) or real(self, owner, c)
    )
    out = {}
    with SymmetricRegion(size, "cpu", dist.group.WORLD, chunk_bytes=_g(), run_bytes=size,
                         backend="host", timeout=60) as sr:  # fmt: skip
        sr.set_block_layout(segs, DS_CAPACITY)
        for step, blocks in (("null block", 1), ("extend", DS_EXTEND), ("sleep", 0),
                             ("wake", DS_EXTEND)):  # fmt: skip
            exported.clear()
            sr.resize_blocks(blocks)
            own = [(c.offset, c.size) for c in sr.region.chunks()]
            everyone = [None] * world
            dist.all_gather_object(everyone, own)
            peers_ok = all(
                [(c.offset, c.size) for c in sr.peers.mapped_chunks(q)] == everyone[q]
                for q in range(world)
            )
            bytes_ok = None
            if step == "extend":  # every rank writes its blocks; every replica is read here
                for i, (lo, hi) in enumerate(_ranges(segs, blocks)):
                    sr.view(rank, reserve=True)[lo:hi].copy_(_pattern(rank, hi - lo, i))
                dist.barrier()
                bytes_ok = all(
                    torch.equal(sr.view(q, reserve=True)[lo:hi], _pattern(q, hi - lo, i))
                    for q in range(world)
                    for i, (lo, hi) in enumerate(_ranges(segs, blocks))
                )
                dist.barrier()
            elif step == "wake":
                bytes_ok = all(
                    int(sr.view(q, reserve=True)[lo:hi].count_nonzero()) == 0
                    for q in range(world)
                    for lo, hi in _ranges(segs, blocks)
                )
            out[step] = {"handles": len(exported), "runs": len(own), "peers": peers_ok,
                         "bytes": bytes_ok, "memory": sr.committed_bytes}  # fmt: skip
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_deepseek_v32s_122_layer_segments_exchange_one_handle_per_run(world):
    segs, _ = vllm_lbnhc(61, DS_CAPACITY)
    g = _g()
    extend = sum(_up(DS_EXTEND * p, g) for _, p in segs)
    out = run_world(_deepseek_handles, world, timeout=160)
    for rank, o in enumerate(out):
        want = {
            "null block": (122, 122, sum(_up(p, g) for _, p in segs)),
            "extend": (122, 244, extend),  # the tail of every segment: one run each
            "sleep": (0, 0, 0),
            "wake": (122, 122, extend),  # every segment in one run
        }
        for step, (handles, runs, memory) in want.items():
            s = o[step]
            assert (s["handles"], s["runs"], s["memory"]) == (handles, runs, memory), (
                rank,
                step,
                s,
            )
            assert s["peers"] and s["bytes"] is not False, (rank, step, s)
        assert o["extend"]["bytes"] and o["wake"]["bytes"], (rank, o)


# --------------------------------------------------------------------------------------------
# the group: tests/test_segments.py's block-growth scenario with runs
# --------------------------------------------------------------------------------------------


def _runs_scenario(rank, world, fail_at, run_chunks, backend="host"):
    """``test_segments._scenario`` on ``backend`` with the cache's runs cut at ``run_chunks``
    chunks (None: uncut) and its oracle keeping runs (``_RunReplica``). Returns the scenario's result and
    the bytes the own memory held beyond the chunks covering the blocks, after each shrink."""
    import vmmkv
    from tests import test_segments as ts

    real = vmmkv.ReplicatedKVCache

    def cache(*args, **kw):
        if "chunk_bytes" in kw:  # the scenario's cache, not its one-rank warm-up
            kw["run_bytes"] = kw["chunk_bytes"] * run_chunks if run_chunks else args[1]
        return real(*args, **kw)

    class _RunReplica(ts._Replica):
        """The oracle's own memory is the runs of a per-chunk model (``_model_commit``):
        a fresh run reads zero, a kept run keeps its bytes, the blocks that join read zero."""

        beyond: list[int] = []

        def __init__(self, c, setup):
            super().__init__(c, setup)
            self.runs: list[Chunk] = []

        def expected_chunks(self, blocks):
            return list(self.runs)

        def resized(self, blocks):
            run = self.cache.region.region.run_bytes
            if blocks > self.blocks:
                new = _model_commit(self.runs, self.ranges(blocks), self.setup.chunk, run,
                                    self.setup.capacity)  # fmt: skip
                for c in new:
                    self.model[c.offset : c.offset + c.size] = 0
                self.runs = sorted(self.runs + new, key=lambda c: c.offset)
            else:
                self.runs = _model_keep(self.runs, self.ranges(blocks))
                cover = covering_chunks(self.ranges(blocks), self.setup.chunk, self.setup.capacity)
                _RunReplica.beyond.append(
                    sum(c.size for c in self.runs) - sum(c.size for c in cover)
                )
            self.zero_exposed(blocks)
            self.blocks = blocks

    vmmkv.ReplicatedKVCache = cache
    ts._Replica = _RunReplica
    return ts._scenario(rank, world, backend, fail_at), _RunReplica.beyond


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "world,fail_at,run_chunks",
    [(2, "commit", 2), (2, "exchange", None), (3, "exchange", 2), (3, "commit", None)],
)
def test_block_growth_in_runs_stores_byte_exact_and_a_grow_failing_at_a_run_rolls_back(
    world, fail_at, run_chunks
):
    out = run_world(_runs_scenario, world, args=(fail_at, run_chunks), timeout=270)
    cause = "injected out of memory" if fail_at == "commit" else "injected mapping failure"
    for rank, ((failure, baseline, after), beyond) in enumerate(out):
        assert failure[0] == "raised", (rank, failure)
        assert cause in failure[1] and f"ranks [{world - 1}]" in failure[1], (rank, failure)
        assert after == baseline, (rank, baseline, after)  # fds, memfds, mappings, reservations
        assert max(beyond) > 0, beyond  # a shrink ended inside a run: it stayed whole


@requires_gpu
@pytest.mark.timeout(300)
def test_a_graph_captured_before_growth_in_runs_replays_into_every_replica_on_cuda():
    """``test_segments``' CUDA case in uncut runs: the layer publications are captured once,
    before growing by blocks; every replay after each grow and shrink writes the reference
    bytes into every replica's committed blocks (the oracle of each own run's bytes)."""
    out = run_world(_runs_scenario, 2, args=(None, None, "cuda"), timeout=270)
    for (failure, baseline, after), _ in out:
        assert failure is None
        for key in ("memfds", "memfd_maps", "reservations"):  # none on CUDA, before or after
            assert after[key] == baseline[key], (key, baseline, after)


# --------------------------------------------------------------------------------------------
# by-value handles (the host simulation), three simulated hosts
# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_runs_travel_by_value_across_three_simulated_hosts(tmp_path, monkeypatch):
    """``test_fabric_sim``'s segmented cycle (two segments of 1.5-page blocks, by-value handles
    across three simulated hosts) in runs as long as the region: one run per segment, a shrink
    inside them keeps them, the blocks that join read zero, a wake maps each segment whole."""
    from tests.helpers import ShmLedger
    from tests.test_fabric_sim import _segments_cycle

    ledger = ShmLedger(tmp_path / "shm-names").enable(monkeypatch)
    g = _g()
    out = run_world(_segments_cycle, 3, args=(16 * g,), timeout=100)
    for o in out:
        assert o["grow"] == [] and o["after_shrink"] == [], o
        assert o["chunks"] == [[(0, 5 * g), (8 * g, 5 * g)]] * 3, o  # 3 blocks: 4.5 pages each
        assert o["shrunk_chunks"] == o["chunks"], o
        assert all(o["regrown_zero"]), o
        assert o["woken_chunks"] == [[(0, 6 * g), (8 * g, 6 * g)]] * 3, o
        assert o["leaks"] == (0, 0, 0), o
    assert ledger.names() and ledger.left() == [], ledger.left()


# --------------------------------------------------------------------------------------------
# a peer killed during a grow, a shrink or a close of a region in runs
# --------------------------------------------------------------------------------------------


def _killed_with_runs(rank, world, point, marker):
    """``test_faults._killed_at`` with the caches in runs as long as the capacity (8 chunks):
    the grow from 2 to 4 chunks adds one run, the shrink from 4 to 2 ends inside the one run
    the cache started with (its peers' unmap is called and unmaps nothing)."""
    from tests import test_faults as tf

    real = tf._cache

    def cache(backend, device, initial_chunks, group=None, **kw):
        return real(backend, device, initial_chunks, group=group,
                    run_bytes=8 * tf._chunk(backend, device), **kw)  # fmt: skip

    tf._cache = cache
    return tf._killed_at(rank, world, "host", point, marker)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("point", ["grow-after-commit", "grow-after-mapping", "shrink", "close"])
def test_a_peer_killed_at_a_step_of_a_region_in_runs_is_named_and_everything_is_released(
    point, world, tmp_path
):
    from tests import test_faults as tf

    marker = tmp_path / "killed-at"
    res = run_world_raw(_killed_with_runs, world, args=(point, str(marker)), timeout=150)
    assert res[-1].exitcode == -signal.SIGKILL, (res[-1].exitcode, res[-1].error)
    assert marker.read_text() == tf.POINTS[point][2]
    tf._assert_survivors_named_the_victim(res, "host", point)


# --------------------------------------------------------------------------------------------
# the plugin's geometry under vLLM's extensible cache (pure: no vLLM, no driver)
# --------------------------------------------------------------------------------------------


def test_the_plugin_commits_in_granules_in_runs_cut_at_elastic_modes_chunk_or_the_envs_grid():
    from vmmkv.integrations.vllm._buffer import _chunk_and_runs

    size = 26_352_812_032  # DeepSeek-V3.2's 122 padded segments of 9000 blocks, 2 MiB each
    # default: granule chunks (vLLM's estimate exact), runs as long as the cache
    assert _chunk_and_runs(GRANULE, size, None, None) == (GRANULE, size)
    assert _chunk_and_runs(GRANULE, size + 1, None, None) == (GRANULE, size + GRANULE)
    # elastic mode: runs cut at its 64 MiB chunk (its releases return what that grid returns)
    assert _chunk_and_runs(GRANULE, size, 64 << 20, None) == (GRANULE, 64 << 20)
    assert _chunk_and_runs(4096, size, (64 << 20) + 1, None) == (4096, (64 << 20) + 4096)
    # VMMKV_CHUNK_MIB: that grid, one allocation per chunk, elastic or not
    assert _chunk_and_runs(GRANULE, size, 64 << 20, 8 << 20) == (8 << 20, 8 << 20)
    assert _chunk_and_runs(GRANULE, size, None, 2 << 20) == (2 << 20, 2 << 20)
