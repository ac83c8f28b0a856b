"""Fused Main-KV + Indexer-K stores into 1..8 destinations, and barrier latency.

For T tokens and D destinations (distinct VMM regions on the one GPU, as peers would be):
- fused ``store_layer`` (one launch for both caches of a layer), timed two ways: eager calls
  (CUDA events around each call, Python launch cost included) and CUDA-graph replays (device
  time only); effective bandwidth = (bytes read once + bytes written per destination) / time;
- the unfused naive path: reference quantize (torch ops), then one index_put per destination;
- ceilings measured in the same run: a 1 GiB fill (write) and copy (read + write), the launch
  of an empty kernel through the same launch path, and copies of 8, 26 and 52 MB between two
  local buffers three ways (benchmarks/ceiling.py: the copy engine, an SM kernel of full 128-B
  lines in 16-B stores, with and without ``L1::no_allocate``, and TMA bulk stores from shared
  memory; graph replays, bytes copied per second, each copy checked once); the 1-destination
  rows from ``BW_MIN_T`` tokens on get ``store/best ceiling``: bytes written per second
  (``T * (656 + 132)`` / graph time) over the best copy's at the closest size;
- barrier: 1 rank (eager and graph), 2 processes sharing the GPU, and torch symmetric memory's
  ``barrier()`` in a 1-rank group.
``--pcp N`` instead runs N ranks (one process per GPU when there are N GPUs, else sharing one)
over a ``SymmetricRegion`` and prints, side by side: the eager host time per layer step (store +
barrier in two launches vs ``publish`` in one; functional API vs ``vmmkv.ops.prepare``), the
graph-replayed device time of both, the barrier vs torch symmetric memory's (eager, graph) and
the publish bandwidth vs a peer copy of the same bytes through the same mapping. Each rank
also copies 8, 26 and 52 MB into its peer's replica (rank + 1, all ranks at once) the same
three ways as above; every bandwidth row gets ``best ceiling GB/s`` (the best of them at the
size closest to the row's ``T * (656 + 132)`` bytes) and ``publish/best ceiling`` (the per-peer
publish GB/s over it), and the ceilings table is printed (slowest rank per method).
``--host-cost`` (one process) breaks the host time of one prepared publish into its stages
(perf_counter_ns) and compares the empty-kernel launch with torch's own launches;
``--host-cost --cpu`` measures the same Python without a GPU (driver calls as no-ops).
Medians after warm-up. Prints tables, writes JSON (``--out``). Needs CUDA (but ``--host-cost --cpu``).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import ceiling  # noqa: E402
from common import (  # noqa: E402
    arguments,
    median,
    own_layer_targets,
    per_call_ns,
    table,
    write_json,
)

BS = 64
MLA, IDX = 656, 132
READ_PER_TOKEN = 512 * 2 + 64 * 2 + 128 * 2 + 8  # kv_c, k_pe, k (bf16), slot (int64)
SLOT_PATTERNS = ("runs", "blocks", "random")
DEFAULT_PATTERNS = ("runs", "random")  # the tables' columns; `blocks` only on request (--slots)


def slot_mapping(pattern, t, span, base, device, generator):
    """int64 slots of ``t`` tokens inside ``[base, base + span)`` (``span`` a multiple of
    ``BS``). ``runs``: consecutive slots from ``base``, what an engine's prefill writes into a
    block table of consecutive blocks (a prompt's tokens go to consecutive slots of its blocks;
    ``slots`` in the tables). ``blocks``: the same into a fragmented block table, whole blocks
    of consecutive slots, the blocks distinct and in random order. ``random``: distinct slots in
    random order, every token in a different place (the worst case: each entry's partial 32-byte
    sectors and each 4-byte indexer scale land alone)."""
    import torch

    if pattern == "runs":
        return torch.arange(base, base + t, device=device)
    if pattern == "blocks":
        if span % BS:
            raise ValueError(f"span {span} is not a multiple of the block size {BS}")
        order = torch.randperm(span // BS, device=device, generator=generator)[: -(-t // BS)]
        within = torch.arange(BS, device=device)
        return (order[:, None] * BS + within).reshape(-1)[:t] + base
    if pattern == "random":
        return torch.randperm(span, device=device, generator=generator)[:t] + base
    raise ValueError(f"slot pattern must be one of {SLOT_PATTERNS}, got {pattern!r}")


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
    """1 GiB fill and copy (eager, CUDA events), the empty-kernel launch, and ``copies``: the
    local copy ceilings of benchmarks/ceiling.py (GB/s = bytes copied per second)."""
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
    # local copies at the ceiling sizes, three ways, in the same two buffers
    copies = ceiling.measure(ordinal, dst, src, lambda fn: _graph_ms(fn, iters))
    return {
        "fill_GBps": n / fill_ms / 1e6,
        "copy_GBps": 2 * n / copy_ms / 1e6,
        "empty_launch_eager_us": empty_eager * 1e3,
        "empty_launch_graph_us": empty_graph * 1e3,
        "copies": copies,
    }


def store_sweep(tokens, dests, iters, patterns=DEFAULT_PATTERNS):
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
    sig1 = torch.zeros(2, dtype=torch.int32, device="cuda")
    bar1 = ops.DeviceBarrier(
        torch.tensor([sig1.data_ptr()], dtype=torch.int64, device="cuda"), None, 0, 1, 1, "cuda:0"
    )
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
        prepared = ops.prepare((mla_t, idx_t))
        views = [
            (
                r.tensor()[:mla_bytes].view(nblk, BS, MLA),
                r.tensor()[mla_bytes : mla_bytes + idx_bytes].view(nblk, BS, IDX),
            )
            for r in regions[:d]
        ]
        for t, pattern in [(t, p) for t in tokens for p in patterns]:
            kv_c = torch.randn(t, 512, device="cuda", generator=g).bfloat16()
            k_pe = torch.randn(t, 64, device="cuda", generator=g).bfloat16()
            k = torch.randn(t, 128, device="cuda", generator=g).bfloat16()
            slots = slot_mapping(pattern, t, nblk * BS, 0, "cuda", g)

            def fused(kv_c=kv_c, k_pe=k_pe, k=k, slots=slots, mla_t=mla_t, idx_t=idx_t):
                ops.store_layer(mla_t, idx_t, kv_c, k_pe, k, slots)

            def published(kv_c=kv_c, k_pe=k_pe, k=k, slots=slots, p=prepared):
                p.publish((kv_c, k_pe, k), slots, 0, bar1, 0)

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
            pub_graph = _graph_ms(published, iters)
            naive = _events_ms(unfused, max(5, iters // 4))
            nbytes = t * READ_PER_TOKEN + t * (MLA + IDX) * d
            rows.append(
                {
                    "T": t,
                    "dests": d,
                    "slots": pattern,
                    "fused_eager_us": eager * 1e3,
                    "fused_graph_us": graph * 1e3,
                    "publish_1rank_graph_us": pub_graph * 1e3,
                    "unfused_us": naive * 1e3,
                    "unfused/fused": naive / eager,
                    "eff_GBps": nbytes / graph / 1e6,
                }
            )
            print(f"T={t} dests={d} slots={pattern} done", file=sys.stderr, flush=True)
    bar1.close()
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


def _barrier_rank(rank, world, iters):
    """One rank of ``barrier_two_processes``, in the spawner's gloo group: seconds per barrier."""
    import torch
    import torch.distributed as dist

    from vmmkv import ops
    from vmmkv.ipc import SymmetricRegion

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
    return per


