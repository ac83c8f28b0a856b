// Fused KV stores: quantize each token once, write its bytes into every replica.
//
// One warp per token (grid-stride over tokens). Byte formats are docs/design.md's "KV byte formats";
// vmmkv/ops/reference.py is the pure-torch oracle the GPU tests compare against.
// Host-side contract (checked by vmmkv/ops/kv.py before launch): bf16 inputs with unit inner
// stride, 16-byte aligned rows for kv_c / k_pe and 8-byte aligned rows for k, 16-byte aligned
// ds_mla views and 4-byte aligned indexer views in every region.
// The `*_barrier` kernels store like their plain twins, then run the barrier of barrier.cuh in
// the same launch (the last CTA to finish, after every CTA released its stores).
// The stores exist once per scale rule of the kinds they write (see the end of the file):
// fp8_ds_mla's raw tile scales or fp8_ds_mla_ue8m0's powers of two (the `_ue8m0` entry points),
// indexer_k's fp32 scale word or indexer_k_mxfp8's four UE8M0 bytes (the `_mxfp8` ones).
#include "barrier.cuh"
#include "vmmkv_common.cuh"

using namespace vmmkv;

namespace {

enum : unsigned { kFullMask = 0xffffffffu };

__device__ __forceinline__ float warp_max(float v, int width) {
    // fmaxf ignores NaN operands, so NaN inputs never poison a scale (matches vLLM's reduction)
    for (int m = width / 2; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, m));
    return v;
}

__device__ __forceinline__ float abs_max8(uint4 v) {
    float m = 0.0f;
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) m = fmaxf(m, fmaxf(fabsf(bf16_lo(w[j])), fabsf(bf16_hi(w[j]))));
    return m;
}

// Four bf16 (two bf16 pairs) divided by the scale of `d` -> four e4m3 bytes, element 0 lowest,
// by the fast division (kFast, only where fast_division(d)) or IEEE `/`.
template <bool kPow2, bool kFast>
__device__ __forceinline__ u32 quantize_bf16x4(u32 p0, u32 p1, const InvScale& d) {
    const float a = bf16_lo(p0), b = bf16_hi(p0), c = bf16_lo(p1), e = bf16_hi(p1);
    return kFast ? quantize4_fast<kPow2>(a, b, c, e, d) : quantize4_ieee(a, b, c, e, d);
}

template <bool kPow2, bool kFast>
__device__ __forceinline__ uint4 quantize16_path(uint4 v0, uint4 v1, const InvScale& d) {
    return make_uint4(quantize_bf16x4<kPow2, kFast>(v0.x, v0.y, d),
                      quantize_bf16x4<kPow2, kFast>(v0.z, v0.w, d),
                      quantize_bf16x4<kPow2, kFast>(v1.x, v1.y, d),
                      quantize_bf16x4<kPow2, kFast>(v1.z, v1.w, d));
}

// Sixteen bf16 of one tile (two uint4) -> sixteen e4m3 bytes (one uint4): quantize4's choice
// made once for the sixteen instead of once per four (three branches and their reconvergence
// fewer per token, measured with ncu: docs/benchmarks-history.md).
template <bool kPow2>
__device__ __forceinline__ uint4 quantize16(uint4 v0, uint4 v1, const InvScale& d) {
    if (fast_division<kPow2>(d)) return quantize16_path<kPow2, true>(v0, v1, d);
    return quantize16_path<kPow2, false>(v0, v1, d);
}

// fp8_ds_mla: lane l owns kv_c elements [16 l, 16 l + 16) -> entry bytes [16 l, 16 l + 16);
// lanes 8t..8t+7 form tile t. The entry's last 144 bytes (four fp32 scales, then k_pe) are its
// chunks 32..40 of 16 bytes, held by lanes 0..8: lane 0 the scales, lane 1 + j the k_pe chunk j.
// kPow2 (fp8_ds_mla_ue8m0, a compile-time variant): the tile scale is rounded up to a power of
// two (mla_tile_scale), still stored as an fp32; the values are divided by it through
// quantize16 (quantize4's bytes of IEEE division, at the cost of a multiply or three FMA-class
// ops).
// Every token function loads its inputs before it looks at the slot (rows i < num_tokens always
// exist), so the input and slot loads are in flight together.

