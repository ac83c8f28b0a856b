"""The environment variables of vmmkv's library: one reader per variable, the one place that
spells its name, the values it takes and the error a wrong value gives.

Contract: each reader reads ``os.environ`` when called (nothing is cached) and returns the
parsed value, or raises ``ValueError`` naming the variable, the value it got and what it
expects. Local, torch-free and CUDA-free: the CLI checks the whole environment through
:func:`problems` before it imports torch or spawns a rank.

Read elsewhere, each in one module: the vLLM plugin's variables (``VLLM_USE_VMMKV``,
``VLLM_VMMKV_ELASTIC``, ``VMMKV_ELASTIC_*``, ``VMMKV_SLEEP_INNER_BACKEND``, and its own reading of
``VMMKV_CHUNK_MIB``) in ``vmmkv.integrations.vllm``; the kernel build's paths
(``VMMKV_CSRC_DIR``, ``VMMKV_CUDA_INCLUDE``, ``VMMKV_CACHE_DIR``) in ``vmmkv.ops.build``; the
test-only ``VMMKV_TEST_*`` in the modules that honour them. README.md lists every one.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

from ._util import require_timeout

__all__ = [
    "BARRIER_TIMEOUT",
    "BARRIER_TRAP",
    "CHECK_PADDING",
    "CHUNK_MIB",
    "DIRECT",
    "FABRIC",
    "LAUNCH_API",
    "barrier_timeout",
    "barrier_trap",
    "check_padding",
    "chunk_bytes",
    "direct",
    "fabric",
    "launch_api",
    "problems",
]

DIRECT = "VMMKV_DIRECT"
BARRIER_TIMEOUT = "VMMKV_BARRIER_TIMEOUT"
BARRIER_TRAP = "VMMKV_BARRIER_TRAP"
CHECK_PADDING = "VMMKV_CHECK_PADDING"
CHUNK_MIB = "VMMKV_CHUNK_MIB"
FABRIC = "VMMKV_FABRIC"
LAUNCH_API = "VMMKV_LAUNCH_API"

DEFAULT_BARRIER_TIMEOUT_S = 600.0


def _raw(name: str, default: str = "") -> str:
    return os.environ.get(name, default).strip()


def _choice(name: str, allowed: tuple[str, ...], default: str) -> str:
    value = _raw(name, default).lower() or default
    if value not in allowed:
        spelled = ", ".join(repr(a) for a in allowed[:-1]) + f" or {allowed[-1]!r}"
        raise ValueError(f"{name} must be {spelled}, got {value!r}")
    return value


def direct() -> str:
    """``VMMKV_DIRECT``: 'auto' (unset), '0' (always gather) or '1' (direct or warn)."""
    return _choice(DIRECT, ("auto", "0", "1"), "auto")


def barrier_timeout() -> float:
    """``VMMKV_BARRIER_TIMEOUT``: the host timeout of a barrier wait in seconds (600 unset)."""
    raw = _raw(BARRIER_TIMEOUT)
    if not raw:
        return DEFAULT_BARRIER_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{BARRIER_TIMEOUT} must be a number of seconds, got {raw!r}") from None
    return require_timeout(BARRIER_TIMEOUT, value)


def barrier_trap() -> bool:
    """``VMMKV_BARRIER_TRAP``: '1' (or 'true') traps the device at a barrier timeout; '0',
    'false' or unset leaves it to the watchdog."""
    return _choice(BARRIER_TRAP, ("0", "1", "false", "true"), "0") in ("1", "true")


def check_padding() -> bool:
    """``VMMKV_CHECK_PADDING``: '1' turns the gather's padding check on, '0' or unset off."""
    return _choice(CHECK_PADDING, ("0", "1"), "0") == "1"


def chunk_bytes() -> int | None:
    """``VMMKV_CHUNK_MIB``: a chunk size in MiB (fractions allowed: 0.5 is 512 KiB) as bytes,
    or None when unset. Whether it suits a region (a multiple of the allocation granularity, at
    most the capacity) is the caller's check."""
    raw = _raw(CHUNK_MIB)
    if not raw:
        return None
    try:
        mib = float(raw)
    except ValueError:
        mib = math.nan
    nbytes = mib * (1 << 20)
    if not math.isfinite(nbytes) or nbytes < 1 or nbytes != int(nbytes):
        raise ValueError(
            f"{CHUNK_MIB} must be a positive number of MiB (a whole number of bytes), got {raw!r}"
        )
    return int(nbytes)


def fabric() -> bool:
    """``VMMKV_FABRIC``: '1' opts in to by-value handles across the hosts of one NVLink domain;
    '0' or unset does not."""
    return _choice(FABRIC, ("0", "1"), "0") == "1"


def launch_api() -> str:
    """``VMMKV_LAUNCH_API``: how kernels are launched, 'bindings' (cuda.bindings; unset) or
    'ctypes'."""
    return _choice(LAUNCH_API, ("bindings", "ctypes"), "bindings")


READERS: dict[str, Callable[[], object]] = {
    DIRECT: direct,
    BARRIER_TIMEOUT: barrier_timeout,
    BARRIER_TRAP: barrier_trap,
    CHECK_PADDING: check_padding,
    CHUNK_MIB: chunk_bytes,
    FABRIC: fabric,
    LAUNCH_API: launch_api,
}


def problems() -> list[str]:
    """One line per variable of :data:`READERS` whose value its reader refuses (empty: all
    valid or unset)."""
    found = []
    for read in READERS.values():
        try:
            read()
        except ValueError as exc:
            found.append(str(exc))
    return found
