"""The CUDA pieces the vLLM plugin relies on, without vLLM: a DeepSeek-V3.2
block layout through ``ReplicatedKVCache``, grown, captured, slept and woken.

Layout: vLLM's LBNHC, layer-major, 61 layers = 122 segments: one indexer-K tensor (page = one
block = 64 * 132 = 8,448 bytes), then one MLA tensor (64 * 656 = 41,984 bytes); with ``nb``
blocks per layer, layer ``l``'s indexer segment is at ``l * nb * 8448`` and its MLA segment at
``61 * nb * 8448 + l * nb * 41984`` of one ``allocate()``d backing. The block count is uneven
(CUDA: 1,000 blocks, a backing of 3,076,352,000 bytes, not a multiple of 2 MiB), so segment
starts are not chunk-aligned and neighbouring segments share chunks. The cache: capacity = the
backing rounded up to the backend's granularity, chunk = one granule, nothing committed at first.

One scenario, one worker, two backends (2 spawned ranks; on one GPU both share it):
``host`` (CPU, the host backend, 4 KiB chunks, 7 blocks; runs everywhere) and ``cuda``
(marked ``gpu``; 2 MiB chunks, 1,000 blocks). Three layers are bound (0, 30 and 60: the first
segment pair, the middle, and the MLA segment that ends the backing), MLA as
``fp8_ds_mla_ue8m0`` ``[nb, 64, 656]``, indexer as ``indexer_k`` ``[nb, 64, 132]`` (split
blocks). Layer 1 is not bound and is checked to stay untouched (its indexer segment shares a
chunk with layer 0's).

1. ``grow_blocks(n1)`` (uneven: 37 on CUDA), warm-up, then one CUDA graph is captured of one
   step as the plugin issues it (layer 0: ``publish_layer``; layer 30: ``store_ds_mla``,
   ``barrier``, ``store_indexer_k``, ``barrier`` with a rank-major ``gathered_slot_mapping``;
   layer 60: ``store_layer`` + ``barrier``). Host: the same function, called eagerly.
2. Every publication phase: every rank poisons its replica's checked segments (random non-zero
   bytes over every committed byte of them, the chunk tail beyond the last block included),
   snapshots every replica, publishes ``T`` random non-zero bf16 tokens per rank (distinct
   random slots in a block range, one ``-1`` padding slot, one slot in the first block beyond
   the committed ones, or beyond the view), then every rank compares every replica, byte for
   byte, with the snapshot after the pure-torch reference inserts (``vmmkv.ops.reference``) of
   every rank's tokens, the beyond-the-bound token skipped; the out-of-range counter must be
   the beyond-the-bound tokens times the 6 caches. Each phase runs the graph replay (new data
   copied into its static inputs) and then an eager call with fresh tensors.
3. After the capture: ``grow_blocks(n2)`` (613 on CUDA), same addresses, the new blocks read
   zero (``VirtualRegion.commit_ranges``: "new bytes are zero on return"; new blocks in chunks
   that stayed committed are zeroed by ``SymmetricRegion``'s block commit), the same replay
   writes into blocks ``[n1, n2)``. ``shrink_blocks(0)`` (vLLM sleep): no own chunk, no peer
   chunk mapped, every bound at its segment's start; a replay while asleep writes nothing and
   counts every token. ``grow_blocks(n1)`` (wake): same addresses, zero blocks, replays land.
   Last, ``grow_blocks(nb)``: every block, replay into ``[n2, nb)``.
4. After every grow: committed bytes == the union of the chunks covering each segment's first
   ``n`` blocks (computed here from the geometry alone), own and in every peer's mapping;
   committed <= the blocks' bytes + 122 * 2 chunks; the ratio committed / blocks' bytes is
   returned; on CUDA at 1,000 blocks it must be <= 1.2.

GPU command: ``python -m pytest -q -m gpu tests/test_block_layout_gpu.py -rs``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch

from tests.helpers import rank_device
from vmmkv.alloc.region import covering_chunks
from vmmkv.ops.formats import INDEXER_ENTRY_BYTES, MLA_ENTRY_BYTES
from vmmkv.testing.markers import requires_gpu
from vmmkv.testing.spawn import run_world
from vmmkv.testing.timing import capture_graph

BS = 64  # tokens per block
IDX_PAGE = BS * INDEXER_ENTRY_BYTES  # 8,448 bytes
MLA_PAGE = BS * MLA_ENTRY_BYTES  # 41,984 bytes
LAYERS = 61  # DeepSeek-V3.2
MLA_KIND, IDX_KIND = "fp8_ds_mla_ue8m0", "indexer_k"
BOUND = (0, 30, 60)  # the layers bound (and published into)
SENTINEL = (1,)  # a layer never bound: checked unchanged
WORLD = 2


@dataclass(frozen=True)
class Case:
    """One backend's sizes: ``nb`` blocks per layer (the layout's max), the block counts the
    scenario moves through (``n1`` < ``n2`` < ``nb``), ``tokens`` per rank and publication,
    the bound on committed / blocks' bytes at ``nb`` blocks (None: only the geometric one)."""

    backend: str
    nb: int
    n1: int
    n2: int
    tokens: int
    max_ratio_at_nb: float | None


