"""benchmarks/bench_prefill.py without a GPU: its arguments, workload plan, FLOP count and
summary on made-up numbers, and two host-backend runs of 2 ranks (gloo, tiny shapes): one that
passes verification and writes every path's numbers, one whose dropped KV update verification
must catch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_prefill as bp  # noqa: E402
from prefill import model, report  # noqa: E402
from prefill.paths import mla_kind  # noqa: E402

SCRIPT = os.path.join(ROOT, "benchmarks", "bench_prefill.py")


def _run(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, SCRIPT, "--cpu", "--layers", "2", "--out", str(tmp_path), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=170, cwd=ROOT)


def test_defaults_are_the_gpu_matrix_and_cpu_drops_symm_mem_and_graphs_with_a_reason():
    gpu = bp.parse_args([])
    assert gpu.tokens == [256, 1024, 4096, 16384] and gpu.batch == (16, 1024)
    assert gpu.paths == bp.PATHS and gpu.modes == ("eager", "graph")
    assert (gpu.layers, gpu.iters, gpu.warmup, gpu.world) == (61, 20, 1, 2)
    assert gpu.timeout == gpu.budget_s + 240 and gpu.notes == {}
    cpu = bp.parse_args(["--cpu"])
    assert cpu.paths == ("direct", "vllm_gather", "vmmkv_gather") and cpu.modes == ("eager",)
    assert "CUDA" in cpu.notes["symm_mem"] and "CUDA" in cpu.notes["graph"]
    assert bp.parse_args(["--batch", "none"]).batch is None
    assert [s.name for s in bp.parse_args(["--tokens", "none"]).specs] == ["16x1024"]
    picked = bp.parse_args(["--paths", "symm_mem,direct", "--modes", "graph", "--budget-s", "0"])
    assert picked.paths == ("direct", "symm_mem") and picked.modes == ("graph",)
    assert picked.timeout == 3600


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tokens", "0"], "argument --tokens: each value must be an even number >= 2"),
        (["--tokens", "255"], "got 255"),
        (["--tokens", "256,abc"], "takes comma-separated integers (tokens per rank), got 'abc'"),
        (["--tokens", "256,256"], "lists a value twice"),
        (["--layers", "62"], "argument --layers: must be in [1, 61], got 62"),
        (["--iters", "0"], "argument --iters: must be >= 1, got 0"),
        (["--warmup", "0"], "argument --warmup: must be >= 1, got 0"),
        (["--world", "1"], "argument --world: must be >= 2, got 1"),
        (["--modes", "eager,fast"], "argument --modes: unknown ['fast']; choose from eager, graph"),
        (["--paths", "nccl"], "argument --paths: unknown ['nccl']; choose from direct,"),
        (["--batch", "16by1024"], "takes PROMPTSxLENGTH (e.g. 16x1024) or none, got '16by1024'"),
        (["--batch", "16x1022"], "a multiple of 2 x --world = 4"),
        (["--budget-s", "-1"], "argument --budget-s: must be a finite number >= 0"),
        (["--timeout", "0"], "--timeout must be > 0"),
        (["--cpu", "--paths", "symm_mem"], "--cpu leaves nothing to run"),
        (["--tokens", "none", "--batch", "none"], "nothing to run"),
        (["--paths", "direct", "--drop-update", "symm_mem"], "not among --paths"),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag_and_the_value(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bp.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_each_prompt_is_split_across_ranks_and_steps_run_cheapest_first():
    specs = bp.workloads([256, 16384], (16, 1024), 2)
    assert [(s.name, s.sequences, s.per_rank, s.tokens, s.seq_len) for s in specs] == [
        ("256/rank", 1, 256, 256, 512),
        ("16384/rank", 1, 16384, 16384, 32768),
        ("16x1024", 16, 512, 8192, 1024),
    ]
    assert specs[2].blocks == 16 * 1024 // 64 and specs[1].blocks == 512
    order = [(s.name, m) for s, m in bp.steps(specs, ("eager", "graph"), 1024)]
    assert order == [("256/rank", "eager"), ("256/rank", "graph"), ("16x1024", "eager"),
                     ("16384/rank", "eager")]  # fmt: skip


def test_dual_chunk_swap_gives_every_position_to_exactly_one_rank():
    import torch

    for world, per_rank in ((2, 8), (4, 6)):
        got = torch.cat([model._rank_positions(r, world, per_rank) for r in range(world)])
        assert sorted(got.tolist()) == list(range(world * per_rank))
    assert model._rank_positions(0, 2, 8).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]


@pytest.mark.parametrize("kind", ["indexer_k", "indexer_k_mxfp8"])
def test_the_attention_reads_back_what_the_reference_wrote_in_position_order(kind):
    import torch

    from vmmkv.ops import reference as ref
    from vmmkv.testing.kv import interleaved_views, layer_inputs

    spec = model.WorkloadSpec("2x128", 2, 64, 2)  # 2 prompts of 128 tokens: 4 blocks
    wl = model._Workload(spec, 0, bp.TINY, 1, torch.device("cpu"), seed=3)
    buf = torch.full((spec.blocks * 64 * (656 + 132),), 0xA5, dtype=torch.uint8)
    ((mla, idx),) = interleaved_views(buf, 1, spec.blocks)
    kv_c, k_pe, k = layer_inputs(7, 2 * spec.tokens)
    ref.insert_ds_mla(mla, kv_c, k_pe, wl.gslots)  # every rank's rows, rank-major
    insert = ref.insert_indexer_k_mxfp8 if kind == "indexer_k_mxfp8" else ref.insert_indexer_k
    insert(idx, k, wl.gslots)
    kv, kidx = model._read_cache(model._read_views([(mla, idx)], kind)[0], wl)
    # token at position p of prompt j: find its row in the gathered (rank-major) order
    slot_of = {int(s): i for i, s in enumerate(wl.gslots)}
    for j, p in ((0, 0), (0, 127), (1, 5), (1, 64), (1, 100)):
        row = slot_of[int(wl.read_blk[j, p]) * 64 + int(wl.read_off[j, p])]
        want = torch.cat((kv_c[row].float(), k_pe[row].float()))
        assert torch.equal(kv[j, p, 512:], k_pe[row])  # rope: bf16, verbatim
        assert torch.allclose(kv[j, p].float(), want, rtol=0.13, atol=1e-2)  # fp8 precision
        assert torch.allclose(kidx[j, p].float(), k[row].float(), rtol=0.13, atol=1e-2)
    assert sorted(slot_of) == sorted(
        (wl.read_blk * 64 + wl.read_off).flatten().tolist()
    )  # the attention reads exactly the tokens the group wrote


def test_flops_are_the_documented_deepseek_v32_figures():
    s = bp.DEEPSEEK_V32
    assert s.ffn_inter == 18432  # 8 routed + 1 shared expert of 2048 = the dense layers' width
    assert s.weights()["qkv_a"] == (7168, 1536 + 512 + 64)
    assert s.linear_flops() == 1_194_852_352  # 1.195 GFLOP per token and layer
    assert s.attention_flops(512) == 2 * 512 * (576 + 128 + 512)
    one = model.WorkloadSpec("x", 1, 256, 2)
    assert one.flops(s, 61) == 61 * 256 * (s.linear_flops() + s.attention_flops(512))


def _step(name, mode, fwd, kv, skipped=None):
    st = {"workload": name, "tokens_per_rank": 8, "sequences": 1, "seq_len": 16, "mode": mode,
          "flop_per_forward": 1e9}  # fmt: skip
    if skipped:
        return {**st, "skipped": skipped}
    paths = {p: {"forward_ms": list(f), "kv_ms": list(k)} for p, f, k in zip(fwd, fwd.values(),
             kv.values(), strict=True)}  # fmt: skip
    return {**st, "verify": {"passed": True, "forward_s": {p: 1.0 for p in fwd}}, "paths": paths}


def test_merge_takes_each_iterations_slowest_rank_and_summary_compares_with_the_baseline():
    r0 = _step("8/rank", "eager", {"vllm_gather": [10, 12, 11], "direct": [9, 8, 10]},
               {"vllm_gather": [2, 2, 2], "direct": [1, 1, 1]})  # fmt: skip
    r1 = _step("8/rank", "eager", {"vllm_gather": [11, 10, 13], "direct": [7, 9, 9]},
               {"vllm_gather": [3, 1, 2], "direct": [1, 2, 1]})  # fmt: skip
    merged = report.merge_ranks([r0, r1])
    assert merged["paths"]["vllm_gather"]["forward_ms"] == [11, 12, 13]
    assert merged["paths"]["direct"]["forward_ms"] == [9, 9, 10]
    assert merged["paths"]["vllm_gather"]["kv_ms"] == [3, 2, 2]
    skipped = report.merge_ranks([_step("big", "eager", {}, {}, "budget")] * 2)
    rows = bp.summarize([merged, skipped])
    assert [(r["path"], r["workload"]) for r in rows] == [("direct", "8/rank"),
                                                          ("vllm_gather", "8/rank")]  # fmt: skip
    direct, base = rows
    assert (direct["forward_p50_ms"], direct["forward_p99_ms"], base["forward_p50_ms"]) == (
        9,
        10,
        12,
    )
    assert direct["vs_baseline_pct"] == pytest.approx(-25.0) and base["vs_baseline_pct"] == 0.0
    assert direct["kv_share_pct"] == pytest.approx(100 / 9) and base["kv_p50_ms"] == 2
    assert direct["tflops"] == pytest.approx(1e9 / 9e-3 / 1e12)
    table = bp.markdown({"steps": [merged, skipped]}, rows)
    assert "| 8/rank | 8 | eager | direct | 9 | 10 | 1 | 11.11% | -25.00% |" in table
    assert "| baseline |" in table
    assert "- skipped: big eager: budget (alone: --tokens 8 --batch none --modes eager)" in table


@pytest.mark.timeout(180)
def test_host_backend_run_verifies_every_path_and_writes_positive_numbers(tmp_path):
    proc = _run(tmp_path, "--tokens", "64", "--iters", "2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    data = json.loads((tmp_path / "bench_prefill.json").read_text())
    paths = ["direct", "vllm_gather", "vmmkv_gather"]
    assert data["paths"] == ["vllm_gather", "direct", "vmmkv_gather"]  # the baseline first
    assert data["kv_kinds"][0] == mla_kind("indexer_k") and data["kv_kinds"][1] == "indexer_k"
    assert [(s["workload"], s["mode"]) for s in data["steps"]] == [("64/rank", "eager"),
                                                                  ("4x48", "eager")]  # fmt: skip
    for step in data["steps"]:
        assert "skipped" not in step and step["verify"]["passed"] is True
        assert step["verify"]["reference"] == "vllm_gather" and step["verify"]["bytes_compared"] > 0
        assert sorted(step["paths"]) == paths
        for got in step["paths"].values():
            assert len(got["forward_ms"]) == 2 and len(got["kv_ms"]) == 2
            assert all(v > 0 for v in got["forward_ms"] + got["kv_ms"])
    rows = data["rows"]
    assert sorted((r["workload"], r["path"]) for r in rows) == sorted(
        (w, p) for w in ("64/rank", "4x48") for p in paths
    )
    for r in rows:
        assert r["forward_p50_ms"] > 0 and r["kv_p50_ms"] > 0 and r["kv_share_pct"] > 0
        assert (r["vs_baseline_pct"] == 0.0) == (r["path"] == "vllm_gather")
    for key in ("vmmkv direct", "vmmkv direct=False", "vllm plain"):
        assert data["setup"][key]["first_s"] > 0 and data["setup"][key]["second_s"] > 0
    grow = data["growth"]["paths"]["vmmkv grow (direct)"]
    assert grow["total_s"] > 0 and grow["check"].startswith("moved blocks byte-exact")
    assert data["growth"]["to_bytes"] > 2 * data["growth"]["from_bytes"]
    assert "CUDA" in data["growth"]["paths"]["torch symm_mem regrow"]
    assert "symm_mem skipped with --cpu" in out and "graph skipped with --cpu" in out
    assert "| 64/rank | 64 | eager | direct |" in out and "| baseline |" in out
    assert (tmp_path / "bench_prefill.png").exists() or "matplotlib is not installed" in out
    partial = [json.loads(x) for x in (tmp_path / "bench_prefill.partial.jsonl").open()]
    assert [p["workload"] for p in partial] == ["64/rank", "4x48"]


@pytest.mark.timeout(180)
def test_a_dropped_kv_update_fails_verification_and_aborts_before_any_timing(tmp_path):
    proc = _run(tmp_path, "--tokens", "16", "--batch", "none", "--iters", "1",
                "--drop-update", "direct")  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "aborted: " in out and "verification failed (16/rank eager)" in out
    assert "direct's replica differs from vllm_gather's" in out
    assert "direct's attention checksums differ from vllm_gather's in layers [0, 1]" in out
    assert "still hold the poison" in out and "| baseline |" not in out
    data = json.loads((tmp_path / "bench_prefill.json").read_text())
    assert data["rows"] == [] and data["steps"] == [] and sorted(data["errors"]) == ["0", "1"]


def test_the_gpu_run_says_what_it_needs_without_enough_gpus(capsys):
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has 2 GPUs")
    assert bp.main(["--out", "/nonexistent/never-written"]) == 2
    assert "needs 2 GPUs" in capsys.readouterr().err
