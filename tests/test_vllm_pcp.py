"""vmmkv.integrations.vllm driven by vLLM 0.34.0's own control flow (CPU, host backend, spawned
ranks): nothing vLLM computes is drawn by hand here.

- **Groups**: every rank joins vLLM's own process groups (``init_distributed_environment`` +
  ``initialize_model_parallel`` on gloo: vLLM builds the PCP ``GroupCoordinator``).
- **Allocation**: MRV2's sequence with CUDA graphs on: a small profiling KV cache through
  ``vllm.v1.worker.gpu.attn_utils.allocate_kv_cache`` (the patched site), vLLM's teardown (its
  views dropped), then the real cache of an uneven block count (its backing is not a multiple
  of the allocation granularity), both planned by vLLM's ``get_kv_cache_configs``.
- **Slot mappings**: vLLM's MRV2 ``PCPManager`` (``_build_batch_layout`` +
  ``_convert_to_gathered_slot_mappings``) for PCP 2 and 4, DCP 1 (vLLM then shards decode
  requests: ``pcp_shard_decode_requests``) and DCP 2 (decodes and short prefills replicated,
  rank 0 their canonical writer), over step mixes: decode-only, mixed, prefill-only, a prefill
  crossing blocks, and replicated draft decodes (unexpanded mapping). Every rank's rows are
  those of the global tokens ``PCPManager`` gives it (``_padded_gather_idx``), so replicated
  rows are equal on every rank as in a real forward. The mappings come from one global block
  table, the same on every rank: under DCP 2 vLLM's own block tables shard the cache over the
  DCP ranks (each rank's mapping holds its own slots, -1 for the other's tokens), which only
  the engine harness (``tests/test_vllm_engine.py``) builds; here DCP 2 checks the gather path
  the plugin takes for it.
- **Stores**: through vLLM's call sites (``sparse_attn_indexer``'s ``maybe_gather_indexer_k`` +
  ``ops.indexer_k_quant_and_cache``; ``maybe_gather_mla_latent_cache_inputs`` of
  ``deepseek_v32.attention`` and of ``mla_attention`` + ``MLAAttentionImpl.do_kv_cache_update``).
- **Expected replica**: vLLM's unpatched path on a plain ``vllm.v1.worker.utils.allocate_kv_cache``
  of the same config, poisoned alike: vLLM's own ``_gather_prefill_cache_inputs`` (its gloo
  all-gather) on the same inputs, its rows inserted at its slots by ``vmmkv.ops.reference``.
  Every replica equals it over the whole backing, direct publication and gather fallback.
"""

from __future__ import annotations

import pytest

from tests.helpers import vllm_marks
from vmmkv.testing.spawn import run_world

pytestmark = vllm_marks()

BS, LAYERS = 64, 4
NUM_BLOCKS, PROFILE_BLOCKS = 37, 5  # uneven: 37 x 4 x 50432 B is not a multiple of 4 KiB
MLA_B, IDX_B = 656, 132
# step mix -> requests (query length, computed tokens before the step, prefilling), the extra
# leading rows the indexer's metadata counts as decodes under DCP > 1 (a replicated short
# prefill right after the decodes: the indexer and MLA may classify it differently)
MIXES = {
    "decode-only": ([(1, 70, False), (1, 5, False), (1, 128, False)], 0),
    "mixed": ([(1, 63, False), (3, 20, True), (1, 9, False), (45, 50, True)], 3),
    "prefill-only": ([(37, 0, True), (16, 64, True)], 0),
    "prefill-crossing-blocks": ([(150, 30, True)], 0),
}


def _bf16(seed, shape):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g).mul(6).add(0.1)
    return x.to(torch.bfloat16)


