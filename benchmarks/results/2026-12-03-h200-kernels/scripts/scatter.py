"""What the random-slot stores pay for, on one GPU: store_layer (quantize + write both views) and
publish_rows (a copy of already formatted 656-byte fp8_ds_mla entries, no quantizing) into D
destinations laid out as bench_store.py's store_sweep lays them (D regions of one chunk each,
fp8_ds_mla then indexer_k), slots from bench_store.slot_mapping.

usage: scatter.py time T D[,D..]           medians (CUDA events, 30 calls after 3) of both ops,
                                           every slot pattern
       scatter.py ncu T D PATTERN OP       OP layer|rows: 4 calls, for ncu's --launch-skip 3
"""

import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_store import BS, IDX, MLA, SLOT_PATTERNS, _events_ms, slot_mapping

from vmmkv import ops
from vmmkv.alloc import VirtualRegion
from vmmkv.ops import reference as ref
from vmmkv.ops.kv import KVTarget


def setup(T, D):
    nblk = -(-T // BS)
    mla_bytes, idx_bytes = nblk * BS * MLA, nblk * BS * IDX
    gran = 2 << 20
    cap = -(-(mla_bytes + idx_bytes) // gran) * gran
    regions = [VirtualRegion(cap, 0, chunk_bytes=cap, backend="cuda") for _ in range(D)]
    for r in regions:
        r.commit(cap)
    committed = torch.tensor([cap], dtype=torch.int64, device="cuda")
    errors = torch.zeros(1, dtype=torch.int32, device="cuda")
    local = regions[0].tensor()
    table = torch.tensor([r.base_ptr for r in regions], dtype=torch.int64, device="cuda")
    geo = dict(ptr_table=table, my_rank=0, num_blocks=nblk, block_size=BS,
               committed_bytes=committed, error_counter=errors)  # fmt: skip
    mla = KVTarget(kind="fp8_ds_mla", offset_bytes=0, block_stride=BS * MLA, entry_stride=MLA,
                   entry_bytes=MLA, cache=local[:mla_bytes], **geo)  # fmt: skip
    rows = KVTarget(kind="rows", offset_bytes=0, block_stride=BS * MLA, entry_stride=MLA,
                    entry_bytes=MLA, cache=local[:mla_bytes], **geo)  # fmt: skip
    idx = KVTarget(kind="indexer_k", offset_bytes=mla_bytes, block_stride=BS * IDX,
                   entry_stride=IDX, entry_bytes=IDX,
                   cache=local[mla_bytes : mla_bytes + idx_bytes], **geo)  # fmt: skip
    return regions, mla, idx, rows, nblk


def ops_for(T, D, pattern, targets, g):
    regions, mla, idx, rows, nblk = targets
    kv_c = torch.randn(T, 512, device="cuda", generator=g).bfloat16()
    k_pe = torch.randn(T, 64, device="cuda", generator=g).bfloat16()
    k = torch.randn(T, 128, device="cuda", generator=g).bfloat16()
    entries = ref.quantize_ds_mla(kv_c, k_pe).contiguous()
    slots = slot_mapping(pattern, T, nblk * BS, 0, "cuda", g)
    return {
        "layer": lambda: ops.store_layer(mla, idx, kv_c, k_pe, k, slots),
        "rows": lambda: ops.publish_rows(rows, entries, slots),
    }


def median_us(fn, iters=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return _events_ms(fn, iters) * 1e3


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    if sys.argv[1] == "ncu":
        T, D, pattern, op = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
        targets = setup(T, D)
        fn = ops_for(T, D, pattern, targets, g)[op]
        for _ in range(4):
            fn()
        torch.cuda.synchronize()
        for r in targets[0]:
            r.close()
        print("ok", T, D, pattern, op)
        return
    T = int(sys.argv[2])
    print("T | D | slots | store_layer us | GB/s written | publish_rows 656 B us | GB/s written")
    for D in [int(x) for x in sys.argv[3].split(",")]:
        targets = setup(T, D)
        for pattern in SLOT_PATTERNS:
            fns = ops_for(T, D, pattern, targets, g)
            lay, rws = median_us(fns["layer"]), median_us(fns["rows"])
            print(f"{T} | {D} | {pattern} | {lay:.1f} | {T * (MLA + IDX) * D / lay / 1e3:.0f} | "
                  f"{rws:.1f} | {T * MLA * D / rws / 1e3:.0f}", flush=True)  # fmt: skip
        for r in targets[0]:
            r.close()


if __name__ == "__main__":
    main()
