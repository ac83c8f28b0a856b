"""``VllmKVCache``: vLLM 0.34.0's KV cache of one worker on a :class:`vmmkv.ReplicatedKVCache`.

What it does, in order (the constructor):

1. :func:`plan_kv_cache` validates vLLM's ``KVCacheConfig`` and layout (local; it raises
   :class:`UnsupportedKVCache` naming the layer, spec or layout before any collective).
2. One ``ReplicatedKVCache`` over the PCP group (``cpu_group`` for its rendezvous,
   ``device_group`` for its gather fallback) of the backing size rounded up to the allocation
   granularity, nothing committed, in the region's default chunks (at most 64, of at most 1 GiB;
   ``chunk_bytes`` or ``VMMKV_CHUNK_MIB`` for others): vLLM commits every block or none
   (start, sleep, wake), and a grow's cost is per allocation and peer, so few chunks make the
   engine's start and every wake fast (docs/design.md, "Chunk sizes"). ``run_bytes``: the
   region's run grid (vLLM's extensible cache passes granule chunks in runs of each segment's
   own, ``_buffer._chunk_and_runs``).
3. ``allocate(size, reserve=True)`` (exactly vLLM's backing size, committed block by block
   afterwards) is vLLM's backing buffer; ``set_block_layout`` declares the plan's segments
   (block growth, both layout families); vLLM's own ``create_kv_cache_views`` builds the layer
   views over that buffer (no whole-buffer ``torch.zeros`` over uncommitted memory).
4. Every layer view is bound (4-D ``[B, 1, N, C]`` as vLLM makes it) with its kind:
   ``mla_kind`` for MLA layers, ``indexer_kind`` for indexer K layers.
5. ``grow(initial_blocks)``.

Growth: ``grow(n)``/``shrink(n)`` give every layer blocks ``[0, n)`` (collective over the PCP
group); ``set_committed_blocks`` any block set (holes). Blocks that join the set read zero in
every replica when the call returns on any rank: vmmkv's resize zeroes them (fresh chunks and
the stale part of chunks that stayed committed) and synchronizes before the agreement that
lets a peer map or write them, so no zeroing or barrier is needed here (docs/design.md,
"Zeroing and copy order", has what vLLM zeroes on top and why vmmkv still zeroes). vLLM cannot
resize its block pool: the engine must hand out blocks of the committed set only
(:meth:`check_blocks` refuses others before vLLM's zeroing kernel touches them).

Stores (:meth:`store`): a layer's rows in one of the three PCP cases (``StorePlan``), through the
cache's direct path (every rank writes its rows into every replica, then one barrier, so that
the rows are visible before attention reads them) or its gather fallback (same bytes).

Zeroing (:meth:`after_zeroing`): vLLM zeroes newly allocated blocks every step
(``KVBlockZeroer``) in the own replica only; rows a peer already published into those blocks
are lost. The barrier after zeroing orders every rank's zeroing before any rank's first
publication of the step (the package docstring says why not replicated zeroing).

Contract: collective over the PCP group: the constructor, ``grow``, ``shrink``,
``after_zeroing`` and the stores (direct: the barrier; gather: the all-gather), every rank in the
same order. Local: ``binding``, ``check_blocks``, properties, ``close`` (idempotent; the views
are invalid afterwards). The object owns its ``ReplicatedKVCache`` and closes it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ... import _blockset as blockset
from ..._util import require_int, round_up
from ...alloc.region import make_backend
from ...cache import Binding, ReplicatedKVCache
from ...ops.formats import get_format
from ._buffer import _chunk_bytes_from_env
from ._layout import KVCachePlan, create_views, plan_kv_cache

__all__ = ["StorePlan", "VllmKVCache", "pcp_store_plan"]

log = logging.getLogger(__name__)

MLA, INDEXER = "mla", "indexer"
DCP_SHARDED = "dcp-replicated-decodes"  # StorePlan.case under DCP > 1


@dataclass(frozen=True)
class StorePlan:
    """One layer store in vLLM's PCP convention: ``tokens`` rows of this rank's inputs, the
    leading ``num_local_only`` of them replicated (own replica only). ``slots``: the slot of
    each of the ``tokens`` rows on this rank (what vLLM's insert receives after the replaced
    gather); ``gathered``: the group's rank-major mapping ``[world * tokens]`` (the gather
    fallback takes the peers' slots from it), or None (case 1)."""

    case: str
    tokens: int
    num_local_only: int
    slots: torch.Tensor
    gathered: torch.Tensor | None


