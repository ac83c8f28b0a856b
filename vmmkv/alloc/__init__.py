"""vmmkv.alloc: the driver layer and the region (knows nothing of process groups or kernels).

- ``VirtualRegion``: stable VA reservation of full capacity, growable committed prefix,
  exportable chunks, DLPack views. CUDA backend (VMM) or host backend (memfd + mmap), chosen by
  ``backend="auto"``; nothing above this package branches on the backend.
- ``PeerRegion``: a reservation into which a peer's exported chunks are mapped.
- ``CudaError``: every failed driver call, naming the call, the CUresult and the context.
"""

from .driver import CudaError, cuda_usable, primary_context
from .region import Chunk, PeerRegion, RegionClosedError, VirtualRegion, make_backend

__all__ = [
    "Chunk",
    "CudaError",
    "PeerRegion",
    "RegionClosedError",
    "VirtualRegion",
    "cuda_usable",
    "make_backend",
    "primary_context",
]
