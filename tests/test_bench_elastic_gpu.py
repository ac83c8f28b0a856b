"""benchmarks/bench_elastic_gpu.py without a GPU: its geometry and arguments, the adapter's
zeroing of new blocks, and one host-backend run of 2 ranks at a tiny size (2 layers, 64 blocks,
64 KiB chunks) whose JSON is checked against chunk geometry computed here: every rank at every
step's target, committed bytes and chunk counts those of the chunks covering the blocks, ratios
within a chunk's share, the summary the slowest rank's median, and the machine, date, commit and
command recorded."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_elastic_gpu as be  # noqa: E402

SCRIPT = os.path.join(ROOT, "benchmarks", "bench_elastic_gpu.py")
KiB, MLA, IDX = 1024, 41984, 8448
LAYERS, MAX, FLOOR, STEP, REPS, CHUNK = 2, 64, 16, 8, 3, 64 * KiB
BLOCK = LAYERS * (MLA + IDX)  # 100,864 B: one block of every layer and cache


def test_geometry_is_one_packed_segment_or_the_indexer_segments_then_the_mla_segments():
    segs, size = be.geometry("BL", 61, 4000)
    assert segs == [(0, 3_076_352)] and size == 4000 * 3_076_352
    segs, size = be.geometry("LB", 61, 4000)
    assert len(segs) == 122 and size == 4000 * 3_076_352
    assert [bb for _, bb in segs] == [IDX] * 61 + [MLA] * 61
    assert segs[1] == (4000 * IDX, IDX) and segs[61] == (61 * 4000 * IDX, MLA)
    assert all(o2 == o1 + 4000 * b1 for (o1, b1), (o2, _) in zip(segs, segs[1:], strict=False))
    with pytest.raises(ValueError, match="layout must be one of"):
        be.geometry("BLNHC", 61, 10)


def test_configs_are_layout_and_mib_or_kib():
    assert be.parse_configs("BL:32,BL:64,LB:2") == [
        ("BL", 32 << 20), ("BL", 64 << 20), ("LB", 2 << 20)
    ]  # fmt: skip
    assert be.parse_configs("LB:64K, BL:0.5") == [("LB", 64 * KiB), ("BL", 512 * KiB)]
    for bad in ("XX:2", "BL", "BL:"):
        with pytest.raises(ValueError, match="want LAYOUT:SIZE"):
            be.parse_configs(bad)


def test_the_plan_is_floor_then_grow_release_pairs_then_full_and_zero():
    assert be.plan(1000, 256, 4000, 2) == [
        ("floor", 1000), ("grow", 1256), ("release", 1000), ("grow", 1256),
        ("release", 1000), ("hole", ((0, 372), (628, 1000))), ("recommit", 1000),
        ("full", 4000), ("zero", 0),
    ]  # fmt: skip


def _zeroing_rank(rank: int, world: int) -> list[int]:
    """One rank: blocks grown through ElasticWorker; bytes written past the committed blocks
    inside a committed chunk must read zero once a grow covers them, and a shrink + grow too.
    vLLM cannot be imported here, as on the GPU machines the benchmark runs on."""
    sys.modules["vllm"] = None  # type: ignore[assignment]  # an import of vllm now raises
    import torch
    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache
    from vmmkv.integrations.vllm._elastic_worker import ElasticWorker

    segs, size = be.geometry("LB", 1, 8)  # 8448 B and 41984 B blocks, 8 of each
    cache = ReplicatedKVCache(dist.group.WORLD, 1 << 20, "cpu", chunk_bytes=1 << 20,
                              initial_bytes=0, backend="host")  # fmt: skip
    try:
        buf = cache.allocate(size, reserve=True).view(torch.uint8)
        cache.set_block_layout(segs, 8)
        adapter, worker = be.ElasticCache(cache, buf, segs), ElasticWorker()
        worker.apply(adapter, (1, 2))
        buf[:size].fill_(0xAB)  # one chunk holds everything: blocks 2..7 are written too
        worker.apply(adapter, (2, 5))
        nonzero = [int(buf[o + 2 * bb : o + 5 * bb].count_nonzero()) for o, bb in segs]
        kept = [int((buf[o : o + 2 * bb] == 0xAB).sum()) - 2 * bb for o, bb in segs]
        untouched = [int((buf[o + 5 * bb : o + 8 * bb] == 0xAB).sum()) - 3 * bb for o, bb in segs]
        worker.apply(adapter, (3, 1))
        worker.apply(adapter, (3, 8))  # a sequence number seen already: nothing happens
        assert adapter.committed_blocks == 1 and worker.error is None
        return nonzero + kept + untouched
    finally:
        cache.close()


def test_the_adapter_zeroes_exactly_the_new_blocks_of_every_segment():
    from vmmkv.testing.spawn import run_world

    assert run_world(_zeroing_rank, 1, timeout=60) == [[0] * 6]


def _check_rank(rank: int, world: int) -> list[str]:
    """One rank: ``check_step`` after a real grow (zero: passes) and over the same blocks once
    dirtied, as if the resize had not zeroed them (fails, naming the blocks)."""
    import torch
    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache

    segs, size = be.geometry("LB", 1, 8)
    cache = ReplicatedKVCache(dist.group.WORLD, 1 << 20, "cpu", chunk_bytes=1 << 20,
                              initial_bytes=0, backend="host")  # fmt: skip
    try:
        buf = cache.allocate(size, reserve=True).view(torch.uint8)
        base = buf.data_ptr() - cache.region.base_ptr
        cache.set_block_layout([(base + o, bb) for o, bb in segs], 8)
        adapter = be.ElasticCache(cache, buf, segs)
        replicas = [cache.region.view(q, reserve=True) for q in range(world)]
        adapter.grow(3)
        passed = be.check_step(adapter, (), replicas, base)
        be.dirty(adapter)
        assert int(buf[segs[1][0] : segs[1][0] + 3 * segs[1][1]].count_nonzero()) == 3 * segs[1][1]
        failed = be.check_step(adapter, ((0, 1),), replicas, base)
        return [passed, failed]
    finally:
        cache.close()


def test_the_zero_check_passes_a_real_grow_and_catches_blocks_left_dirty():
    from vmmkv.testing.spawn import run_world

    [[passed, failed]] = run_world(_check_rank, 1, timeout=60)
    assert passed == ""
    assert failed.startswith("rank 0: joined blocks not zero") and "blocks [1, 3)" in failed


def _covering(layout: str, base: int, blocks, chunk: int, cap: int) -> tuple[int, int]:
    """(chunks, bytes) covering ``blocks`` (the first n, or a block set) of every segment: the
    grid of ``chunk`` over ``[0, cap)``, its last chunk cut at ``cap``."""
    held = ((0, blocks),) if isinstance(blocks, int) else blocks
    if layout == "BL":
        ranges = [(base + a * BLOCK, base + b * BLOCK) for a, b in held]
    else:
        ranges, off = [], base
        for bb in [IDX] * LAYERS + [MLA] * LAYERS:
            ranges += [(off + a * bb, off + b * bb) for a, b in held]
            off += MAX * bb
    ks = {k for s, e in ranges if e > s for k in range(s // chunk, -(-e // chunk))}
    return len(ks), sum(min(chunk, cap - k * chunk) for k in ks)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The tool's ``main`` in this process (its ranks are spawned): the JSON and stdout."""
    from tests.helpers import run_tool_main

    out = tmp_path_factory.mktemp("elastic") / "elastic.json"
    argv = [SCRIPT, "--backend", "host", "--ranks", "2", "--configs", "BL:64K,LB:64K",
            "--layers", str(LAYERS), "--max-blocks", str(MAX), "--floor", str(FLOOR), "--step",
            str(STEP), "--reps", str(REPS), "--timeout", "60", "--out", str(out)]  # fmt: skip
    return run_tool_main(be.main, argv, out)


