"""Host-backend stores: the kernels' semantics on CPU targets, through the pure-torch reference.

Same signatures as ``vmmkv.ops.kv``; a :class:`KVTarget` whose tensors live on the CPU (its
``ptr_table`` holds host addresses of every replica's region, peers mapped through shared
memfds). For each token: ``slot < 0`` skipped; a block beyond the view or beyond
``committed_bytes`` counted in ``error_counter`` once and skipped; tokens below
``num_local_only`` go to the own replica only. Each token's bytes are computed once and written
to every destination. The stores take either kind of their cache (``fp8_ds_mla``,
``fp8_ds_mla_ue8m0``; ``indexer_k``, ``indexer_k_mxfp8``): the target's kind picks the scale
rule and encoding. Local, synchronous, never collective.
"""

from __future__ import annotations

import torch

from .._util import require_int
from ..alloc.dlpack import tensor_at
from . import reference as ref
from .formats import INDEXER_ENTRY_BYTES, INDEXER_KINDS, MLA_KINDS, get_format
from .kv import KVTarget, _check_ue8m0

__all__ = ["publish_rows", "store_ds_mla", "store_indexer_k", "store_layer"]


def _check(target: KVTarget, kinds: tuple[str, ...]) -> None:
    if not isinstance(target, KVTarget):
        raise TypeError(f"target must be a KVTarget, got {type(target).__name__}")
    if target.kind not in kinds:
        raise ValueError(f"target is a {target.kind} view, this store writes {' or '.join(kinds)}")
    if target.device.type != "cpu":
        raise ValueError(f"host stores take CPU targets, got {target.device}")


def _validate(target: KVTarget, kinds, slot_mapping, nlo, *inputs, ue8m0=True) -> torch.Tensor:
    """Every argument checked before anything is counted or written: the target's kind (one
    of ``kinds``) and device, the slots, ``num_local_only``, ``ue8m0`` and the inputs as
    ``vmmkv.ops.formats`` lists them. Returns the slots as a fresh int64 tensor."""
    _check(target, kinds)
    slots = ref.check_slot_mapping(slot_mapping).long().clone()
    n = slots.numel()
    require_int("num_local_only", nlo, 0, n)
    _check_ue8m0(ue8m0, (target.kind,))
    for t, (name, dtype, width) in zip(inputs, get_format(target.kind).inputs, strict=True):
        width = target.entry_bytes if width is None else width
        ref.check_store_input(name, t, dtype, width, tokens=n)
    return slots


def _skip_invalid(target: KVTarget, slots: torch.Tensor) -> torch.Tensor:
    """``slots`` with out-of-range / uncommitted ones set to -1 and counted in the target."""
    blocks = torch.div(slots, target.block_size, rounding_mode="floor")
    end = target.offset_bytes + blocks * target.block_stride + target.block_extent
    committed = int(target.committed_bytes.item())
    bad = (slots >= 0) & ((blocks >= target.num_blocks) | (end > committed))
    target.error_counter.add_(int(bad.sum()))
    slots[bad] = -1
    return slots


def _checked(target: KVTarget, kinds, slot_mapping, nlo, *inputs, ue8m0=True) -> torch.Tensor:
    return _skip_invalid(target, _validate(target, kinds, slot_mapping, nlo, *inputs, ue8m0=ue8m0))


def _view(target: KVTarget, base: int) -> torch.Tensor:
    """The layer view ``[num_blocks, block_size, entry]`` inside the region at ``base``."""
    nb, bs = target.num_blocks, target.block_size
    span = (nb - 1) * target.block_stride + target.block_extent if nb else 1
    flat = tensor_at(base + target.offset_bytes, span, torch.uint8, torch.device("cpu"))
    if get_format(target.kind).split_block:
        return flat.as_strided((nb, bs * INDEXER_ENTRY_BYTES), (target.block_stride, 1))
    return flat.as_strided(
        (nb, bs, target.entry_bytes), (target.block_stride, target.entry_stride, 1)
    )


def _each_destination(target: KVTarget, slots: torch.Tensor, nlo: int):
    """(view, token slice) for every replica: the own one takes all tokens, peers skip the
    ``nlo`` replicated leading ones."""
    for d, base in enumerate(target.ptr_table.tolist()):
        yield _view(target, base), slice(0 if d == target.my_rank else nlo, slots.numel())


def publish_rows(target, rows, slot_mapping, *, num_local_only=0) -> None:
    slots = _checked(target, ("rows",), slot_mapping, num_local_only, rows)
    n = slots.numel()
    for view, sel in _each_destination(target, slots, num_local_only):
        ref.insert_rows(view, rows[:n][sel], slots[sel])


def store_ds_mla(target, kv_c, k_pe, slot_mapping, *, num_local_only=0) -> None:
    slots = _checked(target, MLA_KINDS, slot_mapping, num_local_only, kv_c, k_pe)
    n = slots.numel()
    rows = ref.quantize_ds_mla(kv_c[:n], k_pe[:n], kind=target.kind)
    for view, sel in _each_destination(target, slots, num_local_only):
        ref.insert_rows(view, rows[sel], slots[sel])


def store_indexer_k(target, k, slot_mapping, *, num_local_only=0, ue8m0=True) -> None:
    slots = _checked(target, INDEXER_KINDS, slot_mapping, num_local_only, k, ue8m0=ue8m0)
    n = slots.numel()
    for view, sel in _each_destination(target, slots, num_local_only):
        ref.insert_indexer_k(view, k[:n][sel], slots[sel], ue8m0, kind=target.kind)


def store_layer(mla, idx, kv_c, k_pe, k, slot_mapping, *, num_local_only=0, ue8m0=True) -> None:
    # nothing written if k (or ue8m0) is bad
    _validate(idx, INDEXER_KINDS, slot_mapping, num_local_only, k, ue8m0=ue8m0)
    store_ds_mla(mla, kv_c, k_pe, slot_mapping, num_local_only=num_local_only)
    store_indexer_k(idx, k, slot_mapping, num_local_only=num_local_only, ue8m0=ue8m0)
