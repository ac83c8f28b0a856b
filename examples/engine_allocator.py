"""How a serving engine's KV-cache manager plugs vmmkv in. Runnable: ``python examples/engine_allocator.py``.

1. The engine builds its PCP group as usual and hands vmmkv the CPU (gloo) group.
2. ``cache.allocate`` is the engine's ``buffer_allocator(nbytes, device)`` hook: the engine
   allocates ONE layer-interleaved buffer (block b of every layer is contiguous), so growing the
   committed prefix adds whole blocks to every layer at once.
3. Per-layer views are strided slices of that buffer; ``bind`` validates them once.
4. Prefill: each rank stores its own tokens into every replica, then one barrier.
5. The step is captured in a CUDA graph; the cache then grows (more blocks) without recapture,
   and shrinks when the engine sleeps.

Runs on GPUs (one process per GPU, or two sharing one) or, without a GPU, on the host backend.
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vmmkv import ReplicatedKVCache  # noqa: E402
from vmmkv.alloc import cuda_usable  # noqa: E402
from vmmkv.testing.kv import (  # noqa: E402
    BLOCK_SIZE,
    block_stride,
    interleaved_views,
    layer_inputs,
)
from vmmkv.testing.spawn import run_world  # noqa: E402

LAYERS = 2
PER_BLOCK = block_stride(LAYERS)  # bytes of block b of every layer (MLA then indexer, per layer)


def allocate_kv_cache(num_blocks: int, buffer_allocator, device):
    """What an engine's allocator does: ONE buffer, per-layer (mla, indexer) strided views.
    The layout (block b of every layer contiguous) is written once in vmmkv.testing.kv; an
    engine computes the same strides from its own layer specs."""
    buf = buffer_allocator(num_blocks * PER_BLOCK, device)
    return interleaved_views(buf, LAYERS, num_blocks)


def engine_rank(rank: int, world: int, cuda: bool) -> dict:
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    max_blocks, start_blocks = 64, 16
    chunk = (2 << 20) if cuda else (1 << 16)
    capacity = math.ceil(max_blocks * PER_BLOCK / chunk) * chunk  # whole chunks
    with ReplicatedKVCache(
        dist.group.WORLD,  # the PCP group's CPU (gloo) group
        capacity,
        device,
        initial_bytes=start_blocks * PER_BLOCK,
        chunk_bytes=chunk,
        backend="cuda" if cuda else "host",
    ) as cache:
        views = allocate_kv_cache(max_blocks, cache.allocate, device)
        layers = [
            (
                cache.bind(f"layer{i}.mla", m, "fp8_ds_mla"),
                cache.bind(f"layer{i}.idx", x, "indexer_k"),
            )
            for i, (m, x) in enumerate(views)
        ]
        # static step buffers (what a captured forward pass would own)
        t = 32
        kv_c, k_pe, k = (x.to(device) for x in layer_inputs(rank, t))  # random, non-zero
        slots = torch.arange(t, device=device) + rank * t  # this rank's prompt share

        def prefill_step():
            for mla, idx in layers:
                cache.store_layer(mla, idx, kv_c, k_pe, k, slots)
            cache.barrier()

        prefill_step()
        graph = None
        if cuda and cache.direct:
            from vmmkv.ops import warm_up

            warm_up(device)
            graph = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                graph.capture_begin()
                prefill_step()
                graph.capture_end()
            torch.cuda.current_stream().wait_stream(s)
        # more memory became free: grow to all blocks, after capture, without moving anything
        cache.grow(max_blocks * PER_BLOCK)
        new_first = (start_blocks + 1) * BLOCK_SIZE  # a slot in a block committed by the grow
        slots.copy_(torch.arange(t, device=device) + new_first + rank * t)
        graph.replay() if graph is not None else prefill_step()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        # every replica now holds every rank's rows in the new blocks
        other = (rank + 1) % world
        mla0 = views[0][0]
        row = mla0[(start_blocks + 1) + (other * t) // BLOCK_SIZE, (other * t) % BLOCK_SIZE]
        landed = bool(row.count_nonzero() > 0)
        # the engine goes to sleep: give memory back, keep the addresses
        cache.shrink(start_blocks * PER_BLOCK)
        return {"rank": rank, "direct": cache.direct, "landed": landed,
                "committed": cache.committed_bytes, "stats": cache.stats()}  # fmt: skip


def main() -> int:
    cuda = cuda_usable()
    world = max(2, torch.cuda.device_count()) if cuda else 2
    # one process per rank, in a gloo group, killed together on timeout (vmmkv's test spawner)
    reports = run_world(engine_rank, world, args=(cuda,), timeout=300)
    ok = all(r["landed"] for r in reports)
    for r in reports:
        print(r)
    print("engine example:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
