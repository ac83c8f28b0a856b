"""Elastic KV end to end over PCP ranks on the CPU: vLLM 0.34.0's scheduler in the engine-core
role, every ``SchedulerOutput`` delivered to every rank, each rank running the plugin's worker
path on a real ``VllmKVCache`` (host backend, spawned ranks, vLLM's own process groups on gloo).

What runs through vLLM's own code:

- **Scheduler**: vLLM's ``AsyncScheduler`` (a batch queue of 2: step k+1 is scheduled before step
  k's output is processed) and its ``Scheduler``, with ``KVCacheManager``, ``BlockPool``, prefix
  caching and chunked prefill, built by ``trace.TraceRun`` (the ``"ranks"`` trace: a burst,
  steady arrivals, a drain, idle releases with arrivals right after them) in rank 0's process
  (the output rank) with the plugin's engine sites installed (``_install.install_engine``: the
  elastic pool comes from the patched ``Scheduler.__init__``).
- **Delivery**: each ``SchedulerOutput`` is pickled and broadcast (``broadcast_object_list`` on
  the PCP group's gloo group); every rank, rank 0 included, works on the unpickled copy, as
  vLLM's one broadcast queue delivers it to every worker identically and in order. Rank 0's
  ``WORKER.stamp`` goes back on the ``ModelRunnerOutput`` the scheduler processes.
- **Allocation**: the patched ``vllm.v1.worker.gpu.attn_utils.allocate_kv_cache`` with
  ``VLLM_VMMKV_ELASTIC=1`` (BLNHC, the floor committed, the elastic chunk from
  ``VMMKV_CHUNK_MIB``), the KV-cache config planned by vLLM's ``get_kv_cache_configs``.
- **Worker step**, in MRV2's order (``finish_requests``, ``add_requests``, ``update_requests``):
  per-request block tables kept as MRV2 keeps them (new requests' ``block_ids``, cached
  requests' ``new_block_ids``, finished and preempted requests dropped, resumed ones arriving as
  new requests); ``_elastic_worker.on_update_requests`` (the resize, the block-id check); vLLM's
  real ``KVBlockZeroer.zero_block_ids`` through the patched site; then every scheduled token's
  KV rows (random non-zero bf16, seeded per step and layer) split across ranks by vLLM's MRV2
  ``PCPManager`` and written through vLLM's cache-write call sites
  (``tests.test_vllm_pcp._call_sites``).
- **Idle release**: ``TraceRun``'s idle hook broadcasts the pool's resize request; every rank
  runs ``_elastic_worker.worker_resize`` (the body of the engine's ``collective_rpc``).
- **Sleep and wake** at the second idle release: the scheduler's ``reset_prefix_cache`` (what
  ``EngineCore.sleep`` does first), then on every rank the plugin's ``VmmkvSleepModeBackend``
  ``suspend(())`` and ``resume()`` around vLLM's own ``CuMemBackend``.

Stood in for, and why:

- vLLM's Triton zeroing kernel (no Triton on the CPU): a host memset of exactly the segments
  vLLM's ``KVBlockZeroer`` computed (``tests.test_vllm_zero_grow._HostZeroKernel``).
- ``CuMemAllocator`` behind vLLM's ``CuMemBackend`` (CUDA only): a recording stand-in
  (``tests.test_vllm_sleep._RecordingAllocator``).
- The model: no forward; the scheduler samples one fixed token per request (``TraceRun``).
- Zeroing of new blocks: vLLM zeroes them for Mamba or mixed-precision caches, which
  DeepSeek-V3.2's MLA + indexer pair is (``KVCacheConfig.needs_kv_cache_zeroing``, on by
  default); the async run keeps it on, the sync run turns it off while the scheduler is built
  (handed-out blocks keep their old bytes, as for a cache of one precision).
- A refused grow: rank 1's host backend fails its second chunk creation during its second grow
  (an out-of-memory at commit, as ``tests/test_segments.py`` injects it).

Expected bytes: a plain allocation of the same config (``vllm.v1.worker.utils``), poisoned like
the cache, written by vLLM's unpatched gather and the reference insert
(``tests.test_vllm_pcp._vllm_reference``), zeroed where vLLM zeroes, where a grow zeroes (the
newly committed blocks) and at a wake. After every step, on every rank: the committed blocks
equal it byte for byte, no row was skipped as out of range, every tracked block id is committed,
and (step, resize sequence, committed blocks, the own chunk set, each peer's mapped chunk set)
agree over the ranks (``all_gather_object``), each rank mapping exactly its peers' chunks.

Zeroing, on every rank: every chunk the cache creates after the start holds random non-zero
bytes first (device memory has no promised contents; the host backend's memfds are zero), and
the blocks that join the committed set (a grow, a refilled hole, a wake) read zero in the own
replica before vLLM's zeroing and any store; every block id vLLM sends to zero is committed;
with vLLM's zeroing on, every block a step adds to a table that is not a prefix hit is in that
step's zero list; no prefix hit lands on a block that joined the set and was not written since.

Not covered: vLLM's copy-on-write block copies (``kv_cache_block_copies``): vLLM makes them only
for partial prefix hits, which need Mamba "align" groups (never for this MLA model; the harness
asserts none arrive); speculative-decoding rows (no drafter runs here).
"""

