"""benchmarks/bench_store.py without a GPU: the slot patterns its tables are measured with, and
the copy ceilings of benchmarks/ceiling.py (NVRTC compile and PTX, sizes, size matching, the
launch's parameters, the byte check)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_store as bs  # noqa: E402
import ceiling  # noqa: E402


def test_runs_are_consecutive_slots_from_the_base():
    g = torch.Generator().manual_seed(0)
    slots = bs.slot_mapping("runs", 100, 640, 1280, "cpu", g)
    assert slots.dtype == torch.int64
    assert slots.tolist() == list(range(1280, 1380))


def test_random_slots_are_distinct_inside_the_span_and_not_in_order():
    g = torch.Generator().manual_seed(0)
    slots = bs.slot_mapping("random", 500, 640, 1280, "cpu", g)
    values = slots.tolist()
    assert len(set(values)) == 500 and min(values) >= 1280 and max(values) < 1280 + 640
    assert values != sorted(values)


def test_blocks_are_whole_blocks_of_consecutive_slots_in_random_block_order():
    g = torch.Generator().manual_seed(0)
    slots = bs.slot_mapping("blocks", 300, 640, 1280, "cpu", g)  # 4 whole blocks and 44 slots
    values = slots.tolist()
    assert len(values) == 300 and len(set(values)) == 300
    assert min(values) >= 1280 and max(values) < 1280 + 640
    starts = values[:: bs.BS]
    assert all((s - 1280) % bs.BS == 0 for s in starts)
    for i, s in enumerate(starts):
        assert values[i * bs.BS : (i + 1) * bs.BS] == list(range(s, s + bs.BS))[: 300 - i * bs.BS]
    assert starts != sorted(starts)
    with pytest.raises(ValueError, match="not a multiple of the block size 64"):
        bs.slot_mapping("blocks", 4, 100, 0, "cpu", g)


def test_an_unknown_slot_pattern_is_refused_by_name():
    match = r"slot pattern must be one of \('runs', 'blocks', 'random'\)"
    with pytest.raises(ValueError, match=match):
        bs.slot_mapping("strided", 4, 64, 0, "cpu", torch.Generator())


# ---------------------------------------------------------------------------------------------
# copy ceilings (benchmarks/ceiling.py): kernel source, sizes, size matching, launch, check


def test_ceiling_sizes_are_8_26_52_mb_rounded_down_to_512():
    assert ceiling.SIZES == (8_000_000, 25_999_872, 51_999_744)
    for size, want in zip(ceiling.SIZES, (8e6, 26e6, 52e6), strict=True):
        assert size % 512 == 0 and want - 512 < size <= want


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_the_ceiling_kernels_compile_with_nvrtc(arch):
    cubin = ceiling.compile_cubin(arch)
    assert cubin.startswith(b"\x7fELF")
    for entry in ceiling.ENTRIES.values():
        assert entry.encode() in cubin, entry


def test_the_ceiling_ptx_has_full_line_stores_and_a_tma_bulk_store():
    ptx = ceiling.compile_ptx("sm_90")
    for want in (
        "st.global.v4.b32",
        "st.global.L1::no_allocate.v4.b32",
        "fence.proxy.async.shared::cta",
        "cp.async.bulk.global.shared::cta.bulk_group",
        "cp.async.bulk.commit_group",
        "cp.async.bulk.wait_group.read 1",
        "cp.async.bulk.wait_group 0",
    ):
        assert want in ptx, want
    # the SM copy: 4 loads of a hunk before its 4 stores
    body = ptx[ptx.index(".entry vmmkv_ceiling_copy_lines(") :]
    body = body[: body.index("st.global.v4.b32") + 200]
    assert body.count("ld.global.nc.v4") >= 4
    # the TMA copy's static shared memory: TMA_STAGES tiles
    assert f".b8 _ZZ23vmmkv_ceiling_tma_storeE4tile[{ceiling.TMA_TILE * ceiling.TMA_STAGES}]" in ptx


def test_before_sm_90_the_tma_copy_is_compiled_out():
    assert not ceiling.has_tma("sm_80") and ceiling.has_tma("sm_90a") and ceiling.has_tma("sm_100")
    ptx = ceiling.compile_ptx("sm_80")
    assert "cp.async.bulk" not in ptx and "st.global.v4.b32" in ptx


def test_the_closest_size_is_picked_the_smaller_on_a_tie():
    sizes = ceiling.SIZES
    assert ceiling.closest_size(8192 * 788, sizes) == sizes[0]  # 6.5 MB
    assert ceiling.closest_size(16384 * 788, sizes) == sizes[0]  # 12.9 MB
    assert ceiling.closest_size(32768 * 788, sizes) == sizes[1]  # 25.8 MB
    assert ceiling.closest_size(65536 * 788, sizes) == sizes[2]  # 51.6 MB
    assert ceiling.closest_size(10**12, sizes) == sizes[2]
    assert ceiling.closest_size(15, (10, 20)) == 10
    with pytest.raises(ValueError, match="no ceiling sizes"):
        ceiling.closest_size(1, ())


def _ceil_row(n, ce, lines, tma):
    return ceiling._finish(
        {"bytes": n, "MB": n / 1e6, "CE copy GB/s": ce, "SM lines GB/s": lines,
         "TMA bulk GB/s": tma}
    )  # fmt: skip


def test_best_ceiling_is_the_fastest_method_at_the_closest_size():
    rows = [_ceil_row(100, 300.0, 310.0, 290.0), _ceil_row(1000, 370.0, 350.0, 360.0)]
    assert (rows[0][ceiling.BEST], rows[0]["best"]) == (310.0, "SM lines")
    assert (rows[1][ceiling.BEST], rows[1]["best"]) == (370.0, "CE copy")
    assert ceiling.best_at(rows, 400) == 310.0 and ceiling.best_at(rows, 900) == 370.0


def test_the_pcp_ceilings_take_each_method_of_the_slowest_rank():
    rank0 = [_ceil_row(100, 300.0, 310.0, 290.0)]
    rank1 = [_ceil_row(100, 305.0, 280.0, 295.0)]
    (row,) = ceiling.slowest([rank0, rank1])
    assert (row["CE copy GB/s"], row["SM lines GB/s"], row["TMA bulk GB/s"]) == (300, 280, 290)
    assert (row[ceiling.BEST], row["best"]) == (300.0, "CE copy")
    assert bs.ceiling_columns([row]) == [
        "MB", "CE copy GB/s", "SM lines GB/s", "TMA bulk GB/s", ceiling.BEST, "best"
    ]  # fmt: skip


class _Tensor:
    def __init__(self, ptr, n):
        self.ptr, self.n = ptr, n

    def data_ptr(self):
        return self.ptr

    def numel(self):
        return self.n


def test_a_copy_kernel_launch_passes_dst_src_bytes_on_the_current_stream(monkeypatch):
    import ctypes
    import types

    from vmmkv.alloc import driver

    calls = []

    def call(fn, *args, **context):
        grid, block, stream, params = args[1], args[4], args[8], args[9]
        ptrs = (ctypes.c_void_p * 3).from_address(params)
        dst = ctypes.c_uint64.from_address(ptrs[0]).value
        src = ctypes.c_uint64.from_address(ptrs[1]).value
        n = ctypes.c_uint64.from_address(ptrs[2]).value
        calls.append((args[0], grid, block, stream, dst, src, n, context))

    class NoContext:
        def __init__(self, ordinal):
            pass

        def __enter__(self):
            return None

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(driver, "call", call)
    monkeypatch.setattr(driver, "primary_context", NoContext)
    monkeypatch.setattr(driver, "cu", types.SimpleNamespace(cuLaunchKernel="launch"))
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda o: types.SimpleNamespace(cuda_stream=77)
    )
    k = object.__new__(ceiling.CopyKernels)
    k.ordinal, k.arch, k.sms = 0, "sm_90", 132
    k.functions = {"SM lines": "f_lines", "TMA bulk": "f_tma"}
    assert k.methods() == ("CE copy", "SM lines", "TMA bulk")
    k.copy("SM lines", _Tensor(1 << 21, 4096), _Tensor(1 << 22, 1024))
    k.copy("TMA bulk", _Tensor(1 << 21, 4096), _Tensor(1 << 22, 1024))
    lines = (ceiling.LINES_THREADS, 132 * ceiling.LINES_CTAS_PER_SM)
    tma = (ceiling.TMA_THREADS, 132 * ceiling.TMA_CTAS_PER_SM)
    assert [c[:7] for c in calls] == [
        ("f_lines", lines[1], lines[0], 77, 1 << 21, 1 << 22, 1024),
        ("f_tma", tma[1], tma[0], 77, 1 << 21, 1 << 22, 1024),
    ]
    assert calls[0][7] == {"kernel": "vmmkv_ceiling_copy_lines", "device": 0}
    with pytest.raises(ValueError, match="multiples of 512"):
        k.copy("SM lines", _Tensor(1 << 21, 4096), _Tensor(1 << 22, 1000))
    with pytest.raises(ValueError, match="multiples of 512"):
        k.copy("SM lines", _Tensor((1 << 21) + 16, 4096), _Tensor(1 << 22, 1024))


class _CpuKernels:
    """The CE copy as torch's, an 'SM lines' that drops the last byte when ``broken``."""

    def __init__(self, broken):
        self.broken = broken

    def methods(self):
        return ("CE copy", "SM lines")

    def copy(self, method, dst, src):
        n = src.numel() - (1 if self.broken and method == "SM lines" else 0)
        dst[:n].copy_(src[:n])


