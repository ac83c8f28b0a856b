"""The vLLM plugin's per-process state and its version error, shared by the plugin's modules: the
installer (``_install``: the patches and import hooks), the allocation sites (``_allocation``:
the active cache), the store sites (``_stores``: the pending records), the sleep-mode backend
(``_sleep``: the released record) and elastic mode's worker sites (``_elastic_worker``: they read
the active cache and retarget a released one). They import this module; it imports none of them.

:func:`close_active` closes the active cache (a new allocation, the runner's shutdown, vLLM's
``free`` of the extensible buffer, ``uninstall``); :func:`original` finds vLLM's own object
behind a patched site. Nothing else here closes anything.

Imports no vLLM module. Local, not thread-safe: vLLM's worker installs, allocates and sleeps
from one thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ... import _blockset as blockset

__all__ = ["UnsupportedVLLM", "active_cache", "close_active", "original"]

log = logging.getLogger(__name__)


class UnsupportedVLLM(RuntimeError):
    """The installed vLLM is not the release vmmkv's plugin is written for, or one of the sites
    it patches moved or changed its parameters (nothing was patched)."""


@dataclass
class _Pending:
    plan: Any  # StorePlan
    rows: torch.Tensor  # the first input the replaced gather returned


@dataclass
class _Released:
    """A KV cache the sleep-mode backend released (sleep, discard) and the blocks a wake
    restores: the committed blocks before, or the last elastic target applied while released.
    ``blocks`` is the top of that set; ``block_set`` the set itself when it has holes (the
    wake then commits exactly it), else None (the prefix ``[0, blocks)``)."""

    cache: Any  # VllmKVCache
    blocks: int
    block_set: tuple[tuple[int, int], ...] | None = None

    @property
    def committed(self) -> int | tuple[tuple[int, int], ...]:
        """What a wake restores, as a worker's stamp reports it (an int for a prefix)."""
        return self.blocks if self.block_set is None else self.block_set

    def set_committed(self, blocks: tuple[tuple[int, int], ...]) -> None:
        """Restore the canonical block set ``blocks`` at the wake."""
        self.blocks = blockset.top(blocks)
        self.block_set = None if blockset.as_prefix(blocks) is not None else blocks


ABSENT = object()  # a patch's original where the plugin adds the attribute


@dataclass
class _Patch:
    owner: Any
    name: str
    original: Any
    replacement: Any


class _State:
    def __init__(self) -> None:
        self.patches: list[_Patch] = []
        self.engine_patches: list[_Patch] = []  # elastic mode's, in the engine core
        self.active: Any = None  # the process's VllmKVCache, once allocated
        self.pending: dict[str, _Pending] = {}
        self.released: _Released | None = None  # written by _sleep, read by _elastic_worker
        self.hook: Any = None  # the import hook of install_when_worker_starts, until it fires
        self.engine_hook: Any = None  # install_when_engine_core_loads', until it fires
        # (kv_cache_config, layout) while vLLM builds an ExtensibleKVCache
        self.extensible_spec: Any = None
        # a weak reference to the ExtensibleKVCache over the active cache (_allocation):
        # elastic mode keeps vLLM's count of committed blocks equal to vmmkv's
        self.extensible: Any = None


_STATE = _State()


def active_cache() -> Any:
    """The :class:`VllmKVCache` the plugin allocated in this process, or None."""
    return _STATE.active


def close_active(why: str) -> None:
    """Close the process's cache (local, idempotent): pending records dropped, views invalid."""
    _STATE.pending.clear()
    cache, _STATE.active = _STATE.active, None
    if cache is not None:
        log.info("vmmkv: rank %d closes its KV cache (%s)", cache.rank, why)
        cache.close()


def original(owner: Any, name: str) -> Any:
    """vLLM's own object behind a patched ``owner.name`` (for tests and debugging)."""
    for p in _STATE.patches + _STATE.engine_patches:
        if p.owner is owner and p.name == name:
            return p.original
    return getattr(owner, name)
