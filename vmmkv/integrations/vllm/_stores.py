"""The store sites: vLLM 0.34.0's PCP gather + insert pairs become one store through the cache, and
the cache barrier follows vLLM's zeroing and copy-on-write block copies (the package docstring,
"Zeroing hazard", says why). Installed by ``_install`` with the other worker sites.

| site (module: name) | replaced by |
|---|---|
| ``vllm.models.deepseek_v32.attention`` and ``vllm.model_executor.layers.attention.mla_attention``: ``maybe_gather_mla_latent_cache_inputs`` | no gather: this rank's rows and slots (replicated rows with the slots vLLM writes them at), the PCP case remembered for the insert |
| ``vllm.model_executor.layers.sparse_attn_indexer: maybe_gather_indexer_k`` | the same for the indexer (its own metadata's ``num_decode_tokens``) |
| ``vllm._custom_ops: concat_and_cache_mla``, ``indexer_k_quant_and_cache`` | into a vmmkv layer view after a replaced gather: the cache's store (direct publication + barrier, or vmmkv's gather fallback); any other call: vLLM's op unchanged |
| ``vllm.v1.worker.utils: KVBlockZeroer.zero_block_ids`` | a check that the blocks are committed, vLLM's zeroing, then the cache barrier |
| ``vllm.v1.worker.gpu.model_runner: copy_kv_cache_blocks_inplace`` | a check that the blocks are committed, vLLM's copy-on-write block copies (after the zeroing), then the cache barrier again: no peer publishes into this replica before its copies ran |
| ``vllm.model_executor.layers.attention.mla_attention: MLAAttention._gather_pcp_cache_inputs`` | refused while a vmmkv cache is active (it copies the gathered rows into padded buffers, so the insert would write this rank's rows only); vLLM's otherwise |

A replaced gather and its insert pair up through a pending record per cache family (MLA,
indexer): the gather stores the PCP case and the tensors it returned; the insert that receives
exactly those tensors consumes it. An insert that does not (any call outside the PCP path) runs
vLLM's op; a replaced gather whose insert targets memory vmmkv did not allocate raises, naming
the tensor (the rows of the other ranks were never gathered, so vLLM's op would write too few).
The pending records live in ``_state``; the store's plan is ``_cache.pcp_store_plan``'s.

Contract: the stores and the zeroing and copy barriers are collective over the PCP group, as
vLLM's own gathers are: every rank calls them in the same order. The replaced gathers are local.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...ops.formats import INDEXER_DIM
from ._state import _STATE, _Pending
from ._support import MX_INDEXER_KIND

MLA, INDEXER = "mla", "indexer"


def _gather_mla(orig: Callable[..., Any]) -> Callable[..., Any]:
    def maybe_gather_mla_latent_cache_inputs(
        kv_c_normed, k_pe, slot_mapping, num_decode_tokens, use_pcp,
        pcp_shard_decode_requests=False,
    ):  # fmt: skip
        cache = _STATE.active
        if cache is None or not use_pcp or num_decode_tokens is None:
            return orig(
                kv_c_normed, k_pe, slot_mapping, num_decode_tokens, use_pcp,
                pcp_shard_decode_requests,
            )  # fmt: skip
        plan = _plan(cache, kv_c_normed.shape[0], slot_mapping, num_decode_tokens,
                     pcp_shard_decode_requests)  # fmt: skip
        kv_c, kpe = kv_c_normed[: plan.tokens], k_pe[: plan.tokens]
        _STATE.pending[MLA] = _Pending(plan, kv_c)
        return kv_c, kpe, plan.slots

    return maybe_gather_mla_latent_cache_inputs


def _gather_indexer(orig: Callable[..., Any]) -> Callable[..., Any]:
    def maybe_gather_indexer_k(
        k, slot_mapping, num_decode_tokens, use_pcp, pcp_shard_decode_requests=False
    ):
        cache = _STATE.active
        if cache is None or not use_pcp:
            return orig(k, slot_mapping, num_decode_tokens, use_pcp, pcp_shard_decode_requests)
        plan = _plan(cache, k.shape[0], slot_mapping, num_decode_tokens,
                     pcp_shard_decode_requests)  # fmt: skip
        rows = k[: plan.tokens]
        _STATE.pending[INDEXER] = _Pending(plan, rows)
        return rows, plan.slots

    return maybe_gather_indexer_k


def _plan(cache, rows, slot_mapping, num_decode_tokens, shard):
    from ._cache import pcp_store_plan

    return pcp_store_plan(rows, slot_mapping, num_decode_tokens, shard, cache.rank,
                          cache.world_size)  # fmt: skip


def _take(family: str, rows: Any, slots: Any) -> _Pending | None:
    """The pending record of ``family`` if this insert receives exactly the tensors the replaced
    gather returned (then it is consumed), else None (and the record stays)."""
    p = _STATE.pending.get(family)
    if p is None or not isinstance(rows, torch.Tensor) or not isinstance(slots, torch.Tensor):
        return None
    own = p.plan.slots
    same = (
        rows.data_ptr() == p.rows.data_ptr()
        and rows.shape[0] == p.rows.shape[0]
        and slots.data_ptr() == own.data_ptr()
        and slots.numel() == own.numel()
    )
    if not same:
        return None
    del _STATE.pending[family]
    return p


def _bound(family: str, kv_cache: Any, op: str) -> Any:
    b = _STATE.active.binding(kv_cache, family) if isinstance(kv_cache, torch.Tensor) else None
    if b is None:
        got = (
            f"shape {list(kv_cache.shape)} at {kv_cache.data_ptr():#x}"
            if isinstance(kv_cache, torch.Tensor)
            else type(kv_cache).__name__
        )
        raise RuntimeError(
            f"rank {_STATE.active.rank}: {op} after vmmkv's PCP gather replacement targets a KV "
            f"cache ({got}) that is not a {family} layer view vmmkv allocated; the other ranks' "
            "rows were not gathered, so vLLM's op cannot write them"
        )
    return b


def _insert_mla(orig: Callable[..., Any]) -> Callable[..., Any]:
    def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale,
                             skip_scale=False):  # fmt: skip
        p = _take(MLA, kv_c, slot_mapping)
        if p is None:
            return orig(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale, skip_scale)
        b = _bound(MLA, kv_cache, "concat_and_cache_mla")
        if kv_cache_dtype != "fp8_ds_mla":
            raise RuntimeError(
                f"concat_and_cache_mla with kv_cache_dtype {kv_cache_dtype!r} into vmmkv layer "
                f"{b.name!r}: vmmkv writes 'fp8_ds_mla' only"
            )
        _STATE.active.store(b, (kv_c, k_pe.reshape(k_pe.shape[0], -1)), p.plan)

    return concat_and_cache_mla


def _insert_indexer(orig: Callable[..., Any]) -> Callable[..., Any]:
    def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, kv_cache_dtype):
        p = _take(INDEXER, k, slot_mapping)
        if p is None:
            return orig(k, kv_cache, slot_mapping, quant_block_size, kv_cache_dtype)
        b = _bound(INDEXER, kv_cache, "indexer_k_quant_and_cache")
        want = "mxfp8" if b.kind == MX_INDEXER_KIND else "ue8m0"
        if quant_block_size != INDEXER_DIM or kv_cache_dtype != want:
            raise RuntimeError(
                f"indexer_k_quant_and_cache(quant_block_size={quant_block_size}, "
                f"scale format {kv_cache_dtype!r}) into vmmkv layer {b.name!r} of kind "
                f"{b.kind!r}: vmmkv writes quant_block_size {INDEXER_DIM} with {want!r} only"
            )
        _STATE.active.store(b, (k,), p.plan)

    return indexer_k_quant_and_cache


def _zero(orig: Callable[..., Any]) -> Callable[..., Any]:
    def zero_block_ids(self, block_ids):
        cache = _STATE.active
        if cache is not None and block_ids:
            cache.check_blocks(block_ids)
        orig(self, block_ids)
        if cache is not None and block_ids and getattr(self, "_meta", None) is not None:
            cache.after_zeroing()

    return zero_block_ids


def _copy(orig: Callable[..., Any]) -> Callable[..., Any]:
    def copy_kv_cache_blocks_inplace(kv_caches, num_blocks, kv_cache_block_copies):
        cache = _STATE.active
        if cache is not None and kv_cache_block_copies:
            cache.check_blocks([b for pair in kv_cache_block_copies for b in pair])
        orig(kv_caches, num_blocks, kv_cache_block_copies)
        if cache is not None and kv_cache_block_copies:
            cache.after_zeroing()  # the copies wrote the own replica, as zeroing does

    return copy_kv_cache_blocks_inplace


def _gather_into_buffers(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _gather_pcp_cache_inputs(self, kv_c_normed, k_pe, slot_mapping):
        if _STATE.active is not None:
            # it copies the gathered rows into padded buffers: the insert would not receive
            # the tensors the replaced gather returned, and vLLM's op would write this rank's
            # rows only. DeepSeek-V3.2 reaches it only with HiSparse, which is refused.
            raise RuntimeError(
                f"rank {_STATE.active.rank}: layer {getattr(self, 'layer_name', '?')!r}: "
                "vLLM's PIECEWISE-graph PCP gather of the generic MLA layer "
                "(MLAAttention._gather_pcp_cache_inputs) is not supported with "
                "VLLM_USE_VMMKV=1"
            )
        return orig(self, kv_c_normed, k_pe, slot_mapping)

    return _gather_pcp_cache_inputs
