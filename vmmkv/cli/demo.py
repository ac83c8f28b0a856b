"""``python -m vmmkv demo``: the whole product in one run, verified byte for byte.

Spawns a PCP group (one process per GPU; with one GPU, two processes sharing it; with no GPU,
the host backend), allocates a layer-interleaved MLA + Indexer cache through ``allocate``, binds
the per-layer views, captures a CUDA graph of the stores + barrier, grows the cache after
capture, replays with tokens landing in the newly committed blocks (on the host backend, or with
the gather fallback, there is no graph: eager stores land there instead), verifies every replica
against the pure-torch oracle over all ranks' tokens, times direct publication against the
gather fallback, checks the fallback's bytes too, shrinks, closes, and prints a report: a few
lines and a table of each rank's median step times. Exits 1 on any mismatch or failure, 2 on a
wrong argument or environment variable (checked before any rank starts).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from . import HOST_TIMINGS, add_group_args, banner, checks, rank_reports, tool_parser

DECODE = 2  # replicated decode tokens at the head of every step (num_local_only)
TOKENS = (13, 64, 1, 0)  # each rank's own tokens per step (rank r: TOKENS[r % 4])
BLOCK_TOKENS = 64  # vmmkv.testing.kv.BLOCK_SIZE, without importing torch (a test ties them)


def _log(rank: int, t0: float, msg: str) -> None:
    if rank == 0:
        banner("demo", f"[{time.monotonic() - t0:6.1f}s] {msg}")


def _batch(rank: int, step: int, blocks: range, tokens: list[int]):
    """Deterministic inputs ``(kv_c, k_pe, k, slots)`` of one step on ``rank``: the replicated
    decode tokens first (the same on every rank), then this rank's own. Slots are distinct
    across ranks and drawn from ``blocks``."""
    import torch

    from ..testing.kv import BLOCK_SIZE, layer_inputs

    g = torch.Generator().manual_seed(1000 * step + 17)
    perm = torch.randperm(len(blocks) * BLOCK_SIZE, generator=g) + blocks.start * BLOCK_SIZE
    start = DECODE + sum(tokens[:rank])
    slots = torch.cat([perm[:DECODE], perm[start : start + tokens[rank]]])
    shared = layer_inputs(step * 7, DECODE)  # seeded without the rank
    own = layer_inputs(step * 7 + 100 * (rank + 1), tokens[rank])
    kv_c, k_pe, k = (torch.cat([a, b]) for a, b in zip(shared, own, strict=True))
    return kv_c, k_pe, k, slots


def _run_rank(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from .. import ReplicatedKVCache
    from .._util import round_up
    from ..testing.kv import block_stride

    t0, backend = opts["t0"], opts["backend"]
    if backend == "cuda":
        ngpu = torch.cuda.device_count()
        device = torch.device("cuda", rank % ngpu)
        torch.cuda.set_device(device)
        device_group = dist.new_group(backend="nccl") if ngpu >= world else None
    else:
        device, device_group = torch.device("cpu"), None
    per_block = block_stride(opts["layers"])
    half = opts["blocks"] // 2
    _log(rank, t0, f"ranks up: {world} x {backend}; creating the replicated cache")
    cache = ReplicatedKVCache(
        dist.group.WORLD,
        round_up(opts["blocks"] * per_block, opts["chunk"]),
        device,
        device_group=device_group,
        initial_bytes=half * per_block,
        chunk_bytes=opts["chunk"],
        backend=backend,
    )
    try:
        return _drive(cache, rank, world, opts)
    finally:
        cache.close()


def _drive(cache, rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from .. import ops
    from ..ops.formats import get_format
    from ..testing.kv import block_stride, expected_replica, interleaved_views
    from ..testing.timing import capture_graph

    t0, layers, num_blocks = opts["t0"], opts["layers"], opts["blocks"]
    half = num_blocks // 2
    tokens = [opts["tokens"][r % len(opts["tokens"])] for r in range(world)]
    report: dict[str, Any] = {
        "rank": rank,
        "device": str(cache.device),
        "backend": cache.backend,
        "direct": cache.direct,
        "why_not_direct": cache.why_not_direct,
        "committed_before": cache.committed_bytes,
    }
    dev = cache.device
    # The whole capacity, half of it committed: the engine's pattern when it grows later
    # (reserve=True; only committed blocks are touched, the stores skip the rest).
    buf = cache.allocate(num_blocks * block_stride(layers), reserve=True).view(torch.uint8)
    bound = [
        (cache.bind(f"mla.{i}", m, "fp8_ds_mla"), cache.bind(f"idx.{i}", x, "indexer_k"))
        for i, (m, x) in enumerate(interleaved_views(buf, layers, num_blocks))
    ]
    # static step inputs (what a captured forward pass owns), refilled before each step
    tmax = DECODE + max(tokens)
    kv_c, k_pe, k = (
        torch.zeros(tmax, width, dtype=dtype, device=dev)
        for kind in ("fp8_ds_mla", "indexer_k")
        for _, dtype, width in get_format(kind).inputs
    )
    slots = torch.full((tmax,), -1, dtype=torch.int64, device=dev)

    def load(step, blocks):
        batch = _batch(rank, step, blocks, tokens)
        n = batch[3].numel()
        slots.fill_(-1)
        for dst, src in zip((kv_c, k_pe, k, slots), batch, strict=True):
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
        """Poison the committed part of the own replica; the oracle of every rank's step."""
        g = torch.Generator().manual_seed(rank * 31 + salt)
        n = cache.committed_bytes - (buf.data_ptr() - cache.region.base_ptr)
        n = min(n, buf.numel())
        poison = torch.randint(1, 256, (buf.numel(),), generator=g, dtype=torch.uint8)
        buf[:n].copy_(poison[:n].to(dev))
        before = torch.cat([buf[:n].cpu(), poison[n:]])
        sync()
        batches = [_batch(r, step, blocks, tokens) for r in range(world)]
        return n, expected_replica(before, batches, layers=layers, num_blocks=num_blocks)

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
        graph = capture_graph(step_all, dev)
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
    if graph is not None:
        _log(rank, t0, "graph replay into the new blocks verified on every replica")
    else:  # the host backend has no graphs; the gather fallback is not capturable
        why = "the gather fallback" if dev.type == "cuda" else "host backend"
        _log(
            rank,
            t0,
            f"eager stores into the new blocks verified on every replica (no graph: {why})",
        )
    # 4. time direct publication against the gather fallback
    timing = _time(cache, step_all, graph, dev, sync)
    report.update(timing)
    _log(rank, t0, "timed direct publication and the gather fallback (table below)")
    # 5. the fallback writes the same bytes
    n, want = poison_and_oracle(2, new_blocks, 3)
    step_all(mode="gather")
    verify(n, want, "gather fallback")
    _log(rank, t0, "gather fallback verified: identical bytes")
    report["stats"] = cache.stats()
    # 6. shrink back (the caller closes)
    cache.shrink(half * block_stride(layers))
    report["committed_after_shrink"] = cache.committed_bytes
    report["verified"] = True
    return report