def _global_step(mix, layer, step_seed):
    """The scheduler's view of one step, equal on every rank: per request its blocks and the
    global slot of every scheduled token, and every global token's KV inputs for ``layer``."""
    import numpy as np
    import torch

    reqs, _ = MIXES[mix]
    g = torch.Generator().manual_seed(step_seed)
    pool = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    slots, used = [], 0
    for q, computed, _prefill in reqs:
        need = (computed + q + BS - 1) // BS
        table, used = pool[used : used + need], used + need
        slots += [table[p // BS] * BS + p % BS for p in range(computed, computed + q)]
    n = len(slots)
    seed = 1000 * step_seed + 10 * layer
    inputs = [_bf16(seed + s, (n, w)) for s, w in ((1, 512), (2, 64), (3, 128))]
    nst = np.array([q for q, _, _ in reqs])
    return {
        "nst": nst,
        "computed": np.array([c for _, c, _ in reqs]),
        "prefilling": np.array([p for _, _, p in reqs]),
        "qsl": np.concatenate([[0], np.cumsum(nst)]),
        "slots": torch.tensor(slots, dtype=torch.int64),
        "inputs": inputs,
    }


def _pcp_step(mix, layer, step_seed, prank, world, dcp):
    """This PCP rank's share of a step as vLLM's PCPManager lays it out: (kv_c, k_pe, k, the
    expanded slot mapping, MLA decodes, indexer decodes, shard_decode_requests)."""
    import torch
    from vllm.v1.worker.gpu import pcp_manager as pm

    # CPU only: vLLM's async_tensor_h2d pins host memory (CUDA); the values are unchanged
    pm.async_tensor_h2d = lambda data, dtype=None, device=None, **_: torch.tensor(
        data, dtype=dtype, device=device
    )
    shard = dcp == 1  # vLLM's ParallelConfig.pcp_shard_decode_requests: PCP > 1 and DCP == 1
    glob = _global_step(mix, layer, step_seed)
    m = pm.PCPManager(world, prank, torch.device("cpu"), shard, dcp_world_size=dcp)
    segments, per_rank = m._build_batch_layout(
        glob["nst"], glob["computed"], glob["prefilling"], glob["qsl"]
    )
    padded = max(per_rank)
    mapping = m._convert_to_gathered_slot_mappings(glob["slots"].view(1, -1))[0].clone()
    idx = m._padded_gather_idx[prank * padded : (prank + 1) * padded]
    kv_c, k_pe, k = (t[idx] for t in glob["inputs"])
    mine = segments[prank]
    nd = sum(s.num_tokens for s in mine if not glob["prefilling"][s.global_batch_req_idx])
    extra = MIXES[mix][1] if dcp > 1 else 0
    return kv_c, k_pe, k, mapping, nd, nd + extra, shard


def _draft_step(layer, step_seed):
    """Replicated draft decodes: the unexpanded slot mapping of the decodes (equal on every
    rank), the rows padded past it."""
    glob = _global_step("decode-only", layer, step_seed)
    n = glob["slots"].numel()
    kv_c, k_pe, k = (t.repeat(2, 1)[: n + 2] for t in glob["inputs"])
    return kv_c, k_pe, k, glob["slots"].clone(), n, n, False


def _call_sites(views, layer, kv_c, k_pe, k, mapping, nd_mla, nd_idx, shard, world):
    """vLLM's PCP cache writes of one layer, through the names vLLM looks up."""
    import torch
    from vllm.model_executor.layers import sparse_attn_indexer as sai
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.models.deepseek_v32 import attention as v32
    from vllm.v1.attention.backend import MLAAttentionImpl

    from vmmkv.testing.vllm.configs import idx_layer, mla_layer

    k_cache, k_slots = sai.maybe_gather_indexer_k(
        k, mapping, nd_idx, True, pcp_shard_decode_requests=shard
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


def _vllm_reference(vc, plain, layer, kv_c, k_pe, k, mapping, nd_mla, nd_idx, shard):
    """vLLM's unpatched gather (collective: its all-gather on the PCP group), its rows inserted
    at its slots into the plain allocation by vmmkv's reference writer."""
    from vllm.v1.attention.ops import pcp as vpcp

    from vmmkv.ops import reference as ref
    from vmmkv.testing.vllm.configs import idx_layer, mla_layer

    idx, mla = idx_layer(layer), mla_layer(layer)
    (ik,), islots = vpcp._gather_prefill_cache_inputs((k,), mapping, nd_idx, shard)
    ref.insert_indexer_k(plain[idx].squeeze(1), ik, islots, kind=vc.bindings[idx].kind)
    (mkv, mkp), mslots = vpcp._gather_prefill_cache_inputs((kv_c, k_pe), mapping, nd_mla, shard)
    ref.insert_ds_mla(plain[mla].squeeze(1), mkv, mkp, mslots, kind=vc.bindings[mla].kind)


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
    from vllm.v1.worker.gpu import attn_utils

    from vmmkv.integrations import vllm as integration
    from vmmkv.testing.vllm import configs

    cfg = configs.vllm_config("LBNHC", NUM_BLOCKS, tp=tp, pcp=pcp_size)
    specs = configs.layer_specs(cfg)
    for n in [n for n in specs if n.endswith(".attn")]:
        specs[n] = dataclasses.replace(
            specs[n], cache_dtype_str="auto", dtype=torch.bfloat16, state_content_bytes=None
        )
    cfg, config = configs.build_kv_cache_config("LBNHC", NUM_BLOCKS, tp=tp, pcp=pcp_size,
                                                specs=specs)  # fmt: skip
    with set_current_vllm_config(cfg), integration.patched():
        try:
            attn_utils.allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBNHC, [BS])
        except integration.UnsupportedKVCache as exc:
            return f"{exc} (active: {integration.active_cache()})"
    return "no error"


def _allocate_as_mrv2(layout, tp, pcp_size):
    """MRV2's allocation sequence with CUDA graphs on (profile_cudagraph_memory ->
    _init_minimal_kv_cache_for_profiling, _teardown_profiling_state, then
    initialize_kv_cache): returns (views, cache, what the profiling cache looked like)."""
    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.gpu import attn_utils

    from vmmkv.integrations import vllm as integration
    from vmmkv.testing.vllm import configs

    _, prof_config = configs.build_profiling_kv_cache_config(
        layout, PROFILE_BLOCKS, tp=tp, pcp=pcp_size
    )
    _, config = configs.build_kv_cache_config(layout, NUM_BLOCKS, tp=tp, pcp=pcp_size)
    cpu, lay = torch.device("cpu"), KVCacheLayout[layout]
    prof_views = attn_utils.allocate_kv_cache(prof_config, cpu, lay, [BS])
    prof = integration.active_cache()
    seen = {"profiling_blocks": prof.committed_blocks, "profiling_views": len(prof_views)}
    del prof_views  # vLLM's teardown drops the views (kv_caches.clear(), layers detached)
    views = attn_utils.allocate_kv_cache(config, cpu, lay, [BS])
    vc = integration.active_cache()
    try:
        prof.cache.allocate(4096)  # local: a closed cache refuses it
        seen["profiling_after"] = "open"
    except RuntimeError as exc:
        seen["profiling_after"] = str(exc)
    del prof
    return views, vc, config, seen


def _shutdown_closes(vc):
    """vLLM's worker shutdown (``Worker.shutdown`` -> MRV2's ``GPUModelRunner.shutdown``, the
    patched method) on a runner with nothing else to release: (no active cache left, what the
    closed cache says)."""
    from unittest import mock

    from vllm.v1.worker.gpu import model_runner as mrv2

    from vmmkv.integrations import vllm as integration
    from vmmkv.testing.vllm import configs

    runner = object.__new__(mrv2.GPUModelRunner)
    runner.aux_output_connector = None
    runner.vllm_config = configs.vllm_config("LBNHC", NUM_BLOCKS)  # shutdown resets its fields
    with mock.patch("torch.accelerator.synchronize", lambda *a: None):  # CPU: no device
        mrv2.GPUModelRunner.shutdown(runner)
    try:
        vc.cache.allocate(4096)
        return integration.active_cache() is None, "open"
    except RuntimeError as exc:
        return integration.active_cache() is None, str(exc).split(": ", 1)[1]


def _scenario(rank, world, port, tp, runs, dcps):
    """Per (layout, direct) run: allocate as MRV2 does, poison, every DCP x step mix through
    the call sites; returns what each rank saw."""
    import os

    import torch
    import torch.distributed as dist
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker import utils as worker_utils

    from vmmkv.integrations import vllm as integration
    from vmmkv.testing.vllm import configs

    pcp_size = world // tp
    cfg = configs.vllm_config("LBNHC", NUM_BLOCKS, tp=tp, pcp=pcp_size)
    with configs.vllm_groups(cfg, rank, world, port) as ps:
        pcp, tpg = ps.get_pcp_group(), ps.get_tp_group()
        prank = pcp.rank_in_group
        out = {"pcp_ranks": pcp.ranks, "tp_ranks": tpg.ranks, "runs": {}}
        out["refused"] = _refusal(pcp_size, tp)
        for layout, direct in runs:
            os.environ["VMMKV_DIRECT"] = "1" if direct else "0"
            rep = {}
            with set_current_vllm_config(cfg), integration.patched():
                views, vc, config, rep["allocation"] = _allocate_as_mrv2(layout, tp, pcp_size)
                size = config.kv_cache_tensors[0].size
                rep["direct"], rep["cache_rank"] = vc.direct, vc.rank
                rep["kinds"] = sorted({b.kind for b in vc.bindings.values()})
                rep["capacity"], rep["size"] = vc.cache.capacity_bytes, size
                plain = worker_utils.allocate_kv_cache(
                    config, torch.device("cpu"), KVCacheLayout[layout], [BS]
                )
                want = _flat(next(iter(plain.values())), size)
                rep["views_equal"] = _same_views(views, vc.buffer, plain, want)
                rep["committed_blocks"] = vc.committed_blocks
                poison = torch.randint(1, 256, (size,), dtype=torch.uint8,
                                       generator=torch.Generator().manual_seed(5))  # fmt: skip
                vc.buffer.view(torch.uint8).copy_(poison)
                want.copy_(poison)
                dist.barrier(group=pcp.cpu_group)  # every replica poisoned before any store
                steps = [(f"dcp{d}/{mix}", d, mix) for d in dcps for mix in MIXES]
                steps.append(("draft", None, "draft"))
                for n, (name, dcp, mix) in enumerate(steps):
                    before, expect = vc.stats(), {"peer_bytes": 0, "barriers": 0}
                    for layer in range(LAYERS):
                        seed = 100 * n + 7 * tpg.rank_in_group + 1
                        step = (
                            _draft_step(layer, seed)
                            if dcp is None
                            else _pcp_step(mix, layer, seed, prank, pcp_size, dcp)
                        )
                        _call_sites(views, layer, *step, pcp_size)
                        _vllm_reference(vc, plain, layer, *step)
                        rows, mapping, nd_mla, nd_idx, shard = step[0].shape[0], *step[3:]
                        # expanded: rows past nlo published; under DCP > 1 (vLLM shards the
                        # cache over the DCP ranks) every store takes the gather path instead
                        if direct and mapping.numel() > rows and shard:
                            for nd, entry in ((nd_mla, MLA_B), (nd_idx, IDX_B)):
                                nlo = 0 if shard else nd  # sharded decodes are published
                                expect["peer_bytes"] += (pcp_size - 1) * (rows - nlo) * entry
                                expect["barriers"] += int(nlo < rows)
                    after = vc.stats()
                    dist.barrier(group=pcp.cpu_group)  # every rank's stores done
                    got = vc.buffer.view(torch.uint8)
                    rep[name] = {
                        "equal": bool(torch.equal(got, want)),
                        "differing_bytes": int((got != want).sum()),
                        "peer_bytes": after["peer_bytes_issued"] - before["peer_bytes_issued"],
                        "barriers": after["barriers"] - before["barriers"],
                        "skipped": after["out_of_range_slots"] - before["out_of_range_slots"],
                        "expect": expect,
                    }
                    dist.barrier(group=pcp.cpu_group)  # compared before the next step stores
                rep["closed_by_shutdown"] = _shutdown_closes(vc)
            out["runs"][f"{layout}/{'direct' if direct else 'gather'}"] = rep
    return out


def _check(rep, direct, names):
    assert rep["direct"] is direct
    # the bytes vLLM 0.34.0 writes on this machine: power-of-two MLA tile scales, fp32 indexer
    assert rep["kinds"] == ["fp8_ds_mla_ue8m0", "indexer_k"]
    alloc = rep["allocation"]
    assert alloc["profiling_blocks"] == PROFILE_BLOCKS and alloc["profiling_views"] == 2 * LAYERS
    assert alloc["profiling_after"].endswith("ReplicatedKVCache is closed"), alloc  # replaced
    assert rep["size"] % 4096 and rep["capacity"] == -(-rep["size"] // 4096) * 4096, rep
    assert rep["views_equal"] and rep["committed_blocks"] == NUM_BLOCKS
    assert rep["closed_by_shutdown"] == (True, "ReplicatedKVCache is closed"), rep
    for name in names:
        r = rep[name]
        assert r["equal"], f"{name}: {r['differing_bytes']} bytes differ from vLLM's own path"
        assert r["skipped"] == 0, (name, r)
        assert (r["peer_bytes"], r["barriers"]) == (
            r["expect"]["peer_bytes"],
            r["expect"]["barriers"],
        ), (name, r)


def _names(dcps):
    return [f"dcp{d}/{mix}" for d in dcps for mix in MIXES] + ["draft"]


@pytest.mark.timeout(900)
def test_two_pcp_ranks_match_vllms_own_path_for_every_pcp_manager_step_both_families_and_gather(
    world_store,
):
    runs = [("LBNHC", True), ("BLNHC", True), ("LBNHC", False)]
    out = run_world(_scenario, 2, args=(world_store.port, 1, runs, (1, 2)), init_group=False,
                    env=world_store.env, timeout=860)  # fmt: skip
    for rank, o in enumerate(out):
        assert o["pcp_ranks"] == [0, 1] and o["tp_ranks"] == [rank]
        assert "cannot hold the KV cache of '/" in o["refused"] and "vmmkv-dsv32-" in o["refused"]
        assert "layer 'model.layers.0.self_attn.attn' has MLAAttentionSpec(" in o["refused"]
        assert "cache_dtype_str='auto'" in o["refused"] and o["refused"].endswith("(active: None)")
        for name, rep in o["runs"].items():
            assert rep["cache_rank"] == rank, name
            _check(rep, name.endswith("direct"), _names((1, 2)))


@pytest.mark.timeout(900)
def test_four_pcp_ranks_match_vllms_own_path_for_every_pcp_manager_step_direct_and_gather(
    world_store,
):
    runs = [("LBNHC", True), ("LBNHC", False)]
    out = run_world(_scenario, 4, args=(world_store.port, 1, runs, (1, 2)), init_group=False,
                    env=world_store.env, timeout=860)  # fmt: skip
    for rank, o in enumerate(out):
        assert o["pcp_ranks"] == [0, 1, 2, 3]
        for name, rep in o["runs"].items():
            assert rep["cache_rank"] == rank, name
            _check(rep, name.endswith("direct"), _names((1, 2)))


@pytest.mark.timeout(900)
def test_tp2_pcp2_groups_built_by_vllm_each_hold_only_their_own_pcp_replicas(world_store):
    out = run_world(
        _scenario, 4, args=(world_store.port, 2, [("LBNHC", True)], (2,)), init_group=False,
        env=world_store.env, timeout=860,
    )  # fmt: skip
    # vLLM's order is [..., PCP, TP]: TP groups [0,1], [2,3]; PCP groups [0,2], [1,3]
    assert [o["tp_ranks"] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [o["pcp_ranks"] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    for rank, o in enumerate(out):
        rep = o["runs"]["LBNHC/direct"]
        assert rep["cache_rank"] == rank // 2
        _check(rep, True, _names((2,)))  # each PCP group's replicas equal its own reference
