"""Checked access to the CUDA driver through ``cuda.bindings.driver``.

Contract:
- ``call(fn, *args, **context)`` runs one driver entry point and returns its outputs without the
  status; any status other than ``CUDA_SUCCESS`` raises :class:`CudaError`, which names the call,
  the CUresult (name and description) and the context keywords given (rank, peer, device, size...).
- ``primary_context(device)`` makes the device's primary context (the one torch uses) current on
  the calling thread for the duration of a ``with`` block and restores the previous one. It works
  in fresh threads, where no context is current.
- ``cuda_usable()`` never raises: it says whether a driver and at least one device exist.
- ``nvml_uuid(ordinal)`` is the device's UUID as NVML spells it (the backend and the NVML
  fabric query both key devices by it).
- Nothing here is collective; everything is capture-safe except ``cuInit`` (done once).
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any

try:  # cuda-python is a hard dependency, but keep `import vmmkv` working where it is broken.
    from cuda.bindings import driver as cu
except Exception as exc:  # pragma: no cover - exercised only on broken installs
    cu = None
    _IMPORT_ERROR: Exception | None = exc
else:
    _IMPORT_ERROR = None

__all__ = [
    "CudaError",
    "call",
    "cu",
    "cuda_usable",
    "device_count",
    "ensure_init",
    "finalizing",
    "nvml_uuid",
    "primary_context",
]


class CudaError(RuntimeError):
    """A driver call failed. ``code`` is the CUresult (or None when the driver is absent)."""

    def __init__(self, call_name: str, code: Any, detail: str, context: dict[str, Any]):
        self.call_name = call_name
        self.code = code
        self.context = dict(context)
        where = ", ".join(
            f"{k}={v:#x}" if k == "ptr" and isinstance(v, int) else f"{k}={v}"
            for k, v in context.items()
        )
        super().__init__(f"{call_name} failed: {detail}" + (f" [{where}]" if where else ""))


def _describe(code: Any) -> str:
    name = getattr(code, "name", str(code))
    try:
        err, text = cu.cuGetErrorString(code)
        if err == cu.CUresult.CUDA_SUCCESS and text:
            return f"{name} ({text.decode(errors='replace')})"
    except Exception:  # cuGetErrorString itself unavailable: the name is enough
        pass
    return name


def call(fn: Any, *args: Any, **context: Any) -> Any:
    """Call ``fn(*args)``, check its CUresult, return the remaining outputs.

    Returns None for no outputs, the single output for one, a tuple otherwise.
    """
    name = getattr(fn, "__name__", repr(fn))
    if cu is None:
        raise CudaError(name, None, f"cuda.bindings is not importable: {_IMPORT_ERROR}", context)
    try:
        out = fn(*args)
    except CudaError:
        raise
    except Exception as exc:  # e.g. libcuda.so missing: the bindings raise instead of returning
        raise CudaError(name, None, f"{type(exc).__name__}: {exc}", context) from exc
    if not isinstance(out, tuple):
        out = (out,)
    code, rest = out[0], out[1:]
    if code != cu.CUresult.CUDA_SUCCESS:
        raise CudaError(name, code, _describe(code), context)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


_init_lock = threading.Lock()
_initialized = False


def ensure_init() -> None:
    """``cuInit(0)`` once per process (raises CudaError when there is no usable driver)."""
    global _initialized
    if _initialized:
        return
    with _init_lock:
        if not _initialized:
            call(getattr(cu, "cuInit", None), 0)
            _initialized = True


@functools.cache
def _probe() -> tuple[int, str]:
    try:
        ensure_init()
        return int(call(cu.cuDeviceGetCount)), ""
    except CudaError as exc:
        return 0, str(exc)


def cuda_usable() -> bool:
    """True when the driver loads and reports at least one device. Never raises."""
    return _probe()[0] > 0


def device_count() -> int:
    return _probe()[0]


def why_no_cuda() -> str:
    """The reason ``cuda_usable()`` is False ('' when it is True)."""
    count, reason = _probe()
    if count:
        return ""
    return reason or "the driver reports no CUDA device"


_primary: dict[int, Any] = {}
_primary_lock = threading.Lock()


def _primary_ctx(ordinal: int) -> Any:
    # Retained once per process and never released: torch holds the same primary context, and
    # releasing it while tensors live would destroy it under them.
    ctx = _primary.get(ordinal)
    if ctx is not None:
        return ctx
    with _primary_lock:
        ctx = _primary.get(ordinal)
        if ctx is None:
            ensure_init()
            dev = call(cu.cuDeviceGet, ordinal, device=ordinal)
            ctx = call(cu.cuDevicePrimaryCtxRetain, dev, device=ordinal)
            _primary[ordinal] = (ctx, int(ctx))
        return _primary[ordinal]


_current = threading.local()  # the ordinal whose guard is innermost on this thread


class primary_context:  # noqa: N801 - used like a function: ``with primary_context(i):``
    """Make ``ordinal``'s primary context current on this thread inside the block.

    A plain class rather than a generator: it wraps every driver call of the hot paths
    (commit, map), where the generator machinery was measurable per chunk."""

    __slots__ = ("ordinal", "ctx", "prev", "outer")

    def __init__(self, ordinal: int) -> None:
        self.ordinal = ordinal
        self.ctx, self.prev, self.outer = None, None, None

    def __enter__(self) -> Any:
        ctx, ctx_int = _primary_ctx(self.ordinal)
        self.outer = getattr(_current, "ordinal", None)
        self.ctx = ctx
        if self.outer == self.ordinal:  # nested in a guard of the same device: already current
            return ctx
        err, prev = cu.cuCtxGetCurrent()
        if err != cu.CUresult.CUDA_SUCCESS:
            raise CudaError("cuCtxGetCurrent", err, _describe(err), {"device": self.ordinal})
        if int(prev) != ctx_int:
            call(cu.cuCtxSetCurrent, ctx, device=self.ordinal)
            self.prev = prev
        _current.ordinal = self.ordinal  # only once the context really is current
        return ctx

    def __exit__(self, *exc: Any) -> None:
        _current.ordinal = self.outer
        if self.prev is not None:
            prev, self.prev = self.prev, None
            call(cu.cuCtxSetCurrent, prev, device=self.ordinal)


def nvml_uuid(ordinal: int) -> str:
    """The device's UUID as NVML spells it ("GPU-8-4-4-4-12" hex). NVML indices follow PCI
    order and ignore CUDA_VISIBLE_DEVICES, so NVML lookups go by UUID, never by CUDA ordinal."""
    with primary_context(ordinal):
        raw = bytes(call(cu.cuDeviceGetUuid, call(cu.cuDeviceGet, ordinal), device=ordinal).bytes)
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def finalizing() -> bool:
    """True while the interpreter shuts down: driver calls are skipped then (the driver may be
    torn down already, and the process exit releases everything anyway)."""
    return sys.is_finalizing()