def _time(cache, step_all, graph, dev, sync, iters: int = 20) -> dict[str, float | None]:
    """Median step time (us) of direct publication (the graph where captured) and of the
    gather fallback: 3 untimed steps, ranks aligned, then ``iters`` timed ones (CUDA events on
    a GPU, the host clock on the CPU)."""
    from ..testing.timing import percentile, time_us

    def measure(fn):
        for _ in range(3):
            fn()
        sync()
        times = time_us(fn, iters=iters, device=dev, events=True)
        sync()
        return percentile(times, 50)

    direct = measure(graph.replay if graph is not None else step_all) if cache.direct else None
    gather = measure(lambda: step_all(mode="gather"))
    return {"direct_us": direct, "gather_us": gather}


def run(
    world: int,
    backend: str,
    *,
    chunk: int,
    layers: int = 4,
    blocks: int = 32,
    tokens: tuple[int, ...] = TOKENS,
    timeout: float = 600.0,
) -> list[dict]:
    """Spawn the group (``backend`` 'cuda' or 'host', checked by the caller), run the demo on
    every rank, return the per-rank reports (a failed rank's report holds ``error``)."""
    opts = {
        "backend": backend,
        "layers": layers,
        "blocks": blocks,
        "tokens": list(tokens),
        "chunk": chunk,
        "t0": time.monotonic(),
    }
    banner("demo", f"spawning {world} ranks ({backend} backend)")
    return rank_reports(_run_rank, world, opts, timeout)


