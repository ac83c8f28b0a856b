"""benchmarks/bench_sparse_read.py without a GPU: both layouts' offset tables address the rows the
layout's shaped views name (and a wrong table is caught), the kernel compiles for sm_90 with
16-byte MLA loads, and a host-backend run over torch and VirtualRegion backings checks every
configuration and records the machine, commit and command. On a GPU: a small run of the kernel
checked against the reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_sparse_read as bs  # noqa: E402

SCRIPT = os.path.join(ROOT, "benchmarks", "bench_sparse_read.py")
LAYERS, BLOCKS = 5, 7


def cache_words(seed: int = 0) -> torch.Tensor:
    nbytes = BLOCKS * LAYERS * (bs.MLA_BLOCK + bs.IDX_BLOCK)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    bs.fill_random(buf, seed)
    assert int(buf.min()) >= 1
    return buf.view(torch.int32)


def test_rows_are_656_and_132_bytes_and_bl_blocks_pack_every_layer():
    assert (bs.MLA_ROW, bs.IDX_ROW) == (656, 132)
    bl = bs.layout_tables("BL", 61, 10)
    assert bl["mla_stride"] == bl["idx_stride"] == 3_076_352 and bl["bytes"] == 10 * 3_076_352
    lb = bs.layout_tables("LB", 61, 10)
    assert (lb["mla_stride"], lb["idx_stride"], lb["bytes"]) == (41984, 8448, bl["bytes"])
    assert lb["idx_off"][:2] == [0, 10 * 8448] and lb["mla_off"][0] == 61 * 10 * 8448
    with pytest.raises(ValueError, match="layout must be one of"):
        bs.layout_tables("LBNHC", 61, 10)


@pytest.mark.parametrize("layout", bs.LAYOUTS)
def test_offset_table_addresses_read_the_rows_the_shaped_views_name(layout):
    words = cache_words()
    gen = torch.Generator().manual_seed(3)
    topk = torch.randint(0, BLOCKS * 64, (3, LAYERS, 50), generator=gen, dtype=torch.int32)
    tables = bs.layout_tables(layout, LAYERS, BLOCKS)
    want = bs.reference_sums(words, layout, LAYERS, BLOCKS, topk)
    assert torch.equal(bs.flat_sums(words, tables, topk), want)
    # one row by hand: query 1, layer 2, its 5th token, MLA words straight from the bytes
    t = int(topk[1, 2, 4])
    start = tables["mla_off"][2] + t // 64 * tables["mla_stride"] + t % 64 * 656
    mla, _ = bs.shaped_views(words, layout, LAYERS, BLOCKS)
    assert torch.equal(mla[2, t // 64, t % 64], words[start // 4 : start // 4 + 164])
    other = bs.layout_tables("BL" if layout == "LB" else "LB", LAYERS, BLOCKS)
    assert not torch.equal(bs.flat_sums(words, other, topk), want)  # the check has teeth


def test_the_kernel_compiles_for_sm90_with_16_byte_mla_loads():
    pytest.importorskip("cuda.bindings.nvrtc")
    from vmmkv.ops.build import _nvrtc_compile, compile_options

    cubin = bs.compile_kernel("sm_90")
    assert cubin.startswith(b"\x7fELF")
    opts = [o.replace("sm_90", "compute_90") for o in compile_options("sm_90", None)]
    opts += ["-DMLA_ROW=656", "-DIDX_ROW=132", "-DBLOCK_TOKENS=64"]
    ptx = _nvrtc_compile("sparse_read.cu", bs.SOURCE, {}, opts, ptx=True).decode()
    assert "ld.global.nc.v4.u32" in ptx


def run_script(tmp_path, *args: str) -> tuple[dict, str]:
    out = tmp_path / "sparse.json"
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, SCRIPT, "--queries", "3", "--topk", "32", "--layers",
                           "4", "--reps", "2", "--out", str(out), *args], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text()), proc.stdout


def test_a_host_run_checks_every_backing_and_layout_and_records_the_machine(tmp_path):
    data, printed = run_script(tmp_path, "--backend", "host", "--gib", "0.01")
    assert data["benchmark"] == "bench_sparse_read" and data["device"] == "host"
    assert "machine" in data and "commit" in data and data["command"][1] == SCRIPT
    got = [(r["backing"], r["layout"], r.get("chunk_MiB")) for r in data["rows"]]
    assert got == [("torch.empty", "LB", None), ("torch.empty", "BL", None),
                   ("vmmkv 2 MiB", "LB", 2), ("vmmkv 2 MiB", "BL", 2),
                   ("vmmkv 64 MiB", "LB", 64), ("vmmkv 64 MiB", "BL", 64)]  # fmt: skip
    assert all(r["check"] == "ok" and r["GB_s"] > 0 for r in data["rows"]), data["rows"]
    assert data["rows"][0]["vs_torch_LB"] == 1.0
    assert data["settings"]["checked_queries"] == [0, 1, 2] and "vs_torch_LB" in printed


@pytest.mark.gpu
def test_the_kernel_reads_the_reference_bytes_from_every_backing_on_a_gpu(tmp_path):
    data, _ = run_script(tmp_path, "--backend", "cuda", "--gib", "0.5")
    assert len(data["rows"]) == 6 and data["kernel"]["arch"].startswith("sm_")
    assert all(r["check"] == "ok" for r in data["rows"]), data["rows"]
