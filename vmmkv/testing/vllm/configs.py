"""Internal helpers of the vLLM plugin's tests (no API promise; ``vmmkv.testing``): a
DeepSeek-V3.2-shaped ``KVCacheConfig`` built by vLLM 0.34.0's own functions, on the CPU, without
weights.

:func:`build_kv_cache_config` does what vLLM's engine does between the worker's
``get_kv_cache_spec`` and ``initialize_kv_cache``: the per-layer specs (each layer's indexer K
cache from the real ``DeepseekV32IndexerCache`` module, registered first as in the model; the
MLA spec with the arguments ``MLAAttention.get_kv_cache_spec`` passes, since building the
attention module needs a CUDA backend), ``customize_attention_spec`` with each layer's backend,
then ``get_global_kv_cache_groups`` and ``get_kv_cache_configs`` with ``num_gpu_blocks_override``.
The model config is a real ``ModelConfig`` from a ``config.json`` written to a temporary
directory (transformers' ``DeepseekV32Config`` with small sizes). :func:`vllm_groups` runs a
block inside vLLM's own distributed setup (gloo) and tears it down (collective).

``join_vllm_groups`` and ``vllm_groups`` are collective over the ranks that join; the rest is
local. Writes one config.json per process (in a fresh temporary directory).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from ...ops.formats import INDEXER_ENTRY_BYTES, MLA_ENTRY_BYTES, MLA_KV_DIM, MLA_ROPE_DIM

__all__ = [
    "build_kv_cache_config",
    "build_profiling_kv_cache_config",
    "idx_layer",
    "join_vllm_groups",
    "layer_specs",
    "mla_spec",
    "mla_layer",
    "model_config",
    "vllm_config",
    "vllm_groups",
]

log = logging.getLogger(__name__)

BLOCK_SIZE = 64
CACHE_DTYPE = "fp8_ds_mla"
_MODEL: dict[tuple, Any] = {}


def mla_layer(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def idx_layer(i: int) -> str:
    return f"model.layers.{i}.self_attn.indexer.k_cache"


def model_config(num_layers: int = 4, **settings: Any) -> Any:
    """A real vLLM ``ModelConfig`` of a DeepSeek-V3.2-shaped model of ``num_layers`` layers
    (no weights, no tokenizer) with ``settings`` (e.g. ``enable_sleep_mode``), cached per layer
    count and settings."""
    key = (num_layers, tuple(sorted(settings.items())))
    if key in _MODEL:
        return _MODEL[key]
    from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config
    from vllm.config import ModelConfig

    hf = DeepseekV32Config(
        num_hidden_layers=num_layers,
        # 64 query heads, not DeepSeek-V3.2's 128 (the KV cache has one head either way): vLLM's
        # FlashMLA-sparse builder refuses TP 2 x DCP 4 when the local and DCP-gathered heads
        # pad to different kernel envelopes, which 128 heads do (64 local, 128 gathered)
        num_attention_heads=64,
        first_k_dense_replace=num_layers,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        vocab_size=512,
        max_position_embeddings=2048,
    ).to_dict()
    hf["architectures"] = ["DeepseekV32ForCausalLM"]
    folder = tempfile.mkdtemp(prefix="vmmkv-dsv32-")
    # vLLM may read the folder again after this call, so it lives as long as the process.
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f)
    _MODEL[key] = ModelConfig(
        model=folder, skip_tokenizer_init=True, max_model_len=1024, dtype="bfloat16", **settings
    )
    return _MODEL[key]


def vllm_config(
    layout: str | None = None, num_blocks: int = 32, num_layers: int = 4, *, tp: int = 1,
    pcp: int = 1, kv_transfer_config: Any = None,
) -> Any:  # fmt: skip
    """A ``VllmConfig`` on the CPU device with the fp8_ds_mla cache, ``num_blocks`` blocks,
    ``layout`` (a KVCacheLayout name; None: vLLM resolves it), ``tp`` x ``pcp`` ranks and
    ``kv_transfer_config`` (a vLLM ``KVTransferConfig``, or None)."""
    from vllm.config import CacheConfig, DeviceConfig, ParallelConfig, VllmConfig

    cfg = VllmConfig(
        model_config=model_config(num_layers),
        device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, cache_dtype=CACHE_DTYPE),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, prefill_context_parallel_size=pcp),
        kv_transfer_config=kv_transfer_config,
    )
    cfg.cache_config.num_gpu_blocks_override = num_blocks
    if layout is not None:
        cfg.cache_config.kv_cache_layout = layout
    return cfg


def mla_spec(cfg: Any) -> Any:
    """The spec vLLM's ``MLAAttention.get_kv_cache_spec`` gives a DeepSeek-V3.2 layer of the
    fp8_ds_mla cache (building the attention module itself needs a CUDA backend)."""
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode

    return MLAAttentionSpec(
        block_size=cfg.cache_config.block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=MLA_KV_DIM + MLA_ROPE_DIM,
        dtype=kv_cache_dtype_str_to_dtype(CACHE_DTYPE, cfg.model_config),
        cache_dtype_str=CACHE_DTYPE,
        kv_quant_mode=get_kv_quant_mode(CACHE_DTYPE),
        state_content_bytes=MLA_ENTRY_BYTES,
        topk_buffer_width=cfg.model_config.hf_config.index_topk,
        is_index_group_leader=True,
        non_causal_multi_token_decode=False,
    )


def layer_specs(cfg: Any) -> dict[str, Any]:
    """Layer name -> spec, in the model's registration order (indexer K cache, then MLA)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
    from vllm.v1.worker.utils import customize_attention_spec

    hf = cfg.model_config.hf_config
    specs: dict[str, Any] = {}
    for i in range(hf.num_hidden_layers):
        with set_current_vllm_config(cfg):
            idx = DeepseekV32IndexerCache(
                head_dim=INDEXER_ENTRY_BYTES,  # 128 e4m3 values + one fp32 scale
                dtype=torch.uint8,
                prefix=idx_layer(i),
                cache_config=cfg.cache_config,
            )
            spec = idx.get_kv_cache_spec(cfg)
        specs[idx_layer(i)] = customize_attention_spec(idx.get_attn_backend(), spec)
        specs[mla_layer(i)] = customize_attention_spec(FlashMLASparseBackend, mla_spec(cfg))
    return specs