def test_the_json_names_the_machine_date_commit_and_command(run):
    data, _ = run
    assert data["benchmark"] == "bench_elastic_gpu" and data["device"] == "host"
    assert datetime.datetime.fromisoformat(data["machine"]["date"]).tzinfo is not None
    assert data["machine"]["host"] and data["machine"]["torch"]
    assert "commit" in data
    if data["commit"] is not None:  # a checkout with git: the short hash, maybe +dirty
        assert int(data["commit"].removesuffix("+dirty"), 16) >= 0
    assert data["command"][1] == SCRIPT and "--max-blocks" in data["command"]
    assert data["settings"] == {"configs": "BL:64K,LB:64K", "layers": LAYERS, "max_blocks": MAX,
                                "floor": FLOOR, "step": STEP, "reps": REPS, "backend": "host",
                                "timeout": 60.0}  # fmt: skip


def test_every_rank_reaches_every_target_with_the_covering_chunks_committed(run):
    data, _ = run
    steps = be.plan(FLOOR, STEP, MAX, REPS)
    assert [(r["pcp"], r["layout"]) for r in data["rows"]] == [(2, "BL"), (2, "LB")]
    for row in data["rows"]:
        layout = row["layout"]
        assert "error" not in row and row["blocks_ok"] is True and row["zero_ok"] is True
        assert row["segments"] == (1 if layout == "BL" else 2 * LAYERS)
        assert row["block_bytes"] == BLOCK and row["chunk_MiB"] == CHUNK / (1 << 20)
        ranks = row["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        for r in ranks:
            assert r["chunk_bytes"] == CHUNK and r["capacity"] == MAX * BLOCK  # 4 KiB pages
            assert [(s["step"], s["target"]) for s in r["steps"]] == [
                (name, json.loads(json.dumps(t))) for name, t in steps
            ]
            prev = 0
            for s in r["steps"]:
                target = (
                    s["target"]
                    if isinstance(s["target"], int)
                    else tuple(tuple(iv) for iv in s["target"])
                )
                want_chunks, want_bytes = _covering(layout, r["base"], target, CHUNK, r["capacity"])
                n = target if isinstance(target, int) else sum(b - a for a, b in target)
                top = target if isinstance(target, int) else target[-1][1]
                assert (s["blocks"], s["committed_bytes"], s["error"]) == (top, want_bytes, "")
                assert s["zero"] == ""
                assert s["held"] == be._held(target)
                assert s["chunks"] == abs(want_chunks - prev)
                prev = want_chunks
                if n == 0:
                    assert s["ratio"] is None and s["committed_bytes"] == 0
                    continue
                assert s["ratio"] == pytest.approx(want_bytes / (n * BLOCK))
                # at most one partly used chunk at each end of every segment (BL: one in all)
                # (a hole adds the partly used chunks at its two edges)
                parts = 2 * len(s["held"]) - 1 if layout == "BL" else 4 * LAYERS * len(s["held"])
                share = parts * CHUNK / (n * BLOCK)
                assert 1.0 <= s["ratio"] < 1.0 + share
        for i in range(len(steps)):  # the same size on every rank at every step
            assert len({(r["steps"][i]["blocks"], r["steps"][i]["committed_bytes"])
                        for r in ranks}) == 1  # fmt: skip


def test_the_bl_numbers_are_the_hand_computed_ones(run):
    # 16 blocks = 1,613,824 B: 25 chunks of 64 KiB; 24 blocks = 2,420,736 B: 37 chunks; the
    # capacity 6,455,296 B: 98 chunks and one cut to 32,768 B (99)
    row = run[0]["rows"][0]
    assert (row["floor_chunks"], row["grow_chunks"], row["release_chunks"]) == (25, 12, 12)
    assert (row["full_chunks"], row["zero_chunks"]) == (99 - 25, 99)
    assert row["floor_ratio"] == round(25 * CHUNK / (16 * BLOCK), 4) == 1.0152
    assert row["grow_ratio"] == round(37 * CHUNK / (24 * BLOCK), 4)
    assert row["full_ratio"] == 1.0 and "zero_ratio" not in row
    assert row["criterion"] is False  # 1.0152 > 1.01: a 64 KiB chunk is 4 % of 16 blocks
    # the hole: blocks [4, 12) of 16, bytes [403,456, 1,210,368): chunks 7..17 wholly inside
    assert be.hole(FLOOR, STEP) == ((0, 4), (12, 16))
    assert (row["hole_chunks"], row["recommit_chunks"]) == (11, 11)


def test_the_summary_is_the_slowest_rank_per_repetition_then_the_median(run):
    data, stdout = run
    for row in data["rows"]:
        for name in ("floor", "grow", "release", "hole", "recommit", "full", "zero"):
            idx = [i for i, s in enumerate(row["ranks"][0]["steps"]) if s["step"] == name]
            worst = [max(r["steps"][i]["ms"] for r in row["ranks"]) for i in idx]
            assert all(w > 0 for w in worst)
            assert row[f"{name}_ms"] == round(statistics.median(worst), 2)
            assert row.get(f"{name}_max_ms") == (round(max(worst), 2) if len(idx) > 1 else None)
    header = next(line for line in stdout.splitlines() if line.startswith("pcp"))
    for col in ("layout", "chunk_MiB", "floor_ms", "floor_ratio", "grow_ms", "grow_chunks",
                "release_ms", "full_ms", "zero_ms", "blocks_ok", "criterion"):  # fmt: skip
        assert col in header
    assert "criterion: floor_ratio <= 1.01 and grow_ms <= 30" in stdout
