"""vLLM 0.34's extensible KV cache over the plugin's buffer in runs, at the plugin's defaults
(no ``VMMKV_CHUNK_MIB``; CPU, host backend, spawned PCP ranks, vLLM's own groups, planner,
padding and ``ExtensibleKVCache``).

- DeepSeek-V3.2's 61-layer cache starts, sleeps and wakes under a hard limit of 4096 open files
  in vLLM's default layout (LBNHC) and in BLNHC: the chunk is the host's page, and every commit
  maps one run per segment it extends (LBNHC: 122), which each peer maps exactly (in chunks of a
  page, one allocation each, the same cache would need tens of thousands of files).
- What vLLM budgets is what vmmkv maps: BLNHC, 61 layers, 59 blocks: vLLM's
  ``physical_bytes_for`` equals the buffer's ``physical_bytes`` on the host's page and on a
  2 MiB granule (CUDA's; the host backend's granularity set to it): 182,452,224 bytes, where a
  64 MiB chunk made vLLM budget 201,326,592.
- ``segments_backed_by_one_chunk`` answers from the runs: False for segments that the null
  block's run and the extend's run share, True after vLLM's defragmenting commit, which then
  remaps nothing more.
"""

from __future__ import annotations

import pytest

from tests.helpers import vllm_marks
from tests.test_vllm_scale import BLOCKS, LAYERS, _scale_extensible
from vmmkv.testing.spawn import run_world

pytestmark = vllm_marks()

