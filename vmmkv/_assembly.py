"""The construction of a :class:`vmmkv.ReplicatedKVCache`: the settings every rank must share,
the :class:`vmmkv.ipc.SymmetricRegion`, the two paths and their dispatch, the region's views,
then one agreement: every rank keeps a cache, or none does.

Contract: :func:`assemble` is collective over ``cpu_group`` (the region's rendezvous, then the
agreement) and not capture-safe. A caller's bad argument is refused before any driver call
(``check_cpu_group``, ``shared_settings``, the region's own checks): the rank that passed it
raises its own ``ValueError``/``TypeError``, the others a ``RendezvousError`` naming it. A
local failure after the region exists (a path's setup) is agreed on, so every rank raises. On
any failure nothing stays open on this rank (the direct path, then the region, are closed
before the error propagates). On success the returned :class:`Parts` belong to the cache,
which closes them (paths, region, views) in its ``close``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from . import ops
from ._dispatch import StoreDispatch
from ._out_of_range import OutOfRange
from ._selection import barrier_trap, log_selection, shared_settings, why_not_direct
from ._util import require_timeout, run_all
from ._views import RegionViews
from .direct import DirectPath
from .gather import GatherPath
from .ipc import ConfigMismatch, SymmetricRegion
from .ipc.comm import check_cpu_group

__all__ = ["Parts", "assemble"]


@dataclass(frozen=True)
class Parts:
    """What a cache is made of, all built and agreed on every rank."""

    region: SymmetricRegion
    mode_requested: str  # 'auto', '1' or '0': the direct= argument, or VMMKV_DIRECT
    why_not_direct: str  # '' when every rank mapped every peer
    out_of_range: OutOfRange
    stores: StoreDispatch  # owns the paths
    views: RegionViews  # holds the whole-region view


def assemble(
    cpu_group: Any,
    capacity_bytes: int,
    device: Any,
    *,
    device_group: Any,
    initial_bytes: int | None,
    chunk_bytes: int | None,
    run_bytes: int | None,
    lanes: int,
    direct: bool | None,
    timeout: float,
    barrier_timeout: float | None,
    backend: str,
    log: logging.Logger,
) -> Parts:
    """Collective: build a cache's parts (the constructor's arguments, see
    :class:`vmmkv.ReplicatedKVCache`); ``log`` gets the selection line."""
    check_cpu_group(cpu_group)
    timeout = require_timeout("timeout", timeout)
    match, error = shared_settings(direct, lanes, barrier_timeout)
    mode = match["direct"]
    try:
        sr = SymmetricRegion(
            capacity_bytes, device, cpu_group, initial_bytes=initial_bytes or 0,
            chunk_bytes=chunk_bytes, run_bytes=run_bytes, backend=backend, timeout=timeout,
            must_match=match, peers="auto" if mode in ("auto", "1") else "off",
        )  # fmt: skip
    except ConfigMismatch as exc:
        if error is not None:
            raise error from exc  # this rank's own setting is the cause
        raise
    if error is not None:  # every rank has the same bad setting
        sr.close()
        raise error
    why = why_not_direct(sr, mode)
    error, direct_path = None, None
    try:  # local setup, then one agreement: every rank keeps a cache, or none does
        out_of_range = OutOfRange(sr.rank, sr.device, log)
        # the whole own region, committed or not: KVTarget.cache, the barrier's fence
        fence = sr.view(sr.rank, reserve=True)
        if sr.device.type == "cuda":
            # Load every kernel now: a module loaded lazily while a barrier spins would wait
            # for that barrier, and loading is not capture-safe.
            ops.warm_up(sr.device)
        gather = GatherPath(
            sr.rank, sr.world_size, sr.device, sr.local_table, cpu_group, device_group,
            timeout, match["check_padding"],
        )  # fmt: skip
        if sr.mapped:
            direct_path = DirectPath(
                sr, fence, lanes, match["barrier_timeout"], barrier_trap=barrier_trap()
            )
    except Exception as exc:
        error = exc
    try:
        sr.agree(error, "cache setup")
    except BaseException:
        run_all(([direct_path.close] if direct_path else []) + [sr.close])
        raise
    stores = StoreDispatch(
        gather, direct_path, lanes=lanes, rank=sr.rank, device=sr.device, why_not_direct=why
    )
    views = RegionViews(sr, fence, out_of_range.counter, stores.paths)
    log_selection(log, sr.mapped, sr.world_size, why, mode)
    return Parts(sr, mode, why, out_of_range, stores, views)
