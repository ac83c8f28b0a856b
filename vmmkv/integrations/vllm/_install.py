"""The vLLM 0.34.0 call sites vmmkv replaces, each patched where vLLM looks it up and restored
by :func:`uninstall`. PCP runs only on vLLM's v2 model runner (MRV2), so only MRV2's sites are
patched; the sites of vLLM's extensible KV cache are ``_extensible``'s (listed there).

| site (module: name) | replaced by |
|---|---|
| ``vllm.v1.worker.gpu.attn_utils: allocate_kv_cache`` (MRV2's allocation) | with vLLM's extensible KV cache's ``allocate`` hook: ``_extensible.allocate_extensible`` (vLLM's allocation over vmmkv's buffer, every view checked to be bound); without it a :class:`VllmKVCache` over the PCP group, which *replaces* the process's previous one (closed first: vLLM allocates a small profiling cache, tears it down, then allocates the real one); vLLM's own allocation when PCP is 1 |
| ``vllm.models.deepseek_v32.attention`` and ``vllm.model_executor.layers.attention.mla_attention``: ``maybe_gather_mla_latent_cache_inputs`` | no gather: this rank's rows and slots (replicated rows with the slots vLLM writes them at), the PCP case remembered for the insert |
| ``vllm.model_executor.layers.sparse_attn_indexer: maybe_gather_indexer_k`` | the same for the indexer (its own metadata's ``num_decode_tokens``) |
| ``vllm._custom_ops: concat_and_cache_mla``, ``indexer_k_quant_and_cache`` | into a vmmkv layer view after a replaced gather: the cache's store (direct publication + barrier, or vmmkv's gather fallback); any other call: vLLM's op unchanged |
| ``vllm.v1.worker.utils: KVBlockZeroer.zero_block_ids`` | a check that the blocks are committed, vLLM's zeroing, then the cache barrier |
| ``vllm.v1.worker.gpu.model_runner: copy_kv_cache_blocks_inplace`` | a check that the blocks are committed, vLLM's copy-on-write block copies (after the zeroing), then the cache barrier again: no peer publishes into this replica before its copies ran |
| ``vllm.v1.worker.gpu.model_runner: GPUModelRunner.shutdown`` | vLLM's shutdown, then the cache is closed |
| ``vllm.model_executor.layers.attention.mla_attention: MLAAttention._gather_pcp_cache_inputs`` | refused while a vmmkv cache is active (it copies the gathered rows into padded buffers, so the insert would write this rank's rows only); vLLM's otherwise |

Not a patch: ``install`` registers the ``vmmkv`` sleep-mode backend with vLLM's
``SleepModeBackendFactory`` (``_sleep``). The replaced ``allocate_kv_cache`` first runs
``check_vllm_config`` (local, before any collective: every rank refuses alike), then builds the
cache outside vLLM's CuMem pools (``_sleep.OutsideCuMemPools``: vmmkv's small device tensors
must not be dropped by a sleep).

A replaced gather and its insert pair up through a pending record per cache family (MLA,
indexer): the gather stores the PCP case and the tensors it returned; the insert that receives
exactly those tensors consumes it. An insert that does not (any call outside the PCP path) runs
vLLM's op; a replaced gather whose insert targets memory vmmkv did not allocate raises, naming
the tensor (the rows of the other ranks were never gathered, so vLLM's op would write too few).

Installation (:func:`install`) is all or nothing: the installed vLLM's version must be in
:data:`SUPPORTED_VLLM` (checked from the package metadata, :func:`check_vllm_version`, without
importing vLLM) and every site must exist with the parameters recorded here from 0.34.0;
otherwise :class:`UnsupportedVLLM` names vmmkv, the supported release and every site that moved,
and nothing is patched. :func:`install_when_worker_starts` (what ``register()`` uses) defers the
installation until the process imports MRV2's model runner module, so vLLM's API server and
engine-core processes never import vLLM modules on vmmkv's behalf.

The patches, the active cache and the pending records live in ``_state`` (the sleep-mode
backend reads the active cache there); this module writes them.

Local, not thread-safe: install/uninstall from one thread, like vLLM's worker.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch

from ...ops.formats import FORMATS, INDEXER_DIM
from ._elastic_engine import (
    STATS_UTILITY,
    _process_input_queue,
    _schedule,
    _scheduler_init,
    _stats_utility,
    _update_from_output,
)
from ._elastic_worker import _extend, _stamping, _update_requests
from ._extensible import agreed_lending, capture_spec, make_buffer
from ._state import _STATE, ABSENT, UnsupportedVLLM, _Patch, _Pending

__all__ = [
    "SUPPORTED_VLLM",
    "check_vllm_version",
    "install",
    "install_engine",
    "install_when_engine_core_loads",
    "install_when_worker_starts",
    "installed",
    "original",
    "uninstall",
    "vllm_indexer_kind",
    "vllm_mla_kind",
]

log = logging.getLogger(__name__)

MLA, INDEXER = "mla", "indexer"
MX_INDEXER_KIND = "indexer_k_mxfp8"
# The vLLM release whose internals the sites below are written against (PEP 440 specifier; a
# local build such as 0.34.0+cu130 matches).
SUPPORTED_VLLM = "==0.34.0"
# The last vmmkv release whose plugin is written for vLLM 0.33.0 (README, "Running vLLM with vmmkv").
LAST_033_TAG = "v0.1.0"
# The module whose import marks a process that runs an MRV2 GPU worker.
WORKER_MODULE = "vllm.v1.worker.gpu.model_runner"
ENGINE_MODULE = "vllm.v1.engine.core"  # elastic mode's engine sites (EngineCoreProc) live here


def check_vllm_version(version: str | None = None) -> str:
    """The installed vLLM's version (from its package metadata: no vLLM import), or
    :class:`UnsupportedVLLM` when it is not in :data:`SUPPORTED_VLLM`."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    from ... import __version__

    if version is None:
        try:
            version = importlib.metadata.version("vllm")
        except importlib.metadata.PackageNotFoundError:
            raise UnsupportedVLLM(
                f"VLLM_USE_VMMKV=1 but vLLM is not installed; vmmkv {__version__} supports "
                f"vllm{SUPPORTED_VLLM} (pip install 'vmmkv[vllm]')"
            ) from None
    try:
        ok = Version(version) in SpecifierSet(SUPPORTED_VLLM)
    except InvalidVersion:
        ok = False
    if not ok:
        raise UnsupportedVLLM(
            f"vmmkv {__version__}'s vLLM plugin supports vllm{SUPPORTED_VLLM} only (it replaces "
            f"internal call sites of that release); the installed vLLM is {version}. Install "
            'vllm==0.34.0 (README, "Running vLLM with vmmkv"; for vllm 0.33.0, vmmkv\'s tag '
            f"{LAST_033_TAG}) or unset VLLM_USE_VMMKV"
        )
    return version


