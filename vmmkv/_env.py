"""The environment variables of vmmkv: one parser per kind of value, and one reader per variable
of the library, the one place that spells its name.

Kinds, the same words meaning the same everywhere (the vLLM plugin's variables parse through
them too):

- :func:`boolean`: ``0`` / ``false`` or ``1`` / ``true`` (any case), unset or empty for the
  default;
- :func:`tristate`: ``auto`` or a boolean word, as ``"auto"``, ``"0"`` or ``"1"``;
- :func:`number`: an integer or a finite number, with a lower bound;
- :func:`choice`: one word of a fixed list.

Contract: each parser and reader reads ``os.environ`` (or the mapping passed as ``env``) when
called (nothing is cached) and returns the parsed value, or raises ``ValueError`` naming the
variable, the value it got and what it expects. Local, torch-free and CUDA-free: the CLI checks
the whole environment through :func:`problems` before it imports torch or spawns a rank.

Read elsewhere, each in one module: the vLLM plugin's variables (``VLLM_USE_VMMKV``,
``VLLM_VMMKV_ELASTIC``, ``VMMKV_ELASTIC_*``, ``VMMKV_SLEEP_INNER_BACKEND``, and its own reading of
``VMMKV_CHUNK_MIB``) in ``vmmkv.integrations.vllm``; the kernel build's paths
(``VMMKV_CSRC_DIR``, ``VMMKV_CUDA_INCLUDE``, ``VMMKV_CACHE_DIR``) in ``vmmkv.ops.build``; the
test-only ``VMMKV_TEST_*`` in the modules that honour them. README.md lists every one.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping

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
    "boolean",
    "check_padding",
    "choice",
    "chunk_bytes",
    "direct",
    "fabric",
    "launch_api",
    "number",
    "problems",
    "set_variables",
    "tristate",
]

DIRECT = "VMMKV_DIRECT"
BARRIER_TIMEOUT = "VMMKV_BARRIER_TIMEOUT"
BARRIER_TRAP = "VMMKV_BARRIER_TRAP"
CHECK_PADDING = "VMMKV_CHECK_PADDING"
CHUNK_MIB = "VMMKV_CHUNK_MIB"
FABRIC = "VMMKV_FABRIC"
LAUNCH_API = "VMMKV_LAUNCH_API"


BOOLEAN_WORDS = {"0": False, "1": True, "false": False, "true": True}

DEFAULT_BARRIER_TIMEOUT_S = 600.0


def _raw(name: str, env: Mapping[str, str] | None) -> str:
    return (os.environ if env is None else env).get(name, "").strip()


def boolean(name: str, default: bool = False, *, env: Mapping[str, str] | None = None) -> bool:
    """A switch: ``0``/``false`` or ``1``/``true`` (any case); unset or empty: ``default``."""
    raw = _raw(name, env)
    if not raw:
        return default
    value = BOOLEAN_WORDS.get(raw.lower())
    if value is None:
        raise ValueError(f"{name} must be '0' or '1', got {raw!r} ('false' and 'true' also work)")
    return value


def tristate(name: str, *, env: Mapping[str, str] | None = None) -> str:
    """``auto`` (unset or empty too) or a boolean word: ``"auto"``, ``"0"`` or ``"1"``."""
    raw = _raw(name, env)
    if not raw or raw.lower() == "auto":
        return "auto"
    value = BOOLEAN_WORDS.get(raw.lower())
    if value is None:
        raise ValueError(
            f"{name} must be 'auto', '0' or '1', got {raw!r} ('false' and 'true' also work)"
        )
    return "1" if value else "0"


def number(
    name: str,
    default: float | None,
    *,
    minimum: float,
    integer: bool = False,
    exclusive: bool = False,
    unit: str = "",
    env: Mapping[str, str] | None = None,
) -> float | None:
    """An integer (``integer=True``) or a finite number, ``>= minimum`` (``> minimum`` when
    ``exclusive``); unset or empty: ``default``. ``unit`` only words the error."""
    raw = _raw(name, env)
    if not raw:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < minimum or (exclusive and value == minimum):
        what = ("an integer" if integer else "a number") + (f" of {unit}" if unit else "")
        raise ValueError(
            f"{name} must be {what} {'>' if exclusive else '>='} {minimum:g}, got {raw!r}"
        )
    return value


def choice(
    name: str, allowed: tuple[str, ...], default: str, *, env: Mapping[str, str] | None = None
) -> str:
    """One word of ``allowed`` (any case); unset or empty: ``default``."""
    value = _raw(name, env).lower() or default
    if value not in allowed:
        spelled = ", ".join(repr(a) for a in allowed[:-1]) + f" or {allowed[-1]!r}"
        raise ValueError(f"{name} must be {spelled}, got {_raw(name, env)!r}")
    return value


def direct() -> str:
    """``VMMKV_DIRECT``: 'auto' (unset), '0' (always gather) or '1' (direct or warn)."""
    return tristate(DIRECT)


def barrier_timeout() -> float:
    """``VMMKV_BARRIER_TIMEOUT``: the host timeout of a barrier wait in seconds (600 unset)."""
    seconds = number(
        BARRIER_TIMEOUT, DEFAULT_BARRIER_TIMEOUT_S, minimum=0, exclusive=True, unit="seconds"
    )
    return float(seconds)


def barrier_trap() -> bool:
    """``VMMKV_BARRIER_TRAP``: true traps the device at a barrier timeout; false or unset
    leaves it to the watchdog."""
    return boolean(BARRIER_TRAP)


def check_padding() -> bool:
    """``VMMKV_CHECK_PADDING``: true turns the gather's padding check on; false or unset off."""
    return boolean(CHECK_PADDING)


def chunk_bytes() -> int | None:
    """``VMMKV_CHUNK_MIB``: a chunk size in MiB (fractions allowed: 0.5 is 512 KiB) as bytes,
    or None when unset. Whether it suits a region (a multiple of the allocation granularity, at
    most the capacity) is the caller's check."""
    mib = number(CHUNK_MIB, None, minimum=0, exclusive=True, unit="MiB")
    if mib is None:
        return None
    nbytes = mib * (1 << 20)
    if nbytes != int(nbytes) or nbytes < 1:
        raise ValueError(
            f"{CHUNK_MIB} must be a whole number of bytes in MiB, got {_raw(CHUNK_MIB, None)!r} "
            f"({nbytes} bytes)"
        )
    return int(nbytes)


def fabric() -> bool:
    """``VMMKV_FABRIC``: true opts in to by-value handles across the hosts of one NVLink
    domain; false or unset does not."""
    return boolean(FABRIC)


def launch_api() -> str:
    """``VMMKV_LAUNCH_API``: how kernels are launched, 'bindings' (cuda.bindings; unset) or
    'ctypes'."""
    return choice(LAUNCH_API, ("bindings", "ctypes"), "bindings")


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


def set_variables(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """vmmkv's variables that are set, the library's and the vLLM plugin's (``VMMKV_*``,
    ``VLLM_USE_VMMKV``, ``VLLM_VMMKV_*``: a ``VMMKV_`` or ``VLLM_`` name that says ``VMMKV``),
    by name, with their values as given."""
    env = os.environ if env is None else env
    return {
        k: v for k, v in sorted(env.items()) if k.startswith(("VMMKV_", "VLLM_")) and "VMMKV" in k
    }
