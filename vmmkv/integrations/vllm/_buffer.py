"""vLLM 0.34's extensible KV cache with vmmkv as its physical layer (PCP > 1): the buffer, and the
chunk and runs it commits in.

vLLM 0.34 reserves the KV cache's address range itself (``ExtensibleKVCache``, on by default on
CUDA), commits a prefix of blocks on demand and keeps the planning, the post-capture sizing, the
views, sleep, discard and shutdown. It builds its byte buffer through the module-level name
``vllm.v1.worker.extensible_kv_cache.ExtensibleTensor``; the plugin binds that name to
``_allocation.make_buffer``, which under PCP > 1 returns a :class:`PeerKVBuffer`: the same nine
members vLLM uses (``device``, ``free``, ``full_view``, ``granularity``, ``physical_bytes``,
``release_physical``, ``resize_segments_``, ``segment_view``, ``segments_backed_by_one_chunk``)
over one ``VllmKVCache``, whose region every PCP rank maps: a commit is vmmkv's collective grow
(exportable chunks, fd exchange, peer maps, the new blocks zeroed before any peer maps them), a
release its collective shrink to 0 (peers unmapped first). With PCP = 1 it returns vLLM's own
``ExtensibleTensor``: nothing of vmmkv runs.

The chunk (the unit a commit rounds each segment to, :attr:`PeerKVBuffer.granularity`, which
vLLM's sizing after capture rounds every segment up to) and the runs (one physical allocation
per stretch of new chunks, ``vmmkv.alloc.region``) are chosen here: :func:`_chunk_and_runs`,
with elastic mode's chunk (:func:`elastic_chunk_bytes`) as the grid the runs are cut at;
``VMMKV_CHUNK_MIB`` comes first (:func:`_chunk_bytes_from_env`, also ``VllmKVCache``'s default).

Why every collective lines up: vLLM calls the buffer on every rank in the same order: the
allocate hook, warmup commits (counts min-reduced over the world group), the two shrink-remaps
before capture, ``extend_kv_cache`` (a ``collective_rpc``), sleep, wake and discard
(``collective_rpc``), shutdown (``free``, local). The one per-rank decision, lending for a
weight update, is agreed in ``_lending``. Elastic mode (``_elastic_worker``):
:attr:`PeerKVBuffer.budget` is what ``extend_kv_cache`` committed, and
:attr:`PeerKVBuffer.released` says that vLLM holds the memory released (nothing is committed
for a resize then).

Contract: ``resize_segments_`` and ``release_physical`` are collective over the PCP group; the
views, ``free`` (idempotent; closes the cache and clears the plugin's active cache), the
properties and the chunk functions are local. Not capture-safe: vLLM commits outside graph
capture. The buffer owns its ``VllmKVCache``; vLLM owns the buffer (``ExtensibleKVCache.free``
at the runner's shutdown).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import torch

from ._state import _STATE, close_active

__all__ = ["ELASTIC_CHUNK_MIB", "PeerKVBuffer", "elastic_chunk_bytes"]

# Elastic mode's chunk: 64 MiB in a block-major layout (docs/design.md, "Elastic KV in
# vLLM"): a grow costs one driver call per chunk and peer; on one H200, 2 processes, a
# +256-block DeepSeek-V3.2 grow took 21.6-25.1 ms at 64 MiB, 28.3-32.6 ms at 32 MiB (two runs),
# and committed bytes stay within 0.4 % of the blocks' own at 1000 blocks.
ELASTIC_CHUNK_MIB = 64


def _chunk_bytes_from_env(granularity: int, capacity: int) -> int | None:
    """The KV region's chunk size from ``VMMKV_CHUNK_MIB`` (``vmmkv._env.chunk_bytes``: MiB, a
    whole number of bytes), which must be a multiple of the allocation granularity and at most
    the KV capacity; or None: the region's default."""
    from ..._env import CHUNK_MIB, chunk_bytes

    chunk = chunk_bytes()
    if chunk is not None and (chunk % granularity or chunk > capacity):
        raise ValueError(
            f"{CHUNK_MIB}={chunk / (1 << 20):g}: expected a chunk size in MiB, a multiple of the "
            f"allocation granularity ({granularity} bytes) and at most the KV capacity "
            f"({capacity} bytes)"
        )
    return chunk


