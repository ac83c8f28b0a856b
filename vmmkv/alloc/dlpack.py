"""Torch tensors over raw addresses through DLPack, with the device stated explicitly.

``tensor_at(ptr, nbytes, dtype, device, owner)`` builds a legacy ``DLManagedTensor`` capsule
naming the device type and ordinal (no ``__cuda_array_interface__`` guessing) and hands it to
``torch.from_dlpack``. The tensor does not own the memory. ``owner`` (the region's
``Reservation``; optional for scratch views whose memory the caller keeps) is told of every view: ``owner.hold()`` before the tensor exists, ``owner.drop()``
from the DLPack deleter once torch frees the storage (every slice and view of the tensor shares
it), so the address range stays reserved while any view lives.

The deleter may run on any thread, inside a garbage collection, or while the interpreter
finalizes: it takes only reentrant locks and never raises (``owner.drop()`` logs its errors).
Local, capture-safe (no driver call, no allocation on the device).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Protocol

import torch

__all__ = ["ViewOwner", "tensor_at"]

log = logging.getLogger(__name__)


class ViewOwner(Protocol):
    """What keeps the memory under a view: told when a view is made and when it dies."""

    def hold(self) -> None: ...

    def drop(self) -> None: ...


_KDL_CPU = 1
_KDL_CUDA = 2

# DLDataType codes: 0 int, 1 uint, 2 float, 4 bfloat.
_DTYPES: dict[torch.dtype, tuple[int, int]] = {
    torch.uint8: (1, 8),
    torch.int8: (0, 8),
    torch.int16: (0, 16),
    torch.int32: (0, 32),
    torch.int64: (0, 64),
    torch.float16: (2, 16),
    torch.bfloat16: (4, 16),
    torch.float32: (2, 32),
    torch.float64: (2, 64),
}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DELETER),
]

# The ctypes structures (and the owner) must stay alive until the consumer calls the deleter.
_live: dict[int, tuple[_DLManagedTensor, ctypes.Array, ViewOwner | None]] = {}
# reentrant: a garbage collection inside the locked section may run a deleter on this thread
_live_lock = threading.RLock()


@_DELETER
def _deleter(managed: ctypes._Pointer) -> None:
    try:
        with _live_lock:
            entry = _live.pop(ctypes.addressof(managed.contents), None)
        if entry is not None and entry[2] is not None:
            entry[2].drop()
    except BaseException:  # noqa: B902 - an exception cannot cross the C deleter
        try:
            log.exception("vmmkv: DLPack deleter failed")
        except BaseException:  # noqa: B902 - logging torn down at interpreter exit
            pass


# The thunk must outlive every view: the interpreter's last collection at exit clears module
# dicts in no fixed order, and a view freed after this module's (a vLLM layer or a module global
# holding it) would make torch call freed code. One reference that nothing ever drops.
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_deleter))

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def tensor_at(
    ptr: int,
    nbytes: int,
    dtype: torch.dtype,
    device: torch.device,
    owner: ViewOwner | None = None,
) -> torch.Tensor:
    """A 1-D tensor of ``nbytes // dtype.itemsize`` elements at address ``ptr`` on ``device``,
    registered with ``owner`` for as long as its storage lives. Without an owner nothing keeps
    the memory: the caller guarantees that it outlives the tensor (a short-lived scratch view)."""
    if dtype not in _DTYPES:
        raise TypeError(f"tensor_at: dtype {dtype} not supported; expected one of {list(_DTYPES)}")
    if not isinstance(ptr, int) or ptr <= 0:
        raise ValueError(f"tensor_at: ptr must be a positive int address, got {ptr!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if nbytes <= 0 or nbytes % itemsize or ptr % itemsize:
        raise ValueError(
            f"tensor_at: nbytes={nbytes} and ptr={ptr:#x} must be positive multiples of the "
            f"{dtype} item size {itemsize}"
        )
    if device.type == "cuda":
        dev = _DLDevice(_KDL_CUDA, device.index if device.index is not None else 0)
    elif device.type == "cpu":
        dev = _DLDevice(_KDL_CPU, 0)
    else:
        raise ValueError(f"tensor_at: device must be cpu or cuda, got {device}")
    code, bits = _DTYPES[dtype]
    shape = (ctypes.c_int64 * 1)(nbytes // itemsize)
    managed = _DLManagedTensor()
    managed.dl_tensor = _DLTensor(ptr, dev, 1, _DLDataType(code, bits, 1), shape, None, 0)
    managed.manager_ctx = None  # the entry in _live is the context (found by address)
    managed.deleter = _deleter
    key = ctypes.addressof(managed)
    entry = (managed, shape, owner)
    if owner is not None:
        owner.hold()  # may raise (owner gone): nothing registered yet
    with _live_lock:
        _live[key] = entry
    # No capsule destructor: torch always consumes the capsule below, and calls the deleter
    # when the tensor dies; if from_dlpack raises, we undo the registration ourselves.
    try:
        capsule = _capsule_new(key, b"dltensor", None)
        return torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        with _live_lock:
            mine = _live.pop(key, None) is not None  # else torch already ran the deleter
        if mine and owner is not None:
            owner.drop()
        raise
