"""ReplicatedKVCache: direct publication and the gather fallback against a pure-torch oracle.

Each rank holds its own prefill tokens (uneven counts: 13, 64, 1, 0) plus the same replicated
decode tokens (``num_local_only``); every replica must equal, byte for byte, a CPU copy of the
poisoned buffer into which the reference inserters wrote every rank's tokens. Guard bytes
between and around the views are part of the comparison. Host backend in CI; ``gpu`` marker: N
processes sharing the GPU.
"""

from __future__ import annotations

import pytest

from vmmkv.testing.spawn import capture_logs, run_world

BS = 64  # block size
NB = 6  # blocks per layer view
MLA, IDX = 656, 132
LAYER = BS * MLA + BS * IDX  # one layer's MLA block then its indexer block
LAYERS = 2
BLOCK_TOTAL = LAYERS * LAYER  # layer-interleaved: block b of every layer is contiguous
GUARD = 4096
ROWS = 1152  # a bf16 MLA row, published as-is
TOKENS = [13, 64, 1, 0]
DECODE = 3


def _gen(seed, shape, dtype):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g).mul(8)
    x[x.abs() < 1e-3] = 0.5  # random non-zero data
    return x.to(dtype)


def _inputs(rank, world, committed_blocks):
    """Deterministic per-rank tokens: (kv_c, k_pe, k, rows, slots) for two layers."""
    import torch

    n = TOKENS[rank % len(TOKENS)] if world > 1 else 13
    g = torch.Generator().manual_seed(777)
    perm = torch.randperm(committed_blocks * BS, generator=g)
    start = sum(TOKENS[r % len(TOKENS)] for r in range(rank)) + DECODE
    slots = perm[start : start + n].clone()
    if n >= 4:
        slots[1] = -1  # padding
        slots[2] = NB * BS + 5  # beyond the view: counted, never written
        if committed_blocks < NB:
            slots[3] = committed_blocks * BS + 1  # an uncommitted block: counted
    seed = 100 + rank
    return (
        _gen(seed, (n + 2, 512), torch.bfloat16),  # inputs longer than slot_mapping
        _gen(seed + 1, (n + 2, 64), torch.bfloat16),
        _gen(seed + 2, (n + 2, 128), torch.bfloat16),
        torch.randint(0, 256, (n + 2, ROWS), generator=g, dtype=torch.uint8),
        slots,
    )


def _decode(committed_blocks):
    import torch

    g = torch.Generator().manual_seed(777)
    slots = torch.randperm(committed_blocks * BS, generator=g)[:DECODE].clone()
    return (
        _gen(5, (DECODE, 512), torch.bfloat16),
        _gen(6, (DECODE, 64), torch.bfloat16),
        _gen(7, (DECODE, 128), torch.bfloat16),
        torch.randint(0, 256, (DECODE, ROWS), generator=torch.Generator().manual_seed(8),
                      dtype=torch.uint8),
        slots,
    )  # fmt: skip


LAYERS_AT = GUARD + NB * BS * ROWS  # layout: guard | rows view | interleaved layers | guard
TOTAL = LAYERS_AT + NB * BLOCK_TOTAL + GUARD


def _rows_view(buf):
    return buf[GUARD : GUARD + NB * BS * ROWS].view(NB, BS, ROWS)


def _views(buf):
    """Per layer (mla view, indexer view) of the interleaved layout inside the buffer."""
    import torch

    u8 = buf.view(torch.uint8)
    out = []
    for layer in range(LAYERS):
        off = LAYERS_AT + layer * LAYER
        mla = u8.as_strided((NB, BS, MLA), (BLOCK_TOTAL, MLA, 1), u8.storage_offset() + off)
        idx = u8.as_strided(
            (NB, BS, IDX), (BLOCK_TOTAL, IDX, 1), u8.storage_offset() + off + BS * MLA
        )
        out.append((mla, idx))
    return out