def pcp_store_plan(
    rows: int,
    slot_mapping: torch.Tensor,
    num_decode_tokens: int,
    shard_decode_requests: bool,
    rank: int,
    world: int,
) -> StorePlan:
    """The store of one layer's cache inputs under vLLM 0.33's PCP gather convention
    (``vllm.v1.attention.ops.pcp._gather_prefill_cache_inputs``), without the gather:

    1. a slot mapping no longer than the local rows (replicated draft decodes, unexpanded):
       the first ``num_decode_tokens`` rows, all local only, at ``slot_mapping[:nd]``;
    2. ``shard_decode_requests`` (PCP with DCP == 1: one owner per decode): every local row is
       published at this rank's own section (``num_local_only = 0``);
    3. otherwise (DCP > 1, decodes replicated): the leading ``nd = num_decode_tokens`` rows are
       local only, the rest gathered. vLLM shards the KV cache over the DCP ranks then (its
       specs are ``dcp_sharded``): each rank's block holds the tokens the interleave gives it, at
       slots of its own, and its expanded mapping holds -1 for every token another rank keeps.
       A rank's rows therefore belong in its peers' caches at slots only their mappings know,
       and the store takes the gather path (``VllmKVCache.store``): every rank inserts the
       gathered rows into its own cache at its own mapping, as vLLM's gather + insert does.
       Direct publication needs every PCP rank to hold the same replica (DCP = 1).

    In 2 and 3 the slot mapping is the expanded one that vLLM's ``PCPManager`` builds: its first
    ``world * rows`` entries are rank-major (rank ``r``'s rows at ``[r * rows, (r + 1) * rows)``).
    vLLM makes rank 0 the canonical writer of replicated rows: every other rank's section holds
    PAD_SLOT_ID (-1) there. Replicated rows that are published (case 2, and short replicated
    prefills in case 3) are therefore written by rank 0 into every replica, as vLLM's gather
    writes rank 0's copy. The local-only rows of case 3 are written on every rank, as vLLM's
    insert writes them, at rank 0's slots ``mapping[:nd]`` (every rank holds the same rows):
    this rank's slots are ``mapping[:nd]`` followed by its own section past ``nd`` (one small
    copy when ``0 < nd``; a view of the mapping otherwise)."""
    require_int("rows", rows, lo=0)
    require_int("num_decode_tokens", num_decode_tokens, lo=0, hi=rows)
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1:
        raise TypeError(f"slot_mapping must be a 1-D tensor, got {slot_mapping!r:.80}")
    n = slot_mapping.shape[0]
    if n <= rows:
        nd = num_decode_tokens
        return StorePlan("replicated-draft-decodes", nd, nd, slot_mapping[:nd], None)
    if n < world * rows:
        raise ValueError(
            f"rank {rank}: the expanded slot mapping has {n} entries, fewer than "
            f"{world} ranks x {rows} rows"
        )
    gathered = slot_mapping[: world * rows]
    own = gathered[rank * rows : (rank + 1) * rows]
    if shard_decode_requests:
        return StorePlan("shard-decode-requests", rows, 0, own, gathered)
    nd = num_decode_tokens
    if 0 < nd and rank != 0:
        own = torch.cat((gathered[:nd], own[nd:]))
    return StorePlan(DCP_SHARDED, rows, nd, own, gathered)


