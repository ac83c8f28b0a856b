"""The quantizers' division at issue rate gives IEEE division's bytes: an exhaustive proof.

The stores divide each tile's values by its scale with ``quantize4`` (csrc/vmmkv_common.cuh): a
multiply by the exact reciprocal for power-of-two scales, else a multiply by the correctly
rounded reciprocal plus one FMA correction and copysign, with IEEE ``/`` kept for tiles whose
scale is outside the guarded range (``div_scale`` is the same choice for one value). Every scale is a function of a tile's amax, and amax is a bf16 magnitude (the
largest |x| of the tile; NaN never wins ``fmaxf``), so the pairs a tile can hold are finite:
every amax from +0 to +inf (32641 bf16 patterns) times every bf16 value ``x`` with
``|x| <= amax`` or ``x`` NaN. For each of the four scale rules (fp8_ds_mla, fp8_ds_mla_ue8m0,
indexer_k, indexer_k ue8m0 / mxfp8; computed by the kernels' own ``mla_tile_scale`` and
``indexer_scale``) a kernel runs all of them (2^30 + 16384 pairs per rule) and compares

- the e4m3 bytes of the stores' own ``quantize4`` (the division and the packed conversion, two
  values per instruction), fed ``(x, -x, -x, x)``, with the software conversion of the IEEE
  quotient (``e4m3_satfinite_soft``, itself checked against cuda_fp8.h on every float in
  tests/test_nvrtc.py): no difference;
- the fp32 quotient bits with ``x / s`` (NaN with NaN): for the power-of-two rules no difference
  at all; for the raw-scale rules none where either quotient is NaN or of magnitude >= 2^-11
  (a last-bit difference below that, where e4m3 gives +-0 either way, is counted and printed);

with exactly the expected number of pairs. The sweep includes the edge cases by construction:
+-0, bf16 subnormals, the largest finite value, infinities, NaNs, and every amax under the scale
floors (FLT_MIN, 1e-4). Power-of-two rules also check that every finite scale is an exact power
of two (what makes the single multiply exact).

Teeth: the same sweep with the plain product ``x * r`` (no correction) and with the correction
but without copysign must find differences (in the quotient, and in the bytes for -0).
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from vmmkv.alloc import driver
from vmmkv.ops import build
from vmmkv.testing.markers import requires_gpu

RULES = {"fp8_ds_mla": 0, "fp8_ds_mla_ue8m0": 1, "indexer_k": 2, "indexer_k_ue8m0": 3}
POW2 = {1, 3}
MODES = {"div_scale": 0, "plain_product": 1, "no_copysign": 2}
AMAX_PATTERNS = 0x7F80 + 1  # +0 .. +inf
THREADS = 256

SOURCE = r"""
#include "vmmkv_common.cuh"
using namespace vmmkv;

__device__ float rule_scale(int rule, float amax) {
    switch (rule) {
        case 0: return mla_tile_scale<false>(amax);
        case 1: return mla_tile_scale<true>(amax);
        case 2: return indexer_scale(amax, false);
        default: return indexer_scale(amax, true);
    }
}

__device__ float quotient(int mode, bool pow2, float x, const InvScale& d) {
    if (mode == 1) return x * d.r;
    if (mode == 2) { const float q = x * d.r; return fmaf(fmaf(-d.s, q, x), d.r, q); }
    return pow2 ? div_scale<true>(x, d) : div_scale<false>(x, d);
}

__device__ bool same_bits(float a, float b) {
    return f32_bits(a) == f32_bits(b) || (a != a && b != b);
}

// A quotient difference e4m3 can see: either float NaN or of magnitude >= 2^-11 (below 2^-10
// both round to +-0, so a difference there cannot reach a byte).
__device__ bool visible(float got, float want) {
    return !same_bits(got, want) &&
           (got != got || want != want || fmaxf(fabsf(got), fabsf(want)) >= 0x1p-11f);
}