def _oracle(poisoned, world, committed_blocks):
    """CPU oracle: the reference inserters, every rank's tokens plus the decode tokens."""
    import torch

    from vmmkv.ops import reference as ref

    want = poisoned.clone()
    views = _views(want)
    rows_view = _rows_view(want)
    batches = [_decode(committed_blocks)] + [
        _inputs(r, world, committed_blocks) for r in range(world)
    ]
    for kv_c, k_pe, k, rows, slots in batches:
        ok = slots.clone()
        ok[(ok >= committed_blocks * BS)] = -1  # uncommitted or outside: never written
        for mla, idx in views:
            ref.insert_ds_mla(mla, kv_c, k_pe, ok)
            ref.insert_indexer_k(idx, k, ok)
        ref.insert_rows(rows_view, rows, slots)  # the rows view is committed in full
    del torch
    return want


def _padded_tokens(world):
    """The group's largest own token count: what every rank pads to."""
    return max(TOKENS[r % len(TOKENS)] for r in range(world)) if world > 1 else 13


def _expected_errors(rank, world, committed_blocks, mode):
    """Skipped tokens counted per store: 2 layers x 2 kinds bounded by the committed blocks,
    plus the rows view bounded by its NB blocks."""
    ranks = range(world) if mode == "gather" and world > 1 else [rank]
    n = 0
    for r in ranks:
        slots = _inputs(r, world, committed_blocks)[4]
        n += 4 * int((slots >= committed_blocks * BS).sum()) + int((slots >= NB * BS).sum())
    return n