HOST = Case("host", nb=7, n1=2, n2=5, tokens=12, max_ratio_at_nb=None)
CUDA = Case("cuda", nb=1000, n1=37, n2=613, tokens=64, max_ratio_at_nb=1.2)


def lbnhc_segments(layers: int, nb: int, base: int = 0) -> list[tuple[int, int]]:
    """``(offset, page)`` per segment: the indexer segments of layers 0..L-1, then the MLA ones
    (segment ``l`` is layer ``l``'s indexer, ``L + l`` its MLA)."""
    idx = [(base + layer * nb * IDX_PAGE, IDX_PAGE) for layer in range(layers)]
    at = base + layers * nb * IDX_PAGE
    mla = [(at + layer * nb * MLA_PAGE, MLA_PAGE) for layer in range(layers)]
    return idx + mla


def chunk_indices(segments, n: int, chunk: int) -> set[int]:
    """The chunks (grid indices) that hold any byte of any segment's first ``n`` blocks: the
    geometry alone, no vmmkv code."""
    out: set[int] = set()
    for off, page in segments:
        if n:
            out.update(range(off // chunk, -(-(off + n * page) // chunk)))
    return out


def _allocate(cache, nbytes: int) -> torch.Tensor:
    # the whole backing over memory that is not committed yet: the block layout commits it by
    # grow_blocks, as the vLLM plugin does
    return cache.allocate(nbytes, reserve=True)


_device = rank_device


# --------------------------------------------------------------------------------------------
# the worker (one rank)
# --------------------------------------------------------------------------------------------


class _Rank:
    """One rank's cache over the V3.2 layout, its bindings, and the checks."""

    def __init__(self, rank: int, world: int, case: Case) -> None:
        import torch.distributed as dist

        from vmmkv import ReplicatedKVCache
        from vmmkv.alloc.region import make_backend

        self.rank, self.world, self.case = rank, world, case
        self.dev = _device(case.backend, rank, world)
        self.gran = make_backend(self.dev, case.backend).granularity
        self.backing = LAYERS * case.nb * (IDX_PAGE + MLA_PAGE)
        capacity = -(-self.backing // self.gran) * self.gran
        self.cache = ReplicatedKVCache(
            dist.group.WORLD, capacity, self.dev, chunk_bytes=self.gran, initial_bytes=0,
            direct=True, backend=case.backend, timeout=60.0,
        )  # fmt: skip
        cache = self.cache
        assert cache.direct, cache.why_not_direct
        assert cache.chunk_bytes == self.gran and cache.committed_bytes == 0
        self.buf = _allocate(cache, self.backing).view(torch.uint8)
        self.buf_offset = self.buf.data_ptr() - cache.region.base_ptr
        assert self.buf_offset + self.backing <= cache.capacity_bytes
        self.segments = lbnhc_segments(LAYERS, case.nb, self.buf_offset)
        cache.set_block_layout(self.segments, case.nb)
        assert cache.committed_blocks == 0 and cache.committed_bytes == 0
        self.errors = 0  # the out-of-range count this rank's stores must have added
        self.bound = []
        for layer in BOUND:
            mla, idx = self.layer_views(layer)
            self.bound.append(
                (
                    cache.bind(f"mla.{layer}", mla, MLA_KIND),
                    cache.bind(f"idx.{layer}", idx, IDX_KIND),
                )
            )
        # the checked segments: (segment index, bound?) of the bound and the sentinel layers
        self.checked = [(s, layer in BOUND) for layer in BOUND + SENTINEL
                        for s in (layer, LAYERS + layer)]  # fmt: skip
        self.replicas = [cache.region.view(q, reserve=True) for q in range(world)]
        self.addresses = self.address_book()

    def layer_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's layer views inside the backing: MLA ``[nb, 64, 656]``, indexer ``[nb, 64,
        132]`` (each block contiguous: the kernels split values and scales inside it)."""
        nb = self.case.nb
        (io, _), (mo, _) = self.segments[layer], self.segments[LAYERS + layer]
        base = self.buf_offset
        mla = self.buf[mo - base : mo - base + nb * MLA_PAGE].view(nb, BS, MLA_ENTRY_BYTES)
        idx = self.buf[io - base : io - base + nb * IDX_PAGE].view(nb, BS, INDEXER_ENTRY_BYTES)
        return mla, idx

    def address_book(self) -> tuple:
        sr = self.cache.region
        return (sr.base_ptr, tuple(sr.peers.ptrs), self.buf.data_ptr(),
                tuple(v.data_ptr() for v in self.replicas),
                tuple(b.view.data_ptr() for pair in self.bound for b in pair))  # fmt: skip

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    # -- memory accounting ----------------------------------------------------------------
    def check_committed(self, n: int) -> float:
        """After a resize to ``n`` blocks: the block count, the bounds, the own chunk set and
        every peer's mapping equal the geometry's; the geometric bound on committed bytes.
        Returns committed / blocks' bytes (0 at 0 blocks)."""
        cache, sr, chunk = self.cache, self.cache.region, self.gran
        assert cache.committed_blocks == n
        assert self.address_book() == self.addresses, "an address moved"
        want = sorted(chunk_indices(self.segments, n, chunk))
        committed = len(want) * chunk
        assert [c.offset for c in sr.region.chunks()] == [k * chunk for k in want]
        assert cache.committed_bytes == committed, (cache.committed_bytes, committed)
        assert cache.stats()["committed_bytes"] == committed
        assert sr.committed_table.tolist() == [off + n * page for off, page in self.segments]
        for q in range(self.world):
            if q != self.rank:
                assert sr.peers.mapped_bytes(q) == committed, (q, n)
                assert [c.offset for c in sr.peers.mapped_chunks(q)] == [k * chunk for k in want]
        blocks_bytes = n * (IDX_PAGE + MLA_PAGE) * LAYERS
        assert committed <= blocks_bytes + len(self.segments) * 2 * chunk, (n, committed)
        return committed / blocks_bytes if n else 0.0

    # -- bytes ----------------------------------------------------------------------------
    def extents(self, n: int) -> list[tuple[int, int]]:
        """Per checked segment, the committed bytes it holds: its first ``n`` blocks and the
        rest of the chunk the last one ends in (committed, beyond the bound)."""
        if n == 0:
            return [(0, 0) for _ in self.checked]
        out = []
        for s, _ in self.checked:
            off, page = self.segments[s]
            end = -(-(off + n * page) // self.gran) * self.gran
            out.append((off, min(end, off + self.case.nb * page)))
        return out

    def read(self, q: int, extents) -> list[torch.Tensor]:
        """Replica ``q``'s bytes of ``extents``, through this process's mapping, on the CPU."""
        self.sync()
        view = self.replicas[q]
        return [view[lo:hi].clone().cpu() for lo, hi in extents]

    def poison(self, n: int, seed: int) -> None:
        """Random bytes in 1..255 over the own replica's checked committed bytes."""
        gen = torch.Generator(device=self.dev).manual_seed(seed)
        own = self.replicas[self.rank]
        for lo, hi in self.extents(n):
            if hi > lo:
                noise = torch.randint(
                    1, 256, (hi - lo,), generator=gen, device=self.dev, dtype=torch.uint8
                )
                own[lo:hi].copy_(noise)
        self.sync()

    def check_zero(self, old: int, new: int, what: str) -> None:
        """Blocks ``[old, new)`` of every checked segment read zero in every replica."""
        spans = [
            (self.segments[s][0] + old * self.segments[s][1],
             self.segments[s][0] + new * self.segments[s][1])
            for s, _ in self.checked
        ]  # fmt: skip
        for q in range(self.world):
            for (lo, _), data in zip(spans, self.read(q, spans), strict=True):
                nz = int(data.count_nonzero())
                assert nz == 0, f"rank {self.rank}: {what}: replica {q} at {lo}: {nz} bytes != 0"
        import torch.distributed as dist

        dist.barrier()  # every rank read every replica before anyone poisons its own

    # -- tokens ---------------------------------------------------------------------------
    def batch(self, seed: int, q: int, lo: int, hi: int):
        """Rank ``q``'s tokens of a publication into blocks ``[lo, hi)``: random non-zero bf16
        inputs; distinct random slots in those blocks (disjoint between ranks), one -1, and one
        slot in block ``hi`` (uncommitted, or beyond the view); shuffled."""
        from vmmkv.testing.kv import layer_inputs

        t = self.case.tokens
        real = t - 2
        perm = torch.randperm((hi - lo) * BS, generator=torch.Generator().manual_seed(seed))
        assert perm.numel() >= self.world * real
        mine = perm[q * real : (q + 1) * real] + lo * BS
        slots = torch.cat([mine, torch.tensor([-1, hi * BS + q])])
        order = torch.randperm(t, generator=torch.Generator().manual_seed(seed * 31 + q))
        return (*layer_inputs(seed * 100 + q, t), slots[order].to(torch.int64))

    def expect(self, before, batches, n: int) -> list[torch.Tensor]:
        """``before`` (one replica's checked extents) after the reference inserts of every
        rank's ``batches`` into the bound layers, tokens beyond ``n`` blocks skipped."""
        from vmmkv.ops import reference as ref

        out = []
        for (s, bound), data in zip(self.checked, before, strict=True):
            _, page = self.segments[s]
            model = torch.zeros(self.case.nb * page, dtype=torch.uint8)
            model[: data.numel()] = data
            if bound:
                entry = MLA_ENTRY_BYTES if s >= LAYERS else INDEXER_ENTRY_BYTES
                view = model.view(self.case.nb, BS, entry)
                for kv_c, k_pe, k, slots in batches:
                    ok = torch.where(slots >= n * BS, -1, slots)
                    if s >= LAYERS:
                        ref.insert_ds_mla(view, kv_c, k_pe, ok, kind=MLA_KIND)
                    else:
                        ref.insert_indexer_k(view, k, ok, kind=IDX_KIND)
                assert not torch.equal(model[: data.numel()], data), "nothing to check"
            out.append(model[: data.numel()])
        return out

    def publish(self, kv_c, k_pe, k, gathered) -> None:
        """One step as the plugin issues it, over all bound layers (see the module docstring)."""
        cache, t = self.cache, self.case.tokens
        slots = gathered[self.rank * t : (self.rank + 1) * t]  # this rank's slice: a view
        (m0, x0), (m1, x1), (m2, x2) = self.bound
        cache.publish_layer(m0, x0, kv_c, k_pe, k, slots)
        cache.store_ds_mla(m1, kv_c, k_pe, None, gathered_slot_mapping=gathered)
        cache.barrier()
        cache.store_indexer_k(x1, k, None, gathered_slot_mapping=gathered)
        cache.barrier()
        cache.store_layer(m2, x2, kv_c, k_pe, k, slots)
        cache.barrier()

    def phase(self, what: str, seed: int, lo: int, hi: int, run) -> None:
        """Poison, snapshot every replica, ``run(batches)`` (this rank's publication), then
        every replica must equal the snapshot after every rank's reference inserts."""
        import torch.distributed as dist

        n = self.cache.committed_blocks
        ext = self.extents(n)
        self.poison(n, seed * 1000 + self.rank)
        dist.barrier()  # every replica poisoned
        before = [self.read(q, ext) for q in range(self.world)]
        dist.barrier()  # every snapshot taken before anyone publishes
        batches = [self.batch(seed, q, lo, hi) for q in range(self.world)]
        run(batches)
        self.sync()
        slots = batches[self.rank][3]
        self.errors += 2 * len(BOUND) * int(((slots >= 0) & (slots >= n * BS)).sum())
        dist.barrier()  # every rank's publication done (its barriers, too)
        for q in range(self.world):
            got, want = self.read(q, ext), self.expect(before[q], batches, n)
            for (lo_, _), g, w in zip(ext, got, want, strict=True):
                if not torch.equal(g, w):
                    bad = (g != w).nonzero().flatten()
                    raise AssertionError(
                        f"rank {self.rank}: {what}: replica {q}: {bad.numel()} bytes differ "
                        f"from the reference, first at region offsets {(lo_ + bad[:4]).tolist()}"
                    )
        assert self.cache.stats()["out_of_range_slots"] == self.errors, what
        dist.barrier()  # every rank done reading before the next poison

    def gathered(self, batches) -> torch.Tensor:
        return torch.cat([b[3] for b in batches]).to(self.dev)


def _scenario(rank: int, world: int, case: Case) -> dict:
    """The whole scenario on one rank (see the module docstring); returns the committed
    ratios and the phases' wall times."""
    start = time.monotonic()
    r = _Rank(rank, world, case)
    cache, t, dev = r.cache, case.tokens, r.dev
    ratios = {}

    # 1. first grow, warm-up, capture
    assert cache.grow_blocks(case.n1) == case.n1
    ratios[case.n1] = r.check_committed(case.n1)
    r.check_zero(0, case.n1, f"grow to {case.n1}")
    from vmmkv.ops.formats import get_format

    widths = [w for kind in (MLA_KIND, IDX_KIND) for _, _, w in get_format(kind).inputs]
    static = [torch.zeros(t, w, dtype=torch.bfloat16, device=dev) for w in widths]
    static_slots = torch.full((world * t,), -1, dtype=torch.int64, device=dev)

    def step():
        r.publish(*static, static_slots)

    step()  # eager warm-up (padding only: writes nothing) loads every kernel
    r.sync()
    if case.backend == "cuda":
        graph = capture_graph(step, dev)
        r.sync()
        replay = graph.replay
    else:
        replay = step
    assert cache.stats()["out_of_range_slots"] == 0  # neither warm-up nor capture counted

    def replayed(batches):
        for dst, src in zip(static, batches[rank][:3], strict=True):
            dst.copy_(src.to(dev))
        static_slots.copy_(r.gathered(batches))
        replay()

    def eager(batches):
        kv_c, k_pe, k = (x.to(dev) for x in batches[rank][:3])
        r.publish(kv_c, k_pe, k, r.gathered(batches))

    times = {"setup": time.monotonic() - start}
    r.phase(f"replay at {case.n1} blocks", 1, 0, case.n1, replayed)
    r.phase(f"eager at {case.n1} blocks", 2, 0, case.n1, eager)
    times["first"] = time.monotonic() - start

    # 2. grow after the capture: the same graph writes into the new blocks
    assert cache.grow_blocks(case.n2) == case.n2
    ratios[case.n2] = r.check_committed(case.n2)
    r.check_zero(case.n1, case.n2, f"grow {case.n1} -> {case.n2}")
    r.phase(f"replay into [{case.n1}, {case.n2})", 3, case.n1, case.n2, replayed)
    r.phase(f"eager into [{case.n1}, {case.n2})", 4, case.n1, case.n2, eager)
    times["second"] = time.monotonic() - start

    # 3. sleep (every chunk released, peers unmapped), a replay while asleep, wake
    assert cache.shrink_blocks(0) == 0
    assert r.check_committed(0) == 0.0
    assert cache.committed_bytes == 0 and cache.region.region.chunks() == []
    assert all(cache.region.peers.mapped_bytes(q) == 0 for q in range(world))
    batches = [r.batch(5, q, 0, case.n1) for q in range(world)]
    replayed(batches)  # every token skipped and counted: nothing is mapped to write into
    r.sync()
    r.errors += 2 * len(BOUND) * int((batches[rank][3] >= 0).sum())
    assert cache.stats()["out_of_range_slots"] == r.errors
    assert cache.grow_blocks(case.n1) == case.n1
    ratios["wake"] = r.check_committed(case.n1)
    r.check_zero(0, case.n1, f"wake to {case.n1}")
    r.phase(f"replay after wake at {case.n1}", 6, 0, case.n1, replayed)
    r.phase(f"eager after wake at {case.n1}", 7, 0, case.n1, eager)
    times["wake"] = time.monotonic() - start

    # 4. every block: the whole backing (the last chunk's tail aside) committed
    assert cache.grow_blocks(case.nb) == case.nb
    ratios[case.nb] = r.check_committed(case.nb)
    assert cache.committed_bytes == -(-(r.buf_offset + r.backing) // r.gran) * r.gran
    r.check_zero(case.n1, case.nb, f"grow {case.n1} -> {case.nb}")
    r.phase(f"replay into [{case.n2}, {case.nb})", 8, case.n2, case.nb, replayed)
    times["last"] = time.monotonic() - start

    r.sync()
    del r.replicas
    cache.close()
    return {"ratios": ratios, "times": times, "errors": r.errors}


def _run(case: Case) -> list[dict]:
    out = run_world(_scenario, WORLD, args=(case,), timeout=240)
    for rank, res in enumerate(out):
        ratios = res["ratios"]
        assert ratios == out[0]["ratios"], (rank, ratios, out[0]["ratios"])
        assert ratios[case.n1] == ratios["wake"]  # the wake commits what the first grow did
        if case.max_ratio_at_nb is not None:
            assert ratios[case.nb] <= case.max_ratio_at_nb, ratios
        print(f"{case.backend} rank {rank}: committed/blocks {ratios}, times {res['times']}")
    return out


# --------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------


def test_v32_layout_geometry_uneven_backing_and_the_committed_bound():
    """The layout itself (no ranks): the 122 segments tile the backing in vLLM's order, the
    CUDA backing is not a multiple of 2 MiB, and the chunk union computed here agrees with
    vmmkv's ``covering_chunks`` and stays within the geometric bound at every block count the
    CUDA scenario reaches (ratio <= 1.2 at 1,000 blocks)."""
    chunk = 2 << 20
    for case in (HOST, CUDA):
        segs = lbnhc_segments(LAYERS, case.nb)
        backing = LAYERS * case.nb * (IDX_PAGE + MLA_PAGE)
        assert len(segs) == 2 * LAYERS
        ends = [off + case.nb * page for off, page in segs]
        assert [off for off, _ in segs[1:]] == ends[:-1] and segs[0][0] == 0  # back to back
        assert ends[-1] == backing
        assert segs[LAYERS] == (LAYERS * case.nb * IDX_PAGE, MLA_PAGE)  # MLA after the indexer
    backing = LAYERS * CUDA.nb * (IDX_PAGE + MLA_PAGE)
    assert backing == 3_076_352_000 and backing % chunk != 0
    segs = lbnhc_segments(LAYERS, CUDA.nb)
    capacity = -(-backing // chunk) * chunk
    assert any(off % chunk for off, _ in segs)  # unaligned segment starts: shared chunks
    for n in (1, CUDA.n1, CUDA.n2, CUDA.nb):
        mine = chunk_indices(segs, n, chunk)
        theirs = covering_chunks([(o, o + n * p) for o, p in segs], chunk, capacity)
        assert sorted(mine) == [c.offset // chunk for c in theirs]
        used = n * (IDX_PAGE + MLA_PAGE) * LAYERS
        assert len(mine) * chunk <= used + len(segs) * 2 * chunk
    assert len(chunk_indices(segs, CUDA.nb, chunk)) * chunk == capacity
    assert capacity / backing <= 1.2


@pytest.mark.timeout(300)
def test_v32_block_layout_grow_capture_sleep_wake_publishes_byte_exact_on_host():
    """The scenario on the host backend (CPU, 4 KiB chunks, 7 blocks: 2 -> 5 -> 0 -> 2 -> 7);
    the 'graph' is the same step called eagerly."""
    _run(HOST)


@requires_gpu
@pytest.mark.timeout(300)
def test_v32_block_layout_grow_capture_sleep_wake_publishes_byte_exact_on_cuda():
    """The scenario on CUDA (2 MiB chunks, 1,000 blocks: 37 -> 613 -> 0 -> 37 -> 1000), the
    step captured in a CUDA graph after the first grow and only replayed afterwards."""
    _run(CUDA)
