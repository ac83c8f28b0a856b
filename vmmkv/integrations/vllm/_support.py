"""The vLLM release and configuration vmmkv's plugin supports, checked before anything is patched
or allocated:

- :func:`check_vllm_version`: the installed vLLM's version, from its package metadata (no vLLM
  import), against :data:`SUPPORTED_VLLM`; otherwise :class:`UnsupportedVLLM` names vmmkv, the
  supported release and vmmkv's last tag for vLLM 0.33.0;
- :func:`vllm_mla_kind`, :func:`vllm_indexer_kind`: the bytes the installed vLLM writes (the MLA
  kind from ``vmmkv.ops.formats.mla_kind_for(vllm.__version__)``, the indexer kind from vLLM's
  own ``mqa_logits_use_mx_scales()``);
- :func:`check_vllm_config`: what a ``VllmConfig`` asks and vmmkv cannot do, refused by the
  allocation sites (``_allocation``) before any collective, so that every rank refuses alike.

Local; no vLLM import at module level.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import torch

from ...ops.formats import FORMATS
from ._state import UnsupportedVLLM

__all__ = [
    "MX_INDEXER_KIND",
    "SUPPORTED_VLLM",
    "check_vllm_config",
    "check_vllm_version",
    "vllm_indexer_kind",
    "vllm_mla_kind",
]

MX_INDEXER_KIND = "indexer_k_mxfp8"


# The vLLM release whose internals the plugin's sites are written against (PEP 440 specifier; a
# local build such as 0.34.0+cu130 matches).
SUPPORTED_VLLM = "==0.34.0"


# The commit of vmmkv 0.1.0, the last release whose plugin is written for vLLM 0.33.0 (README,
# "Running vLLM with vmmkv"): a clone of the published repository has no tags, only commits.
LAST_033_COMMIT = "77d5183"


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
            'vllm==0.34.0 (README, "Running vLLM with vmmkv"; for vllm 0.33.0, vmmkv 0.1.0 at '
            f"commit {LAST_033_COMMIT}) or unset VLLM_USE_VMMKV"
        )
    return version


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