def build_kv_cache_config(
    layout: str, num_blocks: int = 32, num_layers: int = 4, *, tp: int = 1, pcp: int = 1,
    specs: dict[str, Any] | None = None,
) -> tuple[Any, Any]:  # fmt: skip
    """(VllmConfig, KVCacheConfig) of the model for ``layout``, planned by vLLM's
    ``get_global_kv_cache_groups`` + ``get_kv_cache_configs`` (vLLM raises for layouts it
    cannot place). ``specs``: other layer specs (default :func:`layer_specs`)."""
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

    cfg = vllm_config(layout, num_blocks, num_layers, tp=tp, pcp=pcp)
    specs = layer_specs(cfg) if specs is None else specs
    groups = get_global_kv_cache_groups(cfg, [specs])
    (config,) = get_kv_cache_configs(cfg, [specs], [1 << 40], groups)
    config.kv_cache_layout = layout
    return cfg, config


def build_profiling_kv_cache_config(
    layout: str, num_blocks: int, num_layers: int = 4, *, tp: int = 1, pcp: int = 1
) -> tuple[Any, Any]:  # fmt: skip
    """(VllmConfig, KVCacheConfig) of the minimal KV cache MRV2 allocates to profile CUDA-graph
    memory, as ``vllm.v1.worker.gpu.cudagraph_utils._init_minimal_kv_cache_for_profiling``
    builds it: the platform's ``KVCacheConfigBuilder``, ``get_kv_cache_groups_from_builder``,
    then ``get_kv_cache_config_from_groups(num_blocks=...)`` (no memory check)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups_from_builder

    cfg = vllm_config(layout, num_blocks, num_layers, tp=tp, pcp=pcp)
    specs = layer_specs(cfg)
    with set_current_vllm_config(cfg):
        builder = get_kv_cache_config_builder(cfg)
        groups = get_kv_cache_groups_from_builder(builder, cfg, specs)
        config = builder.get_kv_cache_config_from_groups(cfg, groups, num_blocks=num_blocks)
    config.kv_cache_layout = layout
    return cfg, config


def join_vllm_groups(cfg: Any, rank: int, world: int, port: int) -> Any:
    """vLLM's own distributed setup on gloo (CPU): ``init_distributed_environment`` over
    ``tcp://127.0.0.1:port`` then ``initialize_model_parallel`` with ``cfg``'s TP and PCP sizes,
    as a worker does. Returns vLLM's ``parallel_state`` module (``get_pcp_group()`` ...); the
    caller tears it down with ``destroy_model_parallel`` + ``destroy_distributed_environment``."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    pc = cfg.parallel_config
    with set_current_vllm_config(cfg):
        ps.init_distributed_environment(
            world, rank, f"tcp://127.0.0.1:{port}", rank, backend="gloo"
        )
        ps.initialize_model_parallel(
            pc.tensor_parallel_size, 1, pc.prefill_context_parallel_size, 1, backend="gloo"
        )
    return ps


@contextlib.contextmanager
def vllm_groups(cfg: Any, rank: int, world: int, port: int) -> Iterator[Any]:
    """:func:`join_vllm_groups` for the block (yields vLLM's ``parallel_state``), then the
    teardown: when the block succeeded, a barrier over the world group (rank 0 hosts the store
    every group uses: it tears down only after every rank is done); always
    ``destroy_model_parallel`` and ``destroy_distributed_environment``. Collective."""
    import torch.distributed as dist

    ps = join_vllm_groups(cfg, rank, world, port)
    try:
        yield ps
        dist.barrier(group=ps.get_world_group().cpu_group)
    finally:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()