def barrier_two_processes(iters):
    from vmmkv.testing.spawn import run_world

    per = run_world(_barrier_rank, 2, args=(iters,), timeout=300)
    return {"per_barrier_us (host clock, back-to-back)": max(per) * 1e6}


def symm_mem_barrier(iters):
    import torch
    import torch.distributed as dist

    try:
        import torch.distributed._symmetric_memory as symm_mem
    except Exception as exc:
        return {"error": str(exc)}
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    # a world of this one process: an in-process store, no port
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
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


# ---------------------------------------------------------------------------------------------
# --pcp N: N ranks over a SymmetricRegion (one process per GPU, or sharing one GPU)

PCP_TOKENS = (1, 16, 256, 2048, 8192, 65536)
EAGER_MAX_T = 8192  # eager host-time rows (larger T is device bound)
BW_MIN_T = 8192  # bandwidth rows
# steps per captured graph in the PCP rows: the ranks start their replays up to a few µs apart
# and the first barrier of a replay absorbs that skew, so it is amortized over 100 steps
PCP_INNER = 100


def _host_us(fn, n, reps, sync_group):
    """(host µs per call, wall µs per call incl. the final synchronize), medians over ``reps``
    loops of ``n`` back-to-back calls; every rank starts each loop together."""
    import torch

    host, wall = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        sync_group()
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        t1 = time.perf_counter_ns()
        torch.cuda.synchronize()
        t2 = time.perf_counter_ns()
        host.append((t1 - t0) / n / 1e3)
        wall.append((t2 - t0) / n / 1e3)
    return median(host), median(wall)


