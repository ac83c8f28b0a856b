"""What the direct and the gather path share: the view geometry of a bound layer, the checks of
the cache's store arguments, and the slot forms.

- ``target_geometry(view, kind, region_base, capacity)`` validates a layer view
  ``[num_blocks, block_size, entry]`` (or vLLM's single-head ``[num_blocks, 1, block_size,
  entry]``) that lies inside a region and returns the geometry fields of a
  :class:`vmmkv.ops.KVTarget` (the format facts come from ``vmmkv.ops.formats``).
- ``check_inputs`` makes, before any collective, the checks the kernels would make, so a rank
  with bad inputs raises before its peers start waiting for it.
- ``own_slots`` resolves the two slot forms (this rank's mapping, or the engine's gathered one).

Local, no collective, no device work (shapes and metadata only; safe under capture).
Internal: the engine-facing API is :class:`vmmkv.ReplicatedKVCache`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch

from ._util import require_int
from .ops.formats import STORE_KINDS, get_format
from .ops.reference import check_slot_mapping, check_store_input

__all__ = ["check_inputs", "check_kinds", "own_slots", "target_geometry"]

log = logging.getLogger(__name__)


def target_geometry(
    view: torch.Tensor, kind: str, region_base: int, capacity: int, *, name: str = "view"
) -> dict[str, Any]:
    """The ``KVTarget`` geometry (kind, offset_bytes, num_blocks, block_size, block_stride,
    entry_stride, entry_bytes) of ``view`` inside the region ``[region_base, region_base +
    capacity)``. Raises TypeError/ValueError naming ``name``, the value got and what was
    expected; touches no memory."""
    fmt = get_format(kind)
    if not isinstance(view, torch.Tensor):
        raise TypeError(f"bind {name!r}: view must be a torch.Tensor, got {type(view).__name__}")
    if view.dtype not in (torch.uint8, torch.int8):
        raise TypeError(f"bind {name!r}: view must be uint8 or int8, got {view.dtype}")
    if view.dim() == 4:  # vLLM's [B, H, N, C] layer views: one head only
        if view.shape[1] != 1:
            raise ValueError(
                f"bind {name!r}: a 4-D view [num_blocks, heads, block_size, entry] must have one "
                f"head (H == 1, as vLLM's MLA and indexer caches), got H = {view.shape[1]} in "
                f"shape {list(view.shape)}"
            )
        view = view.select(1, 0)  # same bytes; the head stride is irrelevant for one head
    if view.dim() != 3:
        raise ValueError(
            f"bind {name!r}: view must be [num_blocks, block_size, entry] or "
            f"[num_blocks, 1, block_size, entry], got shape {list(view.shape)}"
        )
    num_blocks, block_size, entry = view.shape
    if fmt.entry_bytes is not None and entry != fmt.entry_bytes:
        raise ValueError(
            f"bind {name!r}: a {kind} view has entries of {fmt.entry_bytes} bytes, got {entry}"
        )
    if view.stride(2) != 1:
        raise ValueError(f"bind {name!r}: entries must be contiguous, strides {view.stride()}")
    block_stride, entry_stride = view.stride(0), view.stride(1)
    if fmt.split_block and entry_stride != entry:
        raise ValueError(
            f"bind {name!r}: a {kind} block must be contiguous (stride {entry} between tokens), "
            f"got strides {view.stride()}"
        )
    offset = view.data_ptr() - region_base
    if fmt.split_block:
        extent = block_size * entry
    else:
        extent = (block_size - 1) * entry_stride + entry
    end = offset + (num_blocks - 1) * block_stride + extent if num_blocks else offset
    if offset < 0 or end > capacity:
        raise ValueError(
            f"bind {name!r}: view spans region bytes [{offset}, {end}), outside [0, {capacity}): "
            "views must come from this cache's allocate()"
        )
    return dict(
        kind=kind,
        offset_bytes=offset,
        num_blocks=num_blocks,
        block_size=block_size,
        block_stride=block_stride,
        entry_stride=entry_stride,
        entry_bytes=entry,
    )


def check_kinds(bindings: Sequence[Any], binding_type: type) -> tuple[str, ...]:
    """The kinds of ``bindings`` if they form one of ``STORE_KINDS``."""
    for b in bindings:
        if not isinstance(b, binding_type):
            raise TypeError(f"expected a Binding from bind(), got {type(b).__name__}")
    kinds = tuple(b.kind for b in bindings)
    if kinds not in STORE_KINDS:
        raise ValueError(f"this store takes bindings of kinds {STORE_KINDS}, got {kinds}")
    return kinds


def own_slots(
    slot_mapping: Any, gathered: Any, rank: int, world: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(this rank's slots, the gathered slot mapping or None). With only ``gathered`` given
    (``[world * T]``, rank-major), this rank's slots are its slice: a view, no copy, no sync."""
    if gathered is None:
        if slot_mapping is None:
            raise TypeError("slot_mapping is None and no gathered_slot_mapping was given")
        return slot_mapping, None
    if not isinstance(gathered, torch.Tensor) or gathered.dim() != 1:
        raise TypeError(f"gathered_slot_mapping must be a 1-D tensor, got {gathered!r:.60}")
    n = gathered.numel()
    if n > 1 and gathered.stride(0) != 1:
        raise ValueError(
            f"gathered_slot_mapping must be contiguous, got stride {gathered.stride()}"
        )
    if n % world:
        raise ValueError(
            f"gathered_slot_mapping has {n} entries, not a multiple of the group size {world} "
            "(rank-major, the same padded count per rank)"
        )
    per_rank = n // world
    if slot_mapping is None:
        return gathered[rank * per_rank : (rank + 1) * per_rank], gathered
    if isinstance(slot_mapping, torch.Tensor) and slot_mapping.numel() != per_rank:
        raise ValueError(
            f"slot_mapping has {slot_mapping.numel()} entries but gathered_slot_mapping holds "
            f"{per_rank} per rank ({n} for {world} ranks)"
        )
    return slot_mapping, gathered


@functools.cache
def _input_specs(kinds: tuple[str, ...], rows_entry: int) -> tuple[tuple[str, Any, int], ...]:
    """(name, dtype, width) of each input of a store of ``kinds`` (the formats' facts, looked
    up once per kinds and entry width: the check runs on every store call)."""
    return tuple(
        (name, dtype, rows_entry if width is None else width)
        for kind in kinds
        for name, dtype, width in get_format(kind).inputs
    )


def check_inputs(
    kinds: tuple[str, ...],
    rows_entry: int,
    inputs: Sequence[Any],
    slot_mapping: Any,
    nlo: Any,
    device: torch.device,
) -> int:
    """The checks the kernels make (types, dtypes, widths, devices, token counts), through the
    one store-input check of ``vmmkv.ops.reference``; returns the token count
    ``slot_mapping.numel()``."""
    slots = check_slot_mapping(slot_mapping)
    tokens = slots.numel()
    if tokens > 1 and slots.stride(0) != 1:
        raise ValueError(f"slot_mapping must be contiguous, got stride {slots.stride()}")
    if slots.device != device:
        raise ValueError(f"slot_mapping is on {slots.device}, expected {device}")
    require_int("num_local_only", nlo, lo=0, hi=tokens)
    specs = _input_specs(kinds, rows_entry)
    if not isinstance(inputs, (tuple, list)) or len(inputs) != len(specs):
        raise TypeError(f"expected {len(specs)} input tensors {[s[0] for s in specs]}")
    for t, (name, dtype, width) in zip(inputs, specs, strict=True):
        check_store_input(name, t, dtype, width, tokens=tokens, contiguous_rows=True, device=device)
    return tokens
