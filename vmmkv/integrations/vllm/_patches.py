"""The vLLM 0.33.0 call sites vmmkv replaces, each patched where vLLM looks it up and restored
by :func:`uninstall`.

| site (module: name) | replaced by |
|---|---|
| ``vllm.v1.worker.gpu_model_runner: allocate_kv_cache`` and ``vllm.v1.worker.gpu.attn_utils: allocate_kv_cache`` (the two runners' allocation) | a :class:`VllmKVCache` over the PCP group; vLLM's own one when PCP is 1 |
| ``vllm.models.deepseek_v32.attention`` and ``vllm.model_executor.layers.attention.mla_attention``: ``maybe_gather_mla_latent_cache_inputs`` | no gather: this rank's rows and slots, the PCP case remembered for the insert |
| ``vllm.model_executor.layers.sparse_attn_indexer: maybe_gather_indexer_k`` | the same for the indexer (its own metadata's ``num_decode_tokens``) |
| ``vllm._custom_ops: concat_and_cache_mla``, ``indexer_k_quant_and_cache`` | into a vmmkv layer view after a replaced gather: the cache's store (direct publication + barrier, or vmmkv's gather fallback); any other call: vLLM's op unchanged |
| ``vllm.v1.worker.utils: KVBlockZeroer.zero_block_ids`` | vLLM's zeroing, then the cache barrier (and a check that the blocks are committed) |

Not a patch: ``install`` registers the ``vmmkv`` sleep-mode backend with vLLM's
``SleepModeBackendFactory`` (``_sleep``), and ``check_vllm_config`` refuses sleep mode under any
other sleep-mode backend.

A replaced gather and its insert pair up through a pending record per cache family (MLA,
indexer): the gather stores the PCP case and the tensors it returned; the insert that receives
exactly those tensors consumes it. An insert that does not (any call outside the PCP path) runs
vLLM's op; a replaced gather whose insert targets memory vmmkv did not allocate raises, naming
the tensor (the rows of the other ranks were never gathered, so vLLM's op would write too few).

Local, not thread-safe: install/uninstall from one thread, like vLLM's worker.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...ops.formats import FORMATS, INDEXER_DIM

__all__ = [
    "active_cache",
    "install",
    "installed",
    "original",
    "uninstall",
    "vllm_indexer_kind",
    "vllm_mla_kind",
]

log = logging.getLogger(__name__)

MLA, INDEXER = "mla", "indexer"
MX_INDEXER_KIND = "indexer_k_mxfp8"


@dataclass
class _Pending:
    plan: Any  # StorePlan
    rows: torch.Tensor  # the first input the replaced gather returned


@dataclass
class _Patch:
    owner: Any
    name: str
    original: Any
    replacement: Any


class _State:
    def __init__(self) -> None:
        self.patches: list[_Patch] = []
        self.active: Any = None  # the process's VllmKVCache, once allocated
        self.pending: dict[str, _Pending] = {}


_STATE = _State()


def active_cache() -> Any:
    """The :class:`VllmKVCache` the plugin allocated in this process, or None."""
    return _STATE.active


def installed() -> bool:
    return bool(_STATE.patches)


def original(owner: Any, name: str) -> Any:
    """vLLM's own object behind a patched ``owner.name`` (for tests and debugging)."""
    for p in _STATE.patches:
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
    (``vmmkv.ops.formats.mla_kind_for(vllm.__version__)``: power-of-two tile scales for 0.33)."""
    import vllm

    from ...ops.formats import mla_kind_for

    return mla_kind_for(vllm.__version__)


def check_vllm_config(cfg: Any) -> None:
    """Refuse (UnsupportedKVCache) what the vLLM config asks and vmmkv cannot do: activations
    other than bfloat16 (the stores take bf16), HiSparse KV caches, micro-batching (DBO)."""
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
    from ._sleep import check_config  # sleep mode needs the vmmkv sleep-mode backend

    check_config(cfg)


# -- the replacements ------------------------------------------------------------------------


def _allocate(orig: Callable[..., Any]) -> Callable[..., Any]:
    def allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes=None):
        from vllm.config import get_current_vllm_config_or_none
        from vllm.distributed.parallel_state import get_pcp_group

        from ._cache import VllmKVCache
        from ._layout import UnsupportedKVCache

        pcp = get_pcp_group()
        if pcp.world_size == 1:
            log.info("vmmkv: prefill context parallel size 1: vLLM allocates its KV cache")
            return orig(kv_cache_config, device, layout, kernel_block_sizes)
        cfg = get_current_vllm_config_or_none()
        if cfg is not None:
            check_vllm_config(cfg)
        if _STATE.active is not None:
            raise RuntimeError(
                f"rank {_STATE.active.rank}: vmmkv already allocated this worker's KV cache; "
                "vmmkv.integrations.vllm.unregister() closes it"
            )
        try:
            cache = VllmKVCache(
                kv_cache_config, layout, cpu_group=pcp.cpu_group, device=device,
                device_group=pcp.device_group, kernel_block_sizes=kernel_block_sizes,
                mla_kind=vllm_mla_kind(), indexer_kind=vllm_indexer_kind(),
            )  # fmt: skip
        except UnsupportedKVCache as exc:  # name the model too (every rank refuses alike)
            model = cfg.model_config.model if cfg is not None and cfg.model_config else "?"
            raise UnsupportedKVCache(f"vmmkv cannot hold the KV cache of {model!r}: {exc}") from exc
        _STATE.active = cache
        return dict(cache.views)

    return allocate_kv_cache


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
        return kv_c, kpe, plan.own_slots

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
        return rows, plan.own_slots

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
    own = p.plan.own_slots
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


# (module, attribute path, replacement factory): every use site vLLM 0.33.0 looks these up at
_SITES: tuple[tuple[str, str, Callable[..., Any]], ...] = (
    ("vllm.v1.worker.gpu_model_runner", "allocate_kv_cache", _allocate),
    ("vllm.v1.worker.gpu.attn_utils", "allocate_kv_cache", _allocate),
    ("vllm.models.deepseek_v32.attention", "maybe_gather_mla_latent_cache_inputs", _gather_mla),
    (
        "vllm.model_executor.layers.attention.mla_attention",
        "maybe_gather_mla_latent_cache_inputs",
        _gather_mla,
    ),
    ("vllm.model_executor.layers.sparse_attn_indexer", "maybe_gather_indexer_k", _gather_indexer),
    ("vllm._custom_ops", "concat_and_cache_mla", _insert_mla),
    ("vllm._custom_ops", "indexer_k_quant_and_cache", _insert_indexer),
    ("vllm.v1.worker.utils", "KVBlockZeroer.zero_block_ids", _zero),
)


def install() -> None:
    """Patch every site (idempotent). Imports the vLLM modules that hold them."""
    if _STATE.patches:
        return
    patches = []
    for module, path, factory in _SITES:
        owner: Any = importlib.import_module(module)
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        current = getattr(owner, name)
        patches.append(_Patch(owner, name, current, factory(current)))
    from ._sleep import register_backend  # vLLM's sleep-mode factory: the "vmmkv" backend

    register_backend()
    for p in patches:
        setattr(p.owner, p.name, p.replacement)
    _STATE.patches = patches
    log.info("vmmkv: replaced %d vLLM call sites (VLLM_USE_VMMKV=1)", len(patches))


def uninstall() -> None:
    """Restore every patched site, drop pending records, close the active cache (its views,
    which vLLM may still hold, are invalid afterwards). Idempotent."""
    patches, _STATE.patches = _STATE.patches, []
    for p in reversed(patches):
        if getattr(p.owner, p.name) is p.replacement:
            setattr(p.owner, p.name, p.original)
        else:
            log.warning("vmmkv: %s.%s was patched again by someone else; left as it is",
                        getattr(p.owner, "__name__", p.owner), p.name)  # fmt: skip
    _STATE.pending.clear()
    cache, _STATE.active = _STATE.active, None
    if cache is not None:
        cache.close()
