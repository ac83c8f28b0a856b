"""vLLM 0.34.0 sleep mode with the KV cache on vmmkv memory (CPU, host backend, 2 PCP ranks).

Through vLLM's own code: the plugin's patched ``allocate_kv_cache`` builds the cache; vLLM's
real ``Worker.sleep``/``wake_up``/``discard`` (``v1/worker/gpu_worker.py``) run on a minimally
constructed worker (``Worker.__new__`` plus the attributes those methods read); the worker gets
its backend from vLLM's real ``SleepModeBackendFactory`` (``sleep_mode_backend="vmmkv"``), which
wraps vLLM's real ``CuMemBackend``. Stand-ins, for what the CPU lacks: ``CuMemAllocator`` (CUDA
only) is a recorder of the calls ``CuMemBackend`` makes (``vllm.device_allocator.
get_mem_allocator_instance``, which CuMemBackend looks up at each call), and
``torch.accelerator.synchronize``/``get_memory_info`` are host versions (the "device memory in
use" is the vmmkv chunks mapped in this process, read from ``/proc/self/maps``).

Checked on both ranks: sleep releases every chunk of the KV region and every peer mapping
(vmmkv's books and the kernel's mappings: 0 bytes), a store while asleep is skipped and counted
(no fault), a wake without "kv_cache" keeps it released, a wake with "kv_cache" or with no tags
restores the committed blocks (the count before sleep, not the capacity) zeroed (poisoned
before sleep) at the same addresses (every view's data_ptr), and stores afterwards are byte-equal
to ``vmmkv.ops.reference``; ``discard(("kv_cache",))`` releases and a wake restores; CuMem gets
the calls vLLM's own backend makes (vmmkv's bookkeeping is outside CuMem's pool:
``tests/test_vllm_cumem.py``), after the release and before the restore.
"""

from __future__ import annotations

import pytest

from tests.helpers import vllm_marks, vllm_world_fixture

pytestmark = vllm_marks()

BS, NUM_BLOCKS, LAYERS, ROWS = 64, 32, 4, 7
COMMITTED = 20  # blocks committed before sleep: a wake restores these, not NUM_BLOCKS
BLOCKS = [0, 7, 13]  # where the stores put their rows (all committed)
LAYOUT = "LBNHC"  # layer-major: 2 segments per layer
POISON = 0xA5
CUMEM_TAGS = ("runtime", "cudagraph")  # CuMemBackend.suspend always offloads these


class _RecordingAllocator:
    """Stands in for ``CuMemAllocator`` (CUDA only) behind vLLM's real ``CuMemBackend``: records
    each call with the KV cache's committed blocks at that moment (the order of vmmkv's release
    and restore against the allocator's sleep and wake)."""

    default_tag = "default"

    def __init__(self, cache=None):
        self.cache = cache
        self.calls = []

    def _blocks(self):
        return None if self.cache is None else self.cache.committed_blocks

    def sleep(self, offload_tags=None, discardable=()):
        self.calls.append(("sleep", tuple(offload_tags), self._blocks()))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", None if tags is None else list(tags), self._blocks()))

    def discard(self, tags):
        self.calls.append(("discard", tuple(tags), self._blocks()))


def _mapped_kernel_bytes(lo, hi):
    """Bytes of memfd mappings (vmmkv host chunks) inside ``[lo, hi)``, per the kernel."""
    total = 0
    with open("/proc/self/maps") as f:
        for line in f:
            if "memfd:" not in line:
                continue
            a, b = (int(x, 16) for x in line.split()[0].split("-"))
            total += max(0, min(b, hi) - max(a, lo))
    return total


def _memory(vc, world):
    """What is mapped of the KV region: vmmkv's books (own committed bytes, each peer's mapped
    bytes and chunks) and the kernel's (memfd bytes in the own range and in each peer range)."""
    sr = vc.cache.region
    cap = sr.capacity_bytes
    peers = [r for r in range(world) if r != vc.rank]
    return {
        "blocks": vc.committed_blocks,
        "own": sr.committed_bytes,
        "own_kernel": _mapped_kernel_bytes(sr.base_ptr, sr.base_ptr + cap),
        "peers": [sr.peers.mapped_bytes(r) for r in peers],
        "peer_chunks": [len(sr.peers.mapped_chunks(r)) for r in peers],
        "peers_kernel": [
            _mapped_kernel_bytes(sr.peers.ptrs[r], sr.peers.ptrs[r] + cap) for r in peers
        ],
    }