// One entry, split at the absolute 128-byte lines: `a` = chunks of the entry's first line that
// precede it. The first store covers chunks [0, 32 - a) (lane l: value chunk l), whole lines
// after the first; the second the rest, [32 - a, 41): at most 16 chunks, one full line and the
// entry's last partial one. So the entry goes out as the 6 line pieces it spans (NVLink sends
// one packet per line a warp store touches, docs/design.md; a 512 + 144 byte split sends 7
// whenever a != 0). Lanes 0..8 are always in the first part (32 - a >= 25), so in the second
// store lane l writes chunk `c2` = 32 + l (l <= 8: `w` is its tail chunk) or l (l >= 32 - a: `w`
// is its value chunk): `w` and `c2` are the token's (mla_token), only the predicates depend on
// the destination's address.
__device__ __forceinline__ void mla_store_entry(uint4* entry, uint4 q, uint4 w, int c2, int lane) {
    const int a = (int)((reinterpret_cast<u64>(entry) >> 4) & 7u);
    if (lane < 32 - a) entry[lane] = q;
    if (lane <= 8 || lane >= 32 - a) entry[c2] = w;
}

template <bool kPow2>
__device__ __forceinline__ void mla_token(const KVDest& dst, i64 committed,
                                          const u16* __restrict__ kv_c, i64 kv_c_stride,
                                          const u16* __restrict__ k_pe, i64 k_pe_stride, i64 i,
                                          i64 slot, i64 num_local_only, int lane) {
    const uint4* src = reinterpret_cast<const uint4*>(kv_c + i * kv_c_stride) + 2 * lane;
    const uint4 v0 = src[0];
    const uint4 v1 = src[1];
    uint4 tail = make_uint4(0u, 0u, 0u, 0u);
    if (lane >= 1 && lane <= 8)
        tail = reinterpret_cast<const uint4*>(k_pe + i * k_pe_stride)[lane - 1];

    int o = 0;
    const i64 block_off = dest_block_offset(dst, committed, slot, lane == 0, &o);
    if (block_off < 0) return;  // warp-uniform: every lane saw the same slot

    const float amax = warp_max(fmaxf(abs_max8(v0), abs_max8(v1)), 8);
    const float s = mla_tile_scale<kPow2>(amax);
    const InvScale d = inv_scale(s);
    const uint4 q = quantize16<kPow2>(v0, v1, d);

    const float s0 = __shfl_sync(kFullMask, s, 0);
    const float s1 = __shfl_sync(kFullMask, s, 8);
    const float s2 = __shfl_sync(kFullMask, s, 16);
    const float s3 = __shfl_sync(kFullMask, s, 24);
    if (lane == 0) tail = make_uint4(f32_bits(s0), f32_bits(s1), f32_bits(s2), f32_bits(s3));
    static_assert(kMlaScaleOffset == 32 * 16 && kMlaRopeOffset == kMlaScaleOffset + 16 &&
                      kMlaEntryBytes == kMlaRopeOffset + 128,
                  "the scales and k_pe must be the entry's chunks 32..40 of 16 bytes");

    const uint4 w = lane <= 8 ? tail : q;
    const int c2 = lane <= 8 ? kMlaScaleOffset / 16 + lane : lane;
    int first, end;
    dest_range(dst, i, num_local_only, &first, &end);
    for (int r = first; r < end; ++r)
        mla_store_entry(reinterpret_cast<uint4*>(region_base(dst, r) + block_off +
                                                 (i64)o * dst.entry_stride),
                        q, w, c2, lane);
}

// indexer_k: lane l owns k elements [4 l, 4 l + 4); one scale for the whole 128-wide row.
// Block layout: fp8 values of token o at o*128, its 4-byte scale at block_size*128 + 4*o.
// kMx (indexer_k_mxfp8, a compile-time variant): the scale is always rounded to a power of two
// and stored as four equal UE8M0 bytes instead of an fp32.
// `v` is the lane's 4 values of row i, loaded by the caller (indexer_row) ahead of its stores.
__device__ __forceinline__ uint2 indexer_row(const u16* __restrict__ k, i64 k_stride, i64 i,
                                             int lane) {
    return reinterpret_cast<const uint2*>(k + i * k_stride)[lane];
}

