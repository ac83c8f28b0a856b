"""``python -m vmmkv demo``: the whole product in one run, verified byte for byte.

Spawns a PCP group (one process per GPU; with one GPU, two processes sharing it; with no GPU,
the host backend), allocates a layer-interleaved MLA + Indexer cache through ``allocate``, binds
the per-layer views, captures a CUDA graph of the stores + barrier, grows the cache after
capture, replays with tokens landing in the newly committed blocks, verifies every replica
against the pure-torch oracle over all ranks' tokens, times direct publication against the
gather fallback, checks the fallback's bytes too, shrinks, closes, and prints a report. Exits
non-zero on any mismatch or failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from .._spawn import spawn_group
from . import banner

BS = 64
MLA, IDX = 656, 132
DECODE = 2


def _log(rank: int, t0: float, msg: str) -> None:
    if rank == 0:
        banner("demo", f"[{time.monotonic() - t0:6.1f}s] {msg}")


def _batch(rank: int, world: int, step: int, blocks: range, tokens: list[int]):
    """Deterministic inputs of one step: replicated decode tokens first, then this rank's own.
    Slots are distinct across ranks and drawn from ``blocks``."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + 17)
    perm = torch.randperm(len(blocks) * BS, generator=g) + blocks.start * BS
    start = DECODE + sum(tokens[:rank])
    slots = torch.cat([perm[:DECODE], perm[start : start + tokens[rank]]])
    n = slots.numel()

    def data(seed, rows, d):
        gg = torch.Generator().manual_seed(seed)
        x = torch.randn(rows, d, generator=gg) * torch.rand(rows, 1, generator=gg).mul(6)
        x[x == 0] = 1.0
        return x

    def both(seed, d):  # decode rows are the same on every rank: seeded without the rank
        shared = data(step * 7 + seed, DECODE, d)
        return torch.cat([shared, data(step * 7 + 100 * seed + rank, n - DECODE, d)]).bfloat16()

    return both(1, 512), both(2, 64), both(3, 128), slots


def _layer_views(buf, layers: int, num_blocks: int):
    import torch

    u8 = buf.view(torch.uint8)
    block_total = layers * BS * (MLA + IDX)
    views = []
    for layer in range(layers):
        off = u8.storage_offset() + layer * BS * (MLA + IDX)
        views.append(
            (
                u8.as_strided((num_blocks, BS, MLA), (block_total, MLA, 1), off),
                u8.as_strided((num_blocks, BS, IDX), (block_total, IDX, 1), off + BS * MLA),
            )
        )
    return views


def _oracle(poison, layers, num_blocks, world, step, blocks, tokens):
    from ..ops import reference as ref

    want = poison.clone()
    views = _layer_views(want, layers, num_blocks)
    for r in range(world):
        kv_c, k_pe, k, slots = _batch(r, world, step, blocks, tokens)
        for mla, idx in views:
            ref.insert_ds_mla(mla, kv_c, k_pe, slots)
            ref.insert_indexer_k(idx, k, slots)
    return want


