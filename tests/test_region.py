"""VirtualRegion: lifecycle, growth/shrink against a model, views, errors, no leaks.

Runs on the host backend everywhere and on the CUDA backend where a GPU is usable (marker gpu).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import commit_random, fd_count, map_all_chunks, random_bytes
from vmmkv.alloc import Chunk, RegionClosedError, VirtualRegion, make_backend

BACKENDS = ["host", pytest.param("cuda", marks=pytest.mark.gpu)]


def _gran(backend: str) -> int:
    return make_backend(backend=backend).granularity


@pytest.mark.parametrize("backend", BACKENDS)
def test_base_pointer_never_moves_across_commit_and_decommit(backend):
    g = _gran(backend)
    with VirtualRegion(8 * g, backend=backend, chunk_bytes=2 * g) as r:
        base = r.base_ptr
        assert r.committed_bytes == 0 and r.capacity_bytes == 8 * g and r.chunk_bytes == 2 * g
        r.commit(3 * g)  # rounds up to two chunks
        assert r.committed_bytes == 4 * g
        assert r.chunks() == [Chunk(0, 2 * g), Chunk(2 * g, 2 * g)]
        r.decommit(1)
        assert r.committed_bytes == 2 * g
        r.commit(8 * g)
        assert r.committed_bytes == 8 * g and r.base_ptr == base
        assert r.tensor().data_ptr() == base


@pytest.mark.parametrize("backend", BACKENDS)
def test_new_bytes_are_zero_and_kept_prefix_survives_shrink(backend):
    g = _gran(backend)
    with VirtualRegion(4 * g, backend=backend, chunk_bytes=g) as r:
        r.commit(4 * g)
        t = r.tensor()
        data = random_bytes(4 * g, 1, t.device)
        t.copy_(data)
        r.decommit(2 * g)
        assert torch.equal(t[: 2 * g].cpu(), data[: 2 * g].cpu())
        r.commit(4 * g)
        assert torch.equal(t[: 2 * g].cpu(), data[: 2 * g].cpu())
        assert int(t[2 * g :].count_nonzero()) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_views_have_the_requested_dtype_device_and_size(backend):
    g = _gran(backend)
    with VirtualRegion(2 * g, backend=backend) as r:
        for dtype in (torch.uint8, torch.int32, torch.bfloat16, torch.int64):
            v = r.tensor(dtype)
            assert v.dtype == dtype and v.device == r.device
            assert v.numel() * v.element_size() == 2 * g and v.data_ptr() == r.base_ptr


@pytest.mark.parametrize("backend", BACKENDS)
def test_exported_chunk_maps_into_a_peer_region_with_the_same_bytes(backend):
    g = _gran(backend)
    before = fd_count()
    with VirtualRegion(4 * g, backend=backend, chunk_bytes=g) as r, r.open_peer() as peer:
        data = commit_random(r, 2 * g, 2)
        map_all_chunks(r, peer)
        assert peer.mapped_bytes == 2 * g and peer.base_ptr != r.base_ptr
        assert torch.equal(peer.tensor()[: 2 * g].cpu(), data.cpu())
        peer.tensor()[:16].fill_(3)  # writes through the peer mapping reach the owner
        r.synchronize()
        assert r.tensor()[:16].cpu().tolist() == [3] * 16
        assert peer.unmap_from(g) == [Chunk(g, g)]
        # peer mappings are a chunk set: a mapping over a mapped chunk or past the capacity is
        # refused, one past a hole is taken (the same memory seen at a second place)
        fd = r.export_chunk(r.chunks()[0])
        try:
            with pytest.raises(ValueError, match="overlaps the mapped"):
                peer.map_fd(fd, Chunk(0, g))
            with pytest.raises(ValueError, match="outside capacity"):
                peer.map_fd(fd, Chunk(4 * g, g))
            peer.map_fd(fd, Chunk(3 * g, g))
        finally:
            os.close(fd)
        assert peer.chunks() == [Chunk(0, g), Chunk(3 * g, g)] and peer.mapped_bytes == 2 * g
        assert torch.equal(peer.tensor()[3 * g : 4 * g].cpu(), peer.tensor()[:g].cpu())
        assert peer.unmap_outside([(3 * g, 3 * g + 1)]) == [Chunk(0, g)]
        assert peer.unmap_from(0) == [Chunk(3 * g, g)]
    assert fd_count() == before


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_is_idempotent_and_every_method_fails_afterwards(backend):
    g = _gran(backend)
    before = fd_count()
    r = VirtualRegion(2 * g, backend=backend)
    r.commit(2 * g)
    r.close()
    r.close()
    assert r.closed
    for op in (
        lambda: r.commit(g),
        lambda: r.decommit(0),
        lambda: r.tensor(),
        lambda: r.chunks(),
        lambda: r.base_ptr,
        lambda: r.open_peer(),
    ):
        with pytest.raises(RegionClosedError, match="closed"):
            op()
    assert fd_count() == before


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_sizes_raise_and_name_the_granularity(backend):
    g = _gran(backend)
    with pytest.raises(ValueError, match=f"granularity {g}"):
        VirtualRegion(g + 1, backend=backend)
    with pytest.raises(ValueError, match="> 0"):
        VirtualRegion(0, backend=backend)
    with pytest.raises(TypeError):
        VirtualRegion(float(g), backend=backend)
    with pytest.raises(ValueError, match=f"granularity {g}"):
        VirtualRegion(4 * g, backend=backend, chunk_bytes=g + 1)
    with pytest.raises(ValueError, match="exceeds"):
        VirtualRegion(2 * g, backend=backend, chunk_bytes=4 * g)
    with VirtualRegion(2 * g, backend=backend) as r:
        with pytest.raises(ValueError, match="outside"):
            r.commit(3 * g)
        with pytest.raises(ValueError, match="outside"):
            r.decommit(-1)
        with pytest.raises(TypeError):
            r.commit(True)
        with pytest.raises(ValueError, match="not committed"):
            r.export_chunk(Chunk(0, g))


def test_default_chunk_is_a_64th_of_capacity_rounded_to_granularity():
    g = _gran("host")
    with VirtualRegion(640 * g, backend="host") as r:
        assert r.chunk_bytes == 10 * g
    with VirtualRegion(65 * g, backend="host") as r:
        assert r.chunk_bytes == 2 * g  # ceil(65/64) granules


def test_unknown_backend_and_device_are_rejected():
    with pytest.raises(ValueError, match="backend"):
        VirtualRegion(1 << 20, backend="tpu")
    with pytest.raises(ValueError, match="cpu"):
        VirtualRegion(1 << 20, device="cuda:0", backend="host")
    with pytest.raises(TypeError):
        VirtualRegion(1 << 20, device=1.5)


def test_fd_count_returns_to_baseline_after_a_full_lifecycle_on_host():
    g = _gran("host")
    before = fd_count()
    for _ in range(3):
        r = VirtualRegion(16 * g, backend="host", chunk_bytes=g)
        r.commit(16 * g)
        assert fd_count() == before + 16  # one memfd kept per exportable chunk
        r.decommit(4 * g)
        assert fd_count() == before + 4
        r.close()
    assert fd_count() == before


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("commit"), st.integers(0, 12)),
        st.tuples(st.just("decommit"), st.integers(0, 12)),
        st.tuples(st.just("write"), st.integers(0, 12 * 64 - 1), st.integers(1, 300)),
    ),
    min_size=1,
    max_size=25,
)


def _model_check(backend: str, ops) -> None:
    """Drive a region and a bytearray model with the same ops; compare after every step. Ops
    count in half granules; chunks are two granules."""
    gran = _gran(backend)
    unit = gran // 2
    chunk = 2 * gran
    cap = 6 * chunk
    model = bytearray()
    with VirtualRegion(cap, backend=backend, chunk_bytes=chunk) as r:
        t = r.tensor()
        for step, op in enumerate(ops):
            if op[0] == "commit":
                n = op[1] * unit
                r.commit(min(n, cap))
                want = max(len(model), -(-min(n, cap) // chunk) * chunk)
                model.extend(bytes(want - len(model)))
            elif op[0] == "decommit":
                n = op[1] * unit
                r.decommit(min(n, cap))
                keep = max(-(-min(n, cap) // chunk) * chunk, 0)
                del model[min(keep, len(model)) :]
            else:
                if not model:
                    continue
                off = (op[1] * unit // 64) % len(model)
                ln = min(op[2], len(model) - off)
                data = random_bytes(ln, step, "cpu")
                t[off : off + ln].copy_(data.to(t.device))
                model[off : off + ln] = bytes(data.tolist())
            assert r.committed_bytes == len(model)
            if model:
                got = t[: len(model)].cpu()
                assert torch.equal(got, torch.frombuffer(bytearray(model), dtype=torch.uint8))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_OPS)
def test_commit_decommit_and_writes_match_a_bytearray_model_on_host(ops):
    _model_check("host", ops)


@pytest.mark.gpu
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_OPS)
def test_commit_decommit_and_writes_match_a_bytearray_model_on_cuda(ops):
    _model_check("cuda", ops)


# --------------------------------------------------------------------------------------------
# CUDA only
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_device_memory_returns_to_baseline_after_close():
    g = _gran("cuda")
    torch.cuda.synchronize()
    r0 = VirtualRegion(64 * g, backend="cuda", chunk_bytes=4 * g)
    base_used = r0.memory_in_use()
    r0.commit(64 * g)
    assert r0.memory_in_use() - base_used >= 64 * g - g
    r0.decommit(16 * g)
    r0.close()
    r1 = VirtualRegion(g, backend="cuda")
    after = r1.memory_in_use()
    r1.close()
    assert abs(after - base_used) < g


@contextlib.contextmanager
def _cuda_region_with_one_chunk():
    """A CUDA region of four one-granule chunks with the first committed: yields the
    granularity, the region and its full-range tensor view; closes the region after."""
    g = _gran("cuda")
    with VirtualRegion(4 * g, backend="cuda", chunk_bytes=g) as r:
        r.commit(g)
        yield g, r, r.tensor()


@pytest.mark.gpu
def test_commit_and_decommit_refuse_during_stream_capture():
    with _cuda_region_with_one_chunk() as (g, r, t):
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            graph.capture_begin()
            try:
                t[:16].fill_(1)
                with pytest.raises(RuntimeError, match="capture"):
                    r.commit(2 * g)
                with pytest.raises(RuntimeError, match="capture"):
                    r.decommit(0)
            finally:
                graph.capture_end()
        assert r.committed_bytes == g


@pytest.mark.gpu
def test_graph_captured_over_uncommitted_addresses_replays_after_commit_and_recommit():
    with _cuda_region_with_one_chunk() as (g, r, t):
        n = 3 * g  # the captured copy spans two chunks that are not committed yet
        src = random_bytes(n, 7, r.device)
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            graph.capture_begin()
            # a kernel, not copy_: a memcpy node is validated against the (unmapped) range at
            # capture time and fails; kernels only touch memory when they run
            torch.add(src, 0, out=t[:n])
            graph.capture_end()
        torch.cuda.current_stream().wait_stream(s)
        r.commit(n)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(t[:n], src)
        # new physical memory at the same addresses: zero first, then the replay refills it
        r.decommit(g)
        r.commit(n)
        assert int(t[g:n].count_nonzero()) == 0
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(t[:n], src)
