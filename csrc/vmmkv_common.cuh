// Shared device code of the vmmkv kernels: the destination description, slot checks, exact
// bf16 -> f32 and f32 -> fp8 e4m3 conversions.
//
// Compiled by NVRTC (vmmkv/ops/build.py) with -std=c++17 -default-device and no fast-math, so
// `/` is IEEE division, denormals are kept and math functions are the accurate ones.
// No standard header is needed; <cuda_fp8.h> is used when build.py found the CUDA headers
// (it defines VMMKV_HAVE_CUDA_FP8_H), otherwise an equivalent conversion below is used.
#pragma once

// VMMKV_CVT marks the pure conversions: VMMKV_HOST_TEST makes them callable from host code too,
// so tests/test_nvrtc.py can check them exhaustively on a CPU (nvcc, host side).
#if defined(VMMKV_HOST_TEST)
#define VMMKV_CVT __host__ __device__ inline
#else
#define VMMKV_CVT __device__ __forceinline__
#endif
#define VMMKV_FN __device__ __forceinline__

#if defined(VMMKV_HAVE_CUDA_FP8_H)
#include <cuda_fp8.h>
#endif

namespace vmmkv {

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

// `inline` (external linkage) keeps NVRTC from naming them with a per-compilation hash, so
// the cubin bytes are deterministic.
inline constexpr float kFltMin = 0x1p-126f;       // FLT_MIN
inline constexpr float kFp8Max = 448.0f;          // largest finite e4m3 value
inline constexpr float kIndexerAmaxFloor = 1e-4f; // same float as vLLM's fmaxf(amax, 1e-4)
inline constexpr float kMlaUe8m0Floor = 1e-4f;    // fp8_ds_mla_ue8m0: fmaxf(amax / 448, 1e-4f)
inline constexpr int kMlaEntryBytes = 656;        // 512 fp8 + 4 fp32 scales + 64 bf16
inline constexpr int kMlaScaleOffset = 512;
inline constexpr int kMlaRopeOffset = 528;
inline constexpr int kIndexerDim = 128;
inline constexpr int kIndexerEntryBytes = 132;    // 128 fp8 + one fp32 scale, split in the block

// Where a layer view lives in every replica. Mirrored byte for byte by vmmkv/ops/launch.py
// (`KVDEST`); 8-byte fields first so that host and device layouts agree without padding.
struct KVDest {
    const i64* ptr_table;        // [num_dest] region base addresses (own and mapped peers)
    const i64* committed_bytes;  // device int64: committed bytes of each region (grows later)
    int* error_counter;          // device int32: tokens skipped because out of range
    i64 offset_bytes;            // the view's offset inside each region
    i64 block_stride;            // bytes between consecutive blocks of the view
    i64 entry_stride;            // bytes between tokens inside a block (ds_mla, rows)
    i64 block_extent;            // bytes of a block this kind can touch
    i64 num_blocks;              // blocks of the view
    int block_size;              // tokens per block
    int num_dest;                // entries of ptr_table
    int my_rank;                 // own entry of ptr_table
    int reserved;
};
static_assert(sizeof(KVDest) == 80, "KVDest layout must match vmmkv/ops/launch.py");

VMMKV_CVT u32 f32_bits(float x) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(x);
#else
    u32 u;
    __builtin_memcpy(&u, &x, 4);
    return u;
#endif
}

VMMKV_CVT float f32_from_bits(u32 u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float x;
    __builtin_memcpy(&x, &u, 4);
    return x;
#endif
}

// bf16 is the upper half of an f32: the widening is exact.
VMMKV_CVT float bf16_lo(u32 pair) { return f32_from_bits(pair << 16); }
VMMKV_CVT float bf16_hi(u32 pair) { return f32_from_bits(pair & 0xffff0000u); }

// f32 -> e4m3 (OCP fp8 e4m3fn), round to nearest even, saturating to +-448, NaN -> 0x7f.
// Bit-exact to cuda_fp8.hpp's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) software
// path (checked on every float of the fp8 range in tests/test_nvrtc.py).
VMMKV_CVT u32 e4m3_satfinite_soft(float x) {
    const u32 bits = f32_bits(x);
    const u32 a = bits & 0x7fffffffu;
    const u32 sign = (bits >> 24) & 0x80u;
    if (a > 0x7f800000u) return 0x7fu;              // NaN: canonical, sign dropped
    if (a >= 0x43e00000u) return sign | 0x7eu;      // |x| >= 448 (inf too): (448, 464] rounds to 448 anyway
    if (a < 0x3c800000u) {                          // |x| < 2^-6: subnormal grid of 2^-9
        const float m = rintf(f32_from_bits(a) * 512.0f);  // exact scaling, then RNE to 0..8
        return sign | (u32)m;                       // 8 is 0x08, the smallest normal
    }
    const u32 exponent = (a >> 23) - 120u;          // rebias 127 -> 7
    const u32 mantissa = (a >> 20) & 7u;
    const u32 rest = a & 0xfffffu;
    u32 q = (exponent << 3) | mantissa;
    if (rest > 0x80000u || (rest == 0x80000u && (mantissa & 1u))) q += 1u;  // carry may bump the exponent
    return sign | q;
}

