"""vmmkv.alloc: the driver layer and the region (knows nothing of process groups or kernels).

- ``VirtualRegion``: stable VA reservation of full capacity, committed chunks that grow and
  shrink (a prefix, or ranges), exportable chunks, DLPack views. CUDA backend (VMM) or host
  backend (memfd + mmap), chosen by ``backend="auto"``; nothing above this package branches on
  the backend.
- ``PeerRegion``: a reservation into which a peer's exported chunks are mapped.
- ``Backend``: the interface both backends implement (``backend.py``).
- ``CudaError``: every failed driver call, naming the call, the CUresult and the context.
- ``UnmapError``: an unmap that failed part-way, naming the chunks still mapped.

Views keep the address range reserved: touching them after ``close()`` faults; CUDA graphs that
captured the addresses must not be replayed after ``close()``.
"""

from .backend import Backend
from .driver import CudaError, cuda_usable, primary_context
from .region import (
    Chunk,
    PeerRegion,
    RegionClosedError,
    UnmapError,
    VirtualRegion,
    make_backend,
)

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
