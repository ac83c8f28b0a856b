"""Small helpers shared by several test files (one copy each, instead of one per file).

Local, not collective; nothing here is capture-safe or meant for production. Every helper that
opens an fd closes it before returning; the fault injectors return the function that undoes them.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)


def fd_count() -> int:
    """How many fds this process holds now."""
    return len(os.listdir("/proc/self/fd"))


def random_bytes(n: int, seed: int, device="cpu") -> torch.Tensor:
    """``n`` random bytes in 1..255 (never zero, so an unwritten, zeroed byte can never pass for
    a written one), drawn on the CPU from ``seed`` and then moved to ``device``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (n,), generator=gen, dtype=torch.uint8).to(device)


def commit_random(region, nbytes: int, seed: int) -> torch.Tensor:
    """Commit the first ``nbytes`` of ``region`` and fill them with ``random_bytes(nbytes, seed)``;
    returns those bytes (on the region's device)."""
    region.commit(nbytes)
    data = random_bytes(nbytes, seed, region.device)
    region.tensor()[:nbytes].copy_(data)
    return data


def map_all_chunks(region, peer) -> None:
    """Export every committed chunk of ``region`` and map it into ``peer`` (a PeerRegion of it),
    closing each exported fd whether or not the mapping succeeds."""
    for c in region.chunks():
        fd = region.export_chunk(c)
        try:
            peer.map_fd(fd, c)
        finally:
            os.close(fd)


def struct_offset_checks(struct: str, header: str, fields: list[str], sizes: list[int]) -> str:
    """CUDA source that includes ``header`` and static_asserts that the fields of
    ``vmmkv::<struct>`` sit at the offsets the packed ``sizes`` give (as the host mirror packs)."""
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    checks = "\n".join(
        f'static_assert(__builtin_offsetof(vmmkv::{struct}, {f}) == {o}, "{f}");'
        for f, o in zip(fields, offsets, strict=True)
    )
    return f'#include "{header}"\n' + checks + "\n"


def fail_peer_mapping_on(rank_to_fail: int, rank: int):
    """On ``rank_to_fail`` (this process being ``rank``) make every ``PeerRegion.map_fd`` raise a
    CudaError "injected mapping failure"; other ranks are untouched. Returns the undo."""
    from vmmkv.alloc import CudaError, PeerRegion

    real = PeerRegion.map_fd
    if rank == rank_to_fail:

        def fail(self, fd, chunk):
            raise CudaError("cuMemMap", None, "injected mapping failure", {"rank": rank})

        PeerRegion.map_fd = fail
    return lambda: setattr(PeerRegion, "map_fd", real)
