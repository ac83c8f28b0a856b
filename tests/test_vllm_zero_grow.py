"""The zeroing race and growth in blocks, against the real vLLM 0.34.0 (CPU, host backend).

Zeroing: vLLM's real ``KVBlockZeroer`` (built from the bound layer views as the runner builds
it) zeroes newly allocated blocks of the own replica. Its Triton kernel cannot run on the CPU, so
the kernel launch is replaced by a host memset of exactly the segments vLLM computed (its units:
int32 elements). The bad interleaving is forced with host waits: the slow rank zeroes only once
the fast rank has reached a barrier. Without the fix (vLLM's own ``zero_block_ids``) the fast
rank's first published rows are wiped from the slow rank's replica; with the plugin's
``zero_block_ids`` (zeroing, then the cache barrier) none are.

Growth: ``VllmKVCache.grow``/``shrink`` in blocks under a layer-major (LBNHC, one segment per
layer) and a block-major (BLNHC, one segment) layout: rows land in committed blocks only (the
others are counted, never written), committed ranges equal the reference byte for byte.
"""

from __future__ import annotations

import pytest

from tests.helpers import vllm_marks, vllm_world_fixture

pytestmark = vllm_marks()

BS, NUM_BLOCKS, LAYERS, ROWS = 64, 32, 4, 7
NEW_BLOCKS = [5, 6]  # the step's newly allocated blocks, zeroed by vLLM


class _HostZeroKernel:
    """Stands in for vLLM's Triton ``_zero_kv_blocks_kernel[grid](...)`` on the host: zero page
    ``seg_page_sizes[i]`` int32 elements at ``seg_addrs[i] + block * seg_block_strides[i]``."""

    def __getitem__(self, grid):
        def launch(seg_addrs, seg_block_strides, seg_page_sizes, block_ids, BLOCK_SIZE):
            import ctypes

            segs = (seg_addrs.tolist(), seg_block_strides.tolist(), seg_page_sizes.tolist())
            for addr, stride, page in zip(*segs, strict=True):
                for b in block_ids.tolist():
                    ctypes.memset(addr + 4 * b * stride, 0, 4 * page)

        return launch


