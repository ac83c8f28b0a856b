"""The gather fallback over gloo (host backend) when ranks break the padding convention: uneven
token counts or replicated-row counts, or invalid inputs on one rank.

Every rank must raise (the same diagnosis where the convention differs), none may die of a
signal, no replica may change, and the next valid call must write every rank's rows: each
replica is poisoned with non-zero random bytes and compared, byte for byte, with a CPU copy of
the poison into which ``vmmkv.ops.reference`` wrote the rows.
"""

from __future__ import annotations

import pytest

from vmmkv.testing.spawn import run_world_raw

BS = 64
NB = 4
IDX = 132  # indexer_k entry: 128 fp8 bytes + one fp32 scale


def _valid_call(c, idx, buf, rank, world, seed, gathered_form):
    """Poison, then one valid store of 2 replicated rows + 4 own rows per rank; True when this
    replica holds exactly the reference's bytes afterwards."""
    import torch
    import torch.distributed as dist

    from tests.helpers import random_bytes
    from vmmkv.ops import reference as ref

    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NB * BS, generator=g)
    decode, own = 2, 4
    ks = [
        torch.randn(decode if r < 0 else own, 128, generator=g).bfloat16() for r in range(-1, world)
    ]
    slots = [perm[:decode]] + [
        perm[decode + r * own : decode + (r + 1) * own] for r in range(world)
    ]
    poison = random_bytes(buf.numel(), seed * 10 + rank)
    buf.copy_(poison)
    want = poison.clone()
    for k, s in zip(ks, slots, strict=True):
        ref.insert_indexer_k(want.view(NB, BS, IDX), k, s)
    k = torch.cat([ks[0], ks[rank + 1]])
    kw = {"num_local_only": decode}
    if gathered_form:
        kw["gathered_slot_mapping"] = torch.cat([torch.cat([slots[0], s]) for s in slots[1:]])
        mine = None
    else:
        mine = torch.cat([slots[0], slots[rank + 1]])
    dist.barrier()  # every replica poisoned before anyone stores
    c.store_indexer_k(idx, k, mine, **kw)
    dist.barrier()
    return torch.equal(buf, want)


def _broken_call(rank, world, case):
    import time

    import torch
    import torch.distributed as dist

    from tests.helpers import random_bytes
    from vmmkv import ReplicatedKVCache

    dist.barrier()  # both ranks enter the cache's bounded join together
    with ReplicatedKVCache(
        dist.group.WORLD, 1 << 20, "cpu", backend="host", direct=False, initial_bytes=1 << 20,
        timeout=10,
    ) as c:  # fmt: skip
        buf = c.allocate(NB * BS * IDX).view(torch.uint8)
        idx = c.bind("idx", buf.view(NB, BS, IDX), "indexer_k")
        gathered_form = case == "num_local_only"
        first = _valid_call(c, idx, buf, rank, world, 1, gathered_form)  # staging filled
        t, nlo = {
            "tokens": (5 if rank == 1 else 4, 0),
            "num_local_only": (6, 2 if rank == 1 else 1),
            "same rows": (5, 1) if rank == 0 else (4, 0),  # equal gathered sizes
            "invalid": (4, 0),
        }[case]
        g = torch.Generator().manual_seed(100 + rank)
        dtype = torch.float16 if case == "invalid" and rank == 1 else torch.bfloat16
        k = torch.randn(t, 128, generator=g).to(dtype)
        slots = torch.randperm(NB * BS, generator=g)[:t]
        kw = {"num_local_only": nlo}
        if gathered_form:
            kw["gathered_slot_mapping"] = torch.randperm(NB * BS, generator=g)[: world * t]
            slots = None
        poison = random_bytes(buf.numel(), 7 + rank)
        buf.copy_(poison)
        dist.barrier()
        t0 = time.monotonic()
        try:
            c.store_indexer_k(idx, k, slots, **kw)
            outcome = ("stored", "")
        except Exception as exc:
            outcome = (type(exc).__name__, str(exc))
        waited = time.monotonic() - t0
        unchanged = torch.equal(buf, poison)
        dist.barrier()
        after = _valid_call(c, idx, buf, rank, world, 2, gathered_form)
    return first, outcome, waited, unchanged, after


LISTINGS = {
    "tokens": "padded token count differs across ranks (rank 0: 4, rank 1: 5); "
    "T/num_local_only by rank: rank 0: 4/0, rank 1: 5/0.",
    "num_local_only": "num_local_only differs across ranks (rank 0: 1, rank 1: 2); "
    "T/num_local_only by rank: rank 0: 6/1, rank 1: 6/2.",
    "same rows": "padded token count differs across ranks (rank 0: 5, rank 1: 4); "
    "T/num_local_only by rank: rank 0: 5/1, rank 1: 4/0.",
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", [*LISTINGS, "invalid"])
def test_a_broken_convention_raises_on_every_rank_stores_nothing_and_the_next_call_works(case):
    results = run_world_raw(_broken_call, 2, args=(case,), timeout=50)
    for r in results:
        assert r.ok and r.exitcode == 0, (r.rank, r.exitcode, r.error, r.stderr_tail)
    for rank, (first, (name, msg), waited, unchanged, after) in enumerate(r.value for r in results):
        assert first and after, (rank, first, after)  # byte-equal to the reference
        assert unchanged, f"rank {rank}: the broken call changed the replica"
        assert waited < 5, waited  # no rank waited for the 10 s timeout
        if case == "invalid":
            want = "TypeError" if rank == 1 else "ValueError"
            assert name == want, (rank, name, msg)
            if rank == 0:
                assert "ranks [1] passed invalid inputs" in msg, msg
            continue
        assert name == "ValueError", (rank, name, msg)
        head = f"rank {rank} (cpu): gather fallback, call 2 (indexer_k): "
        assert msg.startswith(head), msg
        assert msg[len(head) :].startswith(LISTINGS[case]), msg
        assert "Nothing was stored on any rank" in msg and "pad_tokens" in msg, msg
    if case != "invalid":
        bodies = {r.value[1][1].split(": ", 2)[2] for r in results}
        assert len(bodies) == 1, bodies  # the same error on every rank
