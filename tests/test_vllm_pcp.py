"""vmmkv.integrations.vllm against the real vLLM 0.33.0 (CPU, host backend, spawned ranks).

Every rank joins vLLM's own process groups (``init_distributed_environment`` +
``initialize_model_parallel`` on gloo: vLLM builds the PCP ``GroupCoordinator``), builds a
DeepSeek-V3.2-shaped ``KVCacheConfig`` with vLLM's planner, allocates through the patched
``gpu_model_runner.allocate_kv_cache`` and stores through vLLM's call sites as vLLM calls them
(``sparse_attn_indexer``'s ``maybe_gather_indexer_k`` + ``ops.indexer_k_quant_and_cache``;
``maybe_gather_mla_latent_cache_inputs`` of ``deepseek_v32.attention`` and of
``mla_attention`` + vLLM's ``MLAAttentionImpl.do_kv_cache_update``). Every replica is compared,
over the whole backing, with a plain ``vllm.v1.worker.utils.allocate_kv_cache`` of the same
config, poisoned alike, into which ``vmmkv.ops.reference`` inserted every rank's tokens as vLLM's
gather would (all ranks' rows with their slots).

The three PCP cases per layer ("draft": replicated draft decodes, unexpanded slot mapping;
"shard": ``pcp_shard_decode_requests``; "dcp": DCP > 1, decode rows replicated, MLA and indexer
with different decode counts), each also checked by the bytes sent to peers and the barriers.
"""

from __future__ import annotations

import pytest

from tests.helpers import VLLM_LAYOUTS, vllm_marks
from vmmkv.testing.spawn import free_port, run_world

pytestmark = vllm_marks()

BS, NUM_BLOCKS, LAYERS = 64, 32, 4
MLA_B, IDX_B = 656, 132
# case -> (rows per rank, slots in the mapping per rank, MLA decodes, indexer decodes, shard)
CASES = {
    "draft": (6, 4, 4, 4, True),
    "shard": (7, 7, 2, 2, True),
    "dcp": (8, 8, 3, 5, False),
}
TAIL = 3  # valid slots after the group's rows in an expanded mapping: never to be written


def _bf16(seed, shape):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g).mul(6).add(0.1)
    return x.to(torch.bfloat16)


def _slot_pool():
    import torch

    return torch.randperm(NUM_BLOCKS * BS, generator=torch.Generator().manual_seed(99))


def _step(case, layer, prank, world, group_seed):
    """One layer's inputs of PCP rank ``prank`` in ``case``: (kv_c, k_pe, k, slot_mapping as
    vLLM hands it, the rank-major slots of every rank [world][rows], decodes MLA / indexer,
    shard). Replicated rows (decodes; "dcp": the first indexer-decode rows) are equal on every
    rank; a rank's other rows are its own."""
    import torch

    rows, nslots, nd_mla, nd_idx, shard = CASES[case]
    start = {"draft": 0, "shard": 64, "dcp": 128}[case]
    pool = _slot_pool()[start : start + 64]
    seed = 1000 * group_seed + 10 * layer + list(CASES).index(case)
    rep = nslots if case == "draft" else (nd_idx if case == "dcp" else 0)

    def rows_of(r):
        shared = [_bf16(seed + s, (rows, w)) for s, w in ((1, 512), (2, 64), (3, 128))]
        own = [_bf16(seed + 100 * (r + 1) + s, (rows, w)) for s, w in ((1, 512), (2, 64), (3, 128))]
        return [torch.cat([a[:rep], b[rep:]]) for a, b in zip(shared, own, strict=True)]

    if case == "draft":  # unexpanded: the same short mapping on every rank
        mapping = pool[:nslots].clone()
        per_rank = [mapping] * world
    else:
        per_rank = []
        for r in range(world):
            s = pool[8 + r * rows : 8 + (r + 1) * rows].clone()
            s[:rep] = pool[:rep]  # replicated rows: the same slots on every rank
            s[rows - 2 if r % 2 else 5] = -1  # padding
            per_rank.append(s)
        mapping = torch.cat([*per_rank, pool[60 : 60 + TAIL]])
    kv_c, k_pe, k = rows_of(prank)
    return (
        kv_c,
        k_pe,
        k,
        mapping,
        [rows_of(r) for r in range(world)],
        per_rank,
        nd_mla,
        nd_idx,
        shard,
    )