def _zeroer(config, views):
    """vLLM's KVBlockZeroer over the layers' bound views (the runner's attention groups: one per
    backend, both in KV cache group 0; the layers keep ``view.squeeze(1)`` as ``kv_cache``)."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
    from vllm.v1.worker.utils import AttentionGroup, KVBlockZeroer

    from vmmkv.integrations.vllm import _layout

    idx = [n for n in views if n.endswith(".k_cache")]
    mla = [n for n in views if n.endswith(".attn")]
    groups = [
        AttentionGroup(DeepseekV32IndexerBackend, idx, _layout.layer_spec(config, idx[0])[1], 0),
        AttentionGroup(FlashMLASparseBackend, mla, _layout.layer_spec(config, mla[0])[1], 0),
    ]
    layers = {n: SimpleNamespace(kv_cache=v.squeeze(1)) for n, v in views.items()}
    return KVBlockZeroer(torch.device("cpu"), groups, [BS], layers, config.num_blocks)


def _inputs(layer, prank, world, blocks):
    """'shard'-case inputs of one layer (``tests.helpers.shard_step_rows``)."""
    from tests.helpers import shard_step_rows

    return shard_step_rows(100 * layer, prank, world, blocks, ROWS, BS)


def _lost_rows(views, plain, every, layer):
    """(cache, token) rows of ``every`` whose bytes in the replica differ from the reference."""
    from vmmkv.testing.vllm.configs import idx_layer, mla_layer

    lost = 0
    mla, mla_ref = views[mla_layer(layer)].squeeze(1), plain[mla_layer(layer)].squeeze(1)
    idx, idx_ref = views[idx_layer(layer)].squeeze(1), plain[idx_layer(layer)].squeeze(1)
    for _, slots in every:
        for s in slots.tolist():
            if s < 0:
                continue
            b, o = divmod(s, BS)
            lost += int(not mla[b, o].equal(mla_ref[b, o]))
            blk, ref = idx[b].reshape(-1), idx_ref[b].reshape(-1)
            span = [(o * 128, (o + 1) * 128), (BS * 128 + 4 * o, BS * 128 + 4 * o + 4)]
            lost += int(any(not blk[a:e].equal(ref[a:e]) for a, e in span))
    return lost


def _zero_race(rank, world, ps, store, variant):
    """One step whose new blocks vLLM zeroes, with the slow rank (1) zeroing only after the fast
    rank (0) reached a barrier; returns the rows lost per layer in this rank's replica."""
    import torch
    import torch.distributed as dist
    from vllm.config import set_current_vllm_config
    from vllm.utils import torch_utils
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker import utils as worker_utils
    from vllm.v1.worker.gpu import attn_utils  # MRV2: the runner that runs PCP

    from tests.test_vllm_pcp import _call_sites, _flat
    from vmmkv.integrations import vllm as integration
    from vmmkv.ops import reference as ref
    from vmmkv.testing.vllm.configs import build_kv_cache_config, idx_layer, mla_layer

    pcp = ps.get_pcp_group()
    cfg, config = build_kv_cache_config("LBNHC", NUM_BLOCKS, pcp=world)
    size = config.kv_cache_tensors[0].size
    real_kernel = worker_utils._zero_kv_blocks_kernel
    worker_utils._zero_kv_blocks_kernel = _HostZeroKernel()
    # vLLM's platform here (no driver: UnspecifiedPlatform) claims pinned memory, which needs a
    # driver; vLLM's CPU platform says False, as here.
    torch_utils.PIN_MEMORY = False
    try:
        with set_current_vllm_config(cfg), integration.patched():
            views = attn_utils.allocate_kv_cache(
                config, torch.device("cpu"), KVCacheLayout.LBNHC, [BS]
            )
            vc = integration.active_cache()
            zeroer = _zeroer(config, views)
            plain = worker_utils.allocate_kv_cache(
                config, torch.device("cpu"), KVCacheLayout.LBNHC, [BS]
            )
            want = _flat(next(iter(plain.values())), size)
            stale = torch.randint(1, 256, (size,), dtype=torch.uint8,
                                  generator=torch.Generator().manual_seed(3))  # fmt: skip
            vc.buffer.view(torch.uint8).copy_(stale)  # the blocks' previous contents
            want.copy_(stale)
            dist.barrier(group=pcp.cpu_group)
            key = f"zero-race/{variant}/rank0-at-barrier"
            if pcp.rank_in_group == 0:
                real_barrier = vc.cache.barrier

                def barrier(lane=0):
                    store.set(key, "1")  # the slow rank may zero now
                    real_barrier(lane)

                vc.cache.barrier = barrier
            else:
                store.wait([key])  # the fast rank published (or waits after its zeroing)
            if variant == "with the fix":
                zeroer.zero_block_ids(NEW_BLOCKS)
            else:
                integration.original(worker_utils.KVBlockZeroer, "zero_block_ids")(
                    zeroer, NEW_BLOCKS
                )
            inputs = [
                _inputs(layer, pcp.rank_in_group, world, NEW_BLOCKS) for layer in range(LAYERS)
            ]
            for layer, (kv_c, k_pe, k, mapping, _) in enumerate(inputs):
                _call_sites(views, layer, kv_c, k_pe, k, mapping, 0, 0, True, world)  # fmt: skip
            dist.barrier(group=pcp.cpu_group)
            for view in plain.values():  # the reference: zeroed, then every rank's rows
                view[NEW_BLOCKS] = 0
            for layer, (*_, every) in enumerate(inputs):
                for (kv_c, k_pe, k), slots in every:
                    idx, mla = idx_layer(layer), mla_layer(layer)
                    ref.insert_indexer_k(plain[idx].squeeze(1), k, slots,
                                         kind=vc.bindings[idx].kind)  # fmt: skip
                    ref.insert_ds_mla(plain[mla].squeeze(1), kv_c, k_pe, slots,
                                      kind=vc.bindings[mla].kind)  # fmt: skip
            lost = [_lost_rows(views, plain, inputs[layer][4], layer) for layer in range(LAYERS)]
            equal = bool(torch.equal(vc.buffer.view(torch.uint8), want))
            dist.barrier(group=pcp.cpu_group)
    finally:
        worker_utils._zero_kv_blocks_kernel = real_kernel
    return {"lost": lost, "equal": equal}


def _committed_equal(vc, want, blocks):
    """The committed blocks of every segment equal the reference (uncommitted bytes unread)."""
    import torch

    got = vc.buffer.view(torch.uint8)
    return all(torch.equal(got[o : o + blocks * bb], want[o : o + blocks * bb])
               for o, bb in vc.segments)  # fmt: skip