def installed() -> bool:
    return bool(_STATE.patches)


def original(owner: Any, name: str) -> Any:
    """vLLM's own object behind a patched ``owner.name`` (for tests and debugging)."""
    for p in _STATE.patches + _STATE.engine_patches:
        if p.owner is owner and p.name == name:
            return p.original
    return getattr(owner, name)


def vllm_indexer_kind() -> str:
    """The vmmkv kind of the indexer K cache on this machine, by vLLM's own decision
    (``mqa_logits_use_mx_scales()``: SM100 stores each scale as four UE8M0 bytes)."""
    from vllm.utils.deep_gemm import mqa_logits_use_mx_scales

    if not mqa_logits_use_mx_scales():
        return "indexer_k"
    if MX_INDEXER_KIND not in FORMATS:
        from ._layout import UnsupportedKVCache

        raise UnsupportedKVCache(
            "vLLM stores the indexer K scales as packed UE8M0 bytes on this GPU "
            f"(mqa_logits_use_mx_scales()), and this vmmkv has no {MX_INDEXER_KIND!r} format"
        )
    return MX_INDEXER_KIND


def vllm_mla_kind() -> str:
    """The vmmkv kind whose bytes the installed vLLM writes into its ``fp8_ds_mla`` cache
    (``vmmkv.ops.formats.mla_kind_for(vllm.__version__)``: power-of-two tile scales)."""
    import vllm

    from ...ops.formats import mla_kind_for

    return mla_kind_for(vllm.__version__)


