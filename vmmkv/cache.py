"""``ReplicatedKVCache``: the engine-facing object (region + rendezvous + kernels).

It picks one path at construction and delegates every store to it: the direct path
(``vmmkv.direct``: every rank writes its rows into every replica through the peer mappings,
then a barrier) or the gather path (``vmmkv.gather``: all-gather the group's rows, insert them
into the own replica). Both write the same bytes.

Contract:
- Collective (every rank of ``cpu_group``, same order): the constructor, ``grow``, ``shrink``,
  ``set_block_layout``, ``grow_blocks``, ``shrink_blocks``, ``set_committed_blocks``, the stores in gather mode (they
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
    cache.set_committed_blocks([(0, a), (b, c)])       # a block set: holes released

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
  ``committed_bytes`` is always the committed memory (the sum of the runs).
- ``run_bytes``: the run grid (``vmmkv.alloc.region``): a grow maps one physical allocation per
  stretch of new chunks of each segment, cut at its multiples (default ``chunk_bytes``).

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
import sys
import threading
from typing import Any

import torch

from ._assembly import assemble
from ._selection import resolve_direct
from ._util import delegate, delegates, run_all
from ._views import Binding
from .alloc.driver import finalizing

__all__ = ["Binding", "ReplicatedKVCache", "resolve_direct"]

log = logging.getLogger(__name__)


class ReplicatedKVCache:
    """Replicated KV cache over a PCP group (see the module docstring for the contracts).

    The cache checks every call against its closed and broken state, and delegates the rest:

    - its construction (the region, the paths, one agreement: every rank keeps a cache, or
      none): :func:`vmmkv._assembly.assemble`;
    - the shared settings and the selection line: ``vmmkv._selection``;
    - ``allocate``, ``bind``, the refusal of a late ``set_block_layout``:
      :class:`vmmkv._views.RegionViews` (it holds the whole-region view);
    - the stores, ``publish_layer``, ``barrier`` and their counters:
      :class:`vmmkv._dispatch.StoreDispatch` (it owns and closes the paths);
    - the out-of-range counter and its warning: :class:`vmmkv._out_of_range.OutOfRange`;
    - resizes and the block layout: the :class:`vmmkv.ipc.SymmetricRegion`.

    ``close`` closes the paths, then the region, then drops the whole-region view."""

    def __init__(
        self,
        cpu_group: Any,
        capacity_bytes: int,
        device: Any = None,
        *,
        device_group: Any = None,
        initial_bytes: int | None = None,
        chunk_bytes: int | None = None,
        run_bytes: int | None = None,
        lanes: int = 1,
        direct: bool | None = None,
        timeout: float = 60.0,
        barrier_timeout: float | None = None,
        backend: str = "auto",
    ) -> None:
        self._lock = threading.Lock()
        self._closed = False
        parts = assemble(
            cpu_group, capacity_bytes, device, device_group=device_group,
            initial_bytes=initial_bytes, chunk_bytes=chunk_bytes, run_bytes=run_bytes, lanes=lanes,
            direct=direct, timeout=timeout, barrier_timeout=barrier_timeout, backend=backend,
            log=log,
        )  # fmt: skip
        self._sr, self._stores, self._views = parts.region, parts.stores, parts.views
        self._out_of_range = parts.out_of_range
        self.error_counter = parts.out_of_range.counter
        self.mode_requested, self.why_not_direct = parts.mode_requested, parts.why_not_direct
        self.direct = parts.region.mapped

    # -- properties: the region's and the dispatch's, passed through ------------------------
    rank, world_size, device, backend, chunk_bytes, capacity_bytes, committed_bytes = delegates(
        "_sr", "rank", "world_size", "device", "backend", "chunk_bytes", "capacity_bytes",
        "committed_bytes",
    )  # fmt: skip
    committed_blocks = delegate(
        "_sr.committed_blocks",
        "The top of the committed block set: the block count when it is a prefix, the "
        "kernels' bound (None without a block layout: a prefix cache).",
    )
    committed_block_set = delegate(
        "_sr.committed_block_set",
        "The committed block set, ``((start, end), ...)`` (None without a block layout).",
    )
    lanes = delegate("_stores.lanes")
    region = delegate("_sr", "The SymmetricRegion under the cache.")
    closed = delegate("_closed", "True once close() ran.")
    path = delegate("_stores.default.name", "'direct' or 'gather'.")
    _path = delegate("_stores.default")  # the path object (tests, diagnostics)
    _gather = delegate("_stores.gather")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: ReplicatedKVCache is closed")
        stores = getattr(self, "_stores", None)
        if stores is not None and stores.broken is not None:
            frame = sys._getframe(1)  # a barrier wait was abandoned: name the public call
            while frame.f_back is not None and frame.f_code.co_name.startswith("_"):
                frame = frame.f_back
            stores.raise_broken(f"ReplicatedKVCache.{frame.f_code.co_name}")

    # -- memory ----------------------------------------------------------------------------
    def allocate(self, nbytes: int, device: Any = None, *, reserve: bool = False) -> torch.Tensor:
        """1-D int8 view of the next ``nbytes`` of the region (256-byte aligned): an engine's
        ``(nbytes, device)`` allocation hook (``vmmkv.integrations.vllm``
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
        return self._views.allocate(nbytes, device, reserve)

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
        return self._views.bind(name, view, kind)

    def grow(self, committed_bytes: int) -> int:
        """Collective: grow every replica's committed prefix to ``committed_bytes`` (rounded up
        to chunks). Allowed after graph capture; refused during capture. Returns the size."""
        return self._resize(self._sr.resize, committed_bytes, "grow")

    def shrink(self, committed_bytes: int) -> int:
        """Collective: shrink every replica's committed prefix (e.g. to sleep). Blocks beyond it
        are never written afterwards (kernels read the bound from device memory)."""
        return self._resize(self._sr.resize, committed_bytes, "shrink")

    def set_block_layout(self, segments: Any, max_blocks: int) -> None:
        """Collective: grow by blocks from now on (see the module docstring). ``segments``:
        ``(offset_bytes, block_bytes)`` pairs in region byte offsets. Validated on every rank
        before anything else (ints, > 0, inside the capacity, non-overlapping; allowed once,
        before any ``bind``, while nothing is committed); a bad layout raises on every rank
        (the offending rank TypeError/ValueError/RuntimeError, the others RendezvousError
        naming it), layouts that differ between ranks raise ConfigMismatch on every rank."""
        self._check_open()
        self._views.set_block_layout(segments, max_blocks)

    def grow_blocks(self, n: int) -> int:
        """Collective: every segment of the block layout holds ``n`` committed blocks
        afterwards, in every replica (the chunks covering them). Allowed after graph capture;
        refused during capture. Returns the block count."""
        return self._resize(self._sr.resize_blocks, n, "grow")

    def shrink_blocks(self, n: int) -> int:
        """Collective: lower every segment to ``n`` blocks (bounds first: blocks beyond are
        never written afterwards), then decommit the chunks no segment needs (e.g. to sleep).
        Returns the block count."""
        return self._resize(self._sr.resize_blocks, n, "shrink")

    def set_committed_blocks(
        self, intervals: Any, *, direction: str | None = None
    ) -> tuple[tuple[int, int], ...]:
        """Collective: every segment of the block layout holds exactly the blocks of
        ``intervals`` (``(start, end)`` pairs) afterwards, in every replica: holes release the
        chunks no block of the set needs in any segment and recommit them later, zeroed
        (``SymmetricRegion.resize_block_set``). Allowed after graph capture; refused during
        capture. Returns the canonical set. The kernels' bound is the top of the set: a slot
        in a hole below it is not skipped, so the caller never hands out a block outside the
        set (vLLM's worker checks every block id a step adds)."""
        return self._resize(self._sr.resize_block_set, intervals, direction)

    def _resize(self, resize: Any, n: Any, direction: str | None) -> Any:
        self._check_open()
        size = resize(n, direction=direction)
        self._out_of_range.warn()  # a host sync point: report skipped slots, once per cache
        return size

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
        self._check_open()
        self._stores.publish(
            (mla, idx), (kv_c, k_pe, k), slot_mapping, num_local_only, mode,
            gathered_slot_mapping, lane,
        )  # fmt: skip

    def _store(self, bindings, inputs, slot_mapping, nlo, mode, gathered) -> None:
        self._check_open()
        self._stores.store(bindings, inputs, slot_mapping, nlo, mode, gathered)

    def barrier(self, lane: int = 0) -> None:
        """Direct mode: every rank's earlier stores are visible in every replica afterwards
        (device-side system-scope barrier on CUDA; capture-safe). It does not hold back later
        stores: a peer past the barrier may store into this replica at once, so a read that
        must not see the peers' next stores needs a collective of its own between the two.
        Gather mode: nothing to wait for (each rank inserted everything itself), returns at
        once."""
        self._check_open()
        self._stores.barrier(lane)

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
        skipped = self._out_of_range.read()
        self._out_of_range.warn(skipped)
        return {
            "tokens_stored": self._stores.tokens,
            "peer_bytes_issued": self._stores.peer_bytes,
            "barriers": self._stores.barriers,
            "out_of_range_slots": skipped,
            "committed_bytes": self.committed_bytes,
        }

    def close(self) -> None:
        """Local and idempotent: barrier resources, peer mappings, then the own region."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # Synchronize before freeing the barrier's host-mapped control page: a barrier still in
        # flight writes into it. Its waits are aborted first (a wait longer than about 1 ms
        # returns; peers still got this rank's signals), so that close never waits for a peer.
        # While the interpreter shuts down, no driver call is made (alloc.driver.finalizing).
        stores = self._stores
        steps = [stores.abort_waits, stores.sync, self._out_of_range.warn_at_close]
        run_all([*([] if finalizing() else steps), stores.close, self._sr.close])
        self._views.close()  # the whole-region view: bindings the engine holds keep it alive

    def __enter__(self) -> ReplicatedKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