def _run(rank, world, backend, modes, committed_blocks=NB - 1):
    import torch
    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache
    from vmmkv.gather import pad_tokens

    device = "cpu" if backend == "host" else "cuda:0"
    total = TOTAL
    chunk = 1 << 21 if backend == "cuda" else 1 << 16
    cap = -(-total // chunk) * chunk + chunk
    with ReplicatedKVCache(
        dist.group.WORLD, cap, device, chunk_bytes=chunk, backend=backend
    ) as cache:
        buf = cache.allocate(total, reserve=True).view(torch.uint8)  # committed by the grow below
        views = _views(buf)
        # The kernels' bound ends after `committed_blocks` blocks of the interleaved layers
        # (everything is mapped, so a wrong write would land in poison and be seen).
        start = buf.data_ptr() - cache.region.base_ptr
        need = start + LAYERS_AT + committed_blocks * BLOCK_TOTAL
        cache.grow(cap)
        layer_b = [
            (cache.bind(f"mla{i}", m, "fp8_ds_mla"), cache.bind(f"idx{i}", x, "indexer_k"))
            for i, (m, x) in enumerate(views)
        ]
        rows_b = cache.bind("rows", _rows_view(buf), "rows")
        results = {}
        for mode in modes:
            g = torch.Generator().manual_seed(rank)
            poison = torch.randint(1, 256, (buf.numel(),), generator=g, dtype=torch.uint8)
            buf.copy_(poison.to(buf.device))
            cache.error_counter.zero_()
            cache.region.committed_table.fill_(need)
            dist.barrier()
            dec = [t.to(device) for t in _decode(committed_blocks)]
            own = [t.to(device) for t in _inputs(rank, world, committed_blocks)]
            # every rank passes the same padded count (the gather convention; slot -1 rows)
            own_in, own_slots = pad_tokens(own[:4], own[4], _padded_tokens(world))
            extra = [t[-2:] for t in own[:4]]  # inputs longer than slot_mapping
            # decode tokens first (replicated, local only), then this rank's own tokens
            kv_c, k_pe, k, rows = (
                torch.cat([d, o, x]) for d, o, x in zip(dec[:4], own_in, extra, strict=True)
            )
            slots = torch.cat([dec[4], own_slots]).to(torch.int32)
            m = None if mode == "auto" else mode
            (mla0, idx0), (mla1, idx1) = layer_b
            cache.store_layer(mla0, idx0, kv_c, k_pe, k, slots, num_local_only=DECODE, mode=m)
            cache.store_ds_mla(mla1, kv_c, k_pe, slots, num_local_only=DECODE, mode=m)
            cache.store_indexer_k(idx1, k, slots, num_local_only=DECODE, mode=m)
            cache.publish_rows(rows_b, rows, slots, num_local_only=DECODE, mode=m)
            cache.barrier()
            if cache.device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            # the poison of every rank differs, so compare against this rank's own oracle
            want = _oracle(poison, world, committed_blocks)
            got = buf.cpu()
            assert torch.equal(got, want), (
                f"rank {rank} mode {mode}: {(got != want).sum().item()} bytes differ, first at "
                f"{(got != want).nonzero()[:4].flatten().tolist()}"
            )
            errs = int(cache.error_counter.item())
            eff = "gather" if mode == "gather" or not cache.direct else "direct"
            assert errs == _expected_errors(rank, world, committed_blocks, eff), (mode, errs)
            results[mode] = errs
            dist.barrier()
        stats = cache.stats()
        return cache.direct, cache.why_not_direct, results, stats


CASES = [
    pytest.param("host", 2, id="host-2"),
    pytest.param("host", 4, id="host-4"),
    pytest.param("cuda", 1, id="cuda-1", marks=pytest.mark.gpu),
    pytest.param("cuda", 2, id="cuda-2", marks=pytest.mark.gpu),
    pytest.param("cuda", 4, id="cuda-4", marks=pytest.mark.gpu),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend,world", CASES)
def test_direct_and_gather_paths_write_the_oracle_bytes_into_every_replica(backend, world):
    out = run_world(_run, world, args=(backend, ("direct", "gather")), timeout=150)
    for direct, why, _, stats in out:
        assert direct and why == ""
        assert stats["barriers"] == 2 and stats["tokens_stored"] > 0


def _forced_gather(rank, world):
    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache

    records = capture_logs()
    import os

    os.environ["VMMKV_DIRECT"] = "0"
    with ReplicatedKVCache(dist.group.WORLD, 1 << 20, "cpu", backend="host") as cache:
        assert not cache.direct
        why = cache.why_not_direct
    _run(rank, world, "host", ("auto",))
    return why, records


@pytest.mark.timeout(120)
def test_vmmkv_direct_0_selects_the_gather_path_and_logs_why():
    out = run_world(_forced_gather, 2, timeout=100)
    for why, records in out:
        assert "VMMKV_DIRECT=0" in why
        assert any("gather-then-insert fallback" in r and "VMMKV_DIRECT=0" in r for r in records)


def _bind_errors(rank, world):
    import torch
    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache

    msgs = []
    with ReplicatedKVCache(
        dist.group.WORLD, 1 << 20, "cpu", backend="host", initial_bytes=1 << 20
    ) as cache:
        buf = cache.allocate(BS * MLA * 2).view(torch.uint8)
        for call in (
            lambda: cache.bind("x", torch.zeros(2, BS, MLA, dtype=torch.uint8), "fp8_ds_mla"),
            lambda: cache.bind("x", buf.view(2, BS, MLA).view(torch.int16), "fp8_ds_mla"),
            lambda: cache.bind("x", buf[: 2 * BS * 132].view(2, BS, 132), "fp8_ds_mla"),
            lambda: cache.bind("x", buf.view(2, BS, MLA), "paged"),
            lambda: cache.allocate(1 << 21),
            lambda: cache.allocate(0),
            lambda: cache.grow(1 << 22),
        ):
            try:
                call()
            except (ValueError, TypeError) as exc:
                msgs.append(f"{type(exc).__name__}: {exc}")
            else:
                msgs.append("no error")
    return msgs


@pytest.mark.timeout(60)
def test_bind_and_allocate_reject_bad_views_sizes_and_kinds_with_clear_errors():
    msgs = run_world(_bind_errors, 1, timeout=50)[0]
    assert "outside" in msgs[0] and "allocate()" in msgs[0]
    assert msgs[1].startswith("TypeError") and "uint8 or int8" in msgs[1]
    assert "656" in msgs[2]
    assert "kind must be one of" in msgs[3]
    assert "exceed the capacity" in msgs[4]
    assert "nbytes must be" in msgs[5]
    assert "outside" in msgs[6]


def test_vmmkv_direct_values_are_validated(monkeypatch):
    from vmmkv.cache import resolve_direct

    monkeypatch.setenv("VMMKV_DIRECT", "sometimes")
    with pytest.raises(ValueError, match="VMMKV_DIRECT"):
        resolve_direct(None)
    monkeypatch.setenv("VMMKV_DIRECT", "1")
    assert resolve_direct(None) == "1" and resolve_direct(False) == "0"
    monkeypatch.delenv("VMMKV_DIRECT")
    assert resolve_direct(None) == "auto"


def _gather_edge_cases(rank, world):
    import os

    import torch
    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache
    from vmmkv.gather import pad_tokens
    from vmmkv.ops import reference as ref

    os.environ["VMMKV_CHECK_PADDING"] = "1"  # the debug check: bad inputs raise on every rank
    out = {}
    with ReplicatedKVCache(
        dist.group.WORLD, 1 << 20, "cpu", backend="host", direct=False, initial_bytes=1 << 20
    ) as c:
        buf = c.allocate(4 * BS * IDX).view(torch.uint8)
        idx = c.bind("idx", buf.view(4, BS, IDX), "indexer_k")
        buf.fill_(0xA5)
        # rank 1 has nothing to store at all: it pads to rank 0's count (every row slot -1)
        n = 5 if rank == 0 else 0
        k = _gen(3, (5, 128), torch.bfloat16)[:n]
        slots = torch.arange(n, dtype=torch.int64) + 7
        (k,), slots = pad_tokens((k,), slots, 5)
        c.store_indexer_k(idx, k, slots)
        want = torch.full_like(buf, 0xA5)
        ref.insert_indexer_k(
            want.view(4, BS, IDX), _gen(3, (5, 128), torch.bfloat16), torch.arange(5) + 7
        )
        out["empty_ok"] = torch.equal(buf, want)
        # rank 1 passes fp16: it raises TypeError, rank 0 a ValueError naming it; no one waits
        bad = torch.zeros(2, 128, dtype=torch.float16 if rank == 1 else torch.bfloat16)
        try:
            c.store_indexer_k(idx, bad, torch.arange(2))
        except (TypeError, ValueError) as exc:
            out["bad"] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.mark.timeout(60)
def test_gather_fallback_handles_a_padded_rank_without_tokens_and_rejects_bad_inputs_on_every_rank():
    out = run_world(_gather_edge_cases, 2, timeout=45)
    assert out[0]["empty_ok"] and out[1]["empty_ok"]
    assert out[1]["bad"].startswith("TypeError") and "float16" in out[1]["bad"]
    assert out[0]["bad"].startswith("ValueError") and "ranks [1]" in out[0]["bad"]


def _mode_mismatch(rank, world):
    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache

    try:
        ReplicatedKVCache(
            dist.group.WORLD, 1 << 20, "cpu", backend="host", direct=rank == 0, timeout=20
        )
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "constructed"


@pytest.mark.timeout(60)
def test_a_direct_mode_that_differs_between_ranks_raises_on_every_rank_naming_it():
    out = run_world(_mode_mismatch, 2, timeout=50)
    for msg in out:
        assert msg.startswith("ConfigMismatch") and "direct differs" in msg, msg
        assert "ranks [0] have '1'" in msg and "ranks [1] have '0'" in msg, msg


def _setup_fails_on_rank_1(rank, world):
    import torch.distributed as dist

    import vmmkv._assembly as cache_mod
    from vmmkv import ReplicatedKVCache

    def broken(*args, **kwargs):
        raise MemoryError("injected: no memory for the gather path")

    original = cache_mod.GatherPath
    if rank == 1:
        cache_mod.GatherPath = broken  # a local failure after the region exists
    out = []
    try:
        ReplicatedKVCache(dist.group.WORLD, 1 << 20, "cpu", backend="host", timeout=20)
        out.append("constructed")
    except Exception as exc:
        out.append(f"{type(exc).__name__}: {exc}")
    finally:
        cache_mod.GatherPath = original
    with ReplicatedKVCache(dist.group.WORLD, 1 << 20, "cpu", backend="host", timeout=20) as c:
        out.append(c.path)  # the group is usable afterwards
    return out


@pytest.mark.timeout(60)
def test_a_local_setup_failure_after_the_region_raises_on_every_rank_and_leaves_the_group_usable():
    out = run_world(_setup_fails_on_rank_1, 2, timeout=50)
    for msg, path in out:
        assert "cache setup failed on group ranks [1]" in msg and "injected" in msg, msg
        assert path == "direct"


def _typo_on_rank_1(rank, world):
    import os
    import time

    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache

    os.environ["VMMKV_DIRECT"] = "yes" if rank == 1 else "auto"
    t0 = time.monotonic()
    try:
        ReplicatedKVCache(dist.group.WORLD, 1 << 20, "cpu", backend="host", timeout=20)
        msg = "constructed"
    except Exception as exc:
        msg = f"{type(exc).__name__}: {exc}"
    waited = time.monotonic() - t0
    os.environ["VMMKV_DIRECT"] = "auto"
    with ReplicatedKVCache(dist.group.WORLD, 1 << 20, "cpu", backend="host", timeout=20) as c:
        return msg, waited, c.path  # the group is usable afterwards


@pytest.mark.timeout(60)
def test_a_bad_setting_on_one_rank_fails_every_rank_at_once_naming_it():
    (msg0, waited0, path0), (msg1, waited1, path1) = run_world(_typo_on_rank_1, 2, timeout=50)
    assert msg1.startswith("ValueError") and "VMMKV_DIRECT must be" in msg1, msg1
    assert msg0.startswith("ConfigMismatch") and "direct differs" in msg0, msg0
    assert "invalid: VMMKV_DIRECT must be" in msg0, msg0
    assert waited0 < 10 and waited1 < 10  # not the 20 s timeout
    assert path0 == path1 == "direct"


def _allocate_uncommitted(rank, world):
    import torch
    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache

    out = {}
    with ReplicatedKVCache(
        dist.group.WORLD, 1 << 20, "cpu", backend="host", chunk_bytes=1 << 16
    ) as cache:
        try:
            cache.allocate(4096).zero_()  # nothing committed: this was a SIGSEGV
            out["nothing committed"] = "no error"
        except ValueError as exc:
            out["nothing committed"] = str(exc)
        try:
            cache.region.view(rank).zero_()
            out["region view"] = "no error"
        except ValueError as exc:
            out["region view"] = str(exc)
        cache.grow(1 << 16)
        out["inside"] = cache.allocate(4096).zero_().numel()  # the failed call took no bytes
        try:
            cache.allocate(1 << 16)  # [4096, 69632) runs past the committed 65536
            out["past the prefix"] = "no error"
        except ValueError as exc:
            out["past the prefix"] = str(exc)
        out["region view bytes"] = cache.region.view(rank).numel()
        reserved = cache.allocate(1 << 17, reserve=True).view(torch.uint8)
        out["reserved"] = (reserved.data_ptr() - cache.region.base_ptr, reserved.numel())
        out["whole"] = cache.region.view(rank, reserve=True).numel()
    return out


@pytest.mark.timeout(60)
def test_allocate_over_uncommitted_memory_raises_naming_the_committed_size_unless_reserve():
    for rank, out in enumerate(run_world(_allocate_uncommitted, 2, timeout=50)):
        msg = out["nothing committed"]
        assert f"rank {rank} (cpu): allocate(4096)" in msg, msg
        assert "committed prefix is 0 of 1048576 bytes" in msg and "grow(" in msg, msg
        assert "initial_bytes=" in msg and "reserve=True" in msg, msg
        assert "nothing is committed" in out["region view"], out["region view"]
        assert out["inside"] == 4096
        msg = out["past the prefix"]
        assert "[4096, 69632)" in msg and "committed prefix is 65536 of" in msg, msg
        assert out["region view bytes"] == 1 << 16  # the committed prefix only
        assert out["reserved"] == (4096, 1 << 17)  # refused calls took no bytes
        assert out["whole"] == 1 << 20


def _constructor_mistakes(rank, world):
    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache

    out = []
    for kw in (
        dict(capacity_bytes=0),
        dict(capacity_bytes=-1),
        dict(capacity_bytes="1M"),
        dict(backend="cdua"),
        dict(chunk_bytes=0),
        dict(chunk_bytes=3),  # found by the region: not a multiple of the granularity
        dict(initial_bytes=1 << 30),
    ):
        args = dict(capacity_bytes=1 << 20, backend="host", timeout=20) | kw
        try:
            ReplicatedKVCache(dist.group.WORLD, device="cpu", **args)
            out.append("constructed")
        except (ValueError, TypeError) as exc:
            out.append(f"{'ValueError' if isinstance(exc, ValueError) else 'TypeError'}: {exc}")
        except Exception as exc:
            out.append(f"not caught: {type(exc).__name__}: {exc}")
    with ReplicatedKVCache(dist.group.WORLD, 1 << 20, "cpu", backend="host", timeout=20) as c:
        out.append(c.path)  # the group is usable afterwards
    return out


@pytest.mark.timeout(120)
def test_constructor_mistakes_raise_value_or_type_errors_that_callers_can_catch():
    for rank, out in enumerate(run_world(_constructor_mistakes, 2, timeout=110)):
        zero, negative, text, typo, chunk0, chunk3, initial, path = out
        assert zero.startswith("ValueError: capacity_bytes must be >= 1, got 0"), zero
        assert f"rank {rank}, device='cpu'" in zero, zero
        assert negative.startswith("ValueError: capacity_bytes must be >= 1, got -1"), negative
        assert text.startswith("TypeError: capacity_bytes must be an int"), text
        assert typo.startswith("ValueError: backend must be") and "'cdua'" in typo, typo
        assert chunk0.startswith("ValueError: chunk_bytes must be >= 1, got 0"), chunk0
        assert chunk3.startswith("ValueError: chunk_bytes=3 is not a multiple"), chunk3
        assert initial.startswith("ValueError: initial_bytes must be in [0, 1048576]"), initial
        assert path == "direct"


def _capacity_zero_on_rank_1(rank, world):
    import time

    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache

    t0 = time.monotonic()
    try:
        ReplicatedKVCache(dist.group.WORLD, 0 if rank == 1 else 1 << 20, "cpu", backend="host",
                          timeout=20)  # fmt: skip
        msg = "constructed"
    except Exception as exc:
        msg = f"{type(exc).__name__} ValueError={isinstance(exc, ValueError)}: {exc}"
    return msg, time.monotonic() - t0


@pytest.mark.timeout(60)
def test_a_bad_argument_on_one_rank_raises_its_class_there_and_rendezvous_error_on_the_others():
    (msg0, waited0), (msg1, waited1) = run_world(_capacity_zero_on_rank_1, 2, timeout=50)
    assert msg1.startswith("RendezvousValueError ValueError=True: capacity_bytes must be"), msg1
    assert msg0.startswith("RendezvousError ValueError=False"), msg0
    assert "rank 1: ValueError('capacity_bytes must be >= 1, got 0')" in msg0, msg0
    assert waited0 < 10 and waited1 < 10  # at once, not after the 20 s timeout


def _out_of_range_warning(rank, world):
    import torch
    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache

    records = capture_logs("vmmkv")
    out = {}
    chunk, entry = 1 << 16, 1024

    def warnings():
        return [r for r in records if "out-of-range slots" in r]

    for when in ("stats", "close"):
        cache = ReplicatedKVCache(dist.group.WORLD, 1 << 20, "cpu", backend="host",
                                  chunk_bytes=chunk, initial_bytes=chunk)  # fmt: skip
        view = cache.allocate(4 * BS * entry, reserve=True).view(torch.uint8)
        rows = cache.bind("rows", view.view(4, BS, entry), "rows")
        data = torch.full((3, entry), 7, dtype=torch.uint8)
        slots = torch.tensor([0, 2 * BS, 3 * BS + 1])  # blocks 2 and 3 are not committed
        cache.publish_rows(rows, data, slots)
        out[when] = [len(warnings())]  # the store path does not read the counter
        if when == "stats":
            out[when].append(cache.stats()["out_of_range_slots"])
            cache.publish_rows(rows, data, slots)
            out[when] += [len(warnings()), cache.stats()["out_of_range_slots"]]
        cache.close()
        out[when].append(len(warnings()))
    out["message"] = warnings()[0]
    return out


@pytest.mark.timeout(60)
def test_out_of_range_slots_are_logged_once_per_cache_at_stats_or_close():
    out = run_world(_out_of_range_warning, 1, timeout=50)[0]
    assert out["stats"] == [0, 2, 1, 4, 1]  # once, at the first stats(); not again
    assert out["close"] == [1, 2]  # a second cache warns once, at close()
    msg = out["message"]
    assert "rank 0 (cpu)" in msg and "skipped 2 out-of-range slots" in msg, msg
    assert "grow" in msg and "once per cache" in msg, msg
