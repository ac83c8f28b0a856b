"""Holes: a block layout committed as a set of block intervals, not only a prefix.

- Block sets (``vmmkv._blockset``): canonical form, difference, membership.
- The cache (spawned ranks, host backend, 2 and 3 ranks, gloo): a layer-major layout of MLA and
  indexer segments (two page sizes, no segment start chunk-aligned) fully committed and
  poisoned with random non-zero bytes, then moved through block sets with holes: a middle hole
  released, several holes at once (one of them a block taken back), a grow that fails (at the
  commit or in the exchange) rolled back on every rank to the holed set, the hole recommitted.
  At every step every replica equals the pure-torch reference inserts on a CPU oracle (blocks
  that stay keep their bytes, recommitted ones read zero, stores beyond the top are skipped
  and counted), the own chunks are exactly those covering the set in some segment, every rank
  maps exactly its peers' chunks, and every rank reads the same bytes of every replica.
- Refusals on every rank: a set that differs between ranks (naming the rank), a set outside
  the layout, a set on a prefix region, ``direction`` contradicted; an fd budget that cannot
  hold a recommit refused before any chunk is created.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import random_bytes
from tests.test_alloc_unmap import _mapped_offsets
from tests.test_segments import (
    BS,
    IDX_PAGE,
    LAYERS,
    MLA_PAGE,
    _inject,
    _lbnhc,
    _outcome,
    _Replica,
    _resources,
    _Setup,
)
from vmmkv import _blockset as blockset
from vmmkv.alloc.region import covering_chunks
from vmmkv.testing.spawn import run_world

# --------------------------------------------------------------------------------------------
# block sets
# --------------------------------------------------------------------------------------------


def test_a_block_set_is_sorted_merged_and_stripped_of_empty_intervals():
    got = blockset.block_set([(8, 12), [0, 3], (3, 4), (10, 14), (20, 20)], 32)
    assert got == ((0, 4), (8, 14))
    assert blockset.block_set([], 4) == () and blockset.prefix(0) == ()
    assert blockset.as_prefix(((0, 5),)) == 5 and blockset.as_prefix(((1, 5),)) is None
    assert blockset.as_set(7) == ((0, 7),) and blockset.as_set([(1, 2)]) == ((1, 2),)
    assert blockset.top(got) == 14 and blockset.count(got) == 10


@pytest.mark.parametrize(
    "intervals,exc,match",
    [
        ("0-4", TypeError, "sequence of"),
        ([(0, 4, 5)], TypeError, r"block set\[0\]"),
        ([(0, 4.0)], TypeError, r"block set\[0\] end must be an int"),
        ([(3, 2)], ValueError, r"\(3, 2\) is not inside \[0, max_blocks=8\]"),
        ([(0, 9)], ValueError, "max_blocks=8"),
        ([(-1, 2)], ValueError, "max_blocks=8"),
    ],
)
def test_a_bad_block_set_is_refused_naming_the_interval(intervals, exc, match):
    with pytest.raises(exc, match=match):
        blockset.block_set(intervals, 8)


def test_difference_subset_and_membership_agree_with_python_sets():
    gen = torch.Generator().manual_seed(3)
    for _ in range(200):
        a, b = (
            blockset.block_set(
                [tuple(sorted(torch.randint(0, 40, (2,), generator=gen).tolist())) for _ in "abc"],
                40,
            )
            for _ in "ab"
        )
        sa = {i for s, e in a for i in range(s, e)}
        sb = {i for s, e in b for i in range(s, e)}
        assert {i for s, e in blockset.difference(a, b) for i in range(s, e)} == sa - sb
        assert {i for s, e in blockset.union(a, b) for i in range(s, e)} == sa | sb
        assert blockset.is_subset(a, b) == (sa <= sb)
        assert all(blockset.contains(a, i) == (i in sa) for i in range(41))


# --------------------------------------------------------------------------------------------
# the cache over spawned ranks
# --------------------------------------------------------------------------------------------


class _Holed(_Replica):
    """``_Replica``'s oracle with a committed block set ``held`` in place of a count."""

    def __init__(self, cache, setup):
        super().__init__(cache, setup)
        self.held: blockset.BlockSet = ()

    def set_ranges(self, held):
        return [(off + a * page, off + b * page) for off, page in self.segments for a, b in held]

    def set_chunks(self, held):
        return covering_chunks(self.set_ranges(held), self.setup.chunk, self.setup.capacity)

    def moved(self, held):
        """After a change to ``held``: fresh chunks read zero, and so do the blocks that joined
        the set in chunks that stayed committed; blocks that stay keep their bytes."""
        old = {c.offset for c in self.set_chunks(self.held)}
        for c in self.set_chunks(held):
            if c.offset not in old:
                self.model[c.offset : c.offset + c.size] = 0
        self.zero_joined(held)
        self.held, self.blocks = held, blockset.top(held)

    def zero_joined(self, held):
        for lo, hi in self.set_ranges(blockset.difference(held, self.held)):
            self.model[lo:hi] = 0

    def slots_for(self, rank, step):
        """As ``_Replica``'s, but only in blocks of the set or at/after its top (skipped and
        counted there): a slot in a hole below the top would not be skipped (the bound is the
        top), which is why the engine never hands such a block out."""
        slots = super().slots_for(rank, step)
        blocks = slots // BS
        ok = (slots < 0) | (blocks >= self.blocks)
        for a, b in self.held:
            ok |= (blocks >= a) & (blocks < b)
        return torch.where(ok, slots, -1)

    def own_chunks(self):
        return self.cache.region.region.chunks()

    def check(self, what):
        assert self.cache.committed_block_set == self.held, (self.rank, what)
        want = self.set_chunks(self.held)
        assert self.own_chunks() == want, (self.rank, what)
        sr = self.cache.region
        for q in range(self.world):
            if q != self.rank:
                assert sr.peers.mapped_chunks(q) == want, (self.rank, q, what)
                gran = self.setup.granularity
                pages = _mapped_offsets(sr.peers.ptrs[q], self.setup.capacity, gran)
                assert pages == {
                    (c.offset + i) // gran for c in want for i in range(0, c.size, gran)
                }, (self.rank, q, what)
        # the parent checks bytes, bounds (the top), out-of-range counts and the digests of
        # every replica over the ranks, on the chunks it expects: those of the set here
        self.expected_chunks = lambda _blocks: want
        try:
            super().check(what)
        finally:
            del self.expected_chunks


