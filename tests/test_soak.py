"""Grow/shrink soak: an engine sleeping and waking its cache many times.

200 cycles of: grow -> replay of a step captured before the first grow (CUDA graph; the host
backend runs the same store calls) with every rank's tokens landing in the blocks committed in
that cycle -> shrink -> replay with tokens in the kept blocks and in the blocks just released
(skipped and counted). Every cycle checks the own replica byte for byte against the oracle
(``vmmkv.testing.kv``: the pure-torch reference); at the end the kept blocks must hold every
cycle's tokens, in order, and the out-of-range counter every released-block token. fds (every
fd, memfds, fds that are not sockets), host reservations, memfd mappings and device memory are
sampled each cycle at one point where every rank is idle: the last 20 samples may not exceed
the first 20 (device memory: by less than one granule).

``VMMKV_SOAK_CYCLES`` shortens the soak for local debugging only (every assertion still runs).
"""

from __future__ import annotations

import os

import pytest

from tests.helpers import KVStep, device_memory_in_use, fd_count, fds_not_sockets
from tests.test_faults import BACKENDS, _device, _granularity
from tests.test_rendezvous import _maps, _memfds
from vmmkv.testing.spawn import run_world

WORLD = 2
LAYERS = 1
WINDOW = 20  # cycles compared at the start and at the end
NEW_TOKENS, KEPT_TOKENS, GONE_TOKENS = 24, 12, 4  # per rank and step


def _cycles() -> int:
    return int(os.environ.get("VMMKV_SOAK_CYCLES", "200"))


def _sample(backend, device):
    out = {"fds": fd_count(), "not_sockets": fds_not_sockets(), "memfds": _memfds()}
    out["memfd_maps"], out["reservations"] = _maps()
    if backend == "cuda":
        out["memory"] = device_memory_in_use([device.index])[device.index]
    return out


def _soak(rank, world, backend, cycles):
    import torch
    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache

    device = _device(backend, rank, world)
    g = _granularity(backend, device)
    chunk = (1 if backend == "cuda" else 64) * g
    base, grown = 2 * chunk, 4 * chunk
    cache = ReplicatedKVCache(
        dist.group.WORLD, grown, device, chunk_bytes=chunk, initial_bytes=base, timeout=30.0,
        direct=True, backend=backend,
    )  # fmt: skip
    assert cache.direct, cache.why_not_direct
    kv = KVStep(cache, LAYERS, NEW_TOKENS)
    kept = kv.blocks(base)  # whole blocks of the kept prefix
    first, end = -(-base // kv.stride), kv.blocks(grown)  # whole blocks of the grown part only
    new_pool, kept_pool = kv.slot_range(first, end), kv.slot_range(0, kept)
    before_all = kv.poison(0, kept * kv.stride, seed=1000 + rank)
    dist.barrier()  # nobody writes into a replica before its owner poisoned it
    kv.step()  # eager warm-up (padding only) on every rank: loads the kernels
    graph = kv.capture() if backend == "cuda" else None  # before the first grow
    replay = graph.replay if graph is not None else kv.step
    history, samples, gone_tokens = [], [], 0
    for c in range(cycles):
        assert cache.grow(grown) == grown
        before = kv.poison(base, end * kv.stride, seed=10_000 * (rank + 1) + c)
        dist.barrier()
        slots = KVStep.spread(new_pool, world, NEW_TOKENS, seed=c)
        batches = [KVStep.batch(7 * c + 100_000 * (r + 1), slots[r]) for r in range(world)]
        kv.load(batches[rank])
        replay()
        kv.check(kv.expected(before, batches), f"cycle {c}: replay into the grown blocks")
        assert cache.shrink(base) == base
        kept_slots = KVStep.spread(kept_pool, world, KEPT_TOKENS, seed=c + 1)
        gone_slots = KVStep.spread(new_pool, world, GONE_TOKENS, seed=c + 2)
        batches = [
            KVStep.batch(7 * c + 200_000 * (r + 1), torch.cat([kept_slots[r], gone_slots[r]]))
            for r in range(world)
        ]
        kv.load(batches[rank])
        replay()
        history += batches  # the oracle of the kept blocks skips the released slots
        gone_tokens += GONE_TOKENS
        kv.sync()
        dist.barrier()  # every rank idle, at the same committed size
        samples.append(_sample(backend, device))
        dist.barrier()
    kv.check(kv.expected(before_all, history), f"after {cycles} cycles: the kept blocks")
    stats = cache.stats()
    cache.close()
    return samples, stats["out_of_range_slots"], 2 * LAYERS * gone_tokens, g


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_hundred_grow_replay_shrink_cycles_stay_byte_exact_and_leak_nothing(backend):
    cycles = _cycles()
    out = run_world(_soak, WORLD, args=(backend, cycles), timeout=540)
    for rank, (samples, skipped, want_skipped, g) in enumerate(out):
        assert len(samples) == cycles
        # every released-block token counted once per cache it targeted (MLA and indexer)
        assert skipped == want_skipped, (rank, skipped, want_skipped)
        head, tail = samples[:WINDOW], samples[-WINDOW:]
        for key in head[0]:
            slack = g if key == "memory" else 0
            first, last = max(s[key] for s in head), max(s[key] for s in tail)
            assert last <= first + slack, (rank, key, [s[key] for s in samples])