def _step_tokens(world: int, tokens: tuple[int, ...] = TOKENS) -> int:
    """Slots one step writes: the replicated decode tokens and every rank's own."""
    return DECODE + sum(tokens[r % len(tokens)] for r in range(world))


def _timing_table(reports: list[dict]) -> list[str]:
    """Each rank's median step time (us) of direct publication and of the gather fallback, and
    the slowest rank's, which the report's step-time line quotes."""

    def us(value) -> str:
        return "-" if value is None else f"{value:.1f}"

    rows = [r for r in reports if "gather_us" in r]
    lines = [f"    {'rank':>4}  {'direct us':>10}  {'gather us':>10}"]
    lines += [
        f"    {r['rank']:>4}  {us(r['direct_us']):>10}  {us(r['gather_us']):>10}" for r in rows
    ]
    d = [r["direct_us"] for r in rows if r["direct_us"] is not None]
    lines.append(
        f"    {'max':>4}  {us(max(d) if d else None):>10}  {us(max(r['gather_us'] for r in rows)):>10}"
    )
    return lines


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
        if g:
            print("  step time by rank (median of 20 steps)")
            print("\n".join(_timing_table(reports)))
        if first["backend"] == "host":
            print(f"  timings            {HOST_TIMINGS}")
    for r in reports:
        if "error" in r:  # the exception's last line here, the whole traceback on stderr
            last = (r["error"].strip().splitlines() or ["ended without saying why"])[-1]
            print(f"  rank {r.get('rank', '?')} FAILED: {last}")
            print(f"--- rank {r.get('rank', '?')} ---\n{r['error']}", file=sys.stderr)
    print(
        f"  verification       {'PASS: every replica byte-identical to the oracle' if ok else 'FAIL'}"
    )
    return ok


def parser() -> argparse.ArgumentParser:
    ap = tool_parser("demo", __doc__)
    add_group_args(ap)
    ap.add_argument("--layers", type=int, default=4, help="model layers (default 4)")
    ap.add_argument(
        "--blocks", type=int, default=32, help="KV blocks per layer at full size (default 32)"
    )
    ap.add_argument("--json", default=None, help="also write the per-rank reports to this file")
    return ap


def main(argv: list[str] | None = None) -> int:
    a, errors, backend, world, chunk = checks.parse_group_args(
        parser(), argv, {"--layers": 1, "--blocks": 2}
    )
    need = _step_tokens(world)
    if a.blocks >= 2 and world >= 1 and (a.blocks // 2) * BLOCK_TOKENS < need:
        least = 2 * -(-need // BLOCK_TOKENS)
        errors.append(
            f"--blocks {a.blocks} is too few for {world} ranks: the first half of the blocks "
            f"takes a step of {need} tokens ({BLOCK_TOKENS} per block): use --blocks {least} or more"
        )
    if a.json:
        errors += checks.writable("--json", a.json, directory=False)
    if errors:
        return checks.refuse("demo", errors)
    try:
        reports = run(world, backend, chunk=chunk, layers=a.layers, blocks=a.blocks)
    except Exception as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    ok = _print_report(reports)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(reports, f, indent=1, default=str)
    return 0 if ok else 1
