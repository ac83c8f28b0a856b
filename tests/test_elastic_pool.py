"""Elastic KV's engine-core pieces without vLLM (``vmmkv.integrations.vllm._elastic*``): the free
queue's order and bookkeeping, the pool's two-phase grow, calm-gated release, cached cap and
idle release, and the settings' knobs. A minimal stand-in for vLLM's ``BlockPool`` holds the
blocks (id, ref count, hash) and evicts a hash as vLLM's ``_maybe_evict_cached_block`` does;
``tests/test_vllm_elastic.py`` runs the same code inside vLLM's real scheduler."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from vmmkv import _blockset as blockset
from vmmkv.integrations.vllm._elastic import ElasticPool
from vmmkv.integrations.vllm._elastic_queue import LowestIdFreeQueue
from vmmkv.integrations.vllm._elastic_settings import STAMP, elastic_enabled, elastic_settings


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: object = None
    is_null: bool = False


class Pool:
    """What ElasticPool uses of vLLM's BlockPool, with vLLM's semantics for handing out and
    freeing (get_new_blocks / free_blocks / touch)."""

    def __init__(self, n: int) -> None:
        self.num_gpu_blocks = n
        self.blocks = [Block(i) for i in range(n)]
        self.blocks[0].is_null = True
        self.free_block_queue = None  # the elastic queue replaces it

    def get_num_free_blocks(self) -> int:
        q = self.free_block_queue
        return self.num_gpu_blocks - 1 if q is None else q.num_free_blocks

    def _maybe_evict_cached_block(self, b: Block) -> bool:
        had, b.block_hash = b.block_hash is not None, None
        return had

    def get_new_blocks(self, n: int) -> list[Block]:
        out = self.free_block_queue.popleft_n(n)
        for b in out:
            self._maybe_evict_cached_block(b)
            b.ref_cnt += 1
        return out

    def free_blocks(self, blocks: list[Block]) -> None:
        plain, cached = [], []
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                (plain if b.block_hash is None else cached).append(b)
        self.free_block_queue.prepend_n(plain)
        self.free_block_queue.append_n(cached)

    def touch(self, blocks: list[Block]) -> None:
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_block_queue.remove(b)
            b.ref_cnt += 1


def _settings(n=256, **kw):
    env = {
        "VMMKV_ELASTIC_WATERMARK_BLOCKS": str(kw.pop("watermark", 16)),
        "VMMKV_ELASTIC_FLOOR_BLOCKS": str(kw.pop("floor", 32)),
        "VMMKV_ELASTIC_CACHED_BLOCKS": str(kw.pop("cached", 8)),
        "VMMKV_ELASTIC_RELEASE_STEPS": str(kw.pop("steps", 3)),
        **kw.pop("env", {}),
    }
    s = elastic_settings(
        n, 1000, 4000, block_size=64, max_num_batched_tokens=256, max_num_seqs=8,
        concurrent_batches=1, env=env,
    )  # fmt: skip
    # the sizes below are hand-computed without the new level's margin (its own test has it)
    return dataclasses.replace(s, level_margin=kw.pop("margin", 0.0))


def _stamp(seq, committed, error=None):
    return type("Out", (), {STAMP: (seq, committed, error)})()


def test_the_queue_hands_out_uncached_blocks_lowest_id_first_then_cached_ones_oldest_first():
    blocks = [Block(i) for i in range(12)]
    q = LowestIdFreeQueue(blocks, range(1, 12))
    got = q.popleft_n(6)
    assert [b.block_id for b in got] == [1, 2, 3, 4, 5, 6]
    q.prepend_n([blocks[5], blocks[2]])  # freed without a hash
    q.append_n([blocks[4], blocks[1]])  # freed with one (cached): oldest first in the LRU
    assert q.num_free_blocks == 9 and list(q.lru) == [4, 1] and q.num_uncached == 7
    # every uncached block (lowest id first) before any prefix-cache entry is given up
    assert [q.popleft().block_id for _ in range(5)] == [2, 5, 7, 8, 9]
    q.remove(blocks[10])
    assert [b.block_id for b in q.get_all_free_blocks()] == [11, 4, 1]
    assert not q.contains(10) and q.contains(11) and q.contains(4)
    with pytest.raises(ValueError, match="cannot take 4 free blocks from 3"):
        q.popleft_n(4)
    assert q.cached_taken == 0
    assert [b.block_id for b in q.popleft_n(3)] == [11, 4, 1]  # then cached, oldest first
    assert q.cached_taken == 2

    lifo = LowestIdFreeQueue(blocks, range(1, 6), order="lifo")
    assert [lifo.popleft().block_id for _ in range(3)] == [1, 2, 3]  # vLLM: id order at start
    lifo.prepend_n([blocks[2], blocks[1]])  # vLLM prepends: blocks[0] of the list comes next
    lifo.append_n([blocks[3]])
    assert [b.block_id for b in lifo.popleft_n(4)] == [2, 1, 4, 5]
    assert lifo.popleft().block_id == 3  # cached ones last


def test_cached_blocks_freed_to_the_front_keep_their_hash_and_are_evicted_first():
    """vLLM 0.34's BlockPool.free_blocks(evict_first=True) prepends blocks that keep their hash
    (another tier holds their contents): they join the age order at its front, a prefix hit
    still finds them, and none is handed out as an uncached block."""
    blocks = [Block(i) for i in range(10)]
    q = LowestIdFreeQueue(blocks, range(1, 10))
    got = q.popleft_n(6)
    for b in got:
        b.block_hash = ("h", b.block_id)
    q.append_n([blocks[1], blocks[2]])  # ordinary cached frees: oldest first
    q.prepend_n([blocks[5], blocks[4], blocks[6]])  # evict_first: 5 before 4 before 6
    assert list(q.lru) == [5, 4, 6, 1, 2] and q.num_free_blocks == 8
    q.remove(blocks[4])  # a prefix hit on a block freed to the front
    assert list(q.lru) == [5, 6, 1, 2] and q.num_free_blocks == 7
    blocks[5].block_hash = None  # the cached cap dropped its hash
    q.demote(blocks[5])
    assert list(q.lru) == [6, 1, 2]
    assert [q.popleft().block_id for _ in range(7)] == [5, 7, 8, 9, 6, 1, 2]


def test_the_queue_stays_exact_through_random_churn_with_stale_entries_dropped():
    """Random hand-outs, frees (cached or not), removals and demotions against a model."""
    rng = random.Random(7)
    blocks = [Block(i) for i in range(64)]
    for order in ("lowest", "lifo"):
        q = LowestIdFreeQueue(blocks, range(1, 64), order=order)
        free, used, cached = set(range(1, 64)), set(), {}  # cached: the model's LRU (a dict)
        for _ in range(4000):
            op = rng.random()
            if op < 0.4 and free:
                got = q.popleft_n(rng.randint(1, min(4, len(free))))
                ids = [b.block_id for b in got]
                if order == "lowest":  # uncached lowest first, then cached oldest first
                    assert ids == (sorted(free - set(cached)) + list(cached))[: len(ids)]
                free -= set(ids)
                used |= set(ids)
                for i in ids:
                    cached.pop(i, None)
            elif op < 0.8 and used:
                b = blocks[rng.choice(sorted(used))]
                if rng.random() < 0.5:
                    q.append_n([b])
                    cached[b.block_id] = None
                else:
                    q.prepend_n([b])
                used.remove(b.block_id)
                free.add(b.block_id)
            elif free:
                i = rng.choice(sorted(free))
                if i in q.lru and rng.random() < 0.5:
                    q.demote(blocks[i])
                    del cached[i]
                    continue
                q.remove(blocks[i])
                free.remove(i)
                used.add(i)
                cached.pop(i, None)
            assert q.num_free_blocks == len(free) and list(q.lru) == list(cached)
            assert {b.block_id for b in q.get_all_free_blocks()} == free
        assert len(q._uncached) <= 4 * 64 + 1


def test_settings_defaults_rounding_and_refused_knobs():
    s = elastic_settings(
        4096, 3_076_352, 64 << 20, block_size=64, max_num_batched_tokens=8192,
        max_num_seqs=256, concurrent_batches=2, env={},
    )  # fmt: skip
    assert s.quantum == 21  # 64 MiB over DeepSeek-V3.2's 3,076,352 B per block
    assert s.watermark == 1024  # a quarter of the pool (3 worst steps of 384 blocks: more)
    assert s.watermark_min == 132  # one step admitting 8192 tokens: 128 blocks + 256 / 64
    assert s.floor == 399 and s.floor % s.quantum == 0  # 3 such steps, rounded up
    assert s.round(1) == s.floor and s.round(2101) == 2121 and s.round(5000) == 4096
    assert (s.calm_seconds, s.window_seconds, s.lead_steps) == (10.0, 30.0, 3)
    assert s.release_min == 21 and s.block_bytes == 3_076_352
    fixed = _settings()  # a watermark set by hand stays fixed; the floor's default follows it
    assert fixed.watermark == fixed.watermark_min == 16 and fixed.floor == 32
    assert _settings(env={"VMMKV_ELASTIC_FLOOR_BLOCKS": ""}).floor == 32
    assert elastic_enabled({"VLLM_VMMKV_ELASTIC": "1"})
    assert not elastic_enabled({})
    with pytest.raises(ValueError, match="VLLM_VMMKV_ELASTIC must be"):
        elastic_enabled({"VLLM_VMMKV_ELASTIC": "yes"})
    for var, raw in (
        ("VMMKV_ELASTIC_WATERMARK_BLOCKS", "0"),
        ("VMMKV_ELASTIC_IDLE_S", "nan"),
        ("VMMKV_ELASTIC_RELEASE_STEPS", "ten"),
        ("VMMKV_ELASTIC_CALM_S", "-1"),
        ("VMMKV_ELASTIC_WINDOW_S", "inf"),
        ("VMMKV_ELASTIC_ORDER", "fifo"),
    ):
        with pytest.raises(ValueError, match=var):
            _settings(env={var: raw})
    with pytest.raises(ValueError, match=">= 2 blocks"):
        elastic_settings(
            1, 10, 10, block_size=64, max_num_batched_tokens=1, max_num_seqs=1,
            concurrent_batches=1, env={},
        )  # fmt: skip


def test_a_grow_is_handed_out_only_after_the_workers_confirm_it():
    pool = Pool(256)
    el = ElasticPool(pool, _settings())
    assert el.limit == 32 and pool.get_num_free_blocks() == 31  # the floor, null block aside
    got = pool.get_new_blocks(20)
    el.before_schedule()  # 11 free < watermark 16: ask for limit + max(16, limit / 4)
    assert el.pending == (1, 48) and el.resize_request() == (1, 48) and el.limit == 32
    el.on_output(_stamp(0, 32))  # an earlier step's output: not the confirmation
    el.before_schedule()  # no second request while one is pending
    assert el.limit == 32 and el.seq == 1 and pool.get_num_free_blocks() == 11
    el.on_output(_stamp(1, 48))
    assert el.limit == 48 and el.pending is None and pool.get_num_free_blocks() == 27
    assert max(b.block_id for b in pool.get_new_blocks(27)) == 47
    pool.free_blocks(got)
    assert el.counts["grows"] == 1


def test_a_refused_grow_keeps_the_limit_and_waits_before_trying_again():
    pool = Pool(256)
    el = ElasticPool(pool, _settings(steps=3))
    pool.get_new_blocks(20)
    el.before_schedule()
    el.on_output(_stamp(1, 32, "rank 1: RendezvousError: out of memory"))
    assert el.limit == 32 and el.target == 32 and el.counts["refused"] == 1
    assert "out of memory" in el.last_error
    for _ in range(3):  # held for release_steps steps
        el.before_schedule()
        assert el.pending is None
    el.before_schedule()
    assert el.pending == (2, 48)
    el.on_output(_stamp(2, 48))
    assert el.limit == 48


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _grown(pool, el, clock, size):
    """Take every free block and confirm every grow until the limit reaches ``size``."""
    sizes, live = [], []
    while el.limit < size:
        live += pool.get_new_blocks(pool.get_num_free_blocks())
        el.before_schedule()
        el.on_output(_stamp(el.seq, el.target))
        sizes.append(el.limit)
    live += pool.get_new_blocks(pool.get_num_free_blocks())
    return sizes, live


def test_the_tail_is_released_a_calm_time_after_the_last_grow_losing_its_hashes():
    pool, clock = Pool(256), Clock()
    el = ElasticPool(pool, _settings(floor=16, steps=3, cached=20, env=CALM_1S), clock=clock)
    sizes, live = _grown(pool, el, clock, 128)
    # each grow leaves 1.5 x watermark (24) uncached blocks free, rounded to the quantum of 4
    assert sizes == [40, 64, 88, 112, 136] and el.seq == 5
    held = [b for b in live if b.block_id < 10]  # keep the 9 lowest blocks in use
    for b in live:
        if b.block_id >= 10:
            b.block_hash = ("h", b.block_id)  # cached when freed
    pool.free_blocks([b for b in live if b.block_id >= 10])
    for t in (0.0, 0.5, 0.9, 0.95):  # 4 calm steps, but not yet 1 s since the last grow
        clock.t = t
        el.before_schedule()
        assert el.limit == 136
    assert el.counts["dropped_by_cap"] == 126 - 20  # the oldest hashes first
    # the need: 9 in use + 20 cached + 1 + 2 x watermark 16 free, 64 rounded to the quantum;
    # but the 20 cached blocks (ids 116-135) lie in the tail a release drops: 9 + 1 + 32 -> 44
    clock.t = 1.05
    el.before_schedule()
    assert el.limit == 44 and el.resize_request() == (6, 44) and el.counts["releases"] == 1
    parked = pool.blocks[44:]
    assert all(b.block_hash is None for b in parked)
    assert not any(el.queue.contains(b.block_id) for b in parked)
    assert pool.get_num_free_blocks() == 44 - 1 - len(held)
    assert el.counts["dropped_by_release"] == 20
    assert el.counts["cached_dropped"] == 126
    assert el.stats()["released_blocks"] == 92
    for t in (2.0, 3.0, 4.0):  # nothing left to release
        clock.t = t
        el.before_schedule()
    assert el.limit == 44 and el.counts["releases"] == 1


CALM_1S = {"VMMKV_ELASTIC_CALM_S": "1"}


def test_a_release_keeps_the_largest_rise_of_its_calm_time_and_waits_while_the_need_falls():
    pool, clock = Pool(256), Clock()
    el = ElasticPool(
        pool, _settings(floor=16, watermark=8, steps=1, cached=50, env=CALM_1S), clock=clock
    )
    _, live = _grown(pool, el, clock, 128)
    pool.free_blocks([b for b in live if b.block_id >= 10])  # 9 in use, no cached
    for t, take in ((0.1, 0), (0.2, 0), (0.4, 30), (0.6, -30)):  # the need: 9, 9, 39, 9
        clock.t = t
        if take > 0:
            more = pool.get_new_blocks(take)
        elif take < 0:
            pool.free_blocks(more)
        el.before_schedule()
    clock.t = 1.15  # a calm time since the first step after the grow; the rise in its window
    el.before_schedule()
    assert el.limit == 56 and el.counts["releases"] == 1  # 9 + the rise of 30 + 1 + 2 x 8

    # a need still falling is released once, where it settles (2 calm times after the last)
    clock.t = 3.2
    more = pool.get_new_blocks(30)  # need 39: no grow (16 uncached free >= watermark 8)
    el.before_schedule()
    for t in (3.5, 3.9, 4.2):  # the need falls 29, 19, 9
        clock.t = t
        pool.free_blocks(more[:10])
        more = more[10:]
        el.before_schedule()
        assert el.limit == 56, t  # fell by >= release_min (8) in the last half calm time
    clock.t = 4.5
    el.before_schedule()
    assert el.limit == 28 and el.counts["releases"] == 2  # 9 + 1 + 16, rounded

    # a plateau (no fall of the need since the last release) releases nothing in band, even
    # with 100 blocks to spare: that is the idle release's (or a fall's) to do
    el.queue.prepend_n(pool.blocks[28:128])
    el.limit = 128
    for t in (7.0, 8.0, 9.0):
        clock.t = t
        el.before_schedule()
    assert el.limit == 128 and el.counts["releases"] == 2 and el.peak_need == 9


def test_a_release_spares_the_prefix_cache_entries_in_the_tail_when_it_still_frees_half():
    pool, clock = Pool(256), Clock()
    el = ElasticPool(pool, _settings(floor=16, steps=1, cached=50, env=CALM_1S), clock=clock)
    _, live = _grown(pool, el, clock, 128)
    spare = [b for b in live if b.block_id in (60, 61)]
    for b in spare:
        b.block_hash = ("h", b.block_id)
    pool.free_blocks([b for b in live if b.block_id >= 10])  # 9 in use, cached 60 and 61
    for t in (0.0, 1.05):
        clock.t = t
        el.before_schedule()
    # 44 would drop both hashes; 64 (above them, rounded) still frees 72 >= 92 / 2 blocks
    assert el.limit == 64 and el.counts["releases"] == 1
    assert all(b.block_hash is not None for b in spare) and el.counts["dropped_by_release"] == 0


def test_the_cached_cap_gives_a_block_a_prefix_hit_reused_a_second_chance():
    pool = Pool(256)
    el = ElasticPool(pool, _settings(floor=32, cached=4))
    got = pool.get_new_blocks(10)
    for b in got:
        b.block_hash = ("h", b.block_id)
    pool.touch(got[:1])  # another request hits block 1 while it is in use
    pool.free_blocks(got[:1])
    pool.free_blocks(got)  # freed oldest first: 1, 2, ..., 10
    assert list(el.queue.lru) == list(range(1, 11)) and el.hit == {1}
    el.before_schedule()  # 6 over the cap: 1 is spared once (moved young, unmarked), 2-7 go
    assert list(el.queue.lru) == [8, 9, 10, 1] and not el.hit
    assert el.counts["dropped_by_cap"] == 6 and pool.blocks[1].block_hash is not None


def test_the_cached_cap_drops_the_oldest_hashes_and_idle_goes_to_the_floor():
    pool = Pool(256)
    el = ElasticPool(pool, _settings(floor=32, cached=4))
    got = pool.get_new_blocks(10)
    for i, b in enumerate(got):
        b.block_hash = ("h", i)
    pool.free_blocks(got)  # freed in id order: ids 1.. are the oldest
    el.before_schedule()
    assert [b.block_id for b in el.queue.lru.values()] == [7, 8, 9, 10]
    assert all(pool.blocks[i].block_hash is None for i in range(1, 7))
    assert el.idle_release() is None  # already at the floor
    el.limit = 32
    el.queue.prepend_n(pool.blocks[32:64])
    el.limit = 64
    keep = pool.get_new_blocks(1)
    assert keep[0].block_id == 1
    assert el.idle_release() == (1, 32) and el.limit == 32
    pool.free_blocks(keep)
    assert pool.get_num_free_blocks() == 31
    assert el.usage() == 0.0


def test_the_watermark_follows_the_largest_step_of_its_window_and_grows_track_the_rate():
    pool, clock = Pool(512), Clock()
    s = elastic_settings(
        512, 1000, 4000, block_size=64, max_num_batched_tokens=256, max_num_seqs=8,
        concurrent_batches=1, env={},
    )  # fmt: skip
    assert (s.watermark_min, s.watermark, s.floor, s.lead_steps) == (5, 24, 12, 2)
    assert s.level_margin == 0.25
    el = ElasticPool(pool, s, clock=clock)
    assert el.watermark == 5
    live = pool.get_new_blocks(7)  # one step takes 7 blocks: 2 steps of them, within [5, 24]
    el.before_schedule()
    assert el.watermark == 14 and el.pending is not None  # 4 free < 14: grow
    el.on_output(_stamp(el.seq, el.target))
    for t in range(1, 31):  # quiet steps: the 7-block step stays in the window for 30 s
        clock.t = t
        el.before_schedule()
        assert el.watermark == (14 if t <= 30 else 5)
    clock.t = 30.5
    el.before_schedule()
    assert el.watermark == 5
    pool.free_blocks(live)

    # in use growing 10 blocks a second: a grow adds half a calm time (5 s) of it (no new
    # level's margin here: a rising need never meets an earlier level)
    pool, clock = Pool(512), Clock()
    el = ElasticPool(pool, dataclasses.replace(s, level_margin=0.0), clock=clock)
    rates = []
    for t in range(12):
        clock.t = float(t)
        pool.get_new_blocks(10)
        el.before_schedule()
        if el.pending is not None:  # limit - free = in use + cached + 1
            keep = el.watermark + el.watermark // 2 + int(5 * el.growth_rate())
            assert el.keep() == keep  # 1.5 x the watermark, and 5 s of the growth rate
            want = el.limit - el.queue.num_uncached + keep
            assert el.target == el.s.round(want)
            rates.append(el.growth_rate())
            el.on_output(_stamp(el.seq, el.target))
    assert rates[0] == 0.0 and rates[-1] == 10.0 and el.counts["grows"] == len(rates) >= 3


def test_usage_is_blocks_in_use_over_the_capacity_not_over_the_committed_part():
    pool = Pool(256)
    el = ElasticPool(pool, _settings(floor=32))
    got = pool.get_new_blocks(15)
    assert el.usage() == 15 / 255 and el.stats()["usage"] == 15 / 255
    st = el.stats()
    assert (st["committed"], st["capacity"], st["in_use"], st["uncached_free"]) == (32, 256, 15, 16)
    assert st["committed_bytes"] == 32 * 1000
    pool.free_blocks(got)


def test_each_resize_logs_one_info_line_with_the_committed_size(caplog):
    pool, clock = Pool(256), Clock()
    el = ElasticPool(pool, _settings(floor=16, steps=1, env=CALM_1S), clock=clock)
    with caplog.at_level("INFO", logger="vmmkv.integrations.vllm._elastic"):
        _, live = _grown(pool, el, clock, 64)
        pool.free_blocks(live)
        for t in (0.0, 1.05):
            clock.t = t
            el.before_schedule()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == el.counts["grows"] + el.counts["releases"] == 3, lines
    assert lines[0].startswith("vmmkv: elastic KV grew 16 -> 40 of 256 blocks")
    assert "released 64 -> 36 of 256 blocks" in lines[-1] and "0 prefix-cache" in lines[-1]


def _pinned_tail(holes=True):
    """A pool grown to 136 blocks, then freed but for blocks 1-9 and 130 (the tail pinned);
    blocks 60-63 (one chunk) cached; a release due (calm time 1 s)."""
    pool, clock = Pool(256), Clock()
    s = _settings(floor=16, steps=1, cached=50, env=CALM_1S)
    if not holes:
        s = dataclasses.replace(s, holes=False)
    el = ElasticPool(pool, s, clock=clock)
    _, live = _grown(pool, el, clock, 128)
    for b in live:
        if 60 <= b.block_id < 64:
            b.block_hash = ("h", b.block_id)
    pool.free_blocks([b for b in live if b.block_id >= 10 and b.block_id != 130])
    for t in (0.0, 1.05):
        clock.t = t
        el.before_schedule()
    return pool, clock, el


def test_a_pinned_tail_releases_whole_free_chunks_below_it_as_holes_sparing_cached_ones():
    pool, clock, el = _pinned_tail()
    # need 10 in use + 4 cached, + 1 + 2 x watermark 16 = 47 kept; the tail (132) frees too
    # little, so 22 free chunks of 4 go, the highest uncached first: 124-127 down to 36-39
    assert el.holes == ((36, 60), (64, 128)) and el.limit == 136 and el.committed == 48
    assert el.resize_request() == (6, ((0, 36), (60, 64), (128, 136)))
    assert el.counts["releases"] == 1 and el.counts["hole_blocks"] == 88
    assert el.counts["dropped_by_release"] == 0  # the cached chunk is kept, hashes and all
    assert el.stats()["committed"] == 48 and el.parked() == 256 - 48
    # parked like the tail: never handed out, not counted free
    assert pool.get_num_free_blocks() == 48 - 1 - 10
    got = pool.get_new_blocks(37)
    ids = [b.block_id for b in got]
    assert not any(36 <= i < 60 or 64 <= i < 128 for i in ids)
    assert ids[-4:] == [60, 61, 62, 63]  # cached ones last
    assert el.usage() == (48 - 1) / 255


def test_a_grow_refills_the_lowest_holes_first_and_a_set_stamp_confirms_it():
    pool, clock, el = _pinned_tail()
    live = pool.get_new_blocks(pool.get_num_free_blocks())
    clock.t = 1.2
    el.before_schedule()  # nothing free: grow
    seq, target = el.pending
    assert isinstance(target, tuple) and target[0][0] == 0
    filled = blockset.difference(target, ((0, 36), (60, 64), (128, 136)))
    assert filled and filled[0][0] == 36  # the lowest hole first, in chunks of 4
    assert blockset.top(target) == 136  # the tail is not grown while holes are left
    n = blockset.count(filled)
    el.on_output(_stamp(seq, ((0, 36),)))  # a stamp that does not hold the target: refused
    assert el.counts["refused"] == 1 and el.committed == 48
    assert el.target == ((0, 36), (60, 64), (128, 136))
    for _ in range(3):
        el.before_schedule()
    seq, target = el.pending
    el.on_output(_stamp(seq, target))
    assert el.committed == 48 + n and el.counts["grows"] == 6
    new = pool.get_new_blocks(pool.get_num_free_blocks())
    assert sorted(b.block_id for b in new) == [i for a, b in filled for i in range(a, b)]
    pool.free_blocks(new + live)


def test_a_grow_past_every_hole_is_a_prefix_again_and_an_int_stamp_confirms_it():
    pool, clock, el = _pinned_tail()
    live = pool.get_new_blocks(pool.get_num_free_blocks())
    while el.holes:
        clock.t += 0.01
        el.before_schedule()
        if el.pending:
            target = el.pending[1]
            el.on_output(_stamp(el.pending[0], target if el.holes and isinstance(target, tuple)
                                else blockset.as_prefix(blockset.as_set(target))))  # fmt: skip
        live += pool.get_new_blocks(pool.get_num_free_blocks())
    assert isinstance(el.target, int) and el.committed == el.limit >= 136
    assert el.resize_request() == (el.seq, el.limit)


def test_no_holes_where_they_are_off_the_pinned_tail_keeps_its_blocks():
    """Under vLLM's extensible KV cache (holes off: its recommit commits a prefix)."""
    pool, clock, el = _pinned_tail(holes=False)
    assert el.limit == el.committed == 136 and el.holes == () and el.counts["releases"] == 0
    assert el.resize_request() == (5, 136)


