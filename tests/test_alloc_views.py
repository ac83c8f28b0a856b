"""Views outlive close(): the address range stays reserved (and faults) until the last view dies.

Host backend (runs in CI). The stale write runs in a forked child so that its SIGSEGV is observed
instead of taking the test process down.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from tests.helpers import commit_random, map_all_chunks
from vmmkv.alloc import RegionClosedError, VirtualRegion, make_backend
from vmmkv.alloc import reservation as reservation_mod
from vmmkv.alloc.host import HostBackend, _mmap, _munmap, reservations

_PROT_NONE = 0x0
_MAP_PRIVATE = 0x02
_MAP_ANONYMOUS = 0x20
_MAP_FIXED_NOREPLACE = 0x100000


# _mmap/_munmap: the host backend's typed libc bindings, reused; the probe mapping is our own
def _range_is_free(ptr: int, size: int) -> bool:
    """True when nothing is mapped anywhere in [ptr, ptr + size): a probe mapping placed there
    with MAP_FIXED_NOREPLACE succeeds (and is removed again)."""
    flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED_NOREPLACE
    got = _mmap(ptr, size, _PROT_NONE, flags, -1, 0)
    if got is None or got == ctypes.c_void_p(-1).value:
        return False
    _munmap(got, size)
    if got != ptr:  # kernels before 4.17 ignore the flag and place the probe elsewhere
        pytest.skip("MAP_FIXED_NOREPLACE is not supported by this kernel")
    return True


def _g() -> int:
    return os.sysconf("SC_PAGE_SIZE")


def _committed_host_region(pages: int) -> VirtualRegion:
    """A host region of ``pages`` one-page chunks, all committed; the caller closes it."""
    g = _g()
    r = VirtualRegion(pages * g, "cpu", backend="host", chunk_bytes=g)
    r.commit(pages * g)
    return r


def test_a_view_alive_at_close_keeps_its_addresses_out_of_the_next_reservation():
    g = _g()
    a = _committed_host_region(64)
    stale = a.tensor()[: 64 * g]
    a_base = a.base_ptr
    a.close()
    with VirtualRegion(64 * g, "cpu", backend="host", chunk_bytes=g) as b:
        b.commit(64 * g)
        assert b.base_ptr != a_base
        assert b.base_ptr + 64 * g <= a_base or a_base + 64 * g <= b.base_ptr
        assert a_base in reservations()
    del stale


_STALE_WRITE = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from vmmkv.alloc import VirtualRegion

    torch.set_num_threads(1)  # the forked child below must not need a thread pool
    g = os.sysconf("SC_PAGE_SIZE")
    a = VirtualRegion(64 * g, "cpu", backend="host", chunk_bytes=g)
    a.commit(64 * g)
    stale = a.tensor()[: 64 * g]
    a.close()
    b = VirtualRegion(64 * g, "cpu", backend="host", chunk_bytes=g)
    b.commit(64 * g)
    gen = torch.Generator().manual_seed(11)
    data = torch.randint(1, 256, (64 * g,), generator=gen, dtype=torch.uint8)
    b.tensor()[: 64 * g].copy_(data)
    pid = os.fork()
    if pid == 0:  # b is a shared memfd mapping: a write landing in it is seen by the parent
        stale.fill_(0x5A)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
    intact = bool(torch.equal(b.tensor()[: 64 * g], data))
    print(f"signal={sig} intact={intact}")
    b.close()
    """
)


@pytest.mark.timeout(120)
def test_a_stale_write_after_close_faults_and_leaves_the_new_region_intact():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", _STALE_WRITE],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert out.returncode == 0, out.stderr
    assert f"signal={int(signal.SIGSEGV)} intact=True" in out.stdout, (out.stdout, out.stderr)


def test_the_reservation_is_freed_once_the_last_view_is_gone():
    g = _g()
    r = _committed_host_region(8)
    base = r.base_ptr
    view = r.tensor(torch.int32)
    part = view[g:]  # a slice shares the storage: it holds the range as well
    del view
    gc.collect()
    r.close()
    assert base in reservations() and not _range_is_free(base, 8 * g)
    del part
    gc.collect()
    assert base not in reservations()
    assert _range_is_free(base, 8 * g)


def test_close_without_live_views_frees_the_reservation_at_once():
    g = _g()
    r = VirtualRegion(8 * g, "cpu", backend="host", chunk_bytes=g)
    r.commit(4 * g)
    r.tensor()[:16].fill_(7)  # a view that died before close
    base = r.base_ptr
    r.close()
    assert base not in reservations()
    assert _range_is_free(base, 8 * g)


def test_a_peer_region_view_keeps_the_peer_range_reserved_after_close():
    g = _g()
    with VirtualRegion(4 * g, "cpu", backend="host", chunk_bytes=g) as r:
        r.commit(2 * g)
        peer = r.open_peer()
        map_all_chunks(r, peer)
        pview = peer.tensor()
        pbase = peer.base_ptr
        peer.close()
        assert peer.closed and pbase in reservations()
        with pytest.raises(RegionClosedError):
            peer.tensor()
        del pview
        gc.collect()
        assert pbase not in reservations()