def _holes(rank, world, fail_at):
    import gc

    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache

    device = torch.device("cpu")
    setup = _Setup("host", device)
    ReplicatedKVCache(dist.group.WORLD, setup.chunk, device, backend="host").close()  # warm-up
    baseline = _resources()
    out = _holes_cache(rank, world, fail_at, setup)
    gc.collect()
    return out, baseline, _resources()


def _holes_cache(rank, world, fail_at, setup):
    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache

    nb = setup.max_blocks  # 6
    cache = ReplicatedKVCache(
        dist.group.WORLD, setup.capacity, "cpu", chunk_bytes=setup.chunk, timeout=10.0,
        direct=True, backend="host",
    )  # fmt: skip
    rep = _Holed(cache, setup)
    cache.set_block_layout(rep.segments, nb)
    rep.bind()
    out = {}
    full = ((0, nb),)
    assert cache.set_committed_blocks([(0, nb)], direction="grow") == full
    rep.moved(full)
    rep.poison(seed=7 * (rank + 1))
    rep.check("all blocks committed")
    kv_c, k_pe, k = rep.inputs
    counter = {"step": 0}

    def publish(what):
        counter["step"] += 1
        batches = [rep.batch(q, counter["step"]) for q in range(world)]
        rep.load(batches[rank])
        for mla, idx in rep.bound:
            cache.publish_layer(mla, idx, kv_c, k_pe, k, rep.slots)
        rep.apply(batches, gathered=False)
        rep.check(what)

    def gather_store(what):
        counter["step"] += 1
        batches = [rep.batch(q, counter["step"]) for q in range(world)]
        for mla, idx in rep.bound:
            cache.store_layer(mla, idx, *batches[rank], mode="gather")
        rep.apply(batches, gathered=True)
        rep.check(what)

    for mla, idx in rep.bound:  # eager warm-up (padding only)
        cache.publish_layer(mla, idx, kv_c, k_pe, k, rep.slots)
    publish("publish into every block")

    # a middle hole: the chunks wholly inside blocks [2, 4) in every segment are released
    before = cache.committed_bytes
    middle = ((0, 2), (4, nb))
    assert cache.set_committed_blocks([(4, nb), (0, 2)], direction="shrink") == middle
    rep.moved(middle)
    out["middle_released"] = before - cache.committed_bytes
    rep.check("a middle hole released")
    publish("publish around the middle hole")

    # several holes, one block of the old hole taken back: a grow and a shrink in one call
    several = ((0, 1), (2, 3), (5, nb))
    out["several_direction"] = _outcome(
        lambda: cache.set_committed_blocks(several, direction="grow")
    )
    assert cache.committed_block_set == middle
    assert cache.set_committed_blocks(list(several)) == several
    rep.moved(several)
    rep.check("several holes")
    publish("publish around several holes")
    gather_store("gather store around several holes")

    # a recommit that fails on the last rank: every rank back at the holed set
    undo = _inject(fail_at, rank, world, cache.region)
    try:
        out["failed"] = _outcome(lambda: cache.set_committed_blocks(full))
    finally:
        undo()
    rep.zero_joined(full)  # zeroed before the commit, in chunks that stayed committed
    rep.check("after a recommit that failed")
    publish("publish after the failed recommit")

    # refusals on every rank, the set unchanged
    odd = [(0, 1)] if rank == world - 1 else list(several)
    out["mismatch"] = _outcome(lambda: cache.set_committed_blocks(odd))
    bad = [(0, nb + 1)] if rank == 0 else list(several)
    out["outside"] = _outcome(lambda: cache.set_committed_blocks(bad))
    out["shrink_blocks"] = _outcome(lambda: cache.shrink_blocks(nb - 1))  # fills holes
    rep.check("after the refusals")

    # the holes recommitted: every block committed again, the recommitted ones zero
    assert cache.set_committed_blocks(full, direction="grow") == full
    rep.moved(full)
    rep.check("holes recommitted")
    publish("publish after the recommit")
    assert cache.shrink_blocks(3) == 3 and cache.committed_block_set == ((0, 3),)
    rep.moved(((0, 3),))
    publish("publish at a prefix of 3 blocks")
    cache.close()
    return out