def _inputs(seed, prank, world):
    """'shard'-case rows of one layer (``tests.helpers.shard_step_rows``)."""
    from tests.helpers import shard_step_rows

    return shard_step_rows(1000 * seed, prank, world, BLOCKS, ROWS, BS)


def _store(vc, seed, prank, world, layers=range(LAYERS)):
    """Every layer's rows through the cache (direct publication + barrier)."""
    from vmmkv.integrations.vllm import pcp_store_plan
    from vmmkv.testing.vllm import configs

    for layer in layers:
        kv_c, k_pe, k, mapping, _ = _inputs(seed + layer, prank, world)
        plan = pcp_store_plan(ROWS, mapping, 0, True, prank, world)
        vc.store(vc.bindings[configs.idx_layer(layer)], (k,), plan)
        vc.store(vc.bindings[configs.mla_layer(layer)], (kv_c, k_pe), plan)


def _reference(plain, vc, seed, world):
    """vLLM's plain-torch KV cache, zeroed, then every rank's rows of ``seed`` through
    ``vmmkv.ops.reference`` (in the kinds the plugin bound: those the installed vLLM writes)."""
    from vmmkv.ops import reference as ref
    from vmmkv.testing.vllm import configs

    for view in plain.values():
        view.zero_()
    for layer in range(LAYERS):
        idx, mla = configs.idx_layer(layer), configs.mla_layer(layer)
        for (kv_c, k_pe, k), slots in _inputs(seed + layer, 0, world)[4]:
            ref.insert_indexer_k(plain[idx].squeeze(1), k, slots, kind=vc.bindings[idx].kind)
            ref.insert_ds_mla(plain[mla].squeeze(1), kv_c, k_pe, slots,
                              kind=vc.bindings[mla].kind)  # fmt: skip


def _segments(vc, blocks):
    """The own replica's bytes of blocks ``[0, blocks)`` of every segment (uint8 views)."""
    import torch

    buf = vc.buffer.view(torch.uint8)
    base = vc.buffer.data_ptr() - vc.cache.region.base_ptr
    return [buf[o - base : o - base + blocks * bb] for o, bb in vc.segments]


def _equal(vc, want, blocks):
    import torch

    got, ref = _segments(vc, blocks), _segments_of(want, vc, blocks)
    return all(torch.equal(g, w) for g, w in zip(got, ref, strict=True))


def _segments_of(flat, vc, blocks):
    base = vc.buffer.data_ptr() - vc.cache.region.base_ptr
    return [flat[o - base : o - base + blocks * bb] for o, bb in vc.segments]


def _poison(vc):
    for seg in _segments(vc, vc.committed_blocks):
        seg.fill_(POISON)


def _zeroed(vc):
    return all(bool((seg == 0).all()) for seg in _segments(vc, vc.committed_blocks))