// A power-of-two scale as four equal UE8M0 bytes (the indexer_k_mxfp8 scale): its biased
// exponent byte, bits 30..23, in every byte of the word (1.0 -> 0x7f7f7f7f, inf -> 0xffffffff).
VMMKV_CVT u32 ue8m0_x4(float s) { return ((f32_bits(s) >> 23) & 0xffu) * 0x01010101u; }

// Two values -> two e4m3 bytes: `lo` in bits 0..7, `hi` in bits 8..15. On sm_89+ one packed
// instruction converts the pair (cuda_fp8.hpp's per-value __nv_cvt_float_to_fp8 issues the same
// instruction once per value, with a zero partner); elsewhere cuda_fp8.h, else the software path.
VMMKV_CVT u32 e4m3x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    // first source -> upper byte
    u16 pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
    return (u32)pair;
#elif defined(VMMKV_HAVE_CUDA_FP8_H) && !defined(VMMKV_HOST_TEST)
    return (u32)__nv_cvt_float_to_fp8(lo, __NV_SATFINITE, __NV_E4M3) |
           ((u32)__nv_cvt_float_to_fp8(hi, __NV_SATFINITE, __NV_E4M3) << 8);
#else
    return e4m3_satfinite_soft(lo) | (e4m3_satfinite_soft(hi) << 8);
#endif
}

// Four values (each already divided by its scale) -> four e4m3 bytes, element 0 lowest.
VMMKV_CVT u32 e4m3x4(float a, float b, float c, float d) {
    return e4m3x2(a, b) | (e4m3x2(c, d) << 16);
}

// ---------------------------------------------------------------------------------------------
// Scales and the division by them. The formulas are vLLM 0.33's (docs/design.md, "KV byte
// formats"); every scale is a function of a tile's amax, itself a bf16 magnitude, so the proof
// in tests/test_quant_exact_gpu.py runs every reachable (amax, value) pair through these very
// functions and compares the bytes with IEEE division's.

// fp8_ds_mla: fmaxf(amax / 448, FLT_MIN); fp8_ds_mla_ue8m0 (kPow2): that rounded up to a power
// of two with vLLM's floor, exp2f(ceilf(log2f(fmaxf(amax / 448, 1e-4f)))).
template <bool kPow2>
VMMKV_FN float mla_tile_scale(float amax) {
    return kPow2 ? exp2f(ceilf(log2f(fmaxf(amax / kFp8Max, kMlaUe8m0Floor))))
                 : fmaxf(amax / kFp8Max, kFltMin);
}

// indexer_k: fmaxf(amax, 1e-4) / 448, rounded up to a power of two for ue8m0 / indexer_k_mxfp8.
VMMKV_FN float indexer_scale(float amax, bool pow2) {
    const float s = fmaxf(amax, kIndexerAmaxFloor) / kFp8Max;
    return pow2 ? exp2f(ceilf(log2f(s))) : s;
}

// A tile's scale and its correctly rounded reciprocal, computed once per tile (per lane) so
// that each value costs a multiply and two FMAs instead of an IEEE division.
struct InvScale {
    float s;     // the scale
    float r;     // __frcp_rn(s)
    bool fast;   // the corrected product equals x / s for every value of the tile (see div_scale)
};

// `fast` holds for 2^-90 <= s < 2^126. Below, a value small enough to make the correction's
// residual x - s * q underflow (|x| < ~2^-103) can still have a quotient e4m3 resolves, and the
// product would round it differently (measured: fp8_ds_mla tiles of amax < ~2^-81, whose scale
// sits near its FLT_MIN floor); above, 1/s is subnormal; an infinite amax gives s = inf. Those
// tiles take the IEEE `/`, element by element.
VMMKV_FN InvScale inv_scale(float s) {
    return InvScale{s, __frcp_rn(s), s >= 0x1p-90f && s < 0x1p126f};
}

// Where div_scale_fast gives x / s: every power-of-two scale, else scales inside the guard.
template <bool kPow2>
VMMKV_FN bool fast_division(const InvScale& d) {
    return kPow2 || d.fast;
}

// x / s at issue rate, for the e4m3 conversion that follows, where fast_division(d). kPow2 (s
// a power of two, checked for every scale the pow2 formulas produce): r = 1/s is exact, so
// x * r is the exact quotient rounded once, as x / s is: the same float. Otherwise: q = x * r,
// then one Markstein correction q + r * (x - s * q) (the compiler's own fast path of `/`),
// copysign restoring the sign of a zero quotient (x = -0 gives +0 from the FMAs).
template <bool kPow2>
VMMKV_FN float div_scale_fast(float x, const InvScale& d) {
    if (kPow2) return x * d.r;
    const float q = x * d.r;
    return copysignf(fmaf(fmaf(-d.s, q, x), d.r, q), x);
}

