"""KV-cache fixtures shared by the demo, the tests, the example and the benchmarks: the
layer-interleaved view layout, random non-zero store inputs, and the oracle.

Layout (what an engine's allocator builds in ONE buffer, so that growing the committed prefix
adds whole blocks to every layer at once): block ``b`` of every layer is contiguous; inside it,
layer ``l`` holds its ``fp8_ds_mla`` block (``block_size`` entries of 656 bytes) and right after
it its ``indexer_k`` block (``block_size`` entries of 132 bytes, split: values then scales).
Consecutive blocks are ``block_stride(layers) + block_pad`` bytes apart.

The oracle is the pure-torch reference (``vmmkv.ops.reference``) writing every batch into a CPU
copy of the replica as it was before the stores; it shares no code with the kernels or the host
stores. Everything here is local and allocates only CPU tensors (the views alias the caller's
buffer). Internal (see ``vmmkv.testing``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .._util import require_int
from ..ops import reference as ref
from ..ops.formats import INDEXER_ENTRY_BYTES, MLA_ENTRY_BYTES, get_format

__all__ = [
    "BLOCK_SIZE",
    "block_stride",
    "expected_replica",
    "interleaved_views",
    "layer_inputs",
    "random_bf16",
]

BLOCK_SIZE = 64  # tokens per block, as in vLLM's fp8_ds_mla cache

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # kv_c, k_pe, k, slots


def block_stride(layers: int, block_size: int = BLOCK_SIZE) -> int:
    """Bytes of one block of every layer (the MLA and the indexer block of each), no padding."""
    require_int("layers", layers, lo=1)
    require_int("block_size", block_size, lo=1)
    return layers * block_size * (MLA_ENTRY_BYTES + INDEXER_ENTRY_BYTES)


def interleaved_views(
    buf: torch.Tensor,
    layers: int,
    num_blocks: int,
    *,
    block_size: int = BLOCK_SIZE,
    offset: int = 0,
    block_pad: int = 0,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the ``(fp8_ds_mla [num_blocks, block_size, 656], indexer_k [num_blocks,
    block_size, 132])`` uint8 views of the layer-interleaved layout that starts ``offset`` bytes
    into ``buf`` (any dtype; viewed as bytes), blocks ``block_stride(layers) + block_pad`` bytes
    apart. The views alias ``buf``."""
    require_int("num_blocks", num_blocks, lo=0)
    require_int("offset", offset, lo=0)
    require_int("block_pad", block_pad, lo=0)
    stride = block_stride(layers, block_size) + block_pad
    u8 = buf.view(torch.uint8).reshape(-1)
    need = offset + num_blocks * stride
    if u8.numel() < need:
        raise ValueError(
            f"buf holds {u8.numel()} bytes; {layers} layers x {num_blocks} blocks of "
            f"{stride} bytes at offset {offset} need {need}"
        )
    mla_block = block_size * MLA_ENTRY_BYTES
    layer_bytes = mla_block + block_size * INDEXER_ENTRY_BYTES
    views = []
    for layer in range(layers):
        at = u8.storage_offset() + offset + layer * layer_bytes
        mla = u8.as_strided(
            (num_blocks, block_size, MLA_ENTRY_BYTES), (stride, MLA_ENTRY_BYTES, 1), at
        )
        idx = u8.as_strided(
            (num_blocks, block_size, INDEXER_ENTRY_BYTES),
            (stride, INDEXER_ENTRY_BYTES, 1),
            at + mla_block,
        )
        views.append((mla, idx))
    return views


def random_bf16(seed: int, rows: int, width: int, *, spread: float = 8.0) -> torch.Tensor:
    """Deterministic random bf16 ``[rows, width]`` on the CPU with no zero element; each row has
    its own magnitude (up to ``spread``), so every row and tile gets its own scale."""
    require_int("rows", rows, lo=0)
    require_int("width", width, lo=1)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * torch.rand(rows, 1, generator=g).mul(spread)
    x[x.abs() < 1e-3] = 0.5  # non-zero, and far from bf16's subnormals
    return x.bfloat16()


def layer_inputs(seed: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(kv_c, k_pe, k)`` of ``tokens`` tokens for one ``store_layer`` call: random non-zero
    bf16 of the widths ``vmmkv.ops.formats`` gives (512, 64, 128), deterministic in ``seed``."""
    widths = [w for kind in ("fp8_ds_mla", "indexer_k") for _, _, w in get_format(kind).inputs]
    kv_c, k_pe, k = (random_bf16(seed + i, tokens, w) for i, w in enumerate(widths))
    return kv_c, k_pe, k


def expected_replica(
    before: torch.Tensor,
    batches: Iterable[Batch],
    *,
    layers: int,
    num_blocks: int,
    block_size: int = BLOCK_SIZE,
    offset: int = 0,
    block_pad: int = 0,
    committed_blocks: int | None = None,
) -> torch.Tensor:
    """The oracle: what a replica must hold after every batch ``(kv_c, k_pe, k, slot_mapping)``
    was stored (in order) into every layer of the layer-interleaved layout inside it.

    ``before`` is the replica's bytes before the stores (poisoned), copied to the CPU; it is not
    modified. Slots at or beyond ``committed_blocks * block_size`` are skipped, as the stores skip
    (and count) tokens of uncommitted blocks; padding (< 0) and out-of-view slots are skipped by
    the reference inserters themselves."""
    want = before.detach().to("cpu", copy=True).view(torch.uint8).reshape(-1)
    views = interleaved_views(
        want, layers, num_blocks, block_size=block_size, offset=offset, block_pad=block_pad
    )
    for kv_c, k_pe, k, slots in batches:
        slots = slots.to("cpu")
        if committed_blocks is not None:
            slots = torch.where(slots >= committed_blocks * block_size, -1, slots)
        for mla, idx in views:
            ref.insert_ds_mla(mla, kv_c.cpu(), k_pe.cpu(), slots)
            ref.insert_indexer_k(idx, k.cpu(), slots)
    return want
