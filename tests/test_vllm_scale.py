"""A 61-layer DeepSeek-V3.2 KV cache through the vLLM 0.34.0 plugin under a low open-file limit
(CPU, host backend, spawned ranks, vLLM's own groups and planner): the plugin's own allocation
(vLLM's extensible cache off) and vLLM's ExtensibleKVCache over the plugin's buffer.

Each rank sets RLIMIT_NOFILE soft = hard, joins vLLM's process groups, and allocates as MRV2
does with CUDA graphs on (a profiling cache, then the real one, both through the patched
``attn_utils.allocate_kv_cache`` and planned by vLLM's ``get_kv_cache_configs``): the engine's
start, a grow of every block. Then a sleep (``shrink(0)``) and a wake (``grow`` back), the
calls the plugin's sleep backend makes. Checked on every rank: every block committed after
start and wake, none after sleep, each peer mapping exactly the chunks its owner committed, and
the fds held never reaching the limit. In the plugin's own chunks (at most 64) and in 64 KiB
chunks (``VMMKV_CHUNK_MIB``: thousands of them). Under vLLM's extensible cache (layouts padded
by vLLM's ``pad_kv_cache_segments``), in the worker's order: the null block, warmup, the
shrink-remap before capture, the extend, sleep and wake; every commit maps exactly each
segment's blocks rounded up to the chunk (2 MiB, CUDA's granule, and 64 KiB).
"""

from __future__ import annotations

import contextlib

import pytest

from tests.helpers import vllm_marks
from vmmkv.testing.spawn import run_world

pytestmark = vllm_marks()

LAYERS, BLOCKS, PROFILE_BLOCKS, BS = 61, 48, 5, 64


def _mapped(vc) -> dict[str, list[int]]:
    sr = vc.cache.region
    return {"own": [c.offset for c in sr.region.chunks()],
            "peers": [[c.offset for c in sr.peers.mapped_chunks(r)]
                      for r in range(sr.world_size) if r != sr.rank]}  # fmt: skip


@contextlib.contextmanager
def _fd_limit(nofile: int, chunk_mib: float | None):
    """RLIMIT_NOFILE soft = hard = ``nofile`` and ``VMMKV_CHUNK_MIB`` for this rank; yields the
    peak of its open fds, sampled every 2 ms (a one-element list the step loop resets)."""
    import os
    import resource
    import threading
    import time

    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    if chunk_mib:
        os.environ["VMMKV_CHUNK_MIB"] = str(chunk_mib)
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], len(os.listdir("/proc/self/fd")))
            except OSError:
                peak[0] = nofile  # not one fd left to list them with
            time.sleep(0.002)

    threading.Thread(target=sample, daemon=True).start()
    try:
        yield peak
    finally:
        stop.set()


def _steps(steps, group, vc, peak, out) -> None:
    """Each ``(name, call)`` after a barrier over ``group`` (None: no call), then this rank's
    committed blocks, fd peak and chunks in ``out[name]``."""
    import torch.distributed as dist

    for step, call in steps:
        if call is not None:
            dist.barrier(group=group)
            call()
        out[step] = {"blocks": vc.committed_blocks, "peak_fds": peak[0], **_mapped(vc)}
        peak[0] = 0


def _scale(rank, world, port, nofile, chunk_mib):
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.gpu import attn_utils

    from vmmkv.integrations import vllm as integration
    from vmmkv.testing.vllm import configs

    cfg = configs.vllm_config("LBNHC", BLOCKS, LAYERS, pcp=world)
    out = {}
    with _fd_limit(nofile, chunk_mib) as peak:
        with configs.vllm_groups(cfg, rank, world, port) as ps:
            cpu, lay = torch.device("cpu"), KVCacheLayout.LBNHC
            _, prof = configs.build_profiling_kv_cache_config(
                "LBNHC", PROFILE_BLOCKS, LAYERS, pcp=world
            )
            _, config = configs.build_kv_cache_config("LBNHC", BLOCKS, LAYERS, pcp=world)
            with set_current_vllm_config(cfg), integration.patched():
                views = attn_utils.allocate_kv_cache(prof, cpu, lay, [BS])
                del views  # vLLM's teardown of the profiling state
                views = attn_utils.allocate_kv_cache(config, cpu, lay, [BS])
                vc = integration.active_cache()
                out["chunks"] = -(-vc.cache.capacity_bytes // vc.cache.region.chunk_bytes)
                out["views"] = len(views)
                steps = (("start", None), ("sleep", lambda: vc.shrink(0)),
                         ("wake", lambda: vc.grow(vc.num_blocks)))  # fmt: skip
                _steps(steps, ps.get_pcp_group().cpu_group, vc, peak, out)
                del views
                vc.close()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "world,nofile,chunk_mib,chunks",
    [(2, 4096, None, 64), (4, 4096, None, 64), (2, 4096, 0.0625, 2254), (4, 8192, 0.0625, 2254)],
)
def test_a_61_layer_cache_starts_sleeps_and_wakes_through_the_plugin_under_the_limit(
    world, nofile, chunk_mib, chunks, world_store
):
    out = run_world(_scale, world, args=(world_store.port, nofile, chunk_mib), init_group=False,
                    env=world_store.env, timeout=280)  # fmt: skip
    for rank, o in enumerate(out):
        assert o["chunks"] == chunks and o["views"] == 2 * LAYERS, o
        for step, blocks in (("start", BLOCKS), ("sleep", 0), ("wake", BLOCKS)):
            s = o[step]
            assert s["blocks"] == blocks, (rank, step, s["blocks"])
            assert len(s["own"]) == (chunks if blocks else 0), (rank, step, len(s["own"]))
            assert s["peak_fds"] < nofile, (rank, step, s["peak_fds"])
            # every peer maps exactly the chunks its owner committed
            others = [r for r in range(world) if r != rank]
            assert s["peers"] == [out[r][step]["own"] for r in others], (rank, step)