class VllmKVCache:
    """vLLM's KV cache of one worker on vmmkv memory (see the module docstring)."""

    # True when vLLM 0.34's ExtensibleKVCache drives the commits, releases and recommits
    # (``_buffer.PeerKVBuffer``); False when the plugin's own allocation does
    extensible = False

    def __init__(
        self,
        kv_cache_config: Any,
        layout: Any,
        *,
        cpu_group: Any,
        device: Any,
        device_group: Any = None,
        kernel_block_sizes: Sequence[int] | None = None,
        mla_kind: str = "fp8_ds_mla",
        indexer_kind: str = "indexer_k",
        initial_blocks: int | None = None,
        direct: bool | None = None,
        timeout: float = 60.0,
        chunk_bytes: int | None = None,
        run_bytes: int | None = None,
        backend: str = "auto",
    ) -> None:
        self.config = kv_cache_config
        self.timeout = timeout
        self.plan: KVCachePlan = plan_kv_cache(
            kv_cache_config, layout, kernel_block_sizes, mla_kind=mla_kind,
            indexer_kind=indexer_kind,
        )  # fmt: skip
        plan = self.plan
        if initial_blocks is None:
            initial_blocks = plan.num_blocks
        require_int("initial_blocks", initial_blocks, lo=0, hi=plan.num_blocks)
        self.mla_kind, self.indexer_kind = mla_kind, indexer_kind
        # The region's capacity is vLLM's backing size rounded up to the granularity (2 MiB on
        # CUDA: num_blocks x 61 layers x 50432 B almost never is a multiple); vLLM's buffer is
        # exactly plan.size. Few chunks: every block or none is committed (module docstring).
        gran = make_backend(device, backend).granularity
        capacity = round_up(plan.size, gran)
        if chunk_bytes is None:
            chunk_bytes = _chunk_bytes_from_env(gran, capacity)
        elif chunk_bytes > capacity:  # a small cache is one chunk
            chunk_bytes = capacity
        self.cache = ReplicatedKVCache(
            cpu_group, capacity, device, device_group=device_group, initial_bytes=0,
            chunk_bytes=chunk_bytes, run_bytes=run_bytes, lanes=1, direct=direct,
            timeout=timeout, backend=backend,
        )  # fmt: skip
        try:
            # the whole backing, committed block by block below (set_block_layout + grow)
            self.buffer = self.cache.allocate(plan.size, reserve=True)
            base = self.buffer.data_ptr() - self.cache.region.base_ptr
            self.segments = tuple((base + off, bb) for off, bb in plan.segments)
            self.cache.set_block_layout(self.segments, plan.num_blocks)
            self.views = create_views(kv_cache_config, plan.layout, self.buffer, kernel_block_sizes)
            self._bindings: dict[tuple[int, str], Binding] = {}
            self.bindings: dict[str, Binding] = {}
            for name, place in plan.layers.items():
                b = self.cache.bind(name, self.views[name], place.kind)
                self.bindings[name] = b
                self._bindings[(self.views[name].data_ptr(), self._family(place.kind))] = b
            self.grow(initial_blocks)
        except BaseException:
            self.cache.close()
            raise
        log.info(
            "vmmkv: vLLM KV cache on vmmkv memory: %d layers, layout %s, %d of %d blocks "
            "committed, %d segments, path %s over %d PCP ranks",
            len(plan.layers), plan.layout.name, self.committed_blocks, plan.num_blocks,
            len(self.segments), self.cache.path, self.cache.world_size,
        )  # fmt: skip

    @staticmethod
    def _family(kind: str) -> str:
        return INDEXER if get_format(kind).split_block else MLA

    # -- properties ------------------------------------------------------------------------
    num_blocks = property(lambda self: self.plan.num_blocks)
    rank = property(lambda self: self.cache.rank)
    world_size = property(lambda self: self.cache.world_size)
    direct = property(lambda self: self.cache.direct)

    @property
    def committed_blocks(self) -> int:
        """The top of the committed block set (one past its highest block); the block count
        when the set is the prefix ``[0, n)`` of every layer, as it is unless
        :meth:`set_committed_blocks` made holes."""
        return int(self.cache.committed_blocks or 0)

    @property
    def committed_block_set(self) -> tuple[tuple[int, int], ...]:
        """The blocks of every layer committed in every replica, ``((start, end), ...)``."""
        return self.cache.committed_block_set or ()

    # -- growth ----------------------------------------------------------------------------
    def grow(self, num_blocks: int) -> int:
        """Collective: every layer holds blocks ``[0, num_blocks)`` in every replica; the new
        blocks read zero in every replica before any rank returns (the module docstring says
        why). Allowed after CUDA-graph capture. Returns the block count."""
        require_int("num_blocks", num_blocks, lo=0, hi=self.plan.num_blocks)
        return self.cache.grow_blocks(num_blocks)

    def shrink(self, num_blocks: int) -> int:
        """Collective: every layer keeps blocks ``[0, num_blocks)``; the memory beyond is
        decommitted in every replica and never written afterwards. Returns the block count."""
        require_int("num_blocks", num_blocks, lo=0, hi=self.plan.num_blocks)
        return self.cache.shrink_blocks(num_blocks)

    def set_committed_blocks(self, intervals: Any) -> tuple[tuple[int, int], ...]:
        """Collective: every layer holds exactly the blocks of ``intervals`` (``(start, end)``
        block pairs) in every replica (``ReplicatedKVCache.set_committed_blocks``: a hole
        releases the chunks no block of the set needs). Blocks that stay keep their bytes; the
        new ones read zero, as in :meth:`grow`. Returns the canonical set."""
        return self.cache.set_committed_blocks(intervals)

    def check_blocks(self, block_ids: Sequence[int]) -> None:
        """Refuse (ValueError) block ids outside the committed block set (beyond its top or in
        a hole), before anything writes into them: vLLM's block pool does not know vmmkv's
        committed set, and the kernels' bound (the top) does not see holes."""
        if not block_ids:
            return
        held = self.committed_block_set
        n = blockset.as_prefix(held)
        if n is not None:
            if max(block_ids) < n:
                return
            bad = max(block_ids)
        else:
            bad = next((b for b in block_ids if not blockset.contains(held, b)), None)
            if bad is None:
                return
        where = (
            f"committed {n} of {self.num_blocks} blocks"
            if n is not None
            else f"committed the blocks {list(held)} of {self.num_blocks}"
        )
        raise ValueError(
            f"rank {self.rank}: vLLM uses KV block {bad} but vmmkv {where}: grow() first, or "
            "keep vLLM's block pool inside the committed blocks"
        )

    # -- stores ----------------------------------------------------------------------------
    def binding(self, kv_cache: torch.Tensor, family: str) -> Binding | None:
        """The binding of the layer view ``kv_cache`` (vLLM's 4-D view, or the 3-D one its
        layers keep after ``squeeze(1)``) of ``family`` ("mla" or "indexer"), or None. A view
        of fewer blocks at the same address is the same layer (vLLM 0.34's
        ``extend_kv_cache`` re-binds views sized to the committed blocks)."""
        b = self._bindings.get((kv_cache.data_ptr(), family))
        if b is None or not 0 < kv_cache.shape[0] <= b.view.shape[0]:
            return None
        return b

    def store(self, b: Binding, inputs: Sequence[torch.Tensor], plan: StorePlan) -> None:
        """Store one layer cache's rows (``inputs``: ``kv_c, k_pe`` or ``k``) as ``plan`` says,
        then, in direct mode when rows went to peers, the barrier: every replica holds every
        rank's rows before attention reads them. Under DCP > 1 the gather path, whatever the
        cache's mode: vLLM shards the KV cache over the DCP ranks there (``pcp_store_plan``).
        Collective (see the module docstring)."""
        mla = self._family(b.kind) == MLA
        store = self.cache.store_ds_mla if mla else self.cache.store_indexer_k
        mode = "gather" if plan.case == DCP_SHARDED else None
        store(
            b, *inputs, plan.slots, num_local_only=plan.num_local_only, mode=mode,
            gathered_slot_mapping=plan.gathered,
        )  # fmt: skip
        if self.cache.direct and mode is None and plan.num_local_only < plan.tokens:
            self.cache.barrier()

    def after_zeroing(self) -> None:
        """Collective: vLLM zeroed blocks of the own replica; every rank's zeroing precedes
        every rank's next publication (direct mode: the cache barrier; gather mode: nothing,
        no peer writes into this replica)."""
        self.cache.barrier()

    def stats(self) -> dict[str, int]:
        return {**self.cache.stats(), "committed_blocks": self.committed_blocks}

    def close(self) -> None:
        """Local, idempotent: closes the ``ReplicatedKVCache``; the views are invalid after."""
        self.cache.close()
