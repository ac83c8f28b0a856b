"""How a serving engine's KV-cache manager plugs vmmkv in. Runnable: ``python examples/engine_allocator.py``.

1. The engine builds its PCP group as usual and hands vmmkv the CPU (gloo) group.
2. ``cache.allocate`` is the engine's ``buffer_allocator(nbytes, device)`` hook: the engine
   allocates ONE layer-interleaved buffer (block b of every layer is contiguous), so growing the
   committed prefix adds whole blocks to every layer at once. The buffer spans the full
   capacity while only the first blocks are committed, so it is allocated with
   ``reserve=True``: only committed blocks may be touched (the stores skip the rest).
3. Per-layer views are strided slices of that buffer; ``bind`` validates them once.
4. Prefill: each rank stores its own tokens into every replica, then one barrier.
5. The step is captured in a CUDA graph; the cache then grows (more blocks) without recapture,
   and shrinks when the engine sleeps.
6. Every replica is checked byte for byte against the pure-torch reference
   (``vmmkv.ops.insert_ds_mla`` / ``insert_indexer_k``) fed with every rank's tokens.

Public API only: ``vmmkv``, ``vmmkv.ops`` and its format constants; the ranks are started with
``torch.multiprocessing`` as an engine would start its workers, and join a store the launcher
hosts (``vmmkv.testing.spawn.world_store``, standing in for the engine's own rendezvous). Runs on GPUs (one process per
GPU, or two sharing one) or, without a GPU, on the host backend.
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vmmkv import ReplicatedKVCache  # noqa: E402
from vmmkv.ops import insert_ds_mla, insert_indexer_k, warm_up  # noqa: E402
from vmmkv.ops.formats import INDEXER_ENTRY_BYTES, MLA_ENTRY_BYTES  # noqa: E402
from vmmkv.testing.spawn import WorldStore, world_store  # noqa: E402

LAYERS = 2
BLOCK_SIZE = 64  # tokens per block
MLA_BLOCK, IDX_BLOCK = BLOCK_SIZE * MLA_ENTRY_BYTES, BLOCK_SIZE * INDEXER_ENTRY_BYTES
PER_BLOCK = LAYERS * (MLA_BLOCK + IDX_BLOCK)  # bytes of block b of every layer
TOKENS = 32  # per rank and step


def allocate_kv_cache(num_blocks: int, buffer_allocator, device):
    """What an engine's allocator does: ONE buffer, per-layer ``(fp8_ds_mla [num_blocks,
    BLOCK_SIZE, 656], indexer_k [num_blocks, BLOCK_SIZE, 132])`` strided views into it (block b
    of every layer contiguous: layer l's MLA block, then its indexer block)."""
    buf = buffer_allocator(num_blocks * PER_BLOCK, device).view(torch.uint8)
    blocks = buf.view(num_blocks, LAYERS, MLA_BLOCK + IDX_BLOCK)
    return [
        (
            blocks[:, layer, :MLA_BLOCK].unflatten(1, (BLOCK_SIZE, MLA_ENTRY_BYTES)),
            blocks[:, layer, MLA_BLOCK:].unflatten(1, (BLOCK_SIZE, INDEXER_ENTRY_BYTES)),
        )
        for layer in range(LAYERS)
    ]


def rank_inputs(rank: int, first_slot: int):
    """``(kv_c, k_pe, k, slots)`` of one rank's prompt share: deterministic bf16 rows (any rank
    can rebuild any other rank's, for the check) and consecutive slots from ``first_slot``."""
    g = torch.Generator().manual_seed(rank)
    kv_c, k_pe, k = (torch.randn(TOKENS, w, generator=g).bfloat16() for w in (512, 64, 128))
    slots = torch.arange(TOKENS) + first_slot + rank * TOKENS
    return kv_c, k_pe, k, slots


def engine_rank(rank: int, world: int, store: WorldStore, cuda: bool) -> None:
    os.environ.update(store.env)  # join the launcher's store as a client
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=store.init_method)
    try:
        ok = run_engine(rank, world, cuda)
        flags = [None] * world
        dist.all_gather_object(flags, ok)
        if rank == 0:
            print("engine example:", "OK" if all(flags) else f"FAILED (per rank: {flags})")
        if not all(flags):
            raise SystemExit(1)
        dist.barrier()  # no rank tears the group down while another still uses it
    finally:
        dist.destroy_process_group()


def run_engine(rank: int, world: int, cuda: bool) -> bool:
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
        # the whole buffer now, committed as the engine grows: reserve=True
        views = allocate_kv_cache(
            max_blocks, lambda n, dev: cache.allocate(n, dev, reserve=True), device
        )
        layers = [
            (
                cache.bind(f"layer{i}.mla", m, "fp8_ds_mla"),
                cache.bind(f"layer{i}.idx", x, "indexer_k"),
            )
            for i, (m, x) in enumerate(views)
        ]
        # static step buffers (what a captured forward pass would own)
        kv_c, k_pe, k, slots = (x.to(device) for x in rank_inputs(rank, 0))

        def prefill_step():
            for mla, idx in layers:
                cache.store_layer(mla, idx, kv_c, k_pe, k, slots)
            cache.barrier()

        prefill_step()
        graph = None
        if cuda and cache.direct:
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
        slots.copy_(rank_inputs(rank, new_first)[3].to(device))
        before = [(m.cpu(), x.cpu()) for m, x in views]  # this replica before anyone writes
        dist.barrier()
        graph.replay() if graph is not None else prefill_step()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()  # every rank's step (stores + barrier) is done
        # the oracle: every rank's rows, inserted into a CPU copy by the reference
        ok = True
        for (mla, idx), (want_mla, want_idx) in zip(views, before, strict=True):
            for r in range(world):
                r_kv_c, r_k_pe, r_k, r_slots = rank_inputs(r, new_first)
                insert_ds_mla(want_mla, r_kv_c, r_k_pe, r_slots)
                insert_indexer_k(want_idx, r_k, r_slots)
            ok &= torch.equal(mla.cpu(), want_mla) and torch.equal(idx.cpu(), want_idx)
        stats = cache.stats()
        # the engine goes to sleep: give memory back, keep the addresses
        cache.shrink(start_blocks * PER_BLOCK)
        print(f"rank {rank}: path={cache.path} replica matches the reference: {ok}; "
              f"committed {cache.committed_bytes} bytes after shrink; {stats}")  # fmt: skip
        return ok


def main() -> int:
    cuda = torch.cuda.is_available()
    world = max(2, torch.cuda.device_count()) if cuda else 2
    # The launcher hosts the group's store, as an engine's launcher does (vmmkv's own spawner
    # hosts it the same way); one process per rank, as an engine starts its workers.
    try:
        with world_store() as store:
            mp.spawn(engine_rank, args=(world, store, cuda), nprocs=world)
    except Exception as exc:
        print(f"engine example: FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
