"""NVRTC build of the kernels and the on-disk cubin cache (no GPU needed)."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import threading
from pathlib import Path

import pytest

from tests.helpers import packed_layout, struct_layout
from vmmkv.ops import build, launch

ARCHS = ["sm_80", "sm_90", "sm_100"]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("VMMKV_CACHE_DIR", str(tmp_path / "kernels"))
    return tmp_path / "kernels"


def _cache_files(folder: Path) -> list[Path]:
    return sorted(folder.iterdir()) if folder.exists() else []


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles_for_each_arch(arch, cache):
    cubins = build.compile_all(arch)
    assert sorted(cubins) == sorted(build.KERNELS)
    for name, cubin in cubins.items():
        assert cubin.startswith(b"\x7fELF"), name
        for entry in build.KERNELS[name]:
            assert entry.encode() in cubin, f"{entry} missing from {name} ({arch})"


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles_without_the_cuda_headers(arch, cache, monkeypatch):
    monkeypatch.setenv("VMMKV_CUDA_INCLUDE", "none")
    assert build.cuda_include_dir() is None
    cubins = build.compile_all(arch)
    assert all(c.startswith(b"\x7fELF") for c in cubins.values())


def test_sources_come_from_the_checkout_csrc():
    folder = build.csrc_dir()
    assert (folder / "kv_store.cu").is_file() and (folder / "barrier.cu").is_file()
    source, headers = build.read_source("kv_store.cu")
    assert "vmmkv_store_ds_mla" in source and "vmmkv_common.cuh" in headers


def test_options_never_ask_for_fast_math():
    for inc in (None, "/some/include"):
        opts = build.compile_options("sm_90", inc)
        assert "--gpu-architecture=sm_90" in opts and "-std=c++17" in opts
        assert not any("fast" in o or "ftz=true" in o or "prec" in o for o in opts)


@pytest.mark.parametrize("with_headers", [False, True])
def test_ptx_uses_ieee_division_no_flush_to_zero_and_the_satfinite_cvt(with_headers):
    include = build.cuda_include_dir() if with_headers else None
    if with_headers and include is None:
        pytest.skip("CUDA headers not found")
    ptx = build.compile_ptx("kv_store.cu", "sm_90", include)
    assert "div.rn.f32" in ptx
    assert not re.search(r"div\.(approx|full)", ptx) and ".ftz" not in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx


def test_barrier_ptx_uses_system_scope_release_and_acquire():
    ptx = build.compile_ptx("barrier.cu", "sm_90")
    for op in ("st.release.sys.global", "ld.acquire.sys.global", "trap"):
        assert op in ptx, op
    assert "fence.acq_rel.sys" not in ptx  # st.release.sys is the release: no second sys fence
    assert "%globaltimer" in ptx


def test_the_test_lag_hook_exists_only_in_test_builds_and_other_defines_are_refused(monkeypatch):
    plain = build.compile_ptx("kv_store.cu", "sm_90")
    assert "-DVMMKV_TEST" not in " ".join(build.compile_options("sm_90", None))
    monkeypatch.setenv("VMMKV_TEST_DEFINES", "VMMKV_TEST_LAG_NS=50000 VMMKV_TEST_LAG_CTA=0")
    opts = build.compile_options("sm_90", None)
    assert opts[-2:] == ["-DVMMKV_TEST_LAG_NS=50000", "-DVMMKV_TEST_LAG_CTA=0"]
    lagged = build.compile_ptx("kv_store.cu", "sm_90")
    # the lag spins on the timer in every fused kernel, before its stores; the plain ones have none
    for entry in ("vmmkv_publish_rows_barrier", "vmmkv_store_layer_barrier"):
        body = re.search(rf"\.entry {entry}\((.*?)\n}}\n", lagged, re.S).group(1)
        plain_body = re.search(rf"\.entry {entry}\((.*?)\n}}\n", plain, re.S).group(1)
        assert body.count("%globaltimer") > plain_body.count("%globaltimer"), entry
    for bad in ("FOO=1", "VMMKV_TEST_X=1;rm", "-DVMMKV_TEST_X", "VMMKV_TEST_LAG_NS=1e3"):
        monkeypatch.setenv("VMMKV_TEST_DEFINES", bad)
        with pytest.raises(build.BuildError, match="VMMKV_TEST_DEFINES"):
            build.compile_options("sm_90", None)


def test_vmmkv_csrc_dir_replaces_the_sources_and_the_cache_key(tmp_path, monkeypatch, cache):
    for f in build.csrc_dir().iterdir():
        (tmp_path / f.name).write_text(f.read_text())
    text = (tmp_path / "barrier.cuh").read_text()
    (tmp_path / "barrier.cuh").write_text(text.replace("kBackoffNs = 100", "kBackoffNs = 101"))
    first = build.compile_source("barrier.cu", "sm_90")
    monkeypatch.setenv("VMMKV_CSRC_DIR", str(tmp_path))
    assert build.csrc_dir() == tmp_path
    assert build.compile_source("barrier.cu", "sm_90") != first
    assert len(_cache_files(cache)) == 2  # its own cache entry
    monkeypatch.setenv("VMMKV_CSRC_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="VMMKV_CSRC_DIR"):
        build.csrc_dir()


def test_bad_arch_and_unknown_source_are_rejected():
    with pytest.raises(ValueError, match="sm_90"):
        build.compile_options("90", None)
    with pytest.raises(ValueError, match="unknown kernel source"):
        build.compile_source("nope.cu", "sm_90")


def test_compile_errors_raise_with_the_nvrtc_log():
    with pytest.raises(build.BuildError) as info:
        build._nvrtc_compile("broken.cu", "int f( { return 0; }", {}, ["--gpu-architecture=sm_90"])
    assert "broken.cu" in str(info.value) and "error" in info.value.log


def test_cache_key_changes_with_arch_options_source_headers_and_version():
    src, hdrs = build.read_source("kv_store.cu")
    opts = build.compile_options("sm_90", None)
    base = build.cache_key("kv_store.cu", src, hdrs, opts, "sm_90", (13, 0))
    assert base == build.cache_key("kv_store.cu", src, dict(hdrs), list(opts), "sm_90", (13, 0))
    variants = [
        build.cache_key("kv_store.cu", src, hdrs, build.compile_options("sm_80", None), "sm_80", (13, 0)),
        build.cache_key("kv_store.cu", src, hdrs, opts + ["-lineinfo"], "sm_90", (13, 0)),
        build.cache_key("kv_store.cu", src + "\n", hdrs, opts, "sm_90", (13, 0)),
        build.cache_key("kv_store.cu", src, {k: v + " " for k, v in hdrs.items()}, opts, "sm_90", (13, 0)),
        build.cache_key("kv_store.cu", src, hdrs, opts, "sm_90", (13, 1)),
        build.cache_key("kv_store.cu", src, hdrs, opts, "sm_90", (13, 0), b"header text"),
        build.cache_key("barrier.cu", src, hdrs, opts, "sm_90", (13, 0)),
    ]  # fmt: skip
    assert len({base, *variants}) == len(variants) + 1


def test_cache_is_written_once_and_reused_without_compiling(cache, monkeypatch):
    first = build.compile_source("barrier.cu", "sm_90")
    files = _cache_files(cache)
    assert len(files) == 1 and files[0].name.startswith("barrier-sm_90-")
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]
    mtime = files[0].stat().st_mtime_ns

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled although the cache holds the cubin")

    monkeypatch.setattr(build, "_nvrtc_compile", no_compile)
    assert build.compile_source("barrier.cu", "sm_90") == first
    assert files[0].stat().st_mtime_ns == mtime


def test_cache_lives_under_xdg_cache_home_without_vmmkv_cache_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("VMMKV_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert build.cache_dir() == tmp_path / "vmmkv" / "kernels"


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage"])
def test_a_corrupt_cache_file_is_ignored_and_rebuilt(cache, damage):
    good = build.compile_source("barrier.cu", "sm_90")
    (path,) = _cache_files(cache)
    data = path.read_bytes()
    bad = {
        "truncate": data[: len(data) // 2],
        "flip": data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:],
        "empty": b"",
        "garbage": os.urandom(len(data)),
    }[damage]
    path.write_bytes(bad)
    assert build.compile_source("barrier.cu", "sm_90") == good
    assert path.read_bytes() == data


def test_a_failed_cache_write_leaves_no_partial_file(cache, monkeypatch):
    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(build.os, "replace", failing_replace)
    cubin = build.compile_source("barrier.cu", "sm_90")  # still compiled and returned
    assert cubin.startswith(b"\x7fELF")
    assert _cache_files(cache) == []  # neither the final file nor the temporary one


def test_an_unwritable_cache_dir_only_disables_caching(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("VMMKV_CACHE_DIR", str(blocker / "kernels"))
    assert build.compile_source("barrier.cu", "sm_90").startswith(b"\x7fELF")


def test_concurrent_builds_agree_and_leave_one_valid_file(cache):
    results: list[bytes] = []
    errors: list[BaseException] = []

    def work():
        try:
            results.append(build.compile_source("barrier.cu", "sm_80"))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    (path,) = _cache_files(cache)
    assert build._read_cached(path) == results[0]


def test_header_compile_failure_falls_back_to_the_builtin_conversion(cache, monkeypatch, tmp_path):
    fake = tmp_path / "include"
    fake.mkdir()
    (fake / "cuda_fp8.h").write_text("#error this header is from an incompatible toolkit\n")
    (fake / "cuda_fp8.hpp").write_text("")
    monkeypatch.setenv("VMMKV_CUDA_INCLUDE", str(fake))
    with pytest.warns(RuntimeWarning, match="built-in fp8 conversion"):
        cubin = build.compile_source("kv_store.cu", "sm_90")
    assert cubin.startswith(b"\x7fELF")


def test_a_vmmkv_cuda_include_without_the_header_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("VMMKV_CUDA_INCLUDE", str(tmp_path))
    with pytest.raises(build.BuildError, match="cuda_fp8.h"):
        build.cuda_include_dir()


def test_host_kvdest_layout_matches_the_device_struct(cache):
    fields = [
        "ptr_table", "committed_bytes", "error_counter", "offset_bytes", "block_stride",
        "entry_stride", "block_extent", "num_blocks", "block_size", "num_dest", "my_rank",
        "reserved",
    ]  # fmt: skip
    sizes = [8] * 8 + [4] * 4
    assert launch.KVDEST.size == sum(sizes) == 80
    assert struct_layout("KVDest", "vmmkv_common.cuh", fields) == packed_layout(fields, sizes)


_HOST_HARNESS = r"""
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <cuda_fp8.h>
#include "vmmkv_common.cuh"

