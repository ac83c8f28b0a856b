"""benchmarks/bench_gather.py without a GPU: its summary logic on made-up numbers, and its whole
sweep on the host backend (gloo, no graphs), which runs every step it times on the GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_gather  # noqa: E402


def _rank_row(t, scale, graph=True, **extra):
    cases = {c: scale * (i + 1) for i, c in enumerate(bench_gather.CASES_EAGER)}
    return {
        "T": t,
        "world": 2,
        "eager": dict(cases),
        "graph": dict(cases) if graph else {},
        **extra,
    }


def test_summary_takes_the_slowest_rank_and_computes_the_ratios():
    rank0 = [_rank_row(1, 1.0, equal=True), _rank_row(8, 1.0, graph=False, equal=True)]
    rank1 = [_rank_row(1, 2.0, equal=True), _rank_row(8, 0.5, graph=False, equal=False)]
    rows = bench_gather.summarize([rank0, rank1])
    assert [r["T"] for r in rows] == [1, 8]
    e = rows[0]["eager"]
    names = bench_gather.CASES_EAGER
    assert e["fallback_own"] == 2.0 and e["ideal_own"] == 2.0 * (names.index("ideal_own") + 1)
    assert e["fallback/ideal_own"] == pytest.approx(e["fallback_own"] / e["ideal_own"])
    assert e["ideal_own_sum"] == e["nccl_own"] + e["insert"]
    assert e["direct/fallback"] == pytest.approx(e["direct_publish"] / e["fallback_gathered"])
    assert rows[0]["equal"] is True and rows[1]["equal"] is False
    assert "graph" in rows[0] and "graph" not in rows[1]  # nothing measured: no graph entry


def test_summary_keeps_missing_cases_as_none_and_names_the_failed_rank():
    a = _rank_row(4, 1.0, equal=None)
    b = _rank_row(4, 1.0, equal=True, error="RuntimeError: boom")
    for row in (a, b):
        del row["eager"]["direct_publish"]  # no direct publication in this group
    (row,) = bench_gather.summarize([[a], [b]])
    assert row["eager"]["direct_publish"] is None and row["eager"]["direct/fallback"] is None
    assert row["equal"] is None and row["error"] == "rank 1: RuntimeError: boom"
    flat = bench_gather.table_rows([row])
    assert flat[0]["direct"] == "-" and flat[0]["T"] == 4 and len(flat) == 2
    with pytest.raises(ValueError, match="ranks disagree on T"):
        bench_gather.summarize([[_rank_row(1, 1.0)], [_rank_row(2, 1.0)]])


@pytest.mark.timeout(300)
def test_the_sweep_runs_on_the_host_backend_and_writes_its_json(tmp_path):
    out = tmp_path / "bench_gather.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_gather.py"), "--backend",
           "host", "--tokens", "1", "5", "--iters", "1", "--reps", "1", "--world", "3",
           "--profile", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["benchmark"] == "bench_gather" and [r["T"] for r in data["rows"]] == [1, 5]
    for row in data["rows"]:
        assert row["equal"] is True and "error" not in row  # fallback bytes == direct bytes
        assert row["row_bytes_own"] == 1424 and row["row_bytes_gathered"] == 1408
        assert all(row["eager"][c] > 0 for c in bench_gather.CASES_EAGER)
        # --profile: rank 0's host time of one fallback step, led by the store call itself
        names = [p["function"] for p in row["profile"]]
        assert any("cache.py" in n and "store_layer" in n for n in names), names
        assert all(p["cum_us"] > 0 and p["calls"] > 0 for p in row["profile"])
    assert "fallback" in proc.stdout and "direct/fb" in proc.stdout
    assert "host time of one eager fallback_gathered step" in proc.stdout
    partial = [json.loads(x) for x in open(str(out) + ".partial.jsonl")]
    assert [r["T"] for r in partial] == [1, 5]


def _work(n):
    return sum(_leaf(i) for i in range(n))


def _leaf(i):
    return i * i


def test_top_functions_are_per_step_and_sorted_by_cumulative_time():
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(4):
        _work(100)
    prof.disable()
    rows = bench_gather.top_functions(pstats.Stats(prof), steps=4, top=50)
    cums = [r["cum_us"] for r in rows]
    assert cums == sorted(cums, reverse=True)
    by_name = {r["function"].rsplit("(", 1)[1][:-1]: r for r in rows if r["function"].endswith(")")}
    assert by_name["_work"]["calls"] == 1 and by_name["_leaf"]["calls"] == 100  # per step
    assert by_name["_work"]["function"].startswith("tests/test_gather_bench.py:")
    assert by_name["_work"]["cum_us"] >= by_name["_leaf"]["cum_us"] > 0
    assert len(bench_gather.top_functions(pstats.Stats(prof), steps=4, top=2)) == 2


def test_the_cuda_sweep_says_what_it_needs_without_enough_gpus(capsys):
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 64:
        pytest.skip("this machine has the GPUs")
    assert bench_gather.main(["--world", "64", "--out", "/dev/null"]) == 2
    assert "needs 64 GPUs" in capsys.readouterr().err


def test_the_host_cost_stages_run_on_the_cpu_and_write_their_json(tmp_path, capsys):
    out = tmp_path / "host_cost.json"
    argv = ["--host-cost", "--backend", "host", "--tokens", "1", "3", "--out", str(out)]
    assert bench_gather.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    stages = {r["stage"] for r in rows}
    assert stages == {
        "checks (own_slots + check_inputs)",
        "pack + views + slots (_gather)",
        "total: GatherPath.store",
        "reference: torch.cat of the 3 inputs' bytes",
    }  # fmt: skip  (the insert stage is CUDA's only: on the CPU the insert is a no-op)
    assert sorted({r["T"] for r in rows}) == [1, 3] and len(rows) == 2 * len(stages)
    assert all(r["own"] > 0 and r["gathered"] > 0 for r in rows)
    assert "all-gather a no-op (host)" in capsys.readouterr().out


def test_the_cuda_host_cost_says_what_it_needs_without_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert bench_gather.main(["--host-cost", "--out", "/dev/null"]) == 2
    assert "--host-cost: needs a GPU" in capsys.readouterr().err
