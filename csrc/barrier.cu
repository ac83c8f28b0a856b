// System-scope barrier among the ranks of a PCP group, one CTA per call.
//
// Every rank's signal region holds int32 [lanes][2][world]; sig_table[r] is rank r's region
// (peers' regions mapped into our address space). epochs[lane] lives in local device memory and
// advances on the device, so a captured CUDA graph replays without any host update.
// A lane must be used by one stream at a time (its epoch is read-modify-written by thread 0).
#include "vmmkv_common.cuh"

using namespace vmmkv;

namespace {

enum : int { kDiagMagic = 0x564d4d42 };  // "VMMB": the record below is complete

// Written to host-mapped memory before trapping; mirrored by vmmkv/ops/barrier.py.
struct BarrierDiag {
    int magic;
    int lane;
    int rank;
    int missing_peer;
    int epoch;
    int observed;
    int world;
    int reserved;
};

__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ __forceinline__ void st_release_sys(int* p, int v) {
    asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ int ld_acquire_sys(const int* p) {
    int v;
    asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ u64 globaltimer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ int* signal_slot(const i64* sig_table, int owner, int lane, int parity,
                                            int world, int index) {
    int* base = reinterpret_cast<int*>(static_cast<u64>(sig_table[owner]));
    return base + ((i64)lane * 2 + parity) * world + index;
}

__device__ void report_timeout(BarrierDiag* diag, int lane, int rank, int peer, int epoch,
                               int observed, int world, i64 timeout_ns) {
    if (diag != nullptr) {
        volatile int* d = reinterpret_cast<volatile int*>(diag);
        d[1] = lane;
        d[2] = rank;
        d[3] = peer;
        d[4] = epoch;
        d[5] = observed;
        d[6] = world;
        __threadfence_system();  // the fields are visible before the magic that vouches for them
        d[0] = kDiagMagic;
        __threadfence_system();
    }
    printf("vmmkv barrier timeout: lane=%d rank=%d missing peer=%d epoch=%d observed=%d "
           "world=%d timeout_ns=%lld\n",
           lane, rank, peer, epoch, observed, world, timeout_ns);
}

}  // namespace

// Launch: one CTA of a multiple of 32 threads (any count; threads loop over peers).
extern "C" __global__ void vmmkv_barrier(const i64* __restrict__ sig_table, int* __restrict__ epochs,
                                         int lane, int rank, int world, i64 timeout_ns,
                                         BarrierDiag* diag) {
    __shared__ int s_epoch;
    __shared__ int s_reported;
    if (threadIdx.x == 0) {
        const int e = (int)((u32)epochs[lane] + 1u);  // wraps without UB; compared modulo 2^32
        epochs[lane] = e;
        s_epoch = e;
        s_reported = 0;
    }
    __syncthreads();
    const int e = s_epoch;
    const int parity = e & 1;

    for (int t = threadIdx.x; t < world; t += blockDim.x) {
        fence_acq_rel_sys();  // this rank's earlier stores (previous kernels) before the signal
        st_release_sys(signal_slot(sig_table, t, lane, parity, world, rank), e);
    }
    for (int t = threadIdx.x; t < world; t += blockDim.x) {
        const int* own = signal_slot(sig_table, rank, lane, parity, world, t);
        const u64 start = globaltimer_ns();
        int v = ld_acquire_sys(own);
        while ((int)((u32)v - (u32)e) < 0) {
            if (globaltimer_ns() - start > (u64)timeout_ns) {
                if (atomicExch(&s_reported, 1) == 0)
                    report_timeout(diag, lane, rank, t, e, v, world, timeout_ns);
                __trap();
            }
            v = ld_acquire_sys(own);
        }
    }
    __syncthreads();
}

// Does nothing: the launch-overhead reference of the benchmarks (same launch path as the stores).
extern "C" __global__ void vmmkv_noop() {}