def elastic_chunk_bytes() -> int:
    """Elastic mode's chunk size: ``VMMKV_CHUNK_MIB`` (parsed as the plugin does), else
    ``ELASTIC_CHUNK_MIB``; the cache clamps it to its capacity and checks the granularity."""
    return _chunk_bytes_from_env(1, 1 << 62) or ELASTIC_CHUNK_MIB << 20


def _chunk_and_runs(
    granularity: int, size: int, elastic: int | None, env: int | None
) -> tuple[int, int]:
    """The region's ``(chunk_bytes, run_bytes)`` for a cache of ``size`` bytes. ``env``
    (``VMMKV_CHUNK_MIB``) makes both that chunk (one allocation per chunk); else the chunk is
    the allocation ``granularity``, so that vLLM's estimate (each segment rounded up to the
    buffer's ``granularity``) is what vmmkv maps, and runs follow vLLM's own buffer: one
    allocation per stretch of each segment a commit adds (DeepSeek-V3.2's layer-major cache:
    122 runs, one per layer segment), cut at elastic mode's chunk (``elastic``, 64 MiB) so that
    its releases return what a grid of those chunks returns (docs/design.md, "Chunk sizes").
    Pure: no vLLM, no driver call.

    Why runs: a commit's time is per allocation and peer, not per byte; an extend of ~25 GiB in
    2 MiB allocations took 4.9 s at 2 ranks on one H100, where the same bytes in 122 runs take
    a plain driver replay 16 ms (docs/design.md, "Chunk sizes")."""
    from ..._util import round_up

    if env:
        return env, env
    if elastic:
        return granularity, round_up(elastic, granularity)
    return granularity, round_up(size, granularity)