def _scale_extensible(rank, world, port, nofile, chunk_mib, layout):
    """vLLM 0.34's ExtensibleKVCache of the 61-layer cache over the plugin's buffer, in the
    worker's order: the allocate hook (the null block), warmup commits and the shrink-remap to
    the minimum, the extend to every block, a sleep (``release_physical``) and a wake
    (``recommit``), then ``free``."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker import extensible_kv_cache as ekc
    from vllm.v1.worker.gpu import attn_utils

    from vmmkv.integrations import vllm as integration
    from vmmkv.testing.vllm import configs

    cfg = configs.vllm_config(layout, BLOCKS, LAYERS, pcp=world)
    out = {}
    with _fd_limit(nofile, chunk_mib) as peak:
        with configs.vllm_groups(cfg, rank, world, port) as ps:
            cpu, lay = torch.device("cpu"), KVCacheLayout[layout]
            _, config = configs.build_kv_cache_config(layout, BLOCKS, LAYERS, pcp=world)
            config = ekc.pad_kv_cache_segments(config, lay, 2 << 20)  # CUDA's granule floor
            with set_current_vllm_config(cfg), integration.patched():
                ext = ekc.ExtensibleKVCache(config, cpu, lay)
                views = attn_utils.allocate_kv_cache(config, cpu, lay, [BS], allocate=ext.allocate)
                vc = ext.buffer.cache
                out["views"] = len(views)
                out["segments"] = list(zip(ext.segment_offsets, ext.segment_strides, strict=True))
                out["chunk"] = vc.cache.region.chunk_bytes
                steps = (
                    ("null block", None),
                    ("warmup", lambda: ext.commit(BLOCKS // 3)),
                    ("before capture", lambda: ext.commit(ext.min_committed_blocks, shrink=True)),
                    ("extend", lambda: ext.commit(BLOCKS, shrink=True)),
                    ("sleep", ext.release_physical),
                    ("wake", ext.recommit),
                )
                _steps(steps, ps.get_pcp_group().cpu_group, vc, peak, out)
                del views
                ext.free()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "world,layout,chunk_mib", [(2, "LBNHC", 2), (2, "BLNHC", 2), (2, "LBNHC", 0.0625)]
)
def test_a_61_layer_cache_under_vllms_extensible_cache_commits_what_vllm_asks_under_the_limit(
    world, layout, chunk_mib, world_store
):
    nofile = 4096
    out = run_world(_scale_extensible, world, args=(world_store.port, nofile, chunk_mib, layout),
                    init_group=False, env=world_store.env, timeout=280)  # fmt: skip
    for rank, o in enumerate(out):
        assert o["views"] == 2 * LAYERS, o["views"]
        chunk, segments = o["chunk"], o["segments"]
        assert chunk == int(chunk_mib * (1 << 20)) and all(off % chunk == 0 for off, _ in segments)
        assert len(segments) == (2 * LAYERS if layout == "LBNHC" else 1), len(segments)
        minimum = 1 if layout == "LBNHC" else 2  # vLLM's null block (+1 block-outermost)
        for step, blocks in (("null block", minimum), ("warmup", BLOCKS // 3),
                             ("before capture", minimum), ("extend", BLOCKS), ("sleep", 0),
                             ("wake", BLOCKS)):  # fmt: skip
            s = o[step]
            # each segment's first `blocks` blocks, in chunks of the segment's own
            want = sum(-(-blocks * stride // chunk) for _, stride in segments)
            assert (s["blocks"], len(s["own"])) == (blocks, want), (rank, step, s["blocks"])
            assert s["peak_fds"] < nofile, (rank, step, s["peak_fds"])
            others = [r for r in range(world) if r != rank]
            assert s["peers"] == [out[r][step]["own"] for r in others], (rank, step)