def _growth(rank, world, ps, layout):
    """grow/shrink in blocks: 8 -> store -> 32 -> store -> 8 -> store -> 12."""
    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker import utils as worker_utils

    from tests.test_vllm_pcp import _flat
    from vmmkv.integrations.vllm import VllmKVCache, pcp_store_plan
    from vmmkv.ops import reference as ref
    from vmmkv.testing.vllm import configs

    pcp = ps.get_pcp_group()
    _, config = configs.build_kv_cache_config(layout, NUM_BLOCKS, pcp=world)
    size = config.kv_cache_tensors[0].size
    plain = worker_utils.allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout[layout], [BS])
    want = _flat(next(iter(plain.values())), size)
    out = {}
    vc = VllmKVCache(
        config, layout, cpu_group=pcp.cpu_group, device="cpu", device_group=pcp.device_group,
        kernel_block_sizes=[BS], initial_blocks=8, direct=True, chunk_bytes=1 << 16,
    )  # fmt: skip
    prank = pcp.rank_in_group
    try:

        def step(tag, seed):
            """Rows of every rank in blocks 0, 7 and 20; the reference takes the committed."""
            committed = vc.committed_blocks
            before = vc.stats()["out_of_range_slots"]
            for layer in range(LAYERS):
                kv_c, k_pe, k, mapping, every = _inputs(layer + seed, prank, world, [0, 7, 20])
                plan = pcp_store_plan(ROWS, mapping, 0, True, prank, world)
                vc.store(vc.bindings[configs.idx_layer(layer)], (k,), plan)
                vc.store(vc.bindings[configs.mla_layer(layer)], (kv_c, k_pe), plan)
                for (r_kv_c, r_k_pe, r_k), slots in every:
                    ok = torch.where(slots < committed * BS, slots, -1)
                    ref.insert_indexer_k(plain[configs.idx_layer(layer)].squeeze(1), r_k, ok)
                    ref.insert_ds_mla(plain[configs.mla_layer(layer)].squeeze(1), r_kv_c,
                                      r_k_pe, ok)  # fmt: skip
            out[tag] = {
                "blocks": committed,
                "bytes": vc.cache.committed_bytes,
                "skipped": vc.stats()["out_of_range_slots"] - before,
                "equal": _committed_equal(vc, want, committed),
            }

        out["segments"] = len(vc.segments)
        out["size"] = size
        step("8 blocks", 0)
        try:
            vc.check_blocks([3, 9])
            out["refused"] = ""
        except ValueError as exc:
            out["refused"] = str(exc)
        vc.grow(NUM_BLOCKS)
        step("grown to 32", 1)
        vc.shrink(8)
        for view in plain.values():  # decommitted blocks come back zeroed
            view[8:] = 0
        step("shrunk to 8", 2)
        vc.grow(12)
        step("grown to 12", 3)
    finally:
        vc.close()
    return out


def _zero_and_grow(rank, world, port):
    import torch.distributed as dist

    from vmmkv.testing.vllm import configs

    with configs.vllm_groups(configs.vllm_config("LBNHC", pcp=world), rank, world, port) as ps:
        store = dist.distributed_c10d._get_default_store()
        out = {v: _zero_race(rank, world, ps, store, v) for v in ("without", "with the fix")}
        out.update({f"growth {lay}": _growth(rank, world, ps, lay) for lay in ("LBNHC", "BLNHC")})
    return out


zero_and_grow = vllm_world_fixture(_zero_and_grow, 2, timeout=560)


@pytest.mark.timeout(600)
def test_without_the_fix_a_late_zeroing_wipes_the_fast_ranks_first_published_rows(zero_and_grow):
    fast, slow = zero_and_grow[0]["without"], zero_and_grow[1]["without"]
    assert fast["lost"] == [0, 0, 0, 0] and fast["equal"]
    # the fast rank's indexer rows of layer 0 (published before the slow rank zeroed): 6 rows
    assert slow["lost"] == [ROWS - 1, 0, 0, 0] and not slow["equal"]


@pytest.mark.timeout(600)
def test_with_the_fix_zeroing_precedes_every_publication_and_no_row_is_lost(zero_and_grow):
    for rank in range(2):
        got = zero_and_grow[rank]["with the fix"]
        assert got["lost"] == [0, 0, 0, 0] and got["equal"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout,segments", [("LBNHC", 2 * LAYERS), ("BLNHC", 1)])
def test_grow_and_shrink_in_blocks_commit_exactly_the_blocks_of_every_layer(
    zero_and_grow, layout, segments
):
    for rank in range(2):
        g = zero_and_grow[rank][f"growth {layout}"]
        assert g["segments"] == segments
        assert "block 9" in g["refused"] and "committed 8 of 32" in g["refused"]
        steps = [g[t] for t in ("8 blocks", "grown to 32", "shrunk to 8", "grown to 12")]
        assert [s["blocks"] for s in steps] == [8, 32, 8, 12]
        assert all(s["equal"] for s in steps), steps
        # every rank's token in block 20, per layer and cache; this rank counts its own
        assert [s["skipped"] for s in steps] == [2 * LAYERS, 0, 2 * LAYERS, 2 * LAYERS]
        b8, b32, s8, b12 = (s["bytes"] for s in steps)
        assert b32 == g["size"] > b12 > s8 == b8
        assert b8 < g["size"] // 2  # 8 of 32 blocks of every layer, not a prefix of them
