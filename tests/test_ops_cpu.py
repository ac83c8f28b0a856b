"""The ops layer's host-side contracts that need no GPU: geometry bounds of ``KVTarget``,
cleanup of a failed ``load_module``, the custom ops' mutation schemas and their survival in a
``torch.compile`` graph, ``prepare`` on host targets."""

from __future__ import annotations

import pytest
import torch

import vmmkv.ops  # noqa: F401  (registers the custom ops)
from vmmkv.alloc import driver
from vmmkv.ops import build
from vmmkv.ops.kv import KVTarget


def _rows_target(**over) -> KVTarget:
    fields = dict(
        kind="rows",
        ptr_table=torch.zeros(1, dtype=torch.int64),
        my_rank=0,
        offset_bytes=0,
        num_blocks=4,
        block_size=1,
        block_stride=1024,
        entry_stride=1024,
        entry_bytes=1024,
        committed_bytes=torch.tensor([1 << 30]),
        error_counter=torch.zeros(1, dtype=torch.int32),
        cache=torch.zeros(1, dtype=torch.uint8),
    )
    fields.update(over)
    return KVTarget(**fields)


# ---------------------------------------------------------------------------------------------
# KVTarget geometry (review F10)


def test_a_geometry_whose_block_offsets_overflow_int64_is_refused():
    # the review's R13: num_blocks * block_stride wraps around int64 in the kernel
    with pytest.raises(ValueError, match=r"must end below 2\*\*62"):
        _rows_target(num_blocks=1 << 44, block_stride=1 << 20)


@pytest.mark.parametrize(
    "over",
    [
        {"offset_bytes": 2**62 - 1024},
        {"num_blocks": 2**42 + 1, "block_stride": 2**20},
        {"offset_bytes": 2**61, "num_blocks": 2**41 + 1, "block_stride": 2**20},
    ],
)
def test_a_view_ending_at_or_past_2_pow_62_is_refused(over):
    with pytest.raises(ValueError, match="ends at byte"):
        _rows_target(**over)


def test_a_view_ending_just_below_2_pow_62_is_accepted():
    t = _rows_target(offset_bytes=2**62 - 1025, num_blocks=1)
    assert t.offset_bytes + t.block_extent == 2**62 - 1
    assert _rows_target(num_blocks=2**42, block_stride=2**20 - 1, entry_stride=1023,
                        entry_bytes=1023).num_blocks == 2**42  # fmt: skip


def test_an_empty_view_is_bounded_by_its_offset_and_extent():
    assert _rows_target(num_blocks=0).num_blocks == 0
    with pytest.raises(ValueError, match="ends at byte"):
        _rows_target(num_blocks=0, offset_bytes=2**62)


# ---------------------------------------------------------------------------------------------
# load_module cleanup (review finding of issue 12, point 6)


class _FakeDriver:
    """Stands in for ``driver.call``: loads modules until ``fail_at`` (a source name, or a
    function name), records unloads."""

    def __init__(self, fail_at: str):
        self.fail_at = fail_at
        self.loaded: list[str] = []
        self.unloaded: list[str] = []

    def call(self, fn, *args, **context):
        name = getattr(fn, "__name__", str(fn))
        if name == "cuModuleLoadData":
            source = context["source"]
            if source == self.fail_at:
                raise driver.CudaError(name, 200, "CUDA_ERROR_INVALID_IMAGE", context)
            self.loaded.append(source)
            return f"module:{source}"
        if name == "cuModuleGetFunction":
            fname = args[1].decode()
            if fname == self.fail_at:
                raise driver.CudaError(name, 500, "CUDA_ERROR_NOT_FOUND", context)
            return f"fn:{fname}"
        if name == "cuModuleUnload":
            self.unloaded.append(args[0])
            return None
        raise AssertionError(f"unexpected driver call {name}")


class _FakeContext:
    def __init__(self, ordinal):
        pass

    def __enter__(self):
        return 1234

    def __exit__(self, *exc):
        return None


@pytest.fixture
def fake_load(monkeypatch):
    def make(fail_at: str) -> _FakeDriver:
        fake = _FakeDriver(fail_at)
        monkeypatch.setattr(driver, "call", fake.call)
        monkeypatch.setattr(driver, "primary_context", _FakeContext)
        monkeypatch.setattr(build, "arch_of_device", lambda ordinal: "sm_90")
        monkeypatch.setattr(
            build,
            "_build_with_fallback",
            lambda name, arch: build._Build(name, arch, f"key-{name}", b"\x7fELF", True, ()),
        )
        monkeypatch.setattr(build, "_latest", {})
        monkeypatch.setattr(build, "_loaded", {})
        return fake

    return make


def test_load_module_unloads_the_modules_it_loaded_when_a_later_one_fails(fake_load):
    names = list(build.KERNELS)
    assert len(names) >= 2
    fake = fake_load(fail_at=names[-1])
    with pytest.raises(driver.CudaError, match="CUDA_ERROR_INVALID_IMAGE"):
        build.load_module(7)
    assert fake.loaded == names[:-1]
    assert sorted(fake.unloaded) == sorted(f"module:{n}" for n in names[:-1])
    assert build._latest == {} and build._loaded == {}


def test_load_module_unloads_every_module_when_a_function_is_missing(fake_load):
    first = next(iter(build.KERNELS))
    fake = fake_load(fail_at=build.KERNELS[first][-1])
    with pytest.raises(driver.CudaError, match="CUDA_ERROR_NOT_FOUND"):
        build.load_module(7)
    assert fake.unloaded == [f"module:{first}"]
    assert build._latest == {}


def test_load_module_keeps_everything_loaded_when_all_succeed(fake_load):
    fake = fake_load(fail_at="")
    loaded = build.load_module(7)
    assert fake.unloaded == []
    assert sorted(loaded.modules) == sorted(build.KERNELS)
    assert all(loaded.functions[f] == f"fn:{f}" for fs in build.KERNELS.values() for f in fs)
    assert build.load_module(7) is loaded  # cached, no second load
    assert fake.loaded == list(build.KERNELS)
