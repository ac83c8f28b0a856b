// The system-scope barrier body shared by the stand-alone barrier kernel (barrier.cu) and the
// store kernels that end with it (kv_store.cu, "one launch per layer"), so that both use the
// same epochs, signal slots, liveness control and diagnostics and can be mixed on one lane.
//
// Every rank's signal region holds int32 [lanes][2][world]; sig_table[r] is rank r's region
// (peers' regions mapped into our address space). epochs[lane] lives in local device memory and
// advances on the device, so a captured CUDA graph replays without any host update.
// A lane must be used by one stream at a time (its epoch is read-modify-written by thread 0 and
// the fused kernels count their CTAs in arrivals[lane]); a launch that finds the lane busy
// reports it and aborts every wait of its barrier object (below, "Lane misuse").
//
// Liveness (NCCL's split, docs/design.md "Barrier"): a wait never traps by default. It spins
// (a short tight phase, then with __nanosleep backoff) and, only every kCheckEvery spins (off the
// fast path), reads the time and the abort word of the host-mapped control page:
// - after `diag_ns` it writes a diagnostic record for its lane (rank, lane, missing peer, epoch,
//   observed value, how long) and printf's it once, then keeps waiting;
// - when the abort word is non-zero (the host's watchdog set it: a peer process is gone or the
//   host timeout passed; or a launch of this object found its lane busy) it stops waiting and
//   returns: the kernel completes, the CUDA context stays usable, and the host raises an error
//   naming the peer at its next call;
// - with kFlagTrap (opt-in) it traps after `diag_ns` instead, as vmmkv did before: the record is
//   complete before any thread traps.
// If the peer arrives after a record was written, the record is marked "passed" (the host logs
// how long the wait took).
//
// Memory-model invariant (the review's F4): rows a peer stored through its own mapping of our
// memory are read only by kernels launched after the barrier kernel on the reading stream. The
// barrier CTA's acquire and the kernel boundary (CUDA API synchronization, also an alias proxy
// fence) order those reads. A consumer fused into the same kernel would need, in every reading
// CTA, its own acquire of the signals (or a flag set by the barrier CTA after its wait), then
// fence.proxy.alias (it reads through another address than the writer used), and
// fence.proxy.async if it reads with TMA. If programmatic dependent launch is ever enabled for
// these kernels, a griddepcontrol.wait must come before epoch_at_entry and lane_enter: both
// assume the previous kernel on the stream has fully finished.
#pragma once
#include "vmmkv_common.cuh"