from __future__ import annotations

import pytest

from tests.helpers import vllm_marks
from vmmkv.testing.spawn import run_world, world_store

pytestmark = vllm_marks()

BS, LAYERS, NUM_BLOCKS = 64, 2, 128
TOKENS, SEQS = 256, 16  # max_num_batched_tokens (prompts up to 1300: chunked), max_num_seqs
KNOBS = {
    # as a deployment sets them: elastic mode needs the plugin on (vLLM's plugin loader, in any
    # process it starts, refuses VLLM_VMMKV_ELASTIC=1 alone)
    "VLLM_USE_VMMKV": "1",
    "VLLM_VMMKV_ELASTIC": "1",
    "VMMKV_CHUNK_MIB": "0.5",  # 5 blocks of 100,864 B (2 layers) per chunk: the quantum
    "VMMKV_ELASTIC_WATERMARK_BLOCKS": "16",
    "VMMKV_ELASTIC_FLOOR_BLOCKS": "32",  # rounded up to the quantum: 35
    "VMMKV_ELASTIC_RELEASE_STEPS": "4",
    "VMMKV_ELASTIC_CALM_S": "0.12",  # 4 of the trace's 0.03 s steps
    "VMMKV_ELASTIC_CACHED_BLOCKS": "32",
}
FAIL_RANK, FAIL_GROW = 1, 2  # rank 1's 2nd grow fails at its commit
SLEEP_AT = 2  # sleep and wake at the 2nd idle release
LATE = (3, 0.03)  # at four ranks, rank 3 reads its replica 30 ms late in every check
# (name, async depth, vLLM's zeroing on, the grow rank FAIL_RANK fails or None, sleep at)
ASYNC = ("async", 2, True, FAIL_GROW, SLEEP_AT)
SYNC = ("sync", 1, False, None, SLEEP_AT)


def _digest(x) -> str:
    import hashlib

    return hashlib.blake2b(repr(x).encode(), digest_size=8).hexdigest()


def _held(vc):
    """The committed blocks as a stamp reports them: an int while a prefix, else the set."""
    from vmmkv import _blockset as blockset

    held = vc.committed_block_set
    n = blockset.as_prefix(held)
    return held if n is None else n


def _blocks(flat, vc, lo, hi):
    """Blocks ``[lo, hi)`` of every segment of the byte tensor ``flat`` laid out as the cache's
    backing buffer."""
    base = vc.buffer.data_ptr() - vc.cache.region.base_ptr
    return [flat[o - base + lo * bb : o - base + hi * bb] for o, bb in vc.segments]


