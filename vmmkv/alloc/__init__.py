"""vmmkv.alloc: the driver layer and the region (knows nothing of process groups or kernels).

- ``VirtualRegion``: stable VA reservation of full capacity, committed chunks that grow and
  shrink (a prefix, or ranges), backed by runs (one exportable physical allocation per stretch
  of chunks a commit adds), DLPack views. CUDA backend (VMM) or host
  backend (memfd + mmap), chosen by ``backend="auto"``; nothing above this package branches on
  the backend.
- ``PeerRegion``: a reservation into which a peer's exported runs are mapped.
- ``geometry``: the chunk grid and the runs a commit creates, as pure functions.
- ``Backend``: the interface both backends implement (``backend.py``).
- ``CudaError``: every failed driver call, naming the call, the CUresult and the context.
- ``UnmapError``: an unmap that failed part-way, naming the runs still mapped.

Views keep the address range reserved: touching them after ``close()`` faults; CUDA graphs that
captured the addresses must not be replayed after ``close()``.
"""

from __future__ import annotations

import importlib
from typing import Any

# The names below load on first use, so that ``vmmkv.alloc.driver`` imports without torch (the
# CLI asks it whether CUDA is usable before it imports torch).
_LAZY = {
    "Backend": "backend",
    "CudaError": "driver",
    "cuda_usable": "driver",
    "primary_context": "driver",
    "Chunk": "geometry",
    "PeerRegion": "mapped",
    "RegionClosedError": "mapped",
    "UnmapError": "mapped",
    "VirtualRegion": "region",
    "make_backend": "region",
}

__all__ = [
    "Backend",
    "Chunk",
    "CudaError",
    "PeerRegion",
    "RegionClosedError",
    "UnmapError",
    "VirtualRegion",
    "cuda_usable",
    "make_backend",
    "primary_context",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