class PeerKVBuffer:
    """vLLM's ``ExtensibleTensor`` interface over a :class:`VllmKVCache` whose region every PCP
    rank maps. Segment ``i`` holds blocks of stride ``strides[i]``; its committed prefix is
    always ``committed_blocks * strides[i]`` bytes (vmmkv commits blocks ``[0, n)`` of every
    segment together, as vLLM's ``ExtensibleKVCache.commit`` asks)."""

    def __init__(self, cache: Any, offsets: Sequence[int], capacities: Sequence[int],
                 strides: Sequence[int]) -> None:  # fmt: skip
        self.cache = cache
        self._offsets, self._capacities = list(offsets), list(capacities)
        self._strides = list(strides)
        self._device = torch.device(cache.cache.device)
        self._closed = False
        # vLLM released the memory (sleep, discard, lending) and has not committed since
        self.released = False
        # elastic mode: the blocks vLLM's extend_kv_cache committed (the scheduler's capacity)
        self.budget: int | None = None

    # -- what vLLM uses ------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def granularity(self) -> int:
        # The unit a commit rounds each segment to (the region's chunk: the driver's granule
        # unless VMMKV_CHUNK_MIB), which vLLM's physical_bytes_for rounds every segment up to:
        # vLLM sizes the cache after capture by what vmmkv maps.
        return int(self.cache.cache.region.chunk_bytes)

    @property
    def physical_bytes(self) -> int:
        """The own replica's mapped bytes (its runs; peers' not counted)."""
        return 0 if self._closed else int(self.cache.cache.committed_bytes)

    def full_view(self) -> torch.Tensor:
        """The uint8 tensor over the whole reservation (vLLM's backing size)."""
        self._check_open("full_view")
        return self.cache.buffer.view(torch.uint8)  # vLLM's ExtensibleTensor views are uint8

    def segment_view(self, index: int) -> torch.Tensor:
        """The uint8 tensor over segment ``index``'s committed prefix, sized exactly to it."""
        self._check_open("segment_view")
        if not 0 <= index < len(self._offsets):
            raise IndexError(f"segment {index} out of range ({len(self._offsets)})")
        start = self._offsets[index]
        return self.cache.buffer.view(torch.uint8)[start : start + self._committed(index)]

    def resize_segments_(self, sizes: Sequence[int], zero_new: bool = False) -> None:
        """Collective: grow every segment to ``sizes`` bytes, which must be the same block
        count of every segment (vLLM's commit). The new blocks are always zeroed, in every
        replica before any rank returns (vLLM's own buffer zeroes them too: its ``commit``
        promises zeroed blocks); ``zero_new`` is accepted for vLLM's signature."""
        self._check_open("resize_segments_")
        n = self._blocks_of(sizes)
        if n < self.cache.committed_blocks:
            raise ValueError(
                f"rank {self.cache.rank}: resize_segments_ is grow-only: {n} blocks requested, "
                f"{self.cache.committed_blocks} committed"
            )
        self.cache.grow(n)
        self.released = False

    def release_physical(self) -> None:
        """Collective: every replica drops all its memory (peers unmapped first); addresses and
        views stay valid, and nothing may be written until the next commit."""
        self._check_open("release_physical")
        self.cache.shrink(0)
        self.released = True

    def segments_backed_by_one_chunk(self, sizes: Sequence[int]) -> list[bool]:
        """Whether each segment's first ``sizes[i]`` bytes lie inside one run of the own
        replica (one driver allocation), as vLLM's own buffer answers it (an RDMA registration
        of a segment needs one allocation). Local. vLLM asks it only to defragment for a KV
        connector, which the plugin refuses."""
        self._check_open("segments_backed_by_one_chunk")
        if len(sizes) != len(self._offsets):
            raise ValueError(
                f"rank {self.cache.rank}: segments_backed_by_one_chunk: expected "
                f"{len(self._offsets)} segment sizes, got {len(sizes)}"
            )
        region = self.cache.cache.region.region
        base = self.cache.buffer.data_ptr() - region.base_ptr
        runs = region.chunks()
        starts = [c.offset for c in runs]
        out = []
        for off, size in zip(self._offsets, sizes, strict=True):
            lo = base + off
            i = bisect.bisect_right(starts, lo) - 1
            out.append(i >= 0 and lo + size <= runs[i].offset + runs[i].size)
        return out

    def free(self) -> None:
        """Local, idempotent: close the cache (the views are invalid afterwards)."""
        if self._closed:
            return
        self._closed = True
        if _STATE.active is self.cache:
            close_active("vLLM frees its extensible KV cache")
        else:
            self.cache.close()

    # -- more of ExtensibleTensor, for tools and tests -----------------------------------------
    @property
    def segment_offsets(self) -> list[int]:
        return list(self._offsets)

    @property
    def segment_capacities(self) -> list[int]:
        return list(self._capacities)

    @property
    def num_segments(self) -> int:
        return len(self._offsets)

    @property
    def num_bytes(self) -> int:
        return sum(self._committed(i) for i in range(len(self._offsets)))

    # -- internals -----------------------------------------------------------------------------
    def _committed(self, index: int) -> int:
        return 0 if self._closed else self.cache.committed_blocks * self._strides[index]

    def _blocks_of(self, sizes: Sequence[int]) -> int:
        if len(sizes) != len(self._strides):
            raise ValueError(f"expected {len(self._strides)} segment sizes, got {len(sizes)}")
        counts = {
            s // st if s % st == 0 else -1 for s, st in zip(sizes, self._strides, strict=True)
        }
        n = counts.pop() if len(counts) == 1 else -1
        if n < 0 or n > self.cache.num_blocks:
            raise ValueError(
                f"rank {self.cache.rank}: segment sizes {list(sizes)} are not one block count "
                f"(<= {self.cache.num_blocks}) of the segments' block strides {self._strides}"
            )
        return n

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"rank {self.cache.rank}: {what} on a freed vmmkv KV buffer")
