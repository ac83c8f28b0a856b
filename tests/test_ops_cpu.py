"""The ops layer's host-side contracts that need no GPU: geometry bounds of ``KVTarget``,
cleanup of a failed ``load_module``, the custom ops' mutation schemas and their survival in a
``torch.compile`` graph, ``prepare`` on host targets."""

from __future__ import annotations

import ctypes
import re
import struct

import pytest
import torch

import vmmkv.ops  # noqa: F401  (registers the custom ops)
from tests.helpers import packed_layout, struct_layout
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
# KVTarget geometry


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
# load_module cleanup


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
_CODE_SIZE = {"Q": 8, "q": 8, "i": 4, "D": 80, "B": 64}


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
    fields = ["sig_table", "epochs", "arrivals", "lane_state", "ctrl", "diag_ns", "lane", "rank",
              "world", "flags"]  # fmt: skip
    sizes = [8] * 6 + [4] * 4
    assert launch.BARRIER_ARGS.size == sum(sizes) == 64
    assert struct_layout("BarrierArgs", "barrier.cuh", fields) == packed_layout(fields, sizes)


def test_the_control_page_and_record_layouts_match_what_the_host_reads():
    from vmmkv.ops import barrier as B
    from vmmkv.ops import barrier_control as C

    record = ["seq", "state", "lane", "rank", "missing_peer", "epoch", "observed", "world",
              "waited_ns", "diag_ns", "magic"]  # fmt: skip
    sizes = [4] * 8 + [8, 8, 4]
    header = ["abort", "busy_lane", "busy_epoch", "busy_found", "diag"]
    diag = packed_layout(record, sizes)
    assert diag.pop("sizeof") <= C._DIAG_BYTES
    assert struct_layout("BarrierDiag", "barrier.cuh", record) == {**diag, "sizeof": C._DIAG_BYTES}
    ctrl = struct_layout("BarrierCtrl", "barrier.cuh", header)
    del ctrl["sizeof"]  # the records array follows the header
    assert ctrl == {"abort": 0, "busy_lane": 4, "busy_epoch": 8, "busy_found": 12, "diag": 64}
    _, headers = build.read_source("kv_store.cu")
    source = '#include "barrier.cuh"\n'
    source += f"static_assert(vmmkv::kDiagMagic == {C._DIAG_MAGIC});\n"
    source += f"static_assert(vmmkv::kFlagTrap == {B._FLAG_TRAP});\n"
    source += f"static_assert(vmmkv::kAbortByHost == {C._ABORT_BY_HOST});\n"
    source += f"static_assert(vmmkv::kLaneStateWords == {B._LANE_STATE_WORDS});\n"
    for value, name in C._STATES.items():
        source += f"static_assert(vmmkv::kDiag{name.capitalize()} == {value});\n"
    build._nvrtc_compile("layout.cu", source, headers, build.compile_options("sm_90", None))


def _function_body(ptx: str, name: str) -> str:
    m = re.search(rf"\.func\s+(?:\([^)]*\)\s+)?\w*{name}\w*\([^;{{]*?\)\s*{{(.*?)\n}}\n", ptx, re.S)
    assert m is not None, f"{name} not in the PTX"
    return m.group(1)


def test_the_wait_polls_the_abort_word_and_the_timer_only_off_the_fast_path():
    """The spin loads the peer's slot with ld.acquire.sys; the abort word (ld.relaxed.sys), the
    timer and the opt-in trap live only in the out-of-line check the loop calls every
    kCheckEvery spins, after a nanosleep backoff."""
    for name in ("barrier.cu", "kv_store.cu"):
        ptx = build.compile_ptx(name, "sm_90")
        check = _function_body(ptx, "wait_check")
        assert "ld.relaxed.sys.global" in check and "%globaltimer" in check
        assert "trap;" in check  # kFlagTrap: opt-in, after the record (report_wait) is complete
        assert check.index("report_wait") < check.rindex("trap;")
        entry = "vmmkv_barrier" if name == "barrier.cu" else "vmmkv_publish_rows_barrier"
        body = re.search(rf"\.entry {entry}\((.*?)\n}}\n", ptx, re.S).group(1)
        assert "ld.relaxed.sys" not in body and "trap;" not in body  # not inlined into the loop
        spin = body[body.index("ld.acquire.sys.global") :]
        assert "nanosleep.u32" in spin and "wait_check" in spin
        assert spin.index("nanosleep.u32") < spin.index("wait_check")
        # the lane's busy word is exchanged at entry, long before the signals
        assert body.index("atom.global.exch.b32") < body.index("st.release.sys.global")
        assert "VMMKV_TEST" not in ptx and "test_lag" not in ptx  # no test hook in production