namespace vmmkv {

enum : int { kDiagMagic = 0x564d4d42 };  // "VMMB": a record was written here

// What a lane's record says (BarrierDiag::state); mirrored by vmmkv/ops/barrier_control.py.
enum : int {
    kDiagWaiting = 1,  // still waiting for missing_peer after diag_ns
    kDiagPassed = 2,   // the wait that wrote kDiagWaiting ended normally after waited_ns
    kDiagAborted = 3,  // the wait returned because the abort word was set
    kDiagTrapped = 4,  // kFlagTrap: the kernel traps after writing this
};

// BarrierArgs::flags
enum : int { kFlagTrap = 1 };

// The abort word's values (BarrierCtrl::abort): 0 = keep waiting.
enum : int { kAbortByHost = 1, kAbortLaneBusy = 2 };

// Per-lane words in device memory (BarrierArgs::lane_state, int32 [lanes][kLaneStateWords]).
enum : int { kLaneBusy = 0, kLaneClaim = 1, kLaneSeq = 2, kLaneStateWords = 4 };

// Spin policy of the wait (the fast path is the first ld.acquire.sys succeeding, or a few spins).
enum : unsigned {
    kTightSpins = 64,    // plain spins before each further spin sleeps kBackoffNs
    kBackoffNs = 100,    // frees issue slots for co-running kernels (the other lane, a peer rank
                         // time-sliced on the same GPU); costs at most this much wake-up latency
    kCheckEvery = 1024,  // spins between reads of the timer and the abort word (a power of two)
};

// One lane's record in the host-mapped control page; mirrored by vmmkv/ops/barrier_control.py.
// A seqlock: the writer (the CTA that claimed lane_state[lane][kLaneClaim]) makes `seq` odd,
// writes the fields, then makes it even; the host copies the record between two equal even
// reads of `seq`.
struct BarrierDiag {
    int seq;
    int state;  // kDiag*
    int lane;
    int rank;
    int missing_peer;
    int epoch;
    int observed;  // the peer's slot when the record was written
    int world;
    i64 waited_ns;  // since the barrier CTA started waiting, when written
    i64 diag_ns;    // the diagnostic delay (kFlagTrap: the trap timeout)
    int magic;      // kDiagMagic
    int reserved[3];
};
static_assert(sizeof(BarrierDiag) == 64,
              "BarrierDiag layout must match vmmkv/ops/barrier_control.py");

// The host-mapped control page of one DeviceBarrier: 64 bytes, then one record per lane.
struct BarrierCtrl {
    int abort;           // written by the host (kAbortByHost) or by a launch (kAbortLaneBusy)
    int busy_lane;       // 1 + the lane a launch found busy (0: none)
    int busy_epoch;      // the epoch that launch would have used
    int busy_found;      // the lane's epoch (or busy word) it found instead
    int reserved[12];
    BarrierDiag diag[1];  // [lanes]
};

// The barrier a store kernel runs after its stores, and the stand-alone barrier's parameter.
// Mirrored byte for byte by vmmkv/ops/launch.py (`BARRIER_ARGS`); 8-byte fields first.
struct BarrierArgs {
    const i64* sig_table;  // [world] signal-region base addresses (own and mapped peers)
    int* epochs;           // [lanes] local epochs, shared with the stand-alone barrier
    u32* arrivals;         // [lanes] CTAs of the running launch that finished their stores;
                           // zero between launches (the last CTA resets it)
    int* lane_state;       // [lanes][kLaneStateWords] device memory, zero-initialised
    BarrierCtrl* ctrl;     // host-mapped control page, or null (no abort, no record)
    i64 diag_ns;           // write the diagnostic after waiting this long (kFlagTrap: trap)
    int lane;
    int rank;
    int world;
    int flags;  // kFlagTrap
};
static_assert(sizeof(BarrierArgs) == 64, "BarrierArgs layout must match vmmkv/ops/launch.py");

VMMKV_FN void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

VMMKV_FN void st_release_sys(int* p, int v) {
    asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

VMMKV_FN int ld_acquire_sys(const int* p) {
    int v;
    asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// The abort word: a relaxed system-scope load of host-mapped memory (NCCL's checkAbort).
VMMKV_FN int ld_relaxed_sys(const int* p) {
    int v;
    asm volatile("ld.relaxed.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// "memory": the compiler may not move memory accesses across the timer read (the review's F7a).
VMMKV_FN u64 globaltimer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    return t;
}

VMMKV_FN int* signal_slot(const i64* sig_table, int owner, int lane, int parity, int world,
                          int index) {
    int* base = reinterpret_cast<int*>(static_cast<u64>(sig_table[owner]));
    return base + ((i64)lane * 2 + parity) * world + index;
}

VMMKV_FN int* lane_word(const BarrierArgs& b, int word) {
    return b.lane_state + (i64)b.lane * kLaneStateWords + word;
}

// Shared state of the CTA that runs the barrier.
struct BarrierShared {
    u64 start;     // %globaltimer when the CTA started the barrier
    int epoch;     // the epoch this barrier waits for
    int claim;     // 0: no report yet; 1: a thread is reporting; 2: record written; 3: printed only
    int peer;      // the reported peer and its slot value
    int observed;
    int aborted;
};

// Writes the lane's record (the caller holds lane_state[lane][kLaneClaim]).
__device__ __noinline__ void write_record(const BarrierArgs b, int state, int peer, int epoch,
                                          int observed, i64 waited_ns) {
    if (b.ctrl == nullptr) return;
    const int s = atomicAdd(lane_word(b, kLaneSeq), 2);  // unique per write, even
    volatile int* d = reinterpret_cast<volatile int*>(&b.ctrl->diag[b.lane]);
    d[0] = s + 1;  // odd: being written
    __threadfence_system();
    d[1] = state;
    d[2] = b.lane;
    d[3] = b.rank;
    d[4] = peer;
    d[5] = epoch;
    d[6] = observed;
    d[7] = b.world;
    d[8] = (int)(u32)((u64)waited_ns & 0xffffffffu);
    d[9] = (int)(u32)((u64)waited_ns >> 32);
    d[10] = (int)(u32)((u64)b.diag_ns & 0xffffffffu);
    d[11] = (int)(u32)((u64)b.diag_ns >> 32);
    d[12] = kDiagMagic;
    __threadfence_system();  // the fields are visible before the even sequence that vouches
    d[0] = s + 2;
    __threadfence_system();
}

// A launch found its lane busy (another launch of the lane is running: two streams without
// ordering between them) or the lane's epoch advanced under it. Reports it in the control page
// and aborts every wait of this barrier object; the host raises naming the lane.
__device__ __noinline__ void report_lane_busy(const BarrierArgs b, int epoch, int found) {
    if (b.ctrl != nullptr) {
        volatile int* c = reinterpret_cast<volatile int*>(b.ctrl);
        c[2] = epoch;
        c[3] = found;
        c[1] = b.lane + 1;
        __threadfence_system();
        c[0] = kAbortLaneBusy;
        __threadfence_system();
    }
    printf("vmmkv barrier: rank %d lane %d used by two launches at once (epoch %d, found %d): "
           "a lane must be used by one stream at a time; aborting this barrier's waits\n",
           b.rank, b.lane, epoch, found);
}

// Thread 0 of CTA 0 of every launch that runs the barrier of b.lane, at the kernel's start:
// marks the lane busy and returns what the lane's busy word held (non-zero: lane misuse). The
// CTA that runs the barrier clears the word once its wait is over. Off the critical path: the
// result is first needed after this CTA's stores.
// (-DVMMKV_TEST_NO_LANE_CHECK, test builds only: no lane check at all, to measure its cost.)
VMMKV_FN int lane_enter(const BarrierArgs& b) {
#ifdef VMMKV_TEST_NO_LANE_CHECK
    return 0;
#else
    return (threadIdx.x == 0 && blockIdx.x == 0) ? atomicExch(lane_word(b, kLaneBusy), 1) : 0;
#endif
}

// Claims the CTA's report and, if free, the lane's record; writes it (state) and printf's once
// (an abort is printed by barrier_cta once every thread stopped waiting).
__device__ __noinline__ void report_wait(const BarrierArgs b, BarrierShared* sh, int state,
                                         int peer, int observed, i64 waited_ns) {
    if (atomicCAS(&sh->claim, 0, 1) != 0) return;  // another thread of this CTA reports
    const bool owner = atomicCAS(lane_word(b, kLaneClaim), 0, 1) == 0;
    sh->peer = peer;
    sh->observed = observed;
    if (owner) write_record(b, state, peer, sh->epoch, observed, waited_ns);
    const double s = (double)waited_ns * 1e-9;
    if (state == kDiagTrapped) {
        printf("vmmkv barrier timeout: lane=%d rank=%d missing peer=%d epoch=%d observed=%d "
               "world=%d timeout_ns=%lld: trapping\n",
               b.lane, b.rank, peer, sh->epoch, observed, b.world, (long long)b.diag_ns);
    } else if (state == kDiagWaiting) {  // kDiagAborted: printed when the wait has ended
        printf("vmmkv barrier: rank %d lane %d epoch %d: still waiting for peer %d after %.3f s "
               "(observed %d, world %d); waiting on until the peer arrives or the host aborts\n",
               b.rank, b.lane, sh->epoch, peer, s, observed, b.world);
    }
    atomicExch(&sh->claim, owner ? 2 : 3);
}

enum : int { kWaitStop = 1, kWaitReported = 2 };

// The slow part of a wait, every kCheckEvery spins: the abort word, then the diagnostic (or the
// opt-in trap). `state` and the result are kWait* bits: kWaitStop when the wait must stop
// (aborted), kWaitReported once this thread passed the diagnostic delay. BarrierArgs by value:
// a reference would keep the kernel's copy in local memory on the fast path too.
__device__ __noinline__ int wait_check(const BarrierArgs b, BarrierShared* sh, const int* own,
                                       int peer, int observed, int state) {
    const i64 waited = (i64)(globaltimer_ns() - sh->start);
    if (b.ctrl != nullptr && ld_relaxed_sys(&b.ctrl->abort) != 0) {
        // the peer may have signalled just before it went away: then this wait is complete
        observed = ld_acquire_sys(own);
        if ((int)((u32)observed - (u32)sh->epoch) >= 0) return state;
        report_wait(b, sh, kDiagAborted, peer, observed, waited);
        atomicExch(&sh->aborted, 1);
        return state | kWaitStop;
    }
    if (!(state & kWaitReported) && waited > b.diag_ns) {
        state |= kWaitReported;
        if (b.flags & kFlagTrap) {
            report_wait(b, sh, kDiagTrapped, peer, observed, waited);
            // a thread that lost the claim traps only once the record is complete (F3)
            while (*reinterpret_cast<volatile int*>(&sh->claim) < 2) __nanosleep(1000);
            __trap();
        }
        report_wait(b, sh, kDiagWaiting, peer, observed, waited);
    }
    return state;
}

// After the wait of a CTA that reported (claim 2: it owns the lane's record; 3: it only
// printed): the final record ("passed" or "aborted") and one line.
__device__ __noinline__ void finish_report(const BarrierArgs b, const BarrierShared* sh) {
    const i64 waited = (i64)(globaltimer_ns() - sh->start);
    const double s = (double)waited * 1e-9;
    if (sh->aborted) {
        if (sh->claim == 2) write_record(b, kDiagAborted, sh->peer, sh->epoch, sh->observed, waited);
        printf("vmmkv barrier: rank %d lane %d epoch %d: aborted after %.3f s waiting for peer "
               "%d (observed %d, world %d)\n",
               b.rank, b.lane, sh->epoch, s, sh->peer, sh->observed, b.world);
    } else {
        if (sh->claim == 2) {
            write_record(b, kDiagPassed, sh->peer, sh->epoch, sh->observed, waited);
            atomicExch(lane_word(b, kLaneClaim), 0);  // the next late wait may write the record
        }
        printf("vmmkv barrier: rank %d lane %d epoch %d: peer %d arrived, passed after %.3f s\n",
               b.rank, b.lane, sh->epoch, sh->peer, s);
    }
}

// The lane's epoch as thread 0 of a CTA reads it when its kernel starts, so that this load is
// off the barrier's critical path (its value is used only once the CTA's stores are done).
// Sound because nothing writes epochs[lane] between a launch's start and the barrier of that
// launch: only the CTA that runs the barrier writes it, after this read, and launches on one lane
// are stream-ordered. (The barrier checks that with its atomic exchange of the epoch.)
VMMKV_FN int epoch_at_entry(const int* epochs, int lane) {
    return threadIdx.x == 0 ? epochs[lane] : 0;
}

// The barrier, run by every thread of one CTA (any multiple of 32 threads; threads loop over
// peers): advance the lane's epoch (`entry_epoch`, from epoch_at_entry, is thread 0's reading of
// it; `busy_found`, from lane_enter, what thread 0 of CTA 0 found in the lane's busy word),
// signal every rank with a system-scope release, wait (acquire) until every rank signalled the
// same epoch or the abort word is set. Stores this CTA's threads made, or that are ordered
// before them, are visible to every peer once all ranks passed.
VMMKV_FN void barrier_cta(const BarrierArgs& b, int entry_epoch, int busy_found) {
    __shared__ BarrierShared sh;
    int prev = 0;
    if (threadIdx.x == 0) {
        const int e = (int)((u32)entry_epoch + 1u);  // wraps without UB; compared modulo 2^32
        // an exchange, not a store: another launch that advanced the lane since our entry read
        // (lane misuse) shows here; the signal release below waits for it either way
#ifdef VMMKV_TEST_NO_LANE_CHECK
        b.epochs[b.lane] = e;
        prev = entry_epoch;
#else
        prev = atomicExch(b.epochs + b.lane, e);
#endif
        sh.epoch = e;
        sh.claim = 0;
        sh.aborted = 0;
        sh.start = globaltimer_ns();
    }
    __syncthreads();
    const int e = sh.epoch;
    const int parity = e & 1;

    // st.release.sys is a release pattern on its own (PTX: a fence.acq_rel.sys then the store),
    // cumulative over everything this CTA's threads and, through the kernel boundary or the
    // gpu-scope arrival below, earlier stores made visible to them.
    for (int t = threadIdx.x; t < b.world; t += blockDim.x) {
        st_release_sys(signal_slot(b.sig_table, t, b.lane, parity, b.world, b.rank), e);
    }
    if (threadIdx.x == 0 && (busy_found != 0 || prev != entry_epoch))
        report_lane_busy(b, e, busy_found != 0 ? busy_found : prev);
    int state = 0;  // kWait* bits
    for (int t = threadIdx.x; t < b.world && !(state & kWaitStop); t += blockDim.x) {
        const int* own = signal_slot(b.sig_table, b.rank, b.lane, parity, b.world, t);
        int v = ld_acquire_sys(own);
        for (u32 n = 1; (int)((u32)v - (u32)e) < 0; ++n) {
            if (n >= kTightSpins) __nanosleep(kBackoffNs);
            if ((n & (kCheckEvery - 1)) == 0) {
                state = wait_check(b, &sh, own, t, v, state);
                if (state & kWaitStop) break;
            }
            v = ld_acquire_sys(own);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        // the lane is free for the next launch once this wait is over: a launch that overlaps
        // any part of this one, its wait included, finds the word set (one store, at the end)
#ifndef VMMKV_TEST_NO_LANE_CHECK
        *reinterpret_cast<volatile int*>(lane_word(b, kLaneBusy)) = 0;
#endif
        if (sh.claim >= 2) finish_report(b, &sh);
    }
}

// Test-only build hook (compile with -DVMMKV_TEST_LAG_NS=<ns>, never in production builds):
// warp 7 of one CTA (VMMKV_TEST_LAG_CTA, or one picked from the lane's epoch per launch) spins
// that long before its stores, so that a missing "all stores of this CTA before its arrival"
// ordering shows as stale rows at the peer (tests/test_barrier_stress_gpu.py).
#ifdef VMMKV_TEST_LAG_NS
VMMKV_FN void test_lag(const BarrierArgs& b) {
    if ((threadIdx.x >> 5) != 7) return;
#ifdef VMMKV_TEST_LAG_CTA
    const u32 cta = (u32)(VMMKV_TEST_LAG_CTA) % gridDim.x;
    const u32 h = (u32)b.epochs[b.lane] * 2654435761u;
#else
    const u32 h = (u32)b.epochs[b.lane] * 2654435761u;
    const u32 cta = (h >> 8) % gridDim.x;
#endif
    if (blockIdx.x != cta) return;
    const u64 lag = (u64)(VMMKV_TEST_LAG_NS) * (1u + ((h >> 4) & 3u)) / 2u;  // 0.5x .. 2x
    const u64 t0 = globaltimer_ns();
    while (globaltimer_ns() - t0 < lag) {
    }
}
#define VMMKV_TEST_LAG(b) test_lag(b)
#else
#define VMMKV_TEST_LAG(b) ((void)0)
#endif

// The end of a store kernel that publishes: every CTA, once all its threads issued their
// stores, releases them (gpu scope) and counts itself in arrivals[lane]; the last CTA to
// arrive acquires every CTA's stores, resets the counter for the next launch and runs the
// barrier for the whole grid. A grid of one CTA is its own last arrival and skips the count
// (its threads' stores are ordered before the barrier by __syncthreads, as in any last CTA).
// `entry_epoch` comes from epoch_at_entry and `busy_found` from lane_enter at the kernel's
// start. Every thread of every CTA must call this exactly once.
VMMKV_FN void arrive_then_barrier(const BarrierArgs& b, int entry_epoch, int busy_found) {
    __shared__ int s_last;
    __syncthreads();  // every thread of this CTA issued its stores
    const bool alone = gridDim.x == 1;
    if (!alone) {
        if (threadIdx.x == 0) {
            // CTA 0 found the lane busy: another launch's CTAs may be counting in arrivals[lane]
            if (busy_found != 0) report_lane_busy(b, entry_epoch + 1, busy_found);
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
    if (alone || s_last) barrier_cta(b, entry_epoch, alone ? busy_found : 0);
}

}  // namespace vmmkv