def _vllm_config(extensible=None, batches=1):
    from types import SimpleNamespace

    return SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=256, max_num_seqs=8),
        cache_config=SimpleNamespace(block_size=64, enable_extensible_kv_cache=extensible),
        max_concurrent_batches=batches,
    )


KVC = SimpleNamespace(num_blocks=256, kv_cache_tensors=[SimpleNamespace(size=256 * 1000)])


def test_settings_for_turns_holes_off_under_vllms_extensible_kv_cache():
    from vmmkv.integrations.vllm._elastic_settings import settings_for

    assert settings_for(_vllm_config(None), KVC, 4000).holes
    assert settings_for(_vllm_config(False), KVC, 4000).holes
    assert not settings_for(_vllm_config(True), KVC, 4000).holes


def test_the_watermark_covers_one_step_more_than_vllms_batches_in_flight():
    """A grow is confirmed by the output of the step that carried it, processed after
    ``max_concurrent_batches - 1`` more steps were scheduled: a batch queue of 2 without async
    scheduling (2 pipeline stages) needs the lead of async scheduling, not of a sync engine."""
    from vmmkv.integrations.vllm._elastic_settings import settings_for

    got = {b: settings_for(_vllm_config(batches=b), KVC, 4000) for b in (1, 2, 3)}
    assert [got[b].lead_steps for b in (1, 2, 3)] == [2, 3, 4]
    # 256 / 64 + 8 blocks a worst step: lead x 12, at most a quarter of the pool
    assert [got[b].watermark for b in (1, 2, 3)] == [24, 36, 48]
    assert [got[b].floor for b in (1, 2, 3)] == [12, 16, 20]  # lead x 5, in chunks of 4
    with pytest.raises(ValueError, match="concurrent_batches"):
        settings_for(_vllm_config(batches=0), KVC, 4000)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [128, 130])  # the last chunk whole, or cut short at num_blocks