def test_the_fused_kernels_release_their_stores_before_arriving_and_run_the_barrier():
    ptx = build.compile_ptx("kv_store.cu", "sm_90")
    for entry in build.KERNELS["kv_store.cu"]:
        body = re.search(rf"\.entry {entry}\((.*?)\n}}\n", ptx, re.S).group(1)
        fused = entry.endswith("_barrier")
        for op in ("fence.acq_rel.gpu", "st.release.sys.global", "ld.acquire.sys.global",
                   "%globaltimer", "wait_check", "lane_busy"):  # fmt: skip
            assert (op in body) == fused, (entry, op)
        assert "trap;" not in body, entry  # only in wait_check, behind the opt-in flag
        # the system-scope release is the signal store itself (no extra sys fence per CTA)
        assert "fence.acq_rel.sys" not in body, entry
        if fused:  # the gpu-scope release comes before the arrival count, the signals after it
            fence = body.index("fence.acq_rel.gpu")
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
        torch.ops.vmmkv.barrier(epochs, [region], 1, 0, [region_ptr])
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


# ---------------------------------------------------------------------------------------------
# Prepared launches on CPU: the validation of PreparedStore calls and the parameters that reach
# cuLaunchKernel. The driver is replaced by a recorder that decodes each
# kernelParams[i] by the kernel's layout, as the driver reads them.

_SCALAR = {"Q": "<Q", "q": "<q", "i": "<i"}
_KERNELS = {k.name: k for k in vars(launch).values() if isinstance(k, launch.Kernel)}


def _decode_params(kernel: launch.Kernel, params: int) -> list:
    ptrs = (ctypes.c_void_p * len(kernel.layout)).from_address(params)
    out: list = []
    for code, ptr in zip(kernel.layout, ptrs, strict=True):
        if code in "DB":
            out.append(ctypes.string_at(ptr, 80 if code == "D" else 64))
        else:
            fmt = _SCALAR[code]
            out.append(struct.unpack(fmt, ctypes.string_at(ptr, struct.calcsize(fmt)))[0])
    return out


class _Loaded:
    def function(self, name: str) -> str:
        return name


