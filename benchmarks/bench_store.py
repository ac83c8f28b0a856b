"""Fused Main-KV + Indexer-K stores into 1..8 destinations, and barrier latency.

For T tokens and D destinations (distinct VMM regions on the one GPU, as peers would be):
- fused ``store_layer`` (one launch for both caches of a layer), timed two ways: eager calls
  (CUDA events around each call, Python launch cost included) and CUDA-graph replays (device
  time only); effective bandwidth = (bytes read once + bytes written per destination) / time;
- the unfused naive path: reference quantize (torch ops), then one index_put per destination;
- ceilings measured in the same run: a 1 GiB fill (write) and copy (read + write), and the launch
  of an empty kernel through the same launch path;
- barrier: 1 rank (eager and graph), 2 processes sharing the GPU, and torch symmetric memory's
  ``barrier()`` in a 1-rank group.
Medians after warm-up. Prints tables, writes JSON (``--out``). Needs CUDA.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import median, table, write_json  # noqa: E402

BS = 64
MLA, IDX = 656, 132
READ_PER_TOKEN = 512 * 2 + 64 * 2 + 128 * 2 + 8  # kv_c, k_pe, k (bf16), slot (int64)


def _events_ms(fn, iters):
    import torch

    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return median(times)


def _graph_ms(fn, iters, inner=10):
    """Median over ``iters`` replays of a graph holding ``inner`` calls, per call."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        fn()
        g.capture_begin()
        for _ in range(inner):
            fn()
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    return _events_ms(g.replay, iters) / inner


def ceilings(iters):
    import torch

    from vmmkv.ops import launch

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    src.fill_(1)
    fill_ms = _events_ms(lambda: src.fill_(7), iters)
    copy_ms = _events_ms(lambda: dst.copy_(src), iters)
    noop = launch.Kernel("vmmkv_noop", "")
    ordinal = torch.cuda.current_device()
    empty_eager = _events_ms(lambda: noop.launch(ordinal, 1, 32), iters * 5)
    empty_graph = _graph_ms(lambda: noop.launch(ordinal, 1, 32), iters)
    return {
        "fill_GBps": n / fill_ms / 1e6,
        "copy_GBps": 2 * n / copy_ms / 1e6,
        "empty_launch_eager_us": empty_eager * 1e3,
        "empty_launch_graph_us": empty_graph * 1e3,
    }


