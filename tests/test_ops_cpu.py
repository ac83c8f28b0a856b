"""The ops layer's host-side contracts that need no GPU: geometry bounds of ``KVTarget``,
cleanup of a failed ``load_module``, the custom ops' mutation schemas and their survival in a
``torch.compile`` graph, ``prepare`` on host targets."""

from __future__ import annotations

import re

import pytest
import torch

import vmmkv.ops  # noqa: F401  (registers the custom ops)
from tests.helpers import struct_offset_checks
from vmmkv.alloc import driver
from vmmkv.ops import build, launch
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


# ---------------------------------------------------------------------------------------------
# Kernel parameter layouts: the host packing of every entry point matches the compiled kernel

_PTX_PARAM = re.compile(r"\.param\s+(?:\.align\s+\d+\s+)?\.(\w+)\s+\w+?_param_\d+(?:\[(\d+)\])?")
_CODE_SIZE = {"Q": 8, "q": 8, "i": 4, "D": 80, "B": 56}


def _ptx_param_sizes(ptx: str, entry: str) -> list[int]:
    m = re.search(rf"\.entry {entry}\(\s*(.*?)\)", ptx, re.S)
    if m is None:
        m = re.search(rf"\.entry {entry}\(\)", ptx)
        assert m is not None, f"{entry} not in the PTX"
        return []
    sizes = []
    for kind, count in _PTX_PARAM.findall(m.group(1)):
        sizes.append(int(count) if count else int(kind[1:]) // 8)
    return sizes


def test_every_kernel_layout_matches_the_compiled_parameter_list():
    kernels = [k for k in vars(launch).values() if isinstance(k, launch.Kernel)]
    entries = {e for es in build.KERNELS.values() for e in es}
    assert {k.name for k in kernels} == entries  # every entry point has exactly one layout
    ptx = {name: build.compile_ptx(name, "sm_90") for name in build.KERNELS}
    for k in kernels:
        (source,) = [n for n, es in build.KERNELS.items() if k.name in es]
        want = [_CODE_SIZE[c] for c in k.layout]
        assert _ptx_param_sizes(ptx[source], k.name) == want, k.name


def test_barrier_args_layout_matches_the_device_struct():
    fields = ["sig_table", "epochs", "arrivals", "diag", "timeout_ns", "lane", "rank", "world",
              "reserved"]  # fmt: skip
    sizes = [8] * 5 + [4] * 4
    assert launch.BARRIER_ARGS.size == sum(sizes) == 56
    _, headers = build.read_source("kv_store.cu")
    source = struct_offset_checks("BarrierArgs", "barrier.cuh", fields, sizes)
    build._nvrtc_compile("layout.cu", source, headers, build.compile_options("sm_90", None))


def test_the_fused_kernels_release_their_stores_before_arriving_and_run_the_barrier():
    ptx = build.compile_ptx("kv_store.cu", "sm_90")
    for entry in build.KERNELS["kv_store.cu"]:
        body = re.search(rf"\.entry {entry}\((.*?)\n}}\n", ptx, re.S).group(1)
        fused = entry.endswith("_barrier")
        for op in ("fence.acq_rel.sys", "st.release.sys.global", "ld.acquire.sys.global",
                   "%globaltimer", "trap"):  # fmt: skip
            assert (op in body) == fused, (entry, op)
        if fused:  # the release fence comes before the arrival count, the signals after it
            fence = body.index("fence.acq_rel.sys")
            arrive = body.index("atom.global.add.u32", fence)
            assert arrive < body.index("st.release.sys.global"), entry


# ---------------------------------------------------------------------------------------------
# Custom ops: schemas and torch.compile graphs


@pytest.mark.parametrize(
    ("op", "mutated"),
    [
        ("store_ds_mla", ["cache", "error_counter"]),
        ("store_indexer_k", ["cache", "error_counter"]),
        ("publish_rows", ["cache", "error_counter"]),
        ("store_layer", ["mla_cache", "mla_error_counter", "idx_cache", "idx_error_counter"]),
        ("barrier", ["epochs", "fence"]),
        ("prepared_store", ["caches", "counters"]),
        ("prepared_publish", ["caches", "counters", "epochs", "arrivals"]),
    ],
)
def test_every_custom_op_declares_the_caches_and_barrier_state_it_mutates(op, mutated):
    schema = getattr(torch.ops.vmmkv, op).default._schema
    got = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert got == mutated, str(schema)
    assert not schema.returns


def _recording_backend(graphs: list):
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend


def _op_names(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def test_torch_compile_keeps_store_barrier_and_publish_ops_in_program_order():
    """CPU tensors only: the traced graph must hold every op, in order, before the read of the
    region (the backend records the graph and runs nothing)."""
    region = torch.zeros(1 << 16, dtype=torch.uint8)
    view = region[4096:8192]
    target = _rows_target(cache=region, num_blocks=8, block_stride=512, entry_stride=512,
                          entry_bytes=512)  # fmt: skip
    epochs = torch.zeros(1, dtype=torch.int32)
    arrivals = torch.zeros(1, dtype=torch.int32)
    rows = torch.ones(4, 512, dtype=torch.uint8)
    slots = torch.arange(4)
    region_ptr = region.data_ptr()

    def step(rows, slots):
        vmmkv.ops.publish_rows(target, rows, slots)
        torch.ops.vmmkv.barrier(epochs, [region], target.ptr_table, 0, 0, 1, 10**9, 0,
                                [region_ptr])  # fmt: skip
        torch.ops.vmmkv.prepared_publish([region], [target.error_counter], epochs, arrivals,
                                         [rows], slots, 1, 1, 0, 0)  # fmt: skip
        return view.sum(dtype=torch.int64)

    graphs: list = []

    def record_only(gm, example_inputs):  # the ops cannot run on CPU targets
        graphs.append(gm)
        return lambda *args: (torch.zeros((), dtype=torch.int64),)

    compiled = torch.compile(step, fullgraph=True, backend=record_only)
    assert compiled(rows, slots).item() == 0
    (gm,) = graphs
    names = _op_names(gm)
    order = ["vmmkv.publish_rows", "vmmkv.barrier", "vmmkv.prepared_publish"]
    pos = [next(i for i, n in enumerate(names) if n.startswith(o)) for o in order]
    read = max(i for i, n in enumerate(names) if "sum" in n)
    assert pos == sorted(pos) and pos[-1] < read, names


def test_torch_compile_functionalizes_the_ops_without_copying_the_region():
    """Through AOTAutograd (what inductor sees): the mutating ops stay in the graph, and the
    mutated region is not cloned (a clone would break the kernels' writes through addresses)."""
    from torch._dynamo.backends.common import aot_autograd

    region = torch.zeros(1 << 16, dtype=torch.uint8)
    view = region[4096:8192]
    epochs = torch.zeros(1, dtype=torch.int32)
    arrivals = torch.zeros(1, dtype=torch.int32)
    counter = torch.zeros(1, dtype=torch.int32)
    rows = torch.ones(4, 512, dtype=torch.uint8)
    graphs: list = []

    def step(rows, slots):
        torch.ops.vmmkv.prepared_store([region], [counter], [rows], slots, 1, 0)
        torch.ops.vmmkv.prepared_publish([region], [counter], epochs, arrivals, [rows], slots,
                                         1, 1, 0, 0)  # fmt: skip
        return view.sum(dtype=torch.int64)

    backend = aot_autograd(fw_compiler=_recording_backend(graphs))
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    with pytest.raises(RuntimeError, match="prepared store handle 1 no longer exists"):
        compiled(rows, torch.arange(4))
    (gm,) = graphs
    text = gm.code
    assert "vmmkv.prepared_store" in text and "vmmkv.prepared_publish" in text, text
    assert "clone" not in text and "copy" not in text, text
    # the read of the view depends on the publish's output (a data edge, not only program order)
    (read,) = [n for n in gm.graph.nodes if "sum" in str(n.target)]
    node = read
    while "auto_functionalized" not in str(node.target):  # sum <- as_strided <- getitem <- op
        assert node.op == "call_function", text
        node = node.args[0]
    assert "prepared_publish" in str(node.args[0]), text


# ---------------------------------------------------------------------------------------------
# prepare() on host targets, and its argument checks


def _host_layer(replicas: list[torch.Tensor], nb: int, my_rank: int):
    """fp8_ds_mla and indexer_k targets over CPU "replicas" (separate tensors, one per rank)."""
    table = torch.tensor([r.data_ptr() for r in replicas], dtype=torch.int64)
    common = dict(ptr_table=table, my_rank=my_rank, num_blocks=nb, block_size=64,
                  committed_bytes=torch.tensor([replicas[0].numel()]),
                  error_counter=torch.zeros(1, dtype=torch.int32), cache=replicas[my_rank])  # fmt: skip
    mla_bytes = nb * 64 * 656
    mla = KVTarget(kind="fp8_ds_mla", offset_bytes=0, block_stride=64 * 656, entry_stride=656,
                   entry_bytes=656, **common)  # fmt: skip
    idx = KVTarget(kind="indexer_k", offset_bytes=mla_bytes, block_stride=64 * 132,
                   entry_stride=132, entry_bytes=132, **common)  # fmt: skip
    return mla, idx, mla_bytes


class _CountingBarrier:
    def __init__(self):
        self.lanes: list[int] = []

    def arrive_and_wait(self, lane: int = 0) -> None:
        self.lanes.append(lane)


def test_prepare_on_host_targets_stores_the_reference_bytes_and_publish_then_waits():
    from vmmkv.ops import reference as ref

    nb, tokens = 3, 40
    g = torch.Generator().manual_seed(5)
    replicas = [torch.randint(1, 256, (nb * 64 * (656 + 132),), generator=g, dtype=torch.uint8)
                for _ in range(2)]  # fmt: skip
    expected = [r.clone() for r in replicas]
    mla, idx, mla_bytes = _host_layer(replicas, nb, my_rank=1)
    kv_c = (torch.randn(tokens, 512, generator=g) * 3).bfloat16()
    k_pe = torch.randn(tokens, 64, generator=g).bfloat16()
    k = torch.randn(tokens, 128, generator=g).bfloat16()
    slots = torch.randperm(nb * 64, generator=g)[:tokens]
    slots[7] = -1
    nlo = 5
    p = vmmkv.ops.prepare((mla, idx))
    assert isinstance(p, vmmkv.ops.HostPreparedStore) and p.kinds == ("fp8_ds_mla", "indexer_k")
    bar = _CountingBarrier()
    p.publish((kv_c, k_pe, k), slots, nlo, bar, 2)
    assert bar.lanes == [2]
    for r, buf in enumerate(expected):
        first = 0 if r == 1 else nlo
        mla_v = buf[:mla_bytes].view(nb, 64, 656)
        idx_v = buf[mla_bytes:].view(nb, 64 * 132)
        ref.insert_ds_mla(mla_v, kv_c[first:], k_pe[first:], slots[first:])
        ref.insert_indexer_k(idx_v, k[first:], slots[first:], True)
    for r in range(2):
        assert torch.equal(replicas[r], expected[r]), f"replica {r}"


def test_prepare_rejects_unknown_kind_combinations_and_non_targets():
    rows = _rows_target()
    with pytest.raises(ValueError, match=r"kinds .*got \('rows', 'rows'\)"):
        vmmkv.ops.prepare((rows, rows))
    with pytest.raises(TypeError, match="tuple of KVTarget"):
        vmmkv.ops.prepare(rows)
    with pytest.raises(TypeError, match=r"targets\[1\] must be a KVTarget"):
        vmmkv.ops.prepare((rows, object()))
    with pytest.raises(TypeError, match="ue8m0 must be a bool"):
        vmmkv.ops.prepare((rows,), ue8m0=1)


def test_host_publish_needs_a_barrier_with_arrive_and_wait_and_the_right_input_count():
    p = vmmkv.ops.prepare((_rows_target(),))
    with pytest.raises(TypeError, match="arrive_and_wait"):
        p.publish((torch.zeros(1, 1024, dtype=torch.uint8),), torch.arange(1), 0, object(), 0)
    with pytest.raises(TypeError, match=r"1 tensors \('rows',\)"):
        p.store((), torch.arange(1))


def test_inductor_runs_a_traced_publish_in_place_and_reads_after_it():
    """The whole torch.compile pipeline on CPU: a PreparedStore whose eager publish is the
    host store (it writes through the region's address, as the kernels do) stands in for the
    CUDA one. The compiled function must write the region itself (no copy: the op checks the
    addresses) and read the rows only after the publish, on every call."""
    from torch._inductor.utils import run_and_get_code

    from tests.test_compile_gpu import _expected, _inputs, _make_step, _views
    from vmmkv.ops import barrier as barrier_mod
    from vmmkv.ops import prepared as prepared_mod
    from vmmkv.ops.formats import INDEXER_ENTRY_BYTES as IDX
    from vmmkv.ops.formats import MLA_ENTRY_BYTES as MLA

    nb, bs = 2, 64
    region = torch.zeros(2 << 20, dtype=torch.uint8)
    mla_view, idx_view, mla_bytes = _views(region, nb)
    common = dict(ptr_table=torch.tensor([region.data_ptr()]), my_rank=0, num_blocks=nb,
                  block_size=bs, committed_bytes=torch.tensor([region.numel()]),
                  error_counter=torch.zeros(1, dtype=torch.int32), cache=region)  # fmt: skip
    mla = KVTarget(kind="fp8_ds_mla", offset_bytes=0, block_stride=bs * MLA, entry_stride=MLA,
                   entry_bytes=MLA, **common)  # fmt: skip
    idx = KVTarget(kind="indexer_k", offset_bytes=mla_bytes, block_stride=bs * IDX,
                   entry_stride=IDX, entry_bytes=IDX, **common)  # fmt: skip
    host = vmmkv.ops.prepare((mla, idx))

    class HostBackedStore(prepared_mod.PreparedStore):
        def publish(self, inputs, slot_mapping, num_local_only, barrier, lane):
            if torch.compiler.is_compiling():
                return super().publish(inputs, slot_mapping, num_local_only, barrier, lane)
            host.store(inputs, slot_mapping, num_local_only)
            barrier.epochs.add_(1)

    p = object.__new__(HostBackedStore)
    p._caches, p._counters = [region], [mla.error_counter]
    p._cache_ptrs, p._counter_ptrs = [region.data_ptr()], [mla.error_counter.data_ptr()]
    p.handle = next(prepared_mod._next_handle)
    prepared_mod._prepared[p.handle] = p
    bar = object.__new__(barrier_mod.DeviceBarrier)
    bar.epochs = torch.zeros(1, dtype=torch.int32)
    bar.arrivals = torch.zeros(1, dtype=torch.int32)
    bar.handle = barrier_mod._register(bar)

    step = _make_step(p, bar, mla_view, idx_view, nb)
    compiled = torch.compile(step, fullgraph=True)
    for call in range(3):
        kv_c, k_pe, k, slots = _inputs(0, call, "cpu")
        region.fill_(0xA5)
        if call == 0:  # the generated code calls the op itself, once (what the GPU test checks)
            got, codes = run_and_get_code(compiled, kv_c, k_pe, k, slots, slots)
            text = "\n".join(codes)
            assert text.count("torch.ops.vmmkv.prepared_publish.default(") == 1, text
        else:
            got = compiled(kv_c, k_pe, k, slots, slots)
        for a, b in zip(got, _expected(kv_c, k_pe, k), strict=True):
            assert torch.equal(a, b), call
    assert bar.epochs.tolist() == [3]
