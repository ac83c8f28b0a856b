"""benchmarks/bench_extensible_gpu.py without a GPU: vLLM's padded geometry and estimate, and one
host-backend run of 2 ranks at a tiny size whose JSON is checked against numbers computed here:
every rank at every step's block count, the chunks covering each segment's committed blocks,
every peer mapping exactly its owner's chunks, the stamps read back after the extend and every
wake, and the machine, date, commit and command recorded."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_extensible_gpu as bx  # noqa: E402

SCRIPT = os.path.join(ROOT, "benchmarks", "bench_extensible_gpu.py")
KiB, MiB, MLA, IDX = 1024, 1 << 20, 41984, 8448
LAYERS, CAPACITY, BUDGET, WARMUP, CHUNK = 2, 64, 40, 8, 64 * KiB
STEPS = [("allocate", None), ("warmup", WARMUP), ("remap 1", None), ("sizing warmup", WARMUP),
         ("remap 2", None), ("capture", None), ("extend", BUDGET), ("sleep", 0),
         ("wake", BUDGET), ("discard", 0), ("rewake", BUDGET)]  # fmt: skip


def test_lb_regions_start_on_the_granule_and_bl_is_one_packed_segment():
    segs, size = bx.padded_geometry("LB", 61, 9000)
    assert len(segs) == 122 and all(off % (2 * MiB) == 0 for off, _ in segs)
    assert [s for _, s in segs] == [IDX] * 61 + [MLA] * 61
    assert segs[1][0] == -(-9000 * IDX // (2 * MiB)) * 2 * MiB
    assert size == segs[-1][0] + -(-9000 * MLA // (2 * MiB)) * 2 * MiB
    assert bx.padded_geometry("BL", 61, 9000) == ([(0, 61 * (MLA + IDX))], 9000 * 61 * (MLA + IDX))
    assert (
        bx.estimate([(0, 3 * MiB)], 1, 2 * MiB) == 4 * MiB
        and bx.estimate([(0, 10)], 0, 2 * MiB) == 0
    )
    assert bx.estimate([(0, 3 * MiB), (9 * MiB, MiB)], 2, 64 * MiB) == 128 * MiB
    with pytest.raises(ValueError, match="layout must be one of"):
        bx.padded_geometry("LBNHC", 61, 10)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from tests.helpers import run_tool_main

    out = tmp_path_factory.mktemp("extensible") / "extensible.json"
    argv = [SCRIPT, "--backend", "host", "--ranks", "2", "--layers", str(LAYERS), "--capacity",
            str(CAPACITY), "--budget", str(BUDGET), "--warmup", str(WARMUP), "--chunk-mib",
            str(CHUNK / MiB), "--timeout", "60", "--out", str(out)]  # fmt: skip
    return run_tool_main(bx.main, argv, out)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["LB", "BL"])
def test_every_step_commits_the_blocks_vllm_asks_in_the_chunks_covering_them(run, layout):
    data, printed = run
    assert data["benchmark"] == "bench_extensible_gpu" and data["device"] == "host"
    assert data["command"][1] == SCRIPT and "machine" in data and "commit" in data
    rows = [r for r in data["rows"] if r["layout"] == layout]
    assert [r["step"] for r in rows] == [name for name, _ in STEPS], rows
    segs, _ = bx.padded_geometry(layout, LAYERS, CAPACITY)
    minimum = 2 if layout == "BL" else 1
    for row, (name, blocks) in zip(rows, STEPS, strict=True):
        blocks = minimum if blocks is None else blocks
        chunks = sum(-(-blocks * stride // CHUNK) for _, stride in segs)  # segments chunk-aligned
        assert (row["blocks"], row["chunks"]) == (blocks, chunks), (name, row)
        assert row["same_blocks"] and row["peers_mapped"] and "error" not in row, row
        assert row["peak_fds"] > 0, row
        if name in ("extend", "wake", "rewake"):
            assert row["read_ok"] is True, row
    assert rows[0]["path"] == "direct" and rows[0]["chunk_MiB"] == CHUNK / MiB
    assert "rewake" in printed
