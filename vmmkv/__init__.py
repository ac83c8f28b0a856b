"""vmmkv: replicated KV-cache memory for prefill context parallelism.

Layers: ``vmmkv.alloc`` (driver calls, regions), ``vmmkv.ipc`` (fd passing, rendezvous,
collective resize), ``vmmkv.ops`` (NVRTC-built kernels, reference quantizers), and the
engine-facing :class:`ReplicatedKVCache`. Environment variables: see README.md.

The names below load on first use, so that torch-free pieces (``vmmkv.ipc.fdpass``) import
without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

_LAZY = {
    "CudaError": "vmmkv.alloc",
    "VirtualRegion": "vmmkv.alloc",
    "Binding": "vmmkv.cache",
    "ReplicatedKVCache": "vmmkv.cache",
    "DirectUnsupported": "vmmkv.ipc",
    "GroupError": "vmmkv.ipc",
    "PeerMap": "vmmkv.ipc",
    "RendezvousError": "vmmkv.ipc",
    "SymmetricRegion": "vmmkv.ipc",
    "rendezvous": "vmmkv.ipc",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vmmkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