def _run_rank(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from .. import ReplicatedKVCache

    t0 = opts["t0"]
    backend = opts["backend"]
    cpu_group = dist.group.WORLD
    if backend == "cuda":
        ngpu = torch.cuda.device_count()
        device = torch.device("cuda", rank % ngpu)
        torch.cuda.set_device(device)
        device_group = dist.new_group(backend="nccl") if ngpu >= world else None
    else:
        device, device_group = torch.device("cpu"), None
    layers, num_blocks = opts["layers"], opts["blocks"]
    block_total = layers * BS * (MLA + IDX)
    chunk = opts["chunk"]
    capacity = -(-(num_blocks * block_total) // chunk) * chunk
    half = num_blocks // 2
    tokens = [opts["tokens"][r % len(opts["tokens"])] for r in range(world)]
    _log(rank, t0, f"ranks up: {world} x {backend}; creating the replicated cache")
    cache = ReplicatedKVCache(
        cpu_group,
        capacity,
        device,
        device_group=device_group,
        initial_bytes=half * block_total,
        chunk_bytes=chunk,
        backend=backend,
    )
    try:
        return _drive(
            cache, rank, world, t0, layers, num_blocks, half, block_total, tokens, backend
        )
    finally:
        cache.close()


def _drive(cache, rank, world, t0, layers, num_blocks, half, block_total, tokens, backend):
    import torch
    import torch.distributed as dist

    from .. import ops

    report: dict[str, Any] = {
        "rank": rank,
        "device": str(cache.device),
        "backend": cache.backend,
        "direct": cache.direct,
        "why_not_direct": cache.why_not_direct,
        "committed_before": cache.committed_bytes,
    }
    dev = cache.device
    buf = cache.allocate(num_blocks * block_total).view(torch.uint8)
    views = _layer_views(buf, layers, num_blocks)
    bound = [
        (cache.bind(f"mla.{i}", m, "fp8_ds_mla"), cache.bind(f"idx.{i}", x, "indexer_k"))
        for i, (m, x) in enumerate(views)
    ]
    tmax = DECODE + max(tokens)
    kv_c = torch.zeros(tmax, 512, dtype=torch.bfloat16, device=dev)
    k_pe = torch.zeros(tmax, 64, dtype=torch.bfloat16, device=dev)
    k = torch.zeros(tmax, 128, dtype=torch.bfloat16, device=dev)
    slots = torch.full((tmax,), -1, dtype=torch.int64, device=dev)

    def load(step, blocks):
        a, b, c, s = _batch(rank, world, step, blocks, tokens)
        n = s.numel()
        slots.fill_(-1)
        for dst, src in ((kv_c, a), (k_pe, b), (k, c), (slots, s)):
            dst[:n].copy_(src.to(dev))

    def step_all(mode=None):
        for mla, idx in bound:
            cache.store_layer(mla, idx, kv_c, k_pe, k, slots, num_local_only=DECODE, mode=mode)
        cache.barrier()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dist.barrier()

    def poison_and_oracle(step, blocks, salt):
        g = torch.Generator().manual_seed(rank * 31 + salt)
        n = cache.committed_bytes - (buf.data_ptr() - cache.region.region.base_ptr)
        n = min(n, buf.numel())
        poison = torch.randint(1, 256, (buf.numel(),), generator=g, dtype=torch.uint8)
        buf[:n].copy_(poison[:n].to(dev))
        host = buf[:n].cpu()
        full = torch.cat([host, poison[n:]])
        sync()
        return n, _oracle(full, layers, num_blocks, world, step, blocks, tokens)

    def verify(n, want, what):
        sync()
        got = buf[:n].cpu()
        bad = int((got != want[:n]).sum())
        if bad:
            raise AssertionError(f"rank {rank}: {what}: {bad} bytes differ from the oracle")

    if dev.type == "cuda":
        ops.warm_up(dev)
    # 1. eager direct stores into the initially committed blocks
    load(1, range(0, half))
    n, want = poison_and_oracle(1, range(0, half), 1)
    step_all()
    verify(n, want, "eager stores")
    _log(rank, t0, "eager stores verified on every replica")
    # 2. capture stores + barrier, then grow the cache after capture
    graph = None
    if dev.type == "cuda" and cache.direct:  # the gather fallback syncs the host: not capturable
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            graph.capture_begin()
            step_all()
            graph.capture_end()
        torch.cuda.current_stream(dev).wait_stream(stream)
        _log(rank, t0, f"captured a CUDA graph of {len(bound)} layer stores + barrier")
    report["graph"] = graph is not None
    cache.grow(cache.capacity_bytes)
    report["committed_after"] = cache.committed_bytes
    _log(rank, t0, f"grew {report['committed_before']} -> {report['committed_after']} bytes")
    # 3. replay with tokens landing in the newly committed blocks
    new_blocks = range(half, num_blocks)
    load(2, new_blocks)
    n, want = poison_and_oracle(2, new_blocks, 2)
    graph.replay() if graph is not None else step_all()
    verify(n, want, "graph replay after growth" if graph else "stores after growth")
    _log(rank, t0, "replay into the new blocks verified on every replica")
    # 4. time direct publication against the gather fallback
    timing = _time(cache, step_all, graph, dev, sync)
    report.update(timing)
    _log(rank, t0, f"timed direct vs gather: {timing}")
    # 5. the fallback writes the same bytes
    n, want = poison_and_oracle(2, new_blocks, 3)
    step_all(mode="gather")
    verify(n, want, "gather fallback")
    _log(rank, t0, "gather fallback verified: identical bytes")
    stats = cache.stats()
    report["stats"] = stats
    # 6. shrink back and close
    cache.shrink(half * block_total)
    report["committed_after_shrink"] = cache.committed_bytes
    report["verified"] = True
    return report


def _time(cache, step_all, graph, dev, sync, iters: int = 20) -> dict[str, float]:
    import torch

    def measure(fn):
        for _ in range(3):
            fn()
        sync()
        times = []
        for _ in range(iters):
            if dev.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e6)
        sync()
        return sorted(times)[len(times) // 2]

    direct = measure(graph.replay if graph is not None else step_all) if cache.direct else None
    gather = measure(lambda: step_all(mode="gather"))
    return {"direct_us": direct, "gather_us": gather}


def run(
    world: int | None = None,
    backend: str = "auto",
    *,
    layers: int = 4,
    blocks: int = 32,
    tokens: tuple[int, ...] = (13, 64, 1, 0),
    timeout: float = 600.0,
) -> list[dict]:
    """Spawn the group, run the demo on every rank, return the per-rank reports."""  # fmt: skip

    from ..alloc import driver

    if backend == "auto":
        backend = "cuda" if driver.cuda_usable() else "host"
    if world is None:
        world = max(2, driver.device_count()) if backend == "cuda" else 2
    for var, val in (
        ("NCCL_NVLS_ENABLE", "0"),
        ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
        ("NVSHMEM_DISABLE_NVLS", "1"),
    ):
        os.environ.setdefault(var, val)
    opts = {
        "backend": backend,
        "layers": layers,
        "blocks": blocks,
        "tokens": list(tokens),
        "chunk": (2 << 20) if backend == "cuda" else (1 << 16),
        "t0": time.monotonic(),
    }
    banner("demo", f"spawning {world} ranks ({backend} backend)")
    return spawn_group(_run_rank, world, opts, timeout)


def _print_report(reports: list[dict]) -> bool:
    ok = all("error" not in r and r.get("verified") for r in reports)
    first = next((r for r in reports if "error" not in r), None)
    print()
    banner("demo", "report")
    print(f"  ranks              {len(reports)}")
    if first:
        print(f"  devices            {', '.join(r.get('device', '?') for r in reports)}")
        print(f"  backend            {first['backend']}")
        mode = "direct publication" if first["direct"] else "gather-then-insert fallback"
        print(
            f"  path               {mode}{'' if first['direct'] else ': ' + first['why_not_direct']}"
        )
        grown = "grown after CUDA-graph capture" if first.get("graph") else "grown"
        print(
            f"  committed bytes    {first['committed_before']} -> {first['committed_after']} "
            f"({grown}) -> {first['committed_after_shrink']} (shrunk)"
        )
        print(
            f"  peer bytes issued  {sum(r['stats']['peer_bytes_issued'] for r in reports if 'stats' in r)}"
        )
        d = [r["direct_us"] for r in reports if r.get("direct_us") is not None]
        g = [r["gather_us"] for r in reports if "gather_us" in r]
        if d and g:
            print(
                f"  step time          direct {max(d):.1f} us, gather fallback {max(g):.1f} us "
                f"(median, slowest rank; direct/gather = {max(d) / max(g):.2f})"
            )
    for r in reports:
        if "error" in r:
            print(f"  rank {r.get('rank', '?')} FAILED: {r['error'].splitlines()[0]}")
    print(
        f"  verification       {'PASS: every replica byte-identical to the oracle' if ok else 'FAIL'}"
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vmmkv demo", description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=None, help="ranks (default: GPUs, at least 2)")
    ap.add_argument("--backend", choices=("auto", "cuda", "host"), default="auto")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=32, help="KV blocks per layer at full size")
    ap.add_argument("--json", default=None, help="also write the per-rank reports here")
    a = ap.parse_args(argv)
    try:
        reports = run(a.world, a.backend, layers=a.layers, blocks=a.blocks)
    except Exception as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    ok = _print_report(reports)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(reports, f, indent=1, default=str)
    return 0 if ok else 1