def _worker(cfg):
    """vLLM's real GPU ``Worker``, built without ``__init__`` (no device): the attributes that
    ``sleep``/``wake_up``/``discard`` read, as ``Worker.__init__`` sets them."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.worker.gpu_worker import Worker

    w = Worker.__new__(Worker)
    w.vllm_config = cfg
    w.model_config = cfg.model_config
    w._sleep_mode_backend = None
    w._sleep_saved_buffers = {}
    w._sleep_saved_parameters = {}
    w._sleep_saved_draft_buffers = {}
    model = torch.nn.Module()
    model.register_buffer("scale", torch.arange(4.0))
    w.model_runner = SimpleNamespace(model=model, get_draft_model=lambda: None)
    return w


class _HostAccelerator:
    """``torch.accelerator.synchronize``/``get_memory_info`` on the host (no driver here):
    "in use" is the vmmkv chunk memory mapped in this process; what ``Worker.sleep`` logs as
    freed and asserts non-negative."""

    TOTAL = 1 << 40

    def __init__(self):
        import torch

        self.acc = torch.accelerator
        self.saved = (self.acc.synchronize, self.acc.get_memory_info)

    def __enter__(self):
        self.acc.synchronize = lambda *a, **k: None
        self.acc.get_memory_info = lambda *a, **k: (
            self.TOTAL - _mapped_kernel_bytes(0, 1 << 64),
            self.TOTAL,
        )
        return self

    def __exit__(self, *exc):
        self.acc.synchronize, self.acc.get_memory_info = self.saved


def _snapshot(vc, views, world, backend=None):
    out = _memory(vc, world)
    out["ptrs"] = {n: v.data_ptr() for n, v in views.items()}
    out["buffer"] = vc.buffer.data_ptr()
    if backend is not None:
        out["state"] = backend.state()
        out["released"] = getattr(backend, "released_blocks", None)
    return out


def _without_vmmkv_cache():
    """The vmmkv backend with no active vmmkv cache (PCP size 1: vLLM's own KV cache): every
    call goes to CuMemBackend unchanged."""
    from types import SimpleNamespace

    import vllm.device_allocator as dalloc
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

    from vmmkv.integrations.vllm import _sleep

    _sleep.register_backend()
    rec = _RecordingAllocator()
    real = dalloc.get_mem_allocator_instance
    dalloc.get_mem_allocator_instance = lambda: rec
    try:
        b = SleepModeBackendFactory.create_backend(SimpleNamespace(sleep_mode_backend="vmmkv"))
        b.suspend(())
        b.resume(["weights"])
        b.resume(None)
        b.discard(("kv_cache",))
    finally:
        dalloc.get_mem_allocator_instance = real
    return {"type": type(b).__name__, "inner": type(b.inner).__name__, "calls": rec.calls}


def _refusal():
    from vmmkv.integrations.vllm import UnsupportedKVCache, _sleep
    from vmmkv.testing.vllm import configs

    out = {}
    for name in ("cumem", "vmmkv"):
        cfg = configs.vllm_config(LAYOUT)
        # set after construction: vLLM refuses sleep mode on the CPU platform
        cfg.model_config.enable_sleep_mode, cfg.model_config.sleep_mode_backend = True, name
        try:
            _sleep.check_config(cfg)
            out[name] = ""
        except UnsupportedKVCache as exc:
            out[name] = str(exc)
    _sleep.check_config(configs.vllm_config(LAYOUT))  # sleep allocator off: vLLM's defaults
    return out


def _sleep_rank(rank, world, port):
    import torch
    import torch.distributed as dist
    import vllm.device_allocator as dalloc
    from vllm.config import set_current_vllm_config
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker import utils as worker_utils
    from vllm.v1.worker.gpu import attn_utils  # MRV2: the runner that runs PCP

    from vmmkv.integrations import vllm as integration
    from vmmkv.testing.vllm import configs

    with configs.vllm_groups(configs.vllm_config(LAYOUT, pcp=world), rank, world, port) as ps:
        out = {"no cache": _without_vmmkv_cache(), "refusal": _refusal()}
        cfg, config = configs.build_kv_cache_config(LAYOUT, NUM_BLOCKS, pcp=world)
        size = config.kv_cache_tensors[0].size
        pcp = ps.get_pcp_group()
        prank = pcp.rank_in_group
        real_allocator = dalloc.get_mem_allocator_instance
        try:
            with set_current_vllm_config(cfg), integration.patched(), _HostAccelerator():
                from vmmkv.integrations.vllm._sleep import VmmkvSleepModeBackend

                out["registered"] = SleepModeBackendFactory.get_backend_class("vmmkv") is (
                    VmmkvSleepModeBackend
                )
                # sleep mode on with vLLM's own backend: refused at allocation, before any collective
                cfg.model_config.enable_sleep_mode, cfg.model_config.sleep_mode_backend = (
                    True,
                    "cumem",
                )
                try:
                    attn_utils.allocate_kv_cache(
                        config, torch.device("cpu"), KVCacheLayout[LAYOUT], [BS]
                    )
                    out["refused at allocation"] = ""
                except integration.UnsupportedKVCache as exc:
                    out["refused at allocation"] = str(exc)
                cfg.model_config.enable_sleep_mode = False  # vLLM refuses sleep mode on the CPU
                out["active after refusal"] = integration.active_cache() is not None
                views = attn_utils.allocate_kv_cache(
                    config, torch.device("cpu"), KVCacheLayout[LAYOUT], [BS]
                )
                vc = integration.active_cache()
                vc.shrink(COMMITTED)
                plain = worker_utils.allocate_kv_cache(
                    config, torch.device("cpu"), KVCacheLayout[LAYOUT], [BS]
                )
                want = torch.empty(0, dtype=torch.uint8).set_(
                    next(iter(plain.values())).untyped_storage(), 0, (size,), (1,)
                )
                rec = _RecordingAllocator(vc)
                dalloc.get_mem_allocator_instance = lambda: rec

                out["before"] = _snapshot(vc, views, world)
                _store(vc, 0, prank, world)
                _reference(plain, vc, 0, world)
                out["before"]["equal"] = _equal(vc, want, COMMITTED)

                # 0. today: vLLM's own backend (cumem) leaves the KV memory as it is
                kept = [seg.clone() for seg in _segments(vc, COMMITTED)]
                cfg.model_config.sleep_mode_backend = "cumem"
                plain_worker = _worker(cfg)
                plain_worker.sleep(level=1)
                out["cumem asleep"] = _snapshot(vc, views, world, plain_worker.sleep_mode_backend)
                out["cumem asleep"]["kept"] = all(
                    torch.equal(a, b) for a, b in zip(_segments(vc, COMMITTED), kept, strict=True)
                )
                plain_worker.wake_up()
                out["cumem backend"] = type(plain_worker.sleep_mode_backend).__name__
                out["calls 0"], rec.calls = rec.calls, []
                dist.barrier(group=pcp.cpu_group)

                cfg.model_config.sleep_mode_backend = "vmmkv"  # --sleep-mode-backend vmmkv
                worker = _worker(cfg)

                def awake(key, seed, calls):
                    """After a wake: the snapshot, blocks zeroed, then a store equal to the
                    reference, and the inner backend's calls since the last check."""
                    out[key] = _snapshot(vc, views, world, backend)
                    out[key]["zeroed"] = _zeroed(vc)
                    dist.barrier(group=pcp.cpu_group)  # checked before a peer publishes again
                    _store(vc, seed, prank, world)
                    _reference(plain, vc, seed, world)
                    out[key]["equal"] = _equal(vc, want, COMMITTED)
                    out[calls], rec.calls = rec.calls, []

                # 1. sleep(1), wake weights only, wake kv_cache
                _poison(vc)
                dist.barrier(group=pcp.cpu_group)
                worker.sleep(level=1)
                backend = worker.sleep_mode_backend
                out["backend"] = (type(backend).__name__, type(backend.inner).__name__)
                out["asleep"] = _snapshot(vc, views, world, backend)
                skipped = vc.stats()["out_of_range_slots"]
                _store(vc, 5, prank, world, layers=[0])  # nothing to write into: skipped, counted
                out["asleep"]["skipped"] = vc.stats()["out_of_range_slots"] - skipped
                worker.wake_up(["weights"])
                out["weights awake"] = _snapshot(vc, views, world, backend)
                worker.wake_up(["kv_cache"])
                awake("kv awake", 10, "calls 1")

                # 2. sleep(2), wake with no tags
                _poison(vc)
                worker.sleep(level=2)
                out["asleep 2"] = _snapshot(vc, views, world, backend)
                worker.wake_up()
                awake("awake 2", 20, "calls 2")

                # 3. discard kv_cache, wake kv_cache
                _poison(vc)
                worker.discard(("kv_cache",))
                out["discarded"] = _snapshot(vc, views, world, backend)
                worker.wake_up(["kv_cache"])
                awake("awake 3", 30, "calls 3")
                dist.barrier(group=pcp.cpu_group)
        finally:
            dalloc.get_mem_allocator_instance = real_allocator
    return out


sleep_run = vllm_world_fixture(_sleep_rank, 2, timeout=560)


def _released(snap):
    return (
        snap["blocks"] == 0
        and snap["own"] == 0
        and snap["own_kernel"] == 0
        and snap["peers"] == [0]
        and snap["peer_chunks"] == [0]
        and snap["peers_kernel"] == [0]
    )


def _restored(snap, before):
    keys = ("blocks", "own", "own_kernel", "peers", "peer_chunks", "peers_kernel", "ptrs",
            "buffer")  # fmt: skip
    return all(snap[k] == before[k] for k in keys)


@pytest.mark.timeout(600)
def test_with_vllms_own_backend_sleep_leaves_the_kv_memory_untouched(sleep_run):
    """Why the vmmkv backend exists: CuMem does not know vmmkv's memory (not released, not
    offloaded, content kept)."""
    for rank in range(2):
        got = sleep_run[rank]
        assert got["cumem backend"] == "CuMemBackend"
        assert _restored(got["cumem asleep"], got["before"]) and got["cumem asleep"]["kept"]
        assert got["calls 0"] == [
            ("sleep", ("weights", *CUMEM_TAGS), COMMITTED),  # the KV still committed
            ("wake_up", None, COMMITTED),
        ]


@pytest.mark.timeout(600)
def test_the_plugin_registers_the_vmmkv_backend_with_vllms_factory(sleep_run):
    for rank in range(2):
        got = sleep_run[rank]
        assert got["registered"]
        assert got["backend"] == ("VmmkvSleepModeBackend", "CuMemBackend")


@pytest.mark.timeout(600)
def test_sleep_releases_every_chunk_and_peer_mapping_of_the_kv_cache(sleep_run):
    for rank in range(2):
        got = sleep_run[rank]
        before = got["before"]
        assert before["blocks"] == COMMITTED and before["equal"]
        assert 0 < before["own"] == before["own_kernel"]
        assert before["peers"] == [before["own"]] and before["peers_kernel"] == [before["own"]]
        for phase in ("asleep", "weights awake", "asleep 2", "discarded"):
            assert _released(got[phase]), (phase, got[phase])
            assert got[phase]["released"] == COMMITTED
            assert got[phase]["ptrs"] == before["ptrs"]
        assert got["asleep"]["state"] == "SUSPENDED"
        # layer 0's ROWS - 1 rows of this rank, MLA and indexer: skipped, nothing written
        assert got["asleep"]["skipped"] == 2 * (ROWS - 1)


@pytest.mark.timeout(600)
def test_wake_up_with_kv_cache_restores_the_blocks_zeroed_at_the_same_addresses(sleep_run):
    for rank in range(2):
        got = sleep_run[rank]
        for phase in ("kv awake", "awake 3"):
            snap = got[phase]
            assert _restored(snap, got["before"]), (phase, snap, got["before"])
            assert snap["zeroed"] and snap["released"] is None and snap["state"] == "RUNNING"


@pytest.mark.timeout(600)
def test_wake_up_without_tags_restores_the_kv_cache(sleep_run):
    for rank in range(2):
        got = sleep_run[rank]
        snap = got["awake 2"]
        assert _restored(snap, got["before"]) and snap["zeroed"] and snap["released"] is None


@pytest.mark.timeout(600)
def test_stores_after_wake_up_equal_the_reference(sleep_run):
    for rank in range(2):
        got = sleep_run[rank]
        assert [got[p]["equal"] for p in ("kv awake", "awake 2", "awake 3")] == [True] * 3


@pytest.mark.timeout(600)
def test_cumem_gets_vllms_own_calls_around_the_release(sleep_run):
    """CuMem's sleep runs after the release (0 blocks) with the tags vLLM's own backend gives
    it; its wake and a kv_cache discard run while the KV is released (still 0 blocks)."""
    for rank in range(2):
        got = sleep_run[rank]
        assert got["calls 1"] == [
            ("sleep", ("weights", *CUMEM_TAGS), 0),
            ("wake_up", ["weights"], 0),
            ("wake_up", ["kv_cache"], 0),
        ]
        # vLLM 0.34's CuMemBackend offloads the same tags at every level (level 2 passes the
        # parameters it rewrites as discardable instead)
        assert got["calls 2"] == [("sleep", ("weights", *CUMEM_TAGS), 0), ("wake_up", None, 0)]
        assert got["calls 3"] == [("discard", ("kv_cache",), 0), ("wake_up", ["kv_cache"], 0)]


@pytest.mark.timeout(600)
def test_without_a_vmmkv_cache_every_call_goes_to_cumem_unchanged(sleep_run):
    got = sleep_run[0]["no cache"]
    assert (got["type"], got["inner"]) == ("VmmkvSleepModeBackend", "CuMemBackend")
    assert got["calls"] == [
        ("sleep", ("weights", *CUMEM_TAGS), None),
        ("wake_up", ["weights"], None),
        ("wake_up", None, None),
        ("discard", ("kv_cache",), None),
    ]


@pytest.mark.timeout(600)
def test_sleep_mode_with_another_backend_is_refused(sleep_run):
    got = sleep_run[0]["refusal"]
    assert "--sleep-mode-backend vmmkv" in got["cumem"] and "'cumem'" in got["cumem"]
    assert got["vmmkv"] == ""
    for rank in range(2):  # through the plugin's allocate_kv_cache (the wiring)
        assert "--sleep-mode-backend vmmkv" in sleep_run[rank]["refused at allocation"]
        assert not sleep_run[rank]["active after refusal"]
