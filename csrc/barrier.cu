// System-scope barrier among the ranks of a PCP group, one CTA per call (body: barrier.cuh,
// shared with the store kernels that end with the barrier).
#include "barrier.cuh"

using namespace vmmkv;

// Launch: one CTA of a multiple of 32 threads (any count; threads loop over peers).
extern "C" __global__ void vmmkv_barrier(BarrierArgs bar) {
    const int busy_found = lane_enter(bar);
    barrier_cta(bar, epoch_at_entry(bar.epochs, bar.lane), busy_found);
}

// Does nothing: the launch-overhead reference of the benchmarks (same launch path as the stores).
extern "C" __global__ void vmmkv_noop() {}
