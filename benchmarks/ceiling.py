"""Copy ceilings: the same N bytes copied from a local buffer to a destination buffer (a peer's
replica through its NVLink mapping, or a second local buffer) three ways, timed in the same run
as the stores they bound. Imported by bench_store.py; a benchmark tool, not library code.

- ``CE copy``: ``dst.copy_(src)`` (torch's ``cudaMemcpyAsync``, D2D or peer: a copy engine,
  256-B NVLink packets);
- ``SM lines`` (and ``SM lines no_alloc``, the same with ``st.global.L1::no_allocate``): an SM
  kernel whose every warp store instruction writes 512 contiguous, 512-aligned bytes (lane ``l``
  stores bytes ``[16 l, 16 l + 16)`` of a 512-B piece) as 16-B ``st.global.v4.b32``, so every
  request is a full 128-B line (SM-originated NVLink writes carry at most 128 B). Each warp
  loads 4 pieces (2 KiB) first, then stores them (NCCL's reduceCopyPacks shape), grid-stride
  over pieces; ``SMS * LINES_CTAS_PER_SM`` CTAs of ``LINES_THREADS`` threads;
- ``TMA bulk``: each CTA loads a ``TMA_TILE``-byte tile into shared memory with 16-B loads,
  ``fence.proxy.async.shared::cta``, then one thread issues one
  ``cp.async.bulk.global.shared::cta.bulk_group`` of the whole tile (``TMA_STAGES`` tiles in
  flight per CTA: ``cp.async.bulk.wait_group.read`` before a buffer is refilled,
  ``cp.async.bulk.wait_group 0`` at the end); sm_90+ only (absent on older GPUs).

GB/s = bytes copied (= bytes written at the destination) per second. The kernels are compiled
by NVRTC through ``vmmkv.ops.build._nvrtc_compile`` and launched with ``cuLaunchKernel`` on
torch's current stream (graph-capturable). :func:`measure` checks each method's bytes once
(``torch.equal``) before timing it.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from typing import Any

PIECE = 512  # bytes one warp store instruction of the SM copy writes
SIZES = tuple(n // PIECE * PIECE for n in (8_000_000, 26_000_000, 52_000_000))
LINES_THREADS, LINES_CTAS_PER_SM = 512, 2
TMA_THREADS, TMA_CTAS_PER_SM = 256, 2
TMA_TILE, TMA_STAGES = 16384, 2  # bytes per bulk store; tiles in flight per CTA (32 KiB smem)
METHODS = ("CE copy", "SM lines", "SM lines no_alloc", "TMA bulk")
BEST = "best ceiling GB/s"

ENTRIES = {
    "SM lines": "vmmkv_ceiling_copy_lines",
    "SM lines no_alloc": "vmmkv_ceiling_copy_lines_na",
    "TMA bulk": "vmmkv_ceiling_tma_store",
}

SOURCE = (
    r"""
// Copy ceilings (benchmarks/ceiling.py). dst, src: 16-B aligned (512-B aligned for full lines).
#define CEIL_UNROLL 4
#define TMA_TILE @TMA_TILE@
#define TMA_STAGES @TMA_STAGES@
#define TMA_THREADS @TMA_THREADS@
#define LINES_THREADS @LINES_THREADS@
#define TMA_PER_THREAD (TMA_TILE / 16 / TMA_THREADS)

template <bool NoAllocate>
__device__ __forceinline__ void ceil_store16(uint4* p, const uint4& v) {
    if (NoAllocate) {
        asm volatile("st.global.L1::no_allocate.v4.b32 [%0], {%1, %2, %3, %4};"
                     :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
    } else {
        asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};"
                     :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
    }
}

// pieces of 512 B: 32 lanes x 16 B, one warp store instruction each. A warp takes hunks of
// CEIL_UNROLL consecutive pieces (loads of the hunk first, then its stores), grid-stride.
template <bool NoAllocate>
__device__ __forceinline__ void ceil_copy_lines(uint4* __restrict__ dst,
                                                const uint4* __restrict__ src,
                                                unsigned long long pieces) {
    const unsigned lane = threadIdx.x & 31u;
    const unsigned long long warp =
        ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const unsigned long long nwarps = ((unsigned long long)gridDim.x * blockDim.x) >> 5;
    const unsigned long long hunks = pieces / CEIL_UNROLL;
    for (unsigned long long h = warp; h < hunks; h += nwarps) {
        const uint4* s = src + h * (CEIL_UNROLL * 32) + lane;
        uint4* d = dst + h * (CEIL_UNROLL * 32) + lane;
        uint4 v[CEIL_UNROLL];
#pragma unroll
        for (int u = 0; u < CEIL_UNROLL; ++u) v[u] = __ldg(s + u * 32);
#pragma unroll
        for (int u = 0; u < CEIL_UNROLL; ++u) ceil_store16<NoAllocate>(d + u * 32, v[u]);
    }
    for (unsigned long long p = hunks * CEIL_UNROLL + warp; p < pieces; p += nwarps) {
        ceil_store16<NoAllocate>(dst + p * 32 + lane, __ldg(src + p * 32 + lane));
    }
}

