"""vmmkv: replicated KV-cache memory for prefill context parallelism.

Layers (see DESIGN in the repository): ``vmmkv.alloc`` (driver calls, regions), ``vmmkv.ipc``
(fd passing, rendezvous, collective resize), ``vmmkv.ops`` (NVRTC-built kernels, reference
quantizers). Import what you need from the subpackages; the top level re-exports the public API.
"""

__version__ = "0.1.0"