@pytest.fixture
def recorded_launches(monkeypatch):
    """Launches of PreparedLaunch objects made from now on, as (kernel, grid, block, stream,
    decoded parameters); CUDA targets stand in for CPU ones (device ordinal -1)."""
    from vmmkv.ops import prepared

    seen: list[tuple] = []

    def cu_launch(fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        assert (gy, gz, by, bz, smem, extra) == (1, 1, 1, 1, 0, 0)
        seen.append((fn, gx, bx, stream, _decode_params(_KERNELS[fn], params)))
        return (launch._CU_SUCCESS,)

    monkeypatch.setenv("VMMKV_LAUNCH_API", "bindings")
    monkeypatch.setattr(build, "load_module", lambda ordinal: _Loaded())
    monkeypatch.setattr(launch, "_cu_launch", cu_launch)
    monkeypatch.setattr(launch, "stream_handle", lambda ordinal: 0x5000 + ordinal)
    monkeypatch.setattr(prepared._kv, "_check_cuda", lambda device: -1)
    # a device's resident grid (132 SMs x 4 CTAs, an H200's for the layer kernels) where a
    # test prepares for a device ordinal; ordinal -1 keeps the functional API's cap
    monkeypatch.setattr(launch, "resident_grid", lambda kernels, ordinal, block: RESIDENT_GRID)
    return seen


RESIDENT_GRID = 528


def _cpu_prepared(targets, ue8m0=True):
    from vmmkv.ops.prepared import PreparedStore

    return PreparedStore(tuple(targets), tuple(t.kind for t in targets), ue8m0)


def _cpu_barrier(lanes: int, rank: int = 1, world: int = 2):
    """A DeviceBarrier's state without CUDA (what __init__ sets, on CPU tensors)."""
    from vmmkv.ops.barrier import DeviceBarrier

    bar = object.__new__(DeviceBarrier)
    bar.sig_table = torch.zeros(world, dtype=torch.int64)
    bar.epochs = torch.zeros(lanes, dtype=torch.int32)
    bar.arrivals = torch.zeros(lanes, dtype=torch.int32)
    bar.rank, bar.world, bar.lanes, bar.ordinal = rank, world, lanes, -1
    bar.device = torch.device("cpu")
    bar.lane_state = torch.zeros(lanes, 4, dtype=torch.int32)
    bar.timeout_ns, bar._diag_dev_ptr, bar._threads = 3 * 10**9, 0x7F00_1234_5000, 32
    bar.fence, bar._fence_ptrs, bar._closed = [], [], False
    bar._error, bar._blocked = None, False
    bar._launches = [None] * lanes
    bar._args = tuple(
        launch.BARRIER_ARGS.pack(bar.sig_table.data_ptr(), bar.epochs.data_ptr(),
                                 bar.arrivals.data_ptr(), bar.lane_state.data_ptr(),
                                 bar._diag_dev_ptr, bar.timeout_ns, lane, rank, world, 0)
        for lane in range(lanes)
    )  # fmt: skip
    return bar


def _layer_inputs(tokens: int, pad: int = 0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    kv_c = torch.randn(tokens, 512 + pad, generator=g).bfloat16()[:, :512]
    k_pe = torch.randn(tokens, 64 + pad, generator=g).bfloat16()[:, :64]
    k = torch.randn(tokens, 128 + pad, generator=g).bfloat16()[:, :128]
    return kv_c, k_pe, k


def _with_dest(target: KVTarget, first: int) -> KVTarget:
    """``target`` with a recognisable packed KVDest (CPU targets pack none)."""
    object.__setattr__(target, "_dest", bytes(range(first, first + 80)))
    return target


def _layer_targets():
    replicas = [torch.zeros(4 * 64 * (656 + 132), dtype=torch.uint8) for _ in range(2)]
    mla, idx, _ = _host_layer(replicas, 4, my_rank=0)
    return _with_dest(mla, 0), _with_dest(idx, 100)


def test_a_stand_alone_barrier_launches_its_lanes_prepared_parameters_without_repacking(
    recorded_launches,
):
    bar = _cpu_barrier(lanes=3)
    for lane in (0, 2, 0):
        bar.arrive_and_wait(lane)
    expected = [("vmmkv_barrier", 1, 32, 0x5000 - 1, [bar._args[lane]]) for lane in (0, 2, 0)]
    sig, epochs, arr, state, ctrl, diag_ns, lane, rank, world, flags = launch.BARRIER_ARGS.unpack(
        bar._args[2]
    )
    assert (sig, epochs, arr, state) == (
        bar.sig_table.data_ptr(), bar.epochs.data_ptr(), bar.arrivals.data_ptr(),
        bar.lane_state.data_ptr(),
    )  # fmt: skip
    assert (ctrl, diag_ns, lane, rank, world, flags) == (0x7F00_1234_5000, 3 * 10**9, 2, 1, 2, 0)
    assert recorded_launches == expected
    assert bar._launches[1] is None  # one prepared launch per lane used, each with its buffer
    assert bar._launches[0]._buf is not bar._launches[2]._buf


def test_a_stand_alone_barrier_refuses_bad_lanes_and_a_closed_barrier_before_launching(
    recorded_launches,
):
    bar = _cpu_barrier(lanes=2)
    for lane in (2, -1, True, 1.0, None):
        with pytest.raises(ValueError, match=r"lane must be an int in \[0, 2\), got"):
            bar.arrive_and_wait(lane)
    bar._closed = bar._blocked = True
    with pytest.raises(RuntimeError, match="closed"):
        bar.arrive_and_wait(0)
    with pytest.raises(RuntimeError, match="closed"):
        bar.barrier_args(0)
    assert recorded_launches == []


def test_a_broken_barrier_refuses_every_launch_naming_rank_peer_lane_device_and_call(
    recorded_launches,
):
    from vmmkv.ops.barrier import BarrierAborted

    bar = _cpu_barrier(lanes=2)
    bar._error = BarrierAborted(1, "cuda:3", "watchdog", 0, 7, 0, "peer rank 0's process (pid "
                                "42) is gone")  # fmt: skip
    bar._blocked = True
    prepared = _cpu_prepared(_layer_targets())
    kv_c, k_pe, k = _layer_inputs(3)
    for call, fn in (
        ("arrive_and_wait", lambda: bar.arrive_and_wait(1)),
        ("publish", lambda: bar.barrier_args(0)),
        ("publish", lambda: prepared.publish((kv_c, k_pe, k), torch.arange(3), 0, bar, 1)),
        ("check", bar.check),
    ):
        with pytest.raises(BarrierAborted) as info:
            fn()
        msg = str(info.value)
        assert msg.startswith(
            f"rank 1 (cuda:3): {call}: vmmkv barrier aborted (lane 0 epoch 7, "
            "waiting for peer rank 0): peer rank 0's process (pid 42) is gone"
        )
        assert (info.value.peer, info.value.lane, info.value.call) == (0, 0, call)
    assert recorded_launches == []


def test_a_prepared_layer_publish_passes_the_kernel_its_inputs_slots_and_barrier_args(
    recorded_launches,
):
    mla, idx = _layer_targets()
    bar = _cpu_barrier(lanes=2)
    for ue8m0 in (True, False):
        p = _cpu_prepared((mla, idx), ue8m0=ue8m0)
        for tokens, slot_dtype, pad, nlo in ((37, torch.int64, 0, 0), (9, torch.int32, 24, 4)):
            recorded_launches.clear()
            kv_c, k_pe, k = _layer_inputs(tokens, pad)
            slots = torch.arange(tokens, dtype=slot_dtype)
            p.publish((kv_c, k_pe, k), slots, nlo, bar, 1)
            p.store([kv_c, k_pe, k], slots, nlo)
            common = [
                mla._dest, idx._dest, kv_c.data_ptr(), 512 + pad, k_pe.data_ptr(), 64 + pad,
                k.data_ptr(), 128 + pad, slots.data_ptr(), int(slot_dtype == torch.int64),
                tokens, nlo, int(ue8m0),
            ]  # fmt: skip
            grid = -(-tokens // 8)
            assert recorded_launches == [
                ("vmmkv_store_layer_barrier", grid, 256, 0x4FFF, [*common, bar._args[1]]),
                ("vmmkv_store_layer", grid, 256, 0x4FFF, common),
            ]


def test_prepared_stores_of_every_kind_pass_their_kernel_layout(recorded_launches):
    mla, idx = _layer_targets()
    rows16 = _with_dest(_rows_target(), 20)
    rows_odd = _with_dest(_rows_target(entry_bytes=1000), 40)
    g = torch.Generator().manual_seed(3)
    kv_c, k_pe, k = _layer_inputs(20, seed=4)
    slots = torch.randperm(64, generator=g)[:20]
    p = _cpu_prepared((mla,))
    p.store((kv_c, k_pe), slots, 3)
    p = _cpu_prepared((idx,))
    p.store((k,), slots, 3)
    rows = torch.zeros(21, 1040, dtype=torch.uint8)  # 16-byte aligned row stride
    _cpu_prepared((rows16,)).store((rows[1:, :1024],), slots, 3)  # 16-byte vectors
    _cpu_prepared((rows16,)).store((rows[:, 8:1032],), slots[:1])  # misaligned address
    _cpu_prepared((rows_odd,)).store((rows[:, :1000],), slots, 3)  # 1000-byte rows
    tail = [slots.data_ptr(), 1, 20, 3]
    r = rows.data_ptr()
    assert recorded_launches == [
        ("vmmkv_store_ds_mla", 3, 256, 0x4FFF,
         [mla._dest, kv_c.data_ptr(), 512, k_pe.data_ptr(), 64, *tail]),
        ("vmmkv_store_indexer_k", 3, 256, 0x4FFF, [idx._dest, k.data_ptr(), 128, *tail, 1]),
        ("vmmkv_publish_rows", 3, 256, 0x4FFF, [rows16._dest, r + 1040, 1040, 1024, *tail, 1]),
        ("vmmkv_publish_rows", 1, 256, 0x4FFF,
         [rows16._dest, r + 8, 1040, 1024, slots.data_ptr(), 1, 1, 0, 0]),
        ("vmmkv_publish_rows", 3, 256, 0x4FFF, [rows_odd._dest, r, 1040, 1000, *tail, 0]),
    ]  # fmt: skip


def test_prepared_grids_cover_every_token_and_a_zero_token_publish_still_launches_one_cta(
    recorded_launches,
):
    (idx,) = _layer_targets()[1:]
    p = _cpu_prepared((idx,))
    bar = _cpu_barrier(lanes=1)
    k = torch.zeros(1, 128, dtype=torch.bfloat16).expand(65535 * 8 + 1, 128)  # one shared row
    cases = (0, 1, 8, 9, 528 * 8, 528 * 8 + 1, 65535 * 8, 65535 * 8 + 1)
    # no device (ordinal -1): the functional cap; a device: its resident grid (the fixture's)
    for cap in (65535, RESIDENT_GRID):
        on = (lambda t: t) if cap == 65535 else (lambda t: t.as_subclass(_OnCuda1))
        if cap == RESIDENT_GRID:  # as if the target and the barrier were on cuda:1
            p._prepare_checks(1, torch.device("cuda", 1))
            bar.ordinal, bar.device = 1, torch.device("cuda", 1)
        for tokens in cases:
            recorded_launches.clear()
            slots = on(torch.zeros(tokens, dtype=torch.int32))
            p.store((on(k),), slots)
            p.publish((on(k),), slots, 0, bar, 0)
            grids = [grid for _, grid, *_ in recorded_launches]
            want = min(cap, -(-tokens // 8))
            assert grids == ([want] if tokens else []) + [max(1, want)], (cap, tokens)


class _OnCuda1(torch.Tensor):
    """A CPU tensor that reports device index 1 (prepared stores compare get_device())."""

    def get_device(self) -> int:
        return 1


def test_prepared_calls_give_the_functional_apis_errors_and_launch_nothing(recorded_launches):
    mla, idx = _layer_targets()
    p = _cpu_prepared((mla, idx))
    bar = _cpu_barrier(lanes=1)
    kv_c, k_pe, k = _layer_inputs(48, seed=5)
    s = torch.arange(48)
    with pytest.raises(TypeError, match=r"3 tensors \('kv_c', 'k_pe', 'k'\)"):
        p.store((kv_c, k_pe), s)
    with pytest.raises(TypeError, match=r"3 tensors .*got dict"):
        p.store({0: kv_c, 1: k_pe, 2: k}, s)
    with pytest.raises(TypeError, match="k_pe must be a torch.Tensor, got ndarray"):
        p.store((kv_c, k_pe.float().numpy(), k), s)
    with pytest.raises(TypeError, match="only bfloat16"):
        p.store((kv_c.half(), k_pe, k), s)
    with pytest.raises(TypeError, match="k must be bfloat16, got torch.float32"):
        p.store((kv_c, k_pe, k.float()), s)
    with pytest.raises(ValueError, match=r"k must have shape \[T, 128\]"):
        p.store((kv_c, k_pe, k[:, :64]), s)
    with pytest.raises(ValueError, match=r"k_pe must have shape \[T, 64\], got \[48, 64, 1\]"):
        p.store((kv_c, k_pe[..., None], k), s)
    with pytest.raises(ValueError, match="fewer than slot_mapping's 48"):
        p.store((kv_c[:5], k_pe, k), s)
    with pytest.raises(ValueError, match=r"kv_c rows must be contiguous \(stride\(1\) == 1\)"):
        p.store((torch.zeros(48, 1024, dtype=torch.bfloat16)[:, ::2], k_pe, k), s)
    raw = torch.zeros(48, 584, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="kv_c rows must be 16-byte aligned"):
        p.store((raw[:, 4:516], k_pe, k), s)
    with pytest.raises(ValueError, match="k_pe rows must be 16-byte aligned.*row stride 136 "):
        p.store((kv_c, torch.zeros(48, 68, dtype=torch.bfloat16)[:, :64], k), s)
    with pytest.raises(ValueError, match="k rows must be 8-byte aligned.*row stride 260 bytes"):
        p.store((kv_c, k_pe, torch.zeros(48, 130, dtype=torch.bfloat16)[:, :128]), s)
    with pytest.raises(TypeError, match="slot_mapping must be a torch.Tensor, got list"):
        p.store((kv_c, k_pe, k), list(range(48)))
    with pytest.raises(TypeError, match="int32 or int64"):
        p.store((kv_c, k_pe, k), s.float())
    with pytest.raises(ValueError, match=r"slot_mapping must be 1-D, got shape \[48, 1\]"):
        p.store((kv_c, k_pe, k), s[:, None])
    with pytest.raises(ValueError, match="slot_mapping must be contiguous"):
        p.store((kv_c, k_pe, k), torch.arange(96)[::2])
    with pytest.raises(ValueError, match=r"num_local_only must be in \[0, 48\], got 49"):
        p.store((kv_c, k_pe, k), s, 49)
    with pytest.raises(TypeError, match="num_local_only must be an int, got bool"):
        p.store((kv_c, k_pe, k), s, True)
    with pytest.raises(TypeError, match="DeviceBarrier"):
        p.publish((kv_c, k_pe, k), s, 0, object(), 0)
    with pytest.raises(ValueError, match=r"lane must be an int in \[0, 1\), got 1"):
        p.publish((kv_c, k_pe, k), s, 0, bar, 1)
    with pytest.raises(ValueError, match="slot_mapping must be contiguous"):
        p.publish((kv_c, k_pe, k), torch.arange(96)[::2], 0, bar, 0)
    bar._closed = bar._blocked = True
    with pytest.raises(RuntimeError, match="closed"):
        p.publish((kv_c, k_pe, k), s, 0, bar, 0)
    assert recorded_launches == []


def test_prepared_calls_compare_every_tensors_device_with_the_targets(recorded_launches):
    mla, idx = _layer_targets()
    p = _cpu_prepared((mla, idx))
    p._prepare_checks(1, torch.device("cuda", 1))  # as if the targets were on cuda:1
    kv_c, k_pe, k = _layer_inputs(16, seed=6)
    s = torch.arange(16)
    on1 = [t.as_subclass(_OnCuda1) for t in (kv_c, k_pe, k, s)]
    with pytest.raises(ValueError, match="slot_mapping is on cpu, expected the target's device"):
        p.store(on1[:3], s)
    for i, name in enumerate(("kv_c", "k_pe", "k")):
        inputs = list(on1[:3])
        inputs[i] = (kv_c, k_pe, k)[i]
        with pytest.raises(ValueError, match=f"^{name} is on cpu, expected .* cuda:1"):
            p.store(inputs, on1[3])
    assert recorded_launches == []
    p.store(on1[:3], on1[3])
    assert [params[2] for *_, params in recorded_launches] == [kv_c.data_ptr()]


def test_prepared_mxfp8_stores_launch_their_own_kernel_variants_with_the_same_parameters(
    recorded_launches,
):
    import dataclasses

    mla, idx = _layer_targets()
    mx = _with_dest(dataclasses.replace(idx, kind="indexer_k_mxfp8"), 100)
    bar = _cpu_barrier(lanes=1)
    kv_c, k_pe, k = _layer_inputs(20, seed=8)
    slots = torch.arange(20, dtype=torch.int32)
    _cpu_prepared((mx,)).store((k,), slots, 2)
    _cpu_prepared((mx,)).publish((k,), slots, 2, bar, 0)
    p = _cpu_prepared((mla, mx))
    p.store((kv_c, k_pe, k), slots, 2)
    p.publish((kv_c, k_pe, k), slots, 2, bar, 0)
    tail = [slots.data_ptr(), 0, 20, 2, 1]  # int32 slots, 20 tokens, nlo 2, ue8m0 1
    idx_params = [mx._dest, k.data_ptr(), 128, *tail]
    layer = [mla._dest, mx._dest, kv_c.data_ptr(), 512, k_pe.data_ptr(), 64, k.data_ptr(), 128,
             *tail]  # fmt: skip
    assert recorded_launches == [
        ("vmmkv_store_indexer_k_mxfp8", 3, 256, 0x4FFF, idx_params),
        ("vmmkv_store_indexer_k_mxfp8_barrier", 3, 256, 0x4FFF, [*idx_params, bar._args[0]]),
        ("vmmkv_store_layer_mxfp8", 3, 256, 0x4FFF, layer),
        ("vmmkv_store_layer_mxfp8_barrier", 3, 256, 0x4FFF, [*layer, bar._args[0]]),
    ]
    with pytest.raises(ValueError, match="ue8m0=False is not possible for a 'indexer_k_mxfp8'"):
        vmmkv.ops.prepare((mla, mx), ue8m0=False)


def test_prepared_ue8m0_mla_stores_launch_their_own_kernel_variants_with_the_same_parameters(
    recorded_launches,
):
    import dataclasses

    mla, idx = _layer_targets()
    ue = _with_dest(dataclasses.replace(mla, kind="fp8_ds_mla_ue8m0"), 0)
    mx = _with_dest(dataclasses.replace(idx, kind="indexer_k_mxfp8"), 100)
    idx = _with_dest(idx, 150)
    bar = _cpu_barrier(lanes=1)
    kv_c, k_pe, k = _layer_inputs(20, seed=9)
    slots = torch.arange(20, dtype=torch.int32)
    for targets in ((ue,), (ue, idx), (ue, mx)):
        p = _cpu_prepared(targets)
        inputs = (kv_c, k_pe) if len(targets) == 1 else (kv_c, k_pe, k)
        p.store(inputs, slots, 2)
        p.publish(inputs, slots, 2, bar, 0)
    tail = [slots.data_ptr(), 0, 20, 2]  # int32 slots, 20 tokens, nlo 2
    mla_params = [ue._dest, kv_c.data_ptr(), 512, k_pe.data_ptr(), 64, *tail]

    def layer(i):  # the indexer's ue8m0 flag last, as for the fp8_ds_mla layer kernels
        return [ue._dest, i._dest, kv_c.data_ptr(), 512, k_pe.data_ptr(), 64, k.data_ptr(), 128,
                *tail, 1]  # fmt: skip

    assert recorded_launches == [
        ("vmmkv_store_ds_mla_ue8m0", 3, 256, 0x4FFF, mla_params),
        ("vmmkv_store_ds_mla_ue8m0_barrier", 3, 256, 0x4FFF, [*mla_params, bar._args[0]]),
        ("vmmkv_store_layer_ue8m0", 3, 256, 0x4FFF, layer(idx)),
        ("vmmkv_store_layer_ue8m0_barrier", 3, 256, 0x4FFF, [*layer(idx), bar._args[0]]),
        ("vmmkv_store_layer_ue8m0_mxfp8", 3, 256, 0x4FFF, layer(mx)),
        ("vmmkv_store_layer_ue8m0_mxfp8_barrier", 3, 256, 0x4FFF, [*layer(mx), bar._args[0]]),
    ]


def test_the_resident_grid_is_sms_times_the_smallest_occupancy_asked_once_per_key(monkeypatch):
    import contextlib
    from types import SimpleNamespace

    per_sm = {"fn-a": 4, "fn-b": 3}
    asked = []

    class Loaded:
        def function(self, name):
            return {launch.STORE_LAYER.name: "fn-a", launch.STORE_LAYER_BARRIER.name: "fn-b"}[name]

    def call(fn, handle, block, smem, **context):
        asked.append((handle, block, smem, context["device"]))
        return per_sm[handle]

    monkeypatch.setattr(launch, "_resident", {})
    monkeypatch.setattr(build, "load_module", lambda ordinal: Loaded())
    monkeypatch.setattr(driver, "call", call)
    monkeypatch.setattr(driver, "primary_context", lambda ordinal: contextlib.nullcontext())
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda o: SimpleNamespace(multi_processor_count=132)
    )
    pair = (launch.STORE_LAYER, launch.STORE_LAYER_BARRIER)
    assert launch.resident_grid(pair, 1, 256) == 132 * 3
    assert launch.resident_grid(pair, 1, 256) == 132 * 3  # cached: no second query
    assert asked == [("fn-a", 256, 0, 1), ("fn-b", 256, 0, 1)]
    assert launch.resident_grid(pair[:1], 1, 256) == 132 * 4  # another key asks again
    assert len(asked) == 3


# ---------------------------------------------------------------------------------------------
# The barrier's watchdog on a fake control page (what the kernel writes, csrc/barrier.cuh)


def _page_barrier(lanes=2, timeout_s=5.0, liveness=None):
    """A DeviceBarrier's host state over a zeroed ctypes page (no CUDA)."""
    import threading

    from vmmkv.ops import barrier_control as C

    page = ctypes.create_string_buffer(C._CTRL_HEADER_BYTES + C._DIAG_BYTES * lanes)
    bar = _cpu_barrier(lanes=lanes, rank=1, world=3)
    bar.device, bar.timeout_s, bar.trap, bar.diag_after_s = "cuda:5", timeout_s, False, 1.0
    bar._host_ptr = ctypes.addressof(page)
    bar._abort_word = ctypes.c_int32.from_address(bar._host_ptr)
    bar._abort_reason, bar._liveness, bar._notify, bar._next_live = None, liveness, "", 0.0
    bar._waiting, bar._logged = {}, set()
    bar._page_lock = threading.RLock()
    bar._test_page = page
    return bar


def _write_record(bar, lane, seq, state, peer, epoch, waited_ns, observed=0):
    from vmmkv.ops import barrier_control as C

    w = (ctypes.c_int32 * 16).from_address(bar._host_ptr + C._CTRL_HEADER_BYTES + 64 * lane)
    w[1:8] = [state, lane, bar.rank, peer, epoch, observed, bar.world]
    w[8], w[9] = waited_ns & 0xFFFFFFFF, waited_ns >> 32
    w[10], w[11] = 10**9, 0
    w[12] = C._DIAG_MAGIC
    w[0] = seq


def test_the_watchdog_aborts_a_wait_past_the_host_timeout_and_breaks_once_it_returned():
    bar = _page_barrier(timeout_s=5.0)
    _write_record(bar, 1, seq=1, state=1, peer=2, epoch=7, waited_ns=10**9)  # odd: being written
    bar._watch(100.0)
    assert bar.read_diagnostic() is None and bar._abort_word.value == 0
    _write_record(bar, 1, seq=2, state=1, peer=2, epoch=7, waited_ns=10**9)  # waiting, 1 s
    bar._watch(100.0)
    rec = bar.read_diagnostic()
    assert (rec.lane, rec.rank, rec.missing_peer, rec.epoch, rec.state) == (1, 1, 2, 7, "waiting")
    assert rec.waited_s == pytest.approx(1.0) and str(rec).startswith(
        "vmmkv barrier timeout: lane=1 rank=1 missing peer=2 epoch=7 observed=0 world=3"
    )  # fmt: skip
    bar._watch(103.9)  # 1 s on the device + 3.9 s seen here: not yet
    assert bar._abort_word.value == 0 and bar.broken is None
    bar._watch(104.1)
    assert bar._abort_word.value == 1 and bar.broken is None  # aborted, the kernel not back yet
    bar.check()  # nothing to raise yet
    _write_record(bar, 1, seq=4, state=3, peer=2, epoch=7, waited_ns=5 * 10**9)  # it returned
    bar._watch(104.2)
    err = bar.broken
    assert err is not None and (err.peer, err.lane, err.epoch) == (2, 1, 7)
    with pytest.raises(Exception, match=r"rank 1 \(cuda:5\): publish: vmmkv barrier aborted "
                       r"\(lane 1 epoch 7, waiting for peer rank 2\): peer rank 2 did not "
                       r"arrive within the barrier timeout of 5 s"):  # fmt: skip
        bar.barrier_args(0)


def test_the_watchdog_aborts_on_a_dead_peer_and_names_it_and_a_passed_wait_breaks_nothing():
    calls = []

    def liveness():
        calls.append(1)
        return (0, "peer rank 0's process (pid 77) is gone") if len(calls) > 1 else None

    bar = _page_barrier(liveness=liveness)
    _write_record(bar, 0, seq=2, state=1, peer=0, epoch=3, waited_ns=2 * 10**9)
    bar._watch(10.0)
    _write_record(bar, 0, seq=4, state=2, peer=0, epoch=3, waited_ns=3 * 10**9)  # passed
    bar._watch(10.2)  # liveness is asked every 0.5 s only
    assert len(calls) == 1 and bar._abort_word.value == 0 and bar.broken is None
    bar._watch(10.6)
    assert len(calls) == 2 and bar._abort_word.value == 1 and bar.broken is None
    _write_record(bar, 0, seq=6, state=3, peer=0, epoch=4, waited_ns=10**6)
    bar._watch(10.7)
    assert "peer rank 0's process (pid 77) is gone" in str(bar.broken)
    assert bar.broken.peer == 0 and bar.broken.epoch == 4


def test_the_watchdog_breaks_the_barrier_when_a_launch_found_its_lane_busy():
    bar = _page_barrier()
    hdr = (ctypes.c_int32 * 4).from_address(bar._host_ptr)
    hdr[1], hdr[2], hdr[3], hdr[0] = 2, 9, 1, 2  # lane 1 (+1), epoch 9, found busy; aborted
    bar._watch(1.0)
    assert bar.broken is not None and bar.broken.lane == 1
    assert "lane 1 was used by two launches at once" in str(bar.broken)
    assert bar._notify.startswith("broke: lane 1 was used")