template <bool kMx>
__device__ __forceinline__ void indexer_token(const KVDest& dst, i64 committed, uint2 v, i64 i,
                                              i64 slot, i64 num_local_only, int ue8m0, int lane) {
    int o = 0;
    const i64 block_off = dest_block_offset(dst, committed, slot, lane == 0, &o);
    if (block_off < 0) return;

    const float x0 = bf16_lo(v.x), x1 = bf16_hi(v.x), x2 = bf16_lo(v.y), x3 = bf16_hi(v.y);
    float amax = fmaxf(fmaxf(fabsf(x0), fabsf(x1)), fmaxf(fabsf(x2), fabsf(x3)));
    amax = warp_max(amax, 32);
    const bool pow2 = kMx || ue8m0;  // warp-uniform
    const float s = indexer_scale(amax, pow2);
    const InvScale d = inv_scale(s);
    const u32 q = pow2 ? quantize4<true>(x0, x1, x2, x3, d) : quantize4<false>(x0, x1, x2, x3, d);
    const u32 scale_word = kMx ? ue8m0_x4(s) : f32_bits(s);

    int first, end;
    dest_range(dst, i, num_local_only, &first, &end);
    const i64 value_off = (i64)o * kIndexerDim + 4 * lane;
    const i64 scale_off = (i64)dst.block_size * kIndexerDim + 4 * (i64)o;
    for (int r = first; r < end; ++r) {
        u8* block = region_base(dst, r) + block_off;
        *reinterpret_cast<u32*>(block + value_off) = q;
        if (lane == 0) *reinterpret_cast<u32*>(block + scale_off) = scale_word;
    }
}

// rows: the warp copies row i (row_bytes) to the token's entry in every destination.
__device__ __forceinline__ void rows_token(const KVDest& dst, i64 committed,
                                           const u8* __restrict__ rows, i64 row_stride,
                                           i64 row_bytes, i64 i, i64 slot, i64 num_local_only,
                                           int vec16, int lane) {
    int o = 0;
    const i64 block_off = dest_block_offset(dst, committed, slot, lane == 0, &o);
    if (block_off < 0) return;
    int first, end;
    dest_range(dst, i, num_local_only, &first, &end);
    const u8* src = rows + i * row_stride;
    const i64 entry_off = block_off + (i64)o * dst.entry_stride;
    if (vec16) {
        for (i64 c = lane; c < row_bytes / 16; c += 32) {
            const uint4 v = reinterpret_cast<const uint4*>(src)[c];
            for (int r = first; r < end; ++r)
                reinterpret_cast<uint4*>(region_base(dst, r) + entry_off)[c] = v;
        }
    } else {
        for (i64 c = lane; c < row_bytes; c += 32) {
            const u8 v = src[c];
            for (int r = first; r < end; ++r) (region_base(dst, r) + entry_off)[c] = v;
        }
    }
}

struct TokenLoop {
    i64 first, step;
    int lane;
    __device__ TokenLoop() {
        const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
        first = tid >> 5;
        step = ((i64)gridDim.x * blockDim.x) >> 5;
        lane = threadIdx.x & 31;
    }
};

// The token loop of each store, shared by its plain kernel and its `*_barrier` twin.
template <bool kPow2>
__device__ __forceinline__ void ds_mla_tokens(const KVDest& dst, const u16* kv_c, i64 kv_c_stride,
                                              const u16* k_pe, i64 k_pe_stride, const void* slots,
                                              int slots_is_64, i64 num_tokens,
                                              i64 num_local_only) {
    const TokenLoop t;
    const i64 committed = committed_now(dst);
    for (i64 i = t.first; i < num_tokens; i += t.step) {
        const i64 slot = load_slot(slots, slots_is_64, i);
        mla_token<kPow2>(dst, committed, kv_c, kv_c_stride, k_pe, k_pe_stride, i, slot,
                         num_local_only, t.lane);
    }
}

template <bool kMx>
__device__ __forceinline__ void indexer_k_tokens(const KVDest& dst, const u16* k, i64 k_stride,
                                                 const void* slots, int slots_is_64,
                                                 i64 num_tokens, i64 num_local_only, int ue8m0) {
    const TokenLoop t;
    const i64 committed = committed_now(dst);
    for (i64 i = t.first; i < num_tokens; i += t.step) {
        const i64 slot = load_slot(slots, slots_is_64, i);
        const uint2 v = indexer_row(k, k_stride, i, t.lane);
        indexer_token<kMx>(dst, committed, v, i, slot, num_local_only, ue8m0, t.lane);
    }
}

// Both stores of one attention layer: same tokens, same slot mapping.
template <bool kPow2, bool kMx>
__device__ __forceinline__ void layer_tokens(const KVDest& mla, const KVDest& idx, const u16* kv_c,
                                             i64 kv_c_stride, const u16* k_pe, i64 k_pe_stride,
                                             const u16* k, i64 k_stride, const void* slots,
                                             int slots_is_64, i64 num_tokens, i64 num_local_only,
                                             int ue8m0) {
    const TokenLoop t;
    const i64 mla_committed = committed_now(mla);
    const i64 idx_committed = committed_now(idx);
    for (i64 i = t.first; i < num_tokens; i += t.step) {
        const i64 slot = load_slot(slots, slots_is_64, i);
        const uint2 v = indexer_row(k, k_stride, i, t.lane);  // before the ds_mla stores
        mla_token<kPow2>(mla, mla_committed, kv_c, kv_c_stride, k_pe, k_pe_stride, i, slot,
                         num_local_only, t.lane);
        indexer_token<kMx>(idx, idx_committed, v, i, slot, num_local_only, ue8m0, t.lane);
    }
}