// One value: div_scale_fast where it applies, else IEEE `/` (what quantize4 does per tile).
// Over every (amax, x) pair a tile can hold (|x| <= amax or x NaN; NaN never wins the amax) the
// e4m3 bytes equal those of x / s, and the float equals x / s wherever either has a magnitude
// >= 2^-11 (below, where e4m3 gives +-0 either way, the residual may underflow and the last bit
// differ): tests/test_quant_exact_gpu.py checks all of them on the GPU.
template <bool kPow2>
VMMKV_FN float div_scale(float x, const InvScale& d) {
    return fast_division<kPow2>(d) ? div_scale_fast<kPow2>(x, d) : x / d.s;
}

// Four values of one tile divided by its scale -> four e4m3 bytes, element 0 lowest: the fast
// division (only where fast_division(d)) and IEEE `/`.
template <bool kPow2>
VMMKV_FN u32 quantize4_fast(float a, float b, float c, float e, const InvScale& d) {
    return e4m3x4(div_scale_fast<kPow2>(a, d), div_scale_fast<kPow2>(b, d),
                  div_scale_fast<kPow2>(c, d), div_scale_fast<kPow2>(e, d));
}

VMMKV_FN u32 quantize4_ieee(float a, float b, float c, float e, const InvScale& d) {
    return e4m3x4(a / d.s, b / d.s, c / d.s, e / d.s);
}

// The two, chosen once for the four (the choice is the tile's), so the fast path is
// straight-line code: no per-value branch or reconvergence. Callers holding more values of one
// tile make the same choice once for all of them (kv_store.cu's quantize16).
template <bool kPow2>
VMMKV_FN u32 quantize4(float a, float b, float c, float e, const InvScale& d) {
    return fast_division<kPow2>(d) ? quantize4_fast<kPow2>(a, b, c, e, d)
                                   : quantize4_ieee(a, b, c, e, d);
}

VMMKV_FN i64 load_slot(const void* slots, int slots_is_64, i64 i) {
    return slots_is_64 ? static_cast<const i64*>(slots)[i] : (i64) static_cast<const int*>(slots)[i];
}

// The committed bytes of the regions, read once per launch and warp (before its token loop,
// off the per-token dependency chain): a graph captured before a grow sees the grown value.
// A plain load that can race the host's copy_ of a new bound during a resize (a copy-engine
// write PTX does not model; the review's F6). Benign by the resize protocol's order: grow raises
// the bound only after every rank mapped the new chunks, shrink lowers it and drains the device
// before anything is unmapped, an aligned 8-byte value is not torn, and launches (or replays)
// after the resize returned see the new value. So a kernel already running may use the old or
// the new bound, both safe; one consequence: a store into blocks a grow is opening, in flight
// while it runs, may be skipped and counted as out of range.
VMMKV_FN i64 committed_now(const KVDest& d) { return *d.committed_bytes; }

// Byte offset of the token's block inside every region, or -1 when the token writes nothing:
// padding (slot < 0) silently, out-of-range or uncommitted blocks (`committed`, from
// committed_now) counted once by `counter_lane`.
// A power-of-two block size (what engines use: vLLM's 64 for these kinds) divides by a shift;
// any other takes the 64-bit division (a software routine of tens of instructions, twice per
// token in a layer store: 7 % of the store's instructions, measured with ncu on one H200 at
// T = 65536). Both give floor(slot / block_size) for slot >= 0.
VMMKV_FN i64 dest_block_offset(const KVDest& d, i64 committed, i64 slot, bool counter_lane,
                               int* offset_in_block) {
    if (slot < 0) return -1;
    const int bs = d.block_size;  // >= 1 (KVTarget)
    const i64 block = (bs & (bs - 1)) == 0 ? slot >> (__ffs(bs) - 1) : slot / bs;
    // The range check comes before the product: for block < num_blocks, KVTarget guarantees
    // offset_bytes + (num_blocks - 1) * block_stride + block_extent < 2^62, so neither
    // block * block_stride nor off + block_extent can overflow; for a larger block it could.
    if (block >= d.num_blocks) {
        if (counter_lane) atomicAdd(d.error_counter, 1);
        return -1;
    }
    const i64 off = d.offset_bytes + block * d.block_stride;
    if (off + d.block_extent > committed) {
        if (counter_lane) atomicAdd(d.error_counter, 1);
        return -1;
    }
    *offset_in_block = (int)(slot - block * bs);
    return off;
}

// Destinations of token i: the own replica only for the leading `num_local_only` tokens.
VMMKV_FN void dest_range(const KVDest& d, i64 i, i64 num_local_only, int* first, int* end) {
    if (i < num_local_only) {
        *first = d.my_rank;
        *end = d.my_rank + 1;
    } else {
        *first = 0;
        *end = d.num_dest;
    }
}

VMMKV_FN u8* region_base(const KVDest& d, int r) {
    return reinterpret_cast<u8*>(static_cast<u64>(d.ptr_table[r]));
}

}  // namespace vmmkv
