"""What the direct and the gather path share: the view geometry of a bound layer, the one input
validator of the cache's stores, and a store over a fixed tuple of targets.

- ``target_geometry(view, kind, region_base, capacity)`` validates a layer view
  ``[num_blocks, block_size, entry]`` that lies inside a region and returns the geometry fields of
  a :class:`vmmkv.ops.KVTarget` (the format facts come from ``vmmkv.ops.formats``).
- ``check_inputs`` makes, before any collective, the checks the kernels would make, so a rank
  with bad inputs raises before its peers start waiting for it.
- ``TargetStore`` runs the stores of one combination of bound caches (one cache, or the two of a
  layer) into a tuple of targets: the fused kernels on CUDA (through ``vmmkv.ops.prepare`` when
  the ops layer offers it: per-binding launch state built once), the pure-torch reference of
  ``vmmkv.ops.host`` on the host backend. ``publish`` adds the device barrier in the same launch
  where the ops layer supports it.

Local, no collective. Capture-safe where the underlying store is (CUDA, after warm-up).
Internal: the engine-facing API is :class:`vmmkv.ReplicatedKVCache`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from . import ops
from .ops import host as host_ops
from .ops.formats import STORE_KINDS, get_format
from .ops.kv import KVTarget

__all__ = ["TargetStore", "check_inputs", "check_kinds", "own_slots", "target_geometry"]

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
    if view.dim() != 3:
        raise ValueError(
            f"bind {name!r}: view must be [num_blocks, block_size, entry], got shape "
            f"{list(view.shape)}"
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


def input_specs(kinds: tuple[str, ...], rows_entry: int) -> list[tuple[str, torch.dtype, int]]:
    """(name, dtype, width) of every input tensor a store of ``kinds`` takes."""
    return [
        (name, dtype, rows_entry if width is None else width)
        for kind in kinds
        for name, dtype, width in get_format(kind).inputs
    ]


def check_inputs(
    kinds: tuple[str, ...],
    rows_entry: int,
    inputs: Sequence[Any],
    slot_mapping: Any,
    nlo: Any,
    device: torch.device,
) -> int:
    """The checks the kernels make (types, dtypes, widths, devices, token counts); returns the
    token count ``slot_mapping.numel()``."""
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1:
        raise TypeError(f"slot_mapping must be a 1-D tensor, got {slot_mapping!r:.60}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    tokens = slot_mapping.numel()
    if tokens > 1 and slot_mapping.stride(0) != 1:
        raise ValueError(f"slot_mapping must be contiguous, got stride {slot_mapping.stride()}")
    if isinstance(nlo, bool) or not isinstance(nlo, int) or not 0 <= nlo <= tokens:
        raise ValueError(f"num_local_only must be an int in [0, {tokens}], got {nlo!r}")
    specs = input_specs(kinds, rows_entry)
    if len(inputs) != len(specs):
        raise ValueError(f"expected {len(specs)} input tensors, got {len(inputs)}")
    for t, (name, dtype, width) in zip(inputs, specs, strict=True):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dtype != dtype:
            raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
        if t.dim() != 2 or t.shape[1] != width or t.shape[0] < tokens:
            raise ValueError(f"{name} must be [>= {tokens}, {width}], got {list(t.shape)}")
        if t.stride(1) != 1:
            raise ValueError(f"{name} rows must be contiguous, got strides {t.stride()}")
    for t in (*inputs, slot_mapping):
        if t.device != device:
            raise ValueError(f"inputs must be on {device}, got one on {t.device}")
    return tokens


class TargetStore:
    """The stores of one combination of bound caches into a fixed tuple of targets."""

    def __init__(self, kinds: tuple[str, ...], targets: tuple[KVTarget, ...]) -> None:
        self.kinds = kinds
        self.targets = targets
        self.entry_bytes = sum(t.entry_bytes for t in targets)
        cuda = targets[0].device.type == "cuda"
        self._impl = ops if cuda else host_ops
        prepare = getattr(ops, "prepare", None) if cuda else None
        # The ops layer's prepared store (launch state built once) where it exists.
        self._prepared = prepare(targets) if prepare is not None else None

    def store(self, inputs: Sequence[torch.Tensor], slots: torch.Tensor, nlo: int) -> None:
        """Store ``inputs`` (validated by the kernels' wrappers) at ``slots``."""
        if self._prepared is not None:
            self._prepared.store(tuple(inputs), slots, nlo)
            return
        impl, t = self._impl, self.targets
        if self.kinds == ("fp8_ds_mla",):
            impl.store_ds_mla(t[0], *inputs, slots, num_local_only=nlo)
        elif self.kinds == ("indexer_k",):
            impl.store_indexer_k(t[0], *inputs, slots, num_local_only=nlo)
        elif self.kinds == ("rows",):
            impl.publish_rows(t[0], *inputs, slots, num_local_only=nlo)
        else:
            impl.store_layer(t[0], t[1], *inputs, slots, num_local_only=nlo)

    def publish(
        self, inputs: Sequence[torch.Tensor], slots: torch.Tensor, nlo: int, barrier: Any, lane: int
    ) -> None:
        """Store, then ``barrier.arrive_and_wait(lane)``: in one launch when the ops layer has
        a fused publish for a device barrier, else two."""
        fused = getattr(self._prepared, "publish", None)
        if fused is not None and isinstance(barrier, ops.DeviceBarrier):
            fused(tuple(inputs), slots, nlo, barrier, lane)
            return
        self.store(inputs, slots, nlo)
        barrier.arrive_and_wait(lane)