static unsigned long long checked = 0, bad = 0;

static void check(uint32_t bits) {
    float x;
    std::memcpy(&x, &bits, 4);
    const unsigned want = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
    const unsigned want_neg = __nv_cvt_float_to_fp8(-x, __NV_SATFINITE, __NV_E4M3);
    const unsigned got = vmmkv::e4m3_satfinite_soft(x);
    const unsigned got_pair = vmmkv::e4m3x2(x, -x);
    ++checked;
    if (got != want || got_pair != (want | (want_neg << 8))) {
        if (bad < 10) std::printf("MISMATCH %08x: header %02x, vmmkv %02x\n", bits, want, got);
        ++bad;
    }
}

int main() {
    // every float with |x| in [2^-15, 2^10): the whole e4m3 range, its rounding and saturation
    for (uint32_t e = 112; e <= 136; ++e)
        for (uint32_t m = 0; m < (1u << 23); ++m) check((e << 23) | m);
    for (uint64_t b = 0; b < (1ull << 32); b += 9973) check((uint32_t)b);  // a sample of the rest
    const uint32_t specials[] = {0u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u,
                                 0xffc00000u, 0x7f800001u, 1u, 0x807fffffu, 0x7f7fffffu};
    for (uint32_t b : specials) check(b);
    std::printf("checked %llu floats, %llu mismatches\n", checked, bad);
    return bad != 0;
}
"""


@pytest.mark.timeout(600)
def test_builtin_e4m3_conversion_equals_cuda_fp8_header_on_every_fp8_range_float(tmp_path):
    nvcc = shutil.which("nvcc")
    include = build.cuda_include_dir()
    if nvcc is None or include is None:
        pytest.skip("needs nvcc and the CUDA headers to run the header's host conversion")
    src = tmp_path / "harness.cu"
    src.write_text(_HOST_HARNESS)
    exe = tmp_path / "harness"
    subprocess.run(
        [nvcc, "-O2", "-std=c++17", "-DVMMKV_HOST_TEST", f"-I{build.csrc_dir()}", f"-I{include}",
         "-o", str(exe), str(src)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert ", 0 mismatches" in run.stdout


_INDEXER_STORES = {  # entry point -> index of its ue8m0 parameter
    "vmmkv_store_indexer_k": 7,
    "vmmkv_store_layer": 12,
    "vmmkv_store_indexer_k_barrier": 7,
    "vmmkv_store_layer_barrier": 12,
}


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_the_mxfp8_indexer_variants_compile_for_hopper_and_blackwell_as_compile_time_twins(
    arch, cache
):
    cubin = build.compile_source("kv_store.cu", arch)
    ptx = build.compile_ptx("kv_store.cu", arch, build.cuda_include_dir())
    for plain, ue8m0_param in _INDEXER_STORES.items():
        mx = plain.replace("_indexer_k", "_indexer_k_mxfp8").replace("_layer", "_layer_mxfp8")
        assert mx.encode() in cubin, (mx, arch)
        bodies = {}
        for entry in (plain, mx):
            m = re.search(rf"\.entry {entry}\((.*?)\n}}\n", ptx, re.S)
            assert m is not None, (entry, arch)
            bodies[entry] = m.group(1)
        reads = rf"ld\.param\.\w+\s+%\w+, \[{{}}_param_{ue8m0_param}\]"
        # the plain kernel reads ue8m0 and stores the fp32 scale; the mxfp8 twin has the
        # rounding built in (no ue8m0 read) and replicates the exponent byte (x 0x01010101)
        assert re.search(reads.format(plain), bodies[plain]), (plain, arch)
        assert not re.search(reads.format(mx), bodies[mx]), (mx, arch)
        assert "16843009" not in bodies[plain] and "16843009" in bodies[mx], (mx, arch)


# every store that quantizes MLA -> its fp8_ds_mla_ue8m0 twin (the suffix goes after the store
# name, before the indexer kind's suffix)
_MLA_TWINS = {
    "vmmkv_store_ds_mla": "vmmkv_store_ds_mla_ue8m0",
    "vmmkv_store_ds_mla_barrier": "vmmkv_store_ds_mla_ue8m0_barrier",
    "vmmkv_store_layer": "vmmkv_store_layer_ue8m0",
    "vmmkv_store_layer_barrier": "vmmkv_store_layer_ue8m0_barrier",
    "vmmkv_store_layer_mxfp8": "vmmkv_store_layer_ue8m0_mxfp8",
    "vmmkv_store_layer_mxfp8_barrier": "vmmkv_store_layer_ue8m0_mxfp8_barrier",
}


def _entry(ptx: str, name: str) -> tuple[list[str], str]:
    """(parameter types, body) of the PTX entry ``name``."""
    m = re.search(
        rf"\.entry {name}\((.*?)\)\s*(?:\.(?:maxntid|minnctapersm)[^\n]*\s*)*\{{(.*?)\n}}\n",
        ptx,
        re.S,
    )
    assert m is not None, name
    return re.findall(r"\.param (\.[\w.]+(?: \.align \d+)?)", m.group(1)), m.group(2)


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_the_ue8m0_mla_variants_compile_for_hopper_and_blackwell_as_compile_time_twins(arch, cache):
    cubin = build.compile_source("kv_store.cu", arch)
    ptx = build.compile_ptx("kv_store.cu", arch, build.cuda_include_dir())
    assert set(_MLA_TWINS.values()) <= set(build.KERNELS["kv_store.cu"])
    for plain, twin in _MLA_TWINS.items():
        assert twin.encode() in cubin, (twin, arch)
        (plain_params, plain_body), (twin_params, twin_body) = _entry(ptx, plain), _entry(ptx, twin)
        assert plain_params == twin_params and plain_params, (twin, arch)  # same parameters
        # the twin rounds the tile scale: one more ceil and 1e-4f (0x38d1b717) than its plain
        # kernel, so the choice is made at compile time, not by a runtime flag
        for marker in ("cvt.rpi.f32.f32", "0f38D1B717", "ex2.approx"):
            assert twin_body.count(marker) > plain_body.count(marker), (twin, marker, arch)
    plain_mla = _entry(ptx, "vmmkv_store_ds_mla")[1]
    twin_mla = _entry(ptx, "vmmkv_store_ds_mla_ue8m0")[1]
    # fp8_ds_mla: the raw quotient floored at FLT_MIN, no rounding at all; the ue8m0 twin: no
    # FLT_MIN floor (0f00800000 only in log2f's subnormal test)
    flt_min_floor = r"(mov|max)\.f32\s[^;]*0f00800000;"
    assert re.search(flt_min_floor, plain_mla) and not re.search(flt_min_floor, twin_mla)
    assert not any(m in plain_mla for m in ("cvt.rpi", "ex2.approx", "0f38D1B717"))


EIATTR_FRAME_SIZE, EIATTR_REGCOUNT = 0x11, 0x2F


def nv_info(cubin: bytes, attr: int) -> dict[str, int]:
    """Attribute ``attr`` of each function of a cubin (e.g. EIATTR_REGCOUNT: registers per thread;
    EIATTR_FRAME_SIZE: stack bytes): the entries of its ``.nv.info`` section that name a symbol of
    ``.symtab``."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)
    ]

    def cstr(base: int, off: int) -> str:
        return cubin[base + off : cubin.index(b"\0", base + off)].decode()

    names = [cstr(sections[shstrndx][4], s[0]) for s in sections]
    symtab = sections[names.index(".symtab")]
    strtab = sections[symtab[6]]
    symbols = [
        cstr(strtab[4], struct.unpack_from("<I", cubin, off)[0])
        for off in range(symtab[4], symtab[4] + symtab[5], 24)
    ]
    info = sections[names.index(".nv.info")]
    found, p, end = {}, info[4], info[4] + info[5]
    # entries: format byte, attribute byte, two bytes; EIFMT_SVAL (4) is followed by as many
    # bytes as those two say, the other formats (no value, a byte, a half word) end there
    while p < end:
        fmt, kind, size = cubin[p], cubin[p + 1], struct.unpack_from("<H", cubin, p + 2)[0]
        if fmt == 4 and kind == attr:
            symbol, value = struct.unpack_from("<II", cubin, p + 4)
            found[symbols[symbol]] = value
        p += 4 + (size if fmt == 4 else 0)
    assert p == end, f".nv.info read past its end ({p} > {end}): an entry format not known here"
    return found


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_every_store_keeps_four_ctas_of_256_threads_resident_per_sm(arch, cache):
    # The stores' grid is capped at their resident CTAs (ops/launch.py's resident_grid); at most
    # 64 registers per thread keep 4 CTAs of 256 threads per SM (65536 registers). The fused
    # (*_barrier) stores are held there by __launch_bounds__(256, 4): unbounded, the fused layer
    # store took 68 registers (3 CTAs per SM) and the one-rank publish got 7 % slower.
    regs = nv_info(build.compile_source("kv_store.cu", arch), EIATTR_REGCOUNT)
    assert set(build.KERNELS["kv_store.cu"]) <= set(regs), arch
    over = {k: regs[k] for k in build.KERNELS["kv_store.cu"] if regs[k] > 64}
    assert not over, (arch, over)
