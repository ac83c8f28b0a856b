"""The engine harness's model: what vLLM's DeepSeek-V3.2 model does to its KV caches, and nothing
below.

Every layer has vLLM's own ``DeepseekV32IndexerCache`` (the indexer's K cache) and
:class:`MLALayer`, a stand-in for vLLM's ``MLAAttention`` as the KV cache sees it (its name in
the forward context, the spec ``MLAAttention.get_kv_cache_spec`` returns for ``fp8_ds_mla``,
``FlashMLASparseBackend`` as its backend): building the real attention module needs a CUDA
backend. vLLM plans, allocates and binds both, and builds their metadata each step
(``FlashMLASparseMetadataBuilder``, ``DeepseekV32IndexerMetadataBuilder``) with the slot
mappings of MRV2's ``BlockTables`` and ``PCPManager``.

:meth:`HarnessModel.forward` makes, per layer, the KV writes of vLLM's DeepSeek-V3.2 forward
exactly as its code makes them, through the names it looks up (the plugin's sites):
``sparse_attn_indexer``'s ``maybe_gather_indexer_k`` + ``ops.indexer_k_quant_and_cache``, and
``DeepseekV32Attention``'s ``maybe_gather_mla_latent_cache_inputs`` + its impl's
``do_kv_cache_update``, with the metadata and slot mappings vLLM put in the forward context.
Rows are a function of (token id, position, layer), so a token's rows are equal on every rank
that holds it, as a real forward's are. Then the reference (``reference.Reference``) takes the
same rows through vLLM's unpatched gather and vmmkv's reference writer, and checks the replica.
No attention is computed: the hidden states are zeros, summed over the TP group after every
layer as the real model's output projections sum them (vLLM's ``tensor_model_parallel_all_reduce``),
and the logits a fixed ramp (sampling stays vLLM's).

The model is built by vLLM's own loader path: the load format :data:`LOAD_FORMAT` is registered
with vLLM's ``register_model_loader``. Imports vLLM (a harness process imports it after
``host.ENV`` is set). Local.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

from ...ops.formats import INDEXER_DIM, INDEXER_ENTRY_BYTES, MLA_KV_DIM, MLA_ROPE_DIM

__all__ = ["LOAD_FORMAT", "HarnessModel", "MLALayer", "register_loader", "rows"]

LOAD_FORMAT = "vmmkv_harness"
HIDDEN = 16  # the hidden size the sampler sees (logits are computed from positions)


def rows(token_ids: torch.Tensor, positions: torch.Tensor, layer: int, width: int,
         salt: int) -> torch.Tensor:  # fmt: skip
    """bf16 ``[n, width]``: non-zero, varying in magnitude from row to row (so every tile
    scale differs), a function of (token id, position, layer, salt) only."""
    key = (token_ids.to(torch.int64) * 1000003 + positions.to(torch.int64) * 7919 +
           (layer * 104729 + salt * 15485863)).to(torch.float64)  # fmt: skip
    cols = torch.arange(width, dtype=torch.float64)
    x = torch.sin(key[:, None] * 1e-3 + cols[None, :] * 0.37 + 0.5) + 1.5
    scale = 0.05 + torch.remainder(key, 97.0) / 97.0 * 8.0
    return (x * scale[:, None]).to(torch.bfloat16)


def _dcp_manager(cfg: Any) -> Any:
    """vLLM's ``MLADCPManager`` as ``MLAAttention`` builds one under DCP > 1 for a DeepSeek-V3.2
    layer (its heads per TP rank, the latent and RoPE widths, bf16 activations; FlashMLA
    sparse's impl pads no heads and takes the LSE base e, vLLM's default)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size
    from vllm.v1.attention.ops.dcp import MLADCPManager

    heads = cfg.model_config.hf_config.num_attention_heads // get_tensor_model_parallel_world_size()
    return MLADCPManager(
        vllm_config=cfg, device=torch.device("cpu"), num_heads=heads,
        query_head_dim=MLA_KV_DIM + MLA_ROPE_DIM, output_head_dim=MLA_KV_DIM,
        query_dtype=torch.bfloat16, output_dtype=torch.bfloat16, padded_num_heads=None,
        is_lse_base_on_e=True, use_pcp=cfg.parallel_config.prefill_context_parallel_size > 1,
    )  # fmt: skip