HOLE_CASES = [
    pytest.param(2, "commit", id="2-ranks-fail-at-commit"),
    pytest.param(3, "exchange", id="3-ranks-fail-in-exchange"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,fail_at", HOLE_CASES)
def test_holes_are_released_and_recommitted_on_every_rank_and_every_replica_stays_exact(
    world, fail_at
):
    out = run_world(_holes, world, args=(fail_at,), timeout=270)
    cause = "injected out of memory" if fail_at == "commit" else "injected mapping failure"
    for rank, (res, baseline, after) in enumerate(out):
        assert res["middle_released"] > 0, (rank, res)
        kind, msg = res["several_direction"]
        assert kind == "raised" and "use shrink" in msg and "it drops {[1, 2), [4, 5)}" in msg, msg
        kind, msg = res["failed"]
        assert kind == "raised" and cause in msg and f"ranks [{world - 1}]" in msg, (rank, msg)
        kind, msg = res["mismatch"]
        assert kind == "raised" and msg.startswith("RendezvousError"), (rank, msg)
        assert f"ranks [{world - 1}] differ from rank 0" in msg and "rank 0: [[0, 1], [2, 3]" in msg
        kind, msg = res["outside"]
        assert kind == "raised" and "rank 0" in msg and "max_blocks=6" in msg, (rank, msg)
        assert msg.startswith("ValueError" if rank == 0 else "RendezvousError"), (rank, msg)
        kind, msg = res["shrink_blocks"]
        assert kind == "raised" and "shrink to 5 is above the committed" in msg, (rank, msg)
        assert after == baseline, (rank, baseline, after)  # fds, memfds, mappings, reservations


def test_a_hole_releases_a_chunk_only_when_no_segment_holds_a_block_of_the_set_in_it():
    """The general rule, by geometry on the scenario's layout (host chunk of four pages): the
    MLA segments' middle hole releases whole chunks; an indexer segment's hole block that shares
    a chunk with a kept block (of its own segment or a neighbour's) keeps that chunk."""
    setup = _Setup("host", torch.device("cpu"))
    segs = _lbnhc(LAYERS, setup.max_blocks, setup.pad)
    cap, chunk = setup.capacity, setup.chunk

    def chunks(held):
        ranges = [(o + a * p, o + b * p) for o, p in segs for a, b in held]
        return {c.offset for c in covering_chunks(ranges, chunk, cap)}

    full, holed = chunks(((0, 6),)), chunks(((0, 2), (4, 6)))
    released = full - holed
    assert released
    for off in released:  # a released chunk holds no byte of a kept block in any segment
        for o, p in segs:
            for b in (0, 1, 4, 5):
                assert off + chunk <= o + b * p or off >= o + (b + 1) * p
    idx = [(o, p) for o, p in segs if p == IDX_PAGE]
    kept_hole = [
        c
        for o, p in idx
        for c in range(o + 2 * p - (o + 2 * p) % chunk, o + 4 * p, chunk)
        if c in holed
    ]
    assert kept_hole  # indexer blocks 2-3 span under two chunks: their edge chunks stay
    assert MLA_PAGE > 2 * chunk  # an MLA hole of two blocks holds whole chunks


# --------------------------------------------------------------------------------------------
# fd budget
# --------------------------------------------------------------------------------------------


def _refused_recommit(rank, world):
    import resource

    import torch.distributed as dist

    from vmmkv.ipc import RendezvousError, SymmetricRegion

    kib4 = 4096
    with SymmetricRegion(3000 * kib4, "cpu", dist.group.WORLD, chunk_bytes=kib4,
                         backend="host", timeout=30) as sr:  # fmt: skip
        sr.set_block_layout([(0, kib4)], 3000)
        sr.resize_block_set([(0, 8), (1000, 1008)])
        backend = sr.region._backend
        real, created = backend.create, []
        backend.create = lambda size: created.append(size) or real(size)
        before = len(os.listdir("/proc/self/fd"))
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (before + 200, before + 200))
        try:
            sr.resize_block_set([(0, 1008)])  # 1000 blocks of one chunk each: 992 new
            err = "no error"
        except RendezvousError as exc:
            err = str(exc)
        after = (sr.committed_block_set, len(created), sr.committed_bytes,
                 [sr.peers.mapped_bytes(r) for r in range(world)])  # fmt: skip
        grown = sr.resize_block_set([(0, 108), (1000, 1008)])  # a recommit that fits
    return err, after, grown


def test_a_recommit_past_the_hard_limit_is_refused_before_any_chunk_is_created():
    out = run_world(_refused_recommit, 2, timeout=60)
    for err, (held, created, committed, mapped), grown in out:
        assert "992 runs" in err or "keeping 992 more open files" in err, err
        assert "rank 0" in err or "rank 1" in err
        assert held == ((0, 8), (1000, 1008)) and created == 0
        assert committed == 16 * 4096 and mapped == [16 * 4096] * 2
        assert grown == ((0, 108), (1000, 1008))


def test_random_bytes_are_never_zero():  # the oracle's poison tells a zeroed byte apart
    assert int((random_bytes(1 << 16, 5) == 0).sum()) == 0
