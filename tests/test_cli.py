"""The command line: demo, doctor, bench, and the engine example, as a newcomer runs them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from vmmkv.alloc import driver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.timeout(300)
def test_demo_runs_to_success_on_the_host_backend_with_two_processes():
    p = _run("-m", "vmmkv", "demo", "--backend", "host", "--world", "2", "--blocks", "8")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "PASS: every replica byte-identical to the oracle" in p.stdout
    assert "backend            host" in p.stdout and "direct publication" in p.stdout
    assert "host backend: timings are functional checks, not performance" in p.stdout


@pytest.mark.timeout(120)
@pytest.mark.skipif(driver.cuda_usable(), reason="checks the CPU-only report")
def test_doctor_on_a_cpu_only_machine_reports_host_backend_only_and_succeeds():
    p = _run("-m", "vmmkv", "doctor")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "host backend only" in p.stdout and "so_peercred" in p.stdout
    # no GPU sections, so no per-GPU fabric lines
    assert "gpu 0:" not in p.stdout and "fabric_state" not in p.stdout, p.stdout


def test_doctor_fabric_lines_show_the_cluster_and_clique_or_the_reason():
    from vmmkv.alloc.fabric import FabricInfo
    from vmmkv.cli.doctor import _fabric_lines

    cluster = "3f1c2b4a-5d6e-4f70-8192-a3b4c5d6e7f8"
    assert _fabric_lines(FabricInfo(0, "completed", cluster, 7, "", "")) == {
        "fabric_state": "completed",
        "fabric_cluster_uuid": cluster,
        "fabric_clique_id": 7,
    }
    why = "device 1 (GPU-x): NVML reports no NVLink fabric for this GPU (state not_supported)"
    assert _fabric_lines(FabricInfo(1, "not_supported", None, None, "", why)) == {
        "fabric_state": "not_supported",
        "fabric_cluster_uuid": "-",
        "fabric_clique_id": "-",
        "fabric_reason": why,
    }


@pytest.mark.timeout(300)
def test_bench_quick_on_the_host_backend_writes_json_and_a_png_with_matplotlib(tmp_path):
    p = _run("-m", "vmmkv", "bench", "--quick", "--backend", "host", "--out", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["timings"] == "functional"
    assert p.stdout.count("host backend: timings are functional checks, not performance") == 2
    assert f"wrote {tmp_path / 'bench.json'}" in p.stdout, p.stdout  # the path, absolute
    assert [r["tokens_per_rank"] for r in data["rows"]] == [1, 32, 512, 2048]
    for r in data["rows"]:
        assert 0 < r["direct_p50_us"] <= r["direct_p99_us"], r
        assert 0 < r["gather_p50_us"] <= r["gather_p99_us"], r
        assert r["publish_GBps"] > 0
    assert data["peer_copy_GBps"] > 0 and data["publish/peer_copy at the largest T"] > 0
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:  # no plot, and one log line that says so
        assert not (tmp_path / "bench.png").exists()
        assert p.stderr.count("matplotlib is not installed") == 1, p.stderr


@pytest.mark.parametrize("cmd", ["demo", "bench", "doctor"])
def test_help_of_every_subcommand_is_plain_text_and_exits_0_without_running_it(cmd):
    p = _run("-m", "vmmkv", cmd, "--help", timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith(f"usage: python -m vmmkv {cmd}"), p.stdout
    assert "``" not in p.stdout and ":func:" not in p.stdout, p.stdout
    banners = [line for line in p.stdout.splitlines() if line.startswith(f"vmmkv {cmd}:")]
    assert not banners, banners  # the tool did not run


def test_every_option_of_every_subcommand_has_a_help_string():
    import argparse
    import importlib

    from vmmkv.cli import COMMANDS

    for cmd, (module, _) in COMMANDS.items():
        parser = importlib.import_module(module).parser()
        assert isinstance(parser, argparse.ArgumentParser) and parser.prog.endswith(cmd)
        for action in parser._actions:
            assert action.help, (cmd, action.option_strings)


def test_bench_help_names_where_bench_json_is_written():
    from vmmkv.cli.bench import parser

    text = parser().format_help()
    assert "./vmmkv-bench/bench.json" in text, text


def test_unknown_commands_fail_with_usage():
    p = _run("-m", "vmmkv", "frobnicate")
    assert p.returncode == 2 and "usage" in p.stderr


@pytest.mark.timeout(300)
def test_engine_allocator_example_runs():
    p = _run("examples/engine_allocator.py")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "engine example: OK" in p.stdout


@pytest.mark.gpu
@pytest.mark.timeout(400)
def test_demo_runs_to_success_on_the_gpu():
    p = _run("-m", "vmmkv", "demo", timeout=380)
    print(p.stdout)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "PASS: every replica byte-identical to the oracle" in p.stdout
    assert "backend            cuda" in p.stdout and "grown after CUDA-graph capture" in p.stdout


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_doctor_on_the_gpu_reports_vmm_and_a_verdict():
    p = _run("-m", "vmmkv", "doctor")
    print(p.stdout)
    assert "vmm" in p.stdout and "verdict:" in p.stdout and "fabric" in p.stdout
    n = driver.device_count()
    for key in ("fabric_state", "fabric_cluster_uuid", "fabric_clique_id"):
        assert p.stdout.count(f"  {key} ") == n, (key, p.stdout)
    assert p.returncode == (0 if "can work here" in p.stdout else 1)
