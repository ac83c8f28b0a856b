"""An unmap that fails half-way keeps the mapped chunks a contiguous prefix, says what is still
mapped, and is retried later (host backend, failures injected into the backend)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import commit_random, fd_count, map_all_chunks
from vmmkv.alloc import Chunk, UnmapError, VirtualRegion
from vmmkv.alloc.host import HostError, reservations


def _g() -> int:
    return os.sysconf("SC_PAGE_SIZE")


def _mapped_offsets(base: int, size: int, g: int) -> set[int]:
    """Offsets (in pages) inside [base, base + size) that /proc/self/maps shows as a readable
    and writable shared mapping."""
    pages: set[int] = set()
    with open("/proc/self/maps") as f:
        for line in f:
            rng, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in rng.split("-"))
            if perms.startswith("rw") and perms[3] == "s":
                for p in range(max(lo, base), min(hi, base + size), g):
                    pages.add((p - base) // g)
    return pages


def _fail_unmap_at(region, ptrs: set[int]):
    """Make the region's backend fail to unmap at the addresses in ``ptrs`` (the mapping stays,
    as with a real failed mmap/cuMemUnmap); returns a function that removes the fault."""
    backend = region._backend
    real = backend.unmap

    def flaky(ptr, size):
        if ptr in ptrs:
            raise HostError(12, f"injected unmap failure at {ptr:#x}")
        return real(ptr, size)

    backend.unmap = flaky
    return lambda: setattr(backend, "unmap", real)


def _fail_map_at(region, ptr: int):
    """Make the region's backend fail to map at ``ptr`` (the handle released, nothing mapped,
    as with a real failed map); returns a function that removes the fault."""
    backend = region._backend
    real = backend.map

    def flaky(p, size, handle, *, exportable=False):
        if p == ptr:
            backend.release(handle)
            raise HostError(12, "injected map failure")
        return real(p, size, handle, exportable=exportable)

    backend.map = flaky
    return lambda: setattr(backend, "map", real)


def test_a_decommit_whose_unmap_fails_in_the_middle_leaves_a_contiguous_prefix():
    g = _g()
    with VirtualRegion(8 * g, "cpu", backend="host", chunk_bytes=g) as r:
        data = commit_random(r, 6 * g, 3)
        heal = _fail_unmap_at(r, {r.base_ptr + 4 * g})
        with pytest.raises(UnmapError, match="still mapped") as info:
            r.decommit(2 * g)  # drops 5, then fails at 4: 2 and 3 must stay
        heal()
        assert info.value.unmapped == [Chunk(5 * g, g)]
        assert info.value.still_mapped == [Chunk(o * g, g) for o in (2, 3, 4)]
        assert isinstance(info.value.__cause__, HostError)
        assert [c.offset // g for c in r.chunks()] == [0, 1, 2, 3, 4]
        assert r.committed_bytes == 5 * g
        assert _mapped_offsets(r.base_ptr, 8 * g, g) == {0, 1, 2, 3, 4}
        assert torch.equal(r.tensor()[: 5 * g], data[: 5 * g])
        # the retry drops what the failure kept; a later commit refills from the prefix end
        assert r.decommit(2 * g) == [Chunk(o * g, g) for o in (2, 3, 4)]
        assert r.commit(6 * g) == [Chunk(o * g, g) for o in range(2, 6)]
        assert _mapped_offsets(r.base_ptr, 8 * g, g) == set(range(6))
        assert torch.equal(r.tensor()[: 2 * g], data[: 2 * g])
        assert int(r.tensor()[2 * g : 6 * g].count_nonzero()) == 0


def test_commit_after_a_failed_decommit_starts_at_the_end_of_the_prefix():
    g = _g()
    with VirtualRegion(8 * g, "cpu", backend="host", chunk_bytes=g) as r:
        r.commit(6 * g)
        heal = _fail_unmap_at(r, {r.base_ptr + 4 * g})
        with pytest.raises(UnmapError):
            r.decommit(2 * g)
        heal()
        assert r.commit(6 * g) == [Chunk(5 * g, g)]
        assert [c.offset // g for c in r.chunks()] == list(range(6))
        assert _mapped_offsets(r.base_ptr, 8 * g, g) == set(range(6))


def test_a_peer_unmap_that_fails_in_the_middle_keeps_the_mapped_prefix_and_map_fd_extends_it():
    g = _g()
    with VirtualRegion(6 * g, "cpu", backend="host", chunk_bytes=g) as r, r.open_peer() as peer:
        data = commit_random(r, 6 * g, 4)
        map_all_chunks(r, peer)
        heal = _fail_unmap_at(r, {peer.base_ptr + 3 * g})
        with pytest.raises(UnmapError, match="still mapped") as info:
            peer.unmap_from(g)
        heal()
        assert info.value.still_mapped == [Chunk(o * g, g) for o in (1, 2, 3)]
        assert peer.mapped_bytes == 4 * g
        assert [c.offset // g for c in peer.chunks()] == [0, 1, 2, 3]
        assert _mapped_offsets(peer.base_ptr, 6 * g, g) == {0, 1, 2, 3}
        assert torch.equal(peer.tensor()[: 4 * g], data[: 4 * g])
        fd = r.export_chunk(r.chunks()[4])
        try:
            peer.map_fd(fd, Chunk(4 * g, g))  # the prefix check accepts the real prefix end
        finally:
            os.close(fd)
        assert peer.mapped_bytes == 5 * g
        assert peer.unmap_from(g) == [Chunk(o * g, g) for o in range(1, 5)]
        assert peer.mapped_bytes == g


def test_a_failed_commit_whose_rollback_also_fails_records_what_stays_mapped():
    g = _g()
    before = fd_count()
    with VirtualRegion(8 * g, "cpu", backend="host", chunk_bytes=g) as r:
        r.commit(2 * g)
        heal_map = _fail_map_at(r, r.base_ptr + 5 * g)
        heal = _fail_unmap_at(r, {r.base_ptr + 3 * g})
        with pytest.raises(HostError, match="injected map failure"):  # the commit's own error
            r.commit(8 * g)
        heal()
        heal_map()
        # chunk 4 was rolled back; 2 and 3 stay mapped, recorded as committed
        assert [c.offset // g for c in r.chunks()] == [0, 1, 2, 3]
        assert r.committed_bytes == 4 * g
        assert _mapped_offsets(r.base_ptr, 8 * g, g) == {0, 1, 2, 3}
        assert r.decommit(0) == [Chunk(o * g, g) for o in range(4)]
        assert _mapped_offsets(r.base_ptr, 8 * g, g) == set()
        assert r.commit(8 * g) == [Chunk(o * g, g) for o in range(8)]
        assert int(r.tensor()[: 8 * g].count_nonzero()) == 0
    assert fd_count() == before


def test_close_with_a_failing_unmap_raises_and_a_second_close_finishes_the_job():
    g = _g()
    before = fd_count()
    r = VirtualRegion(4 * g, "cpu", backend="host", chunk_bytes=g)
    r.commit(4 * g)
    base = r.base_ptr
    heal = _fail_unmap_at(r, {base + g})
    with pytest.raises(UnmapError, match="still mapped") as info:
        r.close()
    heal()
    # close tries every chunk (memory goes back at once); only the failed one stays
    assert info.value.still_mapped == [Chunk(g, g)]
    assert r.closed and base in reservations()
    assert _mapped_offsets(base, 4 * g, g) == {1}
    r.close()
    assert base not in reservations()
    assert fd_count() == before
    r.close()  # idempotent once everything is released