def _call_sites(vc, views, layer, inputs, world):
    """vLLM's PCP cache writes of one layer, through the names vLLM looks up."""
    import torch
    from vllm.model_executor.layers import sparse_attn_indexer as sai
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.models.deepseek_v32 import attention as v32
    from vllm.v1.attention.backend import MLAAttentionImpl

    from vmmkv.integrations.vllm.testing import idx_layer, mla_layer

    kv_c, k_pe, k, mapping, _, _, nd_mla, nd_idx, shard = inputs
    # sparse_attn_indexer: trim k (PCP padding kept), gather, insert
    n = mapping.shape[0]
    if n > k.shape[0]:
        n //= world
    k_cache, k_slots = sai.maybe_gather_indexer_k(
        k[:n], mapping, nd_idx, True, pcp_shard_decode_requests=shard
    )
    sai.ops.indexer_k_quant_and_cache(
        k_cache, views[idx_layer(layer)].squeeze(1), k_slots, 128, "ue8m0"
    )
    # DeepseekV32Attention._sparse_indexer_and_attn (even layers) / MLAAttention.update_kv_cache
    site = v32 if layer % 2 == 0 else mla_attention
    kv_f, kpe_f, s_f = site.maybe_gather_mla_latent_cache_inputs(
        kv_c, k_pe.unsqueeze(1), mapping, nd_mla, True, pcp_shard_decode_requests=shard
    )
    MLAAttentionImpl.do_kv_cache_update(
        None, kv_f, kpe_f, views[mla_layer(layer)].squeeze(1), s_f, "fp8_ds_mla",
        torch.ones(1), False,
    )  # fmt: skip


def _reference(vc, plain, layer, inputs):
    """vLLM's gather semantics on the plain allocation: every rank's rows with its slots, in
    the kinds the cache bound."""
    from vmmkv.integrations.vllm.testing import idx_layer, mla_layer
    from vmmkv.ops import reference as ref

    _, _, _, _, all_rows, per_rank, _, _, _ = inputs
    for (kv_c, k_pe, k), slots in zip(all_rows, per_rank, strict=True):
        n = slots.numel()
        idx, mla = idx_layer(layer), mla_layer(layer)
        ref.insert_indexer_k(plain[idx].squeeze(1), k[:n], slots, kind=vc.bindings[idx].kind)
        ref.insert_ds_mla(plain[mla].squeeze(1), kv_c[:n], k_pe[:n], slots,
                          kind=vc.bindings[mla].kind)  # fmt: skip


def _flat(view, size):
    import torch

    return torch.empty(0, dtype=torch.uint8).set_(view.untyped_storage(), 0, (size,), (1,))


def _same_views(got, buf, plain, plain_buf):
    return sorted(got) == sorted(plain) and all(
        got[n].shape == plain[n].shape
        and got[n].stride() == plain[n].stride()
        and got[n].dtype == plain[n].dtype
        and got[n].data_ptr() - buf.data_ptr() == plain[n].data_ptr() - plain_buf.data_ptr()
        for n in plain
    )


def _refusal(pcp_size, tp):
    """Allocation of MLA layers in bfloat16 ('auto' cache dtype) through the plugin: refused on
    every rank before any collective, naming the model, the layer and its spec."""
    import dataclasses

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker import gpu_model_runner

    from vmmkv.integrations import vllm as integration
    from vmmkv.integrations.vllm import testing

    cfg = testing.vllm_config("LBNHC", NUM_BLOCKS, tp=tp, pcp=pcp_size)
    specs = testing.layer_specs(cfg)
    for n in [n for n in specs if n.endswith(".attn")]:
        specs[n] = dataclasses.replace(
            specs[n], cache_dtype_str="auto", dtype=torch.bfloat16, state_content_bytes=None
        )
    cfg, config = testing.build_kv_cache_config("LBNHC", NUM_BLOCKS, tp=tp, pcp=pcp_size,
                                                specs=specs)  # fmt: skip
    with set_current_vllm_config(cfg), integration.patched():
        try:
            gpu_model_runner.allocate_kv_cache(
                config, torch.device("cpu"), KVCacheLayout.LBNHC, [BS]
            )
        except integration.UnsupportedKVCache as exc:
            return f"{exc} (active: {integration.active_cache()})"
    return "no error"


