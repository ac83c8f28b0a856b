"""How vLLM 0.34.0 places a KV cache, read from its own ``KVCacheConfig``, and what vmmkv makes
of it: the store kind of every layer, the layer views (built by vLLM's own
``create_kv_cache_views``) and the segments of growth by blocks.

- :func:`plan_kv_cache` validates a config and returns a :class:`KVCachePlan`, or raises
  :class:`UnsupportedKVCache` naming the layer and its spec (or the layout) it cannot serve.
- :func:`create_views` builds the per-layer views over a flat int8 buffer exactly as vLLM's
  ``allocate_kv_cache`` does after its ``torch.zeros`` (same vLLM calls, same arguments).

Supported: the two caches of a DeepSeek-V3.2-style sparse MLA layer, in one of the four
block-compact layouts vLLM accepts for them (``SUPPORTED_LAYOUTS``):

- MLA ``MLAAttentionSpec`` with ``cache_dtype_str == "fp8_ds_mla"`` (656-byte entries), one head
  (bound as ``mla_kind``: the MLA format whose scale rule the vLLM release writes);
- indexer K ``MLAAttentionSpec`` with ``cache_role == SparseCacheRole.INDEXER`` (132-byte
  entries, values then scales inside each block), one head, no quantization mode.

Segments (``(offset_bytes, block_bytes)`` in offsets of the backing allocation) come from vLLM's
``KVCacheTensor`` numbers (``offset``, ``layer_stride``, ``block_stride``): a layer-major layout
(LBHNC, LBNHC) has one segment per layer, ``(offset + l * layer_stride, block_stride)``; a
block-major layout (BLHNC, BLNHC) has one segment whose block is the packed block of every layer,
``(lowest offset, block_stride)``. "Blocks ``[0, n)`` of every layer" is then exactly the first
``n`` blocks of every segment.

Local and pure: no collective, no device work (views are metadata over the caller's buffer).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.kv_cache_interface import (
    KVQuantMode,
    MLAAttentionSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from ...ops.formats import INDEXER_ENTRY_BYTES, MLA_ENTRY_BYTES, get_format

__all__ = [
    "SUPPORTED_LAYOUTS",
    "KVCachePlan",
    "LayerPlacement",
    "UnsupportedKVCache",
    "create_views",
    "layer_spec",
    "plan_kv_cache",
]

log = logging.getLogger(__name__)

SUPPORTED_LAYOUTS = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")
_WHAT = (
    "vmmkv serves DeepSeek-V3.2-style sparse MLA caches only: MLAAttentionSpec layers with "
    f"cache_dtype 'fp8_ds_mla' ({MLA_ENTRY_BYTES}-byte entries) and their indexer K caches "
    f"(cache_role INDEXER, {INDEXER_ENTRY_BYTES}-byte entries), one head, uint8"
)


class UnsupportedKVCache(ValueError):
    """A KV cache configuration (a layer's spec, the layout, the placement) vmmkv cannot serve;
    the message names the layer and its spec, or the layout, and what is supported."""


@dataclass(frozen=True)
class LayerPlacement:
    """Where vLLM put one layer: byte ``offset`` of its block 0 in the backing allocation,
    ``block_stride`` between its blocks, ``page_bytes`` of one block, and its store ``kind``."""

    name: str
    kind: str
    tensor: int
    index: int
    offset: int
    block_stride: int
    page_bytes: int


@dataclass(frozen=True)
class KVCachePlan:
    """A validated vLLM KV cache: backing ``size`` (bytes), ``num_blocks``, the ``layout``, the
    placement of every layer (in vLLM's tensor order) and the ``segments`` of block growth."""

    size: int
    num_blocks: int
    layout: KVCacheLayout
    layers: dict[str, LayerPlacement]
    segments: tuple[tuple[int, int], ...]

    @property
    def layer_major(self) -> bool:
        return self.layout.is_layer_compact


def _as_layout(layout: Any) -> KVCacheLayout:
    if isinstance(layout, KVCacheLayout):
        return layout
    if isinstance(layout, str) and layout in KVCacheLayout.__members__:
        return KVCacheLayout[layout]
    raise UnsupportedKVCache(
        f"layout must be a vllm KVCacheLayout or one of {list(KVCacheLayout.__members__)}, "
        f"got {layout!r}"
    )


def _describe(spec: Any) -> str:
    """The fields of a spec that decide its bytes, for error messages."""
    if not isinstance(spec, MLAAttentionSpec):
        return type(spec).__name__
    role = getattr(spec.cache_role, "value", spec.cache_role)
    return (
        f"{type(spec).__name__}(cache_dtype_str={spec.cache_dtype_str!r}, cache_role={role!r}, "
        f"dtype={spec.dtype}, kv_quant_mode={spec.kv_quant_mode.name}, heads={spec.num_heads}, "
        f"tokens_per_state={spec.tokens_per_state}, entry_bytes={spec.state_content_size_bytes}, "
        f"block_size={spec.block_size})"
    )


def layer_spec(config: Any, name: str) -> tuple[int, Any]:
    """(group id, spec) of layer ``name`` in ``config`` (as vLLM's allocation looks it up)."""
    for gid, group in enumerate(config.kv_cache_groups):
        if name in group.layer_names:
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[name]
            return gid, spec
    raise UnsupportedKVCache(f"layer {name!r} of a KVCacheTensor belongs to no KV cache group")


def _kind(name: str, spec: Any, mla_kind: str, indexer_kind: str) -> str:
    """The vmmkv store kind of one layer, or UnsupportedKVCache naming it."""
    base_ok = (
        type(spec) is MLAAttentionSpec
        and spec.num_heads == 1
        and spec.tokens_per_state == 1
        and spec.dtype == torch.uint8
        and spec.has_layer_views
    )
    if base_ok and spec.cache_role == SparseCacheRole.INDEXER:
        if (
            spec.kv_quant_mode == KVQuantMode.NONE
            and spec.state_content_size_bytes == INDEXER_ENTRY_BYTES
        ):
            return indexer_kind
    elif base_ok and spec.cache_dtype_str == "fp8_ds_mla":
        if spec.state_content_size_bytes == MLA_ENTRY_BYTES:
            return mla_kind
    raise UnsupportedKVCache(f"layer {name!r} has {_describe(spec)}; {_WHAT}")


def plan_kv_cache(
    config: Any,
    layout: Any,
    kernel_block_sizes: Sequence[int] | None = None,
    *,
    mla_kind: str = "fp8_ds_mla",
    indexer_kind: str = "indexer_k",
) -> KVCachePlan:
    """Validate vLLM's ``KVCacheConfig`` for ``layout`` and return its :class:`KVCachePlan`.
    Raises :class:`UnsupportedKVCache` naming the layer and spec, the layout, or the placement
    it cannot serve. ``mla_kind`` / ``indexer_kind``: the vmmkv kinds of the MLA and indexer K
    layers (formats of ``vmmkv.ops.formats`` with their entry sizes)."""
    layout = _as_layout(layout)
    for what, kind, entry, split in (
        ("mla_kind", mla_kind, MLA_ENTRY_BYTES, False),
        ("indexer_kind", indexer_kind, INDEXER_ENTRY_BYTES, True),
    ):
        fmt = get_format(kind)
        if fmt.split_block != split or fmt.entry_bytes != entry:
            raise UnsupportedKVCache(f"{what} {kind!r} is not a format of {entry}-byte entries")
    if layout.name not in SUPPORTED_LAYOUTS:
        raise UnsupportedKVCache(
            f"KV cache layout {layout.name} is not supported by vmmkv (supported: "
            f"{', '.join(SUPPORTED_LAYOUTS)}: the block-compact layouts)"
        )
    tensors = list(config.kv_cache_tensors)
    if not tensors:
        raise UnsupportedKVCache("the KVCacheConfig has no KV cache tensors")
    sizes = {t.size for t in tensors}
    if len(sizes) != 1:
        raise UnsupportedKVCache(f"KV cache tensors of different backing sizes {sorted(sizes)}")
    size, num_blocks = sizes.pop(), config.num_blocks
    layers: dict[str, LayerPlacement] = {}
    for ti, t in enumerate(tensors):
        if t.host_resident:
            raise UnsupportedKVCache(
                f"KV cache tensor of layers {t.layers[:2]}... is host-resident (HiSparse): "
                "not supported by vmmkv"
            )
        for li, name in enumerate(t.layers):
            gid, spec = layer_spec(config, name)
            kind = _kind(name, spec, mla_kind, indexer_kind)
            kbs = None
            if kernel_block_sizes is not None and gid < len(kernel_block_sizes):
                kbs = kernel_block_sizes[gid]
            if kbs is not None and kbs != spec.block_size:
                raise UnsupportedKVCache(
                    f"layer {name!r}: kernel block size {kbs} != block size {spec.block_size} "
                    "(kernel block splitting is not supported by vmmkv)"
                )
            layers[name] = LayerPlacement(
                name, kind, ti, li, t.offset + li * t.layer_stride, t.block_stride,
                spec.page_size_bytes,
            )  # fmt: skip
    segments = _segments(layout, list(layers.values()), num_blocks, size)
    return KVCachePlan(size, num_blocks, layout, layers, segments)


def _segments(
    layout: KVCacheLayout, layers: list[LayerPlacement], num_blocks: int, size: int
) -> tuple[tuple[int, int], ...]:
    if layout.is_layer_compact:  # LB*: each layer's blocks are one run of its own
        segs = sorted({(p.offset, p.block_stride) for p in layers})
    else:  # BL*: block b of every layer is one packed run of block_stride bytes
        strides = {p.block_stride for p in layers}
        start = min(p.offset for p in layers)
        stride = strides.pop() if len(strides) == 1 else 0
        if not stride or any(p.offset + p.page_bytes > start + stride for p in layers):
            raise UnsupportedKVCache(
                f"layout {layout.name}: the layers' pages do not form one packed block "
                f"(block strides {sorted({p.block_stride for p in layers})}, pages at offsets "
                f"{sorted({p.offset for p in layers})[:4]}...)"
            )
        segs = [(start, stride)]
    for (off, bb), nxt in zip(segs, [*segs[1:], (size, 0)], strict=True):
        end = off + num_blocks * bb
        if end > nxt[0]:
            raise UnsupportedKVCache(
                f"layout {layout.name}: segment ({off}, {bb}) of {num_blocks} blocks ends at "
                f"byte {end}, past {nxt[0]} (the next segment or the backing size {size})"
            )
    return tuple(segs)


def create_views(
    config: Any,
    layout: Any,
    raw: torch.Tensor,
    kernel_block_sizes: Sequence[int] | None = None,
) -> dict[str, torch.Tensor]:
    """Layer name -> the 4-D ``[B, H, N, C]`` view vLLM's ``allocate_kv_cache`` would return,
    built over ``raw`` (a flat int8 tensor of at least the backing size) by vLLM's own
    ``create_kv_cache_views``. Touches no memory."""
    layout = _as_layout(layout)
    views: dict[str, torch.Tensor] = {}
    for t in config.kv_cache_tensors:
        gid, spec = layer_spec(config, t.layers[0])
        kbs = None
        if kernel_block_sizes is not None and gid < len(kernel_block_sizes):
            kbs = kernel_block_sizes[gid]
        made = create_kv_cache_views(
            raw, spec, config.num_blocks_of(t), layout, t, kernel_block_size=kbs
        )
        views.update(zip(t.layers, made, strict=True))
    return views
