// The system-scope barrier body shared by the stand-alone barrier kernel (barrier.cu) and the
// store kernels that end with it (kv_store.cu, "one launch per layer"), so that both use the
// same epochs, signal slots, timeout and diagnostic and can be mixed on one lane.
//
// Every rank's signal region holds int32 [lanes][2][world]; sig_table[r] is rank r's region
// (peers' regions mapped into our address space). epochs[lane] lives in local device memory and
// advances on the device, so a captured CUDA graph replays without any host update.
// A lane must be used by one stream at a time (its epoch is read-modify-written by thread 0).
#pragma once
#include "vmmkv_common.cuh"

namespace vmmkv {

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

// The barrier a store kernel runs after its stores. Mirrored byte for byte by
// vmmkv/ops/launch.py (`BARRIER_ARGS`); 8-byte fields first.
struct BarrierArgs {
    const i64* sig_table;  // [world] signal-region base addresses (own and mapped peers)
    int* epochs;           // [lanes] local epochs, shared with the stand-alone barrier
    u32* arrivals;         // [lanes] CTAs of the running launch that finished their stores;
                           // zero between launches (the last CTA resets it)
    BarrierDiag* diag;     // host-mapped diagnostic record, or null
    i64 timeout_ns;        // wait for a peer at most this long, then report and trap
    int lane;
    int rank;
    int world;
    int reserved;
};
static_assert(sizeof(BarrierArgs) == 56, "BarrierArgs layout must match vmmkv/ops/launch.py");

VMMKV_FN void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

VMMKV_FN void st_release_sys(int* p, int v) {
    asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

VMMKV_FN int ld_acquire_sys(const int* p) {
    int v;
    asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

VMMKV_FN u64 globaltimer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

VMMKV_FN int* signal_slot(const i64* sig_table, int owner, int lane, int parity, int world,
                          int index) {
    int* base = reinterpret_cast<int*>(static_cast<u64>(sig_table[owner]));
    return base + ((i64)lane * 2 + parity) * world + index;
}

__device__ __noinline__ void report_timeout(BarrierDiag* diag, int lane, int rank, int peer,
                                            int epoch, int observed, int world, i64 timeout_ns) {
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

// The lane's epoch as thread 0 of a CTA reads it when its kernel starts, so that this load is
// off the barrier's critical path (its value is used only once the CTA's stores are done).
// Sound because nothing writes epochs[lane] between a launch's start and the barrier of that
// launch: only the CTA that runs the barrier writes it, after this read, and launches on one lane
// are stream-ordered.
VMMKV_FN int epoch_at_entry(const int* epochs, int lane) {
    return threadIdx.x == 0 ? epochs[lane] : 0;
}

// The barrier, run by every thread of one CTA (any multiple of 32 threads; threads loop over
// peers): advance the lane's epoch (`entry_epoch`, from epoch_at_entry, is thread 0's reading of
// it), signal every rank with a system-scope release, wait (acquire) until every rank signalled
// the same epoch. Stores this CTA's threads made, or that are ordered before them, are visible
// to every peer once all ranks passed.
VMMKV_FN void barrier_cta(const i64* sig_table, int* epochs, int entry_epoch, int lane, int rank,
                          int world, i64 timeout_ns, BarrierDiag* diag) {
    __shared__ int s_epoch;
    __shared__ int s_reported;
    if (threadIdx.x == 0) {
        const int e = (int)((u32)entry_epoch + 1u);  // wraps without UB; compared modulo 2^32
        epochs[lane] = e;
        s_epoch = e;
        s_reported = 0;
    }
    __syncthreads();
    const int e = s_epoch;
    const int parity = e & 1;

    // st.release.sys is a release pattern on its own (PTX: a fence.acq_rel.sys then the store),
    // cumulative over everything this CTA's threads and, through the kernel boundary or the
    // gpu-scope arrival below, earlier stores made visible to them.
    for (int t = threadIdx.x; t < world; t += blockDim.x) {
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

// The end of a store kernel that publishes: every CTA, once all its threads issued their
// stores, releases them (gpu scope) and counts itself in arrivals[lane]; the last CTA to
// arrive acquires every CTA's stores, resets the counter for the next launch and runs the
// barrier for the whole grid. A grid of one CTA is its own last arrival and skips the count
// (its threads' stores are ordered before the barrier by __syncthreads, as in any last CTA).
// `entry_epoch` comes from epoch_at_entry at the kernel's start. Every thread of every CTA must
// call this exactly once.
VMMKV_FN void arrive_then_barrier(const BarrierArgs& b, int entry_epoch) {
    __shared__ int s_last;
    __syncthreads();  // every thread of this CTA issued its stores
    const bool alone = gridDim.x == 1;
    if (!alone) {
        if (threadIdx.x == 0) {
            // gpu scope suffices: the last CTA runs on this GPU, and its system-scope signal
            // release below is cumulative over what it acquired here (measured: one sys fence
            // per CTA cost ~1 us of graph time per launch on 2x H200)
            fence_acq_rel_gpu();  // release: this CTA's stores before its arrival
            const u32 prev = atomicAdd(b.arrivals + b.lane, 1u);
            const int last = prev == gridDim.x - 1;
            if (last) {
                fence_acq_rel_gpu();     // acquire: every CTA's stores before the signals below
                b.arrivals[b.lane] = 0u;  // the next launch on this lane is stream-ordered after us
            }
            s_last = last;
        }
        __syncthreads();
    }
    if (alone || s_last)
        barrier_cta(b.sig_table, b.epochs, entry_epoch, b.lane, b.rank, b.world, b.timeout_ns,
                    b.diag);
}

}  // namespace vmmkv
