"""vmmkv.ipc: fd passing, ``rendezvous()``, peer maps and the collective resize protocol.

Knows nothing of kernels or KV formats. Collective entry points take a CPU-capable
(gloo) ``torch.distributed`` group; every step is bounded by a timeout and a failure on any rank
raises on every rank.
"""

from __future__ import annotations

import importlib
from typing import Any

# Loaded on first use: ``vmmkv.ipc.fdpass`` stays importable without torch (its spawned test
# children, and tools that only pass fds, skip the multi-second torch import).
_LAZY = {
    "GroupError": "comm",
    "PeerTimeoutError": "comm",
    "StepAborted": "comm",
    "ConfigMismatch": "peers",
    "DirectUnsupported": "peers",
    "PeerMap": "peers",
    "RendezvousError": "peers",
    "RendezvousTimeout": "peers",
    "rendezvous": "peers",
    "RendezvousTypeError": "symmetric",
    "RendezvousValueError": "symmetric",
    "SymmetricRegion": "symmetric",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vmmkv.ipc' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = sorted(_LAZY)