__device__ __forceinline__ void rows_tokens(const KVDest& dst, const u8* rows, i64 row_stride,
                                            i64 row_bytes, const void* slots, int slots_is_64,
                                            i64 num_tokens, i64 num_local_only, int vec16) {
    const TokenLoop t;
    const i64 committed = committed_now(dst);
    for (i64 i = t.first; i < num_tokens; i += t.step) {
        const i64 slot = load_slot(slots, slots_is_64, i);
        rows_token(dst, committed, rows, row_stride, row_bytes, i, slot, num_local_only, vec16,
                   t.lane);
    }
}

}  // namespace

// Already formatted rows -> entry at block_base + o*entry_stride. `vec16` (decided on the host)
// says rows, row stride, row bytes and every destination address are 16-byte aligned.
extern "C" __global__ void __launch_bounds__(256)
vmmkv_publish_rows(KVDest dst, const u8* __restrict__ rows, i64 row_stride, i64 row_bytes,
                   const void* __restrict__ slots, int slots_is_64, i64 num_tokens,
                   i64 num_local_only, int vec16) {
    rows_tokens(dst, rows, row_stride, row_bytes, slots, slots_is_64, num_tokens, num_local_only,
                vec16);
}

// The `*_barrier` kernels are held to 64 registers (__launch_bounds__(256, 4)), so 4 CTAs of 256
// threads stay resident per SM, as for their plain twins (ops/launch.py's resident_grid sizes the
// grid from it). Unbounded, the fused layer store took 68 registers with quantize16 (3 CTAs per
// SM; the one-rank publish +7 %, docs/benchmarks-history.md); bounded it fits in 64 without a
// spill. The plain stores stay unbounded: held to 64, ptxas gave store_layer 62 registers
// instead of 52 and it got no faster.
#define VMMKV_FUSED_BOUNDS __launch_bounds__(256, 4)

// The `*_barrier` kernels here and below: the store, then the barrier (barrier.cuh, same epochs
// and lanes as vmmkv_barrier) in one launch. Any grid size >= 1, 256 threads; a launch with
// num_tokens == 0 still runs the barrier.
extern "C" __global__ void VMMKV_FUSED_BOUNDS
vmmkv_publish_rows_barrier(KVDest dst, const u8* __restrict__ rows, i64 row_stride,
                           i64 row_bytes, const void* __restrict__ slots, int slots_is_64,
                           i64 num_tokens, i64 num_local_only, int vec16, BarrierArgs bar) {
    const int entry_epoch = epoch_at_entry(bar.epochs, bar.lane);
    const int busy_found = lane_enter(bar);
    VMMKV_TEST_LAG(bar);
    rows_tokens(dst, rows, row_stride, row_bytes, slots, slots_is_64, num_tokens, num_local_only,
                vec16);
    arrive_then_barrier(bar, entry_epoch, busy_found);
}

// ---------------------------------------------------------------------------------------------
// The stores that quantize, plain and fused with the barrier, once per scale rule. The variant
// is a template argument, so the token loop has no extra branch; the variants of one store take
// the same parameters. Entry point = store name + the suffix of each kind it writes:
//   fp8_ds_mla: ""    fp8_ds_mla_ue8m0: "_ue8m0"    indexer_k: ""    indexer_k_mxfp8: "_mxfp8"
// e.g. vmmkv_store_layer_ue8m0_mxfp8 writes an fp8_ds_mla_ue8m0 and an indexer_k_mxfp8 view.
#define VMMKV_DS_MLA_STORES(SUFFIX, POW2)                                                        \
    extern "C" __global__ void __launch_bounds__(256) vmmkv_store_ds_mla##SUFFIX(                \
        KVDest dst, const u16* __restrict__ kv_c, i64 kv_c_stride, const u16* __restrict__ k_pe, \
        i64 k_pe_stride, const void* __restrict__ slots, int slots_is_64, i64 num_tokens,        \
        i64 num_local_only) {                                                                    \
        ds_mla_tokens<POW2>(dst, kv_c, kv_c_stride, k_pe, k_pe_stride, slots, slots_is_64,       \
                            num_tokens, num_local_only);                                         \
    }                                                                                            \
    extern "C" __global__ void VMMKV_FUSED_BOUNDS vmmkv_store_ds_mla##SUFFIX##_barrier(          \
        KVDest dst, const u16* __restrict__ kv_c, i64 kv_c_stride, const u16* __restrict__ k_pe, \
        i64 k_pe_stride, const void* __restrict__ slots, int slots_is_64, i64 num_tokens,        \
        i64 num_local_only, BarrierArgs bar) {                                                   \
        const int entry_epoch = epoch_at_entry(bar.epochs, bar.lane);                            \
        const int busy_found = lane_enter(bar);                                                  \
        VMMKV_TEST_LAG(bar);                                                                     \
        ds_mla_tokens<POW2>(dst, kv_c, kv_c_stride, k_pe, k_pe_stride, slots, slots_is_64,       \
                            num_tokens, num_local_only);                                         \
        arrive_then_barrier(bar, entry_epoch, busy_found);                                       \
    }