class MLALayer(torch.nn.Module, AttentionLayerBase):
    """vLLM's ``MLAAttention`` as the KV cache and its metadata builder see it: registered in
    the forward context under ``prefix``, with the spec and backend of a DeepSeek-V3.2 layer of
    the ``fp8_ds_mla`` cache, no prefill backend of its own (as vLLM's sparse MLA layers), and
    under DCP > 1 vLLM's own ``MLADCPManager``."""

    def __init__(self, prefix: str, spec: Any) -> None:
        from vllm.config import get_current_vllm_config

        super().__init__()
        self.kv_cache = torch.tensor([])
        self.prefix = self.layer_name = prefix
        self.prefill_backend = None
        self._spec = spec
        cfg = get_current_vllm_config()
        self.dcp_manager = _dcp_manager(cfg) if cfg.parallel_config.decode_context_parallel_size > 1 \
            else None  # fmt: skip
        context = cfg.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self

    def get_kv_cache_spec(self, vllm_config: Any) -> Any:
        return self._spec

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache.squeeze(1)  # [B, H=1, N, C] -> [B, N, C], as MLAAttention

    def get_attn_backend(self) -> Any:
        from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend

        return FlashMLASparseBackend

    def forward(self) -> None:  # vLLM registers layers as modules; this one is never called
        raise RuntimeError("MLALayer holds a KV cache only")