def _scenario(rank, world, port, tp, runs):
    """Per (layout, direct) run: allocate through the plugin, poison, the three cases through
    the call sites; returns what each rank saw."""
    import os

    import torch
    import torch.distributed as dist
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker import utils as worker_utils

    from vmmkv.integrations import vllm as integration
    from vmmkv.integrations.vllm import testing

    pcp_size = world // tp
    cfg0 = testing.vllm_config("LBNHC", NUM_BLOCKS, tp=tp, pcp=pcp_size)
    ps = testing.join_vllm_groups(cfg0, rank, world, port)
    pcp, tpg = ps.get_pcp_group(), ps.get_tp_group()
    out = {"pcp_ranks": pcp.ranks, "tp_ranks": tpg.ranks, "runs": {}}
    try:
        out["refused"] = _refusal(pcp_size, tp)
        for layout, direct in runs:
            os.environ["VMMKV_DIRECT"] = "1" if direct else "0"
            cfg, config = testing.build_kv_cache_config(layout, NUM_BLOCKS, tp=tp, pcp=pcp_size)
            size = config.kv_cache_tensors[0].size
            rep = {}
            with set_current_vllm_config(cfg), integration.patched():
                views = gpu_model_runner.allocate_kv_cache(
                    config, torch.device("cpu"), KVCacheLayout[layout], [BS]
                )
                vc = integration.active_cache()
                rep["direct"], rep["cache_rank"] = vc.direct, vc.rank
                rep["kinds"] = sorted({b.kind for b in vc.bindings.values()})
                plain = worker_utils.allocate_kv_cache(
                    config, torch.device("cpu"), KVCacheLayout[layout], [BS]
                )
                want = _flat(next(iter(plain.values())), size)
                rep["views_equal"] = _same_views(views, vc.buffer, plain, want)
                base = vc.cache.region.base_ptr
                rep["in_region"] = all(base <= v.data_ptr() < base + size for v in views.values())
                rep["bound"] = sorted(vc.bindings) == sorted(views)
                poison = torch.randint(0, 256, (size,), dtype=torch.uint8,
                                       generator=torch.Generator().manual_seed(5))  # fmt: skip
                vc.buffer.view(torch.uint8).copy_(poison)
                want.copy_(poison)
                dist.barrier(group=pcp.cpu_group)  # every replica poisoned before any store
                for case in CASES:
                    before = vc.stats()
                    for layer in range(LAYERS):
                        inputs = _step(case, layer, pcp.rank_in_group, pcp_size, tpg.rank_in_group)
                        _call_sites(vc, views, layer, inputs, pcp_size)
                        _reference(vc, plain, layer, inputs)
                    after = vc.stats()
                    dist.barrier(group=pcp.cpu_group)  # every rank's stores done
                    got = vc.buffer.view(torch.uint8)
                    rep[case] = {
                        "equal": bool(torch.equal(got, want)),
                        "differing_bytes": int((got != want).sum()),
                        "peer_bytes": after["peer_bytes_issued"] - before["peer_bytes_issued"],
                        "barriers": after["barriers"] - before["barriers"],
                        "skipped": after["out_of_range_slots"] - before["out_of_range_slots"],
                    }
                    dist.barrier(group=pcp.cpu_group)  # compared before the next case stores
            out["runs"][f"{layout}/{'direct' if direct else 'gather'}"] = rep
        # rank 0 hosts the store every group uses: it tears down only after every group is done
        dist.barrier(group=ps.get_world_group().cpu_group)
    finally:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()
    return out


def _expected_peer_bytes(case, world, direct):
    rows, nslots, nd_mla, nd_idx, _ = CASES[case]
    if not direct or case == "draft":
        return 0
    nlo_mla, nlo_idx = (0, 0) if case == "shard" else (nd_mla, nd_idx)
    return LAYERS * (world - 1) * ((rows - nlo_mla) * MLA_B + (rows - nlo_idx) * IDX_B)


def _check(rep, world, direct):
    assert rep["direct"] is direct
    # the bytes vLLM 0.33.0 writes on this machine: power-of-two MLA tile scales, fp32 indexer
    assert rep["kinds"] == ["fp8_ds_mla_ue8m0", "indexer_k"]
    assert rep["views_equal"] and rep["in_region"] and rep["bound"]
    for case in CASES:
        r = rep[case]
        assert r["equal"], f"{case}: {r['differing_bytes']} bytes differ from the reference"
        assert r["skipped"] == 0
        assert r["peer_bytes"] == _expected_peer_bytes(case, world, direct), (case, r)
        # direct: one barrier per cache store that sent rows to peers; none for local rows
        assert r["barriers"] == (0 if case == "draft" or not direct else 2 * LAYERS), (case, r)


@pytest.mark.timeout(600)
def test_two_pcp_ranks_publish_every_case_through_vllm_call_sites_in_every_layout_and_gather():
    runs = [(layout, True) for layout in VLLM_LAYOUTS] + [("LBNHC", False)]
    out = run_world(_scenario, 2, args=(free_port(), 1, runs), init_group=False, timeout=560)
    for rank, o in enumerate(out):
        assert o["pcp_ranks"] == [0, 1] and o["tp_ranks"] == [rank]
        assert "cannot hold the KV cache of '/" in o["refused"] and "vmmkv-dsv32-" in o["refused"]
        assert "layer 'model.layers.0.self_attn.attn' has MLAAttentionSpec(" in o["refused"]
        assert "cache_dtype_str='auto'" in o["refused"] and o["refused"].endswith("(active: None)")
        for name, rep in o["runs"].items():
            assert rep["cache_rank"] == rank, name
            _check(rep, 2, name.endswith("direct"))


@pytest.mark.timeout(600)
def test_tp2_pcp2_groups_built_by_vllm_each_hold_only_their_own_pcp_replicas():
    out = run_world(
        _scenario, 4, args=(free_port(), 2, [("LBNHC", True)]), init_group=False, timeout=560
    )
    # vLLM's order is [..., PCP, TP]: TP groups [0,1], [2,3]; PCP groups [0,2], [1,3]
    assert [o["tp_ranks"] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [o["pcp_ranks"] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    for rank, o in enumerate(out):
        rep = o["runs"]["LBNHC/direct"]
        assert rep["cache_rank"] == rank // 2
        _check(rep, 2, True)  # each PCP group's replicas equal its own reference (data per TP rank)
