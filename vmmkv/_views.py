"""The views of :class:`vmmkv.ReplicatedKVCache`: what ``allocate`` hands out and what ``bind``
turns into a :class:`Binding`.

``RegionViews`` owns the allocation cursor (the next free byte of the region), the count of
bound views (a block layout is set before the first) and the lock that orders them with
``set_block_layout``. It holds the whole own region (``fence``: the view every target writes
through and the barrier fences) until ``close`` drops it; it closes nothing else (the cache
closes the region and the paths).

- Local: ``allocate``, ``bind`` (geometry and block checks, then each path's per-binding launch
  state, built once: bind before a graph capture). ``set_block_layout`` is collective: it is the
  region's (``SymmetricRegion.set_block_layout``), refused here once a view is bound.
- Not capture-safe (``bind`` builds launch state); no device work otherwise.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._store import target_geometry
from ._util import round_up
from .ops.formats import get_format
from .ops.kv import KVTarget

__all__ = ["ALLOC_ALIGN", "Binding", "RegionViews"]

ALLOC_ALIGN = 256


@dataclass(frozen=True, eq=False)
class Binding:
    """A bound layer view: what the store methods take. ``local`` targets the own replica (the
    gather path), ``direct`` every replica (None in gather mode)."""

    name: str
    kind: str
    view: torch.Tensor
    local: KVTarget
    direct: KVTarget | None


class RegionViews:
    """Allocation and binding of views of one cache's region (see the module docstring).
    ``paths``: the gather path, then the direct path if the cache has one."""

    def __init__(
        self, region: Any, fence: torch.Tensor, error_counter: torch.Tensor, paths: Sequence[Any]
    ) -> None:
        self._sr = region
        self.fence: torch.Tensor | None = fence
        self._error_counter = error_counter
        self._paths = tuple(paths)
        self._lock = threading.Lock()
        self._next_offset = 0
        self._bound = 0  # bind() calls so far: a block layout is set before the first

    def allocate(self, nbytes: int, device: Any, reserve: bool) -> torch.Tensor:
        """The next ``nbytes`` of the region, ``ALLOC_ALIGN``-aligned, as a 1-D int8 view
        (``ReplicatedKVCache.allocate`` says which bytes it may cover)."""
        sr = self._sr
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"allocate: nbytes must be an int > 0, got {nbytes!r}")
        if not isinstance(reserve, bool):
            raise TypeError(f"allocate: reserve must be True or False, got {reserve!r}")
        if device is not None and torch.device(device) != sr.device:
            dev = torch.device(device)
            if not (dev.type == sr.device.type and dev.index is None):
                raise ValueError(f"allocate: device {dev} is not the cache's device {sr.device}")
        with self._lock:
            start = round_up(self._next_offset, ALLOC_ALIGN)
            if start + nbytes > sr.capacity_bytes:
                raise ValueError(
                    f"allocate: {nbytes} bytes at offset {start} exceed the capacity "
                    f"{sr.capacity_bytes} ({sr.capacity_bytes - start} left)"
                )
            if not reserve and not sr.is_committed(start, start + nbytes):
                raise ValueError(
                    f"rank {sr.rank} ({sr.device}): allocate({nbytes}): region bytes "
                    f"[{start}, {start + nbytes}) are not all committed; "
                    f"{sr.describe_committed()}. Commit them first "
                    f"({sr.how_to_commit()}), or call allocate({nbytes}, reserve=True) for "
                    "a view over address space whose committed parts alone may be touched"
                )
            self._next_offset = start + nbytes
        return self.fence[start : start + nbytes].view(torch.int8)

    def bind(self, name: str, view: torch.Tensor, kind: str) -> Binding:
        """The :class:`Binding` of a layer view (``ReplicatedKVCache.bind`` says which)."""
        sr = self._sr
        geometry = target_geometry(view, kind, self.fence.data_ptr(), sr.capacity_bytes, name=name)
        if view.device != sr.device:
            raise ValueError(f"bind {name!r}: view is on {view.device}, cache on {sr.device}")
        start = geometry["offset_bytes"]
        end = start + sum((n - 1) * st for n, st in zip(view.shape, view.stride(), strict=True))
        end = end + 1 if view.numel() else start  # the last byte the view holds, + 1
        with self._lock:
            bound = sr.bound_for(start, end, f"bind {name!r}")
            self._check_blocks_align(name, geometry, bound)
            self._bound += 1
        tensors = dict(committed_bytes=bound, error_counter=self._error_counter, cache=self.fence)
        gather, *direct = self._paths
        local = gather.target(geometry, **tensors)
        remote = direct[0].target(geometry, **tensors) if direct else None
        cache = view.view(torch.uint8) if view.dtype == torch.int8 else view
        binding = Binding(name, kind, cache, local, remote)
        for path in self._paths:
            path.prepare((binding,))  # per-binding launch state, built once (before capture)
        return binding

    def set_block_layout(self, segments: Any, max_blocks: int) -> None:
        """The region's ``set_block_layout`` (collective), refused on every rank once a view
        of this rank is bound (the region turns ``refuse`` into the same error everywhere)."""
        with self._lock:
            refuse = ""
            if self._bound:
                refuse = f"views are bound already ({self._bound}); set the layout before bind"
            self._sr.set_block_layout(segments, max_blocks, refuse=refuse)

    def _check_blocks_align(self, name: str, geometry: dict[str, Any], bound: Any) -> None:
        """With a block layout, every block of the view must lie in one block of its segment
        (the segment's block a whole number of view blocks, e.g. vLLM's kernel blocks), so
        ``grow_blocks(n)`` opens exactly the view blocks inside the first ``n`` segment blocks."""
        if bound is self._sr.committed_table:
            return  # no block layout
        i = bound.data_ptr() - self._sr.committed_table.data_ptr()
        seg_off, seg_block = self._sr.segments[i // bound.element_size()]
        stride = geometry["block_stride"]
        size, es, entry = geometry["block_size"], geometry["entry_stride"], geometry["entry_bytes"]
        split = get_format(geometry["kind"]).split_block
        extent = size * entry if split else (size - 1) * es + entry
        multi = geometry["num_blocks"] > 1
        unit = stride if multi else seg_block  # segment blocks are whole multiples of `unit`
        rel = (geometry["offset_bytes"] - seg_off) % unit
        if (multi and seg_block % stride) or rel + extent > unit:
            raise ValueError(
                f"rank {self._sr.rank}: bind {name!r}: the view's blocks (stride {stride}, "
                f"{extent} bytes from segment offset {rel}) do not fit the segment's "
                f"{seg_block}-byte blocks at {seg_off}: each view block must lie in one segment "
                "block and the segment block must be a whole number of view block strides"
            )

    def close(self) -> None:
        """Drop the whole-region view: it holds the address range reserved (alloc's view rule);
        bindings the engine still holds keep it until they go too."""
        self.fence = None
