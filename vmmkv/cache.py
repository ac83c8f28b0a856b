"""``ReplicatedKVCache``: the engine-facing object (region + rendezvous + kernels).

It picks one path at construction and delegates every store to it: the direct path
(``vmmkv.direct``: every rank writes its rows into every replica through the peer mappings,
then a barrier) or the gather path (``vmmkv.gather``: all-gather the group's rows, insert them
into the own replica). Both write the same bytes.

Contract:
- Collective (every rank of ``cpu_group``, same order): the constructor, ``grow``, ``shrink``,
  ``set_block_layout``, ``grow_blocks``, ``shrink_blocks``, the stores in gather mode (they
  all-gather), ``barrier`` and ``publish_layer`` in direct mode (every rank calls them for the
  same lane the same number of times).
- Local: ``allocate``, ``bind``, ``stats``, ``close`` (idempotent; a peer may be dead). Direct
  stores are local too (visible to peers after the barrier).
- Capture-safe (``torch.cuda.graph``) once warmed up (one eager call of each store): the
  direct stores, ``barrier`` and ``publish_layer`` on CUDA; the gather stores on CUDA with an
  NCCL ``device_group`` (no host synchronization, no host collective; see ``vmmkv.gather``),
  also when replayed after growth. Not capture-safe: ``grow``/``shrink`` and
  ``grow_blocks``/``shrink_blocks`` (refused during capture), ``set_block_layout``, the gather stores without a device group (they stage through host memory over gloo,
  and are refused during capture), ``stats`` (it reads a device counter).
- Every host-side wait (the host-backend barrier, gloo gathers) is bounded by ``timeout``.
- Device barriers never trap by default (docs/design.md "Barrier"): a wait past
  ``barrier_timeout`` (``VMMKV_BARRIER_TIMEOUT``, default 600 s), or on a peer found dead, is
  aborted by a watchdog; every later call then raises ``vmmkv.ops.BarrierAborted`` naming the
  peer, and ``close`` still works. ``VMMKV_BARRIER_TRAP=1`` restores the device trap.
- Views returned by ``allocate`` and ``bind`` are invalid after ``close``. ``allocate`` hands
  out committed memory only (ValueError otherwise, naming what is committed and the call that
  commits), unless ``reserve=True``: a view over address space of which only committed blocks
  may be touched (the stores are bounded per segment or prefix). ``region.view(rank)`` is the
  committed prefix (``reserve=True``: the whole capacity).
- A caller's bad constructor argument (capacity, chunk size, initial size, backend, device) is
  checked before any driver call; the rank that passed it raises a ``ValueError``/``TypeError``
  (``RendezvousValueError``/``RendezvousTypeError``, which are also ``RendezvousError``), the
  others ``RendezvousError`` naming it, at once. Every rank ends with one outcome.
- Out-of-range slots (beyond a view, or beyond the committed size) are skipped and counted
  (``stats()["out_of_range_slots"]``); one WARNING per cache gives the count the first time
  ``stats``, a grow/shrink or ``close`` finds it non-zero (the stores never read it).

Growth: by a byte prefix (default) or by blocks (a block layout, for layer-major layouts where
"the first B blocks of every layer" is one byte range per layer region, not a prefix)::

    cache.grow(nbytes) / cache.shrink(nbytes)          # the committed prefix, chunk-rounded
    cache.set_block_layout(segments, max_blocks)       # once, before any bind, nothing committed
    cache.grow_blocks(n) / cache.shrink_blocks(n)      # n blocks of every segment

- ``segments``: ``(offset_bytes, block_bytes)`` pairs in region byte offsets (what
  ``allocate()`` views have: ``view.data_ptr() - cache.region.base_ptr``); segment ``i`` spans
  ``[offset_i, offset_i + max_blocks * block_bytes_i)``; any order, never overlapping. Equal on
  every rank (a mismatch raises on every rank naming the ranks). Allowed once, before any
  ``bind``, while nothing is committed (``initial_bytes=0``, no ``grow``).
- ``grow_blocks(n)``/``shrink_blocks(n)`` commit/decommit, on every rank, the chunks covering
  ``[offset_i, offset_i + n * block_bytes_i)`` of every segment (the union: a chunk neighbouring
  segments share stays while either needs it); peers map exactly those chunks. Same protocol
  and failure rules as ``grow``/``shrink`` (docs/design.md, "Resize protocol" and "Segmented
  growth"): a failed grow leaves every rank at the old block count, the group usable.
- Every bound view must lie inside one segment (refused at ``bind`` otherwise); its kernels'
  bound is its segment's element of a device table holding ``offset_i + n * block_bytes_i``
  (exact), read on every launch: growth after graph capture needs no recapture.
- ``grow``/``shrink`` raise on a cache with a block layout, ``grow_blocks``/``shrink_blocks`` on
  one without (on every rank). ``committed_blocks`` is None without a block layout.
  ``committed_bytes`` is always the committed memory (the sum of committed chunks).

Store API (one for both paths)::

    store_ds_mla(b, kv_c, k_pe, slot_mapping, *, num_local_only=0, mode=None,
                 gathered_slot_mapping=None)
    store_indexer_k(b, k, slot_mapping, ...) / publish_rows(b, rows, slot_mapping, ...)
    store_layer(mla, idx, kv_c, k_pe, k, slot_mapping, ...)
    publish_layer(mla, idx, kv_c, k_pe, k, slot_mapping, *, lane=0, ...)  # store + barrier

- ``slot_mapping``: this rank's ``T`` slots (``slot < 0``: padding, never written); inputs hold
  at least ``T`` rows. The leading ``num_local_only`` rows are replicated (decode rows every rank
  computed alike): they go to the own replica only.
- ``gathered_slot_mapping``: the engine's slot mapping of the whole group, ``[world * T]``,
  rank-major (rank ``r``'s rows at ``[r*T, (r+1)*T)``, replicated rows first in each), as vLLM
  builds it for PCP. With it, ``slot_mapping`` may be None: the direct path uses this rank's
  slice (a view), the gather path does not gather slots.
- Gather convention: every rank passes the same padded ``T`` and ``num_local_only`` (pad uneven
  inputs with :func:`vmmkv.gather.pad_tokens`). Over gloo it is checked on every call (a host
  header gathered first; the same error on every rank, nothing stored); over NCCL only with
  ``VMMKV_CHECK_PADDING=1`` (a host collective: not capturable).
- ``mode``: None (the cache's path), ``"gather"`` (always possible) or ``"direct"`` (raises
  when the cache is not direct). One byte result whatever the path.

Selection (``VMMKV_DIRECT``, or the ``direct`` argument, which wins): ``auto`` (default) publishes
directly when every rank mapped every peer, otherwise falls back to gather-then-insert with one
INFO line saying why; ``1`` asks for direct and warns (RuntimeWarning + WARNING) when it falls
back; ``0`` always gathers. The mode, ``lanes``, the barrier timeout and VMMKV_CHECK_PADDING must
be equal on every rank (checked at construction).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from . import ops
from ._store import check_kinds, target_geometry
from ._util import require_int, require_timeout, round_up, run_all
from .alloc.driver import finalizing
from .direct import DirectPath
from .gather import GatherPath, check_padding_enabled
from .ipc import ConfigMismatch, SymmetricRegion
from .ipc.comm import check_cpu_group
from .ops.formats import get_format
from .ops.kv import KVTarget

__all__ = ["Binding", "ReplicatedKVCache", "resolve_direct"]

log = logging.getLogger(__name__)

_ALLOC_ALIGN = 256


def _barrier_timeout(value: float | None) -> float:
    """The host timeout of a barrier wait (docs/design.md "Barrier"): 600 s unless given or set
    by ``VMMKV_BARRIER_TIMEOUT``; the device diagnostic comes after min(10 s, it)."""
    if value is None:
        env = os.environ.get("VMMKV_BARRIER_TIMEOUT", "600")
        try:
            value = float(env)
        except ValueError:
            msg = f"VMMKV_BARRIER_TIMEOUT must be a number of seconds, got {env!r}"
            raise ValueError(msg) from None
    return require_timeout("barrier_timeout", value)


def _settings(direct, lanes, barrier_timeout) -> tuple[dict[str, Any], Exception | None]:
    """The settings every rank must share, and the first invalid one's error. An invalid one
    (e.g. a typo in one rank's environment) still travels to the region's first request, as
    ``"invalid: <why>"``, so the peers fail at once naming it instead of waiting."""
    match: dict[str, Any] = {}
    error: Exception | None = None
    for key, value in (
        ("direct", lambda: resolve_direct(direct)),
        ("lanes", lambda: require_int("lanes", lanes, lo=1)),
        ("barrier_timeout", lambda: _barrier_timeout(barrier_timeout)),
        ("check_padding", check_padding_enabled),
    ):
        try:
            match[key] = value()
        except (TypeError, ValueError) as exc:
            match[key], error = f"invalid: {exc}", error or exc
    return match, error


def resolve_direct(direct: bool | None) -> str:
    """'auto', '1' or '0' from the argument (wins) or ``VMMKV_DIRECT``."""
    if direct is not None:
        if not isinstance(direct, bool):
            raise TypeError(f"direct must be None, True or False, got {direct!r}")
        return "1" if direct else "0"
    value = os.environ.get("VMMKV_DIRECT", "auto").strip().lower()
    if value not in ("auto", "0", "1"):
        raise ValueError(f"VMMKV_DIRECT must be 'auto', '0' or '1', got {value!r}")
    return value


@dataclass(frozen=True, eq=False)
class Binding:
    """A bound layer view: what the store methods take. ``local`` targets the own replica (the
    gather path), ``direct`` every replica (None in gather mode)."""

    name: str
    kind: str
    view: torch.Tensor
    local: KVTarget
    direct: KVTarget | None


class ReplicatedKVCache:
    """Replicated KV cache over a PCP group (see the module docstring for the contracts)."""

    def __init__(
        self,
        cpu_group: Any,
        capacity_bytes: int,
        device: Any = None,
        *,
        device_group: Any = None,
        initial_bytes: int | None = None,
        chunk_bytes: int | None = None,
        lanes: int = 1,
        direct: bool | None = None,
        timeout: float = 60.0,
        barrier_timeout: float | None = None,
        backend: str = "auto",
    ) -> None:
        check_cpu_group(cpu_group)
        timeout = require_timeout("timeout", timeout)
        match, error = _settings(direct, lanes, barrier_timeout)
        self.mode_requested = match["direct"]
        self._lanes = lanes
        self._lock = threading.Lock()
        self._closed = False
        self._next_offset = 0
        self._bound = 0  # bind() calls so far: a block layout is set before the first
        self._tokens = 0
        self._barriers = 0
        self._warned_out_of_range = False  # logged once per cache, at a host sync point
        try:
            sr = SymmetricRegion(
                capacity_bytes, device, cpu_group, initial_bytes=initial_bytes or 0,
                chunk_bytes=chunk_bytes, backend=backend, timeout=timeout, must_match=match,
                peers="auto" if self.mode_requested in ("auto", "1") else "off",
            )  # fmt: skip
        except ConfigMismatch as exc:
            if error is not None:
                raise error from exc  # this rank's own setting is the cause
            raise
        if error is not None:  # every rank has the same bad setting
            sr.close()
            raise error
        self._sr = sr
        self.direct = sr.mapped
        self.why_not_direct = "" if self.direct else sr.why_not_mapped
        if self.mode_requested == "0":
            self.why_not_direct = "direct publication disabled (VMMKV_DIRECT=0 or direct=False)"
        error = None
        try:  # local setup, then one agreement: every rank keeps a cache, or none does
            self.error_counter = torch.zeros(1, dtype=torch.int32, device=sr.device)
            # the whole own region, committed or not: KVTarget.cache, the barrier's fence
            self._fence = sr.view(sr.rank, reserve=True)
            if sr.device.type == "cuda":
                # Load every kernel now: a module loaded lazily while a barrier spins would wait
                # for that barrier, and loading is not capture-safe.
                ops.warm_up(sr.device)
            self._gather = GatherPath(
                sr.rank, sr.world_size, sr.device, sr.local_table, cpu_group, device_group,
                timeout, match["check_padding"],
            )  # fmt: skip
            self._direct = None
            if self.direct:
                trap = os.environ.get("VMMKV_BARRIER_TRAP", "0").strip().lower() in ("1", "true")
                self._direct = DirectPath(
                    sr, self._fence, lanes, match["barrier_timeout"], barrier_trap=trap
                )
        except Exception as exc:
            error = exc
        try:
            sr.agree(error, "cache setup")
        except BaseException:
            direct_path = getattr(self, "_direct", None)
            run_all(([direct_path.close] if direct_path else []) + [sr.close])
            raise
        self._path = self._direct or self._gather
        self._log_selection()

    def _log_selection(self) -> None:
        if self.direct:
            log.info("vmmkv: direct publication to %d ranks", self.world_size)
            return
        msg = f"vmmkv: gather-then-insert fallback: {self.why_not_direct}"
        asked = self.mode_requested == "1"
        if asked:
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
        log.log(logging.WARNING if asked else logging.INFO, msg)

    # -- properties ------------------------------------------------------------------------
    rank = property(lambda self: self._sr.rank)
    world_size = property(lambda self: self._sr.world_size)
    device = property(lambda self: self._sr.device)
    capacity_bytes = property(lambda self: self._sr.capacity_bytes)
    committed_bytes = property(lambda self: self._sr.committed_bytes)
    committed_blocks = property(
        lambda self: self._sr.committed_blocks,
        doc="Blocks every segment holds (None without a block layout: a prefix cache).",
    )
    lanes = property(lambda self: self._lanes)
    region = property(lambda self: self._sr, doc="The SymmetricRegion under the cache.")
    path = property(lambda self: self._path.name, doc="'direct' or 'gather'.")

    @property
    def backend(self) -> str:
        return "cuda" if self.device.type == "cuda" else "host"

    @property
    def chunk_bytes(self) -> int:
        return self._sr.chunk_bytes

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: ReplicatedKVCache is closed")
        broken = self._direct.broken if getattr(self, "_direct", None) else None
        if broken is not None:  # a barrier wait was abandoned: name the public call
            frame = sys._getframe(1)
            while frame.f_back is not None and frame.f_code.co_name.startswith("_"):
                frame = frame.f_back
            self._direct._barrier.check(f"ReplicatedKVCache.{frame.f_code.co_name}")

    # -- memory ----------------------------------------------------------------------------
    def allocate(self, nbytes: int, device: Any = None, *, reserve: bool = False) -> torch.Tensor:
        """1-D int8 view of the next ``nbytes`` of the region (256-byte aligned): an engine's
        ``(nbytes, device)`` allocation hook (vLLM 0.33.0 has none; ``vmmkv.integrations.vllm``
        replaces its ``allocate_kv_cache`` and calls this). Local.

        The view lies in committed memory: ValueError (naming the rank, the device, the bytes
        asked for and what is committed) unless every byte of it is committed (the committed
        prefix, ``initial_bytes=`` or ``grow(...)``; with a block layout, the chunks of the
        committed blocks, ``grow_blocks(n)``); nothing is handed out then. ``reserve=True``
        (keyword only) is for an engine that allocates its whole buffer first and commits it
        afterwards (``set_block_layout`` + ``grow_blocks``, or ``grow`` later): the view then
        spans address space, committed or not. Only committed bytes may be touched through it
        (an uncommitted one kills the process: SIGSEGV on the host backend, an illegal address
        on CUDA); the stores are safe, since they are bounded per view by the committed size of
        its segment (or prefix) and skip and count what lies beyond."""
        self._check_open()
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"allocate: nbytes must be an int > 0, got {nbytes!r}")
        if not isinstance(reserve, bool):
            raise TypeError(f"allocate: reserve must be True or False, got {reserve!r}")
        if device is not None and torch.device(device) != self.device:
            dev = torch.device(device)
            if not (dev.type == self.device.type and dev.index is None):
                raise ValueError(f"allocate: device {dev} is not the cache's device {self.device}")
        with self._lock:
            start = round_up(self._next_offset, _ALLOC_ALIGN)
            if start + nbytes > self.capacity_bytes:
                raise ValueError(
                    f"allocate: {nbytes} bytes at offset {start} exceed the capacity "
                    f"{self.capacity_bytes} ({self.capacity_bytes - start} left)"
                )
            if not reserve and not self._sr.is_committed(start, start + nbytes):
                raise ValueError(
                    f"rank {self.rank} ({self.device}): allocate({nbytes}): region bytes "
                    f"[{start}, {start + nbytes}) are not all committed; "
                    f"{self._sr.describe_committed()}. Commit them first "
                    f"({self._sr.how_to_commit()}), or call allocate({nbytes}, reserve=True) for "
                    "a view over address space whose committed parts alone may be touched"
                )
            self._next_offset = start + nbytes
        return self._fence[start : start + nbytes].view(torch.int8)

    def bind(self, name: str, view: torch.Tensor, kind: str) -> Binding:
        """Validate a layer view ``[num_blocks, block_size, entry]`` inside the region and
        return the :class:`Binding` the store methods take.

        ``kind`` (the formats table, ``vmmkv.ops.formats``): ``"fp8_ds_mla"`` (entry 656, raw
        ``amax/448`` tile scales) or ``"fp8_ds_mla_ue8m0"`` (power-of-two tile scales: what vLLM
        0.33.0 writes, ``mla_kind_for``); ``"indexer_k"`` (132, blocks contiguous: the values
        and scales are split inside each block; fp32 scales, Hopper) or ``"indexer_k_mxfp8"``
        (four UE8M0 bytes per scale, sm_10x; ``indexer_kind_for``); ``"rows"`` (any entry
        size). A 4-D single-head view ``[num_blocks, 1, block_size, entry]`` (vLLM's) is taken
        as the 3-D one. With a block layout the view must lie inside one segment, each of its
        blocks inside one segment block (ValueError naming the view and the segments
        otherwise); its bound is that segment's."""
        self._check_open()
        geometry = target_geometry(
            view, kind, self._fence.data_ptr(), self.capacity_bytes, name=name
        )
        if view.device != self.device:
            raise ValueError(f"bind {name!r}: view is on {view.device}, cache on {self.device}")
        start = geometry["offset_bytes"]
        end = start + sum((n - 1) * st for n, st in zip(view.shape, view.stride(), strict=True))
        end = end + 1 if view.numel() else start  # the last byte the view holds, + 1
        with self._lock:
            bound = self._sr.bound_for(start, end, f"bind {name!r}")
            self._check_blocks_align(name, geometry, bound)
            self._bound += 1
        tensors = dict(committed_bytes=bound, error_counter=self.error_counter, cache=self._fence)
        local = self._gather.target(geometry, **tensors)
        direct = self._direct.target(geometry, **tensors) if self._direct else None
        cache = view.view(torch.uint8) if view.dtype == torch.int8 else view
        binding = Binding(name, kind, cache, local, direct)
        for path in (self._gather, self._direct) if self._direct else (self._gather,):
            path.prepare((binding,))  # per-binding launch state, built once (before capture)
        return binding

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
                f"rank {self.rank}: bind {name!r}: the view's blocks (stride {stride}, "
                f"{extent} bytes from segment offset {rel}) do not fit the segment's "
                f"{seg_block}-byte blocks at {seg_off}: each view block must lie in one segment "
                "block and the segment block must be a whole number of view block strides"
            )

    def grow(self, committed_bytes: int) -> int:
        """Collective: grow every replica's committed prefix to ``committed_bytes`` (rounded up
        to chunks). Allowed after graph capture; refused during capture. Returns the size."""
        self._check_open()
        size = self._sr.resize(committed_bytes, direction="grow")
        self._warn_out_of_range()
        return size

    def shrink(self, committed_bytes: int) -> int:
        """Collective: shrink every replica's committed prefix (e.g. to sleep). Blocks beyond it
        are never written afterwards (kernels read the bound from device memory)."""
        self._check_open()
        size = self._sr.resize(committed_bytes, direction="shrink")
        self._warn_out_of_range()
        return size

    def set_block_layout(self, segments: Any, max_blocks: int) -> None:
        """Collective: grow by blocks from now on (see the module docstring). ``segments``:
        ``(offset_bytes, block_bytes)`` pairs in region byte offsets. Validated on every rank
        before anything else (ints, > 0, inside the capacity, non-overlapping; allowed once,
        before any ``bind``, while nothing is committed); a bad layout raises on every rank
        (the offending rank TypeError/ValueError/RuntimeError, the others RendezvousError
        naming it), layouts that differ between ranks raise ConfigMismatch on every rank."""
        self._check_open()
        with self._lock:
            refuse = ""
            if self._bound:
                refuse = f"views are bound already ({self._bound}); set the layout before bind"
            self._sr.set_block_layout(segments, max_blocks, refuse=refuse)

    def grow_blocks(self, n: int) -> int:
        """Collective: every segment of the block layout holds ``n`` committed blocks
        afterwards, in every replica (the chunks covering them). Allowed after graph capture;
        refused during capture. Returns the block count."""
        self._check_open()
        blocks = self._sr.resize_blocks(n, direction="grow")
        self._warn_out_of_range()
        return blocks

    def shrink_blocks(self, n: int) -> int:
        """Collective: lower every segment to ``n`` blocks (bounds first: blocks beyond are
        never written afterwards), then decommit the chunks no segment needs (e.g. to sleep).
        Returns the block count."""
        self._check_open()
        blocks = self._sr.resize_blocks(n, direction="shrink")
        self._warn_out_of_range()
        return blocks

    # -- stores (see the module docstring) -------------------------------------------------
    def store_ds_mla(self, b, kv_c, k_pe, slot_mapping, *, num_local_only=0, mode=None,
                     gathered_slot_mapping=None) -> None:  # fmt: skip
        """fp8_ds_mla rows of ``kv_c [T,512]`` + ``k_pe [T,64]`` (bf16) into every replica."""
        self._store((b,), (kv_c, k_pe), slot_mapping, num_local_only, mode, gathered_slot_mapping)

    def store_indexer_k(self, b, k, slot_mapping, *, num_local_only=0, mode=None,
                        gathered_slot_mapping=None) -> None:  # fmt: skip
        """Indexer keys ``k [T,128]`` (bf16, ue8m0 scales) into every replica."""
        self._store((b,), (k,), slot_mapping, num_local_only, mode, gathered_slot_mapping)

    def store_layer(self, mla, idx, kv_c, k_pe, k, slot_mapping, *, num_local_only=0,
                    mode=None, gathered_slot_mapping=None) -> None:  # fmt: skip
        """Both caches of one layer in one launch."""
        self._store(
            (mla, idx), (kv_c, k_pe, k), slot_mapping, num_local_only, mode, gathered_slot_mapping
        )

    def publish_rows(self, b, rows, slot_mapping, *, num_local_only=0, mode=None,
                     gathered_slot_mapping=None) -> None:  # fmt: skip
        """Already formatted rows ``[T, entry]`` (uint8) into every replica."""
        self._store((b,), (rows,), slot_mapping, num_local_only, mode, gathered_slot_mapping)

    def publish_layer(self, mla, idx, kv_c, k_pe, k, slot_mapping, *, num_local_only=0,
                      lane=0, mode=None, gathered_slot_mapping=None) -> None:  # fmt: skip
        """``store_layer`` then ``barrier(lane)``: every replica holds the layer afterwards.
        Direct: one launch where the ops layer fuses store and barrier; gather: the store (each
        rank inserted everything itself, nothing to wait for)."""
        path = self._select(mode)
        self._check_lane(lane)
        check_kinds((mla, idx), Binding)
        args = ((mla, idx), (kv_c, k_pe, k), slot_mapping, num_local_only)
        self._tokens += path.publish(*args, gathered_slot_mapping, lane)
        if path is self._direct:
            self._barriers += 1

    def _select(self, mode: str | None) -> Any:
        self._check_open()
        if mode is None:
            return self._path
        if mode == "gather":
            return self._gather
        if mode == "direct":
            if self._direct is None:
                raise RuntimeError(
                    f"rank {self.rank}: direct mode unavailable: {self.why_not_direct}"
                )
            return self._direct
        raise ValueError(f"mode must be None, 'direct' or 'gather', got {mode!r}")

    def _store(self, bindings, inputs, slot_mapping, nlo, mode, gathered) -> None:
        path = self._select(mode)
        check_kinds(bindings, Binding)
        self._tokens += path.store(bindings, inputs, slot_mapping, nlo, gathered)

    def _check_lane(self, lane: Any) -> None:
        if isinstance(lane, bool) or not isinstance(lane, int) or not 0 <= lane < self._lanes:
            raise ValueError(f"lane must be an int in [0, {self._lanes}), got {lane!r}")

    def barrier(self, lane: int = 0) -> None:
        """Direct mode: every rank's earlier stores are visible in every replica afterwards
        (device-side system-scope barrier on CUDA; capture-safe). Gather mode: nothing to
        wait for (each rank inserted everything itself), returns at once."""
        self._check_open()
        self._check_lane(lane)
        if self._direct is None:
            return
        self._direct.barrier(lane)
        self._barriers += 1

    def stats(self) -> dict[str, int]:
        """Host-side counters, plus the device out-of-range counter (synchronizes).

        ``tokens_stored``: the tokens passed to the stores, counted the same in both modes:
        ``T`` per call (this rank's rows, padding and replicated rows included, before any
        gather). ``peer_bytes_issued``: entry bytes sent to peers by direct stores (padding and
        out-of-range tokens included); 0 for gather stores. ``out_of_range_slots``: tokens the
        kernels skipped (slot beyond the view or the committed size), once per cache a token
        targeted (``store_layer`` counts a bad slot twice: MLA and Indexer); a direct store
        counts this rank's own tokens, a gather store every rank's gathered tokens (each rank
        inserts them all) plus its own replicated ones. The first time it is found non-zero
        (here, or after ``grow``/``shrink``/``grow_blocks``/``shrink_blocks``, or in
        ``close``) one WARNING is logged, once per cache, with the count."""
        self._check_open()
        skipped = int(self.error_counter.item())
        self._warn_out_of_range(skipped)
        return {
            "tokens_stored": self._tokens,
            "peer_bytes_issued": self._direct.peer_bytes if self._direct else 0,
            "barriers": self._barriers,
            "out_of_range_slots": skipped,
            "committed_bytes": self.committed_bytes,
        }

    def _warn_out_of_range(self, skipped: int | None = None) -> None:
        """Log once per cache that stores skipped out-of-range slots. Called at host
        synchronization points only (never on the store path: reading the device counter
        synchronizes), and never during a stream capture."""
        if self._warned_out_of_range:
            return
        if skipped is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return
            skipped = int(self.error_counter.item())
        if skipped:
            self._warned_out_of_range = True
            log.warning(
                "vmmkv rank %d (%s): the stores skipped %d out-of-range slots so far (a slot "
                "beyond its view, or in a block beyond the committed size: grow or grow_blocks "
                "before storing there); these rows were written nowhere. stats()"
                "['out_of_range_slots'] has the count; this warning is logged once per cache",
                self.rank, self.device, skipped,
            )  # fmt: skip

    def close(self) -> None:
        """Local and idempotent: barrier resources, peer mappings, then the own region."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # Synchronize before freeing the barrier's host-mapped control page: a barrier still in
        # flight writes into it. Its waits are aborted first (a wait longer than about 1 ms
        # returns; peers still got this rank's signals), so that close never waits for a peer.
        steps = [] if finalizing() else [self._abort_waits, self._sync, self._warn_at_close]
        steps += [self._gather.close] + ([self._direct.close] if self._direct else [])
        run_all([*steps, self._sr.close])
        # The whole-region view holds the address range reserved (alloc's view rule); bindings
        # the engine still holds keep it until they go too.
        self._fence = None

    def _abort_waits(self) -> None:
        if self._direct is not None:
            self._direct.abort_waits(f"rank {self.rank} closed its cache")

    def _warn_at_close(self) -> None:
        try:
            self._warn_out_of_range()
        except Exception as exc:  # a diagnostic: it never fails the teardown
            log.debug(
                "vmmkv rank %d: reading the out-of-range counter at close: %s", self.rank, exc
            )

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self) -> ReplicatedKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
