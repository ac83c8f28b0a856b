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

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vmmkv import ReplicatedKVCache  # noqa: E402
from vmmkv._spawn import spawn_group  # noqa: E402
from vmmkv.alloc import cuda_usable  # noqa: E402

LAYERS, BLOCK_SIZE = 2, 64
MLA_ENTRY, IDX_ENTRY = 656, 132
PER_BLOCK = LAYERS * BLOCK_SIZE * (MLA_ENTRY + IDX_ENTRY)  # all layers of one block


def allocate_kv_cache(num_blocks: int, buffer_allocator, device):
    """What an engine's allocator does: one buffer, per-layer (mla, indexer) strided views."""
    buf = buffer_allocator(num_blocks * PER_BLOCK, device).view(torch.uint8)
    layers = []
    for layer in range(LAYERS):
        off = buf.storage_offset() + layer * BLOCK_SIZE * (MLA_ENTRY + IDX_ENTRY)
        mla = buf.as_strided((num_blocks, BLOCK_SIZE, MLA_ENTRY), (PER_BLOCK, MLA_ENTRY, 1), off)
        idx = buf.as_strided(
            (num_blocks, BLOCK_SIZE, IDX_ENTRY),
            (PER_BLOCK, IDX_ENTRY, 1),
            off + BLOCK_SIZE * MLA_ENTRY,
        )
        layers.append((mla, idx))
    return layers


def engine_rank(rank: int, world: int, opts: dict) -> dict:
    cuda = opts["cuda"]
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    max_blocks, start_blocks = 64, 16
    chunk = (2 << 20) if cuda else (1 << 16)
    capacity = -(-(max_blocks * PER_BLOCK) // chunk) * chunk
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
        kv_c = torch.randn(t, 512, device=device).bfloat16()
        k_pe = torch.randn(t, 64, device=device).bfloat16()
        k = torch.randn(t, 128, device=device).bfloat16()
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
        slots.copy_(torch.arange(t, device=device) + (start_blocks + 1) * BLOCK_SIZE + rank * t)
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
    reports = spawn_group(engine_rank, world, {"cuda": cuda}, timeout=300)
    ok = all(r.get("landed") for r in reports)
    for r in reports:
        print(r)
    print("engine example:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
