"""vLLM 0.34's extensible KV cache with vmmkv as its physical layer (PCP > 1): the buffer, and the
chunk it commits in.

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

The chunk (the unit a commit maps, :attr:`PeerKVBuffer.granularity`, which vLLM's sizing after
capture rounds every segment up to) is chosen here: :func:`_chunk_bytes` under vLLM's extensible
cache, :func:`elastic_chunk_bytes` in elastic mode; ``VMMKV_CHUNK_MIB`` comes first in both
(:func:`_chunk_bytes_from_env`, also ``VllmKVCache``'s default).

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


def _chunk_bytes(device: Any, size: int, layout: Any) -> int:
    """``VMMKV_CHUNK_MIB``; else, under a block-major layout (one segment),
    ``ELASTIC_CHUNK_MIB`` (64 MiB) clamped to the range; else the allocation granularity.

    vLLM sizes the cache after capture from its estimate of a commit's physical bytes, each
    segment rounded up to the buffer's ``granularity``, which is this chunk: so what vLLM
    budgets is what vmmkv maps, and a large chunk costs at most one chunk per segment of the
    budget. Under a layer-major layout that is one per layer region (122 under DeepSeek-V3.2),
    so those keep the granule. A commit's time is per chunk (an extend of ~25 GiB: 5.4 s in
    2 MiB chunks at 2 ranks sharing an H200, BENCHMARKS.md "vLLM 0.34's extensible cache"),
    which is why the one-segment layouts take large ones."""
    from ..._util import round_up
    from ...alloc.region import make_backend

    gran = make_backend(device, "auto").granularity
    env = _chunk_bytes_from_env(gran, round_up(size, gran))
    if env:
        return env
    if layout.is_block_outermost:
        return min(round_up(ELASTIC_CHUNK_MIB << 20, gran), round_up(size, gran))
    return gran


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
        # The unit a commit maps: vLLM's physical_bytes_for rounds every segment up to it,
        # so vLLM sizes the cache after capture by what vmmkv maps (the region's chunk, a
        # multiple of the driver's granule), not by the granule.
        return int(self.cache.cache.region.chunk_bytes)

    @property
    def physical_bytes(self) -> int:
        """The own replica's committed bytes, chunk rounding included (peers' not counted)."""
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
        # vLLM asks only to defragment for a connector that registers the KV cache for RDMA,
        # and vmmkv refuses every KV-transfer connector before this buffer exists.
        raise NotImplementedError(
            "vmmkv's KV cache is not laid out for RDMA registration (KV-transfer connectors "
            "are refused under VLLM_USE_VMMKV=1)"
        )

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