extern "C" __global__ void __launch_bounds__(LINES_THREADS)
vmmkv_ceiling_copy_lines(void* dst, const void* src, unsigned long long nbytes) {
    ceil_copy_lines<false>((uint4*)dst, (const uint4*)src, nbytes / 512);
}

extern "C" __global__ void __launch_bounds__(LINES_THREADS)
vmmkv_ceiling_copy_lines_na(void* dst, const void* src, unsigned long long nbytes) {
    ceil_copy_lines<true>((uint4*)dst, (const uint4*)src, nbytes / 512);
}

// Tiles of TMA_TILE bytes, grid-stride over CTAs; TMA_STAGES shared buffers per CTA. nbytes: a
// multiple of 16 (the last tile may be short).
extern "C" __global__ void __launch_bounds__(TMA_THREADS)
vmmkv_ceiling_tma_store(void* dst, const void* src, unsigned long long nbytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    __shared__ __align__(128) uint4 tile[TMA_STAGES][TMA_TILE / 16];
    const unsigned long long ntiles = (nbytes + TMA_TILE - 1) / TMA_TILE;
    const bool leader = threadIdx.x == 0;
    unsigned i = 0;
    for (unsigned long long t = blockIdx.x; t < ntiles; t += gridDim.x, ++i) {
        const unsigned stage = i % TMA_STAGES;
        const unsigned long long off = t * TMA_TILE;
        const unsigned long long left = nbytes - off;
        const unsigned bytes = left < TMA_TILE ? (unsigned)left : TMA_TILE;
        if (i >= TMA_STAGES) {  // this buffer's bulk store (TMA_STAGES tiles ago) has read it
            if (leader) {
                asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(TMA_STAGES - 1)
                             : "memory");
            }
            __syncthreads();
        }
        const uint4* s = (const uint4*)((const char*)src + off);
        uint4* buf = tile[stage];
        if (bytes == TMA_TILE) {  // a full tile: all loads in flight, then the shared stores
            uint4 v[TMA_PER_THREAD];
#pragma unroll
            for (int u = 0; u < TMA_PER_THREAD; ++u) v[u] = __ldg(s + u * TMA_THREADS + threadIdx.x);
#pragma unroll
            for (int u = 0; u < TMA_PER_THREAD; ++u) buf[u * TMA_THREADS + threadIdx.x] = v[u];
        } else {  // the last, short tile
            for (unsigned j = threadIdx.x; j < bytes / 16; j += TMA_THREADS) buf[j] = __ldg(s + j);
        }
        // generic-proxy writes to shared memory, then read by the async proxy
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        if (leader) {
            const unsigned smem = (unsigned)__cvta_generic_to_shared(buf);
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                         :: "l"((char*)dst + off), "r"(smem), "r"(bytes) : "memory");
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        }
    }
    if (leader) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#else
    __trap();  // cp.async.bulk needs sm_90