def check_vllm_config(cfg: Any) -> None:
    """Refuse (UnsupportedKVCache) what the vLLM config asks and vmmkv cannot do: activations
    other than bfloat16 (the stores take bf16), HiSparse KV caches, micro-batching (DBO), a
    KV-transfer connector (:func:`_check_kv_transfer`), and the sleep-mode settings
    ``_sleep.check_config`` refuses. Local."""
    from ._layout import UnsupportedKVCache

    model = cfg.model_config
    if model is not None and model.dtype != torch.bfloat16:
        raise UnsupportedKVCache(
            f"vmmkv stores bfloat16 activations only; the model {model.model!r} runs in "
            f"{model.dtype}"
        )
    if getattr(cfg.attention_config, "hisparse_config", None) is not None:
        raise UnsupportedKVCache("vmmkv does not support HiSparse KV caches (hisparse_config)")
    if cfg.parallel_config.use_ubatching:
        # microbatches interleave their layers: the pairing of a gather with its insert and the
        # barrier lane per microbatch are not implemented
        raise UnsupportedKVCache(
            "vmmkv does not support micro-batching (enable_dbo / ubatch_size > 1) yet"
        )
    _check_kv_transfer(getattr(cfg, "kv_transfer_config", None))
    from ._sleep import check_config  # sleep mode needs the vmmkv sleep-mode backend

    check_config(cfg)


def _check_kv_transfer(kvt: Any) -> None:
    """Refuse a KV-transfer connector (vLLM creates one when ``is_kv_transfer_instance``): no
    connector has run on vmmkv memory. RDMA connectors (NIXL, Mooncake) register the layer views
    for the NIC, but vmmkv's chunks are not created RDMA-capable and each layer range spans many
    physical allocations; connectors with a memory pool of their own expect the KV cache in it,
    and the replaced allocation does not use it; a grow or shrink remaps pages under registered
    addresses."""
    if kvt is None or not kvt.is_kv_transfer_instance:
        return
    from ._layout import UnsupportedKVCache

    name = kvt.kv_connector
    if name == "MultiConnector":
        children = kvt.kv_connector_extra_config.get("connectors", [])
        name += " (" + ", ".join(str(c.get("kv_connector")) for c in children) + ")"
    raise UnsupportedKVCache(
        f"the KV-transfer connector {name} (kv_role {kvt.kv_role!r}): no connector has been "
        "tested on vmmkv memory; vmmkv's chunks are not registered RDMA-capable (NIXL and "
        "Mooncake register the KV cache for the NIC), a connector's own memory pool would be "
        "bypassed (the KV cache lives in vmmkv's region), and a grow or shrink remaps pages "
        "under registered addresses. Run without --kv-transfer-config, or without "
        "VLLM_USE_VMMKV=1 (vLLM's own KV cache)"
    )


# -- the replacements ------------------------------------------------------------------------