def _steps(ops, mla_t, idx_t, prepared, bar, inputs, slots):
    """The five layer steps the PCP benchmark compares, over the same inputs."""
    kv_c, k_pe, k = inputs

    def two_functional():
        ops.store_layer(mla_t, idx_t, kv_c, k_pe, k, slots)
        bar.arrive_and_wait(0)

    def one_functional():
        ops.publish_layer(mla_t, idx_t, kv_c, k_pe, k, slots, barrier=bar)

    def two_prepared():
        prepared.store(inputs, slots)
        bar.arrive_and_wait(0)

    def one_prepared():
        prepared.publish(inputs, slots, 0, bar, 0)

    def store_only():
        prepared.store(inputs, slots)

    return two_functional, one_functional, two_prepared, one_prepared, store_only


def _pcp_rank(rank, world, tokens, iters, patterns=DEFAULT_PATTERNS):
    import torch
    import torch.distributed as dist

    from vmmkv import ops
    from vmmkv.ipc import SymmetricRegion
    from vmmkv.ops.kv import KVTarget

    ngpu = torch.cuda.device_count()
    dev = torch.device("cuda", rank if ngpu >= world else 0)
    torch.cuda.set_device(dev)
    tmax = max(tokens)
    nb_rank = -(-tmax // BS)
    nb = world * nb_rank
    mla_bytes, idx_bytes = nb * BS * MLA, nb * BS * IDX
    gran = 2 << 20
    # room for the largest copy ceiling too (written from the start of the peer's replica)
    cap = -(-max(mla_bytes + idx_bytes, max(ceiling.SIZES)) // gran) * gran
    sr = SymmetricRegion(cap, dev, initial_bytes=cap, backend="cuda")
    out: dict = {"rank": rank, "device": str(dev), "shared_gpu": ngpu < world, "rows": []}
    try:
        region = sr.region.tensor()
        err = torch.zeros(1, dtype=torch.int32, device=dev)
        geo = dict(ptr_table=sr.peers.ptr_table, my_rank=rank, num_blocks=nb, block_size=BS,
                   committed_bytes=sr.committed_table, error_counter=err, cache=region)  # fmt: skip
        mla_t = KVTarget(kind="fp8_ds_mla", offset_bytes=0, block_stride=BS * MLA,
                         entry_stride=MLA, entry_bytes=MLA, **geo)  # fmt: skip
        idx_t = KVTarget(kind="indexer_k", offset_bytes=mla_bytes, block_stride=BS * IDX,
                         entry_stride=IDX, entry_bytes=IDX, **geo)  # fmt: skip
        bar = ops.DeviceBarrier(sr.peers.signal_table, None, rank, world, 1, dev, timeout_s=60,
                                fence=region)  # fmt: skip
        ops.warm_up(dev)
        prepared = ops.prepare((mla_t, idx_t))
        g = torch.Generator(device=dev).manual_seed(rank)
        sync = dist.barrier

        for t, pattern in [(t, p) for t in tokens for p in patterns]:
            kv_c = torch.randn(t, 512, device=dev, generator=g).bfloat16()
            k_pe = torch.randn(t, 64, device=dev, generator=g).bfloat16()
            k = torch.randn(t, 128, device=dev, generator=g).bfloat16()
            slots = slot_mapping(pattern, t, nb_rank * BS, rank * nb_rank * BS, dev, g)
            inputs = (kv_c, k_pe, k)

            two_functional, one_functional, two_prepared, one_prepared, store_only = _steps(
                ops, mla_t, idx_t, prepared, bar, inputs, slots
            )
            for f in (two_functional, one_functional, two_prepared, one_prepared):
                f()
            torch.cuda.synchronize()
            row = {"T": t, "slots": pattern}
            if t <= EAGER_MAX_T and pattern == patterns[0]:  # host time: slots do not matter
                for name, f in (("2 launches", two_functional), ("1 launch", one_functional),
                                ("2 launches prepared", two_prepared),
                                ("1 launch prepared", one_prepared)):  # fmt: skip
                    host, wall = _host_us(f, 100, 5, sync)
                    row[f"eager host us: {name}"] = host
                    row[f"eager wall us: {name}"] = wall
            sync()
            row["graph us: 2 launches"] = _graph_ms(two_prepared, iters, PCP_INNER) * 1e3
            sync()
            row["graph us: 1 launch"] = _graph_ms(one_prepared, iters, PCP_INNER) * 1e3
            if t >= BW_MIN_T:
                sync()
                alone = _graph_ms(store_only, iters, PCP_INNER)  # no barrier: ranks need not meet
                peer_bytes = t * (MLA + IDX) * (world - 1)
                row["graph us: store only"] = alone * 1e3
                row["publish GB/s to peers"] = peer_bytes / (row["graph us: 1 launch"] * 1e3)
                row["store GB/s to peers"] = peer_bytes / (alone * 1e6)
                peer = (rank + 1) % world
                dst = sr.peers.view(peer)[: t * (MLA + IDX)]
                src = torch.empty(t * (MLA + IDX), dtype=torch.uint8, device=dev)
                sync()
                copy = _graph_ms(lambda dst=dst, src=src: dst.copy_(src), iters, PCP_INNER)
                row["peer copy GB/s"] = t * (MLA + IDX) / (copy * 1e6)
                row["publish/peer copy"] = (  # per peer
                    row["publish GB/s to peers"] / (world - 1) / row["peer copy GB/s"]
                )
            out["rows"].append(row)
            sync()
        # copy ceilings into the peer's replica (every rank at once, after the publish rows so
        # that those run on the memory as before), then each bandwidth row against the best
        peer = (rank + 1) % world
        csrc = torch.empty(max(ceiling.SIZES), dtype=torch.uint8, device=dev)
        sync()
        ceil = ceiling.measure(dev.index, sr.peers.view(peer), csrc,
                               lambda fn: _graph_ms(fn, iters, PCP_INNER), before=sync)  # fmt: skip
        del csrc
        out["ceilings"] = ceil
        for row in out["rows"]:
            if "publish GB/s to peers" in row:
                best = ceiling.best_at(ceil, row["T"] * (MLA + IDX))
                row["best ceiling GB/s"] = best
                row["publish/best ceiling"] = row["publish GB/s to peers"] / (world - 1) / best
        # the barrier alone: vmmkv vs torch symmetric memory (same ranks, same run)
        sync()
        out["barrier vmmkv eager us"] = _events_ms(lambda: bar.arrive_and_wait(0), iters) * 1e3
        out["barrier vmmkv eager host us"] = _host_us(lambda: bar.arrive_and_wait(0), 100, 5,
                                                      sync)[0]  # fmt: skip
        sync()
        barrier_graph = _graph_ms(lambda: bar.arrive_and_wait(0), iters, PCP_INNER)
        out["barrier vmmkv graph us"] = barrier_graph * 1e3
        torch.cuda.synchronize()
        sync()
        out["epochs"] = bar.epochs.tolist()
        out["out_of_range"] = int(err.item())
        bar.close()
        return out
    finally:
        sr.close()


def _symm_mem_rank(rank, world, iters):
    """torch symmetric memory's barrier on the same ranks (own processes: a failure or hang
    there must not cost the vmmkv numbers)."""
    import torch
    import torch.distributed as dist

    ngpu = torch.cuda.device_count()
    dev = torch.device("cuda", rank if ngpu >= world else 0)
    torch.cuda.set_device(dev)
    sync = dist.barrier
    try:
        import torch.distributed._symmetric_memory as symm_mem

        t = symm_mem.empty(1 << 20, dtype=torch.uint8, device=dev)
        h = symm_mem.rendezvous(t, dist.group.WORLD.group_name)
        for _ in range(5):
            h.barrier()
        torch.cuda.synchronize()
        sync()
        res = {"barrier torch symm_mem eager us": _events_ms(h.barrier, iters) * 1e3}
        res["barrier torch symm_mem eager host us"] = _host_us(h.barrier, 100, 5, sync)[0]
        sync()
        res["barrier torch symm_mem graph us"] = _graph_ms(h.barrier, iters, PCP_INNER) * 1e3
        return res
    except Exception as exc:
        return {"barrier torch symm_mem": f"{type(exc).__name__}: {exc}"[:300]}


def pcp(world, tokens, iters, patterns=DEFAULT_PATTERNS):
    from vmmkv.testing.spawn import run_world, run_world_raw

    per_rank = run_world(_pcp_rank, world, args=(tokens, iters, patterns), timeout=900)
    try:
        symm = run_world_raw(_symm_mem_rank, world, args=(iters,), timeout=180)
        for r, res in zip(per_rank, symm, strict=True):
            r.update(res.value if res.ok else {"barrier torch symm_mem": res.error[-300:]})
    except Exception as exc:
        per_rank[0]["barrier torch symm_mem"] = f"{type(exc).__name__}: {exc}"[:300]
    rows = []
    for i, r0 in enumerate(per_rank[0]["rows"]):
        row = {"T": r0["T"], "slots": r0["slots"]}
        for key in r0:
            if key in row:
                continue
            vals = [r["rows"][i][key] for r in per_rank]
            worst = min if "GB/s" in key or "/" in key else max
            row[key] = worst(vals)  # the slowest rank
        rows.append(row)
    keys = {k for r in per_rank for k in r} - {"rows", "rank", "device", "ceilings"}
    summary = {}
    for k in sorted(keys):
        vals = [r[k] for r in per_rank if k in r]
        summary[k] = max(vals) if all(isinstance(v, float) for v in vals) else vals[0]
    summary["devices"] = [r["device"] for r in per_rank]
    summary["ceilings"] = ceiling.slowest([r["ceilings"] for r in per_rank])
    summary["ceilings per rank"] = [r["ceilings"] for r in per_rank]
    return rows, summary


def ceiling_columns(rows):
    """The columns of a copy-ceilings table: size, each method measured, the best."""
    methods = [f"{m} GB/s" for m in ceiling.METHODS if any(f"{m} GB/s" in r for r in rows)]
    return ["MB", *methods, ceiling.BEST, "best"]


# ---------------------------------------------------------------------------------------------
# --host-cost: where the host time of one eager prepared publish goes


def host_cost(tokens=16):
    import torch

    from vmmkv import ops
    from vmmkv.ops import launch
    from vmmkv.ops.kv import _grid

    dev = torch.device("cuda", 0)
    ops.warm_up(dev)
    mla_t, idx_t = own_layer_targets(4, dev, BS)
    region = mla_t.cache
    sig = torch.zeros(2, dtype=torch.int32, device=dev)
    bar = ops.DeviceBarrier(torch.tensor([sig.data_ptr()], dtype=torch.int64, device=dev), None,
                            0, 1, 1, dev, fence=region)  # fmt: skip
    p = ops.prepare((mla_t, idx_t))
    kv_c = torch.randn(tokens, 512, device=dev).bfloat16()
    k_pe = torch.randn(tokens, 64, device=dev).bfloat16()
    k = torch.randn(tokens, 128, device=dev).bfloat16()
    slots = torch.arange(tokens, device=dev)
    inputs = (kv_c, k_pe, k)
    _, _, values = p._values(inputs, slots, 0)
    args = bar.barrier_args(0)
    lp = p._publish
    grid = _grid(tokens)
    stream = launch._current_stream(0)
    res: dict = {"T": tokens}

    def show(key, ns):
        res[key] = ns / 1e3
        print(f"  {key:<58} {ns / 1e3:8.2f} us", flush=True)

    print(f"host time per call, T={tokens} (median of loops of 200 calls):", flush=True)
    show("stage: torch.compiler.is_compiling()", per_call_ns(torch.compiler.is_compiling))
    show(
        "stage: validate + collect values + grid (_values)",
        per_call_ns(lambda: p._values(inputs, slots, 0)),
    )
    show("  of which reading the tensors' attributes", per_call_ns(_attribute_reads(inputs, slots)))
    show("stage: barrier.barrier_args(lane)", per_call_ns(lambda: bar.barrier_args(0)))
    show(
        "stage: pack parameters in place",
        per_call_ns(lambda: lp._pack(lp._buf, lp._offset, *values, args)),
    )
    show("stage: current stream lookup", per_call_ns(lambda: launch._current_stream(0)))
    fn, params = lp._fn, lp._params
    show(
        "stage: cuLaunchKernel (cuda.bindings)",
        per_call_ns(lambda: launch._cu_launch(fn, grid, 1, 1, 256, 1, 1, 0, stream, params, 0)),
    )
    show("total: PreparedStore.publish", per_call_ns(lambda: p.publish(inputs, slots, 0, bar, 0)))
    show("total: PreparedStore.store", per_call_ns(lambda: p.store(inputs, slots)))
    show(
        "total: publish_layer (functional)",
        per_call_ns(lambda: ops.publish_layer(mla_t, idx_t, kv_c, k_pe, k, slots, barrier=bar)),
    )
    show(
        "total: store_layer (functional)",
        per_call_ns(lambda: ops.store_layer(mla_t, idx_t, kv_c, k_pe, k, slots)),
    )
    show("total: DeviceBarrier.arrive_and_wait", per_call_ns(lambda: bar.arrive_and_wait(0)))
    noop_old = launch.Kernel("vmmkv_noop", "")
    show(
        "empty kernel: Kernel.launch (functional path)",
        per_call_ns(lambda: noop_old.launch(0, 1, 32)),
    )
    noop = launch.PreparedLaunch(launch.NOOP, 0, 32)
    show("empty kernel: PreparedLaunch (cuda.bindings)", per_call_ns(lambda: noop.launch(1)))
    x = torch.zeros(1, device=dev)
    show("torch: torch.cuda._sleep(0)", per_call_ns(lambda: torch.cuda._sleep(0)))
    show("torch: x.add_(1) on 1 element", per_call_ns(lambda: x.add_(1)))
    show("torch: x.fill_(1) on 1 element", per_call_ns(lambda: x.fill_(1)))
    # libcuda through ctypes last: a wrong signature would crash here, after the rest printed
    noop_c = launch.PreparedLaunch(launch.NOOP, 0, 32, api="ctypes")
    show("empty kernel: PreparedLaunch (ctypes)", per_call_ns(lambda: noop_c.launch(1)))
    saved = p._publish
    p._publish = launch.PreparedLaunch(launch.STORE_LAYER_BARRIER, 0, 256,
                                       tuple(t._dest for t in p.targets), api="ctypes")  # fmt: skip
    show(
        "total: PreparedStore.publish (ctypes launch)",
        per_call_ns(lambda: p.publish(inputs, slots, 0, bar, 0)),
    )
    p._publish = saved
    torch.cuda.synchronize()
    res["epochs"] = bar.epochs.tolist()
    bar.close()
    return res


def _attribute_reads(inputs, slots):
    """What ``_values`` reads of every tensor (dtype, shape, stride, device index, address):
    the floor of its cost in Python."""
    tensors = (*inputs, slots)

    def reads():
        for t in tensors:
            t.dtype, t.shape, t.stride(), t.get_device(), t.data_ptr()

    return reads


def host_cost_cpu(tokens=16):
    """``--host-cost --cpu``: the Python around ``cuLaunchKernel`` without a GPU: a layer's
    prepared store over CPU tensors (the targets' device index is patched to -1, the CPU's
    ``get_device()``) and a stand-alone barrier, with kernel loading, the stream lookup and
    the driver call replaced by no-ops. Measures this tree's Python only (validation, packing,
    glue); the GPU run's stages add the driver's own time."""
    from unittest import mock

    import torch

    from vmmkv.ops import barrier as barrier_mod
    from vmmkv.ops import build, launch, prepared

    class Loaded:
        def function(self, name):
            return name

    ok = launch._CU_SUCCESS
    mla_t, idx_t = own_layer_targets(4, "cpu", BS)
    kv_c = torch.randn(tokens, 512).bfloat16()
    k_pe = torch.randn(tokens, 64).bfloat16()
    k = torch.randn(tokens, 128).bfloat16()
    slots = torch.arange(tokens)
    inputs = (kv_c, k_pe, k)
    res: dict = {"T": tokens}

    def show(key, ns):
        res[key] = ns / 1e3
        print(f"  {key:<58} {ns / 1e3:8.2f} us", flush=True)

    with (
        mock.patch.object(build, "load_module", lambda ordinal: Loaded()),
        mock.patch.object(launch, "_cu_launch", lambda *args: (ok,)),
        mock.patch.object(launch, "stream_handle", lambda ordinal: 0),
        mock.patch.object(prepared._kv, "_check_cuda", lambda device: -1),
    ):
        p = prepared.PreparedStore((mla_t, idx_t), ("fp8_ds_mla", "indexer_k"), True)
        # a DeviceBarrier's state on CPU tensors (what __init__ sets; it needs CUDA)
        bar = object.__new__(barrier_mod.DeviceBarrier)
        bar.sig_table = torch.zeros(1, dtype=torch.int64)
        bar.epochs = torch.zeros(1, dtype=torch.int32)
        bar.rank, bar.world, bar.lanes, bar.ordinal = 0, 1, 1, -1
        bar.timeout_ns, bar._diag_dev_ptr, bar._threads, bar._closed = 10**10, 0, 32, False
        bar._launches, bar.fence, bar._blocked, bar._error = [None], [], False, None
        bar._args = (launch.BARRIER_ARGS.pack(0, 0, 0, 0, 0, 10**10, 0, 0, 1, 0),)
        print(f"host time per call without the driver, T={tokens} (CPU tensors):", flush=True)
        show(
            "stage: validate + collect values + grid (_values)",
            per_call_ns(lambda: p._values(inputs, slots, 0), sync=None),
        )
        show(
            "  of which reading the tensors' attributes",
            per_call_ns(_attribute_reads(inputs, slots), sync=None),
        )
        show(
            "total: PreparedStore.publish, no-op driver",
            per_call_ns(lambda: p.publish(inputs, slots, 0, bar, 0), sync=None),
        )
        show(
            "total: PreparedStore.store, no-op driver",
            per_call_ns(lambda: p.store(inputs, slots), sync=None),
        )
        show(
            "total: DeviceBarrier.arrive_and_wait, no-op driver",
            per_call_ns(lambda: bar.arrive_and_wait(0), sync=None),
        )
    return res


def main() -> None:
    ap = arguments(__doc__, "bench_store")
    ap.add_argument("--tokens", default="1,16,256,4096,16384,65536")
    ap.add_argument("--dests", default="1,2,4,8")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--slots", default=",".join(DEFAULT_PATTERNS),
                    help=f"slot patterns, comma-separated, of {SLOT_PATTERNS}")  # fmt: skip
    ap.add_argument("--pcp", type=int, default=0, help="run the N-rank publish benchmark only")
    ap.add_argument("--host-cost", action="store_true", help="host time breakdown only")
    ap.add_argument("--cpu", action="store_true", help="with --host-cost: no GPU, no driver")
    a = ap.parse_args()
    patterns = tuple(a.slots.split(","))
    for p in patterns:
        if p not in SLOT_PATTERNS:
            ap.error(f"--slots: {p!r} is not one of {SLOT_PATTERNS}")
    if a.host_cost and a.cpu:
        write_json(a.out, "bench_store_host_cost_cpu", [host_cost_cpu(16), host_cost_cpu(2048)])
        return
    if a.host_cost:
        write_json(a.out, "bench_store_host_cost", [host_cost(16), host_cost(2048)])
        return
    if a.pcp:
        toks = PCP_TOKENS if a.tokens == ap.get_default("tokens") else a.tokens.split(",")
        rows, summary = pcp(a.pcp, [int(x) for x in toks], a.iters, patterns)
        print(f"PCP{a.pcp} publish (slowest rank; devices {summary['devices']}):")
        eager = [r for r in rows if any(k.startswith("eager") for k in r)]
        print(table(eager, ["T"] + [k for k in eager[0] if k.startswith("eager host")]))
        print(table(rows, ["T", "slots", "graph us: 2 launches", "graph us: 1 launch"]))
        bw = [r for r in rows if "peer copy GB/s" in r]
        if bw:
            keys = [k for k in bw[0] if "GB/s" in k or "/" in k or "only" in k]
            print(table(bw, ["T", "slots"] + keys))
        print("copy ceilings into the peer's replica (GB/s of bytes copied; slowest rank):")
        print(table(summary["ceilings"], ceiling_columns(summary["ceilings"])))
        print("barrier:", {k: v for k, v in summary.items() if k.startswith("barrier")})
        write_json(a.out, f"bench_store_pcp{a.pcp}", rows, summary=summary)
        return
    tokens = [int(x) for x in a.tokens.split(",")]
    dests = [int(x) for x in a.dests.split(",")]
    ceil = ceilings(a.iters)
    copies = ceil["copies"]
    rows = store_sweep(tokens, dests, a.iters, patterns)
    for r in rows:
        r["eff/fill"] = r["eff_GBps"] / ceil["fill_GBps"]
        r["eager/empty_launch"] = r["fused_eager_us"] / ceil["empty_launch_eager_us"]
        if r["dests"] == 1 and r["T"] >= BW_MIN_T:  # bytes written per second vs a copy's
            written = r["T"] * (MLA + IDX)
            r["store written GB/s"] = written / (r["fused_graph_us"] * 1e3)
            r["best ceiling GB/s"] = ceiling.best_at(copies, written)
            r["store/best ceiling"] = r["store written GB/s"] / r["best ceiling GB/s"]
    bar = {
        "vmmkv 1 rank": barrier_one_rank(a.iters),
        "vmmkv 2 processes on one GPU": barrier_two_processes(a.iters),
        "torch symm_mem 1 rank": symm_mem_barrier(a.iters),
    }
    print("ceilings (same run):", {k: round(v, 2) for k, v in ceil.items() if k != "copies"})
    print("local copy ceilings (GB/s of bytes copied, graph replays):")
    print(table(copies, ceiling_columns(copies)))
    print(table(rows, list(dict.fromkeys(k for r in rows for k in r))))
    print("barrier latency (median):")
    for k, v in bar.items():
        print(f"  {k:<32} {v}")
    write_json(a.out, "bench_store", rows, ceilings=ceil, barrier=bar)


if __name__ == "__main__":
    main()