def store_sweep(tokens, dests, iters):
    import torch

    from vmmkv import ops
    from vmmkv.alloc import VirtualRegion
    from vmmkv.ops import reference as ref
    from vmmkv.ops.kv import KVTarget

    tmax = max(tokens)
    nblk = -(-tmax // BS)
    mla_bytes, idx_bytes = nblk * BS * MLA, nblk * BS * IDX
    gran = 2 << 20
    cap = -(-(mla_bytes + idx_bytes) // gran) * gran
    regions = [VirtualRegion(cap, 0, chunk_bytes=cap, backend="cuda") for _ in range(max(dests))]
    for r in regions:
        r.commit(cap)
    committed = torch.tensor([cap], dtype=torch.int64, device="cuda")
    errors = torch.zeros(1, dtype=torch.int32, device="cuda")
    local = regions[0].tensor()
    ops.warm_up(0)
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for d in dests:
        table_t = torch.tensor([r.base_ptr for r in regions[:d]], dtype=torch.int64, device="cuda")
        geo = dict(
            ptr_table=table_t,
            my_rank=0,
            num_blocks=nblk,
            block_size=BS,
            committed_bytes=committed,
            error_counter=errors,
        )
        mla_t = KVTarget(kind="fp8_ds_mla", offset_bytes=0, block_stride=BS * MLA,
                         entry_stride=MLA, entry_bytes=MLA, cache=local[:mla_bytes], **geo)  # fmt: skip
        idx_t = KVTarget(kind="indexer_k", offset_bytes=mla_bytes, block_stride=BS * IDX,
                         entry_stride=IDX, entry_bytes=IDX,
                         cache=local[mla_bytes : mla_bytes + idx_bytes], **geo)  # fmt: skip
        views = [
            (
                r.tensor()[:mla_bytes].view(nblk, BS, MLA),
                r.tensor()[mla_bytes : mla_bytes + idx_bytes].view(nblk, BS, IDX),
            )
            for r in regions[:d]
        ]
        for t in tokens:
            kv_c = torch.randn(t, 512, device="cuda", generator=g).bfloat16()
            k_pe = torch.randn(t, 64, device="cuda", generator=g).bfloat16()
            k = torch.randn(t, 128, device="cuda", generator=g).bfloat16()
            slots = torch.randperm(nblk * BS, device="cuda", generator=g)[:t]

            def fused(kv_c=kv_c, k_pe=k_pe, k=k, slots=slots, mla_t=mla_t, idx_t=idx_t):
                ops.store_layer(mla_t, idx_t, kv_c, k_pe, k, slots)

            def unfused(kv_c=kv_c, k_pe=k_pe, k=k, slots=slots, views=views):
                entries = ref.quantize_ds_mla(kv_c, k_pe)
                vals, scales = ref.quantize_indexer_k(k)
                scale_bytes = scales.contiguous().view(torch.uint8).view(-1, 4)
                blk, off = slots // BS, slots % BS
                for mla_v, idx_v in views:
                    mla_v[blk, off] = entries
                    flat = idx_v.view(nblk, BS * IDX)
                    flat[:, : BS * 128].view(nblk, BS, 128)[blk, off] = vals
                    flat[:, BS * 128 :].view(nblk, BS, 4)[blk, off] = scale_bytes

            for _ in range(3):
                fused()
                unfused()
            torch.cuda.synchronize()
            eager = _events_ms(fused, iters)
            graph = _graph_ms(fused, iters)
            naive = _events_ms(unfused, max(5, iters // 4))
            nbytes = t * READ_PER_TOKEN + t * (MLA + IDX) * d
            rows.append(
                {
                    "T": t,
                    "dests": d,
                    "fused_eager_us": eager * 1e3,
                    "fused_graph_us": graph * 1e3,
                    "unfused_us": naive * 1e3,
                    "unfused/fused": naive / eager,
                    "eff_GBps": nbytes / graph / 1e6,
                }
            )
            print(f"T={t} dests={d} done", file=sys.stderr, flush=True)
    for r in regions:
        r.close()
    return rows


def barrier_one_rank(iters):
    import torch

    from vmmkv import ops

    sig = torch.zeros(2 * 1 * 1, dtype=torch.int32, device="cuda")
    table_t = torch.tensor([sig.data_ptr()], dtype=torch.int64, device="cuda")
    bar = ops.DeviceBarrier(table_t, None, 0, 1, 1, "cuda:0")
    for _ in range(5):
        bar.arrive_and_wait(0)
    torch.cuda.synchronize()
    out = {
        "eager_us": _events_ms(lambda: bar.arrive_and_wait(0), iters) * 1e3,
        "graph_us": _graph_ms(lambda: bar.arrive_and_wait(0), iters) * 1e3,
    }
    bar.close()
    return out


def _barrier_rank(rank, world, port, iters, q):
    import torch
    import torch.distributed as dist

    from vmmkv import ops
    from vmmkv.ipc import SymmetricRegion

    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}")  # fmt: skip
    try:
        sr = SymmetricRegion(2 << 20, "cuda:0", initial_bytes=2 << 20, backend="cuda")
        bar = ops.DeviceBarrier(sr.peers.signal_table, None, rank, world, 1, "cuda:0")
        for _ in range(5):
            bar.arrive_and_wait(0)
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            bar.arrive_and_wait(0)
        torch.cuda.synchronize()
        per = (time.perf_counter() - t0) / iters
        dist.barrier()
        bar.close()
        sr.close()
        q.put((rank, per))
    finally:
        dist.destroy_process_group()


def barrier_two_processes(iters):
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_barrier_rank, args=(r, 2, port, iters, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    return {"per_barrier_us (host clock, back-to-back)": max(res.values()) * 1e6}


def symm_mem_barrier(iters):
    import socket

    import torch
    import torch.distributed as dist

    try:
        import torch.distributed._symmetric_memory as symm_mem
    except Exception as exc:
        return {"error": str(exc)}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    try:
        t = symm_mem.empty(1 << 20, dtype=torch.uint8, device="cuda:0")
        h = symm_mem.rendezvous(t, dist.group.WORLD.group_name)
        for _ in range(5):
            h.barrier()
        torch.cuda.synchronize()
        return {
            "eager_us": _events_ms(h.barrier, iters) * 1e3,
            "graph_us": _graph_ms(h.barrier, iters) * 1e3,
        }
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,16,256,4096,16384,65536")
    ap.add_argument("--dests", default="1,2,4,8")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default="bench-out/bench_store.json")
    a = ap.parse_args()
    tokens = [int(x) for x in a.tokens.split(",")]
    dests = [int(x) for x in a.dests.split(",")]
    ceil = ceilings(a.iters)
    rows = store_sweep(tokens, dests, a.iters)
    for r in rows:
        r["eff/fill"] = r["eff_GBps"] / ceil["fill_GBps"]
        r["eager/empty_launch"] = r["fused_eager_us"] / ceil["empty_launch_eager_us"]
    bar = {
        "vmmkv 1 rank": barrier_one_rank(a.iters),
        "vmmkv 2 processes on one GPU": barrier_two_processes(a.iters),
        "torch symm_mem 1 rank": symm_mem_barrier(a.iters),
    }
    print("ceilings (same run):", {k: round(v, 2) for k, v in ceil.items()})
    print(table(rows, list(rows[0])))
    print("barrier latency (median):")
    for k, v in bar.items():
        print(f"  {k:<32} {v}")
    write_json(a.out, "bench_store", rows, ceilings=ceil, barrier=bar)


if __name__ == "__main__":
    main()