def _allocate(orig: Callable[..., Any]) -> Callable[..., Any]:
    def allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes=None, allocate=None):
        from vllm.config import get_current_vllm_config_or_none
        from vllm.distributed.parallel_state import get_pcp_group

        pcp = get_pcp_group()
        if pcp.world_size == 1:
            log.info("vmmkv: prefill context parallel size 1: vLLM allocates its KV cache")
            return orig(kv_cache_config, device, layout, kernel_block_sizes, allocate)
        cfg = get_current_vllm_config_or_none()
        if allocate is not None:  # vLLM's extensible KV cache over vmmkv's buffer (_extensible)
            from ._extensible import allocate_extensible

            return allocate_extensible(
                orig, kv_cache_config, device, layout, kernel_block_sizes, allocate
            )
        if cfg is not None:
            check_vllm_config(cfg)
        # vLLM allocates more than once per worker (MRV2 with CUDA graphs: a profiling cache,
        # torn down by _teardown_profiling_state, then the real one; an engine re-created in
        # the same process): every allocation replaces the previous cache. vLLM dropped the
        # old views and graphs by then; a view it still held faults instead of reaching other
        # memory (the reservation lives as long as a view). Every rank allocates in the same
        # order, so every rank closes (local) and then builds the new cache (collective).
        close_active("vLLM allocates a new KV cache")
        cache = build_cache(
            cfg, pcp, "allocate_kv_cache", kv_cache_config, layout, device=device,
            kernel_block_sizes=kernel_block_sizes,
            **_elastic_kwargs(cfg, kv_cache_config, layout),
        )  # fmt: skip
        _STATE.active = cache
        return dict(cache.views)

    return allocate_kv_cache


def build_cache(cfg: Any, pcp: Any, call: str, kv_cache_config: Any, layout: Any,
                **kwargs: Any) -> Any:  # fmt: skip
    """A :class:`VllmKVCache` over vLLM's PCP group ``pcp`` (collective), built outside vLLM's
    CuMem pools: vLLM allocates inside them ("runtime", "kv_cache") when its sleep allocator
    is on, and a sleep discards what lives there. A refusal names the model (every rank refuses
    alike); a table that still reached a pool closes the cache and raises, naming ``call``."""
    from ._cache import VllmKVCache
    from ._layout import UnsupportedKVCache
    from ._sleep import OutsideCuMemPools

    outside = OutsideCuMemPools()
    try:
        with outside:
            cache = VllmKVCache(
                kv_cache_config, layout, cpu_group=pcp.cpu_group,
                device_group=pcp.device_group, mla_kind=vllm_mla_kind(),
                indexer_kind=vllm_indexer_kind(), **kwargs,
            )  # fmt: skip
    except UnsupportedKVCache as exc:
        model = cfg.model_config.model if cfg is not None and cfg.model_config else "?"
        raise UnsupportedKVCache(f"vmmkv cannot hold the KV cache of {model!r}: {exc}") from exc
    landed = "; ".join(outside.landed())
    if landed:
        cache.close()
        raise RuntimeError(
            f"rank {pcp.rank_in_group} ({kwargs.get('device')}): {call}: vmmkv's KV-cache "
            f"tables reached vLLM's CuMem pool although the plugin builds them outside it "
            f"({landed}); a sleep would discard them without a backup. Run without "
            "--enable-cumem-allocator and --enable-sleep-mode"
        )
    return cache


def _elastic_kwargs(cfg: Any, kv_cache_config: Any, layout: Any) -> dict[str, Any]:
    """Elastic mode (``VLLM_VMMKV_ELASTIC=1``): the floor committed at start and the elastic
    chunk, as the engine core computes them; a block-major layout is required (a layer-major
    one spreads each block over every layer's segment: chunks of 64 MiB would commit up to 2 x
    the blocks' bytes, small chunks cost a driver call each). Otherwise nothing."""
    from ._elastic_settings import elastic_enabled

    if not elastic_enabled():
        return {}
    from ._cache import elastic_chunk_bytes
    from ._elastic_settings import check_elastic_config, settings_for
    from ._elastic_worker import WORKER
    from ._layout import UnsupportedKVCache

    if cfg is None:
        raise UnsupportedKVCache("elastic KV needs vLLM's config in the allocating worker")
    check_elastic_config(cfg)
    if layout.name not in ("BLNHC", "BLHNC"):
        raise UnsupportedKVCache(
            f"elastic KV (VLLM_VMMKV_ELASTIC=1) needs a block-major KV cache layout, got "
            f"{layout.name}: set VLLM_KV_CACHE_LAYOUT=BLNHC"
        )
    chunk = elastic_chunk_bytes()
    WORKER.reset()  # a new cache: no resize applied yet
    return {
        "initial_blocks": settings_for(cfg, kv_cache_config, chunk).floor,
        "chunk_bytes": chunk,
    }