def test_a_pool_committed_to_its_last_block_releases_holes_below_it(n):
    """The hole scan ends at the last chunk, whose blocks end at ``num_blocks``."""
    pool, clock = Pool(n), Clock()
    el = ElasticPool(pool, _settings(n, floor=16, steps=1, cached=50, env=CALM_1S), clock=clock)
    _, live = _grown(pool, el, clock, n)
    assert el.limit == n and el.committed == n
    pool.free_blocks([b for b in live if 10 <= b.block_id < n - 1])  # the last block pinned
    for t in (0.0, 1.05):
        clock.t = t
        el.before_schedule()
    assert el.counts["releases"] == 1 and el.holes, el.counts
    assert blockset.top(el.holes) <= n - 1 and el.committed < n // 2, (el.holes, el.committed)
    assert el.resize_request()[1] == blockset.difference(blockset.prefix(n), el.holes)


def test_holes_that_must_take_cached_chunks_drop_their_hashes_and_keep_the_others():
    """One cached block in every free chunk below the pinned tail (kvcached's page-pinning
    case): the holes take cached chunks, highest first, and a block in a hole loses its hash
    (a later prefix hit would read recommitted, zeroed memory); cached blocks still committed
    keep theirs."""
    pool, clock = Pool(256), Clock()
    el = ElasticPool(pool, _settings(floor=16, steps=1, cached=50, env=CALM_1S), clock=clock)
    _, live = _grown(pool, el, clock, 128)
    for b in live:
        if 10 <= b.block_id < 128 and b.block_id % 4 == 2:
            b.block_hash = ("h", b.block_id)
    pool.free_blocks([b for b in live if b.block_id >= 10 and b.block_id != 130])
    for t in (0.0, 1.05):
        clock.t = t
        el.before_schedule()
    assert el.counts["releases"] == 1 and el.holes, el.counts
    holed = [i for a, b in el.holes for i in range(a, b)]
    cached_holed = [i for i in holed if 10 <= i < 128 and i % 4 == 2]
    assert cached_holed and all(pool.blocks[i].block_hash is None for i in holed)
    assert el.counts["dropped_by_release"] == len(cached_holed), el.counts
    kept = [i for i in range(10, 128) if i % 4 == 2 and not blockset.contains(el.holes, i)]
    assert kept and all(pool.blocks[i].block_hash == ("h", i) for i in kept)
    assert min(holed) > max(kept)  # the highest chunks first