GRANULE = 2 << 20


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_a_61_layer_cache_in_runs_starts_sleeps_and_wakes_under_the_limit_at_the_defaults(
    layout, world_store
):
    import os

    world, nofile = 2, 4096
    out = run_world(_scale_extensible, world, args=(world_store.port, nofile, None, layout),
                    init_group=False, env=world_store.env, timeout=280)  # fmt: skip
    segments = 2 * LAYERS if layout == "LBNHC" else 1
    # vLLM's order: the null block, warmup (a second run per segment), the shrink-remap (one),
    # the extend from the minimum (two), sleep, wake (one: the recommit maps each segment whole)
    runs = {"null block": 1, "warmup": 2, "before capture": 1, "extend": 2, "sleep": 0, "wake": 1}
    blocks = {"warmup": BLOCKS // 3, "extend": BLOCKS, "sleep": 0, "wake": BLOCKS}
    for rank, o in enumerate(out):
        assert o["chunk"] == os.sysconf("SC_PAGE_SIZE"), o["chunk"]
        assert len(o["segments"]) == segments and o["views"] == 2 * LAYERS
        for step, per_segment in runs.items():
            s = o[step]
            if step in blocks:
                assert s["blocks"] == blocks[step], (rank, step, s["blocks"])
            assert len(s["own"]) == per_segment * segments, (rank, step, len(s["own"]))
            assert s["peak_fds"] < nofile, (rank, step, s["peak_fds"])
            others = [r for r in range(world) if r != rank]
            assert s["peers"] == [out[r][step]["own"] for r in others], (rank, step)


def _budget(rank, world, port, layout, layers, blocks, granule):
    """vLLM's ExtensibleKVCache of ``blocks`` blocks, the allocate hook, a commit of every
    block: (vLLM's estimate, the buffer's physical bytes, the bytes of the blocks, the chunk).
    ``granule``: the host backend's granularity for this rank (None: the page)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker import extensible_kv_cache as ekc
    from vllm.v1.worker.gpu import attn_utils

    from vmmkv.alloc import host
    from vmmkv.integrations import vllm as integration
    from vmmkv.testing.vllm import configs

    if granule:  # CUDA's granule on the host backend: mappings are whole pages all the same
        real = host.HostBackend.__init__

        def init(self, *a, **k):
            real(self, *a, **k)
            self.granularity = granule

        host.HostBackend.__init__ = init
    cfg = configs.vllm_config(layout, blocks, layers, pcp=world)
    with configs.vllm_groups(cfg, rank, world, port):
        cpu, lay = torch.device("cpu"), KVCacheLayout[layout]
        _, config = configs.build_kv_cache_config(layout, blocks, layers, pcp=world)
        config = ekc.pad_kv_cache_segments(config, lay, GRANULE)
        with set_current_vllm_config(cfg), integration.patched():
            ext = ekc.ExtensibleKVCache(config, cpu, lay)
            views = attn_utils.allocate_kv_cache(config, cpu, lay, [64], allocate=ext.allocate)
            ext.commit(blocks)
            got = (ext.physical_bytes_for(blocks), ext.buffer.physical_bytes,
                   blocks * ext.bytes_per_block, ext.buffer.granularity)  # fmt: skip
            del views
            ext.free()
    return got


@pytest.mark.timeout(300)
@pytest.mark.parametrize("granule", [None, GRANULE], ids=["page", "2MiB"])
def test_vllms_budget_of_a_61_layer_59_block_blnhc_cache_is_what_vmmkv_maps(granule, world_store):
    import os

    out = run_world(_budget, 2, args=(world_store.port, "BLNHC", 61, 59, granule),
                    init_group=False, env=world_store.env, timeout=280)  # fmt: skip
    unit = granule or os.sysconf("SC_PAGE_SIZE")
    blocks_bytes = 59 * 61 * (41_984 + 8_448)  # 181,504,768
    mapped = -(-blocks_bytes // unit) * unit
    for estimate, physical, held, chunk in out:
        assert held == blocks_bytes and chunk == unit
        assert estimate == physical == mapped, (estimate, physical, mapped)
    if granule:
        assert mapped == 182_452_224  # vLLM budgeted 201,326,592 with a 64 MiB granularity


def _one_chunk(rank, world, port, layout):
    """After the allocate hook and an extend: what ``segments_backed_by_one_chunk`` answers,
    the runs each segment's blocks overlap (read from the region), then the same after vLLM's
    defragmenting commit and after a second one (which must remap nothing)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker import extensible_kv_cache as ekc
    from vllm.v1.worker.gpu import attn_utils

    from vmmkv.integrations import vllm as integration
    from vmmkv.testing.vllm import configs

    blocks, n = 24, 20
    cfg = configs.vllm_config(layout, blocks, 4, pcp=world)
    out = {}
    with configs.vllm_groups(cfg, rank, world, port):
        cpu, lay = torch.device("cpu"), KVCacheLayout[layout]
        _, config = configs.build_kv_cache_config(layout, blocks, 4, pcp=world)
        config = ekc.pad_kv_cache_segments(config, lay, GRANULE)
        with set_current_vllm_config(cfg), integration.patched():
            ext = ekc.ExtensibleKVCache(config, cpu, lay)
            views = attn_utils.allocate_kv_cache(config, cpu, lay, [64], allocate=ext.allocate)
            buf = ext.buffer
            region = buf.cache.cache.region.region
            base = buf.cache.buffer.data_ptr() - region.base_ptr

            def state():
                sizes = [n * s for s in ext.segment_strides]
                runs = region.chunks()
                spans = [
                    sum(
                        1 for c in runs if c.offset < base + o + sz and base + o < c.offset + c.size
                    )
                    for o, sz in zip(ext.segment_offsets, sizes, strict=True)
                ]
                return buf.segments_backed_by_one_chunk(sizes), spans, len(runs)

            ext.commit(n)
            out["extended"] = state()
            ext.commit(n, defragment=True)
            out["defragmented"] = state()
            released = []
            real = buf.release_physical
            buf.release_physical = lambda: released.append(1) or real()
            ext.commit(n, defragment=True)
            out["again"] = (state(), len(released))
            del views
            ext.free()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_segments_backed_by_one_chunk_answers_from_the_runs(layout, world_store):
    out = run_world(_one_chunk, 2, args=(world_store.port, layout), init_group=False,
                    env=world_store.env, timeout=280)  # fmt: skip
    segments = 8 if layout == "LBNHC" else 1
    for o in out:
        backed, spans, runs = o["extended"]
        # the null block's run and the extend's run: two per segment, so none is one chunk
        assert spans == [2] * segments and backed == [False] * segments, o
        assert runs == 2 * segments
        backed, spans, runs = o["defragmented"]
        assert spans == [1] * segments and backed == [True] * segments and runs == segments, o
        (backed, spans, runs), released = o["again"]
        assert backed == [True] * segments and released == 0, o