def close_active(why: str) -> None:
    """Close the process's cache (local, idempotent): pending records dropped, views invalid."""
    _STATE.pending.clear()
    cache, _STATE.active = _STATE.active, None
    if cache is not None:
        log.info("vmmkv: rank %d closes its KV cache (%s)", cache.rank, why)
        cache.close()


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


def _shutdown(orig: Callable[..., Any]) -> Callable[..., Any]:
    def shutdown(self):
        try:
            orig(self)
        finally:
            close_active("the worker's model runner shuts down")

    return shutdown


# (module, attribute path, replacement factory, the parameters vLLM 0.34.0 gives it): every use
# site vLLM 0.34.0's MRV2 worker looks these up at
_SITES: tuple[tuple[str, str, Callable[..., Any], tuple[str, ...]], ...] = (
    (
        "vllm.v1.worker.gpu.attn_utils", "allocate_kv_cache", _allocate,
        ("kv_cache_config", "device", "layout", "kernel_block_sizes", "allocate"),
    ),
    (
        "vllm.models.deepseek_v32.attention", "maybe_gather_mla_latent_cache_inputs", _gather_mla,
        ("kv_c_normed", "k_pe", "slot_mapping", "num_decode_tokens", "use_pcp",
         "pcp_shard_decode_requests"),
    ),
    (
        "vllm.model_executor.layers.attention.mla_attention",
        "maybe_gather_mla_latent_cache_inputs", _gather_mla,
        ("kv_c_normed", "k_pe", "slot_mapping", "num_decode_tokens", "use_pcp",
         "pcp_shard_decode_requests"),
    ),
    (
        "vllm.model_executor.layers.sparse_attn_indexer", "maybe_gather_indexer_k",
        _gather_indexer,
        ("k", "slot_mapping", "num_decode_tokens", "use_pcp", "pcp_shard_decode_requests"),
    ),
    (
        "vllm._custom_ops", "concat_and_cache_mla", _insert_mla,
        ("kv_c", "k_pe", "kv_cache", "slot_mapping", "kv_cache_dtype", "scale", "skip_scale"),
    ),
    (
        "vllm._custom_ops", "indexer_k_quant_and_cache", _insert_indexer,
        ("k", "kv_cache", "slot_mapping", "quant_block_size", "kv_cache_dtype"),
    ),
    ("vllm.v1.worker.utils", "KVBlockZeroer.zero_block_ids", _zero, ("self", "block_ids")),
    (
        "vllm.v1.worker.gpu.model_runner", "copy_kv_cache_blocks_inplace", _copy,
        ("kv_caches", "num_blocks", "kv_cache_block_copies"),
    ),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.shutdown", _shutdown, ("self",)),
    (
        "vllm.model_executor.layers.attention.mla_attention",
        "MLAAttention._gather_pcp_cache_inputs", _gather_into_buffers,
        ("self", "kv_c_normed", "k_pe", "slot_mapping"),
    ),
    # vLLM's extensible KV cache over vmmkv's buffer (_extensible)
    (
        "vllm.v1.worker.extensible_kv_cache", "ExtensibleTensor", lambda _orig: make_buffer,
        ("max_num_bytes", "device", "num_segments", "segment_capacities",
         "export_handle_types"),
    ),
    (
        "vllm.v1.worker.extensible_kv_cache", "ExtensibleKVCache.__init__", capture_spec,
        ("self", "kv_cache_config", "device", "layout", "export_handle_types"),
    ),
    (
        "vllm.v1.worker.extensible_kv_cache", "_release_for_weight_update", agreed_lending,
        ("kv_cache", "model", "reclaimable", "fail_if_short"),
    ),
)  # fmt: skip


