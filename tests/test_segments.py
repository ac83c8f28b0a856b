"""Growth by segments: block-granular growth for layer-major KV layouts.

A layer-major layout (vLLM's LBNHC) puts each layer's blocks in its own byte range, so "the
first n blocks of every layer" is one range per layer region (a *segment*), not a byte prefix.

- Region unit tests (host backend, one process): ``commit_ranges``/``decommit_outside`` commit
  exactly the chunks the ranges touch and keep a chunk two ranges share while either needs it;
  injected failures (a map that fails, an unmap that fails, a rollback that fails) follow the
  prefix rules: a failed commit leaves the set as it was, an unmap stops at the failing chunk and
  keeps it (and every doomed chunk below it) on the books; a hypothesis model check.
- Geometry: the committed-but-unused bytes of the full DeepSeek-V3.2 layout.
- The cache (spawned ranks; host backend with 2 and 3 ranks, CUDA with 2): a layout of MLA and
  indexer segments (two page sizes, no segment start chunk-aligned) grows and shrinks by
  blocks; stores land only in committed blocks of every segment and are counted beyond; every
  replica equals the pure-torch reference inserts on a poisoned-then-zeroed CPU oracle at every
  step; every rank maps exactly its peers' committed chunks; a failing grow (at the commit or in
  the exchange) rolls every rank back to the old block count and the next grow works; fds and
  mappings return to the baseline after close. On CUDA the layer publications are captured in
  a CUDA graph before the first growth and only replayed afterwards.
- API errors: bad, mismatched or late layouts, the wrong resize kind, views across segments.
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import (
    fd_count,
    fds_not_sockets,
    layer_buffers,
    map_all_chunks,
    random_bytes,
    rank_device,
)
from tests.test_alloc_unmap import _fail_map_at, _fail_unmap_at, _mapped_offsets
from vmmkv.alloc import Chunk, UnmapError, VirtualRegion
from vmmkv.alloc.host import HostError
from vmmkv.alloc.region import covering_chunks
from vmmkv.ops.formats import INDEXER_ENTRY_BYTES, MLA_ENTRY_BYTES
from vmmkv.testing.markers import requires_gpu
from vmmkv.testing.spawn import run_world
from vmmkv.testing.timing import capture_graph

BS = 64  # tokens per block
MLA_PAGE = BS * MLA_ENTRY_BYTES  # 41,984 bytes
IDX_PAGE = BS * INDEXER_ENTRY_BYTES  # 8,448 bytes


def _g() -> int:
    return os.sysconf("SC_PAGE_SIZE")


def _chunk_offsets(region) -> list[int]:
    return [c.offset for c in region.chunks()]


# --------------------------------------------------------------------------------------------
# region: chunk sets
# --------------------------------------------------------------------------------------------


def test_commit_ranges_commits_exactly_the_chunks_the_ranges_touch_zeroed():
    g = _g()
    with VirtualRegion(16 * g, "cpu", backend="host", chunk_bytes=g) as r:
        added = r.commit_ranges([(g // 2, 2 * g + 1), (5 * g, 5 * g), (7 * g + 10, 9 * g)])
        assert added == [Chunk(o * g, g) for o in (0, 1, 2, 7, 8)]
        assert r.chunks() == added and r.committed_bytes == 5 * g
        assert _mapped_offsets(r.base_ptr, 16 * g, g) == {0, 1, 2, 7, 8}
        t = r.tensor()
        for c in added:
            assert int(t[c.offset : c.offset + c.size].count_nonzero()) == 0
        data = random_bytes(g, 1)
        t[7 * g : 8 * g].copy_(data)
        # committed chunks are not committed again; only the missing ones are added
        assert r.commit_ranges([(7 * g, 12 * g)]) == [Chunk(o * g, g) for o in (9, 10, 11)]
        assert torch.equal(t[7 * g : 8 * g], data)
        assert r.chunks_covering([(7 * g, 12 * g)]) == [Chunk(o * g, g) for o in range(7, 12)]
        # the prefix API fills the hole below its end and adds nothing twice
        assert r.commit(5 * g) == [Chunk(o * g, g) for o in (3, 4)]
        assert _chunk_offsets(r) == [o * g for o in (0, 1, 2, 3, 4, 7, 8, 9, 10, 11)]


def test_decommit_outside_keeps_a_chunk_that_two_ranges_share_while_either_needs_it():
    g = _g()
    with VirtualRegion(8 * g, "cpu", backend="host", chunk_bytes=2 * g) as r:
        # two segments meet inside chunk 1 ([2g, 4g)): the first ends at 3g, the second starts
        r.commit_ranges([(g, 3 * g), (3 * g, 5 * g)])
        assert _chunk_offsets(r) == [0, 2 * g, 4 * g]
        t = r.tensor()
        data = random_bytes(6 * g, 2)
        t[: 6 * g].copy_(data)
        # the first segment goes, the second keeps the shared chunk
        assert r.decommit_outside([(3 * g, 5 * g)]) == [Chunk(0, 2 * g)]
        assert _mapped_offsets(r.base_ptr, 8 * g, g) == {2, 3, 4, 5}
        assert torch.equal(t[2 * g : 6 * g], data[2 * g : 6 * g])
        # the first comes back and the second goes: the shared chunk stays again
        assert r.commit_ranges([(g, 3 * g)]) == [Chunk(0, 2 * g)]
        assert r.decommit_outside([(g, 3 * g), (5 * g, 5 * g)]) == [Chunk(4 * g, 2 * g)]
        assert torch.equal(t[2 * g : 4 * g], data[2 * g : 4 * g])
        assert int(t[: 2 * g].count_nonzero()) == 0
        assert r.decommit_outside([]) == [Chunk(0, 2 * g), Chunk(2 * g, 2 * g)]
        assert r.committed_bytes == 0 and _mapped_offsets(r.base_ptr, 8 * g, g) == set()
        assert r.decommit_outside([(0, 8 * g)]) == []  # nothing to drop: no synchronize either


def test_a_commit_of_ranges_whose_map_fails_unmaps_what_it_mapped_and_keeps_the_old_set():
    g = _g()
    before = fd_count()
    with VirtualRegion(12 * g, "cpu", backend="host", chunk_bytes=g) as r:
        r.commit_ranges([(0, g), (6 * g, 7 * g)])
        data = random_bytes(g, 3)
        r.tensor()[6 * g : 7 * g].copy_(data)
        heal_map = _fail_map_at(r, r.base_ptr + 9 * g)
        with pytest.raises(HostError, match="injected map failure"):
            r.commit_ranges([(2 * g, 4 * g), (8 * g, 10 * g)])  # maps 2, 3, 8, then fails at 9
        heal_map()
        assert _chunk_offsets(r) == [0, 6 * g]
        assert _mapped_offsets(r.base_ptr, 12 * g, g) == {0, 6}
        assert torch.equal(r.tensor()[6 * g : 7 * g], data)
        assert r.commit_ranges([(2 * g, 4 * g), (8 * g, 10 * g)]) == [
            Chunk(o * g, g) for o in (2, 3, 8, 9)
        ]
    assert fd_count() == before


def test_a_decommit_outside_whose_unmap_fails_keeps_the_failed_chunk_and_those_below_it():
    g = _g()
    with VirtualRegion(12 * g, "cpu", backend="host", chunk_bytes=g) as r:
        r.commit_ranges([(0, 3 * g), (5 * g, 6 * g), (8 * g, 11 * g)])
        data = random_bytes(12 * g, 4)
        t = r.tensor()
        for c in r.chunks():
            t[c.offset : c.offset + c.size].copy_(data[c.offset : c.offset + c.size])
        heal = _fail_unmap_at(r, {r.base_ptr + 8 * g})
        with pytest.raises(UnmapError, match="still mapped") as info:
            r.decommit_outside([(0, g)])  # doomed 1, 2, 5, 8, 9, 10 (last first): fails at 8
        heal()
        assert info.value.unmapped == [Chunk(9 * g, g), Chunk(10 * g, g)]
        assert info.value.still_mapped == [Chunk(o * g, g) for o in (1, 2, 5, 8)]
        assert isinstance(info.value.__cause__, HostError)
        assert _chunk_offsets(r) == [o * g for o in (0, 1, 2, 5, 8)]
        assert _mapped_offsets(r.base_ptr, 12 * g, g) == {0, 1, 2, 5, 8}
        for c in r.chunks():
            assert torch.equal(t[c.offset : c.offset + c.size], data[c.offset : c.offset + c.size])
        # the retry drops what the failure kept
        assert r.decommit_outside([(0, g)]) == [Chunk(o * g, g) for o in (1, 2, 5, 8)]
        assert _mapped_offsets(r.base_ptr, 12 * g, g) == {0}


def test_a_failed_commit_of_ranges_whose_rollback_fails_keeps_the_unremovable_chunks_booked():
    g = _g()
    before = fd_count()
    with VirtualRegion(12 * g, "cpu", backend="host", chunk_bytes=g) as r:
        r.commit_ranges([(4 * g, 5 * g)])
        heal_map = _fail_map_at(r, r.base_ptr + 10 * g)
        heal = _fail_unmap_at(r, {r.base_ptr + 2 * g})
        with pytest.raises(HostError, match="injected map failure"):
            r.commit_ranges([(g, 3 * g), (7 * g, 8 * g), (10 * g, 11 * g)])  # 1, 2, 7, then 10
        heal()
        heal_map()
        # 7 was rolled back, 2 could not be and 1 was never tried: both stay, on the books
        assert _chunk_offsets(r) == [g, 2 * g, 4 * g]
        assert _mapped_offsets(r.base_ptr, 12 * g, g) == {1, 2, 4}
        assert r.decommit_outside([(4 * g, 5 * g)]) == [Chunk(g, g), Chunk(2 * g, g)]
        assert _mapped_offsets(r.base_ptr, 12 * g, g) == {4}
    assert fd_count() == before


def test_peer_regions_map_a_chunk_set_and_unmap_outside_stops_at_a_failing_chunk():
    g = _g()
    before = fd_count()
    with VirtualRegion(10 * g, "cpu", backend="host", chunk_bytes=g) as r, r.open_peer() as peer:
        r.commit_ranges([(g, 3 * g), (6 * g, 9 * g)])
        data = random_bytes(10 * g, 5)
        t = r.tensor()
        for c in r.chunks():
            t[c.offset : c.offset + c.size].copy_(data[c.offset : c.offset + c.size])
        map_all_chunks(r, peer)
        assert peer.chunks() == r.chunks() and peer.mapped_bytes == 5 * g
        assert _mapped_offsets(peer.base_ptr, 10 * g, g) == {1, 2, 6, 7, 8}
        for c in r.chunks():
            assert torch.equal(
                peer.tensor()[c.offset : c.offset + c.size], data[c.offset : c.offset + c.size]
            )
        heal = _fail_unmap_at(r, {peer.base_ptr + 7 * g})
        with pytest.raises(UnmapError, match="still mapped") as info:
            peer.unmap_outside([(g, 2 * g)])  # doomed 2, 6, 7, 8: 8 goes, fails at 7
        heal()
        assert info.value.still_mapped == [Chunk(o * g, g) for o in (2, 6, 7)]
        assert _mapped_offsets(peer.base_ptr, 10 * g, g) == {1, 2, 6, 7}
        assert peer.unmap_outside([(g, 2 * g)]) == [Chunk(o * g, g) for o in (2, 6, 7)]
        assert peer.chunks() == [Chunk(g, g)]
    assert fd_count() == before


@pytest.mark.parametrize(
    "ranges, exc, match",
    [
        (5, TypeError, "sequence of \\(start, end\\) pairs"),
        ([(0, 1, 2)], TypeError, "ranges\\[0\\] must be a \\(start, end\\) pair"),
        ([(0.0, 1)], TypeError, "start must be an int"),
        ([(0, True)], TypeError, "end must be an int"),
        ([(2, 1)], ValueError, "start <= end"),
        ([(0, 4096 * 8 + 1)], ValueError, "not inside \\[0, capacity"),
        ([(-1, 1)], ValueError, "not inside"),
    ],
)
def test_bad_ranges_are_refused_before_any_mapping(ranges, exc, match):
    g = _g()
    with VirtualRegion(8 * g, "cpu", backend="host", chunk_bytes=g) as r:
        for op in (r.commit_ranges, r.decommit_outside, r.open_peer().unmap_outside):
            with pytest.raises(exc, match=match):
                op(ranges)
        assert r.committed_bytes == 0


_RANGE_OPS = st.lists(
    st.tuples(
        st.sampled_from(["commit", "decommit", "write"]),
        st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12)), min_size=0, max_size=4),
    ),
    min_size=1,
    max_size=20,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_RANGE_OPS)
def test_commit_ranges_decommit_outside_and_writes_match_a_chunk_set_model(ops):
    """Ranges in quarter chunks (start, length); chunks of two pages, eleven chunks (the last
    one cut short by the capacity). The model: which chunks are committed, and their bytes
    (new chunks read zero, kept chunks keep their bytes)."""
    g = _g()
    chunk, quarter = 2 * g, g // 2
    cap = 21 * g  # 10.5 chunks: the last chunk is one page
    model = torch.zeros(cap, dtype=torch.uint8)
    committed: set[int] = set()
    with VirtualRegion(cap, "cpu", backend="host", chunk_bytes=chunk) as r:
        t = r.tensor()
        for step, (op, spec) in enumerate(ops):
            ranges = [(min(s * quarter, cap), min((s + n) * quarter, cap)) for s, n in spec]
            touched = {
                k * chunk for s, e in ranges for k in range(s // chunk, -(-e // chunk)) if s < e
            }
            if op == "commit":
                added = r.commit_ranges(ranges)
                assert {c.offset for c in added} == touched - committed
                for o in touched - committed:
                    model[o : o + chunk] = 0
                committed |= touched
            elif op == "decommit":
                dropped = r.decommit_outside(ranges)
                assert {c.offset for c in dropped} == committed - touched
                committed &= touched
            else:
                for o in sorted(touched & committed):
                    n = min(chunk, cap - o)
                    data = random_bytes(n, step)
                    t[o : o + n].copy_(data)
                    model[o : o + n] = data
            assert _chunk_offsets(r) == sorted(committed)
            assert r.committed_bytes == sum(min(chunk, cap - o) for o in committed)
            for o in committed:
                n = min(chunk, cap - o)
                assert torch.equal(t[o : o + n], model[o : o + n]), (step, o)


# --------------------------------------------------------------------------------------------
# geometry: the committed-but-unused bytes of a layer-major layout
# --------------------------------------------------------------------------------------------


def _lbnhc(layers, max_blocks, offset=0):
    """The segments of an LBNHC layout: one MLA tensor then one indexer tensor, each holding
    every layer's ``max_blocks`` blocks in its own byte range (layer l of a tensor at
    ``tensor_offset + l * max_blocks * page``)."""
    mla = [(offset + layer * max_blocks * MLA_PAGE, MLA_PAGE) for layer in range(layers)]
    at = offset + layers * max_blocks * MLA_PAGE
    idx = [(at + layer * max_blocks * IDX_PAGE, IDX_PAGE) for layer in range(layers)]
    return mla + idx


def _waste(segments, blocks, chunk, capacity):
    """Committed bytes (the union of the chunks covering every segment's first ``blocks``
    blocks) minus the bytes those blocks hold."""
    ranges = [(off, off + blocks * page) for off, page in segments]
    committed = sum(c.size for c in covering_chunks(ranges, chunk, capacity))
    return committed - sum(blocks * page for _, page in segments)


def test_deepseek_v32_layer_major_growth_wastes_less_than_two_chunks_per_segment():
    """61 layers x (MLA, indexer) = 122 segments, 2 MiB chunks, 4096 blocks per layer: MLA
    segments start chunk-aligned (164 MiB apart), indexer segments 33 MiB apart (every other
    one starts 1 MiB into a chunk). The numbers are the ones docs/design.md states."""
    chunk, layers, max_blocks = 2 << 20, 61, 4096
    segments = _lbnhc(layers, max_blocks)
    capacity = -(-(layers * max_blocks * (MLA_PAGE + IDX_PAGE)) // chunk) * chunk
    assert sorted({off % chunk for off, _ in segments}) == [0, 1 << 20]
    assert _waste(segments, 1000, chunk, capacity) == 249_731_072  # 238.2 MiB, 8.1 % of used
    assert _waste(segments, 1, chunk, capacity) == 252_776_192
    assert _waste(segments, max_blocks, chunk, capacity) == 1 << 20  # the capacity's last chunk
    # per segment: the head of its first chunk and the tail of its last, each < one chunk
    for blocks in (1, 250, 1000, 2048, 4095):
        assert _waste(segments, blocks, chunk, capacity) < len(segments) * 2 * chunk
    assert max(_waste(segments, n, chunk, capacity) for n in range(0, 4097, 50)) == 254_322_176


# --------------------------------------------------------------------------------------------
# the cache, spawned ranks
# --------------------------------------------------------------------------------------------

LAYERS = 3
TOKENS = 24  # static rows per rank and step (padding -1 after the real ones)


class _Setup:
    """Per backend: the chunk (host: four pages, CUDA: one granule), the blocks per layer, and
    the block counts the scenario moves through (grow, grow, shrink, fail, grow, shrink)."""

    def __init__(self, backend, device):
        from vmmkv.alloc import make_backend

        self.granularity = make_backend(device, backend).granularity
        if backend == "host":
            self.chunk, self.max_blocks = 4 * self.granularity, 6
            self.plan = dict(first=2, second=4, low=1, fail=4, last=6, final=3)
        else:
            self.chunk, self.max_blocks = self.granularity, 100
            self.plan = dict(first=2, second=60, low=1, fail=60, last=100, final=50)
        self.pad = 256  # the layout starts here: no segment start is chunk-aligned
        self.end = self.pad + LAYERS * self.max_blocks * (MLA_PAGE + IDX_PAGE)
        self.capacity = (-(-self.end // self.chunk) + 1) * self.chunk


_device = rank_device


class _Replica:
    """One rank's cache with an LBNHC layout in it, the layer bindings, static inputs, and the
    CPU oracle of its own replica: the bytes of every committed chunk (poisoned first, zero when
    a grow adds a chunk) after the reference inserts of every rank's tokens."""

    def __init__(self, cache, setup):
        self.cache, self.setup, self.rank = cache, setup, cache.rank
        self.world = cache.world_size
        sr = cache.region
        nb = setup.max_blocks
        # the engine's order: allocate over address space, then the block layout and grow_blocks
        cache.allocate(1, reserve=True)  # the next allocation starts at byte 256, not aligned
        mla = cache.allocate(LAYERS * nb * MLA_PAGE, reserve=True).view(torch.uint8)
        idx = cache.allocate(LAYERS * nb * IDX_PAGE, reserve=True).view(torch.uint8)
        assert mla.data_ptr() - sr.base_ptr == setup.pad
        self.segments = _lbnhc(LAYERS, nb, setup.pad)
        assert all(off % setup.chunk for off, _ in self.segments)
        self.views = [
            (
                mla.view(LAYERS, nb, BS, MLA_ENTRY_BYTES)[layer],
                idx.view(LAYERS, nb, BS, INDEXER_ENTRY_BYTES)[layer],
            )
            for layer in range(LAYERS)
        ]
        self.blocks = 0
        self.model = torch.zeros(setup.capacity, dtype=torch.uint8)
        self.errors = 0
        self.inputs, self.slots = layer_buffers(TOKENS, cache.device)

    def bind(self):
        self.bound = [
            (
                self.cache.bind(f"mla.{layer}", m, "fp8_ds_mla"),
                self.cache.bind(f"idx.{layer}", x, "indexer_k"),
            )
            for layer, (m, x) in enumerate(self.views)
        ]

    # -- the chunk sets -------------------------------------------------------------------
    def ranges(self, blocks):
        return [(off, off + blocks * page) for off, page in self.segments]

    def expected_chunks(self, blocks):
        return covering_chunks(self.ranges(blocks), self.setup.chunk, self.setup.capacity)

    def own_chunks(self):
        return self.cache.region.region.chunks()

    def resized(self, blocks):
        """After a grow/shrink to ``blocks`` blocks: the oracle's new chunks read zero, and so
        do the new blocks in chunks that stayed committed (a grow zeroes them)."""
        old = {c.offset for c in self.expected_chunks(self.blocks)}
        for c in self.expected_chunks(blocks):
            if c.offset not in old:
                self.model[c.offset : c.offset + c.size] = 0
        self.zero_exposed(blocks)
        self.blocks = blocks

    def zero_exposed(self, blocks):
        """A grow to ``blocks`` zeroes the blocks beyond the current count before anything
        else (also when the grow then fails)."""
        for off, page in self.segments:
            lo, hi = off + self.blocks * page, off + blocks * page
            if hi > lo:
                self.model[lo:hi] = 0

    # -- the bytes ------------------------------------------------------------------------
    def sync(self):
        if self.cache.device.type == "cuda":
            torch.cuda.synchronize(self.cache.device)

    def read(self, rank):
        """Rank ``rank``'s replica, committed chunks only, through this process's mapping."""
        view = self.cache.region.view(rank, reserve=True)  # a block layout: not a prefix
        # a device copy first (CUDA: the copy engine reads the peer mapping), then to the host
        return [view[c.offset : c.offset + c.size].clone().cpu() for c in self.own_chunks()]

    def poison(self, seed):
        own = self.cache.region.view(self.rank, reserve=True)
        for c in self.own_chunks():
            data = random_bytes(c.size, seed + c.offset)
            own[c.offset : c.offset + c.size].copy_(data.to(own.device))
            self.model[c.offset : c.offset + c.size] = data
        self.sync()

    def slots_for(self, rank, step):
        """``rank``'s slots of a step: two tokens in blocks 0, 1, n-1, n, n+1 (n the committed
        count), in the last block and just beyond the view, in token offsets that no other rank
        uses (``rank + world * k``), then two padding slots; shuffled."""
        n, nb = self.blocks, self.setup.max_blocks
        blocks = sorted({b for b in (0, 1, n - 1, n, n + 1, nb // 2, nb - 1, nb) if b >= 0})
        per = BS // self.world
        slots = [
            b * BS + rank + self.world * ((2 * step + j) % per) for b in blocks for j in (0, 1)
        ]
        slots += [-1, -1]
        order = torch.randperm(len(slots), generator=torch.Generator().manual_seed(step))
        return torch.tensor(slots, dtype=torch.int64)[order]

    def batch(self, rank, step):
        from vmmkv.testing.kv import layer_inputs

        slots = self.slots_for(rank, step)
        return (*layer_inputs(1000 * step + 17 * rank, slots.numel()), slots)

    def load(self, batch):
        n = batch[3].numel()
        self.slots.fill_(-1)
        for dst, src in zip((*self.inputs, self.slots), batch, strict=True):
            dst[:n].copy_(src.to(dst.device))

    def apply(self, batches, gathered):
        """The oracle: every rank's batch inserted by the reference into every layer, slots of
        uncommitted blocks skipped; the out-of-range count this rank's stores add."""
        from vmmkv.ops import reference as ref

        nb = self.setup.max_blocks
        for q, (kv_c, k_pe, k, slots) in enumerate(batches):
            bad = (slots >= 0) & (slots >= self.blocks * BS)
            if gathered or q == self.rank:
                self.errors += 2 * LAYERS * int(bad.sum())
            ok = torch.where(bad, -1, slots)
            for layer in range(LAYERS):
                (mla_off, _), (idx_off, _) = self.segments[layer], self.segments[LAYERS + layer]
                m = self.model[mla_off : mla_off + nb * MLA_PAGE].view(nb, BS, MLA_ENTRY_BYTES)
                x = self.model[idx_off : idx_off + nb * IDX_PAGE].view(nb, BS, INDEXER_ENTRY_BYTES)
                ref.insert_ds_mla(m, kv_c, k_pe, ok)
                ref.insert_indexer_k(x, k, ok)

    def check(self, what):
        """Own replica == oracle on every committed chunk; the chunk set, the bounds and every
        peer mapping are the block count's; the out-of-range count is the oracle's. Returns
        the digest of every replica as read here (the caller compares them across ranks)."""
        import torch.distributed as dist

        self.sync()
        sr = self.cache.region
        want = self.expected_chunks(self.blocks)
        assert self.own_chunks() == want, (self.rank, what)
        assert sr.committed_table.tolist() == [o + self.blocks * p for o, p in self.segments]
        assert self.cache.committed_blocks == self.blocks
        assert self.cache.committed_bytes == sum(c.size for c in want)
        for q in range(self.world):
            if q != self.rank:
                assert sr.peers.mapped_chunks(q) == want, (self.rank, q, what)
                if self.cache.device.type == "cpu":
                    gran = self.setup.granularity
                    pages = _mapped_offsets(sr.peers.ptrs[q], self.setup.capacity, gran)
                    assert pages == {
                        (c.offset + i) // gran for c in want for i in range(0, c.size, gran)
                    }, (self.rank, q, what)
        got = self.read(self.rank)
        for c, data in zip(want, got, strict=True):
            expect = self.model[c.offset : c.offset + c.size]
            if not torch.equal(data, expect):
                bad = (data != expect).nonzero().flatten()
                raise AssertionError(
                    f"rank {self.rank}: {what}: {bad.numel()} bytes of the chunk at "
                    f"{c.offset} differ from the oracle, first at {(c.offset + bad[:4]).tolist()}"
                )
        assert self.cache.stats()["out_of_range_slots"] == self.errors, (self.rank, what)
        dist.barrier()  # every rank is done writing its own replica (e.g. poisoning it)
        digests = [
            hashlib.sha256(b"".join(t.numpy().tobytes() for t in self.read(q))).hexdigest()
            for q in range(self.world)
        ]
        everyone = [None] * self.world
        dist.all_gather_object(everyone, digests)
        for q in range(self.world):  # every rank reads rank q's replica as rank q does
            assert all(d[q] == everyone[q][q] for d in everyone), (self.rank, q, what)


def _resources():
    from tests.test_rendezvous import _maps, _memfds

    out = {"not_sockets": fds_not_sockets(), "memfds": _memfds()}
    out["memfd_maps"], out["reservations"] = _maps()
    return out


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as exc:
        return ("raised", f"{type(exc).__name__}: {exc}")


def _inject(point, rank, world, sr):
    """Make the next grow fail on the last rank: at its commit (the third chunk it creates:
    an out-of-memory after two were mapped) or in the exchange (mapping a peer's chunk). Returns
    the undo."""
    from tests.helpers import fail_peer_mapping_on

    if point == "exchange":
        return fail_peer_mapping_on(world - 1, rank)
    if rank != world - 1:
        return lambda: None
    backend = sr.region._backend
    real = backend.create
    calls = {"n": 0}

    def create(size):
        calls["n"] += 1
        if calls["n"] == 3:
            raise HostError(12, "injected out of memory")
        return real(size)

    backend.create = create
    return lambda: setattr(backend, "create", real)


def _scenario(rank, world, backend, fail_at):
    """The whole scenario on one rank; returns (the failed grow's outcome or None, the fds and
    mappings before the cache, the same after it was closed and its objects are gone)."""
    import gc

    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache

    device = _device(backend, rank, world)
    setup = _Setup(backend, device)
    if backend == "host":  # a warm-up cycle: what the first cache opens for good is not counted
        ReplicatedKVCache(dist.group.WORLD, setup.chunk, device, backend=backend).close()
    baseline = _resources()
    failure = _grow_publish_shrink(rank, world, backend, fail_at, device, setup)
    gc.collect()
    return failure, baseline, _resources()


def _grow_publish_shrink(rank, world, backend, fail_at, device, setup):
    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache

    plan = setup.plan
    cache = ReplicatedKVCache(
        dist.group.WORLD, setup.capacity, device, chunk_bytes=setup.chunk, timeout=10.0,
        direct=True, backend=backend,
    )  # fmt: skip
    assert cache.direct, cache.why_not_direct
    rep = _Replica(cache, setup)
    assert cache.committed_blocks is None
    cache.set_block_layout(rep.segments, setup.max_blocks)
    assert cache.committed_blocks == 0 and cache.committed_bytes == 0
    rep.bind()

    assert cache.grow_blocks(plan["first"]) == plan["first"]
    rep.resized(plan["first"])
    rep.poison(seed=100 * (rank + 1))
    rep.check("after the first grow")  # its barrier: nobody stores before all poisoned

    kv_c, k_pe, k = rep.inputs

    def step():
        for mla, idx in rep.bound:
            cache.publish_layer(mla, idx, kv_c, k_pe, k, rep.slots)

    step()  # eager warm-up on every rank (padding only): loads the kernels
    if backend == "cuda":  # captured before any further growth, only replayed afterwards
        graph = capture_graph(step, device)
        replay = graph.replay
    else:
        replay = step

    counter = {"step": 0}

    def publish(what):
        counter["step"] += 1
        batches = [rep.batch(q, counter["step"]) for q in range(world)]
        rep.load(batches[rank])
        replay()
        rep.apply(batches, gathered=False)
        rep.check(what)

    def gather_store(what):
        counter["step"] += 1
        batches = [rep.batch(q, counter["step"]) for q in range(world)]
        dev_batch = [t.to(device) for t in batches[rank]]
        for mla, idx in rep.bound:
            cache.store_layer(mla, idx, *dev_batch, mode="gather")
        rep.apply(batches, gathered=True)
        rep.check(what)

    publish(f"publish at {plan['first']} blocks")
    gather_store(f"gather store at {plan['first']} blocks")

    assert cache.grow_blocks(plan["second"]) == plan["second"]
    rep.resized(plan["second"])
    rep.check("the grown blocks read zero")
    publish(f"publish after growing to {plan['second']} blocks")

    assert cache.shrink_blocks(plan["low"]) == plan["low"]
    rep.resized(plan["low"])
    publish(f"publish after shrinking to {plan['low']} blocks")

    failure = None
    if fail_at is not None:
        undo = _inject(fail_at, rank, world, cache.region)
        try:
            failure = _outcome(lambda: cache.grow_blocks(plan["fail"]))
        finally:
            undo()
        rep.zero_exposed(plan["fail"])
        rep.check(f"after a grow that failed at the {fail_at}")  # all at the old count
        publish(f"publish after the failed grow, at {plan['low']} blocks")

    assert cache.grow_blocks(plan["last"]) == plan["last"]  # every block: shared chunks
    rep.resized(plan["last"])
    publish(f"publish after growing to {plan['last']} blocks")
    assert cache.shrink_blocks(plan["final"]) == plan["final"]
    rep.resized(plan["final"])
    gather_store(f"gather store at {plan['final']} blocks")
    publish(f"publish at {plan['final']} blocks")

    cache.close()
    return failure


HOST_CASES = [
    pytest.param(2, "commit", id="2-ranks-fail-at-commit"),
    pytest.param(2, "exchange", id="2-ranks-fail-in-exchange"),
    pytest.param(3, "commit", id="3-ranks-fail-at-commit"),
    pytest.param(3, "exchange", id="3-ranks-fail-in-exchange"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,fail_at", HOST_CASES)
def test_block_growth_lands_stores_only_in_committed_blocks_and_a_failed_grow_rolls_back(
    world, fail_at
):
    out = run_world(_scenario, world, args=("host", fail_at), timeout=270)
    cause = "injected out of memory" if fail_at == "commit" else "injected mapping failure"
    for rank, (failure, baseline, after) in enumerate(out):
        assert failure[0] == "raised", (rank, failure)
        assert cause in failure[1] and f"ranks [{world - 1}]" in failure[1], (rank, failure)
        assert after == baseline, (rank, baseline, after)  # fds, memfds, mappings, reservations


@requires_gpu
@pytest.mark.timeout(300)
def test_a_graph_captured_before_block_growth_replays_into_the_grown_blocks_on_cuda():
    """Two ranks (one per GPU with two GPUs, else both on GPU 0): the layer publications are
    captured once, before growing by blocks; every replay after each grow/shrink writes the
    reference bytes into every replica's committed blocks and skips (counts) the others."""
    out = run_world(_scenario, 2, args=("cuda", None), timeout=270)
    for failure, baseline, after in out:
        assert failure is None
        for key in ("memfds", "memfd_maps", "reservations"):  # none on CUDA, before or after
            assert after[key] == baseline[key], (key, baseline, after)


# --------------------------------------------------------------------------------------------
# API errors
# --------------------------------------------------------------------------------------------


def _api_errors(rank, world):
    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache

    g = _g()
    chunk = 4 * g
    cap = 64 * chunk
    out = {}

    def cache_(**kw):
        return ReplicatedKVCache(
            dist.group.WORLD, cap, "cpu", chunk_bytes=chunk, backend="host", timeout=10.0, **kw
        )

    with cache_() as c:
        nb = 4
        segs = [(256, MLA_PAGE), (256 + nb * MLA_PAGE, IDX_PAGE)]
        # one rank's bad layout: it raises its own error, the other names it
        bad = [(256, MLA_PAGE), (256 + nb * MLA_PAGE - 16, IDX_PAGE)] if rank == 1 else segs
        out["overlap"] = _outcome(lambda: c.set_block_layout(bad, nb))
        out["type"] = _outcome(lambda: c.set_block_layout(segs, 4.0 if rank == 0 else nb))
        out["capacity"] = _outcome(lambda: c.set_block_layout([(cap - MLA_PAGE, MLA_PAGE)], 2))
        out["empty"] = _outcome(lambda: c.set_block_layout([], 2))
        # layouts that differ between ranks
        other = [(256, MLA_PAGE), (512 + nb * MLA_PAGE, IDX_PAGE)] if rank == 1 else segs
        out["mismatch"] = _outcome(lambda: c.set_block_layout(other, nb))
        out["blocks_on_prefix"] = _outcome(lambda: c.grow_blocks(1))
        out["prefix_blocks"] = c.committed_blocks
        # a layout given in any order; then bytes refused, blocks fine
        c.set_block_layout(list(reversed(segs)), nb)
        out["twice"] = _outcome(lambda: c.set_block_layout(segs, nb))
        out["bytes_on_blocks"] = _outcome(lambda: c.grow(chunk))
        out["shrink_bytes_on_blocks"] = _outcome(lambda: c.shrink(0))
        out["grow_beyond"] = _outcome(lambda: c.grow_blocks(nb + 1))
        out["grow_down"] = _outcome(lambda: (c.grow_blocks(2), c.grow_blocks(1)))
        out["shrink_up"] = _outcome(lambda: c.shrink_blocks(3))
        size = 256 + nb * (MLA_PAGE + IDX_PAGE) + MLA_PAGE
        buf = c.allocate(size, reserve=True).view(torch.uint8)
        mla = buf[256 : 256 + nb * MLA_PAGE].view(nb, BS, MLA_ENTRY_BYTES)
        across = buf[256 + MLA_PAGE : 256 + (nb + 1) * MLA_PAGE].view(nb, BS, MLA_ENTRY_BYTES)
        out["bind_in"] = _outcome(lambda: c.bind("mla", mla, "fp8_ds_mla").local.offset_bytes)
        out["bind_across"] = _outcome(lambda: c.bind("across", across, "fp8_ds_mla"))
        outside = buf[:IDX_PAGE].view(1, BS, INDEXER_ENTRY_BYTES)
        out["bind_outside"] = _outcome(lambda: c.bind("outside", outside, "indexer_k"))
        # blocks that straddle the segment's blocks (one token in) are refused; vLLM-style
        # kernel blocks (half a segment block each) are accepted
        skew = buf[256 + MLA_ENTRY_BYTES : 256 + (nb - 1) * MLA_PAGE + MLA_ENTRY_BYTES]
        skew = skew.view(nb - 1, BS, MLA_ENTRY_BYTES)
        out["bind_skewed"] = _outcome(lambda: c.bind("skewed", skew, "fp8_ds_mla"))
        halves = buf[256 : 256 + nb * MLA_PAGE].view(2 * nb, BS // 2, MLA_ENTRY_BYTES)
        out["bind_halves"] = _outcome(lambda: c.bind("halves", halves, "fp8_ds_mla").kind)
        out["blocks"] = c.committed_blocks
    with cache_(direct=False) as c:  # no peer mappings: the same protocol, commits only
        c.set_block_layout([(256, MLA_PAGE)], 4)
        grown = (c.grow_blocks(3), c.region.region.chunks())
        out["gather_only"] = (c.path, grown, c.shrink_blocks(1), c.region.region.chunks())
    with cache_(initial_bytes=chunk) as c:
        out["committed"] = _outcome(lambda: c.set_block_layout([(0, MLA_PAGE)], 2))
    with cache_() as c:
        view = c.allocate(MLA_PAGE, reserve=True).view(torch.uint8).view(1, BS, MLA_ENTRY_BYTES)
        if rank == 0:
            c.bind("early", view, "fp8_ds_mla")
        out["after_bind"] = _outcome(lambda: c.set_block_layout([(0, MLA_PAGE)], 2))
    return out


@pytest.mark.timeout(120)
def test_bad_mismatched_or_late_layouts_and_wrong_resize_kinds_raise_on_every_rank():
    out = run_world(_api_errors, 2, timeout=100)
    for rank, res in enumerate(out):
        mine = rank == 1

        def raised(key, name, *parts, res=res, rank=rank):
            kind, msg = res[key]
            assert kind == "raised" and msg.startswith(name), (rank, key, res[key])
            for p in parts:
                assert p in msg, (rank, key, p, msg)

        raised("overlap", "ValueError" if mine else "RendezvousError", "rank 1", "overlap")
        raised("type", "TypeError" if rank == 0 else "RendezvousError", "rank 0", "max_blocks")
        raised("capacity", "ValueError", "beyond the capacity")
        raised("empty", "ValueError", "at least one")
        raised("mismatch", "ConfigMismatch", "identical on every rank", "ranks [0]", "ranks [1]")
        raised("bind_skewed", "ValueError", f"rank {rank}", "'skewed'", "do not fit")
        assert res["bind_halves"] == ("ok", "fp8_ds_mla"), (rank, res["bind_halves"])
        raised("blocks_on_prefix", "RuntimeError", "no block layout is set")
        assert res["prefix_blocks"] is None
        raised("twice", "RuntimeError", "already set")
        raised("bytes_on_blocks", "RuntimeError", "a block layout is set", "grow_blocks")
        raised("shrink_bytes_on_blocks", "RuntimeError", "a block layout is set")
        raised("grow_beyond", "ValueError", "blocks=5 outside [0, 4]")
        raised("grow_down", "ValueError", "below the committed 2; use shrink")
        raised("shrink_up", "ValueError", "above the committed 2; use grow")
        assert res["bind_in"] == ("ok", 256)
        raised("bind_across", "ValueError", "bind 'across'", "inside no single segment", "#0")
        raised("bind_outside", "ValueError", "bind 'outside'", "inside no single segment")
        assert res["blocks"] == 2
        covering = [Chunk(o, 4 * _g()) for o in range(0, 256 + 3 * MLA_PAGE, 4 * _g())]
        assert res["gather_only"] == ("gather", (3, covering), 1, covering[:3]), res
        raised("committed", "RuntimeError", "bytes are committed")
        raised(
            "after_bind",
            "RuntimeError" if rank == 0 else "RendezvousError",
            "rank 0",
            "views are bound already",
        )


def test_block_layout_chunks_follow_the_blocks_of_a_deepseek_v32_cache():
    """With the default chunk (capacity / 64) a 122-segment layout commits the whole
    capacity for any block count. ``block_layout_chunk_bytes`` keeps the committed bytes near
    the blocks' own bytes as far as its chunk budget allows (docs/design.md, "Chunk sizes")."""
    from vmmkv._util import ceil_div, round_up
    from vmmkv.alloc.region import MAX_CHUNKS, block_layout_chunk_bytes, covering_chunks

    mib, layers, idx, mla = 1 << 20, 61, 64 * 132, 64 * 656

    def geometry(num_blocks):
        segs = [(i * num_blocks * idx, idx) for i in range(layers)]
        segs += [(layers * num_blocks * idx + i * num_blocks * mla, mla) for i in range(layers)]
        return segs, round_up(layers * num_blocks * (idx + mla), 2 * mib)

    def committed(segs, cap, chunk, n):
        chunks = covering_chunks([(o, o + n * b) for o, b in segs], chunk, cap)
        return len(chunks), sum(c.size for c in chunks), sum(n * b for _, b in segs)

    segs, cap = geometry(4096)  # the review's example: 11.74 GiB
    default = min(round_up(ceil_div(cap, 64), 2 * mib), 1 << 30)
    assert committed(segs, cap, default, 1)[1] == cap  # the defect: everything, for one block
    # the overhead rule alone: 2 MiB chunks follow the blocks within 1.2x, with 6009 chunks
    fine = block_layout_chunk_bytes(segs, cap, 2 * mib, max_chunks=1 << 20)
    assert fine == 2 * mib and cap // fine == 6009
    count, got, blocks = committed(segs, cap, fine, 1000)
    assert (count, round(got / blocks, 3)) == (1586, 1.081)
    # capped at MAX_CHUNKS: 32 MiB, 376 chunks; a layer-major layout's partial grow then
    # commits 2.17x the blocks' bytes (a block-major one would follow them closely)
    chunk = block_layout_chunk_bytes(segs, cap, 2 * mib)
    assert chunk == 32 * mib and ceil_div(cap, chunk) == 376 <= MAX_CHUNKS
    count, got, blocks = committed(segs, cap, chunk, 1000)
    assert (count, round(got / blocks, 3)) == (199, 2.171)
    assert committed(segs, cap, chunk, 4096)[0] == ceil_div(cap, chunk)
    # a larger cache takes larger chunks: at most MAX_CHUNKS of them (the driver calls of a
    # full grow), though the overhead rule alone would take 8 MiB (14,700 chunks)
    segs, cap = geometry(40000)  # ~115 GiB
    assert block_layout_chunk_bytes(segs, cap, 2 * mib, max_chunks=1 << 20) == 8 * mib
    chunk = block_layout_chunk_bytes(segs, cap, 2 * mib)
    assert chunk == 256 * mib and ceil_div(cap, chunk) <= MAX_CHUNKS < ceil_div(cap, chunk // 2)
    count, got, blocks = committed(segs, cap, chunk, 10000)
    assert count == ceil_div(got, chunk) and round(got / blocks, 3) == 2.016
    # never below the granularity, never above 1 GiB
    assert block_layout_chunk_bytes(segs[:1], 4096, 4096) == 4096
    assert block_layout_chunk_bytes([(0, 1)], 1 << 40, 2 * mib) == 1 << 30
