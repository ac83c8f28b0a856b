"""Holes on the worker side of elastic mode (``_elastic_worker``), over two spawned PCP ranks
with a real ``VllmKVCache`` (vLLM 0.34's planned BLNHC config, host backend, gloo).

A ``SchedulerOutput`` carrying ``vmmkv_resize = (seq, block set)`` reaches every rank's
``on_update_requests``: the set is applied once per sequence number (collectively), the stamp
reports the set, the hole's chunks are released on every rank and in every peer mapping, a
block id in a hole is refused before anything writes it, and an int target recommits the hole
zeroed. A wake of vmmkv's sleep-mode backend restores a holed set as it was (holes stay
holes); under vLLM's extensible KV cache a set with holes is refused on the stamp.
"""

from __future__ import annotations

import pytest

from tests.helpers import vllm_marks
from vmmkv.testing.spawn import run_world

pytestmark = vllm_marks()

N, LAYERS = 64, 2
CHUNK = 1 << 19  # 0.5 MiB: about 5 blocks of 100,864 bytes


def _step(resize, ids=()):
    from types import SimpleNamespace

    from vmmkv.integrations.vllm._elastic_settings import RESIZE

    so = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(block_ids=(list(ids),))],
        scheduled_cached_reqs=SimpleNamespace(new_block_ids=[]),
        new_block_ids_to_zero=None,
        kv_cache_block_copies=None,
    )
    setattr(so, RESIZE, resize)
    return so


def _worker(rank, world):
    import weakref

    import torch
    import torch.distributed as dist

    from vmmkv.alloc.region import covering_chunks
    from vmmkv.integrations.vllm import _elastic_worker as worker_side
    from vmmkv.integrations.vllm._buffer import PeerKVBuffer
    from vmmkv.integrations.vllm._cache import VllmKVCache
    from vmmkv.integrations.vllm._sleep import VmmkvSleepModeBackend
    from vmmkv.integrations.vllm._state import _STATE
    from vmmkv.testing.vllm import configs

    _, kvc = configs.build_kv_cache_config("BLNHC", num_blocks=N, num_layers=LAYERS, pcp=world)
    worker_side.WORKER.reset()
    vc = VllmKVCache(kvc, "BLNHC", cpu_group=dist.group.WORLD, device="cpu", backend="host",
                     initial_blocks=40, chunk_bytes=CHUNK, timeout=20)  # fmt: skip
    out = {}
    calls = []
    real = vc.set_committed_blocks
    vc.set_committed_blocks = lambda s: calls.append(s) or real(s)
    sr = vc.cache.region

    def chunks_of(held):
        ranges = [(o + a * p, o + b * p) for o, p in vc.segments for a, b in held]
        return covering_chunks(ranges, sr.chunk_bytes, sr.capacity_bytes)

    def mapped_as_owned():
        own = sr.region.chunks()
        return all(sr.peers.mapped_chunks(q) == own for q in range(world) if q != rank)

    try:
        flat = vc.buffer.view(torch.uint8)
        base = vc.buffer.data_ptr() - sr.base_ptr
        for o, p in vc.segments:  # every committed block non-zero
            flat[o - base : o - base + 40 * p].fill_(7)
        dist.barrier()
        holed = ((0, 10), (30, 40))
        before = vc.cache.committed_bytes
        worker_side.on_update_requests(vc, _step((1, holed), [0, 5, 35]))
        worker_side.on_update_requests(vc, _step((1, holed), [1]))  # the same seq: not again
        out["applied"] = (len(calls), vc.committed_block_set, worker_side.WORKER.stamp(vc))
        out["released"] = before - vc.cache.committed_bytes
        out["chunks"] = sr.region.chunks() == chunks_of(holed) and mapped_as_owned()
        off, bb = vc.segments[0]
        out["kept"] = bool((flat[off - base + 31 * bb : off - base + 40 * bb] == 7).all())
        try:
            worker_side.on_update_requests(vc, _step((1, holed), [3, 15]))
            out["hole_id"] = "no error"
        except ValueError as exc:
            out["hole_id"] = str(exc)
        worker_side.on_update_requests(vc, _step((2, 40)))  # the prefix again: the hole recommitted
        hole = flat[off - base + 10 * bb : off - base + 30 * bb]
        out["recommitted"] = (
            worker_side.WORKER.stamp(vc),
            int(hole.count_nonzero()),
            mapped_as_owned(),
        )

        # vmmkv's sleep-mode backend: a holed set survives sleep, retargeted while asleep
        worker_side.on_update_requests(vc, _step((3, holed)))
        _STATE.active = vc
        backend = VmmkvSleepModeBackend()
        backend._release(vc, "sleep")
        asleep = (vc.committed_block_set, worker_side.WORKER.stamp(vc))
        worker_side.WORKER.apply(vc, (4, ((0, 5), (30, 40))))
        asleep += (worker_side.WORKER.stamp(vc),)
        backend._restore()
        out["sleep"] = (*asleep, vc.committed_block_set, mapped_as_owned())
        _STATE.active = None

        # vLLM's extensible KV cache: holes refused on the stamp, nothing changed
        buffer = PeerKVBuffer.__new__(PeerKVBuffer)
        buffer.cache, buffer.released, buffer.budget = vc, False, N

        class Ext:
            pass

        ext = Ext()
        ext.buffer, ext.num_committed_blocks = buffer, vc.committed_blocks
        _STATE.extensible = weakref.ref(ext)
        worker_side.WORKER.apply(vc, (5, holed))
        out["extensible"] = (worker_side.WORKER.stamp(vc), vc.committed_block_set)
        _STATE.extensible = None
    finally:
        worker_side.WORKER.reset()
        vc.close()
    return out


@pytest.mark.timeout(200)
def test_a_scheduler_output_carrying_a_block_set_is_applied_once_and_stamped():
    out = run_world(_worker, 2, timeout=180)
    holed = ((0, 10), (30, 40))
    for rank, res in enumerate(out):
        assert res["applied"] == (1, holed, (1, holed, None)), (rank, res)
        assert res["released"] > 0 and res["chunks"] and res["kept"], (rank, res)
        assert "block 15" in res["hole_id"] and f"rank {rank}" in res["hole_id"], res
        assert res["recommitted"] == ((2, 40, None), 0, True), (rank, res)
        asleep_set, stamp_asleep, stamp_retargeted, woken, mapped = res["sleep"]
        assert asleep_set == () and stamp_asleep == (3, holed, None), (rank, res)
        assert stamp_retargeted == (4, ((0, 5), (30, 40)), None) and mapped, (rank, res)
        assert woken == ((0, 5), (30, 40)), (rank, res)
        (seq, blocks, error), held = res["extensible"]
        assert (seq, blocks, held) == (5, 40, ((0, 5), (30, 40))), (rank, res)
        assert "not a prefix" in error and "extensible" in error, (rank, error)
