"""The replica each worker of the engine harness must hold, built without vmmkv, and the checks
against it at every step.

:class:`Reference` keeps a plain host buffer of the KV cache's size and replays into it what
vLLM's unpatched path would write: each layer's rows through vLLM's own PCP gather
(``vllm.v1.attention.ops.pcp._gather_prefill_cache_inputs``, the function the plugin's sites
replace, over the same gloo PCP group) and vmmkv's pure-torch reference writer
(``vmmkv.ops.reference``, proven byte-equal to vLLM's CUDA kernels on the GPU), with the kinds
the installed vLLM writes. What else changes a replica's bytes is applied from vLLM's own
records: the blocks each ``SchedulerOutput`` tells the workers to zero
(``new_block_ids_to_zero``) and to copy (``kv_cache_block_copies``), read before the step runs;
and fresh memory reads zero: wherever the kernel shows a different mapping than at the last
check (a page unmapped, or mapped from another memfd: vmmkv released and committed it again),
the reference is zeroed too (the kernel's ``/proc/self/maps`` tells what is mapped, not
vmmkv's books); and blocks that join vmmkv's committed set read zero, also where their chunk
stayed mapped (vmmkv's contract, docs/design.md "Resize protocol"), so the reference zeroes every
block that joined since its last look.

:meth:`Reference.check` (after every forward, and on demand through ``collective_rpc``) is
collective over the PCP group (a barrier before and after, so no peer publishes meanwhile) and
records, never raises:

- every byte of every block in vmmkv's committed set equal to the reference, every other mapped
  byte equal to it or zero (the first differing step, layer region and count are kept);
- under vLLM's extensible KV cache, vLLM's ``num_committed_blocks`` equal to the blocks vmmkv
  holds committed (unless vLLM holds the memory released);
- every block of every live request inside the mapped memory of every layer.

Local state of one worker process; not thread-safe (vLLM's worker runs one step at a time).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

__all__ = ["Reference", "cache_memory", "mapped_memfds", "open_memfds"]

PAGE = 4096


def mapped_memfds() -> list[tuple[int, int, int]]:
    """(start, end, inode) of every memfd mapping of this process (vmmkv's host chunks)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "memfd:" in line:
                fields = line.split()
                a, b = (int(x, 16) for x in fields[0].split("-"))
                out.append((a, b, int(fields[4])))
    return out


def open_memfds() -> list[int]:
    """The inode of every memfd this process holds open."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:"):
                out.append(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except OSError:
            pass
    return out


def cache_memory(cache: Any) -> dict[str, int]:
    """What the kernel shows of vmmkv's memory in this process: memfd bytes mapped in the KV
    regions (own and peers'), in the barrier's signal regions (one granule per rank, kept for
    the cache's life), elsewhere (none expected), and the memfds held open that are not the
    signal regions' (the host backend keeps one per committed own chunk)."""
    peers = cache.cache.region.peers
    capacity = cache.cache.region.capacity_bytes
    kv = [(p, p + capacity) for p in peers.ptrs]
    signal = [(p, p + peers.signal_bytes) for p in peers.signal_ptrs]
    out = {"kv_mapped": 0, "signal_mapped": 0, "other_mapped": 0}
    signal_inodes = set()
    for a, b, inode in mapped_memfds():
        if any(lo <= a and b <= hi for lo, hi in kv):
            out["kv_mapped"] += b - a
        elif any(lo <= a and b <= hi for lo, hi in signal):
            out["signal_mapped"] += b - a
            signal_inodes.add(inode)
        else:
            out["other_mapped"] += b - a
    out["kv_memfds"] = sum(1 for i in open_memfds() if i not in signal_inodes)
    return out


class Reference:
    """The expected replica of this worker (module docstring). ``runner`` is vLLM's model
    runner, ``model`` the harness model (its layer views are vLLM's bound views)."""

    def __init__(self, runner: Any, model: Any) -> None:
        self.runner, self.model = runner, model
        self.steps = 0
        self.checks = 0
        self.peak = 0  # the most blocks vmmkv held committed at a check
        self.mismatch: list[str] = []  # the first few failed checks, with their step
        self.live: dict[str, set[int]] = {}
        self._plain: torch.Tensor | None = None
        self._base = 0
        self._pages: np.ndarray | None = None  # inode per page at the last check (0: unmapped)
        self._held: Any = None  # vmmkv's committed block set at the last check

    # -- what vLLM records -----------------------------------------------------------------------
    def observe(self, so: Any) -> None:
        """A ``SchedulerOutput`` before the worker runs it: vLLM's zeroing and block copies,
        and the blocks each live request holds."""
        self.steps += 1
        for r in so.scheduled_new_reqs:
            self.live[r.req_id] = {b for g in r.block_ids for b in g}
        cached = so.scheduled_cached_reqs
        for req_id, new in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if new:
                self.live.setdefault(req_id, set()).update(b for g in new for b in g)
        for req_id in set(so.finished_req_ids) | set(so.preempted_req_ids or ()):
            self.live.pop(req_id, None)
        if self._plain is None or not self._ready():
            return
        self._sync_mappings()
        for b in so.new_block_ids_to_zero or ():
            for view in self._views():
                view[b].zero_()
        for src, dst in so.kv_cache_block_copies or ():
            for view in self._views():
                view[dst].copy_(view[src])

    def after_forward(self, writes: list[Any]) -> None:
        """The forward's KV writes, replayed through vLLM's gather and the reference writer;
        then :meth:`check`."""
        from vllm.v1.attention.ops import pcp as vllm_pcp

        from ...ops import reference as ref

        if not self._ready():
            return
        self._sync_mappings()  # a resize at the top of this step (update_requests) came first
        kinds = self._kinds()
        for family, view, inputs, slots, num_decode in writes:
            gathered, cache_slots = vllm_pcp._gather_prefill_cache_inputs(
                inputs, slots, num_decode, self.model.shard
            )
            target = self._ref_view(view)
            if family == "indexer":
                ref.insert_indexer_k(target, gathered[0], cache_slots, kind=kinds["indexer"])
            else:
                ref.insert_ds_mla(target, *gathered, cache_slots, kind=kinds["mla"])
        self.check(f"step {self.steps}")

    # -- the check -------------------------------------------------------------------------------
    def check(self, when: str) -> None:
        """Collective over the PCP group: the three checks of the module docstring."""
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_pcp_group

        group = get_pcp_group().cpu_group
        dist.barrier(group=group)
        try:
            if self._ready():
                self.checks += 1
                self.peak = max(self.peak, self._cache().committed_blocks)
                self._sync_mappings()
                self._compare(when)
                self._committed_count(when)
                self._live_blocks(when)
        finally:
            dist.barrier(group=group)

    def _fail(self, when: str, what: str) -> None:
        if len(self.mismatch) < 8:
            self.mismatch.append(f"{when}: {what}")

    def _sync_mappings(self) -> None:
        from ... import _blockset as blockset

        pages = self._current_pages()
        changed = np.nonzero(pages != self._pages)[0]
        plain = self._plain
        for start, end in _runs(changed):
            plain[start * PAGE : end * PAGE].zero_()
        self._pages = pages
        held = self._cache().committed_block_set
        if self._held is not None:
            for lo, hi in blockset.difference(held, self._held):
                for view in self._views():
                    view[lo:hi].zero_()
        self._held = held

    def _compare(self, when: str) -> None:
        """The bytes of every block in vmmkv's committed set equal the reference; the other
        mapped bytes (a chunk's part beyond the committed blocks, holes) equal it or read
        zero: nothing may write there, but a grow zeroes its blocks in chunks that stayed
        mapped before it commits them, and a refused grow leaves them zero."""
        got = self._cache().buffer.view(torch.uint8)
        ref = self._plain
        committed = torch.zeros(ref.numel(), dtype=torch.bool)
        for view in self._cache_views():
            blocks = self._strided(committed, view)
            for lo, hi in self._held:
                blocks[lo:hi] = True
        for start, end in _runs(np.nonzero(self._pages)[0]):
            lo, hi = start * PAGE, end * PAGE
            diff = got[lo:hi] != ref[lo:hi]
            diff &= committed[lo:hi] | (got[lo:hi] != 0)
            if bool(diff.any()):
                first = lo + int(torch.nonzero(diff)[0])
                self._fail(when, f"{int(diff.sum())} bytes differ in [{lo}, {hi}), first at "
                           f"{first} ({self._where(first)}): replica "
                           f"{got[first:first + 8].tolist()}, reference "
                           f"{ref[first:first + 8].tolist()}")  # fmt: skip

    def _committed_count(self, when: str) -> None:
        ext = getattr(self.runner, "extensible_kv_cache", None)
        if ext is None or not hasattr(ext.buffer, "cache") or ext.buffer.released:
            return
        held = ext.buffer.cache.committed_blocks
        if ext.num_committed_blocks != held:
            self._fail(when, f"vLLM counts {ext.num_committed_blocks} committed blocks, vmmkv "
                       f"holds {held}")  # fmt: skip

    def _live_blocks(self, when: str) -> None:
        blocks = sorted(set().union(*self.live.values())) if self.live else []
        unmapped = [b for b in blocks if not self._block_mapped(b)]
        if unmapped:
            self._fail(when, f"live requests use blocks {unmapped[:10]} that are not mapped "
                       f"(of {len(blocks)} in use)")  # fmt: skip

    def _block_mapped(self, b: int) -> bool:
        for view in self._cache_views():
            lo = view.data_ptr() - self._base + b * view.stride(0) * view.element_size()
            span = view[0].numel() * view.element_size()
            first, last = lo // PAGE, (lo + span - 1) // PAGE
            if last >= self._pages.size:
                return False
            if not self._pages[first : last + 1].all():
                return False
        return True

    # -- internals -------------------------------------------------------------------------------
    def _cache(self) -> Any:
        from vmmkv.integrations.vllm import active_cache

        return active_cache()

    def _ready(self) -> bool:
        """The plain buffer exists once vmmkv's cache does (allocated at its first sight)."""
        cache = self._cache()
        if cache is None:
            return False
        base = cache.buffer.data_ptr()
        if self._plain is None or base != self._base:
            size = cache.buffer.numel() * cache.buffer.element_size()
            with torch.inference_mode(False):  # updated in steps and in RPCs alike
                self._plain = torch.zeros(size, dtype=torch.uint8)
            self._base = base
            self._pages = np.zeros(-(-size // PAGE), dtype=np.int64)
            self._held = None
        return True

    def _current_pages(self) -> np.ndarray:
        pages = np.zeros_like(self._pages)
        size = self._plain.numel()
        for a, b, inode in mapped_memfds():
            lo, hi = max(a - self._base, 0), min(b - self._base, size)
            if lo < hi:
                pages[lo // PAGE : -(-hi // PAGE)] = inode
        return pages

    def _cache_views(self) -> list[torch.Tensor]:
        model = self.model
        return [m.kv_cache for m in (*model.indexers, *model.mla) if m.kv_cache.numel()]

    def _views(self) -> list[torch.Tensor]:
        """The reference's view of every layer view vLLM bound."""
        return [self._ref_view(v) for v in self._cache_views()]

    def _ref_view(self, view: torch.Tensor) -> torch.Tensor:
        return self._strided(self._plain, view)

    def _strided(self, buffer: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
        """``view``'s geometry over ``buffer`` (the reference, or a mask of it), with every
        block of the reserved capacity: vLLM zeroes and copies by block id, whatever size its
        views have at that moment (the extensible cache's grow with its commits)."""
        if view.dtype != torch.uint8:
            raise TypeError(f"the harness expects uint8 KV views, got {view.dtype}")
        offset = view.data_ptr() - self._base
        shape = (self.runner.kv_cache_config.num_blocks, *view.shape[1:])
        return buffer.as_strided(shape, view.stride(), offset)

    def _where(self, offset: int) -> str:
        for name, view in zip(("indexer", "mla"), (self.model.indexers, self.model.mla),
                              strict=True):  # fmt: skip
            for i, layer in enumerate(view):
                kv = layer.kv_cache
                lo = kv.data_ptr() - self._base
                if lo <= offset < lo + kv.stride(0) * kv.shape[0]:
                    return f"{name} layer {i}, block {(offset - lo) // kv.stride(0)}"
        return "outside every layer view"

    def _kinds(self) -> dict[str, str]:
        import vllm
        from vllm.utils.deep_gemm import mqa_logits_use_mx_scales

        from ...ops.formats import mla_kind_for

        indexer = "indexer_k_mxfp8" if mqa_logits_use_mx_scales() else "indexer_k"
        return {"mla": mla_kind_for(vllm.__version__), "indexer": indexer}

    def state(self) -> dict[str, Any]:
        return {"steps": self.steps, "checks": self.checks, "mismatch": list(self.mismatch),
                "live_requests": len(self.live), "peak": self.peak}  # fmt: skip


def _runs(indices: np.ndarray) -> list[tuple[int, int]]:
    """Sorted indices as half-open runs [start, end)."""
    if indices.size == 0:
        return []
    breaks = np.nonzero(np.diff(indices) != 1)[0]
    starts = np.concatenate(([indices[0]], indices[breaks + 1]))
    ends = np.concatenate((indices[breaks] + 1, [indices[-1] + 1]))
    return list(zip(starts.tolist(), ends.tolist(), strict=True))
