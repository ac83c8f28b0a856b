"""Sparse attention reads by cache layout: DSA top-k row gathers from LBNHC and BLNHC caches.

A DeepSeek-V3.2 cache (61 layers, 64-token blocks; per token and layer a 656-byte MLA row and a
132-byte indexer row, so 41,984 + 8,448 B per block and layer) of ``--gib`` GiB is read the way
DSA reads it: per query token and layer, the MLA rows and the indexer rows of ``--topk`` (2048)
token indices drawn uniformly (seeded) from every token of the cache. Indices differ per query
and per layer: every V3.2 layer has its own lightning indexer and so its own top-k. The indexer
rows are gathered at the same indices as the MLA rows; the real indexer scores every earlier
token, a dense scan of the request's rows, so this is a stand-in for its traffic.

Two layouts of the same bytes: ``LB`` (LBNHC, layer-major: the 61 indexer segments, then the 61
MLA segments, each of every block, as ``bench_elastic_gpu.geometry``; one layer's blocks are
41,984 B apart) and ``BL`` (BLNHC, block-major, what elastic KV needs: per block every layer's
MLA block then its indexer block, 3,076,352 B per block; one layer's blocks are 3 MB apart, so
nearly every row lands on its own 2 MiB page). Row address, both layouts:
``base + offset[layer] + (token // 64) * block_stride + (token % 64) * row_bytes``.

Backings: a ``VirtualRegion`` committed in chunks of each ``--chunks-mib`` size, and a plain
``torch.empty`` buffer; each is filled with random non-zero bytes, read in both layouts, and
freed before the next. The CUDA kernel (NVRTC) runs one CTA per (query, layer), reads the MLA
rows with 16-byte loads and the indexer rows with 4-byte loads (132 = 33 x 4) and writes the
wrapping 32-bit sum of the words it read, per (query, layer), MLA and indexer apart, into an
output poisoned before the checked launch. The reference gathers the same rows through shaped
views of the buffer (``[layer, block, slot, word]`` or ``[block, layer, slot, word]``), not the
kernel's offset tables, for ``--check-queries`` queries; any difference fails the run (exit 1,
after the table and the JSON). Timing: CUDA events, ``--warmup`` launches, median of ``--reps``;
GB/s counts useful bytes (queries x layers x topk x 788); ``vs_torch_LB`` is the ratio to the
``torch.empty`` buffer in LBNHC, measured in the same run.

``--backend host`` (the default without a GPU): the same configurations on the host backend at a
small size, the kernel's address arithmetic done in torch on flat words instead of the kernel,
checked against the shaped views the same way (timings there are not meaningful).
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

from bench_elastic_gpu import IDX_BLOCK, MLA_BLOCK, geometry, git_commit  # noqa: E402
from common import arguments, device_name, median, resolve_backend, table, write_json  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
BLOCK_TOKENS = 64
MLA_ROW, IDX_ROW = MLA_BLOCK // BLOCK_TOKENS, IDX_BLOCK // BLOCK_TOKENS  # 656, 132 bytes
LAYOUTS = ("LB", "BL")
POISON = 0xA5A5A5A5
THREADS = 512

SOURCE = r"""
// One CTA per (query, layer): the rows of that layer at the query's top-k tokens.
// out[(q * layers + l) * 2 + 0 / 1]: wrapping sum of the 32-bit words of the MLA / indexer rows.
#define MLA_VECS (MLA_ROW / 16)
#define IDX_WORDS (IDX_ROW / 4)

__device__ __forceinline__ unsigned int block_sum(unsigned int v, unsigned int* scratch) {
    for (int s = 16; s > 0; s >>= 1) v += __shfl_down_sync(0xffffffffu, v, s);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = 0;
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? scratch[lane] : 0u;
        for (int s = 16; s > 0; s >>= 1) v += __shfl_down_sync(0xffffffffu, v, s);
    }
    __syncthreads();
    return v;
}