// counts: [0] pairs, [1] byte differences, [2] quotient differences, [3] non-power-of-two
// finite scales of a pow2 rule, [4] visible quotient differences. first: (amax bits << 16) |
// x bits of the first byte difference.
extern "C" __global__ void __launch_bounds__(256)
quant_proof(int rule, int mode, unsigned long long* counts, unsigned int* first) {
    const u32 a = blockIdx.x;  // amax = the bf16 with bits a, 0 .. 0x7f80 (+inf)
    const bool pow2 = rule == 1 || rule == 3;
    const float s = rule_scale(rule, f32_from_bits(a << 16));
    const InvScale d = inv_scale(s);
    if (threadIdx.x == 0 && pow2 && f32_bits(s) < 0x7f800000u && (f32_bits(s) & 0x7fffffu))
        atomicAdd(counts + 3, 1ull);
    unsigned long long pairs = 0, bytes = 0, quots = 0, seen = 0;
    // x and -x in one packed conversion, as the stores convert pairs
    for (u32 m = threadIdx.x; m < 0x8000u; m += blockDim.x) {
        if (!(m <= a || m > 0x7f80u)) continue;  // |x| <= amax, or x NaN
        const float xp = f32_from_bits(m << 16), xn = f32_from_bits((m | 0x8000u) << 16);
        const float gp = quotient(mode, pow2, xp, d), gn = quotient(mode, pow2, xn, d);
        const float wp = xp / s, wn = xn / s;
        // the bytes: the stores' own quantize4 (mode 0), else the control quotients converted
        u32 got;
        if (mode != 0) got = e4m3x2(gp, gn);
        else if (pow2) got = quantize4<true>(xp, xn, xn, xp, d);
        else got = quantize4<false>(xp, xn, xn, xp, d);
        if (mode == 0 && (got >> 16) != (((got & 0xffu) << 8) | ((got >> 8) & 0xffu))) {
            ++bytes;  // the upper pair (-x, x) must mirror the lower (x, -x)
            atomicMin(first, (a << 16) | m);
        }
        const u32 want = e4m3_satfinite_soft(wp) | (e4m3_satfinite_soft(wn) << 8);
        pairs += 2;
        quots += !same_bits(gp, wp);
        quots += !same_bits(gn, wn);
        seen += visible(gp, wp) + visible(gn, wn);
        if ((got & 0xffu) != (want & 0xffu)) { ++bytes; atomicMin(first, (a << 16) | m); }
        if (((got >> 8) & 0xffu) != (want >> 8)) {
            ++bytes;
            atomicMin(first, (a << 16) | m | 0x8000u);
        }
    }
    atomicAdd(counts + 0, pairs);
    if (bytes) atomicAdd(counts + 1, bytes);
    if (quots) atomicAdd(counts + 2, quots);
    if (seen) atomicAdd(counts + 4, seen);
}
"""


def expected_pairs() -> int:
    """Per rule: for amax pattern a, the 2 (a + 1) values with |x| <= amax plus the 254 NaNs."""
    return sum(2 * (a + 1) + 254 for a in range(AMAX_PATTERNS))


class Proof:
    """The proof kernel, compiled with the stores' own options and headers, loaded once."""

    def __init__(self, device: torch.device):
        from cuda.bindings import driver as cu

        self.cu = cu
        self.device = device
        ordinal = device.index or 0
        torch.zeros(1, device=device)  # torch's primary context, current on this thread
        _, headers = build.read_source("kv_store.cu")
        arch = build.arch_of_device(ordinal)
        options = build.compile_options(arch, build.cuda_include_dir())
        cubin = build._nvrtc_compile("quant_proof.cu", SOURCE, headers, options)
        self.module = driver.call(cu.cuModuleLoadData, cubin, device=ordinal)
        self.fn = driver.call(cu.cuModuleGetFunction, self.module, b"quant_proof", device=ordinal)

    def run(self, rule: str, mode: str) -> dict:
        counts = torch.zeros(5, dtype=torch.int64, device=self.device)
        first = torch.full((1,), -1, dtype=torch.int32, device=self.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        args = (
            (RULES[rule], MODES[mode], counts.data_ptr(), first.data_ptr()),
            (ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p),
        )
        driver.call(
            self.cu.cuLaunchKernel, self.fn, AMAX_PATTERNS, 1, 1, THREADS, 1, 1, 0, stream,
            args, 0, device=self.device.index, rule=rule, mode=mode,
        )  # fmt: skip
        torch.cuda.synchronize(self.device)
        pairs, bytes_, quots, not_pow2, visible = counts.tolist()
        bad = first.item() & 0xFFFFFFFF
        where = None
        if bytes_:
            where = {"amax_bf16": hex(bad >> 16), "x_bf16": hex(bad & 0xFFFF)}
        return {"pairs": pairs, "bytes": bytes_, "quotients": quots, "visible": visible,
                "not_pow2": not_pow2, "first": where}  # fmt: skip

    def close(self) -> None:
        driver.call(self.cu.cuModuleUnload, self.module, device=self.device.index)


@pytest.fixture(scope="module")
def proof():
    p = Proof(torch.device("cuda", 0))
    yield p
    p.close()


@pytest.mark.parametrize("a", [0, 1, 0x7F, 0x3C00, 0x43E0, 0x7F7F, 0x7F80])
def test_the_pair_count_is_every_bf16_within_amax_or_nan(a):
    """The kernel's test (bits ``m <= a`` or NaN) and the count it must reach, checked against
    torch's own bf16 comparison over all 65536 patterns (CPU)."""
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    amax = torch.tensor([a], dtype=torch.int16).view(torch.bfloat16).float()
    reachable = int(((every.abs() <= amax) | every.isnan()).sum())
    assert reachable == 2 * (a + 1) + 254


def test_the_proof_kernel_compiles_with_the_stores_headers():
    """CPU: NVRTC builds the proof for sm_90 with the stores' options (no GPU needed)."""
    _, headers = build.read_source("kv_store.cu")
    ptx = build._nvrtc_compile(
        "quant_proof.cu", SOURCE, headers, build.compile_options("sm_90", None), ptx=True
    ).decode()
    assert "quant_proof" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx


@requires_gpu
@pytest.mark.parametrize("rule", list(RULES))
def test_div_scale_is_ieee_division_for_every_reachable_pair(proof, rule):
    got = proof.run(rule, "div_scale")
    assert got["pairs"] == expected_pairs(), got
    assert got["bytes"] == 0, got
    assert got["visible"] == 0, got
    if RULES[rule] in POW2:  # one rounding of the exact quotient: the same float everywhere
        assert got["quotients"] == 0, got
        assert got["not_pow2"] == 0, got
    print(rule, got)  # the count of invisible last-bit differences, for the record


@requires_gpu
@pytest.mark.parametrize("rule", ["fp8_ds_mla", "indexer_k"])
def test_the_sweep_sees_an_uncorrected_product_and_a_lost_sign(proof, rule):
    plain = proof.run(rule, "plain_product")
    assert plain["pairs"] == expected_pairs(), plain
    assert plain["quotients"] > 0, plain  # x * r is off by an ulp for many pairs
    unsigned = proof.run(rule, "no_copysign")
    assert unsigned["bytes"] > 0, unsigned  # -0 -> +0: 0x00 instead of 0x80
    assert unsigned["first"] is not None, unsigned
