"""torch.compile keeps store -> publish -> read in order (GPU).

The cache contract (vmmkv.ops.kv): every target's ``cache`` and the barrier's ``fence`` are the
one tensor over the whole own region, and the views the function reads are views of it. Then
the compiled graph must (a) contain the publish op, (b) read the rows a PEER wrote only after
the publish's barrier, on every call, and (c) give the same bytes as the eager function.

Two ranks: one process per GPU when there are two GPUs, else two processes sharing one.
"""

from __future__ import annotations

import pytest
import torch

from vmmkv.ops import reference as R
from vmmkv.ops.formats import INDEXER_DIM, INDEXER_ENTRY_BYTES, MLA_ENTRY_BYTES
from vmmkv.testing.markers import requires_gpu
from vmmkv.testing.spawn import run_world

BS = 64
TOKENS = 48
REGION_BYTES = 2 << 20


def _inputs(rank: int, call: int, device) -> tuple[torch.Tensor, ...]:
    """Rank ``rank``'s inputs of publish number ``call`` (every rank can compute every rank's):
    kv_c and k_pe as views of one [T, 576] tensor, k [T, 128], and slots in block
    ``2 * rank + call % 2`` (rows of a call are overwritten two calls later at the earliest,
    once every rank passed the barrier in between)."""
    g = torch.Generator().manual_seed(1000 * rank + call // 2)
    both = (torch.randn(TOKENS, 576, generator=g) * 3).bfloat16()
    k = (torch.randn(TOKENS, INDEXER_DIM, generator=g) * 0.5).bfloat16()
    block = 2 * rank + call % 2
    slots = torch.randperm(BS, generator=g)[:TOKENS] + block * BS
    both, k, slots = both.to(device), k.to(device), slots.to(device)
    return both[:, :512], both[:, 512:], k, slots


def _expected(kv_c, k_pe, k) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = R.quantize_ds_mla(kv_c.cpu(), k_pe.cpu())
    vals, scales = R.quantize_indexer_k(k.cpu(), True)
    return rows, vals, scales.contiguous().view(torch.uint8).view(-1, 4)


def _views(region: torch.Tensor, nb: int):
    mla_bytes = nb * BS * MLA_ENTRY_BYTES
    mla = region[:mla_bytes].view(nb, BS, MLA_ENTRY_BYTES)
    idx = region[mla_bytes : mla_bytes + nb * BS * INDEXER_ENTRY_BYTES].view(
        nb, BS * INDEXER_ENTRY_BYTES
    )
    return mla, idx, mla_bytes


def _make_step(prepared, bar, mla_view, idx_view, nb):
    def step(kv_c, k_pe, k, slots, peer_slots):
        prepared.publish((kv_c, k_pe, k), slots, 0, bar, 0)
        blk = peer_slots // BS
        off = peer_slots % BS
        rows = mla_view[blk, off]
        vals = idx_view[:, : BS * INDEXER_DIM].view(nb, BS, INDEXER_DIM)[blk, off]
        scales = idx_view[:, BS * INDEXER_DIM :].view(nb, BS, 4)[blk, off]
        return rows, vals, scales

    return step


def _compile_rank(rank: int, world: int, calls: int) -> dict:
    import torch.distributed as dist
    from torch._inductor.utils import run_and_get_code

    from vmmkv.ipc import SymmetricRegion
    from vmmkv.ops import DeviceBarrier, KVTarget, prepare, warm_up

    ngpu = torch.cuda.device_count()
    device = torch.device("cuda", rank if ngpu >= world else 0)
    torch.cuda.set_device(device)
    nb = 2 * world
    sr = SymmetricRegion(REGION_BYTES, device, initial_bytes=REGION_BYTES, backend="cuda")
    try:
        region = sr.region.tensor()  # THE tensor: caches, fence and read views all alias it
        mla_view, idx_view, mla_bytes = _views(region, nb)
        err = torch.zeros(1, dtype=torch.int32, device=device)
        common = dict(
            ptr_table=sr.peers.ptr_table, my_rank=rank, num_blocks=nb, block_size=BS,
            committed_bytes=sr.committed_table, error_counter=err, cache=region,
        )  # fmt: skip
        mla = KVTarget(kind="fp8_ds_mla", offset_bytes=0, block_stride=BS * MLA_ENTRY_BYTES,
                       entry_stride=MLA_ENTRY_BYTES, entry_bytes=MLA_ENTRY_BYTES, **common)  # fmt: skip
        idx = KVTarget(kind="indexer_k", offset_bytes=mla_bytes,
                       block_stride=BS * INDEXER_ENTRY_BYTES, entry_stride=INDEXER_ENTRY_BYTES,
                       entry_bytes=INDEXER_ENTRY_BYTES, **common)  # fmt: skip
        # generous timeout: a peer may still be compiling while this rank waits
        bar = DeviceBarrier(sr.peers.signal_table, None, rank, world, 1, device, timeout_s=180,
                            fence=region)  # fmt: skip
        warm_up(device)
        prepared = prepare((mla, idx))
        step = _make_step(prepared, bar, mla_view, idx_view, nb)
        compiled = torch.compile(step, fullgraph=True)
        torch.cuda._sleep(1)  # load torch's sleep kernel before any barrier spins
        torch.cuda.synchronize()
        peer = (rank + 1) % world
        codes: list[str] = []
        for call in range(calls):
            kv_c, k_pe, k, slots = _inputs(rank, call, device)
            peer_slots = _inputs(peer, call, device)[3]
            if rank == 1 and call % 4 == 1:
                torch.cuda._sleep(20_000_000)  # make the peers wait for this rank's rows
            if call % 2 == 0:
                out = step(kv_c, k_pe, k, slots, peer_slots)
                eager = [t.cpu() for t in out]
            else:
                if call == 1:
                    dist.barrier()  # start the compiled calls together
                    out, codes = run_and_get_code(compiled, kv_c, k_pe, k, slots, peer_slots)
                else:
                    out = compiled(kv_c, k_pe, k, slots, peer_slots)
                got = [t.cpu() for t in out]
                for name, a, b in zip(("rows", "values", "scales"), eager, got, strict=True):
                    assert torch.equal(a, b), f"rank {rank} call {call}: {name} eager != compiled"
            want = _expected(*_inputs(peer, call, "cpu")[:3])
            got = [t.cpu() for t in out]
            for name, a, b in zip(("rows", "values", "scales"), want, got, strict=True):
                assert torch.equal(a, b), f"rank {rank} call {call}: peer {peer}'s {name} differ"
        torch.cuda.synchronize()
        text = "\n".join(codes)
        assert text.count("torch.ops.vmmkv.prepared_publish.default(") == 1, text[-4000:]
        epochs = bar.epochs.tolist()
        assert epochs == [calls], epochs
        assert err.item() == 0 and bar.read_diagnostic() is None
        dist.barrier()  # nobody closes its region while a peer may still read it
        bar.close()
        return {"rank": rank, "device": str(device), "epochs": epochs}
    finally:
        sr.close()


@requires_gpu
@pytest.mark.timeout(900)
def test_compiled_publish_then_read_sees_the_peer_rows_on_every_rank_and_call():
    results = run_world(_compile_rank, 2, args=(8,), timeout=600)
    assert [r["epochs"] for r in results] == [[8], [8]]


@requires_gpu
def test_compiled_publish_keeps_its_op_and_equals_eager_on_one_rank():
    """World of one (no peer): the compiled function holds the publish op once, and reads the
    rows it just published, equal to the eager function's and to the reference."""
    from torch._inductor.utils import run_and_get_code

    from vmmkv.ops import DeviceBarrier, KVTarget, prepare, warm_up

    device = torch.device("cuda", torch.cuda.current_device())
    warm_up(device)
    nb = 2
    region = torch.zeros(REGION_BYTES, dtype=torch.uint8, device=device)
    mla_view, idx_view, mla_bytes = _views(region, nb)
    table = torch.tensor([region.data_ptr()], dtype=torch.int64, device=device)
    sig = torch.zeros(2, dtype=torch.int32, device=device)
    sig_table = torch.tensor([sig.data_ptr()], dtype=torch.int64, device=device)
    common = dict(
        ptr_table=table, my_rank=0, num_blocks=nb, block_size=BS,
        committed_bytes=torch.tensor([REGION_BYTES], device=device),
        error_counter=torch.zeros(1, dtype=torch.int32, device=device), cache=region,
    )  # fmt: skip
    mla = KVTarget(kind="fp8_ds_mla", offset_bytes=0, block_stride=BS * MLA_ENTRY_BYTES,
                   entry_stride=MLA_ENTRY_BYTES, entry_bytes=MLA_ENTRY_BYTES, **common)  # fmt: skip
    idx = KVTarget(kind="indexer_k", offset_bytes=mla_bytes, block_stride=BS * INDEXER_ENTRY_BYTES,
                   entry_stride=INDEXER_ENTRY_BYTES, entry_bytes=INDEXER_ENTRY_BYTES, **common)  # fmt: skip
    bar = DeviceBarrier(sig_table, None, 0, 1, 1, device, fence=region)
    step = _make_step(prepare((mla, idx)), bar, mla_view, idx_view, nb)
    compiled = torch.compile(step, fullgraph=True)
    for call in range(4):
        kv_c, k_pe, k, slots = _inputs(0, call, device)
        region.fill_(0xA5)
        eager = [t.cpu() for t in step(kv_c, k_pe, k, slots, slots)]
        region.fill_(0x5A)
        if call == 0:
            out, codes = run_and_get_code(compiled, kv_c, k_pe, k, slots, slots)
            text = "\n".join(codes)
            assert text.count("torch.ops.vmmkv.prepared_publish.default(") == 1, text[-4000:]
        else:
            out = compiled(kv_c, k_pe, k, slots, slots)
        want = _expected(kv_c, k_pe, k)
        for a, b, c in zip(eager, (t.cpu() for t in out), want, strict=True):
            assert torch.equal(a, b) and torch.equal(a, c)
    assert bar.epochs.tolist() == [8]
    bar.close()