extern "C" __global__ void sparse_read(
    const unsigned char* __restrict__ base,
    const long long* __restrict__ mla_off, const long long* __restrict__ idx_off,
    long long mla_block_stride, long long idx_block_stride,
    const int* __restrict__ topk, int layers, int k, unsigned int* __restrict__ out) {
    extern __shared__ int tok[];
    __shared__ unsigned int scratch[32];
    const long long ql = blockIdx.x;
    const int layer = (int)(ql % layers);
    for (int i = threadIdx.x; i < k; i += blockDim.x) tok[i] = topk[ql * k + i];
    __syncthreads();
    const unsigned char* mla = base + mla_off[layer];
    const unsigned char* idx = base + idx_off[layer];
    unsigned int s_mla = 0, s_idx = 0;
#pragma unroll 4
    for (int i = threadIdx.x; i < k * MLA_VECS; i += blockDim.x) {
        const int r = i / MLA_VECS, v = i - r * MLA_VECS, t = tok[r];
        const uint4 w = reinterpret_cast<const uint4*>(
            mla + (long long)(t / BLOCK_TOKENS) * mla_block_stride
                + (long long)(t % BLOCK_TOKENS) * MLA_ROW)[v];
        s_mla += w.x + w.y + w.z + w.w;
    }
#pragma unroll 4
    for (int i = threadIdx.x; i < k * IDX_WORDS; i += blockDim.x) {
        const int r = i / IDX_WORDS, v = i - r * IDX_WORDS, t = tok[r];
        s_idx += reinterpret_cast<const unsigned int*>(
            idx + (long long)(t / BLOCK_TOKENS) * idx_block_stride
                + (long long)(t % BLOCK_TOKENS) * IDX_ROW)[v];
    }
    s_mla = block_sum(s_mla, scratch);
    s_idx = block_sum(s_idx, scratch);
    if (threadIdx.x == 0) {
        out[ql * 2] = s_mla;
        out[ql * 2 + 1] = s_idx;
    }
}
"""


def compile_kernel(arch: str) -> bytes:
    """The cubin of ``SOURCE`` for ``arch`` (e.g. ``'sm_90'``); NVRTC only, no GPU needed."""
    from vmmkv.ops.build import _nvrtc_compile, compile_options

    defines = [f"-DMLA_ROW={MLA_ROW}", f"-DIDX_ROW={IDX_ROW}", f"-DBLOCK_TOKENS={BLOCK_TOKENS}"]
    return _nvrtc_compile("sparse_read.cu", SOURCE, {}, compile_options(arch, None) + defines)


def layout_tables(layout: str, layers: int, blocks: int) -> dict[str, Any]:
    """Per-layer byte offsets and block strides of the MLA and indexer rows in ``layout``
    (what the kernel reads with), and the cache's bytes."""
    packed = layers * (MLA_BLOCK + IDX_BLOCK)
    if layout == "LB":
        segs, size = geometry("LB", layers, blocks)
        return {"mla_off": [off for off, _ in segs[layers:]], "idx_off": [off for off, _ in segs[:layers]],
                "mla_stride": MLA_BLOCK, "idx_stride": IDX_BLOCK, "bytes": size}  # fmt: skip
    if layout == "BL":
        mla = [lay * (MLA_BLOCK + IDX_BLOCK) for lay in range(layers)]
        return {"mla_off": mla, "idx_off": [off + MLA_BLOCK for off in mla], "mla_stride": packed,
                "idx_stride": packed, "bytes": blocks * packed}  # fmt: skip
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def shaped_views(words: Any, layout: str, layers: int, blocks: int) -> tuple[Any, Any]:
    """(mla, idx) int32 views of the cache's words, indexed ``[layer, block, slot, word]``;
    built from the layout's definition, not from ``layout_tables``."""
    mw, iw, bt = MLA_BLOCK // 4, IDX_BLOCK // 4, BLOCK_TOKENS
    if layout == "LB":
        idx = words[: layers * blocks * iw].view(layers, blocks, bt, IDX_ROW // 4)
        mla = words[layers * blocks * iw : layers * blocks * (iw + mw)]
        return mla.view(layers, blocks, bt, MLA_ROW // 4), idx
    if layout == "BL":
        per = words[: blocks * layers * (mw + iw)].view(blocks, layers, mw + iw).transpose(0, 1)
        mla = per[:, :, :mw].unflatten(-1, (bt, MLA_ROW // 4))
        return mla, per[:, :, mw:].unflatten(-1, (bt, IDX_ROW // 4))
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def wrap32(x: Any) -> Any:
    """int64 sums -> the uint32 the kernel writes, as int64."""
    return x & 0xFFFFFFFF


def reference_sums(words: Any, layout: str, layers: int, blocks: int, topk: Any) -> Any:
    """``[len(topk), layers, 2]`` int64: per query and layer, the wrapping sum of the words of
    the MLA rows and of the indexer rows at the query's tokens, gathered through shaped views."""
    import torch

    mla, idx = shaped_views(words, layout, layers, blocks)
    lay = torch.arange(layers, device=topk.device)[:, None]
    out = []
    for t in topk.long():  # [layers, k] per query
        blk, slot = t // BLOCK_TOKENS, t % BLOCK_TOKENS
        m = mla[lay, blk, slot].long().sum(dim=(1, 2))
        i = idx[lay, blk, slot].long().sum(dim=(1, 2))
        out.append(wrap32(torch.stack([m, i], dim=-1)))
    return torch.stack(out)


def flat_sums(words: Any, tables: dict[str, Any], topk: Any) -> Any:
    """What the kernel computes, in torch: the same ``[Q, layers, 2]`` sums with every row's
    address from the offset tables (the host backend's stand-in for the kernel)."""
    import torch

    dev = topk.device
    t = topk.long()
    blk, slot = t // BLOCK_TOKENS, t % BLOCK_TOKENS
    sums = []
    for key, stride, row in (("mla", "mla_stride", MLA_ROW), ("idx", "idx_stride", IDX_ROW)):
        off = torch.tensor(tables[f"{key}_off"], dtype=torch.int64, device=dev)[None, :, None]
        addr = off + blk * tables[stride] + slot * row  # bytes, [Q, layers, k]
        word = addr[..., None] // 4 + torch.arange(row // 4, device=dev)
        sums.append(words[word].long().sum(dim=(-2, -1)))
    return wrap32(torch.stack(sums, dim=-1))


class SparseRead:
    """The loaded kernel of one CUDA device; ``launch`` reads ``topk`` ([Q, layers, k] int32)
    from ``base`` with ``tables`` into ``out`` ([Q, layers, 2] int32) on the current stream."""

    def __init__(self, ordinal: int) -> None:
        from vmmkv.alloc import driver
        from vmmkv.ops.build import arch_of_device

        self.ordinal, self.arch = ordinal, arch_of_device(ordinal)
        cubin = compile_kernel(self.arch)
        with driver.primary_context(ordinal):
            self.module = driver.call(driver.cu.cuModuleLoadData, cubin, device=ordinal)
            self.fn = driver.call(driver.cu.cuModuleGetFunction, self.module, b"sparse_read",
                                  device=ordinal)  # fmt: skip

    def launch(self, base: int, mla_off: Any, idx_off: Any, tables: dict[str, Any], topk: Any,
               out: Any) -> None:  # fmt: skip
        import torch

        from vmmkv.alloc import driver

        q, layers, k = topk.shape
        args = [ctypes.c_uint64(base), ctypes.c_uint64(mla_off.data_ptr()),
                ctypes.c_uint64(idx_off.data_ptr()), ctypes.c_int64(tables["mla_stride"]),
                ctypes.c_int64(tables["idx_stride"]), ctypes.c_uint64(topk.data_ptr()),
                ctypes.c_int32(layers), ctypes.c_int32(k), ctypes.c_uint64(out.data_ptr())]  # fmt: skip
        params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        stream = torch.cuda.current_stream(self.ordinal).cuda_stream
        with driver.primary_context(self.ordinal):
            driver.call(driver.cu.cuLaunchKernel, self.fn, q * layers, 1, 1, THREADS, 1, 1, 4 * k,
                        stream, ctypes.addressof(params), 0, kernel="sparse_read",
                        device=self.ordinal)  # fmt: skip


def fill_random(buf: Any, seed: int, piece: int = GiB) -> None:
    """Random bytes in [1, 255] over ``buf`` (uint8), ``piece`` bytes at a time."""
    import torch

    gen = torch.Generator(device=buf.device).manual_seed(seed)
    for start in range(0, buf.numel(), piece):
        part = buf[start : start + piece]
        part.copy_(torch.randint(1, 256, (part.numel(),), generator=gen, device=buf.device,
                                 dtype=torch.uint8))  # fmt: skip


def backings(cfg: dict[str, Any], nbytes: int) -> list[tuple[str, int | None]]:
    """``(name, chunk bytes or None for torch.empty)`` in the order they are measured."""
    return [("torch.empty", None)] + [(f"vmmkv {c} MiB", c * MiB) for c in cfg["chunks_mib"]]


def run_backing(cfg: dict[str, Any], dev: Any, chunk: int | None, topk: Any,
                checked: list[int], kernel: SparseRead | None) -> list[dict[str, Any]]:  # fmt: skip
    """Both layouts over one backing of the cache's bytes: checked, then timed (CUDA)."""
    import torch

    from vmmkv._util import round_up
    from vmmkv.alloc import VirtualRegion

    layers, blocks = cfg["layers"], cfg["blocks"]
    nbytes = blocks * layers * (MLA_BLOCK + IDX_BLOCK)
    region, t0 = None, time.perf_counter()
    if chunk is None:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    else:
        backend = "cuda" if dev.type == "cuda" else "host"
        region = VirtualRegion(round_up(nbytes, chunk), dev, chunk_bytes=chunk, backend=backend)
        region.commit(region.capacity_bytes)
        buf = region.tensor(torch.uint8)[:nbytes]
    rows = []
    try:
        fill_random(buf, cfg["seed"])
        setup_s = time.perf_counter() - t0
        words = buf.view(torch.int32)
        for layout in LAYOUTS:
            tables = layout_tables(layout, layers, blocks)
            assert tables["bytes"] == nbytes, (layout, tables["bytes"], nbytes)
            row: dict[str, Any] = {"layout": layout, "setup_s": round(setup_s, 2)}
            if chunk:
                row["chunk_MiB"] = chunk // MiB
            want = reference_sums(words, layout, layers, blocks, topk[checked])
            if kernel is None:
                t1 = time.perf_counter()
                got = flat_sums(words, tables, topk)
                times = [(time.perf_counter() - t1) * 1e3]
            else:
                got, times = run_kernel(kernel, buf, tables, topk, cfg)
            diff = (got[checked] != want).nonzero()
            row["check"] = "ok"
            if diff.numel():
                d = diff[0].tolist()
                row["check"] = (f"MISMATCH in {diff.shape[0]} sums, first (query {checked[d[0]]}, "
                                f"layer {d[1]}, {('mla', 'idx')[d[2]]}): got "
                                f"{int(got[checked][tuple(d)])}, want {int(want[tuple(d)])}")  # fmt: skip
            row["ms"] = median(times)
            row["GB_s"] = cfg["useful_bytes"] / (row["ms"] * 1e-3) / 1e9
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    finally:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if region is not None:
            region.close()  # device memory returns now; the caller empties torch's cache
    return rows


def run_kernel(kernel: SparseRead, buf: Any, tables: dict[str, Any], topk: Any,
               cfg: dict[str, Any]) -> tuple[Any, list[float]]:  # fmt: skip
    """The checked launch (into a poisoned output), then the timed ones; the output of the last
    timed launch must equal the checked one. Returns (sums as int64, ms per timed launch)."""
    import torch

    dev = buf.device
    base = buf.data_ptr()
    mla_off = torch.tensor(tables["mla_off"], dtype=torch.int64, device=dev)
    idx_off = torch.tensor(tables["idx_off"], dtype=torch.int64, device=dev)
    for off in (*tables["mla_off"], *tables["idx_off"]):
        if (base + off) % 16:  # 16-byte MLA loads (the indexer's need 4)
            raise ValueError(f"row base {base:#x} + {off} is not 16-byte aligned")
    out = torch.full((*topk.shape[:2], 2), POISON - (1 << 32), dtype=torch.int32, device=dev)
    kernel.launch(base, mla_off, idx_off, tables, topk, out)
    torch.cuda.synchronize(dev)
    checked = wrap32(out.long())
    for _ in range(cfg["warmup"]):
        kernel.launch(base, mla_off, idx_off, tables, topk, out)
    times = []
    for _ in range(cfg["reps"]):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        kernel.launch(base, mla_off, idx_off, tables, topk, out)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    if not torch.equal(wrap32(out.long()), checked):
        raise RuntimeError("the timed launches' sums differ from the checked launch's")
    return checked, times


def main() -> None:
    import torch

    ap = arguments(__doc__, "bench_sparse_read")
    ap.add_argument("--backend", default="auto", choices=("auto", "cuda", "host"))
    ap.add_argument("--gib", type=float, default=None, help="cache size (cuda 40, host 0.05)")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--queries", type=int, default=128, help="query tokens per launch")
    ap.add_argument("--topk", type=int, default=2048, help="token indices per query and layer")
    ap.add_argument("--chunks-mib", default="2,64", help="VirtualRegion chunk sizes (MiB)")
    ap.add_argument("--check-queries", type=int, default=4, help="queries checked in full")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    backend = resolve_backend(a.backend)
    gib = a.gib if a.gib is not None else (40.0 if backend == "cuda" else 0.05)
    blocks = int(gib * GiB) // (a.layers * (MLA_BLOCK + IDX_BLOCK))
    if not (blocks > 0 and a.layers > 0 and a.queries > 0 and 0 < a.topk <= 8192
            and 0 < a.check_queries and a.reps > 0 and a.warmup >= 0):  # fmt: skip
        ap.error("want a cache of >= 1 block, --layers, --queries, --check-queries, --reps > 0, "
                 "0 < --topk <= 8192 (the kernel stages the indices in shared memory)")  # fmt: skip
    chunks = [int(c) for c in a.chunks_mib.split(",") if c.strip()]
    tokens = blocks * BLOCK_TOKENS
    cfg = dict(backend=backend, gib=gib, layers=a.layers, blocks=blocks, tokens=tokens,
               queries=a.queries, topk=a.topk, chunks_mib=chunks, warmup=a.warmup, reps=a.reps,
               seed=a.seed, useful_bytes=a.queries * a.layers * a.topk * (MLA_ROW + IDX_ROW))  # fmt: skip
    dev = (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "cuda"
        else torch.device("cpu")
    )
    gen = torch.Generator(device=dev).manual_seed(a.seed + 1)
    topk = torch.randint(0, tokens, (a.queries, a.layers, a.topk), generator=gen, device=dev,
                         dtype=torch.int32)  # fmt: skip
    n = min(a.check_queries, a.queries)
    checked = sorted({round(i * (a.queries - 1) / max(n - 1, 1)) for i in range(n)})
    kernel = SparseRead(dev.index) if backend == "cuda" else None
    rows = []
    for name, chunk in backings(cfg, blocks):
        for row in run_backing(cfg, dev, chunk, topk, checked, kernel):
            rows.append({"backing": name, **row})
        if backend == "cuda":  # the torch.empty buffer is gone: give its 40 GiB back
            torch.cuda.empty_cache()
    base = next(
        (r["GB_s"] for r in rows if r["backing"] == "torch.empty" and r["layout"] == "LB"), None
    )
    for r in rows:
        r["vs_torch_LB"] = round(r["GB_s"] / base, 3) if base else None
    print(f"{device_name(backend)}: {gib:g} GiB cache ({blocks} blocks, {tokens} tokens, {a.layers} "
          f"layers), {a.queries} queries x {a.topk} top-k per layer; rows of {MLA_ROW} + {IDX_ROW} B; "
          f"GB/s of useful bytes ({cfg['useful_bytes'] / 1e9:.2f} GB per launch), "
          + (f"median of {a.reps}" if backend == "cuda" else "host: one pass of the torch "
             "stand-in, timings not meaningful"))  # fmt: skip
    print(
        table(
            rows,
            ["backing", "layout", "chunk_MiB", "ms", "GB_s", "vs_torch_LB", "check", "setup_s"],
        )
    )
    write_json(a.out, "bench_sparse_read", rows, device=device_name(backend), commit=git_commit(),
               command=[sys.executable, *sys.argv], settings={**cfg, "checked_queries": checked},
               kernel=None if kernel is None else {"arch": kernel.arch, "threads": THREADS})  # fmt: skip
    bad = [r for r in rows if r["check"] != "ok"]
    if bad:
        sys.exit(
            f"bench_sparse_read: {len(bad)} configuration(s) read wrong bytes: {bad[0]['check']}"
        )


if __name__ == "__main__":
    main()
