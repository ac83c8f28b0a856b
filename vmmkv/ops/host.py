"""Host-backend stores: the kernels' semantics on CPU targets, through the pure-torch reference.

Same signatures as ``vmmkv.ops.kv``; a :class:`KVTarget` whose tensors live on the CPU (its
``ptr_table`` holds host addresses of every replica's region, peers mapped through shared
memfds). For each token: ``slot < 0`` skipped; a block beyond the view or beyond
``committed_bytes`` counted in ``error_counter`` once and skipped; tokens below
``num_local_only`` go to the own replica only. Each token's bytes are computed once and written
to every destination. Local, synchronous, never collective.
"""

from __future__ import annotations

import torch

from ..alloc.dlpack import tensor_at
from . import reference as ref
from .kv import KVTarget

__all__ = ["publish_rows", "store_ds_mla", "store_indexer_k", "store_layer"]


def _check(target: KVTarget, kind: str) -> None:
    if not isinstance(target, KVTarget):
        raise TypeError(f"target must be a KVTarget, got {type(target).__name__}")
    if target.kind != kind:
        raise ValueError(f"target is a {target.kind} view, this store writes {kind}")
    if target.device.type != "cpu":
        raise ValueError(f"host stores take CPU targets, got {target.device}")


def _valid_slots(target: KVTarget, slot_mapping: torch.Tensor, nlo: int) -> torch.Tensor:
    """int64 slots with out-of-range / uncommitted ones set to -1 and counted."""
    slots = ref._slots(slot_mapping).clone()
    if isinstance(nlo, bool) or not isinstance(nlo, int) or not 0 <= nlo <= slots.numel():
        raise ValueError(f"num_local_only must be an int in [0, {slots.numel()}], got {nlo!r}")
    blocks = torch.div(slots, target.block_size, rounding_mode="floor")
    end = target.offset_bytes + blocks * target.block_stride + target.block_extent
    committed = int(target.committed_bytes.item())
    bad = (slots >= 0) & ((blocks >= target.num_blocks) | (end > committed))
    target.error_counter.add_(int(bad.sum()))
    slots[bad] = -1
    return slots


def _view(target: KVTarget, base: int) -> torch.Tensor:
    """The layer view ``[num_blocks, block_size, entry]`` inside the region at ``base``."""
    nb, bs = target.num_blocks, target.block_size
    span = (nb - 1) * target.block_stride + target.block_extent if nb else 1
    flat = tensor_at(base + target.offset_bytes, span, torch.uint8, torch.device("cpu"))
    if target.kind == "indexer_k":
        return flat.as_strided((nb, bs * ref.INDEXER_ENTRY_BYTES), (target.block_stride, 1))
    return flat.as_strided(
        (nb, bs, target.entry_bytes), (target.block_stride, target.entry_stride, 1)
    )


def _each_destination(target: KVTarget, slots: torch.Tensor, nlo: int):
    """(view, token slice) for every replica: the own one takes all tokens, peers skip the
    ``nlo`` replicated leading ones."""
    for d, base in enumerate(target.ptr_table.tolist()):
        yield _view(target, base), slice(0 if d == target.my_rank else nlo, slots.numel())


def publish_rows(target, rows, slot_mapping, *, num_local_only=0) -> None:
    _check(target, "rows")
    slots = _valid_slots(target, slot_mapping, num_local_only)
    n = slots.numel()
    for view, sel in _each_destination(target, slots, num_local_only):
        ref.insert_rows(view, rows[:n][sel], slots[sel])


def store_ds_mla(target, kv_c, k_pe, slot_mapping, *, num_local_only=0) -> None:
    _check(target, "fp8_ds_mla")
    slots = _valid_slots(target, slot_mapping, num_local_only)
    n = slots.numel()
    ref._check_tokens("kv_c", kv_c, n)
    ref._check_tokens("k_pe", k_pe, n)
    rows = ref.quantize_ds_mla(kv_c[:n], k_pe[:n])
    for view, sel in _each_destination(target, slots, num_local_only):
        ref.insert_rows(view, rows[sel], slots[sel])


def store_indexer_k(target, k, slot_mapping, *, num_local_only=0, ue8m0=True) -> None:
    _check(target, "indexer_k")
    slots = _valid_slots(target, slot_mapping, num_local_only)
    n = slots.numel()
    ref._check_tokens("k", k, n)
    for view, sel in _each_destination(target, slots, num_local_only):
        ref.insert_indexer_k(view, k[:n][sel], slots[sel], ue8m0)


def store_layer(mla, idx, kv_c, k_pe, k, slot_mapping, *, num_local_only=0, ue8m0=True) -> None:
    store_ds_mla(mla, kv_c, k_pe, slot_mapping, num_local_only=num_local_only)
    store_indexer_k(idx, k, slot_mapping, num_local_only=num_local_only, ue8m0=ue8m0)
