"""The settings of :class:`vmmkv.ReplicatedKVCache` that every rank must share, and what its
path selection says.

- ``shared_settings(direct, lanes, barrier_timeout)``: the constructor's arguments and their
  environment variables (``VMMKV_DIRECT``, ``VMMKV_BARRIER_TIMEOUT``, ``VMMKV_CHECK_PADDING``,
  each read by ``vmmkv._env``) resolved into the dict the region's rendezvous compares across ranks (``must_match``), plus
  this rank's first invalid one.
- ``resolve_direct``: ``auto``, ``1`` or ``0`` (also ``vmmkv.cache.resolve_direct``).
- ``barrier_trap``: ``VMMKV_BARRIER_TRAP`` (local, not compared).
- ``why_not_direct`` / ``log_selection``: the reason the cache gathers, and the one INFO line
  (or RuntimeWarning + WARNING when direct was asked for) that reports the selection.

Local, host only: no collective, no device work, nothing to close. Messages go to the logger
the caller passes (the cache's, ``vmmkv.cache``).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from . import _env
from ._util import require_int, require_timeout

__all__ = ["barrier_trap", "log_selection", "resolve_direct", "shared_settings", "why_not_direct"]


def _barrier_timeout(value: float | None) -> float:
    """The host timeout of a barrier wait (docs/design.md "Barrier"): 600 s unless given or set
    by ``VMMKV_BARRIER_TIMEOUT``; the device diagnostic comes after min(10 s, it)."""
    if value is None:
        return _env.barrier_timeout()
    return require_timeout("barrier_timeout", value)


def shared_settings(direct, lanes, barrier_timeout) -> tuple[dict[str, Any], Exception | None]:
    """The settings every rank must share, and the first invalid one's error. An invalid one
    (e.g. a typo in one rank's environment) still travels to the region's first request, as
    ``"invalid: <why>"``, so the peers fail at once naming it instead of waiting."""
    match: dict[str, Any] = {}
    error: Exception | None = None
    for key, value in (
        ("direct", lambda: resolve_direct(direct)),
        ("lanes", lambda: require_int("lanes", lanes, lo=1)),
        ("barrier_timeout", lambda: _barrier_timeout(barrier_timeout)),
        ("check_padding", _env.check_padding),
    ):
        try:
            match[key] = value()
        except (TypeError, ValueError) as exc:
            match[key], error = f"invalid: {exc}", error or exc
    return match, error


def resolve_direct(direct: bool | None) -> str:
    """'auto', '1' or '0' from the argument (wins) or ``VMMKV_DIRECT``."""
    if direct is not None:
        if not isinstance(direct, bool):
            raise TypeError(f"direct must be None, True or False, got {direct!r}")
        return "1" if direct else "0"
    return _env.direct()


def barrier_trap() -> bool:
    """``VMMKV_BARRIER_TRAP=1``: a barrier wait past its timeout traps the device instead of
    being aborted by the watchdog (docs/design.md "Barrier")."""
    return _env.barrier_trap()


def why_not_direct(region: Any, mode_requested: str) -> str:
    """Why the cache gathers ("" when it publishes directly): the mode asked for, else the
    region's reason for not mapping every peer."""
    if mode_requested == "0":
        return "direct publication disabled (VMMKV_DIRECT=0 or direct=False)"
    return "" if region.mapped else region.why_not_mapped


def log_selection(
    log: logging.Logger, direct: bool, world_size: int, why_not: str, mode_requested: str
) -> None:
    """One line saying which path the cache took; a fallback the caller asked to avoid
    (``mode_requested == "1"``) also warns (RuntimeWarning at the cache's constructor call)."""
    if direct:
        log.info("vmmkv: direct publication to %d ranks", world_size)
        return
    msg = f"vmmkv: gather-then-insert fallback: {why_not}"
    asked = mode_requested == "1"
    if asked:
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
    log.log(logging.WARNING if asked else logging.INFO, msg)
