"""The command line: demo, doctor, bench, and the engine example, as a newcomer runs them."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import resource
import subprocess
import sys

import pytest

from vmmkv.alloc import driver
from vmmkv.cli import HOST_TIMINGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str, timeout: float = 240, env=None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
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
    # no graph on the host backend: the demo says what it did instead of a replay
    assert (
        "eager stores into the new blocks verified on every replica (no graph: host backend)"
        in p.stdout
    )
    assert "replay" not in p.stdout and "graph capture" not in p.stdout, p.stdout
    # the step-time line quotes the slowest rank of the table below it, in the table's digits
    line = re.search(r"step time +direct ([0-9.]+) us, gather fallback ([0-9.]+) us", p.stdout)
    rows = re.findall(r"^ +(\d+|max) +([0-9.]+) +([0-9.]+)$", p.stdout, re.M)
    assert line and [r[0] for r in rows] == ["0", "1", "max"], p.stdout
    ranks = [(float(d), float(g)) for name, d, g in rows[:2]]
    assert rows[2][1:] == line.groups(), p.stdout
    assert float(line[1]) == max(d for d, _ in ranks) and float(line[2]) == max(g for _, g in ranks)
    assert not re.search(r"\d\.\d{6,}", p.stdout), p.stdout  # no raw floats
    assert "{" not in p.stdout, p.stdout  # no dicts


@pytest.mark.timeout(120)
@pytest.mark.skipif(driver.cuda_usable(), reason="checks the CPU-only report")
def test_doctor_on_a_cpu_only_machine_reports_host_backend_only_and_succeeds():
    p = _run("-m", "vmmkv", "doctor")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "host backend only" in p.stdout and "so_peercred" in p.stdout
    # no GPU sections, so no per-GPU fabric lines
    assert "gpu 0:" not in p.stdout and "fabric_state" not in p.stdout, p.stdout


# (environment, the one line each refused variable gives): the library's and the plugin's
DOCTOR_REFUSALS = {
    "direct": ({"VMMKV_DIRECT": "maybe"}, ["VMMKV_DIRECT must be 'auto', '0' or '1', got 'maybe'"]),
    "issue-49": (
        {"VMMKV_DIRECT": "maybe", "VMMKV_CHUNK_MIB": "abc"},
        ["VMMKV_DIRECT must be", "VMMKV_CHUNK_MIB must be a number of MiB > 0, got 'abc'"],
    ),
    "plugin": (
        {"VLLM_USE_VMMKV": "yes", "VLLM_VMMKV_ELASTIC": "2", "VMMKV_ELASTIC_CALM_S": "-1",
         "VMMKV_ELASTIC_ORDER": "fifo"},
        ["VLLM_USE_VMMKV must be '0' or '1', got 'yes'",
         "VLLM_VMMKV_ELASTIC must be '0' or '1', got '2'",
         "VMMKV_ELASTIC_CALM_S must be a number >= 0, got '-1'",
         "VMMKV_ELASTIC_ORDER must be 'lowest' or 'lifo', got 'fifo'"],
    ),
}  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(DOCTOR_REFUSALS))
def test_doctor_refuses_an_invalid_variable_as_demo_does(case):
    env, lines = DOCTOR_REFUSALS[case]
    p = _run("-m", "vmmkv", "doctor", env=env, timeout=100)
    assert (p.returncode, p.stdout) == (2, ""), p.stdout + p.stderr
    got = p.stderr.splitlines()
    assert len(got) == len(lines), p.stderr
    for line, want in zip(got, lines, strict=True):
        assert line.startswith(f"python -m vmmkv doctor: error: {want}"), p.stderr


@pytest.mark.timeout(120)
def test_doctor_reports_the_variables_of_vmmkv_that_are_set():
    env = {"VMMKV_DIRECT": "true", "VLLM_USE_VMMKV": "1", "VMMKV_ELASTIC_CALM_S": "3",
           "VLLM_KV_CACHE_LAYOUT": "BLNHC"}  # fmt: skip
    p = _run("-m", "vmmkv", "doctor", env=env, timeout=100)
    assert p.returncode in (0, 1), p.stdout + p.stderr
    section = p.stdout.split("environment (vmmkv's variables that are set):\n", 1)[1]
    lines = [line.split() for line in section.splitlines()[:3]]
    assert lines == [
        ["VLLM_USE_VMMKV", "1"],
        ["VMMKV_DIRECT", "true"],
        ["VMMKV_ELASTIC_CALM_S", "3"],
    ]
    assert "VLLM_KV_CACHE_LAYOUT" not in p.stdout  # vLLM's own variable, not vmmkv's


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
        png = (tmp_path / "bench.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        # the plot says what its timings are (its title, and the PNG's Description text)
        assert b"Description\0" + HOST_TIMINGS.encode() in png
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


# a wrong argument or environment variable, the one line it gives (after "<prog>: error: ")
BAD_INVOCATIONS = {
    "demo-blocks-0": (["demo", "--blocks", "0"], {}, "--blocks must be >= 2, got 0"),
    "demo-layers-negative": (["demo", "--layers", "-1"], {}, "--layers must be >= 1, got -1"),
    "demo-world-0": (["demo", "--world", "0"], {}, "--world must be >= 1, got 0"),
    "demo-blocks-too-few": (
        ["demo", "--blocks", "2", "--backend", "host"],
        {},
        "--blocks 2 is too few for 2 ranks: the first half of the blocks takes a step of 79 "
        "tokens (64 per block): use --blocks 4 or more",
    ),
    "demo-blocks-not-a-number": (
        ["demo", "--blocks", "x"],
        {},
        "argument --blocks: invalid int value: 'x'",
    ),
    "bench-iters-0": (["bench", "--iters", "0"], {}, "--iters must be >= 1, got 0"),
    "bench-warmup-negative": (["bench", "--warmup", "-1"], {}, "--warmup must be >= 0, got -1"),
    "direct": (
        ["demo"],
        {"VMMKV_DIRECT": "abc"},
        "VMMKV_DIRECT must be 'auto', '0' or '1', got 'abc' ('false' and 'true' also work)",
    ),
    "barrier-timeout": (
        ["bench", "--quick"],
        {"VMMKV_BARRIER_TIMEOUT": "abc"},
        "VMMKV_BARRIER_TIMEOUT must be a number of seconds > 0, got 'abc'",
    ),
    "barrier-timeout-negative": (
        ["demo"],
        {"VMMKV_BARRIER_TIMEOUT": "-5"},
        "VMMKV_BARRIER_TIMEOUT must be a number of seconds > 0, got '-5'",
    ),
    "chunk-mib": (
        ["demo"],
        {"VMMKV_CHUNK_MIB": "abc"},
        "VMMKV_CHUNK_MIB must be a number of MiB > 0, got 'abc'",
    ),
    "chunk-mib-granularity": (
        ["demo", "--backend", "host"],
        {"VMMKV_CHUNK_MIB": str(1 / 1024)},  # 1 KiB: not whole pages
        f"VMMKV_CHUNK_MIB='{1 / 1024}' is 1024 bytes: the host backend needs a multiple of "
        f"{os.sysconf('SC_PAGE_SIZE')} bytes",
    ),
    "check-padding": (
        ["demo"],
        {"VMMKV_CHECK_PADDING": "yes"},
        "VMMKV_CHECK_PADDING must be '0' or '1', got 'yes' ('false' and 'true' also work)",
    ),
    "fabric": (
        ["bench"],
        {"VMMKV_FABRIC": "2"},
        "VMMKV_FABRIC must be '0' or '1', got '2' ('false' and 'true' also work)",
    ),
    "barrier-trap": (
        ["demo"],
        {"VMMKV_BARRIER_TRAP": "on"},
        "VMMKV_BARRIER_TRAP must be '0' or '1', got 'on' ('false' and 'true' also work)",
    ),
    "launch-api": (
        ["demo"],
        {"VMMKV_LAUNCH_API": "cffi"},
        "VMMKV_LAUNCH_API must be 'bindings' or 'ctypes', got 'cffi'",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INVOCATIONS))
def test_a_wrong_argument_or_variable_exits_2_at_once_with_one_line_and_no_traceback(case):
    args, env, message = BAD_INVOCATIONS[case]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = _run("-m", "vmmkv", *args, env=env, timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.splitlines() == [f"python -m vmmkv {args[0]}: error: {message}"], p.stderr
    assert p.stdout == "", p.stdout  # no banner: no rank was spawned
    # CPU seconds, not wall time: a loaded machine slows the clock, not the work (no torch)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    assert cpu < 2.0, cpu


def test_every_error_of_one_call_gets_its_own_line():
    env = {"VMMKV_DIRECT": "x", "VMMKV_CHUNK_MIB": "0"}
    p = _run("-m", "vmmkv", "demo", "--blocks", "0", "--layers", "0", env=env, timeout=60)
    assert p.returncode == 2
    assert [line.split(": error: ")[1].split(" ")[0] for line in p.stderr.splitlines()] == [
        "--layers", "--blocks", "VMMKV_DIRECT", "VMMKV_CHUNK_MIB",
    ], p.stderr  # fmt: skip
    assert "Traceback" not in p.stderr


@pytest.mark.skipif(driver.cuda_usable(), reason="checks the machine without a GPU")
def test_demo_on_cuda_without_a_gpu_says_to_use_the_host_backend():
    p = _run("-m", "vmmkv", "demo", "--backend", "cuda", timeout=60)
    assert (p.returncode, p.stdout) == (2, ""), p.stdout + p.stderr
    assert p.stderr == "python -m vmmkv demo: error: no CUDA device: use --backend host\n"


def test_bench_refuses_an_output_directory_it_cannot_write_before_the_sweep(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    p = _run("-m", "vmmkv", "bench", "--quick", "--out", str(blocker / "out"), timeout=60)
    assert (p.returncode, p.stdout) == (2, ""), p.stdout + p.stderr
    assert p.stderr == (
        f"python -m vmmkv bench: error: --out {blocker / 'out'}: cannot write there "
        "(Not a directory)\n"
    )


def test_demo_refuses_a_json_path_that_is_a_directory(tmp_path):
    p = _run("-m", "vmmkv", "demo", "--json", str(tmp_path), timeout=60)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.endswith(f"--json {tmp_path}: cannot write there (it is a directory)\n")


def test_version_prints_the_installed_distributions_version():
    from importlib.metadata import version

    p = _run("-m", "vmmkv", "--version", timeout=60)
    assert p.returncode == 0 and p.stdout == f"vmmkv {version('vmmkv')}\n", p.stdout + p.stderr


def test_the_distribution_names_its_authors_and_classifiers():
    from importlib.metadata import metadata

    meta = metadata("vmmkv")
    assert meta["Author"], dict(meta)
    assert "Operating System :: POSIX :: Linux" in meta.get_all("Classifier"), dict(meta)


def test_version_takes_no_arguments():
    p = _run("-m", "vmmkv", "--version", "extra", timeout=60)
    assert (p.returncode, p.stdout) == (2, ""), p.stdout + p.stderr
    assert p.stderr == "python -m vmmkv: error: --version takes no arguments, got 'extra'\n"


def test_the_demos_block_size_is_the_test_layouts():
    from vmmkv.cli.demo import BLOCK_TOKENS
    from vmmkv.testing.kv import BLOCK_SIZE

    assert BLOCK_TOKENS == BLOCK_SIZE


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