#define VMMKV_INDEXER_STORES(SUFFIX, MX)                                                         \
    extern "C" __global__ void __launch_bounds__(256) vmmkv_store_indexer_k##SUFFIX(             \
        KVDest dst, const u16* __restrict__ k, i64 k_stride, const void* __restrict__ slots,     \
        int slots_is_64, i64 num_tokens, i64 num_local_only, int ue8m0) {                        \
        indexer_k_tokens<MX>(dst, k, k_stride, slots, slots_is_64, num_tokens, num_local_only,   \
                             ue8m0);                                                             \
    }                                                                                            \
    extern "C" __global__ void VMMKV_FUSED_BOUNDS vmmkv_store_indexer_k##SUFFIX##_barrier(       \
        KVDest dst, const u16* __restrict__ k, i64 k_stride, const void* __restrict__ slots,     \
        int slots_is_64, i64 num_tokens, i64 num_local_only, int ue8m0, BarrierArgs bar) {       \
        const int entry_epoch = epoch_at_entry(bar.epochs, bar.lane);                            \
        const int busy_found = lane_enter(bar);                                                  \
        VMMKV_TEST_LAG(bar);                                                                     \
        indexer_k_tokens<MX>(dst, k, k_stride, slots, slots_is_64, num_tokens, num_local_only,   \
                             ue8m0);                                                             \
        arrive_then_barrier(bar, entry_epoch, busy_found);                                       \
    }

// Both stores of one attention layer in one launch.
#define VMMKV_LAYER_STORES(SUFFIX, POW2, MX)                                                     \
    extern "C" __global__ void __launch_bounds__(256) vmmkv_store_layer##SUFFIX(                 \
        KVDest mla, KVDest idx, const u16* __restrict__ kv_c, i64 kv_c_stride,                   \
        const u16* __restrict__ k_pe, i64 k_pe_stride, const u16* __restrict__ k, i64 k_stride,  \
        const void* __restrict__ slots, int slots_is_64, i64 num_tokens, i64 num_local_only,     \
        int ue8m0) {                                                                             \
        layer_tokens<POW2, MX>(mla, idx, kv_c, kv_c_stride, k_pe, k_pe_stride, k, k_stride,      \
                               slots, slots_is_64, num_tokens, num_local_only, ue8m0);           \
    }                                                                                            \
    extern "C" __global__ void VMMKV_FUSED_BOUNDS vmmkv_store_layer##SUFFIX##_barrier(           \
        KVDest mla, KVDest idx, const u16* __restrict__ kv_c, i64 kv_c_stride,                   \
        const u16* __restrict__ k_pe, i64 k_pe_stride, const u16* __restrict__ k, i64 k_stride,  \
        const void* __restrict__ slots, int slots_is_64, i64 num_tokens, i64 num_local_only,     \
        int ue8m0, BarrierArgs bar) {                                                            \
        const int entry_epoch = epoch_at_entry(bar.epochs, bar.lane);                            \
        const int busy_found = lane_enter(bar);                                                  \
        VMMKV_TEST_LAG(bar);                                                                     \
        layer_tokens<POW2, MX>(mla, idx, kv_c, kv_c_stride, k_pe, k_pe_stride, k, k_stride,      \
                               slots, slots_is_64, num_tokens, num_local_only, ue8m0);           \
        arrive_then_barrier(bar, entry_epoch, busy_found);                                       \
    }

VMMKV_DS_MLA_STORES(, false)
VMMKV_DS_MLA_STORES(_ue8m0, true)
VMMKV_INDEXER_STORES(, false)
VMMKV_INDEXER_STORES(_mxfp8, true)
VMMKV_LAYER_STORES(, false, false)
VMMKV_LAYER_STORES(_mxfp8, false, true)
VMMKV_LAYER_STORES(_ue8m0, true, false)
VMMKV_LAYER_STORES(_ue8m0_mxfp8, true, true)