WORKER_SITES: tuple[tuple[str, str, Callable[..., Any], tuple[str, ...]], ...] = (
    (
        "vllm.v1.worker.gpu.model_runner", "GPUModelRunner.update_requests", _update_requests,
        ("self", "scheduler_output"),
    ),
    (
        "vllm.v1.worker.gpu.model_runner", "GPUModelRunner.execute_model", _stamping,
        ("self", "scheduler_output", "intermediate_tensors", "dummy_run",
         "skip_attn_for_dummy_run", "is_profile", "context_len", "valid_dummy_state_slots",
         "randomize_inputs"),
    ),
    (
        "vllm.v1.worker.gpu.model_runner", "GPUModelRunner.sample_tokens", _stamping,
        ("self", "grammar_output"),
    ),
    ("vllm.v1.worker.gpu_worker", "Worker.extend_kv_cache", _extend, ("self", "num_blocks")),
)  # fmt: skip


ENGINE_SITES: tuple[tuple[str, str, Callable[..., Any], tuple[str, ...] | None], ...] = (
    (
        "vllm.v1.core.sched.scheduler", "Scheduler.__init__", _scheduler_init,
        ("self", "vllm_config", "kv_cache_config", "structured_output_manager", "block_size",
         "hash_block_size", "mm_registry", "include_finished_set", "log_stats"),
    ),
    (
        "vllm.v1.core.sched.scheduler", "Scheduler.schedule", _schedule,
        ("self", "throttle_prefills"),
    ),
    (
        "vllm.v1.core.sched.scheduler", "Scheduler.update_from_output", _update_from_output,
        ("self", "scheduler_output", "model_runner_output"),
    ),
    ("vllm.v1.engine.core", "EngineCoreProc._process_input_queue", _process_input_queue, ("self",)),
    ("vllm.v1.engine.core", f"EngineCore.{STATS_UTILITY}", _stats_utility, None),
)  # fmt: skip


def _lookup(module: str, path: str, added: bool = False) -> tuple[Any, str, Any]:
    owner: Any = importlib.import_module(module)
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    return owner, name, (getattr(owner, name, ABSENT) if added else getattr(owner, name))


# a site's parameters: those 0.34.0 gives it, or None for an attribute the plugin adds (absent
# from vLLM: an engine-core utility method, which vLLM's client calls by name)
Sites = tuple[tuple[str, str, Callable[..., Any], tuple[str, ...] | None], ...]


def _patches_for(sites: Sites) -> list[_Patch]:
    """The patches of ``sites``, checked: the vLLM version first, then that every site exists
    with the parameters 0.34.0 gives it (or, for an added attribute, that it does not exist);
    :class:`UnsupportedVLLM` lists every problem and nothing is patched. Imports the vLLM
    modules that hold the sites."""
    version = check_vllm_version()
    patches, problems = [], []
    for module, path, factory, params in sites:
        try:
            owner, name, current = _lookup(module, path, added=params is None)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{module}.{path}: missing ({type(exc).__name__}: {exc})")
            continue
        if params is None:
            if current is not ABSENT:
                problems.append(f"{module}.{path}: exists in this vLLM (vmmkv adds it)")
            else:
                patches.append(_Patch(owner, name, ABSENT, factory(None)))
            continue
        try:
            got = tuple(inspect.signature(current).parameters)
        except (TypeError, ValueError) as exc:
            got = (f"<no signature: {exc}>",)
        if got != params:
            problems.append(f"{module}.{path}: parameters {got}, expected {params}")
            continue
        patches.append(_Patch(owner, name, current, factory(current)))
    if problems:
        from ... import __version__

        raise UnsupportedVLLM(
            f"vmmkv {__version__}'s vLLM plugin (written for vllm{SUPPORTED_VLLM}) cannot patch "
            f"the installed vLLM {version}; nothing was patched: " + "; ".join(problems)
        )
    return patches


def _apply(patches: list[_Patch], where: str) -> list[_Patch]:
    for p in patches:
        setattr(p.owner, p.name, p.replacement)
    log.info("vmmkv: replaced %d vLLM call sites (%s)", len(patches), where)
    return patches