def test_measure_checks_every_copy_before_timing_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(ceiling, "kernels", lambda ordinal: _CpuKernels(False))
    src, dst = torch.zeros(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
    times = iter([1e-3, 2e-3, 1e-3, 0.5e-3])  # ms per call
    events = []
    rows = ceiling.measure(0, dst, src, lambda fn: next(times), sizes=(1024, 4096),
                           before=lambda: events.append("sync"))  # fmt: skip
    assert torch.equal(dst, src) and src.any()  # random source bytes, copied
    assert [r["bytes"] for r in rows] == [1024, 4096]
    assert rows[0]["CE copy GB/s"] == pytest.approx(1024 / 1e-3 / 1e6)
    assert rows[0]["best"] == "CE copy" and rows[1]["best"] == "SM lines"
    assert rows[1][ceiling.BEST] == pytest.approx(4096 / 0.5e-3 / 1e6)
    assert len(events) == 2 * 2 * 2  # sizes x methods x (check, timing)
    monkeypatch.setattr(ceiling, "kernels", lambda ordinal: _CpuKernels(True))
    with pytest.raises(RuntimeError, match="SM lines copy of 1024 B: 1 bytes differ"):
        ceiling.measure(0, dst, src, lambda fn: 1.0, sizes=(1024,))
    with pytest.raises(ValueError, match="need 4096"):
        ceiling.measure(0, dst[:100], src, lambda fn: 1.0, sizes=(4096,))


def test_the_copy_check_catches_an_unwritten_byte_whatever_its_value(monkeypatch):
    # source bytes (i + 1) % 256: the byte the broken method leaves unwritten (1023) is zero, which
    # a check that zeroes the destination first would take for a copied byte
    def pattern(self, low, high):
        return self.copy_((torch.arange(self.numel()) + 1) % 256)

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.Tensor, "random_", pattern)
    monkeypatch.setattr(ceiling, "kernels", lambda ordinal: _CpuKernels(True))
    src, dst = torch.zeros(1024, dtype=torch.uint8), torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="SM lines copy of 1024 B: 1 bytes differ"):
        ceiling.measure(0, dst, src, lambda fn: 1.0, sizes=(1024,))
    assert src[1023] == 0 and dst[1023] == 255  # the source's complement, left unwritten


def test_help_works_without_a_gpu():
    import subprocess

    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_store.py"), "--help"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert "--pcp" in out.stdout
