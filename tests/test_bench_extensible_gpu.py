"""benchmarks/bench_extensible_gpu.py without a GPU: vLLM's padded geometry and estimate, and one
host-backend run of 2 ranks at a tiny size whose JSON is checked against numbers computed here:
every rank at every step's block count, the chunks covering each segment's committed blocks,
every peer mapping exactly its owner's chunks, the stamps read back after the extend and every
wake, and the machine, date, commit and command recorded."""

from __future__ import annotations

import json
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


def _steps(data, layout):
    """(the layout's segments, its rows, [(row, step, blocks committed after it)])."""
    rows = [r for r in data["rows"] if r["layout"] == layout]
    assert [r["step"] for r in rows] == [name for name, _ in STEPS], rows
    segs, _ = bx.padded_geometry(layout, LAYERS, CAPACITY)
    minimum = 2 if layout == "BL" else 1
    steps = [(row, name, minimum if blocks is None else blocks)
             for row, (name, blocks) in zip(rows, STEPS, strict=True)]  # fmt: skip
    return segs, rows, steps


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["LB", "BL"])
def test_every_step_commits_the_blocks_vllm_asks_in_the_chunks_covering_them(run, layout):
    data, printed = run
    assert data["benchmark"] == "bench_extensible_gpu" and data["device"] == "host"
    assert data["command"][1] == SCRIPT and "machine" in data and "commit" in data
    segs, rows, steps = _steps(data, layout)
    for row, name, blocks in steps:
        chunks = sum(-(-blocks * stride // CHUNK) for _, stride in segs)  # segments chunk-aligned
        assert (row["blocks"], row["chunks"]) == (blocks, chunks), (name, row)
        assert row["same_blocks"] and row["peers_mapped"] and "error" not in row, row
        assert row["peak_fds"] > 0, row
        if name in ("extend", "wake", "rewake"):
            assert row["read_ok"] is True, row
    assert rows[0]["path"] == "direct" and rows[0]["chunk_MiB"] == CHUNK / MiB
    assert "rewake" in printed


@pytest.fixture(scope="module")
def run_in_runs(tmp_path_factory):
    """The same run in the plugin's own geometry (no ``--chunk-mib``): page chunks, runs."""
    from tests.helpers import run_tool_main

    out = tmp_path_factory.mktemp("extensible-runs") / "extensible.json"
    argv = [SCRIPT, "--backend", "host", "--ranks", "2", "--layers", str(LAYERS), "--capacity",
            str(CAPACITY), "--budget", str(BUDGET), "--warmup", str(WARMUP), "--timeout", "60",
            "--out", str(out)]  # fmt: skip
    return run_tool_main(bx.main, argv, out)[0]


# own runs per segment after each step, and runs created per segment by it (vLLM's order: a
# shrink-remap releases everything and commits the minimum again; a wake recommits whole)
RUNS = {"allocate": (1, 1), "warmup": (2, 1), "remap 1": (1, 1), "sizing warmup": (2, 1),
        "remap 2": (1, 1), "capture": (1, 0), "extend": (2, 1), "sleep": (0, 0),
        "wake": (1, 1), "discard": (0, 0), "rewake": (1, 1)}  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["LB", "BL"])
def test_in_runs_every_commit_exports_one_handle_per_segment_and_vllms_estimate_is_exact(
    run_in_runs, layout
):
    page = os.sysconf("SC_PAGE_SIZE")
    segs, rows, steps = _steps(run_in_runs, layout)
    for row, name, blocks in steps:
        held, created = RUNS[name]
        assert (row["blocks"], row["chunks"], row["handles"]) == (
            blocks, held * len(segs), created * len(segs)), (name, row)  # fmt: skip
        # page chunks: what vLLM estimates from the buffer's granularity is what is mapped
        mapped = sum(-(-blocks * stride // page) * page for _, stride in segs)
        assert row["physical_MiB"] == row["estimate_MiB"] == round(mapped / MiB, 1), (name, row)
        assert row["same_blocks"] and row["peers_mapped"] and "error" not in row, row
        if name in ("extend", "wake", "rewake"):
            assert row["read_ok"] is True, row
    assert rows[0]["chunk_MiB"] == page / MiB and rows[0]["run_MiB"] > 1, rows[0]


@pytest.mark.timeout(400)
def test_the_comparison_runs_this_tree_and_a_baseline_tree_each_on_its_own_code(tmp_path):
    """``extensible_compare.py --backend host --small`` with a copy of this tree as the baseline
    (the device call unpacks an earlier commit there): each bench runs with its own tree on the
    path, the baseline's under its commit's name, and the summary reads both."""
    import shutil
    import subprocess

    base = tmp_path / "baseline-main"
    shutil.copytree(os.path.join(ROOT, "vmmkv"), base / "vmmkv")
    shutil.copytree(os.path.join(ROOT, "benchmarks"), base / "benchmarks",
                    ignore=shutil.ignore_patterns("results"))  # fmt: skip
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "extensible_compare.py"), "--backend",
           "host", "--small", "--ranks", "2", "--no-elastic", "--baseline", str(base),
           "--baseline-commit", "base123", "--out", str(out)]  # fmt: skip
    printed = subprocess.run(cmd, capture_output=True, text=True, timeout=380, check=True).stdout
    record = json.loads((out / "extensible-compare.json").read_text())
    assert record["baseline"] == "base123" and set(record["runs"]) == {"runs-pcp2", "main-pcp2"}
    assert all(r["rc"] == 0 for r in record["runs"].values()), record["runs"]
    assert json.loads((out / "main-pcp2.json").read_text())["commit"] == "base123"
    assert f"PYTHONPATH={base}" in (out / "main-pcp2.log").read_text()
    for row in record["rows"]:
        assert row["read_ok"] and row["extend_ms"] > 0 and row["main_extend_ms"] > 0, row
        assert row["allocs"] >= 1 and row["floor_wake_ms"] is None, row  # no floor on the host
    assert "extend/main_BL" in printed and "runs-pcp2: rc=0" in printed.splitlines()[-1], printed


def _floor_pass(rank, world, count):
    """The floor's fd passing alone (no CUDA): ``count`` memfds of ``rank + 1`` pages each to
    every peer, in messages of 250; what each peer's fds hold, and the fds left open after."""
    import socket
    import threading

    import floor_extensible_gpu as fl
    import torch.distributed as dist

    nonce = "t" + str(os.getppid())
    before = len(os.listdir("/proc/self/fd"))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(fl._socket_name(nonce, rank))
    listener.listen(world)
    fds = []
    for _ in range(count):
        fd = os.memfd_create("floor-test")
        os.ftruncate(fd, (rank + 1) * 4096)
        fds.append(fd)
    dist.barrier()
    got = {}
    receiver = threading.Thread(target=fl._receive_all, args=(listener, world - 1, got))
    receiver.start()
    for p in range(world):
        if p != rank:
            fl._send_all(fl._socket_name(nonce, p), rank, fds)
    receiver.join()
    sizes = {p: (len(v), sorted({os.fstat(fd).st_size for fd in v})) for p, v in got.items()}
    for fd in fds + [fd for v in got.values() for fd in v]:
        os.close(fd)
    listener.close()
    return sizes, len(os.listdir("/proc/self/fd")) - before


@pytest.mark.timeout(120)
def test_the_floor_passes_every_fd_to_every_peer_in_messages_of_250():
    from vmmkv.testing.spawn import run_world

    out = run_world(_floor_pass, 3, args=(300,), timeout=100)
    for rank, (sizes, leaked) in enumerate(out):
        want = {p: (300, [(p + 1) * 4096]) for p in range(3) if p != rank}
        assert sizes == want and leaked == 0, (rank, sizes, leaked)