class HarnessModel(torch.nn.Module):
    """``num_hidden_layers`` layers of vLLM's indexer K cache and :class:`MLALayer`; forward:
    the KV writes of each layer (module docstring), then ``reference.after_forward``."""

    def __init__(self, vllm_config: Any) -> None:
        from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache

        from .configs import idx_layer, mla_layer, mla_spec

        super().__init__()
        self.vllm_config = vllm_config
        hf = vllm_config.model_config.hf_config
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        pc = vllm_config.parallel_config
        self.use_pcp = pc.prefill_context_parallel_size > 1
        self.shard = bool(getattr(pc, "pcp_shard_decode_requests", False))
        self.scale_fmt = "ue8m0"  # DeepSeek-V3.2's Indexer.scale_fmt
        self.indexers = torch.nn.ModuleList()
        self.mla = torch.nn.ModuleList()
        for i in range(hf.num_hidden_layers):
            self.indexers.append(
                DeepseekV32IndexerCache(
                    head_dim=INDEXER_ENTRY_BYTES, dtype=torch.uint8, prefix=idx_layer(i),
                    cache_config=vllm_config.cache_config,
                )
            )  # fmt: skip
            self.mla.append(MLALayer(mla_layer(i), mla_spec(vllm_config)))
        self.k_scale = torch.ones(1, dtype=torch.float32)
        self.reference: Any = None  # set by the harness worker

    def forward(self, input_ids: torch.Tensor | None = None, positions: torch.Tensor = None,
                inputs_embeds: Any = None, intermediate_tensors: Any = None,
                **kwargs: Any) -> torch.Tensor:  # fmt: skip
        from vllm.distributed import tensor_model_parallel_all_reduce

        n = positions.shape[0]
        ids = input_ids if input_ids is not None else torch.zeros_like(positions)
        hidden = torch.zeros(n, HIDDEN, dtype=torch.bfloat16)
        writes = []
        for i in range(len(self.mla)):
            writes += self._layer(i, ids, positions)
            # each layer's output projection sums its TP shards, as the real model's does: a
            # TP rank that skips a step leaves its peers waiting here
            hidden = tensor_model_parallel_all_reduce(hidden)
        if self.reference is not None:
            self.reference.after_forward(writes)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # a fixed, non-uniform distribution: greedy picks the last token, sampling any
        ramp = torch.arange(self.vocab_size, dtype=torch.float32) * 1e-3
        return ramp.expand(hidden_states.shape[0], -1).clone()

    def load_weights(self, weights: Any) -> set[str]:
        return {name for name, _ in weights}

    def _layer(self, i: int, ids: torch.Tensor, positions: torch.Tensor) -> list[Any]:
        """Layer ``i``'s KV writes as vLLM makes them; returns what the reference replays:
        (family, layer view, rows, slot mapping, decode tokens) per write."""
        from vllm.forward_context import get_forward_context
        from vllm.model_executor.layers import sparse_attn_indexer as sai
        from vllm.model_executor.layers.attention.attention import get_attention_context
        from vllm.models.deepseek_v32 import attention as v32
        from vllm.utils.deep_gemm import mqa_logits_use_mx_scales

        writes = []
        metadata = get_forward_context().attn_metadata
        if metadata is None:  # vLLM's dummy runs without attention (profiling)
            return writes
        # the indexer: sparse_attn_indexer's insert (use_pcp: it writes the cache itself)
        indexer = self.indexers[i]
        meta = metadata[indexer.prefix]
        k = rows(ids, positions, i, INDEXER_DIM, 1)
        slot_mapping = meta.slot_mapping
        num_tokens = slot_mapping.shape[0]
        if self.use_pcp and num_tokens > k.shape[0]:
            from vllm.distributed.parallel_state import get_pcp_group

            num_tokens //= get_pcp_group().world_size
        k = k[:num_tokens]
        writes.append(("indexer", indexer.kv_cache, (k,), slot_mapping, meta.num_decode_tokens))
        k_cache, k_slots = sai.maybe_gather_indexer_k(
            k, slot_mapping, meta.num_decode_tokens, self.use_pcp,
            pcp_shard_decode_requests=self.shard,
        )  # fmt: skip
        sai.ops.indexer_k_quant_and_cache(
            k_cache, indexer.kv_cache, k_slots, INDEXER_DIM,
            "mxfp8" if mqa_logits_use_mx_scales() else self.scale_fmt,
        )  # fmt: skip
        # the MLA latent: DeepseekV32Attention's cache update under PCP
        layer = self.mla[i]
        attn_metadata, _, kv_cache, layer_slot_mapping = get_attention_context(layer.prefix)
        if attn_metadata is None or not self.use_pcp:
            return writes
        kv_c = rows(ids, positions, i, MLA_KV_DIM, 2)
        k_pe = rows(ids, positions, i, MLA_ROPE_DIM, 3)
        writes.append(("mla", kv_cache, (kv_c, k_pe), layer_slot_mapping,
                       attn_metadata.num_decode_tokens))  # fmt: skip
        kv_for_cache, kpe_for_cache, cache_slots = v32.maybe_gather_mla_latent_cache_inputs(
            kv_c, k_pe.unsqueeze(1), layer_slot_mapping, attn_metadata.num_decode_tokens, True,
            pcp_shard_decode_requests=self.shard,
        )  # fmt: skip
        impl = layer.get_attn_backend().get_impl_cls()
        impl.do_kv_cache_update(
            None, kv_for_cache, kpe_for_cache, kv_cache, cache_slots, "fp8_ds_mla",
            self.k_scale, False,
        )  # fmt: skip
        return writes


def register_loader() -> None:
    """Register :data:`LOAD_FORMAT` with vLLM's model-loader registry (idempotent): vLLM's
    ``BaseModelLoader.load_model`` builds :class:`HarnessModel`; no weights to load."""
    from vllm.model_executor import model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    if LOAD_FORMAT in model_loader._LOAD_FORMAT_TO_MODEL_LOADER:
        return

    @model_loader.register_model_loader(LOAD_FORMAT)
    class HarnessLoader(BaseModelLoader):
        def download_model(self, model_config: Any) -> None:
            pass

        def load_weights(self, model: Any, model_config: Any) -> None:
            pass

        def create_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
            return HarnessModel(vllm_config)
