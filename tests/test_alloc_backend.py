"""Both backends implement the declared ``Backend`` interface, method for method."""

from __future__ import annotations

import inspect

import pytest

from vmmkv.alloc import Backend, VirtualRegion, make_backend
from vmmkv.alloc.cuda import CudaBackend
from vmmkv.alloc.host import HostBackend


def _protocol_methods() -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(fn)
        for name, fn in vars(Backend).items()
        if inspect.isfunction(fn) and not name.startswith("_")
    }


def _params(sig: inspect.Signature) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in sig.parameters.values()]


@pytest.mark.parametrize("cls", [HostBackend, CudaBackend])
def test_every_backend_method_has_the_protocol_signature(cls):
    methods = _protocol_methods()
    assert len(methods) >= 15  # reserve, map, unmap, ... (the interface is not empty)
    for name, want in methods.items():
        got = getattr(cls, name, None)
        assert callable(got), f"{cls.__name__} lacks {name}"
        assert _params(inspect.signature(got)) == _params(want), (cls.__name__, name)


@pytest.mark.parametrize("cls", [HostBackend, CudaBackend])
def test_every_backend_states_whether_it_may_free_from_any_thread(cls):
    assert isinstance(cls.frees_from_any_thread, bool)
    assert isinstance(cls.name, str)


def test_the_host_backend_is_a_backend_and_regions_use_it():
    backend = make_backend(backend="host")
    assert isinstance(backend, Backend) and isinstance(backend, HostBackend)
    with VirtualRegion(backend.granularity, backend="host") as r:
        assert isinstance(r._backend, Backend)


@pytest.mark.gpu
def test_the_cuda_backend_is_a_backend():
    assert isinstance(make_backend(backend="cuda"), Backend)
