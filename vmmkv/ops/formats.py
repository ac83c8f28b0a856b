"""The KV byte formats, in one table: entry bytes, the inputs a store takes (dtype, width),
the alignment the kernels need, and how a block is laid out. Every other module (kernel
wrappers, reference, host stores, the cache, tools, tests) reads these facts from here.

The byte layouts themselves are described in docs/design.md ("KV byte formats"); the pure-torch
reference (``vmmkv.ops.reference``) is their executable definition. Local, no device work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "FORMATS",
    "INDEXER_DIM",
    "INDEXER_ENTRY_BYTES",
    "MLA_ENTRY_BYTES",
    "MLA_KV_DIM",
    "MLA_ROPE_DIM",
    "MLA_TILE",
    "KVFormat",
    "STORE_KINDS",
    "get_format",
]

MLA_KV_DIM = 512
MLA_ROPE_DIM = 64
MLA_TILE = 128
MLA_ENTRY_BYTES = MLA_KV_DIM + 4 * (MLA_KV_DIM // MLA_TILE) + 2 * MLA_ROPE_DIM  # 656
INDEXER_DIM = 128
INDEXER_ENTRY_BYTES = INDEXER_DIM + 4  # 132, split inside the block (values, then scales)


@dataclass(frozen=True)
class KVFormat:
    """One cache kind.

    ``entry_bytes``: bytes per token (None: any, the row width of a "rows" cache).
    ``inputs``: (name, dtype, width) of each input tensor ``[T, width]`` a store of this kind
    takes (width None: the entry size). ``align``: the byte alignment the kernels need of the
    view offset, the block stride and (``fp8_ds_mla``) the entry stride. ``split_block``: the
    block holds every token's values first, then every token's scales (indexer_k), so a block
    must be contiguous.
    """

    kind: str
    entry_bytes: int | None
    inputs: tuple[tuple[str, torch.dtype, int | None], ...]
    align: int
    split_block: bool = False


FORMATS: dict[str, KVFormat] = {
    f.kind: f
    for f in (
        KVFormat(
            "fp8_ds_mla",
            MLA_ENTRY_BYTES,
            (("kv_c", torch.bfloat16, MLA_KV_DIM), ("k_pe", torch.bfloat16, MLA_ROPE_DIM)),
            align=16,
        ),
        KVFormat(
            "indexer_k",
            INDEXER_ENTRY_BYTES,
            (("k", torch.bfloat16, INDEXER_DIM),),
            align=4,
            split_block=True,
        ),
        KVFormat("rows", None, (("rows", torch.uint8, None),), align=1),
    )
}

# The combinations of bound caches one store call takes (store_layer: both caches of a layer).
STORE_KINDS = (("fp8_ds_mla",), ("indexer_k",), ("rows",), ("fp8_ds_mla", "indexer_k"))


def get_format(kind: object) -> KVFormat:
    """The format of ``kind``; ValueError naming the known kinds otherwise."""
    fmt = FORMATS.get(kind) if isinstance(kind, str) else None
    if fmt is None:
        raise ValueError(f"kind must be one of {list(FORMATS)}, got {kind!r}")
    return fmt