def _pinned_top(n=1024):
    """A pool committed to ``n`` blocks with blocks 1-9 and the top one in use, the rest
    freed; a release due from t = 1.05 s (calm time 1 s)."""
    pool, clock = Pool(n), Clock()
    el = ElasticPool(pool, _settings(n, floor=16, steps=1, cached=50, env=CALM_1S), clock=clock)
    _, live = _grown(pool, el, clock, n)
    pool.free_blocks([b for b in live if 10 <= b.block_id < el.limit - 1])
    clock.t = 0.0
    el.before_schedule()
    clock.t = 1.05
    return pool, clock, el


def _until_released(el, clock, most=100):
    steps = 0
    while el.counts["releases"] == 0 and steps < most:
        el.before_schedule()
        clock.t += 0.001
        steps += 1
    return steps


def test_a_hole_scan_reads_a_bounded_number_of_blocks_a_step_and_releases_what_one_pass_does(
    monkeypatch,
):
    from vmmkv.integrations.vllm import _elastic_holes

    monkeypatch.setattr(_elastic_holes, "SCAN_BLOCKS", 1 << 30)  # the whole pool in one step
    pool, clock, el = _pinned_top()
    whole = _until_released(el, clock)
    assert whole == 1 and el.holes, (whole, el.counts)
    monkeypatch.setattr(_elastic_holes, "SCAN_BLOCKS", 64)
    pool2, clock2, el2 = _pinned_top()
    reads = []
    real = pool2.blocks.__class__.__getitem__

    class Counted(list):
        def __getitem__(self, i):
            reads.append(i)
            return real(self, i)

    pool2.blocks = Counted(pool2.blocks)
    steps = 0
    while el2.counts["releases"] == 0 and steps < 100:
        reads.clear()
        el2.before_schedule()
        clock2.t += 0.001
        steps += 1
        if el2.counts["releases"] == 0:
            assert len(reads) <= 64 + 4, len(reads)  # one chunk may end past the bound
    chunks_below = (el2.limit - 1 - 16) // 4  # chunks from the floor to the pinned top
    assert steps == -(-(chunks_below * 4) // 64), steps  # the last one finishes and releases
    assert (el2.holes, el2.committed) == (el.holes, el.committed)  # what one pass releases


def test_a_chunk_handed_out_while_the_hole_scan_is_under_way_is_not_released(monkeypatch):
    from vmmkv.integrations.vllm import _elastic_holes

    monkeypatch.setattr(_elastic_holes, "SCAN_BLOCKS", 512)
    pool, clock, el = _pinned_top()
    el.before_schedule()  # the scan's first step reads chunks 16-527, every one free
    assert el.counts["releases"] == 0 and el._scan is not None
    taken = [pool.blocks[i] for i in range(500, 504)]
    pool.touch(taken)  # a prefix hit takes a chunk the scan found free
    steps = _until_released(el, clock)
    assert el.counts["releases"] == 1 and steps == 1, (steps, el.counts)
    assert not any(blockset.contains(el.holes, b.block_id) for b in taken), el.holes
    # the chunks around it, read in the same step, are released
    assert blockset.contains(el.holes, 499) and blockset.contains(el.holes, 504), el.holes


def _release_at(pool, el, clock, live, in_use, step=0.1):
    """Free every block of ``live`` but the ``in_use`` lowest, step until a release; the new
    limit (the blocks freed leave ``live``)."""
    keep = sorted(live, key=lambda b: b.block_id)[:in_use]
    pool.free_blocks([b for b in live if b not in keep])
    live[:] = keep
    releases = el.counts["releases"]
    for _ in range(100):
        clock.t += step
        el.before_schedule()
        if el.counts["releases"] > releases:
            return el.limit
    raise AssertionError(f"no release: {el.stats()}")


def test_a_release_returns_to_a_level_it_asked_for_within_a_watermark_until_it_is_forgotten():
    from vmmkv.integrations.vllm._elastic import LEVEL_SECONDS

    pool, clock = Pool(256), Clock()
    s = _settings(floor=16, watermark=8, steps=1, cached=50, env=CALM_1S, margin=0.25)
    el = ElasticPool(pool, s, clock=clock)
    _, live = _grown(pool, el, clock, 128)
    # 9 in use: asks 9 + 1 + 2 x 8 = 26, a new level: + a quarter watermark = 28
    assert _release_at(pool, el, clock, live, 9) == 28
    clock.t += 3.0
    _, more = _grown(pool, el, clock, 128)
    live += more
    # 3 in use: asks 20; the level 28 is within a watermark above it (without it: 20 + 2 -> 24)
    assert _release_at(pool, el, clock, live, 3) == 28
    assert [(n, k) for _, n, k in el._levels if k == "release"] == [(28, "release")] * 2
    clock.t += LEVEL_SECONDS + 1.0  # forgotten
    _, more = _grown(pool, el, clock, 128)
    live += more
    assert _release_at(pool, el, clock, live, 3) == 24


def test_a_grow_returns_to_the_largest_grow_level_within_a_watermark_above_what_it_needs():
    pool, clock = Pool(512), Clock()
    el = ElasticPool(pool, _settings(n=512, floor=16, watermark=8, margin=0.25), clock=clock)
    el._levels.extend([(0.0, 60, "grow"), (0.0, 64, "grow"), (0.0, 90, "release")])
    assert el._level(57, 1.0, "grow") == 64  # 60 and 64 within [57, 65]: the largest
    assert el._level(57, 1.0, "release") == 59  # no release level near: 57 + 8 // 4
    assert el._level(65, 1.0, "grow") == 67  # none at or above 65 within a watermark
    live = pool.get_new_blocks(pool.get_num_free_blocks())  # 15 in use, 0 free of 16
    el.before_schedule()  # asks 16 + 1.5 x 8 = 28 (+2): no level within [28, 36]
    assert el.target == 32 and el._asked == 30
    el.on_output(_stamp(el.seq, el.target))
    live += pool.get_new_blocks(pool.get_num_free_blocks())
    el._levels.append((clock.t, 52, "grow"))
    el.before_schedule()  # asks 32 + 12 = 44: goes to the level 52 (within [44, 52])
    assert el.target == 52 and el._asked == 52
    pool.free_blocks(live)


def test_a_rise_that_started_far_above_the_need_is_not_kept_by_a_release():
    pool, clock = Pool(256), Clock()
    el = ElasticPool(
        pool, _settings(floor=16, watermark=8, steps=1, cached=50, env=CALM_1S), clock=clock
    )
    _, live = _grown(pool, el, clock, 128)
    pool.free_blocks([b for b in live if b.block_id > 60])  # 60 in use
    live = [b for b in live if b.block_id <= 60]
    for clock.t in (0.5, 0.95):  # the calm time counts from 0.5
        el.before_schedule()
    more = pool.get_new_blocks(30)  # the need rises 60 -> 90: a load at a level far above 9
    clock.t = 1.0
    el.before_schedule()
    # the load ends: 9 in use; the rise of 30 (in the release's calm time) started 51 blocks
    # above the need, beyond a watermark: the release keeps 9 + 1 + 2 x 8 = 26 -> 28 (counted,
    # the rise would keep 9 + 30 + 1 + 16 -> 56)
    assert _release_at(pool, el, clock, live + more, 9) == 28
    assert [t for t, v in el._needs if v == 60] and clock.t < 1.75  # the rise was in the window