class _Rank:
    """One PCP rank's worker side: the cache, the reference, MRV2's per-request state."""

    read_delay_s = 0.0  # a rank that reads its replica late: it sleeps this long first

    def __init__(self, ps, vc, views, plain, want, zeroer, cfg, fail_grow):
        import torch

        self.pcp = ps.get_pcp_group()
        self.group, self.rank = self.pcp.cpu_group, self.pcp.rank_in_group
        self.world = self.pcp.world_size
        self.vc, self.views, self.plain, self.want, self.zeroer = vc, views, plain, want, zeroer
        self.got = vc.buffer.view(torch.uint8)
        self.shard = cfg.parallel_config.pcp_shard_decode_requests
        self.tables: dict[str, list[int]] = {}  # MRV2's block tables, per request
        self.prefill_len: dict[str, int] = {}
        self.computed: dict[str, int] = {}
        self.fail_grow, self.grows = fail_grow, 0
        self.zeroed = 0  # block ids vLLM's zeroer zeroed
        self.vllm_zeroes = False  # the scheduler sends new blocks to zero
        self.stale: set[int] = set()  # blocks that joined the committed set, unwritten since
        self.records: list[tuple] = []  # per step: what every rank must agree on, and checks
        self.problems: list[str] = []
        self.events: dict[str, object] = {}

    # -- collectives -----------------------------------------------------------------------
    def broadcast(self, msg=None):
        import torch.distributed as dist

        box = [msg]
        dist.broadcast_object_list(box, src=self.pcp.ranks[0], group=self.group)
        return box[0]

    def gather(self, obj) -> list:
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    # -- the state every rank must agree on ------------------------------------------------
    def agree(self, what: str, head: tuple) -> None:
        """``head`` (step, seq, committed, ...) and the chunk sets equal on every rank; each
        rank maps exactly the chunks its peers committed; the replica equals the reference.

        The replica is read before the gather: a peer leaves the gather into its next step,
        whose direct stores write into this replica with no collective in between (the cache
        barrier after a store orders the stores of one step, not this rank's reading of the
        step before), so the gather is what holds every peer's next stores back until every
        rank has read its replica."""
        from tests.test_vllm_scale import _mapped

        same = self.equal()
        m = _mapped(self.vc)
        peers = [r for r in range(self.world) if r != self.rank]
        mine = (
            head,
            _digest(m["own"]),
            {q: _digest(c) for q, c in zip(peers, m["peers"], strict=True)},
        )
        every = self.gather(mine)
        if any(h != head for h, _, _ in every):
            self.problems.append(f"{what}: ranks disagree: {[h for h, _, _ in every]}")
        owns = [own for _, own, _ in every]
        if len(set(owns)) != 1:
            self.problems.append(f"{what}: own chunk sets differ over the ranks: {owns}")
        for q, d in mine[2].items():
            if d != owns[q]:
                self.problems.append(f"{what}: rank {self.rank} maps rank {q}'s chunks wrongly")
        if not same:
            self.problems.append(f"{what}: rank {self.rank}'s committed blocks differ")

    def equal(self) -> bool:
        import time

        import torch

        time.sleep(self.read_delay_s)
        for lo, hi in self.vc.committed_block_set:  # holes have no memory to compare
            pairs = zip(
                _blocks(self.got, self.vc, lo, hi), _blocks(self.want, self.vc, lo, hi),
                strict=True,
            )  # fmt: skip
            if not all(torch.equal(a, b) for a, b in pairs):
                return False
        return True

    # -- one step ----------------------------------------------------------------------------
    def step(self, n: int, blob: bytes) -> tuple:
        """Step ``n``: the pickled ``SchedulerOutput`` as every worker receives it."""
        import pickle

        from vmmkv import _blockset as blockset
        from vmmkv.integrations.vllm import _elastic_worker as worker_side
        from vmmkv.integrations.vllm._elastic_settings import RESIZE

        so = pickle.loads(blob)
        vc, WORKER = self.vc, worker_side.WORKER
        # MRV2 finish_requests: finished and preempted requests leave the batch
        for rid in set(so.finished_req_ids) | set(so.preempted_req_ids or ()):
            for d in (self.tables, self.prefill_len, self.computed):
                d.pop(rid, None)
        # add_requests (vLLM sends resumed requests as new ones, with every block id: its
        # CachedRequestData has no resumed field)
        for r in so.scheduled_new_reqs:
            (ids,) = r.block_ids
            self.tables[r.req_id] = list(ids)
            self.prefill_len[r.req_id] = len(r.prefill_token_ids)
            self.computed[r.req_id] = r.num_computed_tokens
        # update_requests, as patched: the resize and the block-id check first
        seq, target = getattr(so, RESIZE)
        before, held = _held(vc), vc.committed_block_set
        growing = seq > WORKER.seq and not blockset.is_subset(blockset.as_set(target), held)
        undo = self._arm_failure() if growing and self._next_grow_fails() else None
        try:
            worker_side.on_update_requests(vc, so)
        finally:
            if undo is not None:
                undo()
        after = _held(vc)
        # no peer writes them yet: the pool hands them out once the stamp confirms the grow
        self.joined(f"step {n}", blockset.difference(vc.committed_block_set, held))
        if undo is not None:
            self.events["refused"] = (n, seq, target, before, after, WORKER.error)
        hits, fresh = self._new_blocks(so)
        cached = so.scheduled_cached_reqs
        for rid, nct, new in zip(
            cached.req_ids, cached.num_computed_tokens, cached.new_block_ids, strict=True
        ):
            self.computed[rid] = nct
            if new is not None:
                (ids,) = new
                self.tables[rid] += ids
        zero = list(so.new_block_ids_to_zero or ())
        if self.vllm_zeroes and not fresh <= set(zero):
            self.problems.append(f"step {n}: new blocks {sorted(fresh - set(zero))} not zeroed")
        if zero:  # vLLM's zeroer through the patched site
            out = [i for i in zero if not blockset.contains(vc.committed_block_set, i)]
            if out:
                self.problems.append(f"step {n}: vLLM zeroes blocks {out} not committed")
            self.zeroed += len(zero)
            self.zeroer.zero_block_ids(zero)
            for v in self.plain.values():
                v[zero] = 0
        if so.kv_cache_block_copies:
            raise AssertionError("vLLM sent copy-on-write block copies; not modelled here")
        oor = vc.stats()["out_of_range_slots"]
        if so.total_num_scheduled_tokens:
            self.stale -= self._store(n, so)
        if hits & self.stale:  # recommitted memory read as cached KV
            self.problems.append(f"step {n}: prefix hits on unwritten blocks {hits & self.stale}")
        highest = max((max(t) for t in self.tables.values() if t), default=0)
        held = vc.committed_block_set
        bad = [i for t in self.tables.values() for i in t if not blockset.contains(held, i)]
        if bad:
            self.problems.append(f"step {n}: blocks {bad[:8]} not committed ({held})")
        skipped = vc.stats()["out_of_range_slots"] - oor
        if skipped:
            self.problems.append(f"step {n}: {skipped} rows skipped as out of range")
        stamp = WORKER.stamp(vc)
        head = (n, stamp[0], stamp[1], stamp[2] is not None)
        self.agree(f"step {n}", head)
        self.records.append((*head, highest, so.total_num_scheduled_tokens))
        return stamp

    def joined(self, what: str, added) -> None:
        """The blocks ``added`` joined the committed set (a grow, a hole refilled, a wake): they
        read zero in this replica before vLLM's zeroing and any store, and stay stale (no
        kernel may read them as cached KV) until a store writes them."""
        for lo, hi in added:
            if any(bool(b.any()) for b in _blocks(self.got, self.vc, lo, hi)):
                self.problems.append(f"{what}: blocks [{lo}, {hi}) joined the set non-zero")
            for b in _blocks(self.want, self.vc, lo, hi):
                b.zero_()
            self.stale.update(range(lo, hi))

    @staticmethod
    def _new_blocks(so) -> tuple[set[int], set[int]]:
        """The block ids ``so`` adds to the batch's tables: prefix hits (a new request's first
        blocks, up to its computed tokens) and the rest (newly allocated)."""
        hits, fresh = set(), set()
        for r in so.scheduled_new_reqs:
            (ids,) = r.block_ids
            k = -(-r.num_computed_tokens // BS)
            hits.update(ids[:k])
            fresh.update(ids[k:])
        for new in so.scheduled_cached_reqs.new_block_ids:
            if new is not None:
                fresh.update(new[0])
        return hits, fresh

    def _next_grow_fails(self) -> bool:
        self.grows += 1
        return self.rank == FAIL_RANK and self.grows == self.fail_grow

    def _arm_failure(self):
        """This rank's next grow fails at its commit: the second chunk it creates raises an
        out-of-memory (after one chunk was created: the rollback decommits it)."""
        from vmmkv.alloc.host import HostError

        backend = self.vc.cache.region.region._backend
        real, calls = backend.create, [0]

        def create(size):
            calls[0] += 1
            if calls[0] == 2:
                raise HostError(12, "injected out of memory")
            return real(size)

        backend.create = create
        return lambda: setattr(backend, "create", real)

    def _store(self, n: int, so) -> set[int]:
        """Every scheduled token's rows, split by vLLM's PCPManager, through vLLM's call sites;
        the reference through vLLM's unpatched gather. Returns the blocks written."""
        import numpy as np
        import torch
        from vllm.v1.worker.gpu import pcp_manager as pm

        from tests.test_vllm_pcp import _bf16, _call_sites, _vllm_reference

        reqs = list(so.num_scheduled_tokens)
        nst = np.array([so.num_scheduled_tokens[r] for r in reqs])
        computed = np.array([self.computed[r] for r in reqs])
        plen = np.array([self.prefill_len[r] for r in reqs])
        prefilling = np.minimum(computed, plen) < plen
        slots = []
        for r, c, q in zip(reqs, computed, nst, strict=True):
            table = self.tables[r]
            if (c + q - 1) // BS >= len(table):
                raise AssertionError(f"step {n}: {r} writes past its {len(table)} blocks")
            slots += [table[p // BS] * BS + p % BS for p in range(c, c + q)]
        m = pm.PCPManager(self.world, self.rank, torch.device("cpu"), self.shard)
        segments, per_rank = m._build_batch_layout(
            nst, computed, prefilling, np.concatenate([[0], np.cumsum(nst)])
        )
        padded = max(per_rank)
        mapping = m._convert_to_gathered_slot_mappings(
            torch.tensor(slots, dtype=torch.int64).view(1, -1)
        )[0].clone()
        idx = m._padded_gather_idx[self.rank * padded : (self.rank + 1) * padded]
        nd = sum(s.num_tokens for s in segments[self.rank]
                 if not prefilling[s.global_batch_req_idx])  # fmt: skip
        for layer in range(LAYERS):
            seed = 100_000 * (n + 1) + 10 * layer
            glob = [_bf16(seed + s, (len(slots), w)) for s, w in ((1, 512), (2, 64), (3, 128))]
            kv_c, k_pe, k = (t[idx] for t in glob)
            _call_sites(self.views, layer, kv_c, k_pe, k, mapping, nd, nd, self.shard, self.world)
            _vllm_reference(self.vc, self.plain, layer, kv_c, k_pe, k, mapping, nd, nd,
                            self.shard)  # fmt: skip
        return {s // BS for s in slots}

    # -- idle --------------------------------------------------------------------------------
    def idle(self, n: int, seq: int, target: int) -> tuple:
        """The idle release's ``collective_rpc`` body on this rank; then at the floor within a
        chunk, every peer's chunks mapped, the replica equal to the reference."""
        from vmmkv.integrations.vllm import _elastic_worker as worker_side

        stamp = worker_side.worker_resize(None, seq, target)
        stamps = self.gather(stamp)
        vc = self.vc
        bb = sum(b for _, b in vc.segments)
        self.events.setdefault("idle", []).append(
            {"step": n, "resize": (seq, target), "stamps": stamps,
             "blocks": vc.committed_blocks, "bytes": vc.cache.committed_bytes,
             "block_bytes": bb, "chunk": vc.cache.region.chunk_bytes}
        )  # fmt: skip
        self.agree(f"idle release at step {n}", (n, seq, vc.committed_blocks))
        return stamp

    def sleep(self, n: int) -> None:
        """The vmmkv sleep-mode backend.s suspend(()) and resume() around vLLM's CuMemBackend
        (its CUDA allocator recorded instead); the blocks come back zeroed."""
        import vllm.device_allocator as dalloc

        from tests.test_vllm_scale import _mapped
        from tests.test_vllm_sleep import _RecordingAllocator
        from vmmkv.integrations.vllm._sleep import VmmkvSleepModeBackend

        vc = self.vc
        rec, real = _RecordingAllocator(vc), dalloc.get_mem_allocator_instance
        dalloc.get_mem_allocator_instance = lambda: rec
        try:
            blocks, own = vc.committed_blocks, _mapped(vc)["own"]
            backend = VmmkvSleepModeBackend()
            backend.suspend(())
            asleep = {"blocks": vc.committed_blocks, **_mapped(vc)}
            backend.resume(None)
        finally:
            dalloc.get_mem_allocator_instance = real
        self.joined(f"wake at step {n}", vc.committed_block_set)
        self.events["sleep"] = {
            "step": n, "blocks": blocks, "asleep": asleep, "awake": vc.committed_blocks,
            "same_chunks": _mapped(vc)["own"] == own, "calls": rec.calls,
            "inner": type(backend.inner).__name__,
        }  # fmt: skip
        self.agree(f"wake at step {n}", (n, blocks, vc.committed_blocks))


def _poison(r: _Rank) -> None:
    """The plain allocation and the cache's committed blocks: the same non-zero bytes."""
    import torch

    size = r.want.numel()
    poison = torch.randint(1, 256, (size,), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(11))  # fmt: skip
    r.want.copy_(poison)
    c = r.vc.committed_blocks
    for a, b in zip(_blocks(r.got, r.vc, 0, c), _blocks(poison, r.vc, 0, c), strict=True):
        a.copy_(b)


def _dirty_new_chunks(vc) -> list[int]:
    """Every chunk the cache creates from now on starts with non-zero bytes, as device memory
    may (``cuMemCreate`` promises no contents; the host backend's memfds are zero). Returns the
    list the created chunks' sizes are appended to."""
    import os

    import torch

    backend = vc.cache.region.region._backend
    real, gen, sizes = backend.create, torch.Generator().manual_seed(13), []

    def create(size):
        fd = real(size)
        os.pwrite(fd, torch.randint(1, 256, (size,), dtype=torch.uint8, generator=gen).numpy(), 0)
        sizes.append(size)
        return fd

    backend.create = create
    return sizes


def _scheduler(world: int, async_depth: int, zeroing: bool):
    """``TraceRun`` of the "ranks" trace, its scheduler built through the patched
    ``Scheduler.__init__`` (vLLM's zeroing of new blocks on when ``zeroing``)."""
    from unittest import mock

    from vllm.v1.kv_cache_interface import KVCacheConfig

    from vmmkv.testing.vllm.trace import TraceRun

    run = TraceRun(trace="ranks", seed=0, num_blocks=NUM_BLOCKS, async_depth=async_depth,
                   world=world, layers=LAYERS, max_num_batched_tokens=TOKENS,
                   max_num_seqs=SEQS)  # fmt: skip
    post_init = KVCacheConfig.__post_init__

    def resolved(self):  # vLLM resolves the field here (on for these mixed-precision caches)
        post_init(self)
        self.needs_kv_cache_zeroing = zeroing

    with mock.patch.object(KVCacheConfig, "__post_init__", resolved):
        run.build()
    return run


def _scheduled(so) -> tuple:
    """What the scheduler handed out in ``so``: the highest block id the step adds, its new
    requests, the requests finished before it, and per new request whether its prefill is
    split (chunked: it does not reach the end of its prefill in this step)."""
    from vmmkv.integrations.vllm._elastic_worker import step_block_ids

    new = so.scheduled_new_reqs
    ends = [x.num_computed_tokens + so.num_scheduled_tokens[x.req_id] for x in new]
    return (
        max(step_block_ids(so), default=0),
        [x.req_id for x in new],
        sorted(so.finished_req_ids),
        [end < len(x.prefill_token_ids) for end, x in zip(ends, new, strict=True)],
    )


def _one_run(ps, world, spec, late=None):
    """One trace on every rank; returns this rank's records and events (rank 0: the
    scheduler's too). ``late``: (rank, seconds), a rank that reads its replica late."""
    import pickle
    import time

    import torch
    import torch.distributed as dist
    from vllm.config import set_current_vllm_config
    from vllm.utils import torch_utils
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker import utils as worker_utils
    from vllm.v1.worker.gpu import attn_utils

    from tests.test_vllm_pcp import _flat
    from tests.test_vllm_zero_grow import _HostZeroKernel, _zeroer
    from vmmkv.integrations import vllm as integration
    from vmmkv.integrations.vllm import _install
    from vmmkv.testing.vllm import configs

    name, async_depth, zeroing, fail_grow, sleep_at = spec
    cfg, config = configs.build_kv_cache_config("BLNHC", NUM_BLOCKS, LAYERS, pcp=world)
    sc = cfg.scheduler_config
    sc.max_num_batched_tokens, sc.max_num_seqs = TOKENS, SEQS
    sc.async_scheduling = async_depth > 1
    cpu, lay = torch.device("cpu"), KVCacheLayout.BLNHC
    real_kernel = worker_utils._zero_kv_blocks_kernel
    worker_utils._zero_kv_blocks_kernel = _HostZeroKernel()
    torch_utils.PIN_MEMORY = False  # no driver here (vLLM's CPU platform says False too)
    t0 = time.monotonic()
    try:
        with set_current_vllm_config(cfg), integration.patched():
            views = attn_utils.allocate_kv_cache(config, cpu, lay, [BS])
            vc = integration.active_cache()
            plain = worker_utils.allocate_kv_cache(config, cpu, lay, [BS])
            want = _flat(next(iter(plain.values())), config.kv_cache_tensors[0].size)
            r = _Rank(ps, vc, views, plain, want, _zeroer(config, views), cfg, fail_grow)
            r.vllm_zeroes = zeroing
            if late is not None and r.rank == late[0]:
                r.read_delay_s = late[1]
            r.events["dirty_chunks"] = _dirty_new_chunks(vc)
            r.events["start"] = {"blocks": vc.committed_blocks, "direct": vc.direct,
                                 "chunk": vc.cache.region.chunk_bytes}  # fmt: skip
            _poison(r)
            dist.barrier(group=r.group)  # every replica poisoned before any store
            if r.rank != 0:
                while (msg := r.broadcast()) != ("done",):
                    getattr(r, msg[0])(*msg[1:])
                r.events["zeroed"] = r.zeroed
                return {"records": r.records, "problems": r.problems, "events": r.events,
                        "seconds": time.monotonic() - t0}  # fmt: skip
            _install.install_engine()  # the engine core's sites, in the output rank's process
            run = _scheduler(world, async_depth, zeroing)
            el, sched = run.el, []

            def on_step(so):
                n = len(run.steps)
                sched.append((n, el.limit, el.counts["grows"], *_scheduled(so)))
                msg = ("step", n, pickle.dumps(so))
                r.broadcast(msg)
                return r.step(n, msg[2])

            def on_idle(resize):
                n = len(run.steps)
                msg = ("idle", n, *resize)
                r.broadcast(msg)
                stamp = r.idle(*msg[1:])
                if len(run.idle_releases) == sleep_at:
                    r.events["reset_prefix_cache"] = run.scheduler.reset_prefix_cache()
                    r.events["hashed_after_reset"] = sum(
                        b.block_hash is not None for b in run.pool.blocks
                    )
                    r.broadcast(("sleep", n))
                    r.sleep(n)
                return stamp

            try:
                run.run(on_step=on_step, on_idle=on_idle)
            finally:
                r.broadcast(("done",))
            r.events["scheduler"] = {
                "floor": el.s.floor, "quantum": el.s.quantum, "counts": dict(el.counts),
                "last_error": el.last_error, "hit_tokens": run.hit_tokens,
                "preemptions": run.preemptions, "idle_releases": run.idle_releases,
                "left": len(run.scheduler.requests), "steps": sched,
            }  # fmt: skip
            r.events["zeroed"] = r.zeroed
            return {"records": r.records, "problems": r.problems, "events": r.events,
                    "seconds": time.monotonic() - t0}  # fmt: skip
    finally:
        worker_utils._zero_kv_blocks_kernel = real_kernel


def _ranks(rank, world, port, specs, late=None):
    import torch.distributed as dist

    from vmmkv.testing.vllm import configs

    cfg = configs.vllm_config("BLNHC", NUM_BLOCKS, LAYERS, pcp=world)
    ps = configs.join_vllm_groups(cfg, rank, world, port)
    try:
        out = {spec[0]: _one_run(ps, world, spec, late) for spec in specs}
        # rank 0 hosts the store every group uses: it tears down only after every rank is done
        dist.barrier(group=ps.get_world_group().cpu_group)
    finally:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()
    return out


# -- the checks ----------------------------------------------------------------------------------


def _check(out, spec, world):
    name, async_depth, zeroing, fail_grow, sleep_at = spec
    runs = [o[name] for o in out]
    for rank, o in enumerate(runs):
        assert o["problems"] == [], (rank, o["problems"][:5])
    s = runs[0]["events"]["scheduler"]
    floor = s["floor"]
    # every rank recorded the same steps: (step, seq, committed, refused), then its checks
    heads = [[rec[:4] for rec in o["records"]] for o in runs]
    assert all(h == heads[0] for h in heads), "ranks saw different steps"
    assert len(heads[0]) == len(s["steps"]) > 100
    for o in runs:  # the floor committed at start, the elastic chunk, direct publication
        assert o["events"]["start"] == {"blocks": floor, "direct": True, "chunk": 512 << 10}
        assert (o["events"]["zeroed"] > 0) is zeroing, o["events"]["zeroed"]  # vLLM's zeroer
        assert o["events"]["dirty_chunks"]  # grows and wakes committed chunks that start dirty
    assert s["quantum"] == 5
    # the trace covered what it is meant to
    counts = s["counts"]
    assert counts["grows"] >= 5 and counts["releases"] >= 3, counts
    assert counts["cached_dropped"] > 0, counts
    # whole free chunks below the highest block in use released as holes, and steps run on
    # every rank with a committed set that is not a prefix
    assert counts["hole_blocks"] > 0, counts
    assert any(not isinstance(rec[2], int) for rec in runs[0]["records"]), counts
    assert s["hit_tokens"] > 0  # shared prefixes hit vLLM's prefix cache
    assert any(any(chunked) for *_, chunked in s["steps"])  # prefills split over steps
    assert s["preemptions"] > 0  # the tight pool preempts (and the requests come back)
    firsts = [rid for *_, new, _, _ in s["steps"] for rid in new]
    assert len(firsts) > len(set(firsts))  # preempted requests resumed as new requests
    finished = {rid for *_, done, _ in s["steps"] for rid in done}
    assert set(firsts) <= finished and s["left"] == 0  # every request completed
    _check_idle(runs, s, floor, world, sleep_at)
    if fail_grow is not None:
        _check_refused(runs, s)
    else:
        assert counts["refused"] == 0 and all(not rec[3] for rec in runs[0]["records"])


def _check_idle(runs, s, floor, world, sleep_at):
    releases = s["idle_releases"]
    assert len(releases) >= 2, releases
    for step in releases[:2]:
        # the requests of the trace arrive in the step right after each of the first releases
        new = [new for n, *_, new, _, _ in s["steps"] if n == step + 1]
        assert new and new[0], (step, s["steps"][:3])
    for o in runs:
        idle = o["events"]["idle"]
        assert [e["step"] for e in idle] == releases
        for e in idle:
            seq, target = e["resize"]
            assert target == floor  # nothing in use: down to the floor
            assert [st[:2] for st in e["stamps"]] == [(seq, target)] * world, e
            assert all(st[2] is None for st in e["stamps"]), e
            assert e["blocks"] == floor
            assert floor * e["block_bytes"] <= e["bytes"] < floor * e["block_bytes"] + e["chunk"]
        sl = o["events"]["sleep"]
        assert sl["step"] == releases[sleep_at - 1] and sl["inner"] == "CuMemBackend"
        assert sl["blocks"] == floor == sl["awake"] and sl["same_chunks"], sl
        assert sl["asleep"]["blocks"] == 0 and sl["asleep"]["own"] == [], sl["asleep"]
        assert sl["asleep"]["peers"] == [[]] * (world - 1), sl["asleep"]
        # vmmkv released before vLLM's inner backend slept, restored after it woke
        assert [c[0] for c in sl["calls"]] == ["sleep", "wake_up"] and all(
            c[2] == 0 for c in sl["calls"]
        ), sl["calls"]
    assert runs[0]["events"]["reset_prefix_cache"] is True
    assert runs[0]["events"]["hashed_after_reset"] == 0
    # after the wake the trace goes on: requests arrive, are written and checked
    wake = runs[0]["events"]["sleep"]["step"]
    assert any(n > wake and tokens for n, *_, tokens in runs[0]["records"])


def _check_refused(runs, s):
    from vmmkv import _blockset as blockset

    counts = s["counts"]
    assert counts["refused"] == 1 and "injected out of memory" in s["last_error"], s["last_error"]
    n, seq, target, before, after, error = runs[1]["events"]["refused"]
    grows = not blockset.is_subset(blockset.as_set(target), blockset.as_set(before))
    assert after == before and grows and "injected out of memory" in error, (before, after, error)
    for rank, o in enumerate(runs):
        rec = {r[0]: r for r in o["records"]}
        assert rec[n][1:4] == (seq, before, True), (rank, rec[n])  # error set, size kept
        # the error stays on the stamps of that sequence number only
        flagged = [r for r in o["records"] if r[3]]
        assert {r[1] for r in flagged} == {seq} and flagged[0][0] == n, flagged[:3]
    # the scheduler hands out nothing beyond the old limit until the next grow is confirmed
    steps = s["steps"]
    grows_then = next(g for m, _, g, *_ in steps if m == n)
    later = [(m, limit, top) for m, limit, g, top, *_ in steps if m > n and g == grows_then]
    bound = blockset.top(blockset.as_set(before))
    assert later and all(top < bound and limit <= bound for _, limit, top in later), later
    held = blockset.count(blockset.as_set(before))
    regrown = [r for r in runs[0]["records"]
               if r[0] > n and blockset.count(blockset.as_set(r[2])) > held]  # fmt: skip
    assert regrown and regrown[0][1] > seq and not regrown[0][3]  # the next grow works
    assert any(m > n and g > grows_then for m, _, g, *_ in steps)  # and is confirmed


@pytest.fixture(scope="module")
def two_ranks():
    with world_store() as store:
        return run_world(_ranks, 2, args=(store.port, [ASYNC, SYNC]), init_group=False,
                         env={**KNOBS, **store.env}, timeout=400)  # fmt: skip


@pytest.mark.timeout(420)
def test_two_ranks_under_vllms_async_scheduler_hold_the_reference_bytes_through_every_resize(
    two_ranks,
):
    _check(two_ranks, ASYNC, 2)


@pytest.mark.timeout(420)
def test_two_ranks_under_vllms_sync_scheduler_hold_the_reference_bytes_without_zeroing(two_ranks):
    _check(two_ranks, SYNC, 2)


@pytest.mark.timeout(600)
def test_three_ranks_under_vllms_async_scheduler_hold_the_reference_bytes():
    with world_store() as store:
        out = run_world(_ranks, 3, args=(store.port, [ASYNC]), init_group=False,
                        env={**KNOBS, **store.env}, timeout=560)  # fmt: skip
    _check(out, ASYNC, 3)


@pytest.mark.timeout(600)
def test_four_ranks_under_vllms_async_scheduler_hold_the_reference_bytes_with_a_late_reader():
    """Four ranks, two chunks per rank of every prefill, one owner per decode; rank 3 reads its
    replica late in every check: no peer's next step may write into it before every rank has
    read it (``_Rank.agree``), else the next step's rows show up in a replica checked against
    this step's reference."""
    with world_store() as store:
        out = run_world(_ranks, 4, args=(store.port, [ASYNC], LATE), init_group=False,
                        env={**KNOBS, **store.env}, timeout=560)  # fmt: skip
    _check(out, ASYNC, 4)