#endif
}
""".replace("@TMA_TILE@", str(TMA_TILE))
    .replace("@TMA_STAGES@", str(TMA_STAGES))
    .replace("@TMA_THREADS@", str(TMA_THREADS))
    .replace("@LINES_THREADS@", str(LINES_THREADS))
)


def _arch_number(arch: str) -> int:
    return int(arch[3:].rstrip("abcdefghijklmnopqrstuvwxyz"))


def has_tma(arch: str) -> bool:
    """Whether ``arch`` (``'sm_90'``) has ``cp.async.bulk`` (sm_90 and later)."""
    return _arch_number(arch) >= 90


def compile_cubin(arch: str) -> bytes:
    """The cubin of :data:`SOURCE` for ``arch`` (NVRTC with the project's options; no GPU)."""
    from vmmkv.ops import build

    return build._nvrtc_compile("vmmkv_ceiling.cu", SOURCE, {}, build.compile_options(arch, None))


def compile_ptx(arch: str) -> str:
    """The PTX of :data:`SOURCE` for ``arch``'s virtual architecture (for inspection, tests)."""
    from vmmkv.ops import build

    options = [
        f"--gpu-architecture=compute_{arch[3:]}" if o.startswith("--gpu-architecture=") else o
        for o in build.compile_options(arch, None)
    ]
    return build._nvrtc_compile("vmmkv_ceiling.cu", SOURCE, {}, options, ptx=True).decode()


def closest_size(nbytes: int, sizes: Sequence[int] = SIZES) -> int:
    """The size of ``sizes`` closest to ``nbytes`` (the smaller one on a tie)."""
    if not sizes:
        raise ValueError("no ceiling sizes")
    return min(sizes, key=lambda s: (abs(s - nbytes), s))


def best_at(ceilings: Sequence[dict[str, Any]], nbytes: int) -> float:
    """The best ceiling GB/s measured at the size closest to ``nbytes``."""
    size = closest_size(nbytes, [c["bytes"] for c in ceilings])
    return next(c[BEST] for c in ceilings if c["bytes"] == size)


def _finish(row: dict[str, Any]) -> dict[str, Any]:
    """Set ``best ceiling GB/s`` (and ``best``, its method) from the method columns present."""
    got = {m: row[f"{m} GB/s"] for m in METHODS if isinstance(row.get(f"{m} GB/s"), float)}
    if got:
        best = max(got, key=got.__getitem__)
        row[BEST], row["best"] = got[best], best
    return row


def slowest(per_rank: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per size, each method's GB/s of the slowest rank (the ranks measured the same sizes);
    the best ceiling is then the best of those minima."""
    rows = []
    for same in zip(*per_rank, strict=True):
        row: dict[str, Any] = {"bytes": same[0]["bytes"], "MB": same[0]["MB"]}
        for m in METHODS:
            vals = [r.get(f"{m} GB/s") for r in same]
            if all(isinstance(v, float) for v in vals):
                row[f"{m} GB/s"] = min(vals)
        rows.append(_finish(row))
    return rows


class CopyKernels:
    """The SM and TMA copy kernels loaded on device ``ordinal`` (under its primary context,
    the one torch uses); ``copy(method, dst, src)`` launches one on torch's current stream."""

    def __init__(self, ordinal: int):
        import torch

        from vmmkv.alloc import driver
        from vmmkv.ops import build

        self.ordinal = ordinal
        self.arch = build.arch_of_device(ordinal)
        self.sms = torch.cuda.get_device_properties(ordinal).multi_processor_count
        cubin = compile_cubin(self.arch)
        self.functions: dict[str, Any] = {}
        with driver.primary_context(ordinal):
            self.module = driver.call(
                driver.cu.cuModuleLoadData, cubin, device=ordinal, source="vmmkv_ceiling.cu"
            )  # kept for the process: captured graphs may still use it
            for method, entry in ENTRIES.items():
                if method == "TMA bulk" and not has_tma(self.arch):
                    continue
                self.functions[method] = driver.call(
                    driver.cu.cuModuleGetFunction, self.module, entry.encode(), device=ordinal
                )

    def methods(self) -> tuple[str, ...]:
        return ("CE copy", *self.functions)

    def copy(self, method: str, dst: Any, src: Any) -> None:
        """Copy all of ``src`` into ``dst[: src.numel()]`` (uint8 tensors) with ``method``."""
        import torch

        from vmmkv.alloc import driver

        n = src.numel()
        if method == "CE copy":
            dst[:n].copy_(src)
            return
        if n % PIECE or dst.data_ptr() % PIECE or src.data_ptr() % PIECE:
            raise ValueError(f"{method}: size and addresses must be multiples of {PIECE} B")
        if method == "TMA bulk":
            grid, block = self.sms * TMA_CTAS_PER_SM, TMA_THREADS
        else:
            grid, block = self.sms * LINES_CTAS_PER_SM, LINES_THREADS
        fn = self.functions[method]
        args = (
            ctypes.c_void_p(dst.data_ptr()),
            ctypes.c_void_p(src.data_ptr()),
            ctypes.c_uint64(n),
        )
        params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        stream = torch.cuda.current_stream(self.ordinal).cuda_stream
        with driver.primary_context(self.ordinal):
            driver.call(
                driver.cu.cuLaunchKernel, fn, grid, 1, 1, block, 1, 1, 0, stream,
                ctypes.addressof(params), 0, kernel=ENTRIES[method], device=self.ordinal,
            )  # fmt: skip


@functools.cache
def kernels(ordinal: int) -> CopyKernels:
    return CopyKernels(ordinal)


def measure(
    ordinal: int,
    dst: Any,
    src: Any,
    time_ms: Callable[[Callable[[], None]], float],
    sizes: Sequence[int] = SIZES,
    before: Callable[[], None] = lambda: None,
) -> list[dict[str, Any]]:
    """One row per size: GB/s of each method copying ``src[:size]`` into ``dst[:size]``
    (``time_ms(fn)``: ms per call, e.g. graph replays) and the best of them. ``src`` is filled
    with random bytes here; each method's result is checked once (``dst`` poisoned with the
    source's complement, so every byte a method leaves unwritten differs whatever its value; one
    copy; ``torch.equal``; RuntimeError on a mismatch) before it is timed. ``before()`` runs before
    each check and each timing (e.g. a barrier of the ranks, so that they copy together)."""
    import torch

    top = max(sizes)
    if src.numel() < top or dst.numel() < top:
        raise ValueError(f"ceiling buffers hold {src.numel()} / {dst.numel()} B, need {top}")
    k = kernels(ordinal)
    src = src[:top]
    src.random_(0, 256)
    rows = []
    for n in sizes:
        row: dict[str, Any] = {"bytes": n, "MB": n / 1e6}
        s, d = src[:n], dst[:n]
        for method in k.methods():

            def fn(method=method, d=d, s=s):
                k.copy(method, d, s)

            before()
            torch.bitwise_not(s, out=d)
            fn()
            torch.cuda.synchronize()
            if not torch.equal(d, s):
                bad = int((d != s).sum().item())
                raise RuntimeError(f"{method} copy of {n} B: {bad} bytes differ from the source")
            before()
            row[f"{method} GB/s"] = n / time_ms(fn) / 1e6
        rows.append(_finish(row))
    return rows