def install(sites: Sites = ()) -> None:
    """Patch every worker site, all or nothing (idempotent; :func:`_patches_for` checks them
    first), with elastic mode's worker sites when ``VLLM_VMMKV_ELASTIC=1``. ``sites``: tests
    only (default: every site of 0.34.0)."""
    if _STATE.patches:
        return
    from ._elastic_settings import elastic_enabled

    if not sites:
        sites = _SITES
        if elastic_enabled():
            sites += WORKER_SITES
    patches = _patches_for(sites)
    from ._sleep import register_backend  # vLLM's sleep-mode factory: the "vmmkv" backend

    register_backend()
    _STATE.patches = _apply(patches, "worker")


def install_engine() -> None:
    """Elastic mode's engine-core sites (``ENGINE_SITES``), all or nothing,
    idempotent. ``register()`` calls it in the process that runs vLLM's ``EngineCore``."""
    if _STATE.engine_patches:
        return
    _STATE.engine_patches = _apply(_patches_for(ENGINE_SITES), "engine core, elastic KV")


class _InstallHook(importlib.abc.MetaPathFinder):
    """Runs ``install`` right after ``module`` has been executed (its first import), once; the
    hook is the one ``_STATE.<slot>`` holds until then."""

    def __init__(self, module: str, install: Callable[[], None], slot: str) -> None:
        self.module, self.install, self.slot = module, install, slot

    def find_spec(self, fullname, path, target=None):
        if fullname != self.module or getattr(_STATE, self.slot) is not self:
            return None
        sys.meta_path.remove(self)  # find the real spec below, once
        setattr(_STATE, self.slot, None)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module
        install = self.install

        def exec_then_install(module):
            exec_module(module)
            install()

        loader.exec_module = exec_then_install
        return spec


def _when_imported(module: str, install: Callable[[], None], slot: str) -> None:
    """``install()`` now if ``module`` is imported, else right after its first import."""
    if module in sys.modules:
        install()
        return
    hook = _InstallHook(module, install, slot)
    setattr(_STATE, slot, hook)
    sys.meta_path.insert(0, hook)


def install_when_worker_starts() -> None:
    """Check the vLLM version now (no vLLM import), then install the patches when this process
    imports MRV2's model runner module (``WORKER_MODULE``): at once if it already did. vLLM's
    API server and engine-core processes never import it, so they import nothing of vLLM on
    vmmkv's behalf. Idempotent."""
    check_vllm_version()
    if _STATE.patches or _STATE.hook is not None:
        return
    _when_imported(WORKER_MODULE, install, "hook")


def install_when_engine_core_loads() -> None:
    """Elastic mode's engine sites (:func:`install_engine`) when this process imports vLLM's
    engine-core module (``ENGINE_MODULE``): at once if it already did. vLLM loads its plugins
    once per process, possibly before that import (``EngineArgs`` does), and an engine core
    forked or run in process never loads them again: the hook hands the sites over to it.
    Idempotent."""
    check_vllm_version()
    if _STATE.engine_patches or _STATE.engine_hook is not None:
        return
    _when_imported(ENGINE_MODULE, install_engine, "engine_hook")


def uninstall() -> None:
    """Restore every patched site, drop pending records, close the active cache (its views,
    which vLLM may still hold, are invalid afterwards), remove the pending import hooks.
    Idempotent."""
    for slot in ("hook", "engine_hook"):
        hook = getattr(_STATE, slot)
        if hook is not None and hook in sys.meta_path:
            sys.meta_path.remove(hook)
        setattr(_STATE, slot, None)
    patches, _STATE.patches = _STATE.patches + _STATE.engine_patches, []
    _STATE.engine_patches = []
    for p in reversed(patches):
        if getattr(p.owner, p.name, None) is p.replacement:
            if p.original is ABSENT:
                delattr(p.owner, p.name)
            else:
                setattr(p.owner, p.name, p.original)
        else:
            log.warning("vmmkv: %s.%s was patched again by someone else; left as it is",
                        getattr(p.owner, "__name__", p.owner), p.name)  # fmt: skip
    close_active("the plugin is unregistered")