def test_the_last_view_may_die_on_another_thread():
    r = _committed_host_region(4)
    base = r.base_ptr
    box = [r.tensor()]
    r.close()
    assert base in reservations()
    t = threading.Thread(target=box.clear)  # the deleter runs on this thread
    t.start()
    t.join()
    gc.collect()
    assert base not in reservations()


def test_views_made_and_dropped_on_many_threads_around_close_free_the_range_exactly_once():
    g = _g()
    r = _committed_host_region(4)
    base = r.base_ptr
    backend = r._backend
    real = backend.free_reservation
    frees: list[int] = []

    def counted(ptr, size):
        frees.append(ptr)
        real(ptr, size)

    backend.free_reservation = counted
    start = threading.Barrier(5)
    errors: list[BaseException] = []

    def churn():
        start.wait()
        for _ in range(300):
            try:
                v = r.tensor()[g:]
            except RegionClosedError:
                continue
            except BaseException as exc:  # anything else is a bug
                errors.append(exc)
                return
            del v

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    start.wait()
    r.close()
    for t in threads:
        t.join()
    gc.collect()
    assert not errors, errors
    assert frees == [base]
    assert base not in reservations()


def test_a_backend_that_cannot_free_from_any_thread_defers_the_free_to_the_next_reservation(
    monkeypatch,
):
    # The CUDA backend's policy (a driver call from a deleter could land in someone's stream
    # capture), exercised on the host backend.
    monkeypatch.setattr(HostBackend, "frees_from_any_thread", False)
    g = _g()
    r = _committed_host_region(4)
    base = r.base_ptr
    view = r.tensor()
    r.close()
    del view
    gc.collect()
    assert base in reservations() and not r._reservation.freed  # the deleter only queued it
    with VirtualRegion(4 * g, "cpu", backend="host", chunk_bytes=g) as r1:
        assert r._reservation.freed  # freed before the new reservation was made
        assert base not in reservations() or r1.base_ptr == base  # (which may reuse it)
    r2 = VirtualRegion(4 * g, "cpu", backend="host", chunk_bytes=g)
    view = r2.tensor()
    r2.close()
    del view
    gc.collect()
    assert r2._reservation.base in reservations()
    reservation_mod.free_deferred()
    assert r2._reservation.base not in reservations()


_EXIT_WITH_LIVE_VIEW = textwrap.dedent(
    """
    import os
    from vmmkv.alloc import VirtualRegion

    g = os.sysconf("SC_PAGE_SIZE")
    r = VirtualRegion(4 * g, "cpu", backend="host", chunk_bytes=g)
    r.commit(4 * g)
    view = r.tensor()  # still alive when the interpreter finalizes
    r.close()
    keep = VirtualRegion(4 * g, "cpu", backend="host", chunk_bytes=g)
    keep_view = keep.tensor()  # never closed
    print("done")
    """
)


@pytest.mark.timeout(120)
def test_views_alive_at_interpreter_exit_end_cleanly():
    out = subprocess.run(
        [sys.executable, "-c", _EXIT_WITH_LIVE_VIEW],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr
    assert "Exception ignored" not in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_views_still_read_and_write_the_committed_prefix_while_the_region_is_open():
    g = _g()
    with VirtualRegion(4 * g, "cpu", backend="host", chunk_bytes=g) as r:
        data = commit_random(r, 2 * g, 5)
        assert torch.equal(r.tensor()[: 2 * g], data)


@pytest.mark.gpu
def test_cuda_close_with_a_live_view_returns_device_memory_and_defers_the_range():
    g = make_backend(backend="cuda").granularity
    torch.empty(16 * g, dtype=torch.uint8, device="cuda").fill_(1)  # load the fill kernel first
    torch.cuda.synchronize()
    a = VirtualRegion(16 * g, backend="cuda", chunk_bytes=4 * g)
    used0 = a.memory_in_use()
    a.commit(16 * g)
    a.tensor()[: 16 * g].fill_(1)
    torch.cuda.synchronize()
    view = a.tensor()  # never touched after close: that would be an illegal-address fault
    base = a.base_ptr
    a.close()
    assert abs(a.memory_in_use() - used0) < g  # the chunks went back at close
    with VirtualRegion(16 * g, backend="cuda", chunk_bytes=4 * g) as b:
        assert b.base_ptr + 16 * g <= base or base + 16 * g <= b.base_ptr
        b.commit(16 * g)
        assert int(b.tensor()[: 16 * g].count_nonzero()) == 0
    del view
    gc.collect()
    assert not a._reservation.freed  # CUDA frees from a deleter wait for a safe point
    reservation_mod.free_deferred()
    assert a._reservation.freed
